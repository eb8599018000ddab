"""Building blocks of a dense decoder: RMSNorm, SwiGLU MLP, attention over the paged cache.

Parameters are plain uninitialised tensors filled by `weights.load_weights`. Projections
that read the same input are fused at load time (q|k|v into `qkv_proj`, gate|up into
`gate_up_proj`) so a decode step issues one GEMM where the checkpoint has two or three.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ninfer_core.model.config import ModelConfig
from ninfer_core.model.ops import KernelOps
from ninfer_core.quant.tensor import QuantizedTensor

if TYPE_CHECKING:
    from ninfer_core.model.attention_meta import AttentionMetadata


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised, frozen parameter: inference never needs autograd state."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelOps, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops, self.eps = ops, eps
        self.weight = empty_param(size, dtype=dtype, device=ops.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up as one [2I, H] weight."""

    def __init__(self, config: ModelConfig, ops: KernelOps, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops = ops
        h, i, dev = config.hidden_size, config.intermediate_size, ops.device
        self.intermediate_size = i
        self.gate_up_proj = empty_param(2 * i, h, dtype=dtype, device=dev)
        self.down_proj = empty_param(h, i, dtype=dtype, device=dev)
        self.gate_up_bias = empty_param(2 * i, dtype=dtype, device=dev) if config.mlp_bias else None
        self.down_bias = empty_param(h, dtype=dtype, device=dev) if config.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> gate_up: [T, 2I] -> [T, H]
        gate_up = self.ops.linear(x, self.gate_up_proj, self.gate_up_bias)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.ops.linear(self.ops.silu_and_mul(gate, up), self.down_proj, self.down_bias)


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, config: ModelConfig, layer: int, ops: KernelOps, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops, self.layer = ops, layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        h, dev = config.hidden_size, ops.device
        qkv = self.q_size + 2 * self.kv_size
        self.qkv_proj = empty_param(qkv, h, dtype=dtype, device=dev)
        self.o_proj = empty_param(h, self.q_size, dtype=dtype, device=dev)
        self.qkv_bias = empty_param(qkv, dtype=dtype, device=dev) if config.attention_bias else None
        self.o_bias = empty_param(h, dtype=dtype, device=dev) if config.attention_bias else None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, dtype)
        else:
            self.q_norm = self.k_norm = None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> q [T, H, D], and k, v [T, Hkv, D], normed and rotated."""
        t = x.shape[0]
        qkv = self.ops.linear(x, self.qkv_proj, self.qkv_bias)  # [T, (H + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.apply_rope(q, k, cos, sin)
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """out: [T, H, D] -> [T, hidden]."""
        return self.ops.linear(out.reshape(out.shape[0], self.q_size), self.o_proj, self.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_store,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = self.ops.paged_attention(q, k, v, kv_store, self.layer, meta, self.scale)
        return self.output(out)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, layer: int, ops: KernelOps, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops, dtype)
        self.self_attn = Attention(config, layer, ops, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops, dtype)
        self.mlp = MLP(config, ops, dtype)

    def forward(self, x, cos, sin, kv_store, meta: AttentionMetadata) -> torch.Tensor:
        return self.mlp_block(x + self.self_attn(self.input_layernorm(x), cos, sin, kv_store, meta))

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        """The layer after attention: h + mlp(norm(h)), h the residual with attention added."""
        return h + self.mlp(self.post_attention_layernorm(h))


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes a model's weights hold: parameters, quantized weights (codes and scales),
    packed copies and other tensors its modules keep (none of which are parameters); an
    object held twice (a tied head) counts once, and so does memory two holders share (a
    packed head over the embedding's own bytes). `CausalLM.weight_bytes` of every
    family."""
    spans: set[tuple[int, int]] = set()  # (address, bytes) of the tensors counted
    total = 0
    for value in _holdings(model):
        if isinstance(value, torch.Tensor):
            total += _unseen_bytes([value], spans)
        else:
            held = _held_tensors(value)  # QuantizedTensor, a backend's packed weight
            total += value.nbytes if held is None else _unseen_bytes(held, spans)
    return total


def held_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a model's weights are (those `held_bytes` counts, where a holder
    shows them): what `memory.huge_pages.consolidate` moves into huge pages."""
    out: list[torch.Tensor] = []
    for value in _holdings(model):
        out.extend([value] if isinstance(value, torch.Tensor) else _tensors_of(value))
    return out


def _holdings(model: torch.nn.Module) -> Iterator[Any]:
    """Each object a model's modules hold that is or holds weights, once: tensors, and
    objects with an integer `nbytes` (quantized and packed weights)."""
    seen: set[int] = set()  # objects yielded
    for module in model.modules():
        for value in (*module._parameters.values(), *vars(module).values()):
            if value is None or id(value) in seen:
                continue
            if isinstance(value, torch.Tensor) or isinstance(getattr(value, "nbytes", None), int):
                seen.add(id(value))
                yield value


def _held_tensors(holder: Any) -> list[torch.Tensor] | None:
    """The tensors `holder` keeps, where they make up its `nbytes`; None where it holds
    something else too (then all of `nbytes` counts)."""
    tensors = _tensors_of(holder)
    return tensors if sum(_size(t) for t in tensors) == holder.nbytes else None


def _tensors_of(holder: Any) -> list[torch.Tensor]:
    """The tensors among `holder`'s attributes."""
    names = getattr(holder, "__slots__", None) or list(getattr(holder, "__dict__", {}))
    return [t for n in names if isinstance(t := getattr(holder, n, None), torch.Tensor)]


def _unseen_bytes(tensors: list[torch.Tensor], spans: set[tuple[int, int]]) -> int:
    """Bytes of `tensors` whose memory was not counted already (marked counted here)."""
    total = 0
    for t in tensors:
        span = (t.data_ptr(), _size(t))
        if span not in spans:
            spans.add(span)
            total += span[1]
    return total


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pack_weight(ops: KernelOps, w: Any, dtype: torch.dtype) -> Any:
    """`ops.pack_linear(w)`, telling it the compute dtype when the weight cannot say it
    (a quantized one)."""
    if isinstance(w, QuantizedTensor):
        return ops.pack_linear(w, dtype=dtype)
    return ops.pack_linear(w)


def pack_params(
    owners: Iterable[tuple[nn.Module, str]], ops: KernelOps, dtype: torch.dtype
) -> None:
    """Replace each `(module, name)` weight by what the backend packs it into, once after
    loading; a packed weight is no longer a parameter (it may not be a tensor at all)."""
    for module, name in owners:
        weight = getattr(module, name)
        packed = pack_weight(ops, weight, dtype)
        if packed is not weight:
            module._parameters.pop(name, None)
            setattr(module, name, packed)


def embed_rows(embed_tokens: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids: [T] -> the residual stream's first values [T, hidden], fp32; a quantized
    embedding dequantizes only these rows."""
    if isinstance(embed_tokens, QuantizedTensor):
        return embed_tokens.embedding(input_ids, torch.float32)
    return embed_tokens[input_ids].float()
