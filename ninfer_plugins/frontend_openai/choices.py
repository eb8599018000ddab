"""A request's `n` choices, `n = 1` included: the one answer loop of chat and completions.

The engine runs one request (`engine/fanout.py` forks it when `n` > 1) and tags each event
with its choice's `index`. Each endpoint keeps per choice what an answer needs (a parser, a
token log) in a `Choices`; the loops here are the endpoints' only ones, streamed or whole,
so what a request gets at its end (usage, `spec_stats`) cannot differ between one choice and
several. A single answer is the case `n = 1`, not a path of its own.

What the request gets once, whatever `n`: the usage, which counts the prompt (and its
cached part) once and sums the choices' completion tokens and speculative rounds, as
OpenAI sums choices; in a stream, the usage chunk after the last finish, or without it the
`spec_stats` on the finish chunk that ends the request (the last choice's). Each choice
streams with its own `index` and gets its own finish chunk, as OpenAI and vLLM send them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from typing import NamedTuple

from litestar import Request, Response
from litestar.response import ServerSentEvent
from msgspec import UNSET, Struct, UnsetType

from ninfer_core.engine.request import FinishEvent, GenerationEvent, TokenEvent
from ninfer_core.engine.request import Usage as EngineUsage
from ninfer_core.serve.limits import until_disconnect
from ninfer_core.spec.stats import SpecUsage
from ninfer_plugins.frontend_openai import wire
from ninfer_plugins.frontend_openai.common import StreamExtras, first_event, sse, usage


class Head(NamedTuple):
    """What every chunk and whole answer of one request names, in the order the wire
    structs take them (`wire.Completion(*head, choices)`)."""

    id: str
    created: int
    model: str


class Choices(ABC):
    """One endpoint's `n` choices of a request: the state each keeps, and the chunks or the
    whole answer made of it. Only one of the two modes is used per request."""

    def __init__(self, head: Head, n: int) -> None:
        self.head, self.n = head, n

    @abstractmethod
    def record(self, event: TokenEvent) -> None:
        """Keep a token event in its choice's state (a whole answer)."""

    @abstractmethod
    def opening(self) -> Iterable[str]:
        """A stream's chunks before any token (chat's roles, completions' echo)."""

    @abstractmethod
    def token(self, event: TokenEvent) -> Iterable[str]:
        """Keep a token event in its choice's state and return the chunks it makes."""

    @abstractmethod
    def finish(self, event: FinishEvent, stats: wire.SpecStats | UnsetType) -> Iterable[str]:
        """The chunks that end choice `event.index` (text held back, then its finish reason;
        `stats`: the request's `spec_stats`, set only on the request's last finish)."""

    @abstractmethod
    def usage_chunk(self, spent: wire.Usage) -> str:
        """A stream's last chunk: no choices, the request's usage."""

    @abstractmethod
    def answer(self, finishes: list[FinishEvent], spent: wire.Usage) -> Struct:
        """The whole answer from every choice's state and finish (index order)."""


async def reply(
    request: Request,
    data: wire.SamplingFields,
    events: AsyncIterator[GenerationEvent],
    choices: Choices,
) -> Response | ServerSentEvent:
    """Answer `request`: its event stream (`data.stream`) or its whole answer."""
    if data.stream:
        first = await first_event(request, events)
        return sse(stream(first, events, choices, StreamExtras.asked(data)))
    finishes = await until_disconnect(request, gather(events, choices))
    spent = usage(total_usage(finishes), with_spec=data.return_spec_stats)
    return Response(choices.answer(finishes, spent))


async def gather(events: AsyncIterator[GenerationEvent], choices: Choices) -> list[FinishEvent]:
    """Read a whole answer: each token to its choice's state; the finishes, by index."""
    finishes: dict[int, FinishEvent] = {}
    try:
        async for event in events:
            if isinstance(event, FinishEvent):
                finishes[event.index] = event
                if len(finishes) == choices.n:
                    return [finishes[i] for i in range(choices.n)]
            else:
                choices.record(event)
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    raise RuntimeError("the generation ended before every choice finished")


async def stream(
    first: GenerationEvent,
    events: AsyncIterator[GenerationEvent],
    choices: Choices,
    extras: StreamExtras,
) -> AsyncIterator[str]:
    """A request's chunks: the opening, each choice's chunks as its tokens come, a finish
    per choice (the last with the request's `spec_stats` when no usage chunk follows),
    then the usage chunk when asked."""
    try:
        for text in choices.opening():
            yield text
        finishes: dict[int, FinishEvent] = {}
        event = first
        while True:
            if isinstance(event, FinishEvent):
                finishes[event.index] = event
                done = len(finishes) == choices.n
                stats = extras.on_finish(total_usage(list(finishes.values()))) if done else UNSET
                for text in choices.finish(event, stats):
                    yield text
                if done:
                    break
            else:
                for text in choices.token(event):
                    yield text
            event = await anext(events)
        spent = extras.usage_chunk(total_usage(list(finishes.values())))
        if spent is not None:
            yield choices.usage_chunk(spent)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def total_usage(finishes: list[FinishEvent]) -> EngineUsage:
    """The request's usage: the prompt (and its cached part) once; every choice's tokens
    and speculative rounds (None when no choice speculated)."""
    first = min(finishes, key=lambda f: f.index).usage
    spent = sum(f.usage.completion_tokens for f in finishes)
    specs = [f.usage.spec for f in finishes if f.usage.spec is not None]
    spec = None
    if specs:
        spec = SpecUsage(
            rounds=sum(s.rounds for s in specs),
            drafted=sum(s.drafted for s in specs),
            accepted=sum(s.accepted for s in specs),
        )
    return EngineUsage(first.prompt_tokens, spent, first.cached_tokens, spec)
