"""The hybrid decoder's decode step and verifying forward as traceable functions
(`CausalLM.decode_graph`, `verify_graph`), beside the dense ones
(`ninfer_core/model/decode_graph.py`, `verify_graph.py`).

The gated full-attention layers attend as the dense graphs do (`attend_cached`: over the
cached pages, the step's own keys apart, nothing written); their K/V come back for the
caller to store. The Gated DeltaNet layers read each sequence's conv and recurrent state
from the state pool's current buffer (`state_rows`: one pool row a sequence), advance
them over the step's rows in plain torch ops, and return the new states, which the caller
writes into the pool's other buffer and commits (`CompiledDecode`), as after an eager
step. No host loop over sequences, no host reads: the eager ops
(`kernels/delta_rule.py`) slice a ragged batch by host offsets, which these rows never
need, since every sequence runs `width` rows.

A verifying forward's sequence with fewer real rows than `width` is padded with copies of
its last row (`CompiledVerify`), which repeat that row's position: a row is real where its
position is row 0's plus its index. A padded row neither decays nor writes the recurrent
state (g = 0, beta = 0, as the eager batch masks a short sequence's steps), and the conv
state is cut at the sequence's own end, so the states returned are those after the real
rows, what the eager forward leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ninfer_core.kernels.delta_rule import l2norm
from ninfer_core.model.decode_graph import attend_cached

if TYPE_CHECKING:
    from ninfer_core.kv.state import SequenceStatePool
    from ninfer_plugins.model_hybrid.layers import GatedDeltaNet
    from ninfer_plugins.model_hybrid.model import HybridDecoder


def hybrid_graph(
    model: HybridDecoder,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_store,
    block_table: torch.Tensor,
    context: torch.Tensor,
    width: int,
    state_pool: SequenceStatePool,
    state_rows: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """`width` rows for each of B sequences: input_ids, positions [B * width]
    (sequence-major), block_table [B, P], context [B] (row 0's), state_rows [B] (each
    sequence's current row of the pool's buffers) -> (final hidden states [B * width,
    hidden], K, V [attention layers, B * width, Hkv, D], then every Gated DeltaNet
    layer's new conv [B, C, K - 1] and recurrent [B, Hv, Dk, Dv] states, in layer
    order)."""
    b = block_table.shape[0]
    valid = None
    if width > 1:  # padded rows repeat their sequence's last position
        grid = positions.view(b, width)
        steps = torch.arange(width, device=positions.device)
        valid = (grid - grid[:, :1]) == steps[None, :]  # [B, W]
    cos, sin = model.rotary(positions, model.dtype)
    x = model.embed(input_ids)  # [R, hidden] fp32
    keys, values, states = [], [], []
    for layer in model.layers:
        y = layer.input_layernorm(x)
        if layer.linear_attn is not None:
            bufs = state_pool.buffers[layer.linear_attn.layer]
            conv, recurrent = (buf.index_select(0, state_rows) for buf in bufs)
            mixed, conv, recurrent = delta_rows(layer.linear_attn, y, conv, recurrent, valid)
            states += [conv, recurrent]
        else:
            attn = layer.self_attn
            q, gate, k, v = attn.project(y, cos, sin)  # [R, H, D], [R, Hkv, D]
            out = attend_cached(kv_store, attn, q, k, v, block_table, context, width)
            mixed = attn.output(out, gate)
            keys.append(k)
            values.append(v)
        h = x + mixed
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(x), torch.stack(keys), torch.stack(values), *states


def delta_rows(
    layer: GatedDeltaNet,
    x: torch.Tensor,
    conv: torch.Tensor,
    recurrent: torch.Tensor,
    valid: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer over W rows of each of B sequences, as the eager layer
    computes them (`GatedDeltaNet.forward` through the reference ops' recurrent form).

    x: [B * W, hidden] (normed); conv [B, C, K - 1], recurrent [B, Hv, Dk, Dv]: the
    states before the rows (fp32, as the pool keeps them); valid: [B, W], the real rows
    (None: all) -> (out [B * W, hidden], the conv and recurrent states after the real
    rows)."""
    c = layer.cfg
    b = conv.shape[0]
    w = x.shape[0] // b
    mixed, z, beta_raw, a = layer._project(x)  # [R, C], [R, Hv, Dv], [R, Hv] x 2
    weight = layer.conv1d_weight.view(c.conv_dim, c.conv_kernel)
    mixed, conv = conv_rows(mixed.view(b, w, c.conv_dim), weight, conv, valid)
    q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
    beta, g = layer.gates(beta_raw, a)
    hv, dk = c.num_value_heads, c.key_head_dim
    group = hv // c.num_key_heads
    # Normalised and widened as the reference op does; [B, W, Hv, D] after the grouping.
    qn = l2norm(q.reshape(b, w, c.num_key_heads, dk).float()) * dk**-0.5
    kn = l2norm(k.reshape(b, w, c.num_key_heads, dk).float())
    qn, kn = qn.repeat_interleave(group, dim=2), kn.repeat_interleave(group, dim=2)
    vf = v.reshape(b, w, hv, c.value_head_dim).float()
    gf, bf = g.view(b, w, hv), beta.view(b, w, hv).float()
    if valid is not None:  # a padded row neither decays nor writes the state
        gf, bf = gf * valid[:, :, None], bf * valid[:, :, None]
    outs = []
    state = recurrent
    for t in range(w):
        o, state = delta_step(qn[:, t], kn[:, t], vf[:, t], gf[:, t], bf[:, t], state)
        outs.append(o.to(v.dtype))
    out = torch.stack(outs, dim=1).view(b * w, hv, c.value_head_dim)
    return layer.output(out, z), conv, state


def delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for every sequence and head: q, k [B, Hv, Dk]
    (normalised), v [B, Hv, Dv], g, beta [B, Hv], state [B, Hv, Dk, Dv] fp32 -> (o
    [B, Hv, Dv], the state after the token). With d = e^g and S the state before:
    `u = beta (v - d Sᵀk)`, `o = d Sᵀq + (k·q) u`, `S' = d S + k uᵀ` (the reference's
    `_recurrent`), written as products and sums the compiler fuses into passes over S."""
    d = g.exp()[:, :, None]  # [B, Hv, 1]
    read_k = (state * k[..., None]).sum(-2)  # [B, Hv, Dv]: Sᵀk
    read_q = (state * q[..., None]).sum(-2)  # Sᵀq
    u = beta[:, :, None] * (v - d * read_k)
    kq = (q * k).sum(-1, keepdim=True)  # [B, Hv, 1]
    out = d * read_q + kq * u
    state = state * d[..., None] + k[..., None] * u[:, :, None, :]
    return out, state


def conv_rows(
    x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(depthwise causal conv) over W rows of each of B sequences, behind each one's
    conv state, as the reference's batched form computes it (`_conv_batch`: in the
    weight's dtype, accumulated in fp32 and rounded once).

    x: [B, W, C]; weight: [C, K]; conv: [B, C, K - 1] -> ([B * W, C] in x's dtype, the
    last K - 1 inputs before each sequence's end, [B, C, K - 1])."""
    b, w, channels = x.shape
    carried = conv.shape[2]
    window = torch.cat((conv.to(weight.dtype), x.to(weight.dtype).transpose(1, 2)), 2)
    columns, taps = window.float(), weight.float()  # [B, C, K - 1 + W], [C, K]
    y = columns[:, :, :w] * taps[:, 0, None]
    for j in range(1, weight.shape[1]):
        y = y + columns[:, :, j : j + w] * taps[:, j, None]
    out = F.silu(y.to(weight.dtype)).transpose(1, 2).reshape(b * w, channels).to(x.dtype)
    if valid is None:
        return out, window[:, :, w:]
    ends = valid.sum(1)  # [B]: real rows
    cols = ends[:, None] + torch.arange(carried, device=x.device)[None, :]  # [B, K - 1]
    return out, window.gather(2, cols[:, None, :].expand(b, channels, carried))
