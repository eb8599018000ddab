"""`ServeMetrics`: one app's Prometheus metrics, in a registry of its own.

A registry per app (not prometheus_client's process-global one) so two apps in one process
— tests, an embedding application — never share or collide on counters. Engine-side figures
(queue depth, running sequences, KV pages) are read when scraped, so they cost nothing per
step; per-token figures come from wrapping `ServeState.generate`, so every frontend is
measured the same way without knowing it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from ninfer_core.engine.request import FinishEvent, GenerationEvent, GenerationRequest, TokenEvent

if TYPE_CHECKING:
    from litestar.types import Message, Scope

    from ninfer_core.serve.state import ServeState

__all__ = ["CONTENT_TYPE", "ServeMetrics"]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)
#: The route label of a request no route matched, so unknown paths cannot grow the label set.
UNMATCHED = "(unmatched)"


class ServeMetrics:
    def __init__(self, state: Callable[[], ServeState | None]) -> None:
        self._state = state
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "ninfer_http_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "ninfer_time_to_first_token_seconds",
            "from submission to the first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "ninfer_inter_token_latency_seconds",
            "between consecutive tokens of a request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "ninfer_prompt_tokens", "prompt tokens prefilled (or taken from the cache)", registry=r
        )
        self.generated_tokens = Counter("ninfer_generated_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter(
            "ninfer_cached_prompt_tokens", "prompt tokens served from the prefix cache", registry=r
        )
        self.finished = Counter(
            "ninfer_generations", "generations ended, by reason", ["reason"], registry=r
        )
        bm = "block_manager"
        gauges = {
            "ninfer_queue_depth": ("requests waiting for a slot", "scheduler", "waiting"),
            "ninfer_running_sequences": ("sequences running", "scheduler", "running"),
            "ninfer_kv_pages_used": ("KV pages held by sequences", bm, "num_used_blocks"),
            "ninfer_kv_pages_free": ("KV pages free, or idle in the cache", bm, "num_free_blocks"),
            "ninfer_kv_pages_cached": (
                "KV pages indexed by the prefix cache",
                bm,
                "num_cached_blocks",
            ),
        }
        for name, (doc, part, attr) in gauges.items():
            Gauge(name, doc, registry=r).set_function(self._engine_reader(part, attr))
        r.register(SpecDecodeCollector(state))

    def _engine_reader(self, part: str, attr: str) -> Callable[[], float]:
        """Read when scraped; a list (the scheduler's queues) reads as its length."""

        def value() -> float:
            state = self._state()
            if state is None:
                return 0.0
            found = getattr(getattr(state.engine, part), attr)
            return float(len(found) if isinstance(found, (list, deque)) else found)

        return value

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- per request -------------------------------------------------------------------------

    async def before_send(self, message: Message, scope: Scope) -> None:
        """litestar's `before_send` hook: count each response once, as it starts."""
        if message["type"] == "http.response.start":
            route = scope.get("path_template") or UNMATCHED
            self.requests.labels(route, str(message["status"])).inc()

    def instrument(self, state: ServeState) -> None:
        """Measure every `state.generate` call, whichever frontend makes it."""
        generate = state.generate
        if getattr(generate, "_ninfer_metrics", None) is self:
            return
        inner = getattr(generate, "_ninfer_inner", generate)

        async def measured(request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
            async for event in self.track(request, inner(request)):
                yield event

        measured._ninfer_metrics = self  # type: ignore[attr-defined]
        measured._ninfer_inner = inner  # type: ignore[attr-defined]
        state.generate = measured  # type: ignore[method-assign]

    async def track(
        self, request: GenerationRequest, events: AsyncIterator[GenerationEvent]
    ) -> AsyncIterator[GenerationEvent]:
        """Pass `events` through, timing tokens; tokens count as they come, so a request
        cancelled half-way still counts what it generated."""
        start = time.monotonic()
        #: When each choice's last token came (`n` > 1 interleaves several).
        last: dict[int, float] = {}
        seen_token = False
        reason = "cancelled"  # unless a finish (or an error) says otherwise
        try:
            async for event in events:
                now = time.monotonic()
                if isinstance(event, TokenEvent) and event.token_ids:
                    if not seen_token:
                        self.ttft.observe(now - start)
                        self.prompt_tokens.inc(len(request.prompt_ids))
                        seen_token = True
                    elif event.index in last:  # a speculative round's tokens share the gap
                        gap = (now - last[event.index]) / len(event.token_ids)
                        for _ in event.token_ids:
                            self.itl.observe(gap)
                    self.generated_tokens.inc(len(event.token_ids))
                    last[event.index] = now
                elif isinstance(event, FinishEvent):
                    reason = event.reason
                    if event.index == 0:  # the prompt of `n` choices counts once
                        self.cached_tokens.inc(event.usage.cached_tokens)
                    if event.embedding is not None:  # an embedding: a prompt, no tokens
                        self.prompt_tokens.inc(len(request.prompt_ids))
                yield event
        except Exception:
            reason = "error"
            raise
        finally:
            self.finished.labels(reason).inc()
            await events.aclose()  # type: ignore[attr-defined]


class SpecDecodeCollector:
    """Speculative decoding's totals under vLLM's counter names (`spec_decode_num_drafts`,
    `…_num_draft_tokens`, `…_num_accepted_tokens`, `…_num_accepted_tokens_per_pos`), with
    our prefix, read from the engine when scraped. Absent while the engine does not
    speculate, as vLLM leaves them out without a speculative config."""

    PREFIX = "ninfer_spec_decode_"

    def __init__(self, state: Callable[[], ServeState | None]) -> None:
        self._state = state

    def describe(self) -> list:
        return []  # collected on demand: no fixed set to register ahead

    def collect(self):
        state = self._state()
        if state is None or state.engine.drafter is None:
            return
        c, p = state.engine.spec_counters, self.PREFIX
        yield CounterMetricFamily(p + "num_drafts", "speculative rounds", value=c.num_drafts)
        yield CounterMetricFamily(p + "num_draft_tokens", "draft tokens", value=c.drafted)
        yield CounterMetricFamily(
            p + "num_accepted_tokens", "draft tokens accepted", value=c.accepted
        )
        per_pos = CounterMetricFamily(
            p + "num_accepted_tokens_per_pos",
            "rounds whose draft at this position was accepted",
            labels=["position"],
        )
        for position, count in enumerate(c.accepted_per_pos):
            per_pos.add_metric([str(position)], count)
        yield per_pos
