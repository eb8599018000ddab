"""`ninfer bench spec`: what speculative decoding buys, per content class, in one run.

Speculation's gain depends on what is generated (a tool call's JSON is predictable, a story
is not), so each class of bundled prompts (`spec_prompts.py`: code, JSON tool calls, prose)
is reported apart. Every strategy × draft count gets its own engine, built once and reused
for every prompt and run (`one_request_engine`: no prefix cache), beside one engine that
does not speculate: the baseline. For every prompt and run, the configurations generate
the same greedy tokens one after another, the order reversed on every other run, so
drift on the machine (a neighbour, a frequency change) hits the baseline as much as the
speculative runs; each figure is the fastest run, and every speed-up is a ratio to the
baseline measured in the same run.

Decode tok/s is timed from the engine's events as `generation.stream` times it (tokens
after the first, over the time from the first token to the last), so prefill is excluded
and a round's several tokens count when they arrive. Acceptance comes from the engine's own
counters (`SpecCounters`), taken before and after each request. The output of a greedy
request must not change with speculation: every run's ids are compared with the
baseline's, and a difference is reported loudly.

A strategy NAME+lm-head drafts through a reduced head (`--lm-head-draft`), which the
built-in model does not carry. So that one run compares MTP with and without it, the
bench takes the head from --draft-head-model, else from MODEL, else builds a copy of MODEL
with one (`ninfer draft-head build`, into a temporary folder) from --draft-head-corpus;
the report says which, and for a built head its rows and coverage. A model the build
refuses (not a `.ninfer` file) skips those rows with the reason, as a refused strategy is.
"""

from __future__ import annotations

import os
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ninfer_core.bench.greedy import greedy_stats
from ninfer_core.bench.spec_prompts import CLASSES, ContentClass
from ninfer_core.config import opt
from ninfer_core.errors import NInferError, UnsupportedChoiceError
from ninfer_core.spec.config import MAX_DRAFT_TOKENS, SpecConfig
from ninfer_core.spec.stats import SpecCounters

if TYPE_CHECKING:
    from ninfer_core.draft_head_build import DraftHeadReport
    from ninfer_core.loading import LoadedModel

#: Greedy tokens each engine generates once before anything is timed.
WARMUP_TOKENS = 8
#: A strategy name with this suffix drafts through the reduced head (`--lm-head-draft`).
LM_HEAD = "+lm-head"
BASELINE = "off"
#: Corpus tokens a draft head built for the +lm-head rows ranks over: about 3 s on the
#: built-in model on 2 threads of a quiet machine (listing the standard library included).
DRAFT_HEAD_TOKENS = 32768
NOTE = (
    "every ratio is against the baseline (no speculation) measured in the same run, on the "
    "same prompts, threads and machine; absolute tok/s are this machine's"
)


