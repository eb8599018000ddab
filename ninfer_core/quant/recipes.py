"""Quantization recipes: which weight format each checkpoint tensor is stored in.

A recipe maps a Hugging Face tensor name (and its shape and source dtype) to a format
name from `formats.FORMATS`. Rules are keyed by *role* -- the projection a name ends
in -- and the roles that the runtime fuses into one matrix (q|k|v, gate|up) share a
single rule, so their row blocks always have one format and can be concatenated.

- `mixed`: embeddings and head Q6G64; the matrices a layer's input goes through (q/k/v,
  gate/up, a Gated DeltaNet's q|k|v|z, the MTP layer's fc) Q4G64; the ones writing back
  into the residual stream (o, down, a Gated DeltaNet's out) Q5G64; a Gated DeltaNet's
  b|a rows, which set each head's decay and write strength, W8G32.
- `q4`, `q6`, `w8`: every 2-D matrix (embeddings and head included) in one format.
- `bf16`: every tensor, 1-D included, as bf16 (bit-identical to a bf16 checkpoint).

Everything else -- norms, biases, any 1-D tensor, and in `mixed` any 2-D matrix of no
known role (a MoE router, a shared expert's gate: a few rows each) -- keeps its source
precision (fp32, bf16 or fp16). A MoE block's experts and shared expert are `gate_proj`,
`up_proj` and `down_proj` matrices like any MLP's (stacked experts are listed per expert,
`model/stacked_experts.py`), so they take those roles' formats.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ninfer_core.errors import UnknownNameError
from ninfer_core.quant.formats import FORMATS

#: Roles: the last module name before `.weight`; fused roles share one rule.
ROLE_GROUPS: dict[str, tuple[str, ...]] = {
    "embed": ("embed_tokens",),
    "head": ("lm_head",),
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
    # Gated DeltaNet (Qwen3-Next fuses q|k|v|z and b|a in the checkpoint; Qwen3.5 keeps
    # them apart, and the runtime fuses them into the same two matrices at load).
    "linear_in": ("in_proj_qkvz", "in_proj_qkv", "in_proj_z"),
    "linear_gates": ("in_proj_ba", "in_proj_b", "in_proj_a"),
    "linear_out": ("out_proj",),
    # The MTP layer's projection of [embedding | hidden] back to the hidden size.
    "mtp_fc": ("fc",),
}
_ROLE_OF = {module: group for group, modules in ROLE_GROUPS.items() for module in modules}

#: A rule value meaning "the source dtype's own dense format".
SOURCE = "source"
_SOURCE_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def role_of(hf_name: str) -> str | None:
    """`"qkv"` for `model.layers.3.self_attn.k_proj.weight`; None for no known role."""
    parts = hf_name.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        return None
    return _ROLE_OF.get(parts[-2])


def source_format(source_dtype: torch.dtype) -> str:
    """The dense format keeping `source_dtype` (fp64 and other floats -> fp32)."""
    if source_dtype in _SOURCE_FORMATS:
        return _SOURCE_FORMATS[source_dtype]
    if source_dtype.is_floating_point:
        return "fp32"
    raise ValueError(f"no weight format stores {source_dtype} tensors")


@dataclass(frozen=True, slots=True)
class Recipe:
    """`roles`: role group -> format for 2-D matrices of that role; `other_2d` for 2-D
    matrices of no known role; `one_d` for every other tensor (`SOURCE` keeps it)."""

    name: str
    description: str
    roles: Mapping[str, str] = field(default_factory=dict)
    other_2d: str = SOURCE
    one_d: str = SOURCE

    def __post_init__(self) -> None:
        for rule in (*self.roles.values(), self.other_2d, self.one_d):
            if rule != SOURCE and rule not in FORMATS:
                raise UnknownNameError("weight format", rule, FORMATS)
        unknown = set(self.roles) - set(ROLE_GROUPS)
        if unknown:
            raise UnknownNameError("role group", sorted(unknown)[0], ROLE_GROUPS)
        object.__setattr__(self, "roles", MappingProxyType(dict(self.roles)))

    def format_for(self, hf_name: str, shape: Sequence[int], source_dtype: torch.dtype) -> str:
        """The format name `hf_name` (of `shape`, stored as `source_dtype`) is written in."""
        if len(shape) != 2:
            rule = self.one_d
        else:
            role = role_of(hf_name)
            rule = self.roles.get(role, self.other_2d) if role else self.other_2d
        return source_format(source_dtype) if rule == SOURCE else rule

    def describe(self) -> dict[str, Any]:
        """JSON-able summary, written into the `.ninfer` header."""
        return {
            "name": self.name,
            "roles": {group: self.roles.get(group, self.other_2d) for group in ROLE_GROUPS},
            "role_tensors": {group: list(mods) for group, mods in ROLE_GROUPS.items()},
            "other_2d": self.other_2d,
            "one_d": self.one_d,
        }


def _uniform(fmt: str) -> dict[str, str]:
    return dict.fromkeys(ROLE_GROUPS, fmt)


_MIXED = {"embed": "Q6G64", "head": "Q6G64"}
_MIXED |= dict.fromkeys(("qkv", "gate_up", "linear_in", "mtp_fc"), "Q4G64")
_MIXED |= dict.fromkeys(("o", "down", "linear_out"), "Q5G64")
_MIXED |= {"linear_gates": "W8G32"}

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "mixed",
            "embeddings/head Q6G64; q/k/v, gate/up, DeltaNet q|k|v|z, MTP fc Q4G64; "
            "o, down, DeltaNet out Q5G64; DeltaNet b|a W8G32; rest at source",
            _MIXED,
        ),
        Recipe("q4", "every 2-D matrix Q4G64; 1-D tensors at source", _uniform("Q4G64"), "Q4G64"),
        Recipe("q6", "every 2-D matrix Q6G64; 1-D tensors at source", _uniform("Q6G64"), "Q6G64"),
        Recipe("w8", "every 2-D matrix W8G32; 1-D tensors at source", _uniform("W8G32"), "W8G32"),
        Recipe("bf16", "every tensor bf16, 1-D included", _uniform("bf16"), "bf16", "bf16"),
    )
}


def recipe(name: str) -> Recipe:
    """The recipe called `name`; an unknown name lists the known ones."""
    try:
        return RECIPES[name]
    except KeyError:
        raise UnknownNameError("quantization recipe", name, RECIPES) from None
