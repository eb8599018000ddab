"""Map Hugging Face tensor names onto `DenseDecoder` parameters and load them.

The checkpoint's q/k/v and gate/up projections land in row ranges of our fused
`qkv_proj` and `gate_up_proj`. Every expected tensor and its shape is checked before
any is read, so a bad checkpoint fails in one line and never half-loads. Tensors we
do not use (rotary `inv_freq`, extra MTP layers, a tied model's `lm_head`) are ignored.

An artifact with `load_weight(name)` (the `.ninfer` reader) may hand back a
`QuantizedTensor` for a matrix; then the parameter is replaced by the quantized matrix
(a fused one stacked with `QuantizedTensor.cat_rows`), never by a dense copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_core.errors import ModelLoadError
from ninfer_core.model.config import ModelConfig
from ninfer_core.plugin_types import Artifact
from ninfer_core.quant.tensor import QuantizedTensor


@dataclass(frozen=True, slots=True)
class WeightSlot:
    """Checkpoint tensor `hf_name` fills rows `offset:offset + shape[0]` of `param`."""

    hf_name: str
    param: str
    offset: int
    shape: tuple[int, ...]
    #: The dtype `param` is held in whatever the compute dtype (a hybrid model's fp32
    #: norms and decay parameters), for the memory plan; None: the compute dtype (a
    #: quantized tensor keeps its stored format either way).
    dtype: torch.dtype | None = None


def weight_plan(config: ModelConfig) -> list[WeightSlot]:
    """Every tensor a dense checkpoint must provide, and where it goes."""
    h = config.hidden_size
    plan = [WeightSlot("model.embed_tokens.weight", "embed_tokens", 0, (config.vocab_size, h))]
    for n in range(config.num_layers):
        plan += layer_slots(config, f"model.layers.{n}.", f"layers.{n}.")
    plan.append(WeightSlot("model.norm.weight", "norm.weight", 0, (h,)))
    if not config.tie_word_embeddings:
        plan.append(WeightSlot("lm_head.weight", "lm_head", 0, (config.vocab_size, h)))
    return plan


def layer_slots(config: ModelConfig, hf_prefix: str, our_prefix: str) -> list[WeightSlot]:
    """One decoder layer's tensors, named `hf_prefix + "self_attn.q_proj.weight"` and so
    on in the checkpoint, filling the `DecoderLayer` whose parameters are named under
    `our_prefix`. Shared with the MTP layer, which is one such layer under other names."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    hf, ours = hf_prefix, our_prefix
    att, mlp = ours + "self_attn.", ours + "mlp."
    slots = [
        WeightSlot(hf + "input_layernorm.weight", ours + "input_layernorm.weight", 0, (h,)),
        WeightSlot(
            hf + "post_attention_layernorm.weight",
            ours + "post_attention_layernorm.weight",
            0,
            (h,),
        ),
        WeightSlot(hf + "self_attn.q_proj.weight", att + "qkv_proj", 0, (q, h)),
        WeightSlot(hf + "self_attn.k_proj.weight", att + "qkv_proj", q, (kv, h)),
        WeightSlot(hf + "self_attn.v_proj.weight", att + "qkv_proj", q + kv, (kv, h)),
        WeightSlot(hf + "self_attn.o_proj.weight", att + "o_proj", 0, (h, q)),
        WeightSlot(hf + "mlp.gate_proj.weight", mlp + "gate_up_proj", 0, (i, h)),
        WeightSlot(hf + "mlp.up_proj.weight", mlp + "gate_up_proj", i, (i, h)),
        WeightSlot(hf + "mlp.down_proj.weight", mlp + "down_proj", 0, (h, i)),
    ]
    if config.attention_bias:
        slots += [
            WeightSlot(hf + "self_attn.q_proj.bias", att + "qkv_bias", 0, (q,)),
            WeightSlot(hf + "self_attn.k_proj.bias", att + "qkv_bias", q, (kv,)),
            WeightSlot(hf + "self_attn.v_proj.bias", att + "qkv_bias", q + kv, (kv,)),
            WeightSlot(hf + "self_attn.o_proj.bias", att + "o_bias", 0, (h,)),
        ]
    if config.mlp_bias:
        slots += [
            WeightSlot(hf + "mlp.gate_proj.bias", mlp + "gate_up_bias", 0, (i,)),
            WeightSlot(hf + "mlp.up_proj.bias", mlp + "gate_up_bias", i, (i,)),
            WeightSlot(hf + "mlp.down_proj.bias", mlp + "down_bias", 0, (h,)),
        ]
    if config.qk_norm:
        slots += [
            WeightSlot(hf + "self_attn.q_norm.weight", att + "q_norm.weight", 0, (d,)),
            WeightSlot(hf + "self_attn.k_norm.weight", att + "k_norm.weight", 0, (d,)),
        ]
    return slots


