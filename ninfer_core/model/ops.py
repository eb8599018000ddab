"""`KernelOps`: every tensor operation the model runtime calls through a kernel backend.

The model never calls a kernel directly; it holds one `KernelOps` and calls these
methods, so a backend (the torch reference in `ninfer_core/kernels/reference.py`, Triton,
CuPy) can replace any subset (`ninfer_core/kernels/compose.py` composes them per op).
Shapes use T = tokens in the step (all sequences flattened), H = query heads, Hkv = KV
heads, D = head dim; for the linear-attention ops (Gated DeltaNet, Qwen3-Next), B =
sequences in the step and `cu_seqlens` their B + 1 token offsets into the T tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ninfer_core.model.attention_meta import AttentionMetadata
    from ninfer_core.plugin_types import PackedSizer


#: Decode lengths per doubling of the context (see `decode_length`).
DECODE_LENGTHS_PER_OCTAVE = 8


def decode_length(context: int, block_size: int) -> int:
    """The key count a decode row of `context` tokens attends over: `context` rounded up
    to a multiple of the page below 16 pages, then to one of 8 lengths per doubling.

    Why: on the CPU, oneDNN compiles (about 2-20 ms) and caches (about 1.3 MiB) a bf16
    matmul kernel per shape, so attention over a context that grows by one token a step
    built a new kernel every step and grew the process by ~2.6 MiB a step
    (docs/memory.md). Padded, contexts up to N tokens give `decode_length_count(N)`
    shapes, and a row does at most 1/8 more attention work (under one page below 16
    pages). A backend whose kernels take any length need not pad.
    """
    step = block_size
    while step * 2 * DECODE_LENGTHS_PER_OCTAVE <= context:
        step *= 2
    return -(-context // step) * step


def decode_length_count(max_context: int, block_size: int) -> int:
    """How many distinct `decode_length`s contexts of 1..`max_context` tokens give: 16 up
    to 16 pages, then 8 per doubling (48 for 4096 tokens of 16-token pages, 88 for 128k),
    well inside the kernel caches' capacity (`ninfer_core.device.CPU_RUNTIME_ENV`)."""
    count, context = 0, 1
    while context <= max_context:  # one pass per distinct length: a few hundred at most
        count += 1
        context = decode_length(context, block_size) + 1
    return count


