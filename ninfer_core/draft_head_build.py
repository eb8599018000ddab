"""`ninfer draft-head build`: rank the tokens a target produces over a corpus and write a
copy of the model that carries a reduced draft head (`spec/draft_head.py`).

The target runs over the corpus's text files in windows of `context` tokens (one prefill
each, as `ninfer eval-ppl` does) and its argmax at every position is counted: those are
the tokens a greedy target emits, so they are the ones a draft must be able to name.
Files are split by a hash of their path under the corpus folder (stable when files are
added, the same on every machine) into a ranking set, which picks the rows, and a
held-out set, which measures how many of the target's tokens the rows would have covered
on text they were not chosen from.

The output holds every object of the input byte for byte (formats, components, config,
tokenizer files, identity and recipe unchanged) plus the `draft_head` component, under a
new artifact id: it is another file. The head's rows are copied in their stored format;
quantized formats are row-blocked (a row's codes and scales are its own bytes), so the
kept rows are the head's own codes, never re-quantized. A GGUF file is first converted
as `ninfer convert` converts it (its quantized tensors keep their codes), and the `.ninfer`
file is what the target runs as and what is written: llama.cpp refuses a GGUF with
tensors it does not expect, and a sidecar file found by its name is a pairing that breaks
when one file moves. A Hugging Face folder gets a new folder (`draft_head_folder.py`).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ninfer_core.config import RuntimeConfig
from ninfer_core.errors import ModelLoadError, NInferError
from ninfer_core.spec.draft_head import (
    COMPONENT,
    DESCRIPTION,
    MAX_TOKEN_ID,
    TOKEN_IDS,
    TOKEN_IDS_FORMAT,
    WEIGHT,
    covered,
    head_tensor,
    rank_tokens,
    special_ids,
)

if TYPE_CHECKING:
    from ninfer_core.device import DeviceInfo
    from ninfer_core.loading import LoadedModel
    from ninfer_core.plugin_host import PluginHost

#: The text files of a corpus folder that are read (any depth).
CORPUS_SUFFIXES = (".txt", ".md", ".py", ".json", ".jsonl")
DEFAULT_HELDOUT = 0.1
DEFAULT_CONTEXT = 512


@dataclass
class SplitCounts:
    """How often the target's argmax was each token, over one split of the corpus."""

    counts: torch.Tensor  # [vocab] int64
    files: int = 0
    tokens: int = 0

    @property
    def distinct(self) -> int:
        """How many different tokens the target produced: the rows full coverage takes."""
        return int((self.counts > 0).sum())

    def coverage(self, token_ids: list[int]) -> float | None:
        """The share of counted tokens among `token_ids`; None when nothing was counted."""
        return covered(self.counts, token_ids) / self.tokens if self.tokens else None


@dataclass(frozen=True)
class DraftHeadReport:
    """What a build wrote and measured."""

    path: Path
    source: Path
    vocab: int
    #: The kept ids, in rank order (the rows of `draft_head.weight`).
    token_ids: list[int]
    special_ids: list[int]
    ranking: SplitCounts
    heldout: SplitCounts
    #: Corpus files that could not be read as UTF-8 text.
    skipped: list[str] = field(default_factory=list)
    #: Wall seconds: `load`, `count` (the target over the corpus), `write`, `total`.
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(self.token_ids)


# ------------------------------------------------------------------------- inputs


def default_out(model: Path) -> Path:
    """Beside the input: `model.ninfer` or `model.gguf` -> `model.draft-head.ninfer`; a
    model folder `hf/` -> the folder `hf.draft-head/`."""
    if model.is_dir():
        return model.with_name(model.name + ".draft-head")
    return model.with_suffix(".draft-head.ninfer")


def source_kind(path: Path) -> str:
    """What `path` is: `"ninfer"` (a version 3 `.ninfer` file), `"folder"` (a Hugging Face
    model folder) or `"gguf"`; anything else is one line saying what is wrong."""
    from ninfer_core.artifact.layout import MAGIC
    from ninfer_core.artifact.reader import read_header

    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: a folder without config.json, not a model folder")
        return "folder"
    try:
        with path.open("rb") as fh:
            magic = fh.read(len(MAGIC))
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if magic[:4] == b"GGUF":
        return "gguf"
    if magic != MAGIC:
        raise ModelLoadError(f"{path}: not a .ninfer file, a GGUF file or a model folder")
    header, _ = read_header(path)
    if header.version < 3:
        raise ModelLoadError(
            f"{path}: .ninfer container version {header.version} has no components; "
            "run `ninfer convert` again (it writes version 3)"
        )
    return "ninfer"


