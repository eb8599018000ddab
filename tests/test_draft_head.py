"""`ninfer draft-head build` and `ReducedHead` on the built-in model.

The references are computed here, apart from the builder: the target's argmax from
transformers' Qwen3 in float64 on the dequantized weights (counted by this file's own
reading of the split rule and the windows), and the reduced head's argmax as a float64
product of the hidden rows with the dequantized head's kept rows.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from pathlib import Path

import pytest
import torch

from ninfer_core.artifact.reader import open_container, read_header
from ninfer_core.builtin_model import BUILTIN_ARTIFACT
from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.draft_head_build import build_draft_head
from ninfer_core.errors import ModelLoadError
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.quant.tensor import QuantizedTensor
from ninfer_core.spec.draft_head import (
    COMPONENT,
    TOKEN_IDS,
    WEIGHT,
    ReducedHead,
    has_draft_head,
    rank_tokens,
)
from ninfer_core.text import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROWS = 512
CONTEXT = 128
HELDOUT = 0.45
HEAD = "model.embed_tokens.weight"  # the built-in model's head is tied
SPECIAL = [0, 1, 2]  # <|endoftext|>, <|im_start|>, <|im_end|>; stops are 2 and 0
#: Float64 top-2 logit gaps below this may order differently in the builder's fp32.
NEAR_TIE = 1e-4


def _source(module_name: str, chars: int = 2500) -> str:
    import importlib

    return inspect.getsource(importlib.import_module(module_name))[:chars]


def _records(n: int) -> str:
    calls = [
        {"name": "get_weather", "arguments": {"city": city, "unit": "celsius"}}
        for city in ("Oslo", "Lagos", "Lima", "Pune", "Kyiv")
    ]
    return "\n".join(json.dumps(calls[i % len(calls)]) for i in range(n))


#: relative path -> contents; with HELDOUT 0.45 the last two are held out by their hash
CORPUS = {
    "colors.py": _source("colorsys"),
    "search.py": _source("bisect"),
    "patterns.py": _source("fnmatch"),
    "tools.json": json.dumps({"tools": json.loads("[" + _records(6).replace("\n", ",") + "]")}),
    "notes/shell.py": _source("shlex"),
    "calls.jsonl": _records(12),
    "notes/readme.md": "# Notes\n\n" + _source("textwrap", 1500),
}


def heldout(relative: str) -> bool:
    """The documented split rule, written out again."""
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < HELDOUT


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for name, text in CORPUS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))  # skipped
    (root / "data.bin").write_bytes(b"\x00\x01 not a corpus suffix")  # never read
    assert {heldout(n) for n in CORPUS} == {False, True}, "both sets need a file"
    return root


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "builtin.draft-head.ninfer"
    report = build_draft_head(
        BUILTIN_ARTIFACT, corpus, ROWS, out=out, heldout_fraction=HELDOUT, context=CONTEXT,
        runtime=RuntimeConfig(dtype="fp32"),
    )  # fmt: skip
    return report


def _dense_head() -> torch.Tensor:
    with open_container(BUILTIN_ARTIFACT) as src:
        return src.load_weight(HEAD).dequantize(torch.float32)


# --------------------------------------------------------------------------
# The file
# --------------------------------------------------------------------------


def test_the_output_keeps_every_object_byte_for_byte(built):
    before, _ = read_header(BUILTIN_ARTIFACT)
    after, _ = read_header(built.path)
    kept = {o.name: o for o in after.objects if o.kind == "resource" or o.component != COMPONENT}
    assert [o.name for o in before.objects] == list(kept)
    with (
        open_container(BUILTIN_ARTIFACT, components=before.components) as src,
        open_container(built.path, components=after.components) as out,
    ):
        for old in before.objects:
            new = kept[old.name]
            assert (new.kind, new.format, new.shape, new.component, new.sha256) == (
                old.kind, old.format, old.shape, old.component, old.sha256,
            )  # fmt: skip
            if old.kind == "resource":
                assert out.read_resource(old.name) == src.read_resource(old.name)
            else:
                assert torch.equal(out.load_raw(old.name), src.load_raw(old.name))
        assert out.verify() == []
    assert (after.identity, after.recipe) == (before.identity, before.recipe)
    assert after.components == {**before.components, COMPONENT: after.components[COMPONENT]}
    assert after.artifact_id != before.artifact_id  # another file, another id


def test_inspect_lists_the_component(built, capsys):
    assert main(["inspect", str(built.path), "--verify", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["components"][COMPONENT]["tensors"] == 2
    shapes = {t["name"]: (t["format"], t["shape"]) for t in info["tensors"]}
    assert shapes[WEIGHT] == ("Q6G64", [ROWS, 256])  # the head's own format
    assert shapes[TOKEN_IDS] == ("fp32", [ROWS])


def test_rows_are_the_heads_own_codes_in_rank_order(built):
    with (
        open_container(BUILTIN_ARTIFACT) as src,
        open_container(built.path, components={"text", COMPONENT}) as out,
    ):
        head, rows = src.load_weight(HEAD), out.load_weight(WEIGHT)
        ids = out.load_tensor(TOKEN_IDS)
        assert isinstance(rows, QuantizedTensor) and rows.fmt == head.fmt
        assert ids.tolist() == [float(i) for i in built.token_ids]
        kept = torch.tensor(built.token_ids)
        assert torch.equal(rows.packed, head.packed[kept])  # copied, never re-quantized
        assert torch.equal(rows.scales, head.scales[kept])


def test_has_draft_head():
    host = create_host()
    loaded = load_model(
        BUILTIN_ARTIFACT, host=host, device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype="fp32"),
    )  # fmt: skip
    assert not has_draft_head(loaded.artifact)
    with pytest.raises(ModelLoadError, match="ninfer draft-head build"):
        ReducedHead.from_artifact(loaded.artifact, loaded.model)


# --------------------------------------------------------------------------
# ReducedHead
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reduced_argmax_is_the_full_heads_argmax_over_the_kept_rows(built, dtype):
    loaded = load_model(
        built.path, host=create_host(), device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype=dtype),
    )  # fmt: skip
    assert has_draft_head(loaded.artifact)
    head = ReducedHead.from_artifact(loaded.artifact, loaded.model)
    assert head.rows == ROWS and head.token_ids.dtype == torch.int64
    torch.manual_seed(0)
    hidden = torch.randn(256, 256) * 2.0  # the final norm's outputs are about this size
    got = head.argmax(hidden.to(loaded.dtype))
    kept = torch.tensor(built.token_ids)
    scores = hidden.double() @ _dense_head()[kept].double().T  # [256, ROWS]
    want = kept[scores.argmax(-1)]
    best = scores.max(-1).values
    picked = scores.gather(1, (got[:, None] == kept).int().argmax(-1, keepdim=True))[:, 0]
    assert set(got.tolist()) <= set(built.token_ids)
    if dtype == "fp32":
        top2 = scores.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > NEAR_TIE
        assert clear.sum() > 240
        assert torch.equal(got[clear], want[clear])
    # bf16 (the int4-pair kernel, bf16 activations): the pick scores within bf16's
    # rounding of the best, and is the best on nearly every row
    assert bool((best - picked <= 0.05 * best.abs().clamp(min=1)).all())
    assert (got == want).float().mean() > 0.9


class _FakeArtifact:
    """An artifact holding only a draft head, to feed `ReducedHead` bad id maps."""

    def __init__(self, ids: torch.Tensor, rows: int = 3, hidden: int = 8, fmt: str = "fp32"):
        self.path = Path("fake.ninfer")
        self.tensors = {WEIGHT: torch.randn(rows, hidden), TOKEN_IDS: ids}
        self.fmt = fmt
        self.load_weight = None
        self.with_components = None  # every tensor listed

    def tensor_names(self):
        return list(self.tensors)

    def tensor_shape(self, name):
        return tuple(self.tensors[name].shape)

    def tensor_format(self, name):
        return self.fmt if name == TOKEN_IDS else "fp32"

    def load_tensor(self, name):
        return self.tensors[name]


class _FakeModel:
    def __init__(self, vocab: int = 10, hidden: int = 8):
        from types import SimpleNamespace

        from ninfer_core.kernels.reference import TorchOps

        self.config = SimpleNamespace(vocab_size=vocab, hidden_size=hidden)
        self.ops, self.dtype = TorchOps("cpu"), torch.float32


@pytest.mark.parametrize(
    ("ids", "kwargs", "problem"),
    [
        (torch.tensor([1.0, 2.0, 2.0]), {}, "names a token twice"),
        (torch.tensor([1.0, 2.0, 10.0]), {}, "outside the vocabulary"),
        (torch.tensor([1.0, -1.0, 3.0]), {}, "outside the vocabulary"),
        (torch.tensor([1.0, 2.5, 3.0]), {}, "not a whole number"),
        (torch.tensor([1.0, float("nan"), 3.0]), {}, "not a whole number"),
        (torch.tensor([1.0, float("inf"), 3.0]), {}, "not a whole number"),
        (torch.tensor([1.0, 2.0]), {}, "expected \\[3\\]"),
        (torch.tensor([1.0, 2.0, 3.0]), {"fmt": "fp16"}, "must be fp32"),
        (torch.tensor([1.0, 2.0, 3.0]), {"hidden": 4}, "expected \\[N, 8\\]"),
        (torch.tensor([1.0, 2.0, 3.0]), {"rows": 11}, "1 <= N <= 10"),
    ],
)
def test_a_bad_draft_head_is_refused_naming_the_problem(ids, kwargs, problem):
    with pytest.raises(ModelLoadError, match=problem):
        ReducedHead.from_artifact(_FakeArtifact(ids, **kwargs), _FakeModel())


def test_a_sound_fake_head_maps_rows_back_to_ids():
    artifact = _FakeArtifact(torch.tensor([7.0, 3.0, 5.0]))
    head = ReducedHead.from_artifact(artifact, _FakeModel())
    hidden = artifact.tensors[WEIGHT] * 10  # row r scores highest against itself
    assert head.argmax(hidden).tolist() == [7, 3, 5]


# --------------------------------------------------------------------------
# Counting and ranking
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_counts():
    """(ranking counts, held-out counts, near ties): transformers' float64 argmax over
    the same windows, split by this file's reading of the rule."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with open_container(BUILTIN_ARTIFACT) as src:
        config = Qwen3Config.from_dict(src.config)
        weights = {}
        for name in src.tensor_names():
            w = src.load_weight(name)
            weights[name] = w.dequantize() if isinstance(w, QuantizedTensor) else w.clone()
        tokenizer = Tokenizer.from_artifact(src)
    model = Qwen3ForCausalLM(config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied
    model = model.double().eval()
    counts = {held: torch.zeros(4096, dtype=torch.int64) for held in (False, True)}
    near = 0
    with torch.no_grad():
        for name in sorted(CORPUS):
            ids = tokenizer.encode(CORPUS[name], add_special_tokens=False)
            for start in range(0, len(ids), CONTEXT):
                window = torch.tensor([ids[start : start + CONTEXT]])
                logits = model(window).logits[0]
                top2 = logits.topk(2, dim=-1).values
                near += int(((top2[:, 0] - top2[:, 1]) < NEAR_TIE).sum())
                counts[heldout(name)] += torch.bincount(logits.argmax(-1), minlength=4096)
    return counts[False], counts[True], near


def test_coverage_equals_a_recount_from_independent_argmaxes(built, reference_counts):
    ranking, held, near = reference_counts
    assert near <= 3, "the corpus should not hinge on near ties"
    assert built.ranking.tokens == int(ranking.sum()) and built.heldout.tokens == int(held.sum())
    assert built.ranking.files == sum(not heldout(n) for n in CORPUS)
    assert built.heldout.files == sum(heldout(n) for n in CORPUS)
    assert built.skipped == ["latin1.txt"]
    # each near tie may move one count from one token to another
    assert int((built.ranking.counts - ranking).abs().sum()) <= 2 * near
    assert int((built.heldout.counts - held).abs().sum()) <= 2 * near
    kept = torch.tensor(built.token_ids)
    for mine, theirs in ((built.ranking, ranking), (built.heldout, held)):
        expected = int(theirs[kept].sum()) / int(theirs.sum())
        assert mine.coverage(built.token_ids) == pytest.approx(expected, abs=near / mine.tokens)
    assert 0.5 < built.heldout.coverage(built.token_ids) <= built.ranking.coverage(built.token_ids)


def test_ranking_is_by_count_with_the_special_ids_kept(built):
    counts = built.ranking.counts
    assert built.special_ids == SPECIAL
    assert len(built.token_ids) == len(set(built.token_ids)) == ROWS
    assert set(SPECIAL) <= set(built.token_ids)
    keys = [(-int(counts[i]), i) for i in built.token_ids]
    assert keys == sorted(keys), "rows are in rank order: count, then id"
    others = [i for i in built.token_ids if i not in SPECIAL]
    last = max((-int(counts[i]), i) for i in others)
    dropped = set(range(4096)) - set(built.token_ids)
    assert all((-int(counts[i]), i) > last for i in dropped), "no dropped token outranks a kept one"


def test_rank_tokens_on_small_counts():
    counts = [5, 0, 3, 3, 9, 3]
    assert rank_tokens(counts, [], 3) == [4, 0, 2]  # ties by the lower id
    assert rank_tokens(counts, [1], 3) == [4, 0, 1]  # the special token takes the last row
    assert rank_tokens(counts, [1, 5], 4) == [4, 0, 5, 1]  # kept in rank order
    assert rank_tokens(counts, [], 6) == [4, 0, 2, 3, 5, 1]
    for rows, special, problem in ((0, [], "1..6"), (7, [], "1..6"), (1, [1, 2], "cannot hold"),
                                   (3, [6], "outside")):  # fmt: skip
        with pytest.raises(ValueError, match=problem):
            rank_tokens(counts, special, rows)


# --------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------


def _build(args: list[str]) -> list[str]:
    return ["draft-head", "build", *args, "--no-progress", "--dtype", "fp32"]


def test_the_command_reports_one_line_each(corpus, tmp_path, capsys):
    out = tmp_path / "m.ninfer"
    args = [str(BUILTIN_ARTIFACT), "--corpus", str(corpus), "--rows", "64", "--out", str(out),
            "--heldout-fraction", str(HELDOUT), "--context", "100"]  # fmt: skip
    assert main(_build([*args, "--max-tokens", "300", "--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["rows"], report["vocab"], report["special_ids"]) == (64, 4096, SPECIAL)
    assert report["ranking"]["tokens"] + report["heldout"]["tokens"] == 300
    assert 0 < report["ranking"]["coverage"] <= 1 and report["path"] == str(out)
    assert set(report["seconds"]) == {"convert", "load", "count", "write", "total"}
    assert main(_build(args)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [
        "rows", "coverage", "held-out", "seconds", "skipped", "wrote",
    ]  # fmt: skip
    assert lines[0].startswith("rows      64 of 4096")


def test_a_rebuild_replaces_the_earlier_draft_head(built, corpus, tmp_path):
    again = build_draft_head(
        built.path, corpus, 32, out=tmp_path / "again.ninfer", max_tokens=200,
        runtime=RuntimeConfig(dtype="fp32"),
    )  # fmt: skip
    header, _ = read_header(again.path)
    names = [o.name for o in header.objects]
    assert names.count(WEIGHT) == 1
    assert next(o for o in header.objects if o.name == WEIGHT).shape == (32, 256)


def _gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def _folder(tmp_path: Path) -> Path:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    return tmp_path / "hf"


def _no_config(tmp_path: Path) -> Path:
    (tmp_path / "hf").mkdir()
    return tmp_path / "hf"


def _text(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("not a model")
    return path


def _v2(tmp_path: Path) -> Path:
    from ninfer_core.artifact.writer import ContainerWriter

    path = tmp_path / "old.ninfer"
    with ContainerWriter(path, version=2) as writer:
        writer.add_resource("config.json", "{}")
    return path


@pytest.mark.parametrize(
    ("model", "extra", "problem"),
    [
        (_gguf, [], "model.gguf: not a readable GGUF file"),
        (_folder, [], "hf: no \\*.safetensors weight files found"),
        (_no_config, [], "a folder without config.json, not a model folder"),
        (_text, [], "not a .ninfer file, a GGUF file or a model folder"),
        (_v2, [], "version 2 has no components"),
        (None, ["--rows", "0"], "--rows must be at least 1"),
        (None, ["--rows", "5000"], "more than the vocabulary \\(4096 tokens\\)"),
        (None, ["--corpus", "/nonexistent/corpus"], "the corpus must be a folder"),
        (None, ["--out", str(BUILTIN_ARTIFACT)], "would overwrite the input"),
        (None, ["--heldout-fraction", "1"], "--heldout-fraction must be in"),
    ],
)
def test_bad_input_fails_with_one_clean_line(model, extra, problem, corpus, tmp_path, capsys):
    path = BUILTIN_ARTIFACT if model is None else model(tmp_path)
    args = [str(path), "--corpus", str(corpus), "--rows", "16", "--out", str(tmp_path / "o.ninfer")]
    assert main(_build([*args, *extra])) == 1
    err = capsys.readouterr().err
    assert err.startswith("ninfer draft-head: error: ") and err.count("\n") == 1
    assert re.search(problem, err), err
    assert not (tmp_path / "o.ninfer").exists()


def test_a_token_budget_reads_first_windows_across_the_corpus():
    """With --max-tokens, every file gives its first window before any gives a second,
    in an order that is not the folder's (a budget read in path order went to a few
    files of one folder); without, every file whole, in path order."""
    from ninfer_core.draft_head_build import reading_order

    files = [(Path(f"f{i:02d}.py"), f"f{i:02d}.py", False) for i in range(20)]
    whole = reading_order(files, 100, None)
    assert whole == [(f, 0, None) for f in files]
    budgeted = reading_order(files, 100, 500)
    firsts, rests = budgeted[:20], budgeted[20:]
    assert all((a, b) == (0, 100) for _, a, b in firsts)
    assert all((a, b) == (100, None) for _, a, b in rests)
    assert sorted(f for f, _, _ in firsts) == files  # each file once per pass
    assert [f for f, _, _ in firsts] != files  # not path order
    assert [f for f, _, _ in firsts] == [f for f, _, _ in rests]
    assert reading_order(list(reversed(files)), 100, 500) == budgeted  # stable
