"""`SparseMoE`: the Qwen3-Next / Qwen3.5-MoE mixture-of-experts MLP block.

Each token is routed to `num_experts_per_tok` (k) of `num_experts` SwiGLU experts and
always passes through one gated shared expert:

    out = sum_e w_e * down_e(silu(gate_e(x)) * up_e(x)) + sigmoid(x @ g.T) * shared(x)

The reference is transformers' `Qwen3NextSparseMoeBlock` (5.24). Transformers stores the
experts fused as 3-D parameters (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]); Qwen3-Next checkpoints keep one matrix per expert
(`mlp.experts.{e}.gate_proj.weight` ...), which transformers' `qwen2_moe` conversion
(`conversion_mapping.py`, also used by `qwen3_next` and `qwen3_5_moe_text`) stacks at
load, while the Hub's Qwen3.5-MoE checkpoints store them stacked. We keep the per-expert
names (`moe_slots`; a folder lists stacked experts under them, `stacked_experts.py`):
each expert's gate|up become one [2I, H] matrix like the dense `MLP`'s, and every matrix
goes through `pack_linear` on its own, so a quantized expert stays quantized and a
backend packs it like any projection.

Config fields come from `config.json` (`MoEConfig.from_hf` reads `ModelConfig.raw`);
`ModelConfig` itself stays the dense decoder's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ninfer_core.errors import ModelLoadError
from ninfer_core.model.config import LIMITS
from ninfer_core.model.config_fields import FieldReader
from ninfer_core.model.layers import empty_param, pack_params
from ninfer_core.model.ops import KernelOps
from ninfer_core.model.stacked_experts import MAX_EXPERTS, split_stacked
from ninfer_core.model.weights import WeightSlot
from ninfer_core.quant.tensor import QuantizedTensor


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The mixture-of-experts fields of a Qwen3-Next / Qwen3.5-MoE `config.json`."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    #: 0: no shared expert (Qwen3-MoE); Qwen3-Next and Qwen3.5-MoE have one.
    shared_expert_intermediate_size: int = 0
    #: Renormalise the k routing weights to sum to 1. Qwen3.5-MoE's config has no such
    #: field and always renormalises, hence the default.
    norm_topk_prob: bool = True
    #: Qwen3-Next: layer n is sparse when (n + 1) % step == 0 and n is not MLP-only.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], source: str = "config.json") -> MoEConfig:
        """Read the MoE fields; a missing, mistyped or out-of-range one is a
        `ModelLoadError` naming it (`config_fields.FieldReader`)."""
        f = FieldReader(raw, source)
        experts = f.int("num_experts", 1, MAX_EXPERTS)
        only = f.get("mlp_only_layers", [])
        if not isinstance(only, list) or any(
            isinstance(n, bool) or not isinstance(n, int) for n in only
        ):
            raise f.fail("mlp_only_layers", only, "it must be a list of layer indices")
        return cls(
            num_experts=experts,
            num_experts_per_tok=f.int("num_experts_per_tok", 1, experts),
            moe_intermediate_size=f.int("moe_intermediate_size", 1, LIMITS["intermediate_size"]),
            shared_expert_intermediate_size=f.int(
                "shared_expert_intermediate_size", 0, LIMITS["intermediate_size"], default=0
            ),
            norm_topk_prob=f.flag("norm_topk_prob", True),
            decoder_sparse_step=f.int("decoder_sparse_step", 1, LIMITS["num_layers"], default=1),
            mlp_only_layers=tuple(only),
        )

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` has a `SparseMoE` (else a dense `MLP`), as transformers'
        `Qwen3NextDecoderLayer` decides. Qwen3.5-MoE configs leave both fields out: all
        layers are sparse."""
        if layer in self.mlp_only_layers:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0


def moe_slots(
    config: MoEConfig, hidden_size: int, hf_prefix: str, our_prefix: str
) -> list[WeightSlot]:
    """The checkpoint tensors of one `SparseMoE`, named `hf_prefix + "gate.weight"` and
    so on (`hf_prefix` like `"model.layers.3.mlp."`), filling the `SparseMoE` whose
    parameters are named under `our_prefix`. Gate and up land in rows 0:I and I:2I of
    one matrix, as `weights.layer_slots` fuses the dense MLP's; the same slots serve
    `weights.load_weights` once a model family lists them."""
    h, i, s = hidden_size, config.moe_intermediate_size, config.shared_expert_intermediate_size
    hf, ours = hf_prefix, our_prefix
    slots = [WeightSlot(hf + "gate.weight", ours + "router", 0, (config.num_experts, h))]
    for e in range(config.num_experts):
        slots += _swiglu_slots(f"{hf}experts.{e}.", f"{ours}experts.{e}.", h, i)
    if s:
        slots += _swiglu_slots(hf + "shared_expert.", ours + "shared_expert.", h, s)
        slots.append(
            WeightSlot(hf + "shared_expert_gate.weight", ours + "shared_expert_gate", 0, (1, h))
        )
    return slots


