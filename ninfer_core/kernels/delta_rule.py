"""Reference ops of a Gated DeltaNet layer (Qwen3-Next / Qwen3.5 linear attention).

Two ops, each over a ragged batch (`cu_seqlens`: B + 1 token offsets into the flat
`[T, ...]` step, as everywhere in the runtime) with a per-sequence state carried from
step to step and updated in place:

- `gated_delta_rule`: the recurrence itself. Per value head, with q and k
  L2-normalised and q scaled by Dk**-0.5 (transformers' `use_qk_l2norm_in_kernel=True`),
  the state S [Dk, Dv] goes, token by token,
  `S = exp(g) S;  u = beta (v - Sᵀ k);  S = S + k uᵀ;  o = Sᵀ q`.
- `causal_conv1d`: the depthwise causal convolution (kernel K, 4 in Qwen3-Next) with
  SiLU in front of it, whose state is the last K - 1 inputs of each sequence.

`transformers.models.qwen3_next.modeling_qwen3_next` is the reference both are tested
against (`tests/test_delta_rule.py`); this module is the core's reference for every
kernel backend (`ninfer_core.kernels.reference.TorchOps` calls it).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F

#: Sequences of at most this many tokens in a step run the recurrent form: decode, or
#: a speculative round's few rows. The chunked form builds [chunk, chunk] matrices and
#: solves a triangular system per chunk, which costs more than a handful of steps of
#: the recurrence; from a few tens of tokens on, its matmuls win.
RECURRENT_MAX_TOKENS = 16
#: transformers' `l2norm` (and FLA's): x * rsqrt(sum(x^2) + eps).
L2NORM_EPS = 1e-6


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    *,
    chunk: int = 64,
) -> torch.Tensor:
    """The gated delta rule over a ragged batch of B sequences.

    q, k: [T, Hqk, Dk]; v: [T, Hv, Dv]; g (log-decay, <= 0), beta (in (0, 1)): [T, Hv];
    states: [B, Hv, Dk, Dv], each sequence's state before its tokens, overwritten with
    the state after them; cu_seqlens: [B + 1] token offsets. Returns o [T, Hv, Dv] in
    v's dtype. Value head j reads q/k head j // (Hv / Hqk) (transformers'
    `repeat_interleave`).

    Computed in fp32 (float64 for float64 inputs): the state accumulates over the whole
    sequence, so rounding it to bf16 every token would drift. A sequence of at most
    `RECURRENT_MAX_TOKENS` runs the recurrence token by token, a longer one the chunked
    (WY) form, `chunk` tokens at a time; both give the same numbers up to rounding.
    """
    offsets = _offsets(cu_seqlens, v.shape[0])
    hv, dk = v.shape[1], q.shape[2]
    _check_delta_shapes(q, k, v, g, beta, states, len(offsets) - 1)
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    group = hv // q.shape[1]
    # Normalised and widened once for the whole step; [T, Hv, Dk] after the grouping.
    qn = _l2norm(q.to(dtype)).mul_(dk**-0.5).repeat_interleave(group, dim=1)
    kn = _l2norm(k.to(dtype)).repeat_interleave(group, dim=1)
    vf, gf, bf = v.to(dtype), g.to(dtype), beta.to(dtype)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for b, (start, end) in enumerate(pairwise(offsets)):
        if end == start:
            continue  # nothing ran: the state stays as it was
        # Heads first: [Hv, L, D] and [Hv, L], so every matmul is batched over heads.
        rows = slice(start, end)
        args = [x[rows].transpose(0, 1) for x in (qn, kn, vf, gf, bf)]
        state = states[b].to(dtype)
        if end - start <= RECURRENT_MAX_TOKENS:
            o, state = _recurrent(*args, state)
        else:
            o, state = _chunked(*args, state, chunk)
        out[rows] = o.transpose(0, 1).to(v.dtype)
        states[b].copy_(state)
    return out


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    states: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
) -> torch.Tensor:
    """silu(depthwise causal conv1d) over a ragged batch of B sequences.

    x: [T, C]; weight: [C, K]; bias: [C] or None; states: [B, C, K - 1], each
    sequence's previous K - 1 inputs (zeros for a new sequence), overwritten with its
    last K - 1 inputs after this step; cu_seqlens: [B + 1] token offsets. Returns
    [T, C] in x's dtype.

    A sequence's tokens are convolved behind its state, so prefill in pieces, decode
    token by token, and one pass give the same outputs: for a new sequence (zero state)
    this is transformers' `causal_conv1d_fn` (left padding K - 1), for a decode step its
    `causal_conv1d_update`. Like them it computes in the weight's dtype.
    """
    offsets = _offsets(cu_seqlens, x.shape[0])
    channels, width = weight.shape
    if x.dim() != 2 or x.shape[1] != channels:
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)} is not [T, {channels}]")
    if states.shape != (len(offsets) - 1, channels, width - 1):
        raise ValueError(
            f"causal_conv1d: states {tuple(states.shape)} is not "
            f"[{len(offsets) - 1}, {channels}, {width - 1}]"
        )
    kernel = weight.unsqueeze(1)  # [C, 1, K]: one filter per channel (groups = C)
    out = torch.empty_like(x)
    for b, (start, end) in enumerate(pairwise(offsets)):
        if end == start:
            continue
        # [C, K - 1 + L]: the state, then this step's inputs, in time order
        window = torch.cat((states[b].to(weight.dtype), x[start:end].t().to(weight.dtype)), 1)
        y = F.conv1d(window[None], kernel, bias, groups=channels)[0]  # [C, L]
        out[start:end] = F.silu(y).t().to(x.dtype)
        states[b].copy_(window[:, window.shape[1] - (width - 1) :])
    return out


def _recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token. q, k: [H, L, Dk], v: [H, L, Dv], g, beta: [H, L],
    state: [H, Dk, Dv] -> (o [H, L, Dv], state after the L tokens)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        k_t = k[:, t]  # [H, Dk]
        predicted = torch.einsum("hk,hkv->hv", k_t, state)  # what S already maps k to
        u = beta[:, t, None] * (v[:, t] - predicted)  # the correction written back
        state = state + k_t[:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[:, t], state))
    return torch.stack(outs, dim=1), state


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence `chunk` tokens at a time (shapes as `_recurrent`): the
    sequential part is one step per chunk, the rest matmuls."""
    outs = []
    for start in range(0, q.shape[1], chunk):
        part = slice(start, start + chunk)
        o, state = _chunk_step(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], state)
        outs.append(o)
    return torch.cat(outs, dim=1), state


