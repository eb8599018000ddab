"""The `torch` kernel backend: the reference every other backend is checked against.

Plain PyTorch ops; runs wherever torch runs. Attention gathers each sequence's cached
pages and calls `F.scaled_dot_product_attention` (grouped-query heads through
`enable_gqa`) for prefill, two small matmuls for a decode row; masks are built once
per step in `prepare`, not per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.engine.attention_meta import AttentionMetadata
from ninfer_core.model.ops import KernelOps
from ninfer_core.support import Support

_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class TorchOps(KernelOps):
    name = "torch"

    def linear(self, x, w, b=None):
        if w.layout == torch._mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")
        return F.linear(x, w, b)

    def pack_linear(self, w):
        """On the CPU, oneDNN's blocked weight layout: decode GEMVs then stream the
        weights at close to memory bandwidth (about 1.5-3x `F.linear` on plain
        row-major weights here), with identical results in bf16."""
        if self.device.type != "cpu" or w.dtype != torch.bfloat16 or not _MKLDNN:
            return w
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous())

    def rms_norm(self, x, w, eps):
        # Statistics in fp32, then back to x.dtype before the weight, as transformers does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    def silu_and_mul(self, gate, up):
        return F.silu(gate) * up

    def apply_rope(self, q, k, cos, sin):
        # q: [T, H, D], k: [T, Hkv, D], cos/sin: [T, D/2] -> broadcast over heads
        cos, sin = cos[:, None, :], sin[:, None, :]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        return rotate(q), rotate(k)

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-sequence query offsets and, for prefill chunks after a cached prefix, the
        causal mask offset by that prefix; built once per step, not per layer."""
        starts, masks, offset = [], [], 0
        dev = meta.slot_mapping.device
        for qlen, ctx in zip(meta.query_lens, meta.context_lens, strict=True):
            starts.append(offset)
            offset += qlen
            if qlen == 1 or qlen == ctx:
                masks.append(None)  # decode, or a whole prompt (plain causal)
            else:
                # Query i sits at position ctx - qlen + i and sees keys up to it.
                q_pos = torch.arange(ctx - qlen, ctx, device=dev)
                masks.append(torch.arange(ctx, device=dev)[None, :] <= q_pos[:, None])
        meta.plan["starts"], meta.plan["masks"] = starts, masks

    def paged_attention(self, q, k_new, v_new, kv_store, layer, meta, scale):
        """Each sequence attends over its own pages only: a ragged batch is never padded
        to its longest member (a decode row reads its L keys, not the batch maximum)."""
        # q: [T, H, D], k_new/v_new: [T, Hkv, D]
        kv_store.write(layer, meta.slot_mapping, k_new, v_new)
        plan, bs = meta.plan, meta.block_size
        outs = []
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
            start = plan["starts"][i]
            qi = q[start : start + qlen]  # [Q, H, D]
            table = meta.block_tables[i, : -(-ctx // bs)]
            k, v = gather_heads(kv_store, layer, table, ctx, q.dtype)  # [Hkv, L, D]
            if qlen == 1:
                outs.append(_decode_one(qi, k, v, scale))
                continue
            mask = plan["masks"][i]
            out = F.scaled_dot_product_attention(
                qi.transpose(0, 1)[None],
                k[None],
                v[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )  # [1, H, Q, D]
            outs.append(out[0].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def gather_heads(kv_store, layer: int, table: torch.Tensor, length: int, dtype: torch.dtype):
    """A sequence's (or batch's) K and V as `[(B,) Hkv, L, D]` in `dtype`.

    Stores that keep pages head-major offer `gather_heads`, which needs no
    transpose; any other store's token-major `gather` is transposed here.
    """
    if hasattr(kv_store, "gather_heads"):
        k, v = kv_store.gather_heads(layer, table, length)
    else:
        k, v = kv_store.gather(layer, table, length)
        k, v = k.transpose(-3, -2), v.transpose(-3, -2)
    return k.to(dtype), v.to(dtype)


def _decode_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token over its whole context, grouped heads as a batched matmul.

    CPU SDPA spends most of its time on setup for a single query row; two small
    matmuls with the softmax in fp32 are several times faster and as exact.
    """
    # q: [1, H, D], k/v: [Hkv, L, D] -> [1, H, D]
    h, d = q.shape[1], q.shape[2]
    hkv = k.shape[0]
    qg = q[0].view(hkv, h // hkv, d)  # [Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(1, 2)).float() * scale  # [Hkv, G, L]
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(1, h, d)  # [Hkv, G, D] -> [1, H, D]


class TorchBackend:
    name = "torch"
    description = "PyTorch reference kernels (F.linear, SDPA over gathered KV pages)"
    priority = 0

    def supports(self, device: DeviceInfo) -> Support:
        return Support.yes("runs wherever torch runs")

    def create_ops(self, device: DeviceInfo | torch.device | str) -> TorchOps:
        where = device.torch_device if isinstance(device, DeviceInfo) else device
        return TorchOps(where)


@hookimpl
def register_kernel_backends() -> list[TorchBackend]:
    return [TorchBackend()]
