"""`n > 1` for chat and completions: one engine request, `n` choices (`engine/fanout.py`).

The engine prefills the prompt once and forks it; its events carry each choice's `index`.
Here each choice keeps what a single answer keeps (its own output parser, token log and
finish): the answer lists the choices by index, and its usage counts the prompt once and sums
the choices' completion tokens, as OpenAI reports it. A stream interleaves the choices'
chunks in the order their tokens come, each with its `index` (the role chunk of every
choice first), a finish chunk per choice, and one usage chunk at the end when asked.

`n = 1` never comes here: those answers are the handlers' own, unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable

from litestar import Request, Response
from litestar.response import ServerSentEvent

from ninfer_core.engine.request import FinishEvent, GenerationEvent
from ninfer_core.engine.request import Usage as EngineUsage
from ninfer_core.serve.limits import until_disconnect
from ninfer_plugins.frontend_openai import wire
from ninfer_plugins.frontend_openai.chat import Tokens, finish_reason, out_calls
from ninfer_plugins.frontend_openai.common import StreamExtras, TokenLog, first_event, sse, usage
from ninfer_plugins.frontend_openai.completions import ChoiceExtras
from ninfer_plugins.frontend_openai.completions import finish_reason as completion_reason
from ninfer_plugins.frontend_openai.logprobs import CompletionLogprobs
from ninfer_plugins.frontend_openai.output import ChatOutput, Piece


def total_usage(finishes: dict[int, FinishEvent]) -> EngineUsage:
    """The request's usage: the prompt (and its cached part) once, every choice's tokens."""
    first = finishes[min(finishes)].usage
    spent = sum(f.usage.completion_tokens for f in finishes.values())
    return EngineUsage(first.prompt_tokens, spent, first.cached_tokens)


# -- chat ----------------------------------------------------------------------------------


async def chat_reply(
    request: Request,
    data: wire.ChatCompletionRequest,
    events: AsyncIterator[GenerationEvent],
    n: int,
    output: ChatOutput,
    ids: tuple[str, int, str],
    tokens: Tokens,
) -> Response | ServerSentEvent:
    """The answer to a chat request with `n` > 1 choices; `ids`: (id, created, model)."""
    rid, created, model = ids
    if data.stream:
        first = await first_event(request, events)
        extras = StreamExtras.asked(data)
        chunks = chat_stream(first, events, n, output, rid, created, model, extras, tokens)
        return sse(chunks)
    choices, spent = await until_disconnect(request, chat_answer(events, n, output, tokens))
    whole = wire.ChatCompletion(rid, created, model, choices, usage(spent))
    whole.prompt_token_ids = tokens.prompt_ids
    return Response(whole)


def chat_outputs(output: ChatOutput, n: int) -> list[ChatOutput]:
    """A parser per choice, each a copy of the prompt's (which has read a forced call's
    opening already, `prompt.py`), taken before any answer text reached it."""
    return [copy.deepcopy(output) for _ in range(n)]


def chat_choice(
    index: int, output: ChatOutput, finish: FinishEvent, tokens: Tokens, log: TokenLog
) -> wire.ChatChoice:
    output.finish()
    content = "".join(output.content)
    message = wire.AssistantMessage(
        content=content if content or not output.calls else None,
        reasoning_content="".join(output.reasoning) or None,
        tool_calls=out_calls(output.calls),
    )
    choice = wire.ChatChoice(index, message, finish_reason(finish.reason, output.calls))
    choice.logprobs, choice.token_ids = tokens.whole(log)
    return choice


async def gather_choices(
    events: AsyncIterator[GenerationEvent], n: int, feed: Callable[[int, str], object]
) -> tuple[list[TokenLog], dict[int, FinishEvent]]:
    """Read a whole answer of `n` choices: each token event's text goes to `feed(index,
    text)` and its log probabilities to that choice's log; returns the logs and the
    finish events by index (chat and completions differ only in what `feed` builds)."""
    logs = [TokenLog() for _ in range(n)]
    finishes: dict[int, FinishEvent] = {}
    async for event in events:
        if isinstance(event, FinishEvent):
            finishes[event.index] = event
        else:
            feed(event.index, event.text)
            logs[event.index].add(event)
    return logs, finishes


async def chat_answer(
    events: AsyncIterator[GenerationEvent], n: int, output: ChatOutput, tokens: Tokens
) -> tuple[list[wire.ChatChoice], EngineUsage]:
    """Every choice of a whole (not streamed) answer, in index order, and the usage."""
    outputs = chat_outputs(output, n)
    logs, finishes = await gather_choices(events, n, lambda i, text: outputs[i].feed(text))
    choices = [chat_choice(i, outputs[i], finishes[i], tokens, logs[i]) for i in range(n)]
    return choices, total_usage(finishes)


async def chat_stream(
    first: GenerationEvent,
    events: AsyncIterator[GenerationEvent],
    n: int,
    output: ChatOutput,
    rid: str,
    created: int,
    model: str,
    extras: StreamExtras,
    tokens: Tokens,
) -> AsyncIterator[str]:
    outputs = chat_outputs(output, n)
    logs = [TokenLog() for _ in range(n)]

    def chunk(index: int, delta: wire.Delta, reason: str | None = None) -> str:
        choice = wire.ChunkChoice(index, delta, reason)
        choice.logprobs, choice.token_ids = tokens.extras(logs[index].take())
        return wire.encode(wire.ChatCompletionChunk(rid, created, model, [choice]))

    def deltas(index: int, piece: Piece) -> list[str]:
        out = []
        if piece.reasoning:
            out.append(chunk(index, wire.Delta(reasoning_content=piece.reasoning)))
        if piece.content:
            out.append(chunk(index, wire.Delta(content=piece.content)))
        if piece.calls:
            start = len(outputs[index].calls) - len(piece.calls)
            calls = [
                wire.ToolCallDelta(start + i, c.id, wire.FunctionCallOut(c.name, c.arguments))
                for i, c in enumerate(piece.calls)
            ]
            out.append(chunk(index, wire.Delta(tool_calls=calls)))
        return out

    try:
        for index in range(n):
            head = wire.ChatCompletionChunk(
                rid,
                created,
                model,
                [wire.ChunkChoice(index, wire.Delta(role="assistant", content=""))],
            )
            if index == 0:
                head.prompt_token_ids = tokens.prompt()
            yield wire.encode(head)
        finishes: dict[int, FinishEvent] = {}
        event = first
        while True:
            index = event.index
            if isinstance(event, FinishEvent):
                for text in deltas(index, outputs[index].finish()):
                    yield text
                yield chunk(index, wire.Delta(), finish_reason(event.reason, outputs[index].calls))
                finishes[index] = event
                if len(finishes) == n:
                    break
            else:
                logs[index].add(event)
                for text in deltas(index, outputs[index].feed(event.text)):
                    yield text
            event = await anext(events)
        spent = extras.usage_chunk(total_usage(finishes))
        if spent is not None:
            yield wire.encode(wire.ChatCompletionChunk(rid, created, model, [], spent))
    finally:
        await events.aclose()  # type: ignore[attr-defined]


# -- completions ---------------------------------------------------------------------------


async def completion_reply(
    request: Request,
    data: wire.CompletionRequest,
    events: AsyncIterator[GenerationEvent],
    n: int,
    echo: str,
    ids: tuple[str, int, str],
    extras: ChoiceExtras,
) -> Response | ServerSentEvent:
    """The answer to a completions request with `n` > 1 choices; `ids`: (id, created,
    model)."""
    rid, created, model = ids
    if data.stream:
        first = await first_event(request, events)
        asked = StreamExtras.asked(data)
        chunks = completion_stream(first, events, n, echo, rid, created, model, asked, extras)
        return sse(chunks)
    answer = completion_answer(events, n, echo, extras)
    choices, spent = await until_disconnect(request, answer)
    return Response(wire.Completion(rid, created, model, choices, usage(spent)))


def completion_extras(extras: ChoiceExtras, n: int) -> list[ChoiceExtras]:
    """Each choice's own log-probability offsets; the prompt's ids are shared."""
    out = []
    for _ in range(n):
        lp = extras.logprobs
        own = None if lp is None else CompletionLogprobs(lp.texts, lp.offset)
        out.append(ChoiceExtras(own, extras.prompt_ids))
    return out


async def completion_answer(
    events: AsyncIterator[GenerationEvent], n: int, echo: str, extras: ChoiceExtras
) -> tuple[list[wire.CompletionChoice], EngineUsage]:
    """Every choice of a whole (not streamed) completion, in index order, and the usage."""
    texts = [[echo] for _ in range(n)]
    logs, finishes = await gather_choices(events, n, lambda i, text: texts[i].append(text))
    choices = []
    for i, more in enumerate(completion_extras(extras, n)):
        reason = completion_reason(finishes[i].reason)
        choice = wire.CompletionChoice(i, "".join(texts[i]), reason)
        more.fill(choice, logs[i], first=True)
        choices.append(choice)
    return choices, total_usage(finishes)


async def completion_stream(
    first: GenerationEvent,
    events: AsyncIterator[GenerationEvent],
    n: int,
    echo: str,
    rid: str,
    created: int,
    model: str,
    extras: StreamExtras,
    choice_extras: ChoiceExtras,
) -> AsyncIterator[str]:
    mores = completion_extras(choice_extras, n)
    logs = [TokenLog() for _ in range(n)]
    sent = [False] * n

    def chunk(index: int, text: str, reason: str | None = None) -> str:
        choice = wire.CompletionChoice(index, text, reason)
        mores[index].fill(choice, logs[index].take(), first=not sent[index])
        sent[index] = True
        return wire.encode(wire.Completion(rid, created, model, [choice]))

    try:
        if echo:
            for index in range(n):
                yield chunk(index, echo)
        finishes: dict[int, FinishEvent] = {}
        event = first
        while True:
            index = event.index
            if isinstance(event, FinishEvent):
                yield chunk(index, "", completion_reason(event.reason))
                finishes[index] = event
                if len(finishes) == n:
                    break
            else:
                logs[index].add(event)
                if event.text or mores[index].asked:
                    yield chunk(index, event.text)
            event = await anext(events)
        spent = extras.usage_chunk(total_usage(finishes))
        if spent is not None:
            yield wire.encode(wire.Completion(rid, created, model, [], spent))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
