"""RMSNorm, SiLU-and-multiply and rotary embedding as Triton kernels.

Each matches the reference op (`TorchOps`) in where it rounds: RMSNorm keeps its
statistics in fp32 and rounds the normalized row to the weight's dtype before the
weight multiplies it (x may be wider than w: the fp32 residual stream of a bf16 model);
SiLU rounds to the activations' dtype before the product, as `F.silu(gate) * up` does;
RoPE rotates q and k (neox layout: dimension i pairs with i + D/2) in one launch, one
program per token, with one rounding per output element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_plugins.backend_triton.table import interpreting

#: Row elements a program handles at a time (the interpreter runs numpy: keep it small).
_ROW_BLOCK = 256 if interpreting() else 4096
_ELEMENT_BLOCK = 256 if interpreting() else 1024


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N], w: [N] -> [..., N] in w.dtype (statistics in fp32)."""
    n = x.shape[-1]
    assert w.shape == (n,) and w.stride(0) == 1
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=w.dtype, device=x.device)
    block = min(_ROW_BLOCK, triton.next_power_of_2(n))
    if rows.shape[0]:
        _rms_norm[(rows.shape[0],)](
            rows, w, out, rows.stride(0), out.stride(0), n, eps, BLOCK=block
        )
    return out.view(x.shape)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [T, I] (row-strided views of one gate_up output are fine) -> [T, I]."""
    assert gate.shape == up.shape and gate.dim() == 2
    assert gate.stride(1) == 1 and up.stride(1) == 1, "feature axis must be contiguous"
    t, inner = gate.shape
    out = torch.empty(t, inner, dtype=gate.dtype, device=gate.device)
    if t and inner:
        grid = (t, triton.cdiv(inner, _ELEMENT_BLOCK))
        _silu_and_mul[grid](
            gate, up, out, gate.stride(0), up.stride(0), out.stride(0), inner,
            BLOCK=min(_ELEMENT_BLOCK, triton.next_power_of_2(inner)),
        )  # fmt: skip
    return out


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D], cos/sin: [T, D/2] -> rotated (q, k), new tensors."""
    t, h, d = q.shape
    hkv = k.shape[1]
    half = d // 2
    assert k.shape == (t, hkv, d) and cos.shape == (t, half) and sin.shape == (t, half)
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    if t:
        _rope[(t,)](
            q, k, cos, sin, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), h, hkv,
            HALF=half, BLOCK_H=triton.next_power_of_2(h), BLOCK_HKV=triton.next_power_of_2(hkv),
            BLOCK_HALF=triton.next_power_of_2(half),
        )  # fmt: skip
    return q_out, k_out


# Only Triton builtins and this module's jit functions inside the kernels (`tl.sum` is
# itself a jit function that an interpreted kernel cannot call in a process that
# imported Triton before turning the interpreter on): `tl.reduce` with `_add` instead.


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _rms_norm(X, W, Y, stride_x, stride_y, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = X + row * stride_x, Y + row * stride_y
    cols = tl.arange(0, BLOCK)
    squares = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, n, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < n, other=0.0).to(tl.float32)
        squares += x * x
    rstd = 1.0 / tl.sqrt(tl.reduce(squares, 0, _add) / n + eps)
    for start in range(0, n, BLOCK):
        mask = start + cols < n
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + start + cols, mask=mask, other=0.0)
        normed = (x * rstd).to(w.dtype)  # rounded to w's dtype before the weight, as HF
        y = normed.to(tl.float32) * w.to(tl.float32)  # one rounding, as w * normed in w.dtype
        tl.store(y_row + start + cols, y.to(w.dtype), mask=mask)


@triton.jit
def _silu_and_mul(G, U, Out, stride_g, stride_u, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds before the product
    y = act.to(tl.float32) * u.to(tl.float32)
    tl.store(Out + row * stride_o + cols, y.to(g.dtype), mask=mask)


@triton.jit
def _rope_heads(X, Y, stride_xh, stride_yh, heads, c, s, BLOCK_HEADS: tl.constexpr,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Rotate `heads` head vectors at X (one token) into Y: x1' = x1 c - x2 s,
    x2' = x2 c + x1 s, with x1 the first half of each head and x2 the second."""
    hh = tl.arange(0, BLOCK_HEADS)
    i = tl.arange(0, BLOCK_HALF)
    mask = (hh[:, None] < heads) & (i[None, :] < HALF)
    x_lo = X + hh[:, None] * stride_xh + i[None, :]
    y_lo = Y + hh[:, None] * stride_yh + i[None, :]
    x1 = tl.load(x_lo, mask=mask, other=0.0)
    x2 = tl.load(x_lo + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(y_lo, (a * c[None, :] - b * s[None, :]).to(x1.dtype), mask=mask)
    tl.store(y_lo + HALF, (b * c[None, :] + a * s[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rope(
    Q, K, COS, SIN, QO, KO,
    sq_t, sq_h, sk_t, sk_h, scos, ssin, sqo_t, sqo_h, sko_t, sko_h, heads, kv_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    c = tl.load(COS + t * scos + i, mask=i < HALF, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * ssin + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rope_heads(Q + t * sq_t, QO + t * sqo_t, sq_h, sqo_h, heads, c, s, BLOCK_H, HALF, BLOCK_HALF)
    _rope_heads(
        K + t * sk_t, KO + t * sko_t, sk_h, sko_h, kv_heads, c, s, BLOCK_HKV, HALF, BLOCK_HALF
    )
