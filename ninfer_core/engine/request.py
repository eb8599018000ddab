"""What a frontend hands the engine, what it gets back, and the errors it must map.

A `GenerationRequest` is token ids plus everything that decides when generation stops; the
engine answers with a stream of `TokenEvent`s and exactly one `FinishEvent`. Refusals are typed
`EngineError`s with a short machine `code`, so the server maps them to HTTP statuses without
parsing messages: `overloaded` -> 429 (with Retry-After), `queue_timeout` and `engine_closed`
-> 503, `request_too_large` -> 400, `internal_error` -> 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ninfer_core.engine.pooling import POOLINGS, Pooler
from ninfer_core.engine.sequence import Sequence as Seq
from ninfer_core.errors import NInferError
from ninfer_core.sampling import MAX_TOP_LOGPROBS, SamplingParams, SequenceTokens, TokenLogprobs
from ninfer_core.sampling.grammar import Constraint, GrammarMatcher
from ninfer_core.spec.stats import SpecUsage
from ninfer_core.text import IncrementalDetokenizer, StopChecker, StopUpdate, Tokenizer

if TYPE_CHECKING:
    import torch

    from ninfer_core.engine.engine import Engine

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    #: New tokens at most; None: whatever the context has left after the prompt.
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    #: Stop token ids on top of the model's own (generation_config / eos).
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    #: Engine-clock time by which the request must have left the queue (None: see below).
    deadline: float | None = None
    #: Longest wait in the queue, when no `deadline`; None: the engine's rule (docs/engine.md).
    pending_timeout_s: float | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: Prefix-cache isolation: only requests with an equal salt share cached KV blocks, so
    #: `cached_tokens` cannot tell one tenant what another sent. None: the shared pool.
    #: Frontends set it from the API key and a request's own `cache_salt` (docs/engine.md).
    cache_salt: str | None = None
    #: Who sent it, for fair admission: a hash of the API key that authenticated it (None:
    #: no key checked). The queue serves the tenant with the fewest sequences running first
    #: (`engine/scheduler.py`), and `max_pending_per_key` bounds what one tenant may queue.
    tenant: str | None = None
    #: Admission order before tenants and arrival: lower goes first (vLLM's `priority`).
    priority: int = 0
    #: None: no log probabilities (nothing is computed). k in 0..20: each token's event
    #: carries its log probability and the k most likely tokens (`sampling/logprobs.py`).
    logprobs: int | None = None
    #: Stop tokens (the model's and `stop_token_ids`) are masked, and stop strings not
    #: looked for, until this many tokens were generated (vLLM's `min_tokens`).
    min_tokens: int = 0
    #: The answer must match this grammar (a JSON schema, ...): each token is masked to
    #: what it allows, and the request ends when it is complete (`engine/constraints.py`).
    constraint: Constraint | None = None
    #: Completions of the one prompt (OpenAI's `n`): the prompt is prefilled once, then the
    #: sequence forks into `n` that share its pages (`engine/fanout.py`). Their events carry
    #: `index` 0..n-1, and the stream ends after `n` finishes.
    n: int = 1
    #: An embedding request (`engine/pooling.py`): "mean" or "last" pools the prompt's
    #: final hidden states into the `FinishEvent`'s `embedding`; nothing is generated.
    pooling: str | None = None
    #: L2-normalise the pooled vector (an embedding request only).
    normalize: bool = True

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.pending_timeout_s is not None and self.pending_timeout_s < 0:
            raise ValueError(f"pending_timeout_s must be >= 0, got {self.pending_timeout_s}")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            raise ValueError(
                f"cache_salt must be a non-empty string or None, got {self.cache_salt!r}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.pooling is not None:
            if self.pooling not in POOLINGS:
                raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
            if self.n != 1 or self.logprobs is not None:
                raise ValueError("an embedding request takes neither n nor logprobs")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens whose KV came from the prefix cache instead of a prefill.
    cached_tokens: int = 0
    #: Its speculative rounds, when the engine speculates; None otherwise.
    spec: SpecUsage | None = None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Tokens accepted this step and the text they complete (often "" mid-character or while a
    possible stop string is held back)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    #: On a request's first event only: prompt tokens whose KV came from the prefix cache,
    #: so a stream can report the cache split before the request ends (Anthropic's
    #: `message_start`). None on every later event.
    cached_tokens: int | None = None
    #: With `GenerationRequest.logprobs`: one entry per token id, in order; else None.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    #: Which of the request's `n` completions this token belongs to.
    index: int = 0


@dataclass(frozen=True, slots=True)
class FinishEvent:
    request_id: str
    reason: FinishReason
    usage: Usage
    #: Set when `reason == "error"`: what went wrong, as the typed error to map.
    error: EngineError | None = None
    #: The stop string or stop token id that ended a "stop" finish.
    matched: str | int | None = None
    #: Which of the request's `n` completions ended.
    index: int = 0
    #: An embedding request's vector ([hidden] fp32, CPU; `engine/pooling.py`).
    embedding: torch.Tensor | None = None


GenerationEvent = TokenEvent | FinishEvent


# -- errors --------------------------------------------------------------------------------


class EngineError(NInferError):
    """Base of the engine's refusals; `code` names the case for the server."""

    code = "engine_error"


class OverloadedError(EngineError):
    """The queue is full; `retry_after` estimates the seconds until a place frees up."""

    code = "overloaded"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueTimeoutError(EngineError):
    """The request was still queued at its deadline; it never ran."""

    code = "queue_timeout"

    def __init__(self, message: str, waited_s: float) -> None:
        super().__init__(message)
        self.waited_s = waited_s