class PackedLinear:
    """The base of a weight `pack_linear` repacked into a layer that runs itself
    (`ninfer_core.plugin_types.PackedLinear`): `linear` calls `w(x, b)` for any subclass.

    A base class, not the protocol alone, because `linear` tells these weights from
    dense tensors and `QuantizedTensor`s by `isinstance` on every projection of every
    step: about 0.05 us against a class, 8 us against a runtime protocol (which calls
    `hasattr` for each member). Subclassing it is also the layer's own statement that
    it keeps the contract, where a structural match would take any callable with an
    `nbytes`."""

    #: Bytes the layer holds (codes, scales, a reordered copy of the weight), which
    #: `CausalLM.weight_bytes` counts: none of them is a parameter.
    nbytes: int

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] -> [T, out] in x.dtype: `F.linear(x, weight, b)` of the weight it
        holds, to the rounding of its kernel."""
        raise NotImplementedError


class KernelOps:
    """The op contract. Subclasses implement each method; the docstrings are the spec."""

    #: Short backend name, for logs and `ninfer probe`.
    name: str = "abstract"
    #: Optional (`ninfer_core.plugin_types.KernelOps`): bytes `pack_linear` would hold
    #: for a weight, from its format and shape alone. None: `ninfer plan` packs a probe.
    packed_nbytes: PackedSizer | None = None

    def __init__(self, device: torch.device | str = "cpu") -> None:
        #: Where the model's parameters and activations live.
        self.device = torch.device(device)

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per forward, before the layer loop: build per-step attention
        state (masks, index tensors) into `meta.plan` so no layer rebuilds it."""

    def linear(self, x: torch.Tensor, w: Any, b: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in], w: [out, in] (the HF layout) or what `pack_linear` made of it,
        b: [out] -> [T, out] in x.dtype.

        `w` may be a `QuantizedTensor` (`ninfer_core.quant.tensor`) when `pack_linear`
        kept one as it is; `QuantizedTensor.linear(x, b)` is the reference for that
        case (row chunks dequantized into x.dtype, then `F.linear`)."""
        raise NotImplementedError

    def pack_linear(self, w: Any, *, dtype: torch.dtype | None = None) -> Any:
        """Repack a loaded `[out, in]` weight into whatever this backend's GEMM reads
        fastest. Called once per weight after loading; the result is only ever handed
        back to `linear`. The default keeps the weight as it is.

        `w` is a dense tensor, or a `QuantizedTensor` (packed group codes and fp16
        scales). Only for the latter does the model pass `dtype`, the compute dtype its
        activations will have, since the weight itself does not tell; a backend that
        repacks quantized weights for a kernel picks it by that dtype. Anything returned
        for a quantized weight should have an `nbytes` property (`weight_bytes` counts it);
        a layer that multiplies by itself subclasses `PackedLinear`.
        """
        return w

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [..., N], w: [N] -> [..., N]; statistics in fp32, result in w.dtype.

        `x` may be wider than `w` (the dense decoder keeps its residual stream in fp32
        while its weights are bf16); the result is in the weight's dtype, the one the
        next GEMM reads. Same dtypes: the same as HF's `x.float()` ... `.to(x.dtype)`."""
        raise NotImplementedError

    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up: [T, I] -> silu(gate) * up: [T, I]."""
        raise NotImplementedError

    def apply_rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D], cos/sin: [T, D/2] -> rotated (q, k).

        Neox / HF layout: dimension i pairs with i + D/2 (`rotate_half`).
        """
        raise NotImplementedError

    def paged_attention(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        kv_store,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend. q: [T, H, D], k_new/v_new: [T, Hkv, D] -> [T, H, D].

        K/V go to `kv_store` at `meta.slot_mapping`; then each sequence's query tokens
        attend causally over its whole cached context (earlier steps plus this one).
        H is a multiple of Hkv (grouped-query attention).
        """
        raise NotImplementedError

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
        """The gated delta rule (Gated DeltaNet's linear attention) over a ragged batch.

        q, k: [T, Hqk, Dk]; v: [T, Hv, Dv] (Hv a multiple of Hqk: value head j reads q/k
        head j // (Hv / Hqk)); g: [T, Hv] log-decay (<= 0); beta: [T, Hv] in (0, 1);
        states: [B, Hv, Dk, Dv] fp32, each sequence's recurrent state before its tokens,
        UPDATED IN PLACE to the state after them; cu_seqlens: [B + 1] token offsets (host
        ints or a tensor) -> o: [T, Hv, Dv] in v's dtype.

        q and k are L2-normalised inside (eps 1e-6 under the root) and q scaled by
        Dk**-0.5. Per value head and token: `S = exp(g) S; u = beta (v - Sᵀk);
        S = S + k uᵀ; o = Sᵀq`. `chunk`: tokens per block of the chunked form a
        backend may use for long sequences (the result must not depend on it beyond
        rounding). Reference: `ninfer_core.kernels.delta_rule.gated_delta_rule`.
        """
        raise NotImplementedError

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        states: torch.Tensor,
        cu_seqlens: Sequence[int] | torch.Tensor,
    ) -> torch.Tensor:
        """silu(depthwise causal conv1d) over a ragged batch, with a carried state.

        x: [T, C]; weight: [C, K]; bias: [C] or None; states: [B, C, K - 1], each
        sequence's previous K - 1 inputs (zeros for a new sequence), UPDATED IN PLACE to
        its last K - 1 inputs; cu_seqlens: [B + 1] token offsets -> [T, C] in x's dtype.
        Prefill in pieces and decode token by token give what one pass does.
        Reference: `ninfer_core.kernels.delta_rule.causal_conv1d`.
        """
        raise NotImplementedError
