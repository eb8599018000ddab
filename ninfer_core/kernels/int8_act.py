"""Int8 activations for prefill (`--activation-dtype int8`): the reference math of a
W8A8 / W4A8 linear over NInfer's group-quantized weights.

A prefill chunk multiplies many rows by the same weight, so its linears are bound by
arithmetic rather than by reading the weight; integer tensor cores (int8 MMA, SM80+) do
about twice the operations per cycle of fp16 ones. Per token `t` of `x: [T, in]`:

    sx[t]     = max_k |x[t, k]| / 127                       (fp32)
    xq[t, k]  = clamp(round_half_even(x[t, k] / sx[t]), -127, 127)    (int8; 0 when sx = 0)

and for each weight group `g` (the format's `group` columns, one fp16 scale per row):

    acc[t, n, g] = sum_{k in g} xq[t, k] * code[n, k]                   (exact integers)
    y[t, n]      = sx[t] * sum_g scale[n, g] * acc[t, n, g]  (+ bias)    (fp32, then x.dtype)

An asymmetric format (Q4G32M: `w = u * scale + min`, `u = code + 8` in 0..15) adds the
min term exactly the same way: `sx[t] * sum_g min[n, g] * sum_{k in g} xq[t, k]`.

The integer products are computed here as batched fp32 matmuls, one per group, and are
EXACT: every operand is an integer, and every partial sum of a group is at most
`group * 127 * 128 = 64 * 127 * 128 < 2^20` in magnitude, below 2^24, where fp32 holds
every integer; so any summation order gives the same acc (on a GPU with TF32 matmuls
too: the integer operands fit TF32's 10-bit significand, and it accumulates in fp32).
Only the sum over groups and the scaling round (in fp32), as the Triton kernel's
epilogue does (`ninfer_plugins.backend_triton.int8_linear`).

Decode and speculative rounds (at most `PREFILL_MIN_ROWS` rows) keep float activations:
there the weight read dominates and quantizing activations would only cost accuracy.
Dense weights keep the float path as well. On the CPU this module is an emulation that
checks correctness; it is slower than the float path, not faster.
"""

from __future__ import annotations

import torch

from ninfer_core.quant.tensor import QuantizedTensor

#: Calls of `linear` with more rows than this run int8 activations; fewer (decode, a
#: speculative round of 1 + up to 8 drafts, a tiny prefill chunk) keep the float path.
PREFILL_MIN_ROWS = 16
#: The largest int8 activation code (symmetric: -127..127, so -x quantizes to -xq).
QMAX = 127
#: The values of `--activation-dtype`; `auto` is the compute dtype.
ACTIVATION_DTYPES = ("auto", "int8")
#: Output elements (`T * rows * groups` fp32 products) held at a time by `int8_linear`.
_CHUNK_ELEMS = 1 << 22


def activation_dtype_name(option: str | None) -> str | None:
    """`--activation-dtype` as `KernelWorkload.activation_dtype`: None for `auto` (the
    compute dtype), else the name (`int8`); an unknown name lists the known ones."""
    if option in (None, "auto"):
        return None
    if option not in ACTIVATION_DTYPES:
        from ninfer_core.errors import UnknownNameError

        raise UnknownNameError("activation dtype", str(option), ACTIVATION_DTYPES)
    return option


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] float -> (xq int8 [T, K], sx fp32 [T]), per token: `sx = max|x| / 127`,
    `xq = round_half_even(x / sx)` in fp32 (an all-zero row: sx 0, codes 0)."""
    xf = x.float()
    sx = xf.abs().amax(dim=-1) / QMAX  # [T]
    safe = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.round(xf / safe[:, None]).clamp_(-QMAX, QMAX)
    return xq.to(torch.int8), sx


def group_products(xq: torch.Tensor, codes: torch.Tensor, group: int) -> torch.Tensor:
    """xq: integer [T, Kp], codes: integer [N, Kp] (Kp a multiple of `group`) ->
    fp32 [G, T, N] with `[g, t, n] = sum_{k in group g} xq[t, k] * codes[n, k]`, exact
    (integers below 2^24 in magnitude; see the module doc)."""
    t, kp = xq.shape
    n = codes.shape[0]
    groups = kp // group
    a = xq.to(torch.float32).view(t, groups, group).transpose(0, 1)  # [G, T, group]
    b = codes.to(torch.float32).view(n, groups, group).permute(1, 2, 0)  # [G, group, N]
    return torch.bmm(a, b)


def int8_linear(x: torch.Tensor, w: QuantizedTensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, in] float, w: a `QuantizedTensor` [out, in], b: [out] -> [T, out] in
    x.dtype: activations quantized per token to int8, products per group in integers
    (exact), scales applied in fp32. Row chunks of `w` bound the memory held."""
    rows, cols = w.shape
    assert x.dim() == 2 and x.shape[1] == cols, f"x {list(x.shape)} against w {list(w.shape)}"
    group, kp = w.fmt.group, w.padded_cols
    xq, sx = quantize_activations(x)
    if kp != cols:  # padded weight columns hold code 0 (u = 0 when asymmetric): x is 0
        xq = torch.nn.functional.pad(xq, (0, kp - cols))
    groups = kp // group
    # Per group sums of xq: the asymmetric format's min term. xsum: [T, G]
    xsum = xq.to(torch.float32).view(-1, groups, group).sum(-1) if w.mins is not None else None
    out = torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device)
    step = max(1, _CHUNK_ELEMS // max(1, x.shape[0] * groups))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        part = w.narrow_rows(start, n)
        codes = part.codes()  # int8 [n, Kp]
        if part.mins is not None:
            codes = codes.to(torch.int16) - w.fmt.qmin  # the stored value u, 0..2^bits-1
        acc = group_products(xq, codes, group)  # [G, T, n], exact
        y = torch.einsum("gtn,ng->tn", acc, part.scales.float())
        if xsum is not None:
            y += xsum @ part.mins.float().t()
        out[:, start : start + n] = y
    out *= sx[:, None]
    if b is not None:
        out += b.float()
    return out.to(x.dtype)
