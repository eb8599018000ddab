"""`ninfer bench serve --url URL`: the deployment guide's table, for any compatible server.

Per scenario (`coding`, `agent`; `serve_workload`), context length and concurrency, `runs`
rounds of `concurrency` streamed requests sent at once, each with a fresh salt so no prefix
cache helps. Per cell: TTFT, prefill tok/s (prompt tokens ÷ TTFT), decode tok/s per stream
(tokens after the first ÷ the time after the first), speculation figures where the server
reports them, as median with min and max over every request of every run. At C2 and above,
`wait` is the guide's observation 1 measured: the last first token's time ÷ the sum of the
requests' prefills alone (C1's TTFT), ≈1 when a server prefills one request after the other,
≈0.5 at C2 when it prefills both together. The same workload (the very same text) can run
against a second endpoint (`--compare`), with ratios per cell.

Token lengths are the target's own: Anthropic endpoints count with `/v1/messages/count_tokens`
where they serve it, anything else by the `usage.prompt_tokens` of a one-token probe
request; the character budget is rescaled until the count is within 1% (or 8 tokens).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ninfer_core.bench.serve_stream import Api, Sample, count_tokens, first_model, stream
from ninfer_core.bench.serve_workload import (
    SCENARIOS,
    Conversation,
    anthropic_body,
    build,
    openai_body,
    parse_contexts,
)
from ninfer_core.config import opt
from ninfer_core.errors import NInferError

if TYPE_CHECKING:  # imported where used: httpx comes with litestar, undeclared
    import httpx

#: A progress report: (requests just finished, what runs now).
Progress = Callable[[int, str], None]


@dataclass
class ServeBenchConfig:
    """Workload of `ninfer bench serve`."""

    url: str | None = opt(None, "the server, e.g. http://127.0.0.1:18020 (or as an argument)")
    api: Literal["openai", "anthropic"] = opt(
        "openai", "openai: /v1/chat/completions; anthropic: /v1/messages"
    )
    model: str | None = opt(None, "model to request (default: the first id of GET /v1/models)")
    api_key: str | None = opt(
        None, "API key (default: $OPENAI_API_KEY or $ANTHROPIC_API_KEY, by --api)"
    )
    scenario: Literal["coding", "agent", "both"] = opt(
        "both", "coding: a file of code + an edit request; agent: tools + tool results + a question"
    )
    contexts: str = opt("8k,32k,64k", "prompt lengths in the target's tokens, e.g. 1k,4k or 1000")
    concurrency: str = opt("1,2", "comma-separated concurrency levels")
    max_tokens: int = opt(160, "tokens to generate per request")
    runs: int = opt(3, "rounds per cell (each sends `concurrency` requests at once)")
    ignore_eos: bool = opt(
        True, "send `ignore_eos` (NInfer, vLLM, llama.cpp) so every answer is --max-tokens long"
    )
    spec_stats: bool = opt(True, "send `return_spec_stats` (NInfer) for speculation figures")
    compare: str | None = opt(None, "a second endpoint to run the same workload against")
    compare_api: Literal["openai", "anthropic"] | None = opt(None, "its API (default: --api)")
    compare_model: str | None = opt(None, "its model (default: the first of its /v1/models)")
    compare_api_key: str | None = opt(None, "its API key (default: --api-key)")
    out: str | None = opt(None, "folder for serve.json, serve.md and the PNG plots")
    plot: bool = opt(True, "write PNG plots into --out (needs the 'plot' extra: matplotlib)")
    seed: int | None = opt(None, "salt base (default: random, so no earlier run's cache helps)")
    timeout_s: float = opt(900.0, "per-request timeout in seconds")

    def levels(self) -> list[int]:
        try:
            levels = [int(c) for c in self.concurrency.split(",") if c.strip()]
        except ValueError:
            levels = []
        if not levels or min(levels) < 1:
            raise NInferError(
                f"--concurrency: positive integers, e.g. 1,2 (got {self.concurrency!r})"
            )
        return sorted(set(levels))

    def scenarios(self) -> list[str]:
        return list(SCENARIOS) if self.scenario == "both" else [self.scenario]

    def check(self) -> None:
        """Every option is checked before the first request: a run can take an hour."""
        if not self.url:
            raise NInferError("give the server: ninfer bench serve --url http://HOST:PORT")
        self.levels()
        parse_contexts(self.contexts)
        if self.max_tokens < 2 or self.runs < 1:
            raise NInferError("--max-tokens must be at least 2 and --runs at least 1")


@dataclass
class Endpoint:
    """One server under test, as the requests address it."""

    label: str
    root: str
    api: Api
    key: str
    model: str
    extras: dict[str, Any]

    def body(self, conv: Conversation, max_tokens: int) -> dict[str, Any]:
        make = openai_body if self.api == "openai" else anthropic_body
        return make(conv, self.model, max_tokens, self.extras)


def api_root(url: str) -> str:
    """`http://host:port`, `.../` or `.../v1` → `http://host:port`."""
    return url.rstrip("/").removesuffix("/v1")


def _key(explicit: str | None, api: Api) -> str:
    env = "OPENAI_API_KEY" if api == "openai" else "ANTHROPIC_API_KEY"
    return explicit or os.environ.get(env) or "none"


async def _endpoint(
    client: httpx.AsyncClient, label: str, url: str, api: Api, key: str, model: str | None,
    cfg: ServeBenchConfig,
) -> Endpoint:  # fmt: skip
    root = api_root(url)
    extras: dict[str, Any] = {}
    if cfg.ignore_eos:
        extras["ignore_eos"] = True
    if cfg.spec_stats:
        extras["return_spec_stats"] = True
    model = model or await first_model(client, root, api, key)
    return Endpoint(label, root, api, key, model, extras)


async def measure_tokens(
    client: httpx.AsyncClient, ep: Endpoint, conv: Conversation
) -> tuple[int, str]:
    """The prompt's tokens as `ep` counts them, and how they were counted."""
    body = ep.body(conv, 1)
    if ep.api == "anthropic" and (n := await count_tokens(client, ep.root, ep.key, body)):
        return n, "count_tokens"
    sample = await stream(client, ep.root, ep.api, ep.key, body)
    # its one token may be one no text comes of (an end token, half a character): the
    # count is all a probe is for
    if not sample.prompt_tokens:
        why = sample.error or "its usage carried no prompt token count"
        error = ProbeError(f"the probe request to {ep.root} failed: {why}")
        error.refused = (sample.error or "").startswith("HTTP 400")
        raise error
    return sample.prompt_tokens, "usage.prompt_tokens of a probe request"


