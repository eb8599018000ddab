"""The memory planner: hand-computed Qwen3-8B figures, `--kv-capacity auto`, early errors,
the artifact path, the workspace estimate against a real step, and `ninfer plan`."""

from __future__ import annotations

import json
import struct
import weakref
from pathlib import Path

import pytest
import torch
from checkpoints import write_tiny_qwen3
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import GIB, probe_device, simulated_device
from ninfer_core.loading import load_model, open_artifact
from ninfer_core.memory import (
    AutoCapacityTooSmallError,
    CapacityBelowContextError,
    CapacityDoesNotFitError,
    DeviceMemory,
    MemoryPlanError,
    device_memory,
    estimate_workspace,
    kv_layers,
    measure_workspace,
    parse_kv_capacity,
    plan_memory,
    weights_bytes,
)
from ninfer_core.memory.planner import mem_available
from ninfer_core.memory.table import render_table
from ninfer_core.memory.workspace import Workspace, profiling_runtime, run_profiling_step
from ninfer_core.model.caches import ModelCaches, PagedKV, SequenceState, StateTensor, dense_caches
from ninfer_core.model.config import ModelConfig
from ninfer_core.model.ops import decode_length
from ninfer_core.model.weights import weight_plan
from ninfer_core.plugin_host import create_host

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    # the long-context configuration the deployment guide serves at --max-context 184320
    # (the plan sizes min(--max-context, this), as the engine does)
    "max_position_embeddings": 196608,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
CFG = ModelConfig.from_hf(QWEN3_8B, qk_norm=True)
#: Parameters, by hand: embedding and untied head, then per layer q, k, v, o, gate, up,
#: down, two RMSNorms of 4096 and q/k norms of 128, then the final norm.
PARAMS = (
    2 * 151936 * 4096
    + 36 * (4096 * 4096 * 2 + 1024 * 4096 * 2 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128)
    + 4096
)
RTX3090 = DeviceMemory("rtx3090", 24 * GIB, 23 * GIB, "free GPU memory")


@pytest.fixture(scope="module")
def host():
    return create_host()