@dataclass
class SpecBenchConfig:
    """Speculative decoding benchmark: strategies × draft tokens × content classes."""

    strategies: str = opt(
        "mtp,mtp+lm-head,ngram",
        "comma-separated draft strategies; NAME+lm-head drafts through the artifact's reduced "
        "head (--lm-head-draft)",
    )
    draft_tokens: str = opt("1,3,5", "comma-separated draft tokens per round (k) for each")
    classes: str = opt("code,json,prose", "comma-separated content classes to run")
    new: int = opt(128, "greedy tokens per generation (eos ignored)")
    runs: int = opt(2, "timed runs of every prompt per configuration; the fastest counts")
    prompts: int = opt(0, "prompts per class: the first N bundled ones; 0: all")
    threads: int = opt(0, "torch threads; 0: one per available core")
    dtype: Literal["bf16", "fp32"] = opt("bf16", "compute dtype")
    compile_decode: bool = opt(
        False,
        "every engine, the baseline's included, decodes through the compiled decode step and "
        "verifies rounds through the compiled round (compiled in the warm-up)",
    )
    draft_head_model: str | None = opt(
        None,
        "a copy of MODEL with a reduced draft head (`ninfer draft-head build`) for the "
        "+lm-head rows; unset: MODEL's own, else one built in this run (--draft-head-corpus)",
    )
    draft_head_corpus: str | None = opt(
        None,
        "folder of text files a draft head is built from when MODEL has none and "
        "--draft-head-model is unset (into a temporary folder, removed at the end); unset: "
        "this Python's standard library (the code the built-in model was trained on)",
    )
    draft_head_rows: int = opt(
        0, "rows of that built head (default 0: half MODEL's vocabulary, rounded up)"
    )
    draft_head_tokens: int = opt(
        DRAFT_HEAD_TOKENS,
        "corpus tokens the target ranks that head's rows over (the files in path order)",
    )
    as_json: bool = opt(False, "print the report as JSON", flag="--json")

    def strategy_list(self) -> list[str]:
        return _names(self.strategies, "--strategies")

    def k_list(self) -> list[int]:
        try:
            ks = [int(k) for k in _names(self.draft_tokens, "--draft-tokens")]
        except ValueError:
            raise NInferError(
                f"--draft-tokens: expected integers, got {self.draft_tokens!r}"
            ) from None
        if any(not 1 <= k <= MAX_DRAFT_TOKENS for k in ks):
            raise NInferError(f"--draft-tokens: each must be in 1..{MAX_DRAFT_TOKENS}")
        return ks

    def class_list(self) -> list[ContentClass]:
        names = _names(self.classes, "--classes")
        unknown = [c for c in names if c not in CLASSES]
        if unknown:
            raise NInferError(f"--classes: unknown {unknown}; known: {', '.join(CLASSES)}")
        return [c for c in CLASSES if c in names]

    def check(self) -> None:
        """Raise NInferError for counts no run can use (decode speed needs two tokens)."""
        if self.new < 2 or self.runs < 1 or self.prompts < 0 or self.threads < 0:
            raise NInferError("--new must be at least 2, --runs at least 1, --prompts 0 or more")
        if self.draft_head_rows < 0 or self.draft_head_tokens < 1:
            raise NInferError(
                "--draft-head-rows must be at least 1 (0: half the vocabulary), "
                "--draft-head-tokens at least 1"
            )
        self.strategy_list()
        self.k_list()
        self.class_list()


