"""Triton RMSNorm, SiLU-and-multiply and RoPE (`backend_triton/norms.py`) in Triton's
interpreter, against float64 references written from the definitions (fp16 and fp32;
the interpreter computes bf16 wrongly)."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import interpreted_module

norms = interpreted_module("ninfer_plugins.backend_triton.norms")

TOL = {torch.float16: 1e-2, torch.float32: 1e-5}
DTYPES = [torch.float16, torch.float32]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 300])  # 300: not a power of two, and longer than a block
def test_rms_norm(dtype, n):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(2, 3, n, generator=gen) * 3 + 1).to(dtype)
    w = torch.randn(n, generator=gen).to(dtype)
    xd = x.double()
    ref = xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
    out = norms.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype]


def test_rms_norm_of_a_wider_residual_stream_returns_the_weight_dtype():
    """x fp32 (the residual stream), w fp16: statistics from the fp32 values, fp16 out."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=gen) * 1e3  # fp16 squares would overflow
    w = torch.rand(96, generator=gen).to(torch.float16)
    xd = x.double()
    ref = xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()
    out = norms.rms_norm(x, w, 1e-5)
    assert out.dtype == torch.float16
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_halves_of_one_gate_up_output(dtype):
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(4, 2 * 300, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # row-strided views
    g, u = gate.double(), up.double()
    ref = g / (1 + torch.exp(-g)) * u
    out = norms.silu_and_mul(gate, up)
    assert out.shape == gate.shape and out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_apply_rope_rotates_q_and_k_in_neox_pairs(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    t, h, hkv, half = 5, 4, 2, head_dim // 2
    qkv = torch.randn(t, h + 2 * hkv, head_dim, generator=gen).to(dtype)
    q, k = qkv[:, :h], qkv[:, h : h + hkv]  # strided views of one projection
    pos = torch.arange(10, 10 + t, dtype=torch.float64)
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = pos[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def ref(x: torch.Tensor) -> torch.Tensor:
        # Pair i with i + D/2: a plane rotation by the position's angle.
        x = x.double()
        c, s = cos.double()[:, None, :], sin.double()[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    q_out, k_out = norms.apply_rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    assert rel_err(q_out, ref(q)) <= TOL[dtype]
    assert rel_err(k_out, ref(k)) <= TOL[dtype]
    # A rotation keeps each pair's length.
    norm = torch.linalg.vector_norm
    torch.testing.assert_close(norm(q_out.double(), dim=-1), norm(q.double(), dim=-1),
                               rtol=TOL[dtype], atol=0)  # fmt: skip
