"""`Runtime`: a loaded model wired to a paged KV pool, built in one place.

The engine, `ninfer generate` (through the engine), the benches, the memory planner's
profiling step, perplexity and the tests all need the same five things: the KV codec chosen
for the device, the page layout the model's geometry asks for, the store that codec
allocates, the block manager over those pages, and the runner that drives one forward per
step. `build_runtime` makes them from a loaded model and the plugin host; `assemble_runtime`
does the same from a model and a codec object already in hand (tests that build a model
through the plugins alone, a codec a bench names). Wiring them anywhere else is how the five
copies this replaced drifted apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ninfer_core import conformance
from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.model_runner import ModelRunner
from ninfer_core.kv import kv_codec_name
from ninfer_core.kv.layout import KVLayout
from ninfer_core.model.config import ModelConfig
from ninfer_core.plugin_types import KVStore

if TYPE_CHECKING:
    from ninfer_core.device import DeviceInfo
    from ninfer_core.loading import LoadedModel
    from ninfer_core.plugin_host import PluginHost


@dataclass(frozen=True)
class RuntimeSpec:
    """The KV pool a runtime gets: how many pages of how many tokens, which codec, and
    whether full pages are shared between requests (the prefix cache)."""

    num_blocks: int
    block_size: int = 16
    #: `--kv-dtype`: a codec name, or `auto` (the model's compute precision).
    kv_dtype: str = "auto"
    prefix_cache: bool = False

    @classmethod
    def for_tokens(cls, tokens: int, block_size: int = 16, **kw: Any) -> RuntimeSpec:
        """A pool of at least `tokens` token slots."""
        return cls(num_blocks=-(-tokens // block_size), block_size=block_size, **kw)


@dataclass
class Runtime:
    """What runs a model's steps: the codec's name, its store, the pages and the runner."""

    kv_codec: str
    kv_store: KVStore
    block_manager: BlockManager
    runner: ModelRunner

    @property
    def layout(self) -> KVLayout:
        return self.kv_store.layout

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size


def choose_kv_codec(
    host: PluginHost, device: DeviceInfo, kv_dtype: str, compute_dtype: torch.dtype
) -> str:
    """The codec `--kv-dtype` names on `device` (`auto`: the compute precision); a codec the
    device refuses raises `UnsupportedChoiceError` with the alternatives."""
    from ninfer_core.selection import choose

    return choose(host, "kv_codecs", device, kv_codec_name(kv_dtype, compute_dtype)).chosen


def build_runtime(
    loaded: LoadedModel, host: PluginHost, device: DeviceInfo, spec: RuntimeSpec
) -> Runtime:
    """The runtime for `loaded` on `device`, its codec chosen through `host`."""
    name = choose_kv_codec(host, device, spec.kv_dtype, loaded.dtype)
    codec = host.kv_codecs.get(name)
    return assemble_runtime(loaded.model, loaded.config, loaded.dtype, codec, spec, name=name)


def assemble_runtime(
    model: torch.nn.Module,
    config: ModelConfig,
    dtype: torch.dtype,
    codec: Any,
    spec: RuntimeSpec,
    *,
    name: str | None = None,
) -> Runtime:
    """Wire `model` (built for `config`, computing in `dtype`) to a pool encoded by `codec`.

    The store lives on the model's device, so the forward never copies K/V across devices;
    it is checked against the `KVStore` contract before anything runs on it. The prefix
    cache's salt names the codec: pages encoded differently never share a key.
    """
    name = name or codec.name
    layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim,
                      spec.block_size, spec.num_blocks)  # fmt: skip
    where = next(model.parameters()).device
    store = codec.allocate(layout, where, compute_dtype=dtype)
    conformance.check(store, KVStore, f"the KV store codec {name!r} allocated")
    blocks = BlockManager(
        spec.num_blocks, spec.block_size, enable_prefix_cache=spec.prefix_cache,
        salt=f"kv-codec={name}",
    )  # fmt: skip
    return Runtime(name, store, blocks, ModelRunner(model, store, blocks))
