"""The memory plan counts speculative decoding's drafter (`DraftStrategy.memory`).

Each strategy declares, from the artifact's headers alone, what its drafter will hold; the
declarations are checked here against what the drafter it creates actually holds, counted
independently (every tensor and packed weight of the loaded module, the store's bytes),
and the plan is checked to move by exactly those amounts. The MTP layer is the built-in
model's (its `mtp` component); a reduced head is planted in a copy of the random model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer_core import conformance
from ninfer_core.builtin_model import BUILTIN_ARTIFACT, ensure_random_model
from ninfer_core.cli.main import build_parser, main
from ninfer_core.cli.plan_cmd import make_plan
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import GIB, probe_device
from ninfer_core.loading import LoadedModel, load_model
from ninfer_core.memory import (
    AutoCapacityTooSmallError,
    CapacityDoesNotFitError,
    DeviceMemory,
    MemoryPlan,
    MemoryPlanError,
    estimate_workspace,
    plan_memory,
)
from ninfer_core.memory.planner import HEADROOM_FLOOR, MIB
from ninfer_core.memory.table import render_table
from ninfer_core.model.config import ModelConfig
from ninfer_core.plugin_host import create_host
from ninfer_core.plugin_types import DraftStrategy
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.draft_head import TOKEN_IDS, WEIGHT
from ninfer_core.spec.types import DraftMemory, DraftOptions, DraftTarget
from ninfer_plugins.draft_mtp import MTPStrategy
from ninfer_plugins.draft_mtp.weights import QWEN3_NEXT, mtp_plan
from ninfer_plugins.draft_ngram import NgramStrategy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16
PAGES = 8
CPU = ["--device-spec", "cpu"]


@pytest.fixture(scope="module")
def host():
    return create_host()


def held_bytes(module: torch.nn.Module) -> int:
    """Every tensor and packed weight `module` holds, each object once: parameters,
    buffers, and attributes with an integer `nbytes` (quantized and packed weights)."""
    seen: set[int] = set()
    total = 0
    for sub in module.modules():
        for value in (*sub._parameters.values(), *sub._buffers.values(), *vars(sub).values()):
            if value is None or id(value) in seen:
                continue
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif isinstance(getattr(value, "nbytes", None), int):
                total += value.nbytes
            else:
                continue
            seen.add(id(value))
    return total


def _target(loaded: LoadedModel, host, codec: str) -> DraftTarget:
    return DraftTarget(
        artifact=loaded.artifact,
        config=loaded.config,
        model=loaded.model,
        kv_codec=host.kv_codecs.get(codec),
        block_size=BLOCK,
        num_blocks=PAGES,
        device=torch.device("cpu"),
    )


def _load(host, path: Path | str, dtype: str) -> LoadedModel:
    device = probe_device(use_cuda=False)
    return load_model(path, host=host, device=device, runtime=RuntimeConfig(dtype=dtype))


def _ns(*args: str) -> argparse.Namespace:
    return build_parser().parse_args(["plan", *args])


def _plan(*args: str, spec: SpecConfig | None = None) -> MemoryPlan:
    plan, _ = make_plan(_ns("--max-context", "2048", *args), spec)
    return plan


# --------------------------------------------------------------------------
# What the strategies declare, against what their drafters hold
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mtp_declares_the_bytes_its_loaded_layer_holds(host, dtype):
    """The plan's count (headers, the backend's `packed_nbytes`) is the loaded layer's,
    exactly: fp32 dequantizes the Q4/Q5 projections once, bf16 packs Q4 into int4 pairs."""
    plan = _plan(*CPU, "--dtype", dtype, "--kv-dtype", "fp32", "--spec", "mtp")
    target = _target(_load(host, BUILTIN_ARTIFACT, dtype), host, "fp32")
    drafter = MTPStrategy().create(target, DraftOptions())
    assert plan.draft_strategy == "mtp"
    assert plan.draft.weights_bytes == held_bytes(drafter.layer) > 0
    assert plan.draft.table_bytes == drafter.embed_table.nbytes  # the normed-embedding table
    assert plan.draft_bytes == plan.draft.weights_bytes + plan.draft.table_bytes


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "rk8v4", "fp8"])
def test_mtp_declares_the_kv_its_pool_allocates_per_token(host, codec):
    loaded = _load(host, BUILTIN_ARTIFACT, "fp32")
    drafter = MTPStrategy().create(_target(loaded, host, codec), DraftOptions())
    declared = MTPStrategy().memory(
        loaded.artifact, loaded.config, DraftOptions(), torch.float32, host.kv_codecs.get(codec)
    )
    assert declared.kv_bytes_per_token * BLOCK * PAGES == drafter.store.nbytes
    # one attention layer of the target's shape, in the target's codec
    cfg = loaded.config
    per_layer = host.kv_codecs.get(codec).bytes_per_token(1, cfg.num_kv_heads, cfg.head_dim)
    assert declared.kv_bytes_per_token == per_layer


def _mtp_tensors(config, seed: int = 3) -> dict[str, torch.Tensor]:
    """Random MTP tensors under Qwen3-Next names, shaped by the drafter's own plan."""
    gen = torch.Generator().manual_seed(seed)
    plan = mtp_plan(config, QWEN3_NEXT)
    return {s.hf_name: torch.randn(*s.shape, generator=gen) * 0.05 for s in plan}


