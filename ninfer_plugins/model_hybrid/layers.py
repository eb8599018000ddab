"""The token mixers of Qwen3-Next and Qwen3.5: gated full attention and the Gated DeltaNet.

Reference: `transformers.models.qwen3_next.modeling_qwen3_next` and `qwen3_5` (5.24),
which differ only in how the DeltaNet's input projections are laid out (`_project`). Tensors are the
runtime's flat ragged batch: T tokens of every sequence in the step, one after another.
The checkpoint's own layouts are kept (no row permutation at load), so a quantized or
backend-packed projection works as for the dense family; the few reorderings they imply
happen on activations, where they cost one small copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_core.model.layers import empty_param
from ninfer_core.model.ops import KernelOps
from ninfer_plugins.model_hybrid.config import HybridConfig

if TYPE_CHECKING:
    from ninfer_core.kv.state import StepStates
    from ninfer_core.model.attention_meta import AttentionMetadata


class ZeroCentredRMSNorm(nn.Module):
    """Qwen3NextRMSNorm: `normed(x) * (1 + w)`, computed in fp32 and then cast.

    The checkpoint stores w centred on zero; `weight` is loaded as fp32 (whatever the
    compute dtype: transformers multiplies by `1 + w.float()`) and turned into `1 + w`
    in place once after loading (`finalize`), so the kernel's plain `rms_norm` does the
    work, the product rounds once as transformers' `(x * (1 + w.float())).type_as(x)`
    does, and the norm holds one fp32 vector, not w and `1 + w` both (the memory plan
    counts 4 bytes an element: `HELD_DTYPE`)."""

    #: The dtype `weight` is held in, whatever the compute dtype.
    HELD_DTYPE = torch.float32

    def __init__(self, size: int, eps: float, ops: KernelOps, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops, self.eps, self.dtype = ops, eps, dtype
        self.weight = empty_param(size, dtype=self.HELD_DTYPE, device=ops.device)
        #: Whether `weight` holds `1 + w` yet (`finalize` ran).
        self.finalized = False

    @torch.no_grad()
    def finalize(self) -> None:
        """After loading: `weight` becomes the fp32 `1 + w` the forward multiplies by
        (once; a second call changes nothing)."""
        if not self.finalized:
            self.weight.add_(1.0)
            self.finalized = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight if self.finalized else 1.0 + self.weight
        return self.ops.rms_norm(x, scale, self.eps).to(self.dtype)


class GatedAttention(nn.Module):
    """Full attention over the paged cache, with an output gate.

    `q_proj` yields, per head, the query (first head_dim rows) then the gate (next
    head_dim). q and k are RMS-normalised per head (zero-centred), RoPE rotates only the
    first `rotary_dim` dims of each head, and the output is `o_proj(attn * sigmoid(gate))`.
    q|k|v are fused into one `qkv_proj` at load, as in the dense decoder."""

    def __init__(
        self, config: HybridConfig, kv_index: int, ops: KernelOps, dtype: torch.dtype
    ) -> None:
        super().__init__()
        base = config.base
        #: The pool's layer number, under both names the callers use (`layer`: the
        #: dense `Attention`'s, read by `model/decode_graph.attend_cached`).
        self.ops, self.kv_index, self.layer = ops, kv_index, kv_index
        self.num_heads, self.num_kv_heads = base.num_heads, base.num_kv_heads
        self.head_dim, self.rotary_dim = base.head_dim, config.rotary_dim
        self.q_size, self.kv_size = base.q_size, base.kv_size
        self.scale = base.head_dim**-0.5
        h, dev = base.hidden_size, ops.device
        self.qkv_proj = empty_param(2 * self.q_size + 2 * self.kv_size, h, dtype=dtype, device=dev)
        self.o_proj = empty_param(h, self.q_size, dtype=dtype, device=dev)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, base.rms_norm_eps, ops, dtype)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, base.rms_norm_eps, ops, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_store,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        q, gate, k, v = self.project(x, cos, sin)
        out = self.ops.paged_attention(q, k, v, kv_store, self.kv_index, meta, self.scale)
        return self.output(out, gate)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """x: [T, hidden] -> q [T, H, D] (normed, rotated), its gate [T, H, D], k
        [T, Hkv, D] (normed, rotated), v [T, Hkv, D]."""
        t, d = x.shape[0], self.head_dim
        qkv = self.ops.linear(x, self.qkv_proj)
        qg, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.reshape(t, self.num_heads, 2 * d).chunk(2, dim=-1)  # per head: q | gate
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))
        q, k = self._rope(q, k, cos, sin)
        return q, gate, k, v.reshape(t, self.num_kv_heads, d)

    def output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The attention's rows out [T, H, D], gated by `gate` [T, H, D] -> [T, hidden]."""
        t = out.shape[0]
        out = out.reshape(t, self.q_size) * torch.sigmoid(gate.reshape(t, self.q_size))
        return self.ops.linear(out, self.o_proj)

    def _rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the first `rotary_dim` dims of each head; the rest pass through."""
        r = self.rotary_dim
        if r == self.head_dim:
            return self.ops.apply_rope(q, k, cos, sin)
        q_rot, k_rot = self.ops.apply_rope(
            q[..., :r].contiguous(), k[..., :r].contiguous(), cos, sin
        )
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention: a causal depthwise conv over q|k|v, then the gated
    delta rule, then an RMSNorm gated by silu(z) and `out_proj`.

    It keeps a state per sequence (`SequenceState` of the family's `layer_caches`): the
    convolution's last K - 1 inputs [conv_dim, K - 1] and the recurrent state
    [Hv, Dk, Dv], both fp32. Each forward reads the batch's states, lets the two ops
    advance them in place over every sequence's tokens, and writes them back, so one
    pass, a chunked prefill and decode token by token give the same numbers.
    """

    #: `dt_bias` and `A_log` are held in fp32 whatever the compute dtype, as transformers
    #: computes with them: `-A_log.float().exp() * softplus(a.float() + dt_bias)`.
    DECAY_DTYPE = torch.float32

    def __init__(
        self, config: HybridConfig, layer: int, ops: KernelOps, dtype: torch.dtype
    ) -> None:
        super().__init__()
        lin, h, dev = config.linear, config.base.hidden_size, ops.device
        self.ops, self.layer, self.dtype, self.cfg = ops, layer, dtype, lin
        self.eps = config.base.rms_norm_eps
        self.grouped = config.grouped_projections
        # Qwen3.5's four projections are fused into the same two matrices at load
        # (q|k|v then z, b then a), so both layouts share parameters and packing.
        qkvz = 2 * lin.key_dim + 2 * lin.value_dim
        self.in_proj_qkvz = empty_param(qkvz, h, dtype=dtype, device=dev)
        self.in_proj_ba = empty_param(2 * lin.num_value_heads, h, dtype=dtype, device=dev)
        # The checkpoint's [C, 1, K] (an nn.Conv1d with groups = C); the op reads [C, K].
        self.conv1d_weight = empty_param(lin.conv_dim, 1, lin.conv_kernel, dtype=dtype, device=dev)
        decay = self.DECAY_DTYPE
        self.dt_bias = empty_param(lin.num_value_heads, dtype=decay, device=dev)
        self.A_log = empty_param(lin.num_value_heads, dtype=decay, device=dev)
        self.norm_weight = empty_param(lin.value_head_dim, dtype=dtype, device=dev)
        self.out_proj = empty_param(h, lin.value_dim, dtype=dtype, device=dev)

    def forward(
        self, x: torch.Tensor, states: StepStates, cu_seqlens: Sequence[int]
    ) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        c, t = self.cfg, x.shape[0]
        mixed, z, b, a = self._project(x)  # mixed: [T, conv_dim], the conv's q | k | v
        conv_state, recurrent = states.read(self.layer)  # copies, advanced in place below
        weight = self.conv1d_weight.view(c.conv_dim, c.conv_kernel)
        mixed = self.ops.causal_conv1d(mixed, weight, None, conv_state, cu_seqlens)
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = q.reshape(t, c.num_key_heads, c.key_head_dim)
        k = k.reshape(t, c.num_key_heads, c.key_head_dim)
        v = v.reshape(t, c.num_value_heads, c.value_head_dim)
        beta, g = self.gates(b, a)
        out = self.ops.gated_delta_rule(q, k, v, g, beta, recurrent, cu_seqlens)
        states.write(self.layer, (conv_state, recurrent))
        return self.output(out, z)

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """b, a: [T, Hv] -> beta (the write strength, in (0, 1)) and g (the log-decay,
        fp32, <= 0), [T, Hv] each."""
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        return torch.sigmoid(b), g

    def output(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The recurrence's rows out [T, Hv, Dv], normed and gated by z [T, Hv, Dv],
        projected back -> [T, hidden]."""
        # Qwen3NextRMSNormGated: plain w (not 1 + w), then * silu(z) in fp32.
        normed = self.ops.rms_norm(out, self.norm_weight, self.eps)
        gated = (normed * F.silu(z.float())).to(self.dtype)
        return self.ops.linear(gated.reshape(out.shape[0], self.cfg.value_dim), self.out_proj)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [T, hidden] -> q|k|v [T, conv_dim] (contiguous), z [T, Hv, Dv], b, a
        [T, Hv]."""
        c, t = self.cfg, x.shape[0]
        qkvz = self.ops.linear(x, self.in_proj_qkvz)
        ba = self.ops.linear(x, self.in_proj_ba)
        if self.grouped:
            q, k, v, z, b, a = self._ungroup(qkvz, ba)
            mixed = torch.cat((q, k, v), dim=-1)
        else:  # Qwen3.5: rows q | k | v | z and b | a, already the conv's channel order
            mixed, z = qkvz.split([c.conv_dim, c.value_dim], dim=-1)
            mixed = mixed.contiguous()
            b, a = ba.split([c.num_value_heads, c.num_value_heads], dim=-1)
        return mixed, z.reshape(t, c.num_value_heads, c.value_head_dim), b, a

    def _ungroup(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Qwen3-Next's grouped rows to the flat q, k, v, z, b, a.

        `in_proj_qkvz` rows are grouped by key head: for each of the Hk key heads, its
        q (Dk), k (Dk), then the v and z of its Hv / Hk value heads; `in_proj_ba` holds,
        per key head, the b then the a of its value heads (transformers'
        `fix_query_key_value_ordering`)."""
        c, t = self.cfg, qkvz.shape[0]
        r, dk, dv = c.group, c.key_head_dim, c.value_head_dim
        q, k, v, z = qkvz.view(t, c.num_key_heads, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba.view(t, c.num_key_heads, 2 * r).split([r, r], dim=-1)
        return (
            q.reshape(t, c.key_dim),
            k.reshape(t, c.key_dim),
            v.reshape(t, c.value_dim),
            z.reshape(t, c.value_dim),
            b.reshape(t, c.num_value_heads),
            a.reshape(t, c.num_value_heads),
        )
