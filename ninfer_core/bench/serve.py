"""`ninfer bench serve URL`: a client load against any OpenAI-compatible server.

Streaming requests to `/v1/chat/completions` (or `/v1/completions`) at each concurrency
level, through the official `openai` SDK, so NInfer, vLLM and llama.cpp's server are measured
the same way. Per request: time to the first generated text (TTFT) and decode tok/s (tokens
after the first ÷ time after the first; tokens from `usage` when the server sends it with
`stream_options.include_usage`, else one per chunk). Per level: TTFT p50/p90, the median
stream's decode tok/s, aggregate tok/s (all tokens ÷ the level's wall time) and errors.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ninfer_core.config import opt
from ninfer_core.errors import NInferError

if TYPE_CHECKING:
    from openai import AsyncOpenAI

#: Short common words: most are one token in a BPE vocabulary, so words ≈ tokens.
_COMMON = (
    "the of and to in is it that for on was with as at by be this from or have an they "
    "which one you were all we can her has there their been if more when will would who so "
    "no out up into than them some could time two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where"
)
WORDS = _COMMON.split()


@dataclass
class ServeBenchConfig:
    """Load for `ninfer bench serve`."""

    api: Literal["chat", "completions"] = opt(
        "chat", "endpoint: /v1/chat/completions or /v1/completions"
    )
    model: str | None = opt(None, "model to request (default: the first id of GET /v1/models)")
    api_key: str | None = opt(None, "API key sent as a Bearer token (default: $OPENAI_API_KEY)")
    concurrency: str = opt("1,2", "comma-separated concurrency levels")
    requests: int = opt(8, "requests per concurrency level")
    prompt_tokens: int = opt(512, "prompt length, approximated by words and calibrated by usage")
    max_tokens: int = opt(64, "tokens to generate per request")
    ignore_eos: bool = opt(
        True, "send `ignore_eos` (NInfer, vLLM, llama.cpp) so every answer is --max-tokens long"
    )
    warmup: int = opt(1, "untimed requests first (the first one calibrates the prompt length)")
    timeout_s: float = opt(300.0, "per-request timeout in seconds")

    def levels(self) -> list[int]:
        try:
            levels = [int(c) for c in self.concurrency.split(",") if c.strip()]
        except ValueError:
            levels = []
        if not levels or min(levels) < 1:
            raise NInferError(
                f"--concurrency: positive integers, e.g. 1,2 (got {self.concurrency!r})"
            )
        return levels


@dataclass
class Sample:
    """One request: when its first and last text arrived, its tokens, or what went wrong."""

    start: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    from_usage: bool = False
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        assert self.first is not None
        return self.first - self.start

    @property
    def decode_tok_s(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2 or self.last <= self.first:
            return None
        return (self.tokens - 1) / (self.last - self.first)


def prompt_text(words: int, salt: int) -> str:
    """A deterministic prompt of `words` words; the salt comes first, so two prompts share no
    prefix (a prefix cache would otherwise make every request after the first cheap)."""
    rng = random.Random(salt)
    return f"{salt}: " + " ".join(rng.choice(WORDS) for _ in range(max(words - 1, 0)))


def _has_text(chunk: Any, api: str) -> bool:
    if not chunk.choices:
        return False
    if api == "completions":
        return bool(chunk.choices[0].text)
    delta = chunk.choices[0].delta
    # Reasoning models stream their thinking first; it is generated text all the same.
    extra = delta.model_extra or {}
    return bool(
        delta.content
        or delta.tool_calls
        or extra.get("reasoning_content")
        or extra.get("reasoning")
    )


async def one_request(
    client: AsyncOpenAI, cfg: ServeBenchConfig, model: str, prompt: str
) -> Sample:
    import httpx
    import openai

    common: dict[str, Any] = {
        "model": model, "max_tokens": cfg.max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "timeout": cfg.timeout_s,
        "extra_body": {"ignore_eos": True} if cfg.ignore_eos else None,
    }  # fmt: skip
    sample = Sample(time.perf_counter())
    chunks = 0
    try:
        if cfg.api == "chat":
            messages = [{"role": "user", "content": prompt}]
            stream = await client.chat.completions.create(messages=messages, **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            now = time.perf_counter()
            if _has_text(chunk, cfg.api):
                sample.first = sample.first or now
                sample.last = now
                chunks += 1
            if chunk.usage is not None:
                sample.tokens, sample.from_usage = chunk.usage.completion_tokens, True
                sample.prompt_tokens = chunk.usage.prompt_tokens
    except (TimeoutError, openai.OpenAIError, httpx.HTTPError) as exc:  # httpx: a broken stream
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    if not sample.from_usage:
        sample.tokens = chunks
    if sample.first is None:
        sample.error = "the stream ended without any text"
    return sample


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(concurrency: int, samples: list[Sample], wall_s: float) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None]
    ttfts = [s.ttft_s * 1000 for s in ok]
    decodes = [d for s in ok if (d := s.decode_tok_s) is not None]
    tokens = sum(s.tokens for s in ok)
    prompts = [s.prompt_tokens for s in ok if s.prompt_tokens is not None]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "ttft_p50_ms": percentile(ttfts, 0.5) if ttfts else None,
        "ttft_p90_ms": percentile(ttfts, 0.9) if ttfts else None,
        "decode_tok_s_median": statistics.median(decodes) if decodes else None,
        # A stream whose text came in one chunk has no decode time to measure.
        "decode_streams": len(decodes),
        "aggregate_tok_s": tokens / wall_s if wall_s > 0 else None,
        "completion_tokens": [s.tokens for s in ok],
        "tokens_from_usage": all(s.from_usage for s in ok) if ok else None,
        "prompt_tokens_median": statistics.median(prompts) if prompts else None,
        "wall_s": wall_s,
        "first_error": next((s.error for s in samples if s.error), None),
    }


async def run_level(client, cfg, model, concurrency: int, words: int, salt: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int) -> Sample:
        async with gate:
            return await one_request(client, cfg, model, prompt_text(words, salt + i))

    start = time.perf_counter()
    samples = await asyncio.gather(*(gated(i) for i in range(cfg.requests)))
    return summarize(concurrency, list(samples), time.perf_counter() - start)


def ratios(levels: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each level's figures ÷ the first level's: `C2/C1` and so on."""
    base, out = levels[0], {}
    for level in levels[1:]:
        name = f"C{level['concurrency']}/C{base['concurrency']}"
        out[name] = {
            key: level[key] / base[key] if level[key] and base[key] else None
            for key in ("ttft_p50_ms", "decode_tok_s_median", "aggregate_tok_s")
        }
    return out