def _names(value: str, flag: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise NInferError(f"{flag}: nothing given")
    return names


@dataclass(frozen=True)
class Setting:
    """One engine's configuration: a strategy at k drafts per round, or the baseline."""

    strategy: str
    k: int = 0

    def spec(self) -> SpecConfig | None:
        if self.strategy == BASELINE:
            return None
        base = self.strategy.removesuffix(LM_HEAD)
        return SpecConfig(spec=base, draft_tokens=self.k, lm_head_draft=base != self.strategy)


def _snapshot(counters: SpecCounters) -> SpecCounters:
    return SpecCounters(counters.rounds, counters.drafted, counters.accepted,
                        list(counters.accepted_per_pos))  # fmt: skip


def _delta(after: SpecCounters, before: SpecCounters) -> SpecCounters:
    pos = list(after.accepted_per_pos)
    for i, n in enumerate(before.accepted_per_pos):
        pos[i] -= n
    return SpecCounters(after.rounds - before.rounds, after.drafted - before.drafted,
                        after.accepted - before.accepted, pos)  # fmt: skip


def _add(total: SpecCounters, part: SpecCounters) -> None:
    total.rounds += part.rounds
    total.drafted += part.drafted
    total.accepted += part.accepted
    total.accepted_per_pos.extend([0] * (len(part.accepted_per_pos) - len(total.accepted_per_pos)))
    for i, n in enumerate(part.accepted_per_pos):
        total.accepted_per_pos[i] += n


class Timed:
    """Every generation of one (setting, class): fastest decode per prompt, first run's ids
    and counters."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.counters = SpecCounters()
        self.counters_agree = True

    def tok_s(self) -> float:
        seconds = sum(self.seconds.values())
        return sum(self.tokens.values()) / seconds if seconds else 0.0


@dataclass
class DraftHead:
    """The model the +lm-head rows run on and where its reduced head came from, or why
    there is none (`reason`, the rows' skip)."""

    loaded: LoadedModel | None
    #: The report's `draft_head` (`_head_info`); None when there is no head.
    info: dict[str, Any] | None
    reason: str | None = None


def _head_info(
    source: str,
    path: str | None,
    rows: int | None,
    vocab: int,
    built: DraftHeadReport | None = None,
    corpus: str | None = None,
) -> dict[str, Any]:
    """The report's `draft_head`: the same keys whatever the source (null where a figure
    belongs to a build), so a reader of the JSON never has to test for a key."""
    return {
        "source": source,  # "given" (--draft-head-model), "model" (MODEL's own), "built"
        "path": path,  # None when built: the file lay in a temporary folder, now removed
        "rows": rows,
        "vocab": vocab,
        "corpus": corpus,
        "corpus_tokens": None if built is None else built.ranking.tokens + built.heldout.tokens,
        "heldout_tokens": None if built is None else built.heldout.tokens,
        "coverage": None if built is None else built.ranking.coverage(built.token_ids),
        "heldout_coverage": None if built is None else built.heldout.coverage(built.token_ids),
        "build_seconds": None if built is None else built.seconds["total"],
    }


def _head_rows(loaded: LoadedModel) -> int | None:
    """The rows of `loaded`'s reduced head, None when it has none."""
    from ninfer_core.spec.draft_head import WEIGHT, draft_head_tensors, has_draft_head

    if not has_draft_head(loaded.artifact):
        return None
    with draft_head_tensors(loaded.artifact) as tensors:
        return int(tensors.tensor_shape(WEIGHT)[0])


def _build_rows(cfg: SpecBenchConfig, vocab: int) -> int:
    """--draft-head-rows, 0 meaning half the vocabulary (rounded up): enough to keep nearly
    every token a small model's greedy output uses (docs/draft-head.md), few enough to be
    a reduced head. A count past the vocabulary is the user's mistake, not a skip, and is
    refused before any engine is built."""
    if cfg.draft_head_rows > vocab:
        raise NInferError(
            f"--draft-head-rows {cfg.draft_head_rows} is more than the vocabulary ({vocab})"
        )
    return cfg.draft_head_rows or (vocab + 1) // 2


def _build_head(cfg, path: Path, loaded, host, device, runtime, scratch: Path) -> DraftHead:
    """A draft head built from --draft-head-corpus into `scratch`, loaded; a build the
    model or corpus refuses (not a .ninfer file, no corpus) is the reason to skip, since the
    rest of the bench does not need it."""
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.draft_head_build import build_draft_head, default_out
    from ninfer_core.loading import load_model

    vocab = loaded.config.vocab_size
    rows = _build_rows(cfg, vocab)
    corpus = cfg.draft_head_corpus or sysconfig.get_paths()["stdlib"]
    try:
        built = build_draft_head(
            path,
            corpus,
            rows,
            out=scratch / default_out(path).name,  # a folder for a folder
            max_tokens=cfg.draft_head_tokens,
            runtime=RuntimeConfig(dtype=cfg.dtype),
        )
    except (NInferError, OSError) as exc:
        reason = (
            f"MODEL has no reduced draft head, and building one ({rows} rows from {corpus}) "
            f"was refused: {exc}; or name a copy of MODEL that has one with --draft-head-model "
            "PATH"
        )
        return DraftHead(None, None, reason)
    head = load_model(built.path, host=host, device=device, runtime=runtime)
    return DraftHead(head, _head_info("built", None, built.rows, vocab, built, str(corpus)))


def _draft_head(cfg, path: Path, loaded, host, device, runtime, scratch: Path) -> DraftHead:
    """The +lm-head rows' model: --draft-head-model, else MODEL when it has a reduced head,
    else a copy built in this run, so one run prints MTP with and without the head."""
    from ninfer_core.loading import load_model

    vocab = loaded.config.vocab_size
    if cfg.draft_head_model:
        head = load_model(cfg.draft_head_model, host=host, device=device, runtime=runtime)
        info = _head_info("given", cfg.draft_head_model, _head_rows(head), vocab)
        return DraftHead(head, info)
    rows = _head_rows(loaded)
    if rows is not None:
        return DraftHead(loaded, _head_info("model", str(path), rows, vocab))
    return _build_head(cfg, path, loaded, host, device, runtime, scratch)


def _base_refusal(strategy: str, skipped: list[dict]) -> str | None:
    """Why NAME was refused, for NAME+lm-head: the same model lacks the same thing, and
    knowing it first spares a draft head build that could serve nothing."""
    base = strategy.removesuffix(LM_HEAD)
    return next((s["reason"] for s in skipped if s["strategy"] == base), None)


def _build_engines(
    cfg, path: Path, loaded, host, device, runtime, scratch: Path
) -> tuple[dict, list[dict], dict | None]:
    """{Setting: Engine} (the baseline first), the strategies refused (with the reason),
    and where the +lm-head rows' reduced head came from (`_head_info`; None if no row)."""
    from ninfer_core.generation import one_request_engine

    known = {e.name for e in host.draft_strategies.entries()}
    unknown = [s for s in cfg.strategy_list() if s.removesuffix(LM_HEAD) not in known]
    if unknown:
        raise NInferError(f"--strategies: unknown {unknown}; known: {', '.join(sorted(known))} "
                          f"(each also as NAME{LM_HEAD})")  # fmt: skip
    engines = {Setting(BASELINE): one_request_engine(loaded, host=host, device=device,
                                                     runtime=runtime)}  # fmt: skip
    skipped: list[dict] = []
    head: DraftHead | None = None
    for strategy in cfg.strategy_list():
        target = loaded
        if strategy.endswith(LM_HEAD):
            reason = _base_refusal(strategy, skipped)
            if reason is None:
                head = head or _draft_head(cfg, path, loaded, host, device, runtime, scratch)
                reason = head.reason
            if reason is not None:
                skipped.append({"strategy": strategy, "reason": reason})
                continue
            target = head.loaded
        for k in cfg.k_list():
            setting = Setting(strategy, k)
            try:
                engines[setting] = one_request_engine(
                    target, host=host, device=device, runtime=runtime, spec=setting.spec()
                )
            except UnsupportedChoiceError as exc:  # the model's refusal is the same at every k
                hint = ""
                if strategy.endswith(LM_HEAD) and not cfg.draft_head_model:
                    hint = "; or name a copy of MODEL that has one with --draft-head-model PATH"
                skipped.append({"strategy": strategy, "reason": f"{exc}{hint}"})
                break
    used = head is not None and any(s.strategy.endswith(LM_HEAD) for s in engines)
    return engines, skipped, head.info if used else None


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _machine_busy_seconds() -> float | None:
    """CPU seconds all processes have used since boot (Linux `/proc/stat`), else None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def _time_all(cfg, engines, prompts) -> tuple[dict, list[dict], dict[str, float | None]]:
    """Every (setting, class) timed; the greedy mismatches; who had the CPUs meanwhile."""
    timed = {(s, c): Timed() for s in engines for c in prompts}
    reference: dict[tuple[str, str], list[int]] = {}
    mismatches: list[dict] = []
    settings = list(engines)
    wall, cpu, busy = time.perf_counter(), time.process_time(), _machine_busy_seconds()
    for run in range(cfg.runs):
        order = settings if run % 2 == 0 else settings[::-1]  # drift hits every setting alike
        for cls, named in prompts.items():
            for name, ids in named:
                for setting in order:
                    engine = engines[setting]
                    before = _snapshot(engine.spec_counters)
                    stats = greedy_stats(engine, ids, cfg.new)
                    record = timed[setting, cls]
                    seconds = record.seconds.get(name, float("inf"))
                    record.seconds[name] = min(seconds, stats.decode_seconds)
                    record.tokens[name] = stats.completion_tokens - 1
                    if run == 0 and setting.strategy != BASELINE:
                        delta = _delta(engine.spec_counters, before)
                        usage = stats.spec
                        record.counters_agree &= usage is not None and (
                            usage.rounds,
                            usage.drafted,
                            usage.accepted,
                        ) == (delta.rounds, delta.drafted, delta.accepted)
                        _add(record.counters, delta)
                    ref = reference.setdefault((cls, name), list(stats.token_ids))
                    at = _first_difference(stats.token_ids, ref)
                    if at is not None:
                        mismatches.append({"class": cls, "prompt": name, "run": run + 1,
                                           "strategy": setting.strategy, "k": setting.k,
                                           "first_difference_at": at})  # fmt: skip
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = _machine_busy_seconds()
    # A small model leaves its second thread idle between steps (Python runs the loop), so
    # a low share of our own threads is no sign of a neighbour; others' CPU time is.
    others = None if busy is None or after is None else max(after - busy - cpu, 0.0)
    return (
        timed,
        mismatches,
        {
            "own_threads": cpu / (wall * torch.get_num_threads()),
            "other_processes": None if others is None else others / (wall * (os.cpu_count() or 1)),
        },
    )


def _row(cls: str, setting: Setting, record: Timed, base: Timed, mismatched: set) -> dict:
    c = record.counters
    # every position up to k, those no round accepted at included
    per_pos = c.accepted_per_pos + [0] * (setting.k - len(c.accepted_per_pos))
    tok_s, base_tok_s = record.tok_s(), base.tok_s()
    return {
        "class": cls,
        "strategy": setting.strategy,
        "k": setting.k,
        "rounds": c.rounds,
        "drafted": c.drafted,
        "accepted": c.accepted,
        "accepted_per_pos": per_pos,
        "acceptance_rate": c.accepted / c.drafted if c.drafted else None,
        "tokens_per_round": 1 + c.accepted / c.rounds if c.rounds else None,
        "acceptance_by_pos": [n / c.rounds for n in per_pos] if c.rounds else [],
        "decode_tok_s": tok_s,
        "baseline_decode_tok_s": base_tok_s,
        "ratio": tok_s / base_tok_s if base_tok_s else None,
        "identical": (cls, setting.strategy, setting.k) not in mismatched,
        "counters_agree": record.counters_agree,
    }


def run_bench(cfg: SpecBenchConfig, model: str | None = None) -> dict[str, Any]:
    """Every figure of the benchmark, as plain data (the CLI prints or dumps it)."""
    from ninfer_core.bench.spec_prompts import class_prompts
    from ninfer_core.builtin_model import CHAT_TEMPLATE, default_model
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device, thread_summary
    from ninfer_core.generation import PromptText
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host
    from ninfer_core.text import Tokenizer

    cfg.check()
    threads = cfg.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    host, device = create_host(), probe_device()
    path = Path(model) if model else default_model()
    loaded = load_model(path, host=host, device=device, runtime=RuntimeConfig(dtype=cfg.dtype))
    text = PromptText.from_loaded(loaded, Tokenizer.from_artifact(loaded.artifact))
    builtin = text.template is not None and text.template.templates.get("default") == CHAT_TEMPLATE
    prompts = {c: class_prompts(c, text, builtin=builtin)[: cfg.prompts or None]
               for c in cfg.class_list()}  # fmt: skip
    longest = max(len(ids) for named in prompts.values() for _, ids in named)
    runtime = RuntimeConfig(dtype=cfg.dtype, max_context=longest + cfg.new + MAX_DRAFT_TOKENS + 1,
                            compile_decode=cfg.compile_decode)  # fmt: skip
    _build_rows(cfg, loaded.config.vocab_size)  # a bad --draft-head-rows fails here
    # a draft head built for the +lm-head rows lives here until every engine is closed
    with tempfile.TemporaryDirectory(prefix="ninfer-bench-spec-") as scratch:
        engines, skipped, draft_head = _build_engines(
            cfg, path, loaded, host, device, runtime, Path(scratch)
        )
        try:
            first = next(iter(prompts.values()))[0][1]
            for engine in engines.values():
                greedy_stats(engine, first, WARMUP_TOKENS)
            timed, mismatches, cpu_share = _time_all(cfg, engines, prompts)
        finally:
            for engine in engines.values():
                engine.close()
    mismatched = {(m["class"], m["strategy"], m["k"]) for m in mismatches}
    base = Setting(BASELINE)
    rows = [_row(c, s, timed[s, c], timed[base, c], mismatched)
            for c in prompts for s in engines if s != base]  # fmt: skip
    return {
        "model": str(path),
        "dtype": cfg.dtype,
        "compile_decode": cfg.compile_decode,
        "prompt_forms": "built-in (raw code, held-out tool turns)" if builtin else "chat template",
        "threads": threads,
        "thread_summary": thread_summary(),
        "new_tokens": cfg.new,
        "runs": cfg.runs,
        "classes": {
            c: {
                "prompts": [n for n, _ in named],
                "prompt_tokens": [len(ids) for _, ids in named],
                "baseline_decode_tok_s": timed[base, c].tok_s(),
            }
            for c, named in prompts.items()
        },
        "rows": rows,
        "draft_head_model": cfg.draft_head_model,
        "draft_head": draft_head,
        "skipped": skipped,
        "identical": not mismatches,
        "mismatches": mismatches,
        "cpu_share": cpu_share,
        "load_average": [load_before, os.getloadavg()],
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "kernel_ops": [c.to_json() for c in loaded.kernels],
        "note": NOTE,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table, one per class × strategy × k."""
    lines = [
        "| class | strategy | k | acceptance | tokens/round | acceptance by position | "
        "decode tok/s off | decode tok/s on | ratio | greedy ids |",
        "|" + " --- |" * 10,
    ]
    for r in result["rows"]:
        by_pos = " ".join(f"{a:.2f}" for a in r["acceptance_by_pos"]) or "-"
        lines.append(
            f"| {r['class']} | {r['strategy']} | {r['k']} | {_fmt(r['acceptance_rate'], '.1%')} | "
            f"{_fmt(r['tokens_per_round'], '.2f')} | {by_pos} | "
            f"{r['baseline_decode_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
            f"{_fmt(r['ratio'], '.2f')} | {'identical' if r['identical'] else 'MISMATCH'} |"
        )
    return "\n".join(lines)


def head_line(head: dict[str, Any]) -> str:
    """Where the +lm-head rows' reduced head came from: a head built in this run is only as
    good as its corpus, so its size, corpus and coverage are printed beside the rows."""
    rows = "?" if head["rows"] is None else f"{head['rows']} of {head['vocab']}"
    if head["source"] == "given":
        return f"{LM_HEAD} rows: target and reduced head ({rows} rows) of {head['path']}"
    if head["source"] == "model":
        return f"{LM_HEAD} rows: MODEL's own reduced head ({rows} rows)"
    heldout = head["heldout_coverage"]
    held = (
        "no held-out file read"
        if heldout is None
        else f"{heldout:.2%} of {head['heldout_tokens']:,} held-out tokens"
    )
    return (
        f"{LM_HEAD} rows: reduced head built in this run (`ninfer draft-head build`, removed "
        f"at the end): {rows} rows ranked over {head['corpus_tokens']:,} tokens of "
        f"{head['corpus']}; coverage {_fmt(head['coverage'], '.2%')} (ranking set), {held}; "
        f"built in {head['build_seconds']:.1f} s"
    )


def render(result: dict[str, Any]) -> str:
    """The header (model, threads, load), the table, skips, and any warning, loudly."""
    from ninfer_core.bench import kernel_ops_line

    before, after = result["load_average"]
    prompts = "; ".join(
        f"{c}: "
        + ", ".join(f"{n} ({t})" for n, t in zip(v["prompts"], v["prompt_tokens"], strict=True))
        for c, v in result["classes"].items()
    )
    lines = [
        f"model: {result['model']} ({result['dtype']}"
        f"{', compiled decode and rounds' if result.get('compile_decode') else ''}), "
        f"prompts: {result['prompt_forms']}",
        kernel_ops_line(result["kernel_ops"]),
        f"{result['thread_summary']}; {result['new_tokens']} new greedy tokens per prompt, "
        f"fastest of {result['runs']} runs, configurations alternated (order reversed every "
        f"other run); load average (1 min) {before[0]:.2f} before, {after[0]:.2f} after "
        f"(on {result['cpus']} CPUs)",
        f"prompts per class: {prompts}",
        f"note: {result['note']}",
        "",
        table(result),
    ]
    if result.get("draft_head"):
        lines.append(head_line(result["draft_head"]))
    for s in result["skipped"]:
        lines.append(f"skipped {s['strategy']}: {s['reason']}")
    runs: dict[tuple, list[int]] = {}
    for m in result["mismatches"]:
        key = (m["strategy"], m["k"], m["class"], m["prompt"], m["first_difference_at"])
        runs.setdefault(key, []).append(m["run"])
    for (strategy, k, cls, prompt, at), numbers in runs.items():
        lines.append(
            f"MISMATCH: {strategy} k={k} gave other greedy ids than the baseline on "
            f"{cls}/{prompt} (run {', '.join(map(str, sorted(numbers)))}), from token {at}"
            " — speculation must not change greedy output"
        )
    if result["mismatches"]:
        lines.append(
            "(a verifying forward runs k + 1 rows where the baseline runs 1: at reduced "
            "precision two logits tied in one can differ in the other; rerun with --dtype "
            "fp32 to tell rounding from a logic error)"
        )
    if not all(r["counters_agree"] for r in result["rows"]):
        lines.append("warning: a request's own spec usage disagreed with the engine's counters")
    share = result["cpu_share"]
    others = share["other_processes"]
    lines.append(
        f"CPU during the timed runs: this process {share['own_threads']:.0%} of its threads' "
        "time; other processes "
        + ("not measured (no /proc/stat)" if others is None else f"{others:.0%} of the machine's")
    )
    if others is not None and others > 0.1:
        lines.append(
            "warning: other processes were running; the tok/s are low (the ratios less so, "
            "the configurations being alternated). Rerun on a quiet machine."
        )
    return "\n".join(lines)