@pytest.fixture(scope="module")
def head_dir(host, tmp_path_factory) -> Path:
    """The random model with an MTP layer and a 64-row reduced head, as a folder."""
    base = ensure_random_model(tmp_path_factory.mktemp("random") / "model")
    out = tmp_path_factory.mktemp("with-head")
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    config = _load(host, base, "fp32").config
    head = {WEIGHT: torch.randn(64, config.hidden_size), TOKEN_IDS: torch.arange(64.0) * 3}
    tensors = {**load_file(str(base / "model.safetensors")), **_mtp_tensors(config), **head}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_lm_head_draft_adds_the_reduced_heads_weight_and_ids(host, head_dir):
    loaded = _load(host, head_dir, "fp32")
    codec = host.kv_codecs.get("fp32")
    args = (loaded.artifact, loaded.config)

    def declared(options: DraftOptions) -> DraftMemory:
        return MTPStrategy().memory(*args, options, torch.float32, codec)

    plain, reduced = declared(DraftOptions()), declared(DraftOptions(lm_head_draft=True))
    drafter = MTPStrategy().create(_target(loaded, host, "fp32"), DraftOptions(lm_head_draft=True))
    head = drafter.head
    hidden = loaded.config.hidden_size
    assert reduced.weights_bytes - plain.weights_bytes == head.weight.nbytes == 64 * hidden * 4
    assert reduced.table_bytes - plain.table_bytes == head.token_ids.nbytes == 64 * 8
    assert reduced.kv_bytes_per_token == plain.kv_bytes_per_token
    assert plain.weights_bytes == held_bytes(drafter.layer)


def test_ngram_declares_nothing(host):
    loaded = _load(host, BUILTIN_ARTIFACT, "fp32")
    options = DraftOptions(num_tokens=8)
    declared = NgramStrategy().memory(
        loaded.artifact, loaded.config, options, torch.float32, host.kv_codecs.get("fp16")
    )
    assert declared == DraftMemory() and declared.fixed_bytes == 0


@pytest.mark.parametrize("strategy", [MTPStrategy(), NgramStrategy()], ids=lambda s: s.name)
def test_both_strategies_keep_the_grown_contract(strategy):
    conformance.check(strategy, DraftStrategy, f"draft strategy {strategy.name!r}")


def test_a_strategy_without_memory_is_refused_naming_it():
    class Old:
        name, description = "old-draft", "written before `memory`"

        def supports(self, device):
            return True

        def supports_model(self, target, options):
            return True

        def create(self, target, options):
            raise NotImplementedError

    assert "no memory" in conformance.problems(Old(), DraftStrategy)


# --------------------------------------------------------------------------
# The plan moves by exactly what the drafter holds
# --------------------------------------------------------------------------

GPU = ["--device-spec", "rtx3090", "--kv-dtype", "fp16", "--max-concurrency", "2"]


def test_auto_capacity_gives_the_drafter_its_share_exactly():
    auto = (*GPU, "--kv-capacity", "auto")
    base, spec = _plan(*auto), _plan(*auto, "--spec", "mtp")
    draft = spec.draft
    assert base.draft is None and draft.weights_bytes > 0 and draft.kv_bytes_per_token > 0
    # everything else alike: the memory left for the pool, and the target's page cost
    left = base.memory.free - (base.weights_bytes + base.workspace.nbytes + base.headroom_bytes)
    page = BLOCK * base.kv_bytes_per_token
    assert base.largest_fit_tokens == left // page * BLOCK
    draft_page = BLOCK * draft.kv_bytes_per_token
    assert spec.largest_fit_tokens == (left - draft.fixed_bytes) // (page + draft_page) * BLOCK
    assert spec.largest_fit_tokens < base.largest_fit_tokens
    assert spec.pool_tokens == spec.largest_fit_tokens  # auto takes all that fits
    assert spec.free_after_bytes >= spec.headroom_bytes


def test_an_explicit_capacity_uses_exactly_the_drafters_bytes_more():
    fixed = (*GPU, "--kv-capacity", "4096")
    base, spec = _plan(*fixed), _plan(*fixed, "--spec", "mtp")
    assert spec.pool_tokens == base.pool_tokens == 4096
    draft = spec.draft
    assert spec.draft_kv_bytes == 4096 * draft.kv_bytes_per_token
    assert spec.used_bytes - base.used_bytes == draft.fixed_bytes + spec.draft_kv_bytes
    assert spec.pool_bytes == base.pool_bytes  # the target's own pool is unchanged


def test_ngram_leaves_the_plan_as_it_was():
    auto = (*GPU, "--kv-capacity", "auto")
    base, spec = _plan(*auto), _plan(*auto, "--spec", "ngram")
    assert spec.draft == DraftMemory() and spec.draft_strategy == "ngram"
    assert (spec.largest_fit_tokens, spec.used_bytes) == (base.largest_fit_tokens, base.used_bytes)
    assert "--spec ngram: no weights, no per-token K/V" in render_table(spec)