def api_root(url: str) -> str:
    """`http://host:port`, `.../` or `.../v1` → the `/v1` base the SDK wants."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def bench(url: str, cfg: ServeBenchConfig) -> dict[str, Any]:
    import openai

    levels = cfg.levels()
    if cfg.requests < 1 or cfg.max_tokens < 1 or cfg.prompt_tokens < 1:
        raise NInferError("--requests, --max-tokens and --prompt-tokens must be at least 1")
    key = cfg.api_key or os.environ.get("OPENAI_API_KEY") or "none"
    base = api_root(url)
    async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as client:
        model = cfg.model
        if model is None:
            try:
                models = await client.models.list(timeout=30)
            except openai.OpenAIError as exc:
                raise NInferError(
                    f"GET {base}/models failed: {type(exc).__name__}: {exc}"
                ) from None
            if not models.data:
                raise NInferError(f"GET {base}/models lists no model; pass --model")
            model = models.data[0].id
        kernel_ops = await server_kernel_ops(base, cfg.timeout_s)
        words = cfg.prompt_tokens
        for i in range(cfg.warmup):
            sample = await one_request(client, cfg, model, prompt_text(words, 10**6 + i))
            if sample.error:
                raise NInferError(f"the warm-up request to {base} failed: {sample.error}")
            if i == 0 and sample.prompt_tokens:  # scale words to the server's token count
                words = max(1, round(words * cfg.prompt_tokens / sample.prompt_tokens))
        results = []
        for n, concurrency in enumerate(levels):
            level = await run_level(client, cfg, model, concurrency, words, salt=1000 * (n + 1))
            if level["errors"] == level["requests"]:
                raise NInferError(
                    f"every request at concurrency {concurrency} failed: {level['first_error']}"
                )
            results.append(level)
    return {
        "url": base, "model": model, "api": cfg.api, "kernel_ops": kernel_ops,
        "prompt_words": words,
        "prompt_tokens": cfg.prompt_tokens, "max_tokens": cfg.max_tokens,
        "levels": results, "ratios": ratios(results),
    }  # fmt: skip


async def server_kernel_ops(base: str, timeout_s: float) -> list[dict[str, Any]] | None:
    """Which kernel backend serves each op, as an NInfer server's `/health` reports it;
    None from a server that does not (vLLM, llama.cpp)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            reply = await http.get(base.removesuffix("/v1") + "/health")
        body = reply.json() if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    ops = body.get("kernel_ops") if isinstance(body, dict) else None
    return ops if isinstance(ops, list) else None


def run_serve_bench(url: str, cfg: ServeBenchConfig) -> dict[str, Any]:
    return asyncio.run(bench(url, cfg))


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(result: dict[str, Any]) -> str:
    """The levels as a Markdown table, then the ratios against the first level."""
    head = ("concurrency", "requests", "errors", "TTFT p50 ms", "TTFT p90 ms",
            "decode tok/s per stream (median)", "aggregate tok/s", "prompt tokens")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in result["levels"]:
        cells = (
            str(r["concurrency"]), str(r["requests"]), str(r["errors"]),
            _num(r["ttft_p50_ms"], ".1f"), _num(r["ttft_p90_ms"], ".1f"),
            _num(r["decode_tok_s_median"], ".2f"), _num(r["aggregate_tok_s"], ".2f"),
            _num(r["prompt_tokens_median"], ".0f"),
        )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if result["ratios"]:
        lines.append("")
    for name, r in result["ratios"].items():
        lines.append(
            f"{name}: TTFT p50 {_num(r['ttft_p50_ms'], '.2f')}, decode per stream "
            f"{_num(r['decode_tok_s_median'], '.2f')}, "
            f"aggregate {_num(r['aggregate_tok_s'], '.2f')}"
        )
    return "\n".join(lines)
