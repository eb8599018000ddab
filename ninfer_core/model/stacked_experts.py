"""Mixture-of-experts weights stored stacked, named as one matrix per expert.

transformers (5.24) holds a MoE block's experts as two 3-D parameters,
`mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and
`mlp.experts.down_proj` [E, H, I], and the Hub's Qwen3.5-MoE checkpoints store them so
(the main model's layers and the MTP layer's). Its `save_pretrained` writes one matrix
per expert instead (`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`; the
`qwen2_moe` conversion that `qwen3_next` and `qwen3_5_moe_text` share, reverted), which
is what Qwen3-Next checkpoints hold.

Rather than teach every reader of weights both layouts (the loader, the MTP layer, the
memory plan, `ninfer convert`, whose recipes quantize 2-D matrices by role), a folder's
artifact lists each stacked tensor as the per-expert matrices it holds (`split_stacked`),
and reading one reads only its slice. A converted `.ninfer` then stores the per-expert
names, each matrix quantized like any `gate_proj` / `down_proj`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ninfer_core.errors import ModelLoadError

#: The stacked parameters, and the per-expert matrices each holds as (name, which half of
#: its rows: 0 the first, 1 the second, None all of them).
STACKED: dict[str, tuple[tuple[str, int | None], ...]] = {
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    "down_proj": (("down_proj", None),),
}
#: Upper bound on `num_experts` (`MoEConfig`) and on the experts of one stacked tensor:
#: 8x Qwen3-Next's 512, low enough that a hostile value fails instead of building a
#: module list of millions of experts.
MAX_EXPERTS = 1 << 12
#: At most this many per-expert matrices in one artifact (Qwen3.5-397B: 512 experts x 3
#: matrices x 61 layers = 93,696): a hostile header of empty [4096, 0, 0] tensors cannot
#: make a listing of billions of names.
MAX_EXPERT_MATRICES = 1 << 20


@dataclass(frozen=True, slots=True)
class ExpertSlice:
    """One expert's matrix inside a stacked tensor: `source[expert, start:stop]`."""

    source: str
    expert: int
    start: int
    stop: int
    #: The matrix's [rows, cols].
    shape: tuple[int, int]


def split_stacked(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, ExpertSlice]:
    """Every per-expert matrix the stacked tensors among `shapes` (name -> shape) hold,
    by the name a per-expert checkpoint gives it (`...experts.{e}.gate_proj.weight`).

    A stacked tensor is named `<prefix>.experts.gate_up_proj` or `...experts.down_proj`
    (no `.weight`); one that is not 3-D, splits an odd number of gate|up rows, or holds
    too many experts is a `ModelLoadError` naming it."""
    out: dict[str, ExpertSlice] = {}
    for name, shape in shapes.items():
        head, sep, proj = name.rpartition(".experts.")
        if not sep or proj not in STACKED:
            continue
        if len(shape) != 3:
            raise ModelLoadError(
                f"stacked experts {name!r} have shape {list(shape)}: expected [experts, rows, cols]"
            )
        experts, rows, cols = shape
        parts = STACKED[proj]
        if len(parts) == 2 and rows % 2:
            raise ModelLoadError(
                f"stacked experts {name!r} have {rows} gate|up rows: expected an even count"
            )
        if experts > MAX_EXPERTS:
            raise ModelLoadError(
                f"stacked experts {name!r} hold {experts} experts, more than {MAX_EXPERTS}"
            )
        width = rows // len(parts)
        for e in range(experts):
            for part, half in parts:
                start = 0 if half is None else half * width
                out[f"{head}.experts.{e}.{part}.weight"] = ExpertSlice(
                    name, e, start, start + width, (width, cols)
                )
        if len(out) > MAX_EXPERT_MATRICES:
            raise ModelLoadError(
                f"stacked experts: more than {MAX_EXPERT_MATRICES} expert matrices"
            )
    return out


def first_stacked(names: Iterable[str]) -> str | None:
    """The first of `names` that is a stacked experts tensor, or None: an artifact that
    lists one is not read per expert (only a model folder is), so a family refuses it by
    name rather than as a missing `experts.0` matrix."""
    return next((n for n in names if n.rpartition(".experts.")[2] in STACKED), None)