def _swiglu_slots(hf: str, ours: str, h: int, i: int) -> list[WeightSlot]:
    return [
        WeightSlot(hf + "gate_proj.weight", ours + "gate_up_proj", 0, (i, h)),
        WeightSlot(hf + "up_proj.weight", ours + "gate_up_proj", i, (i, h)),
        WeightSlot(hf + "down_proj.weight", ours + "down_proj", 0, (h, i)),
    ]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k]).

    Softmax, top-k and renormalisation run in fp32 whatever the logits' dtype, as in
    transformers: bf16 probabilities would tie experts that fp32 tells apart. Tied
    probabilities are fine: `topk` picks k distinct experts among them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SwiGLU(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)), gate|up fused as in the dense `MLP`."""

    def __init__(self, hidden: int, intermediate: int, ops: KernelOps, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops, self.intermediate_size = ops, intermediate
        self.gate_up_proj = empty_param(2 * intermediate, hidden, dtype=dtype, device=ops.device)
        self.down_proj = empty_param(hidden, intermediate, dtype=dtype, device=ops.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> gate_up: [T, 2I] -> [T, H]
        gate, up = self.ops.linear(x, self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return self.ops.linear(self.ops.silu_and_mul(gate, up), self.down_proj)


class SparseMoE(nn.Module):
    """Router, `num_experts` SwiGLU experts, and an optional gated shared expert.

    The forward groups the T*k (token, expert) assignments by expert (one stable sort and
    one `bincount`) and runs one gate_up and one down GEMM per expert that has tokens,
    not one per token: a prefill chunk feeds each active expert all its rows at once,
    and a decode step (T = 1) touches only k experts' weights, the point of an MoE.
    """

    def __init__(
        self, config: MoEConfig, hidden_size: int, ops: KernelOps, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.config, self.ops, self.dtype = config, ops, dtype
        h, dev = hidden_size, ops.device
        self.router = empty_param(config.num_experts, h, dtype=dtype, device=dev)
        self.experts = nn.ModuleList(
            SwiGLU(h, config.moe_intermediate_size, ops, dtype) for _ in range(config.num_experts)
        )
        s = config.shared_expert_intermediate_size
        self.shared_expert = SwiGLU(h, s, ops, dtype) if s else None
        self.shared_expert_gate = empty_param(1, h, dtype=dtype, device=dev) if s else None

    @classmethod
    @torch.no_grad()
    def from_checkpoint(
        cls,
        tensors: Mapping[str, torch.Tensor | QuantizedTensor],
        config: MoEConfig,
        hidden_size: int,
        ops: KernelOps,
        dtype: torch.dtype,
        prefix: str = "",
    ) -> SparseMoE:
        """A block filled from `tensors` in the checkpoint's names under `prefix` (e.g.
        `"model.layers.3.mlp."`) and packed; gate and up are fused here. Dense tensors
        are cast to `dtype`; a quantized gate|up pair is stacked with `cat_rows`. Experts
        stored stacked (`experts.gate_up_proj`, Qwen3.5-MoE's layout) are split first
        (`unstack_experts`)."""
        block = cls(config, hidden_size, ops, dtype)
        if prefix + "experts.gate_up_proj" in tensors:
            tensors = {**tensors, **unstack_experts(tensors, config, hidden_size, prefix)}
        groups: dict[str, list[WeightSlot]] = {}
        for slot in moe_slots(config, hidden_size, prefix, ""):
            groups.setdefault(slot.param, []).append(slot)
        for param, slots in groups.items():
            block._fill(param, [(s, _checked(tensors, s)) for s in slots])
        block.pack_weights()
        return block

    def _fill(self, param: str, parts: list[tuple[WeightSlot, Any]]) -> None:
        module_name, _, attr = param.rpartition(".")
        module = self.get_submodule(module_name)
        quantized = [isinstance(p, QuantizedTensor) for _, p in parts]
        if any(quantized):
            if not all(quantized):
                names = ", ".join(s.hf_name for s, _ in parts)
                raise ModelLoadError(f"{names}: fused into {param}, they need one format")
            del module._parameters[attr]
            setattr(module, attr, QuantizedTensor.cat_rows([p for _, p in parts]))
            return
        target = getattr(module, attr)
        for slot, part in parts:
            target.narrow(0, slot.offset, slot.shape[0]).copy_(part)  # casts, moves

    def pack_weights(self) -> None:
        """Hand every matrix to the backend's `pack_linear`, once, after loading (as
        `DenseDecoder.pack_weights` does for the dense projections)."""
        owners: list[tuple[nn.Module, str]] = [(self, "router")]
        for expert in self._swiglus():
            owners += [(expert, "gate_up_proj"), (expert, "down_proj")]
        if self.shared_expert is not None:
            owners.append((self, "shared_expert_gate"))
        pack_params(owners, self.ops, self.dtype)

    def _swiglus(self) -> list[SwiGLU]:
        shared = [] if self.shared_expert is None else [self.shared_expert]
        return [*self.experts, *shared]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] in the compute dtype -> [T, H] in x.dtype
        # The router GEMM runs in x.dtype, as transformers' does, so routing sees the same
        # logits; softmax and top-k then run in fp32 (`route`).
        logits = self.ops.linear(x, self.router)  # [T, E]
        weights, ids = route(logits, self.config.num_experts_per_tok, self.config.norm_topk_prob)
        out = self._routed(x, weights, ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.ops.linear(x, self.shared_expert_gate))  # [T, 1]
            out = out + gate * self.shared_expert(x)
        return out

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H], weights: fp32 [T, k], ids: [T, k] -> sum_j weights[t, j] *
        expert_{ids[t, j]}(x[t]): [T, H] in x.dtype.

        Assignment a = t * k + j is sorted by expert; expert e's rows are a contiguous run
        of `counts[e]` (the one host sync: GEMM shapes need the counts). Each expert's
        output is written back to its assignments' own rows, so the weighted sum over j
        is one batched GEMM in token order with no atomics: unlike an `index_add_` into
        the output (atomic adds in any order on a GPU), the same step gives the same bits
        on every run. The price is one [T*k, H] buffer in x.dtype."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # assignments, grouped by expert
        counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
        ys = x.new_empty(t * k, x.shape[1])  # each assignment's expert output
        start = 0
        for e, n in enumerate(counts):
            if n:  # an expert no token chose costs no GEMM
                rows = order[start : start + n]
                ys[rows] = self.experts[e](x[rows // k])
                start += n
        # [T, 1, k] @ [T, k, H] -> [T, H]; the weights round to x.dtype as transformers'
        # do; torch's bf16 GEMMs accumulate in fp32 and round once.
        return torch.bmm(weights.to(x.dtype).unsqueeze(1), ys.view(t, k, x.shape[1])).squeeze(1)


def unstack_experts(
    tensors: Mapping[str, Any], config: MoEConfig, hidden_size: int, prefix: str
) -> dict[str, torch.Tensor]:
    """The per-expert tensors (`experts.{e}.gate_proj.weight` ...) as views of stacked
    ones: `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I], split as
    `stacked_experts.split_stacked` names them (the folder reader's rule too)."""
    e, i, h = config.num_experts, config.moe_intermediate_size, hidden_size
    expected = {"experts.gate_up_proj": (e, 2 * i, h), "experts.down_proj": (e, h, i)}
    shapes = {}
    for name, shape in expected.items():
        slot = WeightSlot(prefix + name, name, 0, shape)
        if not isinstance(_checked(tensors, slot), torch.Tensor):
            raise ModelLoadError(f"{slot.hf_name}: stacked experts must be dense tensors")
        shapes[slot.hf_name] = shape
    return {
        name: tensors[part.source][part.expert, part.start : part.stop]
        for name, part in split_stacked(shapes).items()
    }


def _checked(tensors: Mapping[str, Any], slot: WeightSlot) -> Any:
    """`tensors[slot.hf_name]`, after checking it is there with the slot's shape."""
    part = tensors.get(slot.hf_name)
    if part is None:
        raise ModelLoadError(f"missing tensor {slot.hf_name!r} (expected shape {list(slot.shape)})")
    if tuple(part.shape) != slot.shape:
        raise ModelLoadError(
            f"tensor {slot.hf_name!r} has shape {list(part.shape)}, expected {list(slot.shape)}"
        )
    return part