def _chunk_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of C tokens in closed form (the WY / UT representation).

    With G the cumulative log-decay inside the chunk and S0 the state before it,
    unrolling the recurrence gives S_i = e^{G_i} S0 + sum_{j<=i} e^{G_i - G_j} k_j u_jᵀ,
    so the corrections U = [u_i] solve the unit lower-triangular system

        (I + A) U = beta * (V - e^{G} K S0),  A_ij = beta_i e^{G_i - G_j} k_i·k_j  (j < i)

    and then O = (e^{G} Q) S0 + (Q Kᵀ * decay, j <= i) U and
    S_C = e^{G_C} S0 + (e^{G_C - G} K)ᵀ U. One triangular solve and a few matmuls
    replace C sequential state updates.
    """
    cum = g.cumsum(dim=1)  # [H, C]
    decay = _pairwise_decay(cum)  # [H, C, C]: e^{G_i - G_j} for j <= i, else 0
    strict = torch.ones_like(decay[0], dtype=torch.bool).tril(-1)
    a = (beta[:, :, None] * (k @ k.transpose(1, 2)) * decay).masked_fill(~strict, 0.0)
    rhs = beta[:, :, None] * (v - (cum.exp()[:, :, None] * k) @ state)  # [H, C, Dv]
    u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    scores = (q @ k.transpose(1, 2)) * decay  # causal, diagonal included
    o = (cum.exp()[:, :, None] * q) @ state + scores @ u
    last = cum[:, -1:]  # [H, 1]
    tail = (last - cum).exp()[:, :, None] * k  # each key decayed to the chunk's end
    state = last.exp()[:, :, None] * state + tail.transpose(1, 2) @ u
    return o, state


def _pairwise_decay(cum: torch.Tensor) -> torch.Tensor:
    """[H, C] cumulative log-decays -> [H, C, C] with e^{G_i - G_j} where j <= i and 0
    above the diagonal; masked before the exp, where G_i - G_j > 0 could overflow."""
    diff = cum[:, :, None] - cum[:, None, :]
    above = torch.ones_like(diff[0], dtype=torch.bool).triu(1)
    return diff.masked_fill(above, float("-inf")).exp()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / ||x|| over the last dim, as transformers' (and FLA's) `l2norm`: eps inside the
    root, so a zero vector stays zero."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _offsets(cu_seqlens: Sequence[int] | torch.Tensor, tokens: int) -> list[int]:
    """Host ints, checked to cover the step's `tokens`: the loops above slice by them
    (one device sync for a tensor)."""
    offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != tokens:
        raise ValueError(f"cu_seqlens {offsets} is not B + 1 offsets from 0 to {tokens}")
    if any(b < a for a, b in pairwise(offsets)):
        raise ValueError(f"cu_seqlens {offsets} is not B + 1 rising offsets")
    return [int(o) for o in offsets]


def _check_delta_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    batch: int,
) -> None:
    """Shape errors here name the argument, not a broadcast deep inside a chunk."""
    t, hqk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    problems = []
    if k.shape != q.shape:
        problems.append(f"k {tuple(k.shape)} is not q's {tuple(q.shape)}")
    if v.shape[0] != t or hv % hqk:
        problems.append(f"v {tuple(v.shape)} is not [{t}, a multiple of {hqk}, Dv]")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (t, hv):
            problems.append(f"{name} {tuple(x.shape)} is not [{t}, {hv}]")
    if states.shape != (batch, hv, dk, dv):
        problems.append(f"states {tuple(states.shape)} is not [{batch}, {hv}, {dk}, {dv}]")
    if problems:
        raise ValueError("gated_delta_rule: " + "; ".join(problems))