@pytest.fixture(scope="module")
def qwen3_8b_folder(tmp_path_factory) -> Path:
    """A Qwen3-8B-shaped model folder: real config and safetensors header, no weights.

    The data region is a sparse file (a truncate, not 16 GB written): the reader checks
    offsets against the file size, and planning never reads tensor data.
    """
    path = tmp_path_factory.mktemp("qwen3-8b")
    (path / "config.json").write_text(json.dumps(QWEN3_8B))
    header, offset = {}, 0
    for slot in weight_plan(CFG):
        size = 2 * slot.shape[0] * (slot.shape[1] if len(slot.shape) > 1 else 1)
        header[slot.hf_name] = {
            "dtype": "BF16",
            "shape": list(slot.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    with open(path / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)
    return path


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return write_tiny_qwen3(
        tmp_path_factory.mktemp("tiny"), head_dim=64, max_position_embeddings=4096
    )


def workspace_by_hand(s: int, keys: int | None = None) -> int:
    """The estimate for Qwen3-8B, fp16, rk8v4, a 1024-token step of 2 sequences at `s`,
    attention gathering its context (the torch ops on a GPU; the CPU's decode rows read
    the pages in place); `keys`: what the decode row gathers, its context padded to
    `decode_length`."""
    t, q, c = 1024, 1023, 2  # tokens, the prefill chunk's queries, bytes per fp16
    gathered = (keys or s) * 8 * 128  # one sequence's K (or V): [Hkv, S, D]
    step = 2 * t * 4096 * c + q * s + t * 128 * c  # residual stream, bool mask, RoPE
    attention = (
        t * 4096 * c  # normed input
        + t * (32 + 16) * 128 * c  # qkv
        + 3 * t * (32 + 8) * 128 * c  # normed and rotated q, k
        + gathered * (2 * c + 12)  # K and V in fp16, decode scratch
        + 2 * gathered * c  # the previous sequence's K and V
        + q * s * c  # SDPA's additive mask
        + 2 * t * 32 * 128 * c  # outputs, concatenated
    )
    return step + attention


def in_place_by_hand() -> int:
    """The estimate for Qwen3-8B, fp16, rk8v4, a 1024-token step of 2 sequences at 32768,
    when attention reads the pages in place (Triton's `attention_scratch`): the attention
    stage holds no context, only the output, the rotations of a rotated store and the
    split-KV partials of the one decode row."""
    t, c, d = 1024, 2, 128
    step = 2 * t * 4096 * c + t * d * c  # residual stream, RoPE; no mask
    values = t * 32 * d
    parts = decode_length(32768, 16) // 256
    scratch = values * c + 2 * values * (4 + c) + 2 * values * 4 + parts * 32 * (d + 2) * 4
    attention = t * 4096 * c + t * 48 * d * c + 3 * t * 40 * d * c + scratch + 16 * t
    mlp = 2 * t * 4096 * c + 4 * t * 12288 * c
    return step + max(attention, mlp)


def plan_8b(host, memory=RTX3090, in_place=False, **kw):
    """`in_place`: attention as the Triton backend runs it (the plan of a simulated GPU)."""
    codec = host.kv_codecs.get(kw.pop("kv", "rk8v4"))
    ctx = kw.pop("max_context", 32768)
    scratch = host.kernel_backends.get("triton").attention_scratch if in_place else None
    ws = estimate_workspace(
        CFG, dtype=torch.float16, kv_codec=codec, prefill_chunk=1024, context=ctx,
        concurrency=2, attention_scratch=scratch, device_kind="cuda",
    )  # fmt: skip
    return plan_memory(
        CFG,
        weights_bytes=weights_bytes(CFG, torch.float16),
        weights_dtype="fp16",
        codec=codec,
        memory=memory,
        workspace=ws,
        max_context=ctx,
        max_concurrency=2,
        **kw,
    )


def test_qwen3_8b_figures_match_a_hand_computation(host):
    assert PARAMS == 8_190_735_360
    assert weights_bytes(CFG, torch.float16) == PARAMS * 2 == 16_381_470_720
    layers = kv_layers(dense_caches(CFG), host.kv_codecs.get("rk8v4"))
    # Per layer and token: 8 KV heads x (K int8 128 + 2 scales x 2) + (V int4 64 + 4) bytes.
    assert [(x.layer, x.bytes_per_token) for x in layers] == [
        (i, 8 * (132 + 68)) for i in range(36)
    ]
    shape = dict(dtype=torch.float16, kv_codec=host.kv_codecs.get("rk8v4"),
                 prefill_chunk=1024, context=32768, concurrency=2)  # fmt: skip
    ws = estimate_workspace(CFG, **shape, device_kind="cuda")
    assert ws.nbytes == workspace_by_hand(32768) == 857_899_008
    # On the CPU the decode row reads the rk8v4 pages in place: only the prefill gathers.
    assert estimate_workspace(CFG, **shape).nbytes < ws.nbytes
    plan = plan_8b(host, kv_capacity=40000)
    assert plan.kv_bytes_per_token == 57_600
    assert plan.pool_pages == 2500 and plan.pool_tokens == 40000  # 40000 / 16 exactly
    assert plan.pool_bytes == 40000 * 57_600
    assert plan.headroom_bytes == int(23 * GIB * 0.03) == 740_881_858
    assert plan.free_after_bytes == 23 * GIB - 16_381_470_720 - 40000 * 57_600 - 857_899_008
    assert plan.kv_capacity == 40000


def test_explicit_capacity_rounds_up_to_whole_pages(host):
    plan = plan_8b(host, kv_capacity=40001, block_size=16)
    assert plan.pool_pages == 2501 and plan.pool_tokens == 40016


def test_auto_on_a_simulated_rtx3090_takes_what_is_left(host):
    plan = plan_8b(host, kv_capacity="auto")
    left = 23 * GIB - 16_381_470_720 - 857_899_008 - 740_881_858
    assert plan.pool_pages == left // (16 * 57_600) == 7287
    assert plan.pool_tokens == 116_592 == plan.largest_fit_tokens
    # Everything not planned is the headroom plus less than one page.
    assert 0 <= plan.free_after_bytes - plan.headroom_bytes < 16 * 57_600


def test_explicit_capacity_that_does_not_fit_names_the_largest_that_does(host):
    plan_8b(host, kv_capacity=116_592)  # the largest fits exactly
    with pytest.raises(CapacityDoesNotFitError) as err:
        plan_8b(host, kv_capacity=116_593)
    assert err.value.largest_fit == 116_592
    need = 16_381_470_720 + 7288 * 16 * 57_600 + 857_899_008 + 740_881_858
    assert str(err.value).startswith(
        f"--kv-capacity 116593 needs {need / GIB:.2f} GiB, 23.00 GiB free; "
        "the largest that fits is 116592 tokens ("
    )


def test_capacity_below_max_context_fails_before_any_memory_math(host):
    with pytest.raises(CapacityBelowContextError) as err:
        plan_8b(host, kv_capacity=16384, max_context=32768)
    assert str(err.value) == "--kv-capacity 16384 is smaller than --max-context 32768"


def test_auto_that_leaves_less_than_max_context_fails(host):
    with pytest.raises(AutoCapacityTooSmallError) as err:
        plan_8b(host, kv_capacity="auto", max_context=184320)
    assert err.value.tokens < 184320
    assert "fewer than --max-context 184320" in str(err.value)


def test_headroom_is_a_fraction_with_a_floor(host):
    small = DeviceMemory("cpu", 64 * GIB, 2 * GIB, "test")
    codec = host.kv_codecs.get("fp16")
    cfg = ModelConfig.from_hf({**QWEN3_8B, "num_hidden_layers": 2}, qk_norm=True)
    ws = estimate_workspace(cfg, dtype=torch.float16, kv_codec=codec, prefill_chunk=64, context=64)
    kw = dict(weights_bytes=0, codec=codec, workspace=ws, max_context=64)
    assert plan_memory(cfg, memory=small, **kw).headroom_bytes == 256 << 20  # 3% is 61 MiB
    big = DeviceMemory("h200", 141 * GIB, 139 * GIB, "test")
    assert plan_memory(cfg, memory=big, **kw, headroom_fraction=0.05).headroom_bytes == int(
        139 * GIB * 0.05
    )


def hybrid_caches() -> ModelCaches:
    """Qwen3-Next-shaped: three linear-attention layers (a conv and a recurrent state per
    sequence) to each full-attention layer."""
    state = SequenceState((
        StateTensor("conv", (3, 8192), torch.bfloat16),
        StateTensor("recurrent", (32, 128, 128), torch.float32),
    ))  # fmt: skip
    kv = PagedKV(8, 128)
    return ModelCaches((state, state, state, kv) * 9)


def test_hybrid_state_layers_cost_per_sequence_not_per_token(host):
    layers = kv_layers(hybrid_caches(), host.kv_codecs.get("fp16"))
    assert sum(x.bytes_per_token for x in layers) == 9 * 2 * 8 * 128 * 2
    assert [x.kind for x in layers[:4]] == ["state", "state", "state", "paged"]
    per_seq = 2 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)  # both buffers of kv/state.py
    assert [x.bytes_per_sequence for x in layers[:4]] == [per_seq] * 3 + [0]


def test_plan_counts_state_bytes_times_max_concurrency(host):
    ws = estimate_workspace(
        CFG, dtype=torch.float16, kv_codec=host.kv_codecs.get("fp16"),
        prefill_chunk=1024, context=8192, concurrency=3,
    )  # fmt: skip
    memory = DeviceMemory("card", 80 * GIB, 80 * GIB, "test")
    kw = dict(weights_bytes=GIB, codec=host.kv_codecs.get("fp16"), memory=memory,
              workspace=ws, max_context=8192, max_concurrency=3)  # fmt: skip
    dense = plan_memory(CFG, **kw)
    hybrid = plan_memory(CFG, **kw, caches=hybrid_caches())
    per_seq = 27 * 2 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    assert hybrid.state_bytes_per_sequence == per_seq
    assert hybrid.state_bytes == 3 * per_seq
    assert hybrid.used_bytes == GIB + hybrid.pool_bytes + 3 * per_seq + ws.nbytes
    assert dense.state_bytes == 0
    assert hybrid.kv_bytes_per_token * 4 == dense.kv_bytes_per_token  # 9 of 36 layers paged
    table = render_table(hybrid)
    assert "sequence states" in table and "27 keep" in table


def test_kv_capacity_parsing():
    assert parse_kv_capacity("auto") == "auto"
    assert parse_kv_capacity("184320") == 184320
    assert parse_kv_capacity(None) is None
    for bad in ("0", "-5", "lots"):
        with pytest.raises(MemoryPlanError):
            parse_kv_capacity(bad)


def test_cpu_memory_is_mem_available_capped_by_the_budget(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8388608 kB\n")
    assert mem_available(str(meminfo)) == 8 * GIB
    monkeypatch.setattr("ninfer_core.memory.planner.mem_available", lambda: 8 * GIB)
    cpu = probe_device(use_cuda=False)
    assert device_memory(cpu).free == 8 * GIB
    capped = device_memory(cpu, memory_budget=2.5)
    assert capped.free == int(2.5 * GIB) and "--memory-budget 2.5 GiB" in capped.source
    assert device_memory(cpu, memory_budget=64).free == 8 * GIB  # a cap, never a raise
    gpu = device_memory(simulated_device("rtx3090"))
    assert (gpu.total, gpu.free) == (24 * GIB, 23 * GIB)


def test_weights_from_the_artifact_are_what_the_runtime_holds(host, tiny_folder):
    artifact = open_artifact(host, tiny_folder)
    cfg = host.family_for("Qwen3ForCausalLM").parse_config(artifact.config)
    loaded = load_model(
        tiny_folder, host=host, device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype="fp32"),
    )  # fmt: skip
    held = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert weights_bytes(cfg, torch.float32, artifact=artifact) == held
    assert weights_bytes(cfg, torch.bfloat16, artifact=artifact) == held // 2


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages ops create while the mode is on (not `known` ones)."""

    def __init__(self, known) -> None:
        super().__init__()
        self.ignore = {t.untyped_storage().data_ptr() for t in known}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.ignore or not storage.nbytes():
                continue
            if key not in self.refs:
                self.refs[key], self.sizes[key] = 0, storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self.refs[key] += 1
            weakref.finalize(t, self._drop, key)
        return out


def _tensors(*objs):
    for obj in objs:
        for value in vars(obj).values():
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, torch.Tensor) and v.layout == torch.strided:
                    yield v


@pytest.mark.parametrize("codec", ["rk8v4", "bf16", "fp16"])
def test_workspace_estimate_bounds_a_real_profiling_step(host, tiny_folder, codec):
    """The estimate covers what a real step allocates (counted op by op), without
    overshooting by much; if the backend's memory use changes, this fails."""
    loaded = load_model(
        tiny_folder, host=host, device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype="bf16"),
    )  # fmt: skip
    kv = host.kv_codecs.get(codec)
    runtime = profiling_runtime(loaded, host, probe_device(use_cuda=False), kv_dtype=codec,
                                block_size=16, prefill_chunk=128)  # fmt: skip
    store, runner = runtime.kv_store, runtime.runner
    known = [*_tensors(store, *loaded.model.modules()), *loaded.model.parameters()]
    with LiveBytes(known) as mode:
        logits = run_profiling_step(runner, 128, 2048, 2)
    assert logits.shape == (2, loaded.config.vocab_size) and torch.isfinite(logits).all()
    estimate = measure_workspace(runner, 128, context=2048, concurrency=2)  # CPU: the estimate
    assert estimate.method == "estimate"
    assert estimate == estimate_workspace(
        loaded.config, dtype=loaded.dtype, kv_codec=kv, prefill_chunk=128, context=2048,
        concurrency=2,
    )  # fmt: skip
    assert mode.peak <= estimate.nbytes <= 1.5 * mode.peak, (mode.peak, estimate.parts)


