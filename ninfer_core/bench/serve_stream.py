"""One streamed request of `ninfer bench serve`, timed from its server-sent events.

Plain httpx rather than the vendors' SDKs: the bench reads both wire formats the same way,
sees every event when it arrives (an SDK may buffer or merge them), and keeps the fields a
server adds beside the standard ones: NInfer's `usage.spec_stats`, llama.cpp's `timings`.
Parsing is `feed`, a pure function of (event, arrival time), so the figures can be checked
against scripted times without a network.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # imported where used: httpx comes with litestar, undeclared
    import httpx

Api = Literal["openai", "anthropic"]
ANTHROPIC_VERSION = "2023-06-01"


@dataclass
class Sample:
    """What one request's stream said: when each piece of generated text arrived, and the
    server's own counts where it sent them."""

    start: float
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    #: rounds / draft_tokens / accepted_tokens, from `spec_stats` or llama.cpp's `timings`.
    spec: dict[str, int] = field(default_factory=dict)
    #: Prefill tok/s as the server timed it (llama.cpp's `timings.prompt_per_second`).
    server_prefill_tok_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tokens(self) -> int:
        """Generated tokens: the server's count, else one per streamed piece."""
        return self.completion_tokens or len(self.token_times)

    @property
    def prefill_tok_s(self) -> float | None:
        """Prompt tokens ÷ TTFT: the first token costs one decode step too, negligible
        beside a long prefill."""
        if not self.prompt_tokens or self.ttft_s <= 0:
            return None
        return self.prompt_tokens / self.ttft_s

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first ÷ the time after the first; None when the text came in one
        piece (nothing to time)."""
        span = self.token_times[-1] - self.token_times[0] if self.token_times else 0.0
        if self.tokens < 2 or span <= 0:
            return None
        return (self.tokens - 1) / span


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def _take_spec(sample: Sample, stats: Any) -> None:
    if isinstance(stats, dict):
        for key in ("rounds", "draft_tokens", "accepted_tokens"):
            if (n := _count(stats.get(key))) is not None:
                sample.spec[key] = n


def feed(sample: Sample, api: Api, data: dict[str, Any], now: float) -> None:
    """Take one parsed event: a piece of generated text (any kind: text, reasoning, a tool
    call's arguments) stamps `now`; usage and speculation figures are kept."""
    if api == "openai":
        choices = data.get("choices") or []
        delta = (choices[0].get("delta") or {}) if choices else {}
        if choices and (
            delta.get("content")
            or delta.get("tool_calls")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or choices[0].get("text")
        ):
            sample.token_times.append(now)
        usage = data.get("usage") or {}
        sample.prompt_tokens = _count(usage.get("prompt_tokens")) or sample.prompt_tokens
        sample.completion_tokens = (
            _count(usage.get("completion_tokens")) or sample.completion_tokens
        )
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        sample.cached_tokens = _count(cached) if cached is not None else sample.cached_tokens
        _take_spec(sample, usage.get("spec_stats") or data.get("spec_stats"))
        timings = data.get("timings")  # llama.cpp's server
        if isinstance(timings, dict):
            sample.server_prefill_tok_s = timings.get("prompt_per_second")
            if (drafted := _count(timings.get("draft_n"))) is not None:
                sample.spec["draft_tokens"] = drafted
                sample.spec["accepted_tokens"] = _count(timings.get("draft_n_accepted")) or 0
        return
    kind = data.get("type")
    if kind == "message_start":
        usage = (data.get("message") or {}).get("usage") or {}
        read = _count(usage.get("cache_read_input_tokens")) or 0
        total = sum(
            _count(usage.get(k)) or 0
            for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        )
        sample.prompt_tokens = total or None
        sample.cached_tokens = read if "cache_read_input_tokens" in usage else None
    elif kind == "content_block_delta":
        delta = data.get("delta") or {}
        if delta.get("text") or delta.get("thinking") or delta.get("partial_json"):
            sample.token_times.append(now)
    elif kind == "message_delta":
        usage = data.get("usage") or {}
        sample.completion_tokens = _count(usage.get("output_tokens")) or sample.completion_tokens
        _take_spec(sample, usage.get("spec_stats"))
    elif kind == "error":
        sample.error = f"error event: {json.dumps(data.get('error'), ensure_ascii=False)[:300]}"


def headers(api: Api, key: str) -> dict[str, str]:
    """Both APIs' credentials: NInfer, vLLM and llama.cpp read the Bearer token, Anthropic's
    API and servers that mimic it read `x-api-key`."""
    out = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if api == "anthropic":
        out |= {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION}
    return out


def path(api: Api) -> str:
    return "/v1/chat/completions" if api == "openai" else "/v1/messages"


async def stream(
    client: httpx.AsyncClient, root: str, api: Api, key: str, body: dict[str, Any]
) -> Sample:
    """POST `body` to the API's endpoint and read the stream to its end."""
    import httpx

    sample = Sample(time.perf_counter())
    try:
        async with client.stream("POST", root + path(api), json=body,
                                 headers=headers(api, key)) as reply:  # fmt: skip
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                sample.error = f"HTTP {reply.status_code}: {text[:300]}"
                return sample
            async for line in reply.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                try:
                    data = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(data, dict):
                    feed(sample, api, data, now)
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    if sample.error is None and not sample.token_times:
        sample.error = "the stream ended without any generated text"
    return sample


async def count_tokens(
    client: httpx.AsyncClient, root: str, key: str, body: dict[str, Any]
) -> int | None:
    """Anthropic's `/v1/messages/count_tokens` (NInfer serves it): the prompt's tokens without
    running it; None where the server lacks it."""
    import httpx

    probe = {k: v for k, v in body.items() if k in ("model", "system", "messages", "tools")}
    try:
        reply = await client.post(root + "/v1/messages/count_tokens", json=probe,
                                  headers=headers("anthropic", key))  # fmt: skip
        return _count(reply.json().get("input_tokens")) if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


async def first_model(client: httpx.AsyncClient, root: str, api: Api, key: str) -> str:
    """The first id of `GET /v1/models` (OpenAI's and Anthropic's lists share the shape)."""
    import httpx

    from ninfer_core.errors import NInferError

    try:
        reply = await client.get(root + "/v1/models", headers=headers(api, key))
    except httpx.HTTPError as exc:
        raise NInferError(f"GET {root}/v1/models failed: {type(exc).__name__}: {exc}") from None
    if reply.status_code != 200:
        raise NInferError(f"GET {root}/v1/models failed: HTTP {reply.status_code}: "
                          f"{reply.text[:200]}")  # fmt: skip
    try:
        return reply.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise NInferError(f"GET {root}/v1/models lists no model; pass --model") from None