def is_heldout(relative: str, fraction: float) -> bool:
    """Whether the corpus file at `relative` (a POSIX path under the corpus folder) is held
    out: the first 8 bytes of its path's SHA-256, as a fraction of 2**64, below `fraction`."""
    digest = hashlib.sha256(relative.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def corpus_files(root: Path) -> list[tuple[Path, str]]:
    """(file, POSIX path under `root`) of every corpus file, in path order."""
    if not root.is_dir():
        raise NInferError(f"{root}: the corpus must be a folder of text files")
    found = [
        (p, p.relative_to(root).as_posix())
        for p in root.rglob("*")
        if p.suffix in CORPUS_SUFFIXES and p.is_file()
    ]
    if not found:
        raise NInferError(f"{root}: no corpus files ({', '.join(CORPUS_SUFFIXES)}) under it")
    return sorted(found, key=lambda item: item[1])


def reading_order(
    files: list[tuple[Path, str, bool]], context: int, max_tokens: int | None
) -> list[tuple[tuple[Path, str, bool], int, int | None]]:
    """(file, first token, end token or None) in the order the corpus is read.

    Without a token budget: every file whole, in path order. With one, a budget read in
    path order would be spent on the first few files of one folder (the standard
    library's 32k tokens: `LICENSE.txt`, `__future__.py`, ...), so the files come in a
    stable pseudo-random order (a hash of the path, the same on every machine) and each
    gives its first window of `context` tokens before any gives a second."""
    if max_tokens is None:
        return [(f, 0, None) for f in files]
    shuffled = sorted(files, key=lambda f: hashlib.sha256(b"order\0" + f[1].encode()).digest())
    return [(f, 0, context) for f in shuffled] + [(f, context, None) for f in shuffled]


# ------------------------------------------------------------------------- the work


def count_argmax(
    loaded: LoadedModel,
    files: list[tuple[Path, str, bool]],
    *,
    context: int,
    max_tokens: int | None,
    host: PluginHost,
    device: DeviceInfo,
    progress: Callable[[int], Any] | None = None,
) -> tuple[SplitCounts, SplitCounts, list[str]]:
    """(ranking, held-out, unreadable files): the target's argmax counted at every
    position of `files` ((path, relative, held out)), in windows of `context` tokens,
    up to `max_tokens` tokens in all. `progress(n)` after each window of n tokens."""
    from ninfer_core.eval_ppl import scoring_runtime, sequence_logits
    from ninfer_core.text.tokenizer import Tokenizer

    vocab = loaded.config.vocab_size
    tokenizer = Tokenizer.from_artifact(loaded.artifact)
    runtime = scoring_runtime(loaded, context, host=host, device=device)
    splits = {held: SplitCounts(torch.zeros(vocab, dtype=torch.int64)) for held in (False, True)}
    skipped: list[str] = []
    budget = max_tokens
    counted: set[str] = set()
    for (path, relative, held), first, last in reading_order(files, context, max_tokens):
        if budget is not None and budget <= 0:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            if first == 0:  # named once, on its first read
                skipped.append(relative)
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)[first:last][:budget]
        if budget is not None:
            budget -= len(ids)
        if not ids:
            continue
        split = splits[held]
        if relative not in counted:
            counted.add(relative)
            split.files += 1
        for start in range(0, len(ids), context):
            window = ids[start : start + context]
            top = sequence_logits(loaded, window, runtime).argmax(dim=-1)  # [len(window)]
            split.counts += torch.bincount(top.cpu(), minlength=vocab)
            split.tokens += len(window)
            if progress is not None:
                progress(len(window))
    return splits[False], splits[True], skipped


def write_with_draft_head(source: Path, out: Path, head: str, token_ids: list[int]) -> None:
    """Copy every object of `source` into `out` (an earlier draft head excepted) and add
    the head's rows `token_ids`, in rank order, in the head's format, with the id map."""
    from ninfer_core.artifact.reader import open_container, read_header
    from ninfer_core.artifact.writer import ContainerWriter
    from ninfer_core.quant.tensor import QuantizedTensor

    header, _ = read_header(source)
    kept = {name: text for name, text in header.components.items() if name != COMPONENT}
    # a split input was split for a reason (a file size limit): split the copy alike
    sizes = [header.volume_end(v) for v in range(len(header.volumes) + 1)]
    limit = max(sizes) if header.volumes else None
    ids = torch.tensor(token_ids, dtype=torch.int64)
    with (
        open_container(source, components=kept) as src,
        ContainerWriter(
            out,
            identity=header.identity,
            recipe=header.recipe,
            components={**kept, COMPONENT: DESCRIPTION},
            volume_limit=limit,
        ) as writer,
    ):
        for rec in header.objects:
            if rec.kind == "resource":
                writer.add_resource(rec.name, src.read_resource(rec.name) or b"")
            elif rec.component != COMPONENT:
                raw = src.load_raw(rec.name)
                writer.add_tensor(rec.name, rec.format, rec.shape, raw, component=rec.component)
        weight = src.load_weight(head)
        if isinstance(weight, QuantizedTensor):
            rows = weight.index_rows(ids).to_stored()  # the head's own codes and scales
        else:
            rows = weight.index_select(0, ids)
        shape = (len(token_ids), weight.shape[1])
        writer.add_tensor(WEIGHT, src.tensor_format(head), shape, rows, component=COMPONENT)
        writer.add_tensor(
            TOKEN_IDS, TOKEN_IDS_FORMAT, (len(token_ids),), ids.float(), component=COMPONENT
        )


