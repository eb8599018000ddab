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

Sequences of a step that run few tokens (decode, a speculative round's rows) are
advanced together: their states are gathered into one [B, ...] batch and each op runs
once over it, shorter sequences padded with steps that leave the state as it is, so a
decode step of B sequences costs one recurrent update, not B updates in a Python loop.
Longer sequences (prefill) run one at a time, the recurrence in its chunked form.

`transformers.models.qwen3_next.modeling_qwen3_next` is the reference both are tested
against (`tests/test_delta_rule.py`); this module is the core's reference for every
kernel backend (`ninfer_core.kernels.reference.TorchOps` calls it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

#: Sequences of at most this many tokens in a step run the recurrent form: decode, or
#: a speculative round's few rows. The chunked form builds [chunk, chunk] matrices and
#: solves a triangular system per chunk, which costs more than a handful of steps of
#: the recurrence; from a few tens of tokens on, its matmuls win. These sequences are
#: also the ones each op advances together, as one batch.
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
    sequence, so rounding it to bf16 every token would drift. The sequences of at most
    `RECURRENT_MAX_TOKENS` run the recurrence token by token, all of them in one batch
    (`_recurrent_batch`); a longer one runs the chunked (WY) form, `chunk` tokens at a
    time, alone. Both give the same numbers up to rounding.
    """
    offsets = _offsets(cu_seqlens, v.shape[0])
    hv, dk = v.shape[1], q.shape[2]
    _check_delta_shapes(q, k, v, g, beta, states, len(offsets) - 1)
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    group = hv // q.shape[1]
    # Normalised and widened once for the whole step; [T, Hv, Dk] after the grouping.
    qn = l2norm(q.to(dtype)).mul_(dk**-0.5).repeat_interleave(group, dim=1)
    kn = l2norm(k.to(dtype)).repeat_interleave(group, dim=1)
    vf, gf, bf = v.to(dtype), g.to(dtype), beta.to(dtype)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    short = _Short.of(offsets, v.device)
    if short is not None:
        _recurrent_batch(short, (qn, kn, vf, gf, bf), states, out)
    for b, (start, end) in enumerate(pairwise(offsets)):
        if end - start <= RECURRENT_MAX_TOKENS:
            continue  # run in the batch above, or nothing ran: the state stays as it was
        # Heads first: [Hv, L, D] and [Hv, L], so every matmul is batched over heads.
        rows = slice(start, end)
        args = [x[rows].transpose(0, 1) for x in (qn, kn, vf, gf, bf)]
        o, state = _chunked(*args, states[b].to(dtype), chunk)
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
    `causal_conv1d_update`. Like them it computes in the weight's dtype. The sequences
    of at most `RECURRENT_MAX_TOKENS` (decode) are convolved together (`_conv_batch`).
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
    short = _Short.of(offsets, x.device)
    if short is not None:
        _conv_batch(short, x, kernel, bias, states, out)
    for b, (start, end) in enumerate(pairwise(offsets)):
        if end - start <= RECURRENT_MAX_TOKENS:
            continue  # run in the batch above, or nothing ran
        # [C, K - 1 + L]: the state, then this step's inputs, in time order
        window = torch.cat((states[b].to(weight.dtype), x[start:end].t().to(weight.dtype)), 1)
        y = F.conv1d(window[None], kernel, bias, groups=channels)[0]  # [C, L]
        out[start:end] = F.silu(y).t().to(x.dtype)
        states[b].copy_(window[:, window.shape[1] - (width - 1) :])
    return out


@dataclass(frozen=True)
class _Short:
    """The sequences of a step that run the recurrent form together: those with 1 to
    `RECURRENT_MAX_TOKENS` tokens, as a [B, L] grid of token rows (L their longest).

    `rows[b, t]` is sequence b's t-th token row; past its own length it repeats a valid
    row (any: the step there is masked out by `valid`). `rows` is None when every
    sequence of the step is short and all have L tokens, the common decode step: the
    grid is then the flat step itself, `[B * L]` viewed as `[B, L]`, and nothing is
    gathered or scattered. `seqs` indexes the sequences' states (None: all, in order)."""

    count: int
    length: int
    seqs: torch.Tensor | None
    rows: torch.Tensor | None
    valid: torch.Tensor | None
    #: Each sequence's token count [B] (None when `rows` is): where its conv inputs end.
    lengths: torch.Tensor | None

    @classmethod
    def of(cls, offsets: list[int], device: torch.device) -> _Short | None:
        spans = [
            (b, start, end - start)
            for b, (start, end) in enumerate(pairwise(offsets))
            if 0 < end - start <= RECURRENT_MAX_TOKENS
        ]
        if not spans:
            return None
        length = max(n for _, _, n in spans)
        if len(spans) == len(offsets) - 1 and all(n == length for _, _, n in spans):
            return cls(len(spans), length, None, None, None, None)
        steps = torch.arange(length)
        starts = torch.tensor([s for _, s, _ in spans])
        counts = torch.tensor([n for _, _, n in spans])
        valid = steps[None, :] < counts[:, None]  # [B, L]
        rows = torch.where(valid, starts[:, None] + steps[None, :], starts[:, None])
        seqs = torch.tensor([b for b, _, _ in spans])
        return cls(
            len(spans), length, seqs.to(device), rows.to(device), valid.to(device),
            counts.to(device),
        )  # fmt: skip

    def grid(self, x: torch.Tensor) -> torch.Tensor:
        """The step's rows [T, ...] -> [B, L, ...]."""
        if self.rows is None:
            return x.view(self.count, self.length, *x.shape[1:])
        return x[self.rows]

    def scatter(self, grid: torch.Tensor, out: torch.Tensor) -> None:
        """Write [B, L, ...] back into the step's rows of `out` [T, ...] (valid steps)."""
        if self.rows is None:
            out.view(grid.shape).copy_(grid)
        else:
            out[self.rows[self.valid]] = grid[self.valid].to(out.dtype)

    def read(self, states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """These sequences' states [B, ...] in `dtype`, to be advanced in place: `states`
        itself when it holds exactly them in that dtype (a decode step: no copy of the
        states in, none back), else a copy."""
        if self.seqs is None and states.dtype == dtype and states.is_contiguous():
            return states
        picked = states if self.seqs is None else states.index_select(0, self.seqs)
        return picked.to(dtype, copy=True)

    def write(self, states: torch.Tensor, new: torch.Tensor) -> None:
        """Store the advanced states `new` [B, ...] (nothing to do if `read` lent them)."""
        if new.data_ptr() == states.data_ptr() and new.shape == states.shape:
            return
        if self.seqs is None:
            states.copy_(new)
        else:
            states.index_copy_(0, self.seqs, new.to(states.dtype))


def _recurrent_batch(
    short: _Short,
    step: tuple[torch.Tensor, ...],
    states: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The short sequences' recurrence, all at once: their rows of q, k, v, g, beta
    (`step`, [T, Hv, ...] normalised and widened) gathered to [B, L, Hv, ...], then
    batch and heads flattened into one [B * Hv] axis of independent recurrences. A
    padded step has g = 0 and beta = 0, so it neither decays nor writes the state."""
    q, k, v, g, beta = (short.grid(x) for x in step)
    if short.valid is not None:
        mask = short.valid[:, :, None]
        g, beta = g * mask, beta * mask
    b, length, hv = v.shape[:3]

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [B, L, Hv, ...] -> [B * Hv, L, ...]
        return x.transpose(1, 2).reshape(b * hv, length, *x.shape[3:])

    state = short.read(states, q.dtype).reshape(b * hv, *states.shape[2:])
    o, state = _recurrent(*map(heads_first, (q, k, v, g, beta)), state)
    short.write(states, state.view(b, hv, *states.shape[2:]))
    short.scatter(o.view(b, hv, length, -1).transpose(1, 2), out)


def _conv_batch(
    short: _Short,
    x: torch.Tensor,
    kernel: torch.Tensor,
    bias: torch.Tensor | None,
    states: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The short sequences' convolution over [B, C, K - 1 + L] windows (state, then
    inputs; past a shorter sequence's end, padding whose outputs are dropped); each new
    state is the K - 1 inputs before the sequence's own end.

    Written as K shifted multiply-adds, accumulated in fp32 (float64 for float64) and
    rounded once to the weight's dtype, as a conv1d accumulates: for the one to few
    columns of a decode step, a depthwise `conv1d` call costs about twice as much."""
    carried, width = states.shape[2], kernel.shape[2]
    inputs = short.grid(x).to(kernel.dtype)  # [B, L, C]
    window = torch.cat((short.read(states, kernel.dtype), inputs.transpose(1, 2)), 2)
    wide = torch.float64 if kernel.dtype == torch.float64 else torch.float32
    taps, columns = kernel[:, 0, :].to(wide), window.to(wide)  # [C, K], [B, C, K - 1 + L]
    y = columns[:, :, : short.length] * taps[:, 0, None]
    for j in range(1, width):
        y.addcmul_(columns[:, :, j : j + short.length], taps[:, j, None])
    if bias is not None:
        y += bias.to(wide)[:, None]
    y = F.silu(y.to(kernel.dtype))  # [B, C, L]
    short.scatter(y.transpose(1, 2).to(x.dtype), out)
    if short.lengths is None:
        short.write(states, window[:, :, short.length :])
    else:  # window columns n_b .. n_b + K - 2: the last K - 1 before sequence b's end
        cols = short.lengths[:, None] + torch.arange(carried, device=x.device)[None, :]
        index = cols[:, None, :].expand(-1, window.shape[1], -1)
        short.write(states, window.gather(2, index))


def _recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token. q, k: [H, L, Dk], v: [H, L, Dv], g, beta: [H, L],
    state: [H, Dk, Dv] (advanced in place) -> (o [H, L, Dv], the state after the L
    tokens). H is any batch of independent recurrences: heads, or sequences x heads.

    A token reads the state once: with S the state before it and d = e^g,
    `Sᵀk` and `Sᵀq` come from one matmul, then `u = beta (v - d Sᵀk)` and
    `o = (d S + k uᵀ)ᵀ q = d Sᵀq + (k·q) u`, and S is decayed and updated in place.
    On a CPU decode step the state (2 MB a sequence and layer at Qwen3-Next's sizes)
    is the traffic; this is three passes over it, not five."""
    outs = []
    decay = g.exp()
    for t in range(q.shape[1]):
        d = decay[:, t, None, None]  # [H, 1, 1]
        qk = torch.stack((q[:, t], k[:, t]), dim=1)  # [H, 2, Dk]
        read = torch.bmm(qk, state)  # [H, 2, Dv]: Sᵀq, Sᵀk
        u = beta[:, t, None, None] * (v[:, t, None, :] - d * read[:, 1:])  # [H, 1, Dv]
        kq = (qk[:, 0] * qk[:, 1]).sum(-1)[:, None, None]  # [H, 1, 1]
        outs.append(d * read[:, :1] + kq * u)
        state.mul_(d).baddbmm_(qk[:, 1:].transpose(1, 2), u)  # S = d S + k uᵀ
    return torch.cat(outs, dim=1), state


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


def l2norm(x: torch.Tensor) -> torch.Tensor:
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
