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

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ninfer_core import conformance
from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.compiled_step import CompiledDecode, capture_refusal
from ninfer_core.engine.model_runner import ModelRunner
from ninfer_core.engine.state_snapshots import StateSnapshots
from ninfer_core.kv import kv_codec_name
from ninfer_core.kv.layout import KVLayout
from ninfer_core.kv.state import SequenceStatePool
from ninfer_core.memory import huge_pages
from ninfer_core.model.caches import ModelCaches, caches_for, dense_caches
from ninfer_core.model.config import ModelConfig
from ninfer_core.plugin_types import KVStore

if TYPE_CHECKING:
    from ninfer_core.device import DeviceInfo
    from ninfer_core.loading import LoadedModel
    from ninfer_core.plugin_host import PluginHost


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeSpec:
    """The KV pool a runtime gets: how many pages of how many tokens, which codec, and
    whether full pages are shared between requests (the prefix cache)."""

    num_blocks: int
    block_size: int = 16
    #: `--kv-dtype`: a codec name, or `auto` (the model's compute precision).
    kv_dtype: str = "auto"
    prefix_cache: bool = False
    #: Sequences that run at once (`--max-concurrency`): the slots of the per-sequence
    #: state pool, for a model whose family declares state layers.
    max_sequences: int = 1
    #: `--compile-decode`: run decode steps (up to `max_sequences`) through `torch.compile`
    #: (`engine/compiled_step.py`) where the model, kernels and store allow it.
    compile_decode: bool = False
    #: A model with state layers: the state snapshots its prefix cache keeps (0: none,
    #: and no prefix cache), and the tokens between two snapshots of a long prompt.
    state_snapshots: int = 0
    snapshot_interval: int = 1024

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
    #: What each layer keeps (paged K/V or a per-sequence state), as the family declared.
    caches: ModelCaches
    #: The per-sequence states of the state layers; None when every layer is paged.
    states: SequenceStatePool | None = None
    #: The prefix cache's state snapshots (state layers and the prefix cache on), or None.
    snapshots: StateSnapshots | None = None

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
    from ninfer_core.kernels.compose import check_kv_codec

    name = choose_kv_codec(host, device, spec.kv_dtype, loaded.dtype)
    codec = host.kv_codecs.get(name)
    # Attention was composed at load for the codec `--kv-dtype` named then.
    check_kv_codec(host, device, loaded.kernels, loaded.workload, name)
    caches = caches_for(loaded.family, loaded.config)
    return assemble_runtime(
        loaded.model, loaded.config, loaded.dtype, codec, spec, name=name, caches=caches
    )


def store_tensors(store: KVStore, layers: int) -> list[torch.Tensor]:
    """The pools under a store's pages (`raw_pages`, which it must offer), per layer."""
    out: list[torch.Tensor] = []
    for layer in range(layers):
        pages = store.raw_pages(layer)
        for pool in (pages.k, pages.v):
            out.extend(t for t in (pool.values, pool.scales) if t is not None)
    return out


def assemble_runtime(
    model: torch.nn.Module,
    config: ModelConfig,
    dtype: torch.dtype,
    codec: Any,
    spec: RuntimeSpec,
    *,
    name: str | None = None,
    caches: ModelCaches | None = None,
) -> Runtime:
    """Wire `model` (built for `config`, computing in `dtype`) to a pool encoded by `codec`.

    `caches`: what each layer keeps, as its family declares (None: paged K/V in every
    layer). The pool holds the paged layers only; the state layers get a
    `SequenceStatePool` of `spec.max_sequences` slots. A prefix found in the cache would
    skip the tokens that build a state, so for such a model the prefix cache resumes only
    from `spec.state_snapshots` state snapshots (`state_snapshots.py`), and is off when
    that is 0.

    The store lives on the model's device, so the forward never copies K/V across devices;
    it is checked against the `KVStore` contract before anything runs on it. The prefix
    cache's salt names the codec: pages encoded differently never share a key.
    """
    name = name or codec.name
    caches = caches or dense_caches(config)
    kv = caches.kv_geometry
    if kv is None:
        raise ValueError("a model without any paged K/V layer is not supported yet")
    layout = KVLayout(len(caches.paged_layers), kv.num_kv_heads, kv.head_dim,
                      spec.block_size, spec.num_blocks)  # fmt: skip
    where = next(model.parameters()).device
    store = codec.allocate(layout, where, compute_dtype=dtype)
    conformance.check(store, KVStore, f"the KV store codec {name!r} allocated")
    if where.type == "cpu" and store.raw_pages is not None:  # pages read in place
        log.info(huge_pages.collapse(store_tensors(store, layout.num_layers)).describe("K/V"))
    states = SequenceStatePool(caches, spec.max_sequences, where) if caches.has_state else None
    cached = spec.prefix_cache and (states is None or spec.state_snapshots > 0)
    blocks = BlockManager(
        spec.num_blocks, spec.block_size, enable_prefix_cache=cached, salt=f"kv-codec={name}"
    )
    snapshots = None
    if cached and states is not None:
        snapshots = StateSnapshots(
            spec.state_snapshots, spec.snapshot_interval, blocks, states, store
        )
    compiled = None
    if spec.compile_decode:
        refusal = capture_refusal(model, store)
        if refusal is None:
            compiled = CompiledDecode(model, store, spec.block_size, spec.max_sequences, states)
        else:
            log.warning("--compile-decode: decoding eagerly: %s", refusal)
    runner = ModelRunner(model, store, blocks, states, compiled)
    return Runtime(name, store, blocks, runner, caches, states, snapshots)
