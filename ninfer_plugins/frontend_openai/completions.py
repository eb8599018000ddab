"""`POST /v1/completions`: raw text (or token ids) in, its continuation out; no template.

One prompt per request (a list of one is accepted, as clients often send it). Text is
encoded with the tokenizer's special tokens (a BOS where the model has one); token ids are
taken as they are, once checked against the vocabulary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from litestar import Request, Response, post
from litestar.openapi import ResponseSpec
from litestar.params import JSONBody
from msgspec import UNSET, UnsetType

from ninfer_core.engine.request import FinishEvent, GenerationEvent
from ninfer_core.serve.limits import until_disconnect
from ninfer_core.serve.state import ServeState
from ninfer_plugins.frontend_openai import wire
from ninfer_plugins.frontend_openai.common import (
    StreamExtras,
    check_model,
    collect,
    first_event,
    generation_request,
    new_id,
    now,
    refuse,
    refuse_unsupported,
    sse,
    usage,
)


def prompt_ids(state: ServeState, prompt: str | list) -> tuple[list[int], str | None]:
    """(the prompt's ids, its text when it came as text)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise refuse("prompt", f"one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise refuse("prompt", "the prompt is empty")
        return state.encode_prompt(prompt, add_special_tokens=True, param="prompt"), prompt
    if not prompt:
        raise refuse("prompt", "the prompt is empty")
    if not all(isinstance(t, int) for t in prompt):
        raise refuse("prompt", "a prompt is text or a list of token ids, not a mixture")
    vocab = state.tokenizer.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise refuse("prompt", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    return list(prompt), None


def finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def route_handlers(state: ServeState) -> list:
    @post(
        ["/v1/completions", "/completions"],
        status_code=200,
        summary="Create a text completion",
        responses={
            200: ResponseSpec(
                wire.Completion,
                description="the completion, or with "
                "stream=true an event stream of completion chunks",
            )
        },
    )
    async def completions(request: Request, data: JSONBody[wire.CompletionRequest]) -> Response:
        model = check_model(state, data.model)
        refuse_unsupported(data)
        if data.suffix:
            raise refuse("suffix", "insertion (suffix) is not supported by this server")
        if data.logprobs is not None:
            raise refuse("logprobs", "log probabilities are not supported by this server")
        if data.best_of not in (None, 1):
            raise refuse("best_of", "only best_of=1 is supported")
        # Tokenizing a long text takes a while: off the event loop.
        ids, text = await asyncio.to_thread(prompt_ids, state, data.prompt)
        gen = generation_request(
            state, data, ids, data.max_tokens, scope=request.scope, prompt_param="prompt"
        )
        echo = (text if text is not None else state.tokenizer.decode(ids)) if data.echo else ""
        events = state.generate(gen)
        rid, created = new_id("cmpl"), now()
        if data.stream:
            first = await first_event(request, events)
            return sse(stream(first, events, echo, rid, created, model, StreamExtras.asked(data)))
        parts: list[str] = [echo]
        finish = await until_disconnect(request, collect(events, parts.append))
        choice = wire.CompletionChoice(0, "".join(parts), finish_reason(finish.reason))
        spent = usage(finish.usage, with_spec=data.return_spec_stats)
        return Response(wire.Completion(rid, created, model, [choice], spent))

    return [completions]


async def stream(
    first: GenerationEvent,
    events: AsyncIterator[GenerationEvent],
    echo: str,
    rid: str,
    created: int,
    model: str,
    extras: StreamExtras,
) -> AsyncIterator[str]:
    def chunk(
        text: str, reason: str | None = None, stats: wire.SpecStats | UnsetType = UNSET
    ) -> str:
        choice = wire.CompletionChoice(0, text, reason)
        return wire.encode(wire.Completion(rid, created, model, [choice], spec_stats=stats))

    try:
        if echo:
            yield chunk(echo)
        event = first
        while not isinstance(event, FinishEvent):
            if event.text:
                yield chunk(event.text)
            event = await anext(events)
        yield chunk("", finish_reason(event.reason), extras.on_finish(event.usage))
        spent = extras.usage_chunk(event.usage)
        if spent is not None:
            yield wire.encode(wire.Completion(rid, created, model, [], spent))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