def test_serve_passes_its_own_spec_config():
    """`ninfer-serve` hands `make_plan` its `SpecConfig`; the namespace's is not read."""
    plan = _plan(*GPU, spec=SpecConfig(spec="mtp", draft_tokens=4))
    assert plan.draft_strategy == "mtp" and plan.draft.weights_bytes > 0


def test_the_table_and_json_show_the_drafter(capsys):
    assert main(["plan", *GPU, "--spec", "mtp", "--kv-capacity", "4096"]) == 0
    out = capsys.readouterr().out
    weights = next(line for line in out.splitlines() if line.startswith("draft weights"))
    kv = next(line for line in out.splitlines() if line.startswith("draft K/V"))
    assert "--spec mtp: own weights" in weights and "tables" in weights
    assert "4096 tokens x 512 bytes, in the KV pool's pages (2.0 MiB)" in kv
    assert "(with the drafter's K/V)" in out
    plan = _plan(*GPU, "--spec", "mtp", "--kv-capacity", "4096")
    data = plan.to_json()
    assert data["draft"] == {
        "weights_bytes": plan.draft.weights_bytes,
        "table_bytes": plan.draft.table_bytes,
        "kv_bytes_per_token": 512,
    }  # the DraftMemory, as `dataclasses.asdict` writes it
    assert data["draft_kv_bytes"] == 4096 * 512 and data["draft_bytes"] == plan.draft_bytes
    assert "draft" not in render_table(_plan(*GPU))  # no rows without speculation


# --------------------------------------------------------------------------
# The target fits; target and drafter do not
# --------------------------------------------------------------------------

FP16_PER_LAYER = 8 * 128 * 2 * 2  # K and V of 8 heads of 128 in fp16
DRAFT = DraftMemory(
    weights_bytes=400 * MIB, table_bytes=16 * MIB, kv_bytes_per_token=FP16_PER_LAYER
)


def _fits(host, free: int, draft: DraftMemory | None, capacity) -> MemoryPlan:
    """The plan of an 8-layer model with 1 GiB of weights on `free` bytes of an idle card."""
    raw = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 1000,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000,
        "torch_dtype": "float16",
    }
    cfg = ModelConfig.from_hf(raw, qk_norm=True)
    codec = host.kv_codecs.get("fp16")
    ws = estimate_workspace(
        cfg, dtype=torch.float16, kv_codec=codec, prefill_chunk=512, context=16384, concurrency=1
    )
    return plan_memory(
        cfg,
        weights_bytes=GIB,
        codec=codec,
        memory=DeviceMemory("a small card", free, free, "test"),
        workspace=ws,
        max_context=16384,
        kv_capacity=capacity,
        draft=draft,
        draft_strategy="mtp" if draft else "",
    )


@pytest.mark.parametrize("capacity", [16384, "auto"])
def test_a_target_that_fits_alone_is_refused_with_its_drafter(host, capacity):
    alone = _fits(host, 4 * GIB, None, 16384)
    # exactly the target's need, and 1 MiB to spare: the drafter's 416 MiB do not fit
    free = alone.used_bytes + alone.headroom_bytes + (1 << 20)
    assert _fits(host, free, None, capacity).pool_tokens >= 16384
    error = CapacityDoesNotFitError if capacity != "auto" else AutoCapacityTooSmallError
    with pytest.raises(error) as info:
        _fits(host, free, DRAFT, capacity)
    assert "draft weights 0.41" in str(info.value)
    if capacity != "auto":
        assert info.value.largest_fit < 16384
        assert "KV pool with the drafter's K/V" in str(info.value)


def test_serve_startup_stops_at_the_plan_when_the_drafter_does_not_fit():
    """`make_plan` (what `ninfer-serve` runs first) on a budget the target alone fits."""
    alone = _plan(*GPU)
    # the target's need with the 256 MiB headroom floor, and 1 MiB to spare: the drafter's
    # 0.7 MiB of weights, 2 MiB of table and 1 MiB of K/V do not fit
    budget = (alone.used_bytes + HEADROOM_FLOOR + MIB) / GIB
    args = (*GPU, "--memory-budget", f"{budget:.9f}", "--memory-headroom", "0")
    assert _plan(*args).pool_tokens == 2048
    with pytest.raises(MemoryPlanError, match="draft weights"):
        _plan(*args, spec=SpecConfig(spec="mtp"))


def test_plan_refuses_mtp_for_a_model_without_the_layer(tmp_path, capsys):
    folder = ensure_random_model(tmp_path / "model")
    assert main(["plan", str(folder), "--spec", "mtp"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ninfer plan: error: --spec mtp: ") and "no MTP layer" in line
    assert "--spec ngram" in line


def test_plan_takes_the_spec_options_and_checks_them(capsys):
    assert main(["plan", "--draft-tokens", "3"]) == 1
    assert "--draft-tokens needs --spec" in capsys.readouterr().err
    assert main(["plan", "--spec", "nope"]) == 1
    err = capsys.readouterr().err
    assert "nope" in err and "mtp" in err and "ngram" in err
