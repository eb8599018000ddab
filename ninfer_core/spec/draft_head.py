"""The head a drafter picks its tokens with: the model's own, or a reduced one (`--lm-head-draft`).

Drafting runs the head once per draft token; over a 150k vocabulary that GEMV reads as many
bytes as a few decoder layers. `--lm-head-draft` replaces it, while drafting only, by the rows
of the N tokens the target most often produces (ranked over a corpus by how often the
target's argmax was that token; special tokens always kept; rows in rank order), with an id
map back to real token ids. Verification always uses the full head, so the output is the
same either way; a reduced head only changes how often drafts are accepted.

A model that ships no reduced head gets one built while loading (`ReducedHead.built`):
without a count of what the target produces, the rows are the head's lowest ids
(`id_order_rows`). A byte-level BPE numbers its tokens in the order it learned its merges,
most frequent pair first, so low ids are frequent tokens (docs/speculative-decoding.md has
how close that comes to a corpus count). The rows are held at 4 bits (`BUILT_FORMAT`,
upstream's width), re-encoded from the head's values.

In a `.ninfer` artifact the reduced head is the component `draft_head` (written by
`ninfer draft-head build`): `draft_head.weight` [N, hidden] in the head's format and
`draft_head.token_ids` [N], the real id of each row. A container stores no integer
tensors (`docs/artifact-format.md` §4.1), so the ids are fp32: exact for every id below
2**24 (16.7M), far past any vocabulary; the loader checks each is a whole number.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ninfer_core.errors import ModelLoadError
from ninfer_core.plugin_types import Artifact, CausalLM
from ninfer_core.quant.tensor import QuantizedTensor

if TYPE_CHECKING:
    from ninfer_core.memory.planner import PackedBytes

#: The artifact component and tensor names of a reduced draft head.
COMPONENT = "draft_head"
WEIGHT = "draft_head.weight"
TOKEN_IDS = "draft_head.token_ids"
#: What `ninfer inspect` shows for the component.
DESCRIPTION = "reduced head for drafting (--lm-head-draft): the most frequent tokens' rows"
#: The storage format of `TOKEN_IDS`, and the first id it cannot hold exactly.
TOKEN_IDS_FORMAT = "fp32"
MAX_TOKEN_ID = 2**24
#: The format of a reduced head built while loading.
BUILT_FORMAT = "Q4G64"
#: Rows re-encoded at a time while building (bounds the dequantized copy: 64 MiB at 2048
#: columns, fp32).
BUILD_CHUNK = 8192
#: Dtypes a non-`.ninfer` artifact may hand the ids in (each holds them exactly).
_ID_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


class DraftHead(Protocol):
    """Turns a drafter's final hidden states into draft token ids (real vocabulary ids)."""

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> [R] int64, each row's most likely token."""
        ...


class FullHead:
    """The target's own head (`CausalLM.compute_logits`)."""

    def __init__(self, model) -> None:
        self.model = model

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).argmax(dim=-1)


# --------------------------------------------------------------------------- the artifact


def has_draft_head(artifact: Artifact) -> bool:
    """Whether `artifact` carries a reduced head (both tensors, in its `draft_head`
    component when it keeps components apart)."""
    with draft_head_tensors(artifact) as full:
        names = set(full.tensor_names())
    return WEIGHT in names and TOKEN_IDS in names


def draft_head_tensors(artifact: Artifact) -> AbstractContextManager[Artifact]:
    """`artifact` with the draft head's tensors loadable, for a `with` block (a `.ninfer`
    file lists its `draft_head` component only when asked)."""
    from ninfer_core.loading import with_components

    return with_components(artifact, {COMPONENT})


def head_tensor(config: Any) -> str:
    """The checkpoint name of the head: the embedding matrix when tied."""
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


def built_rows(config: Any, rows: int) -> int:
    """Rows of the head `ReducedHead.built` makes for `--draft-vocab rows`."""
    return min(rows, config.vocab_size)