# -- `ninfer plan` ---------------------------------------------------------------------------

ISSUE_ARGS = ["--device-spec", "rtx3090", "--max-context", "184320", "--kv-dtype", "rk8v4",
              "--max-concurrency", "2"]  # fmt: skip


def test_plan_cli_table(qwen3_8b_folder, capsys, host):
    args = ["plan", str(qwen3_8b_folder), *ISSUE_ARGS[:2], "--max-context", "32768",
            "--kv-dtype", "rk8v4", "--max-concurrency", "2", "--kv-capacity", "auto"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"plan for {qwen3_8b_folder} (Qwen3ForCausalLM) on NVIDIA GeForce RTX 3090 "
        "(SM86, simulated)"
    )
    assert out[1] == "KV codec rk8v4: 57600 bytes/token (36 layers x 1600)"
    rows = {line[:22].strip(): line[22:].split() for line in out[4:] if "GiB" in line}
    assert rows["weights"][:2] == ["15.26", "GiB"]
    left = 23 * GIB - 16_381_470_720 - in_place_by_hand() - 740_881_858
    assert rows["KV pool"][2:4] == [str(left // (16 * 57_600) * 16), "tokens"]
    assert rows["activation workspace"][0] == f"{in_place_by_hand() / GIB:.2f}"
    assert rows["reserved headroom"][0] == "0.69"
    assert rows["total"][:2] == ["23.00", "GiB"]
    memory = device_memory(simulated_device("rtx3090"))
    want = plan_8b(host, memory=memory, in_place=True, kv_capacity="auto")
    assert "\n".join(out[1:]) == render_table(want)


def test_plan_for_a_recipe_counts_the_converted_sizes(qwen3_8b_folder, capsys):
    """`--recipe q4` on a bf16 folder: every matrix at 4 bits plus an fp16 scale per 64
    weights, every 1-D tensor at fp16, counted from the folder's safetensors header."""
    with open(qwen3_8b_folder / "model.safetensors", "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    want = 0
    for entry in header.values():
        shape = entry["shape"]
        if len(shape) == 2:
            want += shape[0] * shape[1] // 2 + shape[0] * (shape[1] // 64) * 2
        else:
            want += shape[0] * 2
    args = ["plan", str(qwen3_8b_folder), "--device-spec", "rtx3090", "--max-context", "32768",
            "--json"]  # fmt: skip
    assert main([*args, "--recipe", "q4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weights_bytes"] == want and data["weights_dtype"] == "fp16, q4 recipe"
    assert main([*args, "--recipe", "bf16"]) == 0  # dense: as without a recipe
    assert json.loads(capsys.readouterr().out)["weights_bytes"] == 16_381_470_720
    assert main([*args, "--recipe", "q3"]) == 1
    assert "known quantization recipes: bf16, mixed, q4, q6, w8" in capsys.readouterr().err


def test_plan_cli_json(qwen3_8b_folder, capsys, host):
    args = ["plan", str(qwen3_8b_folder), "--device-spec", "rtx3090", "--max-context", "32768",
            "--kv-dtype", "rk8v4", "--max-concurrency", "2", "--kv-capacity", "40000",
            "--json"]  # fmt: skip
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["architecture"] == "Qwen3ForCausalLM"
    assert data["weights_bytes"] == 16_381_470_720 and data["weights_dtype"] == "fp16"
    assert data["kv_codec"] == "rk8v4" and data["kv_bytes_per_token"] == 57_600
    assert len(data["kv_layers"]) == 36 and data["kv_layers"][0]["bytes_per_token"] == 1600
    assert (data["pool_tokens"], data["pool_pages"], data["kv_capacity"]) == (40000, 2500, 40000)
    # Triton's attention on the simulated card reads the pages in place: no gathered copy.
    assert data["workspace"]["nbytes"] == in_place_by_hand() == 163_889_152
    assert data["workspace"]["method"] == "estimate"
    assert data["memory"]["free"] == 23 * GIB
    want = plan_8b(host, in_place=True, kv_capacity=40000)
    assert data["free_after_bytes"] == want.free_after_bytes


def test_plan_cli_issue_command_says_what_fits(qwen3_8b_folder, capsys):
    """Qwen3-8B in fp16 weights (15.3 GiB) and 184320 tokens of rk8v4 do not fit on 23 GiB."""
    assert main(["plan", str(qwen3_8b_folder), *ISSUE_ARGS, "--recipe", "none"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("ninfer plan: error: --kv-capacity 184320 needs ")
    assert ", 23.00 GiB free; the largest that fits is " in line
    assert "less than --max-context 184320" in line


def test_recipe_auto_quantizes_only_what_does_not_fit(qwen3_8b_folder, capsys):
    """`--recipe auto` (the default): fp16 where it fits (32K above), else the weights as
    `--recipe mixed` holds them, said in the weights row; `--recipe mixed` asked for plans
    the same bytes whether or not fp16 fits."""
    args = ["plan", str(qwen3_8b_folder), *ISSUE_ARGS, "--json"]
    assert main(args) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["weights_dtype"] == "fp16, mixed recipe (--recipe auto: fp16 did not fit)"
    assert main([*args, "--recipe", "mixed"]) == 0
    mixed = json.loads(capsys.readouterr().out)
    assert mixed["weights_dtype"] == "fp16, mixed recipe"
    assert auto["weights_bytes"] == mixed["weights_bytes"] < 16_381_470_720 / 3
    small = ["plan", str(qwen3_8b_folder), "--device-spec", "rtx3090", "--json"]
    assert main(small) == 0
    assert json.loads(capsys.readouterr().out)["weights_dtype"] == "fp16"


def test_plan_cli_refuses_fp8_on_sm86_in_one_line(qwen3_8b_folder, capsys):
    args = ["plan", str(qwen3_8b_folder), "--device-spec", "rtx3090", "--kv-dtype", "fp8"]
    assert main(args) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ninfer plan: error: --kv-dtype fp8: ")
    assert "fp8 KV needs SM89 or newer (this GPU is SM86); use --kv-dtype int8 or rk8v4" in line


def test_plan_cli_on_the_cpu_counts_a_packed_tied_head(tiny_folder, capsys, host):
    from ninfer_core.kernels.cpu_gemv import GemvLinear
    from ninfer_plugins.backend_torch import TorchOps

    args = ["plan", str(tiny_folder), "--device-spec", "cpu", "--dtype", "bf16", "--json",
            "--max-context", "256", "--memory-budget", "1"]  # fmt: skip
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    cfg = host.family_for("Qwen3ForCausalLM").parse_config(json.loads(
        (tiny_folder / "config.json").read_text()))  # fmt: skip
    # A copy of the head where the backend reorders it (oneDNN), none where it keeps the
    # loaded matrix (the AVX512-BF16 GEMV): measured on the packed object itself.
    probe = torch.zeros(2, 2, dtype=torch.bfloat16)
    packed = TorchOps("cpu").pack_linear(probe)
    kept = packed is probe or (
        isinstance(packed, GemvLinear) and packed.weight.data_ptr() == probe.data_ptr()
    )
    head = cfg.vocab_size * cfg.hidden_size * 2
    assert data["weights_bytes"] == weights_bytes(cfg, torch.bfloat16) + (0 if kept else head)
    assert data["memory"]["free"] <= GIB and data["kv_codec"] == "bf16"


def test_workspace_counts_the_decode_rows_padded_context(host):
    """A decode row at 184320 tokens gathers 196608 keys (`decode_length`, issue 13 item 5),
    so the estimate counts those, not the context."""
    codec = host.kv_codecs.get("rk8v4")
    ws = estimate_workspace(
        CFG, dtype=torch.float16, kv_codec=codec, prefill_chunk=1024, context=184320,
        concurrency=2, device_kind="cuda",
    )  # fmt: skip
    assert ws.nbytes == workspace_by_hand(184320, keys=196608) > workspace_by_hand(184320)


def test_a_max_context_past_the_models_positions_is_clamped_with_a_warning(capsys):
    """The built-in model holds 2048 positions: --max-context 184320 must not size a
    184K-token pool, and startup says so."""
    assert main(["plan", "--max-context", "184320", "--json", "--kv-dtype", "fp16"]) == 0
    out = capsys.readouterr()
    plan = json.loads(out.out)
    assert plan["max_context"] == 2048 and plan["pool_tokens"] == 2048
    assert "--max-context 184320 is more than the 2048 positions" in out.err
    assert "serving 2048" in out.err


def test_held_bytes_counts_shared_memory_once():
    """A packed head over the embedding's own bytes (a view, another object) adds nothing;
    a holder whose tensors don't make up its `nbytes` counts all of `nbytes`."""
    from ninfer_core.model.layers import held_bytes

    class Packed:
        def __init__(self, w: torch.Tensor) -> None:
            self.weight = w.detach()  # another tensor object, the same memory

        @property
        def nbytes(self) -> int:
            return self.weight.numel() * self.weight.element_size()

    class Opaque:
        nbytes = 1000

    embed = torch.nn.Parameter(torch.zeros(50, 8), requires_grad=False)
    model = torch.nn.Module()
    model.embed = embed
    model.head = Packed(embed)
    assert held_bytes(model) == 50 * 8 * 4
    model.other = Packed(torch.zeros(10, 8))
    model.opaque = Opaque()
    assert held_bytes(model) == 50 * 8 * 4 + 10 * 8 * 4 + 1000


def test_a_measured_workspace_refits_the_pool(host):
    """What startup does on a GPU after its profiling step (`with_measured_workspace`):
    the measurement replaces the estimate; the pool gives up the pages it missed."""
    from ninfer_core.memory.planner import with_measured_workspace

    auto = plan_8b(host, kv_capacity="auto")
    est = auto.workspace
    page = 16 * auto.kv_bytes_per_token

    def measured(nbytes: int) -> Workspace:
        return Workspace(nbytes, "measured", est.prefill_chunk, est.context, est.concurrency)

    lower = with_measured_workspace(auto, measured(est.nbytes // 2))
    assert lower.pool_pages == auto.pool_pages and lower.workspace.method == "measured"
    higher = with_measured_workspace(auto, measured(est.nbytes + 10 * page + 1))
    assert higher.free_after_bytes >= higher.headroom_bytes
    assert auto.pool_pages - 11 <= higher.pool_pages < auto.pool_pages
    explicit = plan_8b(host, kv_capacity=40000)
    assert with_measured_workspace(explicit, measured(est.nbytes + 1)).pool_tokens == 40000
    spare = explicit.free_after_bytes - explicit.headroom_bytes
    with pytest.raises(CapacityDoesNotFitError, match="measured by a profiling step"):
        with_measured_workspace(explicit, measured(est.nbytes + spare + page))
    with pytest.raises(AutoCapacityTooSmallError, match="fewer than --max-context"):
        with_measured_workspace(auto, measured(est.nbytes + auto.pool_bytes))
