"""`FlaOps`: the fla backend's members of the `KernelOps` contract, `gated_delta_rule`
and `causal_conv1d`, mapped onto flash-linear-attention's Triton kernels (`fla-core`).

Our contract (`ninfer_core/kernels/delta_rule.py`, the reference) and fla's agree on
the maths: fla's `use_qk_l2norm_in_kernel` is our L2 norm (x * rsqrt(sum x² + 1e-6)),
its default scale Dk**-0.5 ours, `g` is a log-decay and `beta` a write strength in
both, its states are [N, Hv, Dk, Dv] fp32 like ours, and value head j reads key head
j // (Hv / Hqk) in both (fla's "grouped value attention"). What differs is the calling
convention: fla takes a batch of one ragged row `[1, T, ...]` with `cu_seqlens` as a
device tensor, and returns a new final state where ours updates `states` in place.

The conv states differ by one column: fla keeps a sequence's last K inputs [N, C, K]
and never reads the oldest, ours keeps the last K - 1 [B, C, K - 1]; a zero column in
front turns ours into fla's.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from ninfer_core.kernels import delta_rule as reference

#: Sequences of at most this many tokens run fla's fused recurrent kernel (decode, a
#: speculative round's rows), longer ones its chunked kernel, as in the reference.
RECURRENT_MAX_TOKENS = reference.RECURRENT_MAX_TOKENS
#: The chunk sizes fla's chunked gated delta rule takes.
CHUNK_SIZES = (16, 32, 64)


@dataclass(frozen=True)
class FlaKernels:
    """The fla entry points the ops launch."""

    chunk: Callable  # fla.ops.gated_delta_rule.chunk_gated_delta_rule
    recurrent: Callable  # fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule
    conv: Callable  # fla.modules.causal_conv1d.ops.causal_conv1d_fwd (varlen, with states)
    conv_update: Callable  # fla.modules.causal_conv1d.ops.causal_conv1d_update (one token)


@functools.cache
def load_kernels() -> FlaKernels:
    """Import fla once. Its import warns about what this machine lacks (Flash Attention,
    a GPU on a CPU box) and uses deprecated torch APIs; none of it concerns these ops."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.modules.causal_conv1d.ops import causal_conv1d_fwd, causal_conv1d_update
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    return FlaKernels(
        chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule,
        causal_conv1d_fwd,
        causal_conv1d_update,
    )