def draft_head_bytes(
    artifact: Artifact,
    dtype: torch.dtype,
    packed_bytes: PackedBytes | None = None,
    *,
    config: Any = None,
    rows: int | None = None,
) -> tuple[int, int]:
    """(weight bytes, id map bytes) a `ReducedHead` of `artifact` holds, from its headers
    alone, for the memory plan: the weight as the planner sizes the full head (cast to
    `dtype` when dense, as stored when quantized, as `packed_bytes` says once packed), the
    ids as int64. An artifact without a reduced head: the one `ReducedHead.built` makes
    for `config` with `rows` rows, in `BUILT_FORMAT`; with no `config`, `ModelLoadError`."""
    from ninfer_core.memory.planner import slots_bytes
    from ninfer_core.model.weights import WeightSlot
    from ninfer_core.quant.formats import weight_format

    with draft_head_tensors(artifact) as full:
        if not {WEIGHT, TOKEN_IDS} <= set(full.tensor_names()):
            if config is None or rows is None:
                raise ModelLoadError(
                    f"{artifact.path}: no reduced draft head; write one with "
                    "`ninfer draft-head build`"
                )
            shape = (built_rows(config, rows), config.hidden_size)
            packed = packed_bytes(BUILT_FORMAT, shape) if packed_bytes else None
            weight = (
                packed if packed is not None else weight_format(BUILT_FORMAT).stored_nbytes(shape)
            )
            return weight, shape[0] * torch.int64.itemsize
        shape = tuple(full.tensor_shape(WEIGHT))
        slot = WeightSlot(WEIGHT, "draft_head", 0, shape)
        weight = slots_bytes(
            [slot], dtype, artifact=full, packed_bytes=packed_bytes, packed={"draft_head"}
        )
    return weight, shape[0] * torch.int64.itemsize


def _checked_ids(artifact: Artifact, rows: int, vocab: int) -> torch.Tensor:
    """The id map as int64 [rows], every id a whole number in range and none twice."""
    where = f"{artifact.path}: {TOKEN_IDS}"
    shape = tuple(artifact.tensor_shape(TOKEN_IDS))
    if shape != (rows,):
        raise ModelLoadError(f"{where} has shape {list(shape)}, expected [{rows}] (one per row)")
    fmt = artifact.tensor_format(TOKEN_IDS) if artifact.tensor_format else None
    if fmt is not None and fmt != TOKEN_IDS_FORMAT:
        # fp16/bf16 would round ids above 2048/256 to other whole numbers, undetectably
        raise ModelLoadError(f"{where} is stored as {fmt}; ids must be {TOKEN_IDS_FORMAT}")
    raw = artifact.load_tensor(TOKEN_IDS)
    if raw.dtype not in _ID_DTYPES:
        raise ModelLoadError(f"{where} is {raw.dtype}; ids must be float32 or an integer type")
    values = raw.to(torch.float64)
    if not bool((torch.isfinite(values) & (values == values.round())).all()):
        raise ModelLoadError(f"{where} holds a value that is not a whole number")
    bad = (values < 0) | (values >= vocab)
    if bool(bad.any()):
        raise ModelLoadError(
            f"{where} holds id {int(values[bad][0])}, outside the vocabulary 0..{vocab - 1}"
        )
    ids = values.to(torch.int64)
    if torch.unique(ids).numel() != rows:
        raise ModelLoadError(f"{where} names a token twice; each row must be a different token")
    return ids