def _fmt(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_weights(
    config: ModelConfig, artifact: Artifact, plan: list[WeightSlot] | None = None
) -> list[WeightSlot]:
    """The plan (a dense decoder's when None), after checking every tensor exists with
    the expected shape."""
    plan = weight_plan(config) if plan is None else plan
    names = set(artifact.tensor_names())
    for slot in plan:
        if slot.hf_name not in names:
            raise ModelLoadError(
                f"{artifact.path}: missing tensor {slot.hf_name!r} "
                f"(expected shape {_fmt(slot.shape)})"
            )
        found = tuple(artifact.tensor_shape(slot.hf_name))
        if found != slot.shape:
            # Name the shard when the reader can tell which file holds the tensor.
            file = artifact.tensor_file(slot.hf_name) if artifact.tensor_file else artifact.path
            raise ModelLoadError(
                f"{file}: tensor {slot.hf_name!r} has shape {_fmt(found)}, "
                f"expected {_fmt(slot.shape)}"
            )
    return plan


@torch.no_grad()
def load_weights(
    model: torch.nn.Module, artifact: Artifact, plan: list[WeightSlot] | None = None
) -> None:
    """Fill `model` from `artifact` by `plan` (a `DenseDecoder`'s when None), casting
    dense tensors to the model's dtype and installing quantized matrices as they are."""
    plan = check_weights(model.config, artifact, plan)
    params = dict(model.named_parameters())
    load = artifact.load_weight or artifact.load_tensor  # optional: None means dense
    groups: dict[str, list[WeightSlot]] = {}
    for slot in plan:
        groups.setdefault(slot.param, []).append(slot)
    for param, slots in groups.items():
        slots.sort(key=lambda s: s.offset)
        target = params[param]
        parts = []
        for slot in slots:
            part = load(slot.hf_name)
            if not isinstance(part, QuantizedTensor):  # dense: straight into its rows
                target.narrow(0, slot.offset, slot.shape[0]).copy_(part)  # casts, moves
            parts.append(part)
        quantized = [isinstance(p, QuantizedTensor) for p in parts]
        if any(quantized):
            _install_quantized(model, param, target, slots, parts, quantized, artifact)


def _install_quantized(model, param, target, slots, parts, quantized, artifact) -> None:
    names = ", ".join(
        f"{s.hf_name} ({p.fmt.name if q else 'dense'})"
        for s, p, q in zip(slots, parts, quantized, strict=True)
    )
    if not all(quantized):
        raise ModelLoadError(
            f"{artifact.path}: tensors fused into {param} mix dense and quantized formats: "
            f"{names}; a fused group needs one format"
        )
    if target.dim() != 2:
        raise ModelLoadError(
            f"{artifact.path}: {names} is quantized, but {param} must be a dense vector"
        )
    for slot, part in zip(slots, parts, strict=True):
        if tuple(part.shape) != slot.shape:
            raise ModelLoadError(
                f"{artifact.path}: quantized tensor {slot.hf_name!r} has shape "
                f"{_fmt(part.shape)}, expected {_fmt(slot.shape)}"
            )
    try:
        matrix = QuantizedTensor.cat_rows(parts)
    except ValueError:
        raise ModelLoadError(
            f"{artifact.path}: tensors fused into {param} have different formats: {names}"
        ) from None
    module_name, _, attr = param.rpartition(".")
    module = model.get_submodule(module_name)
    del module._parameters[attr]  # the uninitialised dense matrix goes
    setattr(module, attr, matrix.to(target.device))
