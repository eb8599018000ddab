"""`--activation-dtype int8`: W8A8 / W4A8 prefill linears (`ninfer_core.kernels.int8_act`,
`ninfer_plugins.backend_triton.int8_linear`).

The oracles are float64 torch written here, not the module's code: per-token scales and
codes from the formula, the product as `sx * (xq @ dequantized_w.T)`, which never cuts
the sum into groups. The Triton kernels run in Triton's interpreter (integer `tl.dot`
included, which the interpreter computes exactly) in fp32 and fp16.
"""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch
from checkpoints import prompt_logits, write_tiny_qwen3

from ninfer_core import hookimpl
from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.convert import convert
from ninfer_core.device import probe_device, simulated_device
from ninfer_core.engine import Sequence
from ninfer_core.errors import UnknownNameError, UnsupportedChoiceError
from ninfer_core.eval_ppl import scoring_runtime
from ninfer_core.kernels import int8_act
from ninfer_core.kernels.compose import plan_kernels
from ninfer_core.kernels.reference import TorchOps
from ninfer_core.kernels.workload import KernelWorkload
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.quant.tensor import QuantizedTensor, quantize
from ninfer_core.support import Support
from ninfer_plugins.backend_triton import table

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = probe_device(use_cuda=False)


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def oracle_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: sx = max|x| / 127 per row, q = x / sx (unrounded; 0 for a zero row)."""
    x64 = x.double()
    sx = x64.abs().amax(-1) / 127
    q = torch.where(sx[:, None] > 0, x64 / sx.clamp_min(1e-300)[:, None], 0.0)
    return q, sx


def oracle_linear(x, w: QuantizedTensor, b=None) -> torch.Tensor:
    """float64 `sx * (xq @ W.T) + b` with W the dequantized weight: no grouping at all."""
    xq, sx = int8_act.quantize_activations(x)  # checked on its own below
    y = sx.double()[:, None] * (xq.double() @ w.dequantize(torch.float64).t())
    return y if b is None else y + b.double()


# -- activation quantization and the grouped integer product ---------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_activation_codes_follow_the_formula(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 70, generator=g) * torch.logspace(-3, 2, 9)[:, None]).to(dtype)
    x[4] = 0  # an all-zero token: scale 0, codes 0
    xq, sx = int8_act.quantize_activations(x)
    q, sx64 = oracle_codes(x)
    assert xq.dtype == torch.int8 and sx.dtype == torch.float32
    torch.testing.assert_close(sx.double(), sx64, rtol=2**-23, atol=0)
    assert int(xq.abs().max()) == 127 and bool((xq[4] == 0).all())
    assert bool((xq.abs().amax(-1)[sx > 0] == 127).all())  # each row's largest maps to +-127
    # Round half to even of x / sx, except where fp32's division lands within 1e-4 of a
    # tie (the oracle divides in float64): there either neighbour is right.
    clear = ((q - q.floor()) - 0.5).abs() > 1e-4
    assert torch.equal(xq.double()[clear], torch.round(q)[clear])
    assert bool(((xq.double() - q).abs() <= 0.5 + 1e-4).all())


def test_group_products_are_exact_at_the_extremes():
    # The worst case for exactness: 64 products of 127 * -128 in one group.
    g = torch.Generator().manual_seed(1)
    xq = torch.randint(-127, 128, (5, 128), generator=g, dtype=torch.int8)
    codes = torch.randint(-128, 128, (7, 128), generator=g, dtype=torch.int8)
    xq[0] = 127
    codes[0] = -128
    acc = int8_act.group_products(xq, codes, 64)  # [G, T, N]
    want = torch.einsum("tgk,ngk->gtn", xq.long().view(5, 2, 64), codes.long().view(7, 2, 64))
    assert acc.dtype == torch.float32 and torch.equal(acc.long(), want)
    assert int(acc[0, 0, 0]) == -64 * 127 * 128


@pytest.mark.parametrize("fmt", ["W8G32", "Q4G64", "Q4G32", "Q4G32M", "Q6G64"])
def test_int8_linear_matches_float64_of_the_same_codes(fmt):
    g = torch.Generator().manual_seed(2)
    w = quantize(torch.randn(37, 100, generator=g), fmt)  # 100: the last group is padded
    x, b = torch.randn(33, 100, generator=g), torch.randn(37, generator=g)
    want = oracle_linear(x, w, b)
    got = int8_act.int8_linear(x, w, b)
    assert got.dtype == torch.float32
    assert rel_rms(got, want) < 1e-6
    # ... and an int8 approximation of the float product (what the bench measures).
    exact = x.double() @ w.dequantize(torch.float64).t() + b.double()
    assert 1e-4 < rel_rms(got, exact) < 0.02


def test_int8_linear_chunks_rows_like_one_pass(monkeypatch):
    g = torch.Generator().manual_seed(3)
    w = quantize(torch.randn(40, 64, generator=g), "Q4G32")
    x = torch.randn(20, 64, generator=g)
    whole = int8_act.int8_linear(x, w)
    monkeypatch.setattr(int8_act, "_CHUNK_ELEMS", 20 * 2 * 7)  # 7 weight rows at a time
    assert torch.equal(int8_act.int8_linear(x, w), whole)


def test_activation_dtype_names():
    assert int8_act.activation_dtype_name("auto") is None
    assert int8_act.activation_dtype_name("int8") == "int8"
    with pytest.raises(UnknownNameError, match="int8"):
        int8_act.activation_dtype_name("fp8")


# -- the Triton kernels, interpreted ----------------------------------------------------


@pytest.fixture(scope="module")
def kernels():
    from triton_helpers import interpreted_module

    return interpreted_module("ninfer_plugins.backend_triton.int8_linear")


CASES = [("W8G32", 17, 96), ("Q4G64", 33, 100), ("Q4G32", 17, 100)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("fmt", "tokens", "cols"), CASES)
def test_triton_int8_linear_against_the_reference(kernels, fmt, tokens, cols, dtype):
    g = torch.Generator().manual_seed(4)
    w = quantize(torch.randn(37, cols, generator=g), fmt)
    x = torch.randn(tokens, cols, generator=g).to(dtype)
    x[3] = 0  # a zero token row
    b = torch.randn(37, generator=g).to(dtype)
    xq, sx = kernels.quantize_rows(x, w.padded_cols)
    ref_q, ref_s = int8_act.quantize_activations(x)
    assert torch.equal(xq[:, :cols], ref_q) and torch.equal(sx, ref_s)
    assert bool((xq[:, cols:] == 0).all())
    got = kernels.int8_linear(x, w.packed, w.scales, fmt, 37, b)
    assert got.dtype == dtype and got.shape == (tokens, 37)
    ref = int8_act.int8_linear(x, w, b)
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # one fp16 rounding of the output
    assert rel_rms(got, ref) < tol
    assert rel_rms(got, oracle_linear(x, w, b)) < tol
    assert torch.equal(got[3], b)  # sx = 0: the bias alone


def test_triton_int8_linear_refuses_what_it_cannot_read(kernels):
    w = quantize(torch.randn(16, 64), "Q4G32M")
    with pytest.raises(ValueError, match="Q4G32M"):
        kernels.int8_linear(torch.randn(20, 64), w.packed, w.scales, "Q4G32M", 16)


def test_triton_ops_route_prefill_rows_only_to_the_int8_gemm(kernels):
    from triton_helpers import interpreted_module

    ops_module = interpreted_module("ninfer_plugins.backend_triton.ops")
    workload = KernelWorkload(frozenset({"fp32", "Q4G64"}), None, torch.float32, "int8")
    ops = ops_module.TritonOps("cpu", workload)
    g = torch.Generator().manual_seed(6)
    w = ops.pack_linear(quantize(torch.randn(37, 64, generator=g), "Q4G64"), dtype=torch.float32)
    assert isinstance(w, QuantizedTensor)  # kept as stored: the int8 GEMM reads the codes
    x = torch.randn(17, 64, generator=g)
    assert torch.equal(ops.linear(x, w), kernels.int8_linear(x, w.packed, w.scales, "Q4G64", 37))
    # 16 rows (a decode batch, a speculative round): the float GEMM, x's own precision.
    dense = x[:16].double() @ w.dequantize(torch.float64).t()
    assert rel_rms(ops.linear(x[:16], w), dense) < 1e-6
    assert rel_rms(int8_act.int8_linear(x[:16], w), dense) > 1e-4  # which int8 would miss


def test_triton_backend_refuses_int8_activations_it_cannot_run(monkeypatch):
    def linear(device, formats):
        workload = KernelWorkload(frozenset(formats), None, torch.float16, "int8")
        return table.op_support(device, workload)["linear"]

    h100 = simulated_device("h100")
    sm75 = replace(h100, cuda=replace(h100.cuda, name="NVIDIA T4", sm=(7, 5)))
    monkeypatch.setattr(table, "triton_installed", lambda: True)
    assert linear(h100, {"fp16", "W8G32", "Q4G64"}).ok
    refused = linear(h100, {"fp16", "Q4G64", "Q6G64", "Q4G32M"})
    assert not refused.ok and "Q4G32M, Q6G64" in refused.reason
    assert not linear(sm75, {"fp16", "W8G32"}).ok
    assert "SM80" in linear(sm75, {"fp16", "W8G32"}).reason


# -- end to end on the reference --------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen3 (tied head) as W8G32 and Q4G64 `.ninfer` files."""
    root = tmp_path_factory.mktemp("int8-acts")
    hf = write_tiny_qwen3(root / "hf")
    out = {}
    for name in ("w8", "q4"):
        out[name] = root / f"{name}.ninfer"
        convert(hf, out[name], recipe_name=name)
    return hf, out