class ProbeError(NInferError):
    """A probe request failed; `refused`: with a 400, as a prompt over the context is."""

    refused = False


async def calibrate(
    client: httpx.AsyncClient, ep: Endpoint, scenario: str, target: int, salt: int
) -> dict[str, Any]:
    """A character budget whose prompt is `target` tokens on `ep`, within 1% or 8 tokens (or
    as close as the scenario's fixed part allows)."""
    chars, best, how = target * 2, None, ""  # ~2 characters a token: mixed text, BPE
    for attempt in range(8):
        try:
            tokens, how = await measure_tokens(client, ep, build(scenario, chars, salt + attempt))
        except ProbeError as exc:
            # the first guess can overshoot a small context: halve it and ask again
            if not exc.refused or chars <= 200 or attempt == 7:
                raise
            chars //= 2
            continue
        if best is None or abs(tokens - target) < abs(best[1] - target):
            best = (chars, tokens)
        if abs(tokens - target) <= max(target // 100, 8):
            break
        scaled = max(int(chars * target / tokens), 200)
        if scaled == chars:
            break
        chars = scaled
    assert best is not None
    return {"scenario": scenario, "target": target, "chars": best[0], "tokens": best[1],
            "counted_by": how}  # fmt: skip


def stat(values: list[float]) -> dict[str, float] | None:
    """Median with the spread: min and max, and how many values."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}  # fmt: skip


def spec_figures(samples: list[Sample]) -> tuple[float | None, float | None]:
    """(acceptance rate, tokens per round) over the requests that reported speculation."""
    spec = [s.spec for s in samples if s.spec]
    drafted = sum(s.get("draft_tokens", 0) for s in spec)
    accepted = sum(s.get("accepted_tokens", 0) for s in spec)
    rounds = sum(s.get("rounds", 0) for s in spec)
    rate = accepted / drafted if drafted else None
    per_round = 1 + accepted / rounds if rounds else None
    return rate, per_round


def summarize(
    key: dict[str, Any], runs: list[list[Sample]], solo_ttft_s: float | None
) -> dict[str, Any]:
    """One cell of the table from its runs; `solo_ttft_s`: C1's median TTFT at the same
    scenario and length, for `wait`."""
    every = [s for run in runs for s in run]
    ok = [s for s in every if s.ok]
    waits = []
    for run in runs:
        ttfts = sorted(s.ttft_s for s in run if s.ok)
        if len(run) >= 2 and len(ttfts) == len(run) and solo_ttft_s:
            waits.append(ttfts[-1] / (len(run) * solo_ttft_s))
    rate, per_round = spec_figures(ok)
    prompts = [s.prompt_tokens for s in ok if s.prompt_tokens]
    # a prefix cache's hits, where reported: the salts leave it the template's head at most
    cached = [s.cached_tokens for s in ok if s.cached_tokens is not None]
    # the per-token times: speculation sends tokens in bursts, which a mean hides
    gaps = sorted((b - a) * 1000 for s in ok for a, b in itertools.pairwise(s.token_times))
    return {
        **key,
        "requests": len(every),
        "errors": len(every) - len(ok),
        "first_error": next((s.error for s in every if s.error), None),
        "prompt_tokens": statistics.median(prompts) if prompts else None,
        "completion_tokens": statistics.median([s.tokens for s in ok]) if ok else None,
        "cached_tokens": max(cached) if cached else None,
        "ttft_ms": stat([s.ttft_s * 1000 for s in ok]),
        "prefill_tok_s": stat([p for s in ok if (p := s.prefill_tok_s)]),
        "decode_tok_s": stat([d for s in ok if (d := s.decode_tok_s)]),
        "server_prefill_tok_s": stat([p for s in ok if (p := s.server_prefill_tok_s)]),
        "acceptance": rate,
        "tokens_per_round": per_round,
        "wait": stat(waits),
        "itl_ms": {"p50": percentile(gaps, 0.5), "p90": percentile(gaps, 0.9)} if gaps else None,
    }


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks of a sorted list (numpy's default)."""
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


async def run_endpoint(
    client: httpx.AsyncClient, ep: Endpoint, cfg: ServeBenchConfig, sizes: list[dict[str, Any]],
    salt: int, progress: Progress,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every cell against one endpoint, C1 first so the wider levels have its TTFT."""
    cells = []
    for size in sizes:
        solo = None
        for c in cfg.levels():
            name = f"{ep.label} {size['scenario']} {size['target']} tokens C{c}"
            runs = []
            for _ in range(cfg.runs):
                convs = [build(size["scenario"], size["chars"], salt + i) for i in range(c)]
                bodies = [ep.body(conv, cfg.max_tokens) for conv in convs]
                salt += c
                progress(0, name)
                runs.append(
                    list(await asyncio.gather(
                        *(stream(client, ep.root, ep.api, ep.key, b) for b in bodies)
                    ))
                )  # fmt: skip
                progress(c, name)
            key = {"endpoint": ep.label, "scenario": size["scenario"],
                   "context": size["target"], "concurrency": c}  # fmt: skip
            cell = summarize(key, runs, solo)
            if cell["errors"] == cell["requests"]:
                raise NInferError(f"every request of {name} failed: {cell['first_error']}")
            if c == 1 and cell["ttft_ms"]:
                solo = cell["ttft_ms"]["median"] / 1000
            cells.append(cell)
    return cells


def ratios(cells: list[dict[str, Any]], base: str, other: str) -> list[dict[str, Any]]:
    """`other` ÷ `base` per cell, for each figure's median."""

    def median(cell: dict[str, Any], name: str) -> float | None:
        return cell[name]["median"] if cell.get(name) else None

    index = {(c["scenario"], c["context"], c["concurrency"]): c for c in cells
             if c["endpoint"] == base}  # fmt: skip
    out = []
    for cell in (c for c in cells if c["endpoint"] == other):
        ref = index.get((cell["scenario"], cell["context"], cell["concurrency"]))
        if ref is None:
            continue
        row = {k: cell[k] for k in ("scenario", "context", "concurrency")}
        for name in ("ttft_ms", "prefill_tok_s", "decode_tok_s"):
            a, b = median(cell, name), median(ref, name)
            row[name] = a / b if a is not None and b else None
        out.append(row)
    return out


async def server_kernel_ops(client: httpx.AsyncClient, root: str) -> list[dict[str, Any]] | None:
    """Which kernel backend serves each op, as an NInfer server's `/health` reports it;
    None from a server that does not (vLLM, llama.cpp)."""
    import httpx

    try:
        reply = await client.get(root + "/health")
        body = reply.json() if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    ops = body.get("kernel_ops") if isinstance(body, dict) else None
    return ops if isinstance(ops, list) else None


def planned_requests(cfg: ServeBenchConfig) -> int:
    """Timed requests in the whole run, for a progress bar."""
    per_endpoint = (
        len(cfg.scenarios()) * len(parse_contexts(cfg.contexts)) * sum(cfg.levels()) * cfg.runs
    )
    return per_endpoint * (2 if cfg.compare else 1)


async def bench(cfg: ServeBenchConfig, progress: Progress) -> dict[str, Any]:
    import httpx

    cfg.check()
    assert cfg.url is not None
    salt = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(1 << 30)
    started = time.time()
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=max(cfg.levels()) + 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        ep = await _endpoint(client, "A", cfg.url, cfg.api, _key(cfg.api_key, cfg.api),
                             cfg.model, cfg)  # fmt: skip
        endpoints = [ep]
        if cfg.compare:
            api = cfg.compare_api or cfg.api
            key = _key(cfg.compare_api_key or cfg.api_key, api)
            endpoints.append(
                await _endpoint(client, "B", cfg.compare, api, key, cfg.compare_model, cfg)
            )
        sizes = []
        for scenario in cfg.scenarios():
            for target in parse_contexts(cfg.contexts):
                progress(0, f"calibrating {scenario} at {target} tokens on {ep.root}")
                sizes.append(await calibrate(client, ep, scenario, target, salt))
                salt += 10
        cells = []
        for e in endpoints:
            cells += await run_endpoint(client, e, cfg, sizes, salt, progress)
            salt += 1 << 20
        described = [
            {"label": e.label, "url": e.root, "api": e.api, "model": e.model,
             "kernel_ops": await server_kernel_ops(client, e.root)}
            for e in endpoints
        ]  # fmt: skip
    return {
        "endpoints": described,
        "max_tokens": cfg.max_tokens,
        "runs": cfg.runs,
        "ignore_eos": cfg.ignore_eos,
        "sizes": sizes,
        "cells": cells,
        "compare": ratios(cells, "A", "B") if cfg.compare else [],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": time.time() - started,
    }


def run_serve_bench(cfg: ServeBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    return asyncio.run(bench(cfg, progress or (lambda n, what: None)))