def _check_request(
    source: Path,
    target: Path,
    rows: int,
    heldout_fraction: float,
    context: int,
    max_tokens: int | None,
) -> str:
    """Everything that can be refused before the model is read; the source's kind."""
    if rows < 1:
        raise NInferError(f"--rows must be at least 1, got {rows}")
    if not 0 <= heldout_fraction < 1:
        raise NInferError(f"--heldout-fraction must be in [0, 1), got {heldout_fraction}")
    if context < 1 or (max_tokens is not None and max_tokens < 1):
        raise NInferError("--context and --max-tokens must be at least 1")
    kind = source_kind(source)
    if target.resolve() == source.resolve():
        raise NInferError(f"{target}: the output would overwrite the input; choose another --out")
    if kind == "folder":
        if source.resolve() in target.resolve().parents:
            raise NInferError(f"{target}: the output folder would be inside the input folder")
        if target.exists() and not (target.is_dir() and not any(target.iterdir())):
            raise NInferError(f"{target}: exists; the output is a new folder, choose another --out")
    elif target.suffix.lower() == ".gguf":
        raise NInferError(f"{target}: the output is a .ninfer file; name it so")
    return kind


@contextmanager
def _as_ninfer(source: Path, kind: str, target: Path) -> Iterator[Path]:
    """`source` as a `.ninfer` file for the `with` block: a GGUF file is converted first
    (`ninfer convert`'s default recipe: its quantized tensors keep their ggml codes) into
    a file beside `target`, removed at the end."""
    if kind != "gguf":
        yield source
        return
    from ninfer_core.convert import convert

    tmp = target.with_name(f".{target.stem}.converted{os.getpid()}.ninfer")
    try:
        convert(source, tmp)
        yield tmp
    finally:
        for part in [tmp, *tmp.parent.glob(tmp.name + ".part-*")]:
            part.unlink(missing_ok=True)


def build_draft_head(
    model: str | Path,
    corpus: str | Path,
    rows: int,
    *,
    out: str | Path | None = None,
    heldout_fraction: float = DEFAULT_HELDOUT,
    context: int = DEFAULT_CONTEXT,
    max_tokens: int | None = None,
    runtime: RuntimeConfig | None = None,
    progress: Callable[[int], Any] | None = None,
) -> DraftHeadReport:
    """Run `model` over `corpus`, keep the `rows` most produced tokens (special and stop
    tokens always) and write `out` (default `default_out`): for a v3 `.ninfer` file or a
    GGUF file (converted first), a `.ninfer` file; for a model folder, a folder."""
    from ninfer_core.device import probe_device
    from ninfer_core.loading import family_and_config, load_model, opened_artifact
    from ninfer_core.plugin_host import create_host

    started = time.perf_counter()
    source = Path(model)
    target = Path(out) if out is not None else default_out(source)
    kind = _check_request(source, target, rows, heldout_fraction, context, max_tokens)
    files = [(p, rel, is_heldout(rel, heldout_fraction)) for p, rel in corpus_files(Path(corpus))]
    if all(held for _, _, held in files):
        raise NInferError(
            f"{corpus}: every file fell in the held-out set; lower --heldout-fraction"
        )
    host, device = create_host(), probe_device()
    with opened_artifact(source, host) as artifact:  # the header and config only
        _, config = family_and_config(host, artifact)
    vocab = config.vocab_size
    if rows > vocab:
        raise NInferError(f"--rows {rows} is more than the vocabulary ({vocab} tokens)")
    if vocab > MAX_TOKEN_ID:
        raise NInferError(f"a vocabulary of {vocab} has ids fp32 cannot hold exactly")

    checked = time.perf_counter()
    with _as_ninfer(source, kind, target) as path:
        converted = time.perf_counter()
        loaded = load_model(path, host=host, device=device, runtime=runtime or RuntimeConfig())
        loaded_at = time.perf_counter()
        special = special_ids(loaded.artifact, loaded.config.vocab_size)
        if rows < len(special):
            raise NInferError(
                f"--rows {rows} cannot hold the {len(special)} special and stop tokens"
            )
        ranking, heldout, skipped = count_argmax(
            loaded,
            files,
            context=context,
            max_tokens=max_tokens,
            host=host,
            device=device,
            progress=progress,
        )
        if not ranking.tokens:
            raise NInferError(f"{corpus}: no token to rank (the ranking set's files are empty)")
        counted = time.perf_counter()
        token_ids = rank_tokens(ranking.counts, special, rows)
        head = head_tensor(loaded.config)
        if kind == "folder":
            from ninfer_core.draft_head_folder import write_folder_with_draft_head

            weights = loaded.artifact.load_tensor(head)  # as stored, for its dtype
            write_folder_with_draft_head(source, target, weights, token_ids)
        else:
            write_with_draft_head(path, target, head, token_ids)
        done = time.perf_counter()
    seconds = {
        "convert": converted - checked,
        "load": loaded_at - converted + checked - started,
        "count": counted - loaded_at,
        "write": done - counted,
        "total": time.perf_counter() - started,
    }
    return DraftHeadReport(
        target, source, vocab, token_ids, special, ranking, heldout, skipped, seconds
    )