def prompt(n: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(5)).tolist()


def load(path, **runtime):
    return load_model(path, host=create_host(), device=CPU, runtime=RuntimeConfig(**runtime))


# Measured on this tiny model (3 layers, logits peaked by a 0.1 init range): relative RMS
# 0.026-0.028 between the int8 and float prefill logits in fp32 (about 4 times the 0.6%
# one int8 GEMM adds, `test_int8_linear_matches_float64_of_the_same_codes`, over 13
# linears) and 0.025-0.031 in fp16/bf16. The bound leaves 2x; a wrong scale or a
# misplaced group gives O(1).
LOGIT_BOUND = 0.06


@pytest.mark.parametrize("recipe", ["w8", "q4"])
def test_prefill_logits_stay_close_to_the_float_path(models, recipe):
    _, files = models
    ids = prompt(40)
    float_logits = prompt_logits(load(files[recipe], dtype="fp32"), ids)
    loaded = load(files[recipe], dtype="fp32", activation_dtype="int8")
    assert loaded.workload.activation_dtype == "int8"
    assert "activations int8" in loaded.workload.describe()
    assert loaded.workload.to_json()["activation_dtype"] == "int8"
    int8_logits = prompt_logits(loaded, ids)
    err = rel_rms(int8_logits, float_logits)
    assert 1e-4 < err < LOGIT_BOUND  # not zero: the int8 path did run
    agree = (int8_logits.argmax(-1) == float_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.85


def test_decode_keeps_the_float_path(models, monkeypatch):
    """Count the int8 GEMMs: a 40-token prefill runs every quantized linear through it,
    a decode step (1 row) and a speculative round's 9 rows run none."""
    _, files = models
    loaded = load(files["q4"], dtype="fp32", activation_dtype="int8")
    assert isinstance(loaded.ops, TorchOps) and loaded.ops.workload.activation_dtype == "int8"
    calls: list[int] = []
    real = int8_act.int8_linear

    def counting(x, w, b=None):
        calls.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(int8_act, "int8_linear", counting)
    runtime = scoring_runtime(loaded, 64)
    seq = Sequence(prompt(40))
    runtime.runner.run([(seq, 40)])
    # 3 layers x (qkv, o, gate_up, down); the tied Q4G64 head runs the last row only,
    # which is decode-sized: it keeps the float path.
    prefill_calls = len(calls)
    assert prefill_calls == 12 and set(calls) == {40}
    for step in range(3):
        seq.append_token(step + 7)
        runtime.runner.run([(seq, 1)])
    for tok in range(9):
        seq.append_token(tok + 11)
    runtime.runner.run([(seq, 9)])  # a verify round: 1 + 8 drafts
    assert len(calls) == prefill_calls


def test_int8_activations_keep_quantized_weights_as_loaded(models):
    """The CPU reference would dequantize (fp32) or repack for the int4 kernel (bf16);
    the int8 path needs the codes, so the weights stay `QuantizedTensor`s."""
    _, files = models
    for dtype in ("fp32", "bf16"):
        loaded = load(files["w8"], dtype=dtype, activation_dtype="int8")
        assert isinstance(loaded.model.layers[0].mlp.down_proj, QuantizedTensor)
        assert loaded.ops.packed_nbytes("W8G32", (64, 64), dtype=loaded.dtype) is None


def test_a_dense_model_is_refused_with_the_alternatives(models, capsys):
    hf, _ = models
    with pytest.raises(UnsupportedChoiceError) as info:
        load(hf, dtype="fp32", activation_dtype="int8")
    message = str(info.value)
    assert "--activation-dtype int8" in message and "--activation-dtype auto" in message
    assert "has none (every weight runs as fp32)" in message
    # The option reaches the loader from the command line (generated from RuntimeConfig).
    argv = ["generate", str(hf), "--prompt", "hi", "--raw", "--max-new", "2"]
    assert main([*argv, "--activation-dtype", "int8"]) != 0
    assert "--activation-dtype int8: int8 activations multiply" in capsys.readouterr().err


class BlindBackend:
    """A backend written before `create_ops` took the workload: it can't see int8."""

    name = "blind"
    description = "test backend whose ops never learn the workload"
    priority = 30
    provides = None
    attention_scratch = None

    def supports(self, device) -> Support:
        return Support.yes()

    def create_ops(self, device) -> TorchOps:
        return TorchOps(getattr(device, "torch_device", device))


def blind_host():
    @hookimpl
    def register_kernel_backends():
        return [BlindBackend()]

    plugin = types.SimpleNamespace(register_kernel_backends=register_kernel_backends)
    return create_host(extra_plugins=[("blind", plugin)])


def test_a_backend_that_cannot_see_int8_is_refused_linear_with_the_reason(models):
    _, files = models
    h = blind_host()
    int8 = KernelWorkload(frozenset({"fp32", "Q4G64"}), "fp32", torch.float32, "int8")
    linear = next(c for c in plan_kernels(h, CPU, workload=int8) if c.op == "linear")
    assert linear.backend == "torch"
    assert ("blind", "its create_ops takes no workload, so its linear cannot run int8 "
            "activations") in linear.passed_over  # fmt: skip
    plain = KernelWorkload(frozenset({"fp32", "Q4G64"}), "fp32", torch.float32)
    assert {c.backend for c in plan_kernels(h, CPU, workload=plain)} == {"blind"}
    with pytest.raises(UnsupportedChoiceError, match=r"cannot serve linear.*create_ops"):
        load_model(
            files["q4"],
            host=h,
            device=CPU,
            runtime=RuntimeConfig(dtype="fp32", activation_dtype="int8", kernel="linear=blind"),
        )