class RequestTooLargeError(EngineError):
    """Prompt plus max_tokens can never fit: over `max_context`, or over the whole KV pool."""

    code = "request_too_large"


class InvalidRequestError(EngineError):
    """The request itself is wrong (e.g. a token id outside the vocabulary)."""

    code = "invalid_request"


class EngineClosedError(EngineError):
    """The engine is shutting down (or has) and takes no more work."""

    code = "engine_closed"


class EngineStepError(EngineError):
    """A step failed (a bug or a device error); the requests in it end, the engine goes on."""

    code = "internal_error"


# -- inside the engine ---------------------------------------------------------------------


class RequestState:
    """An admitted request: its sequence, where its events go, and the state that turns its
    sampled tokens into text (sampler history, streaming detokenizer, stop checker)."""

    def __init__(
        self,
        request: GenerationRequest,
        seq: Seq,
        sink: Callable[[GenerationEvent], None],
        tokenizer: Tokenizer,
        stop_ids: Iterable[int],
    ) -> None:
        self.request, self.seq, self.sink = request, seq, sink
        self.history = SequenceTokens(request.prompt_ids)
        self.detok = IncrementalDetokenizer(tokenizer, context_ids=request.prompt_ids[-8:])
        self.stops = StopChecker(stop_token_ids=stop_ids, stop_strings=list(request.stop))
        #: Its speculative rounds (set by an engine that speculates).
        self.spec: SpecUsage | None = None
        #: Where its answer is in its grammar (with a `constraint`; made on the first token).
        self.grammar: GrammarMatcher | None = None
        #: Which of its request's `n` completions this is, and the id its events carry:
        #: a fork (`engine/fanout.py`) has a request id of its own, for the engine's
        #: tables, but speaks for the request the client sent.
        self.index = 0
        self.event_id = request.request_id
        #: What an embedding request pools its prompt's hidden states into; None otherwise.
        self.pooler: Pooler | None = None
        if request.pooling is not None:
            self.pooler = Pooler(request.pooling, request.normalize)  # type: ignore[arg-type]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def below_min_tokens(self) -> bool:
        """Whether stops are still off (`min_tokens` not yet generated) for the next token."""
        return len(self.seq.completion_ids) < self.request.min_tokens

    def accept(
        self, token: int, logprobs: TokenLogprobs | None = None, last: bool = False
    ) -> tuple[TokenEvent, StopUpdate, bool]:
        """Take a sampled token: (its event, the stop verdict, whether the limit is reached).
        At the limit, or when `last` (its grammar allows nothing more), the text held back
        (a partial character, a possible stop string) goes out with this last token. Below
        `min_tokens` nothing is a stop: the text goes out unchecked, as in vLLM, and the
        stop-string search starts after it."""
        below_min = self.below_min_tokens
        self.seq.append_token(token)
        self.history.append(token)
        piece = self.detok.feed(token)
        update = StopUpdate(piece) if below_min else self.stops.feed(piece, token)
        text = update.text
        at_limit = len(self.seq.completion_ids) >= self.seq.max_tokens
        if (at_limit or last) and not update.finished:
            rest = self.detok.finish()
            update = StopUpdate(rest) if below_min else self.stops.feed(rest)
            text += update.text + self.stops.flush()
        first = len(self.seq.completion_ids) == 1
        cached = self.seq.num_cached_tokens if first else None
        lps = None if logprobs is None else (logprobs,)
        event = TokenEvent(self.event_id, text, (token,), cached, lps, self.index)
        return event, update, at_limit

    def usage(self) -> Usage:
        seq = self.seq
        spec = None if self.spec is None else dataclasses.replace(self.spec)
        return Usage(seq.num_prompt_tokens, len(seq.completion_ids), seq.num_cached_tokens, spec)


# -- consumers -----------------------------------------------------------------------------


class RequestResult:
    """A sink that records one request's events: what tests, the bench and `generate` read."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.events: list[GenerationEvent] = []

    def __call__(self, event: GenerationEvent) -> None:
        self.events.append(event)

    @property
    def finish(self) -> FinishEvent | None:
        last = self.events[-1] if self.events else None
        return last if isinstance(last, FinishEvent) else None

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if isinstance(e, TokenEvent) for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TokenEvent))


class EventStream:
    """One request's events as an async iterator, fed from the engine's thread.

    The step thread calls the stream (`push`) and the event crosses into the event loop with
    `call_soon_threadsafe`, the one asyncio call that is safe from another thread. Iteration
    ends after the `FinishEvent` (after `n` of them, one per completion, for a request with
    `n` > 1); a finish with an error raises that error instead (a queue timeout before any
    token, or a failed step), so a server can still choose the status, and cancels the
    request's other completions. `aclose()` before the end cancels the request (the client
    went away).
    """

    def __init__(
        self,
        request_id: str,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        finishes: int = 1,
    ) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self._done = False
        #: Finish events still to come: one per completion (`GenerationRequest.n`).
        self._finishes = finishes

    def __call__(self, event: GenerationEvent) -> None:
        # RuntimeError: the loop is closed, nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        if isinstance(event, FinishEvent):
            self._finishes -= 1
            self._done = self._finishes <= 0 or event.error is not None
            if event.error is not None:
                if self._finishes > 0:  # one completion failed: the request fails whole
                    self._engine.cancel(self.request_id)
                raise event.error
        return event

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine.cancel(self.request_id)
