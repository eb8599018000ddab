"""The `torch` kernel backend: the reference every other backend is checked against.

Plain PyTorch ops; runs wherever torch runs. Attention gathers the cached pages of
the batch and calls `F.scaled_dot_product_attention` (grouped-query heads through
`enable_gqa`), with one mask built per step in `prepare`, not per layer.
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
        """Build the step's attention mask (and padding index for batches) once."""
        b, qmax, s = meta.batch_size, meta.max_query_len, meta.max_context_len
        if b == 1 and qmax in (1, s):
            return  # decode or a whole prompt: SDPA needs no mask (see paged_attention)
        dev = meta.slot_mapping.device
        qlen = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # [B]
        # Query i of sequence b sits at position ctx_b - qlen_b + i and sees keys <= it.
        q_pos = (meta.context_lens_tensor - qlen)[:, None] + torch.arange(qmax, device=dev)
        keys = torch.arange(s, device=dev)
        meta.plan["mask"] = keys[None, None, None, :] <= q_pos[:, None, :, None]  # [B, 1, Qmax, S]
        if b > 1:
            # Row of each flattened token in the padded [B * Qmax] query batch.
            rows = [i * qmax + j for i, n in enumerate(meta.query_lens) for j in range(n)]
            meta.plan["pad_index"] = torch.tensor(rows, dtype=torch.int64).to(dev)

    def paged_attention(self, q, k_new, v_new, kv_store, layer, meta, scale):
        # q: [T, H, D], k_new/v_new: [T, Hkv, D]
        kv_store.write(layer, meta.slot_mapping, k_new, v_new)
        t, h, d = q.shape
        if meta.batch_size == 1:
            length = meta.context_lens[0]
            k, v = gather_heads(kv_store, layer, meta.block_tables[0], length, q.dtype)
            if t == 1:  # decode: the one new token sees everything cached
                return _decode_one(q, k, v, scale)
            if t == length:  # whole-prompt prefill: plain causal
                mask, causal = None, True
            else:  # a later prefill chunk: causal, offset by the cached prefix
                mask, causal = meta.plan["mask"], False
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k[None],
                v[None],
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=True,
            )  # [1, H, T, D]
            return out[0].transpose(0, 1)
        # Batch: pad queries to [B, Qmax], gather every sequence's pages, mask per row.
        b, qmax, s = meta.batch_size, meta.max_query_len, meta.max_context_len
        nb = -(-s // meta.block_size)
        k, v = gather_heads(kv_store, layer, meta.block_tables[:, :nb], s, q.dtype)
        pad_index = meta.plan["pad_index"]
        qp = q.new_zeros(b * qmax, h, d).index_copy_(0, pad_index, q)
        qp = qp.view(b, qmax, h, d).transpose(1, 2)  # [B, H, Qmax, D]
        out = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=meta.plan["mask"], scale=scale, enable_gqa=True
        )  # [B, H, Qmax, D]
        return out.transpose(1, 2).reshape(b * qmax, h, d)[pad_index]


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