class ReducedHead:
    """The rows of the most frequent tokens (`weight`, as the backend packed it) and
    their real ids (`token_ids`, int64 [N] on the model's device)."""

    def __init__(self, weight: Any, token_ids: torch.Tensor, ops: Any) -> None:
        self.weight, self.token_ids, self.ops = weight, token_ids, ops

    @property
    def rows(self) -> int:
        return self.token_ids.numel()

    @classmethod
    def from_artifact(cls, artifact: Artifact, model: CausalLM) -> ReducedHead:
        """Load and check the artifact's reduced head for `model` (its kernels, dtype,
        device); every problem is a `ModelLoadError` naming the file and what is wrong."""
        ops = getattr(model, "ops", None)
        if ops is None:
            raise ModelLoadError(
                f"the model {type(model).__name__} does not expose its kernels (`ops`), "
                "which the reduced head runs on"
            )
        vocab, hidden = model.config.vocab_size, model.config.hidden_size
        with draft_head_tensors(artifact) as tensors:
            names = set(tensors.tensor_names())
            missing = [n for n in (WEIGHT, TOKEN_IDS) if n not in names]
            if missing:
                raise ModelLoadError(
                    f"{artifact.path}: no reduced draft head ({', '.join(missing)} missing); "
                    "write one with `ninfer draft-head build`"
                )
            shape = tuple(tensors.tensor_shape(WEIGHT))
            if len(shape) != 2 or shape[1] != hidden or not 1 <= shape[0] <= vocab:
                raise ModelLoadError(
                    f"{artifact.path}: {WEIGHT} has shape {list(shape)}, expected [N, {hidden}] "
                    f"with 1 <= N <= {vocab} (the vocabulary)"
                )
            ids = _checked_ids(tensors, shape[0], vocab)
            load = tensors.load_weight or tensors.load_tensor
            weight = load(WEIGHT)
        # Packed as `DenseDecoder._pack` packs the full head: a quantized matrix stays
        # quantized (the backend is told the compute dtype), a dense one takes it.
        if isinstance(weight, QuantizedTensor):
            packed = ops.pack_linear(weight.to(ops.device), dtype=model.dtype)
        else:
            packed = ops.pack_linear(weight.to(device=ops.device, dtype=model.dtype))
        return cls(packed, ids.to(ops.device), ops)

    @classmethod
    def built(cls, artifact: Artifact, model: CausalLM, rows: int) -> ReducedHead:
        """A reduced head made from the model's own head while loading: the rows of
        `id_order_rows` (special and stop tokens always among them), in `BUILT_FORMAT`."""
        from ninfer_core.quant.tensor import quantize

        ops = model.ops  # type: ignore[attr-defined]
        config = model.config
        ids = id_order_rows(config.vocab_size, special_ids(artifact, config.vocab_size),
                            built_rows(config, rows))  # fmt: skip
        index = torch.tensor(ids, dtype=torch.int64)
        load = artifact.load_weight or artifact.load_tensor
        head = load(head_tensor(config))
        parts = []
        for start in range(0, len(ids), BUILD_CHUNK):
            chunk = index[start : start + BUILD_CHUNK]
            if isinstance(head, QuantizedTensor):
                values = head.index_rows(chunk).dequantize(torch.float32)
            else:
                values = head.index_select(0, chunk).float()
            parts.append(quantize(values, BUILT_FORMAT))
        weight = QuantizedTensor.cat_rows(parts)
        packed = ops.pack_linear(weight.to(ops.device), dtype=model.dtype)
        return cls(packed, index.to(ops.device), ops)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [R, hidden] -> scores [R, N] -> [R] int64 real ids
        scores = self.ops.linear(hidden, self.weight)
        return self.token_ids[scores.argmax(dim=-1)]

    def __repr__(self) -> str:
        return f"ReducedHead(rows={self.rows})"


# ------------------------------------------------------------------- choosing the rows


def rank_tokens(
    counts: torch.Tensor | Sequence[int], special_ids: Iterable[int], rows: int
) -> list[int]:
    """The `rows` token ids a reduced head keeps, in rank order: most counted first, ties
    by the lower id. Every id of `special_ids` is kept whatever its count (a draft must be
    able to end a turn), in its rank place; the rest of the rows go to the top-ranked
    others. `counts`: [vocab], how often the target's argmax was each token."""
    counts = torch.as_tensor(counts, dtype=torch.int64).reshape(-1)
    vocab = counts.numel()
    special = set(special_ids)
    if not 1 <= rows <= vocab:
        raise ValueError(f"rows must be in 1..{vocab} (the vocabulary), got {rows}")
    outside = sorted(i for i in special if not 0 <= i < vocab)
    if outside:
        raise ValueError(f"special id {outside[0]} is outside the vocabulary 0..{vocab - 1}")
    if len(special) > rows:
        raise ValueError(f"{rows} rows cannot hold the {len(special)} special tokens")
    # a stable sort of the descending counts leaves equal counts in id order
    order = torch.sort(counts, descending=True, stable=True).indices.tolist()
    keep = set(special)
    for token in order:
        if len(keep) == rows:
            break
        keep.add(token)
    return [token for token in order if token in keep]


def covered(counts: torch.Tensor, token_ids: Sequence[int]) -> int:
    """How many of the counted argmax tokens are among `token_ids`."""
    return int(counts[torch.as_tensor(list(token_ids), dtype=torch.int64)].sum())


def id_order_rows(vocab: int, special: Iterable[int], rows: int) -> list[int]:
    """The `rows` lowest ids, with every special id in place of the highest of them: the
    choice without a count of what the target produces (module doc)."""
    return rank_tokens(torch.arange(vocab, 0, -1), special, rows)


def special_ids(artifact: Artifact, vocab: int) -> list[int]:
    """The ids every reduced head keeps: the tokenizer's special tokens and the model's
    stop tokens (a draft must be able to end a turn), those the head has rows for."""
    from ninfer_core.text import GenerationDefaults, Tokenizer, stop_token_ids

    tokenizer = Tokenizer.from_artifact(artifact)
    generation = GenerationDefaults.from_artifact(artifact)
    stops = stop_token_ids(generation, artifact.config, tokenizer.eos_token_id)
    # an id past the head has no row: no draft can be it, so there is nothing to keep
    return sorted(i for i in {*tokenizer.all_special_ids, *stops} if 0 <= i < vocab)