class FlaOps:
    name = "fla"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        self.kernels = load_kernels()

    def gated_delta_rule(
        self,
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
        """The reference's contract (`delta_rule.gated_delta_rule`): q, k [T, Hqk, Dk],
        v [T, Hv, Dv], g, beta [T, Hv], states [B, Hv, Dk, Dv] fp32 (advanced in place)
        -> o [T, Hv, Dv] in v's dtype. The short sequences run fla's fused recurrent
        kernel together, the long ones its chunked kernel together; each group is
        gathered out of the step only when the step mixes both (or holds empty ones)."""
        if v.dtype == torch.float64:  # fla computes in fp32 at most
            return reference.gated_delta_rule(q, k, v, g, beta, states, cu_seqlens, chunk=chunk)
        offsets = _offsets(cu_seqlens, v.shape[0])
        spans = list(pairwise(offsets))
        t, hv, dv = v.shape
        assert q.shape == k.shape and q.shape[0] == t and hv % q.shape[1] == 0, (q.shape, v.shape)
        assert g.shape == beta.shape == (t, hv), (g.shape, beta.shape)
        assert states.shape == (len(spans), hv, q.shape[2], dv), states.shape
        # fla returns new states, copied back in place: they must be ours to write.
        assert states.dtype == torch.float32 and states.is_contiguous(), states.dtype
        short = [b for b, (s, e) in enumerate(spans) if 0 < e - s <= RECURRENT_MAX_TOKENS]
        long = [b for b, (s, e) in enumerate(spans) if e - s > RECURRENT_MAX_TOKENS]
        size = chunk if chunk in CHUNK_SIZES else 64
        runs = ((short, self._recurrent), (long, functools.partial(self._chunked, size=size)))
        out = None
        for seqs, run in runs:
            if not seqs:
                continue
            group = _Group.of(seqs, spans, v.device)
            h0 = states if group.index is None else states.index_select(0, group.index)
            args = [group.rows_of(x) for x in (q, k, v, g, beta)]
            o, final = run(*args, h0, group.offsets)
            if group.index is None:  # every sequence of the step: o is the output
                states.copy_(final)
                return o
            states.index_copy_(0, group.index, final)
            if out is None:
                out = v.new_zeros(v.shape)  # an empty sequence's rows: none exist
            out.index_copy_(0, group.rows, o)
        return out if out is not None else v.new_zeros(v.shape)

    def _recurrent(self, q, k, v, g, beta, h0, offsets):
        """fla's fused recurrent kernel over [T', ...] rows -> (o [T', Hv, Dv], final)."""
        cu = torch.tensor(offsets, dtype=torch.long, device=v.device)
        o, final = self.kernels.recurrent(
            q[None], k[None], v[None], g=g[None], beta=beta[None],
            scale=q.shape[-1] ** -0.5, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        )  # fmt: skip
        return o[0], final

    def _chunked(self, q, k, v, g, beta, h0, offsets, *, size: int):
        """fla's chunked kernel over [T', ...] rows -> (o [T', Hv, Dv], final)."""
        cu_cpu = torch.tensor(offsets, dtype=torch.long)  # chunk indices without a sync
        o, final = self.kernels.chunk(
            q[None], k[None], v[None], g[None], beta[None],
            scale=q.shape[-1] ** -0.5, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu_cpu.to(v.device),
            cu_seqlens_cpu=cu_cpu, chunk_size=size,
        )  # fmt: skip
        return o[0], final

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        states: torch.Tensor,
        cu_seqlens: Sequence[int] | torch.Tensor,
    ) -> torch.Tensor:
        """The reference's contract (`delta_rule.causal_conv1d`): x [T, C], weight
        [C, K], bias [C] or None, states [B, C, K - 1] (advanced in place) ->
        silu(conv) [T, C] in x's dtype. A decode step (one token a sequence) runs fla's
        update kernel, any other its varlen kernel, then its state kernel."""
        if weight.dtype == torch.float64:
            return reference.causal_conv1d(x, weight, bias, states, cu_seqlens)
        offsets = _offsets(cu_seqlens, x.shape[0])
        channels, width = weight.shape
        assert x.dim() == 2 and x.shape[1] == channels, (x.shape, weight.shape)
        assert states.shape == (len(offsets) - 1, channels, width - 1), states.shape
        assert weight.is_contiguous() and x.stride(1) == 1, (weight.stride(), x.stride())
        window = F.pad(states, (1, 0))  # [B, C, K]: fla's layout, its oldest column unread
        if all(e - s == 1 for s, e in pairwise(offsets)):
            # x: [B, C], one row a sequence; the window is shifted by one in place.
            y, window = self.kernels.conv_update(
                x=x, cache=window, weight=weight, bias=bias, activation="silu"
            )
            states.copy_(window[:, :, 1:])
            return y
        cu_cpu = torch.tensor(offsets, dtype=torch.long)
        y, final = self.kernels.conv(
            x=x[None], weight=weight, bias=bias, residual=None, initial_state=window,
            output_final_state=True, activation="silu", cu_seqlens=cu_cpu.to(x.device),
            cu_seqlens_cpu=cu_cpu,
        )  # fmt: skip
        states.copy_(final[:, :, 1:])
        return y[0]

    def __repr__(self) -> str:
        return f"FlaOps({self.device})"


@dataclass(frozen=True)
class _Group:
    """Some sequences of a step, run by one kernel: their token rows and states.
    `index` and `rows` are None when the group is every sequence of the step."""

    offsets: list[int]  # the group's own B' + 1 offsets into its rows
    index: torch.Tensor | None  # [B'] the sequences' places in `states`
    rows: torch.Tensor | None  # [T'] their rows of the step

    @classmethod
    def of(cls, seqs: list[int], spans: list[tuple[int, int]], device: torch.device) -> _Group:
        lengths = [spans[b][1] - spans[b][0] for b in seqs]
        offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        if len(seqs) == len(spans):
            return cls(offsets, None, None)
        rows = torch.cat([torch.arange(*spans[b]) for b in seqs])
        return cls(offsets, torch.tensor(seqs, device=device), rows.to(device))

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.rows is None else x.index_select(0, self.rows)


def _offsets(cu_seqlens: Sequence[int] | torch.Tensor, tokens: int) -> list[int]:
    """Host ints covering the step's `tokens` (one device sync for a tensor)."""
    offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != tokens:
        raise ValueError(f"cu_seqlens {offsets} is not B + 1 offsets from 0 to {tokens}")
    if any(b < a for a, b in pairwise(offsets)):
        raise ValueError(f"cu_seqlens {offsets} is not B + 1 rising offsets")
    return [int(o) for o in offsets]
