"""`POST /v1/completions`: raw text (or token ids) in, its continuation out; no template.

One prompt per request (a list of one is accepted, as clients often send it). Text is
encoded with the tokenizer's special tokens (a BOS where the model has one); token ids are
taken as they are, once checked against the vocabulary.

`logprobs: k` (0..5, OpenAI's legacy range) gives each generated token's log probability
and its k most likely alternatives in the legacy shape; a stream's chunks carry the tokens
that arrived with their text. The prompt's own log probabilities (`echo` with `logprobs`)
are not computed: that combination is a 400.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

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
    TokenLog,
    check_ids,
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
from ninfer_plugins.frontend_openai.constraints import request_constraint
from ninfer_plugins.frontend_openai.logprobs import CompletionLogprobs, token_texts

#: The most alternatives per token the legacy completions API takes (OpenAI's limit).
MAX_COMPLETION_LOGPROBS = 5


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
    if not all(isinstance(t, int) for t in prompt):
        raise refuse("prompt", "a prompt is text or a list of token ids, not a mixture")
    return check_ids(state, prompt, "prompt", empty="the prompt is empty"), None


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
            if not 0 <= data.logprobs <= MAX_COMPLETION_LOGPROBS:
                raise refuse(
                    "logprobs", f"must be in 0..{MAX_COMPLETION_LOGPROBS}, got {data.logprobs}"
                )
            if data.echo:
                raise refuse(
                    "logprobs", "the prompt's log probabilities (with echo) are not computed"
                )
        if data.best_of not in (None, 1):
            raise refuse("best_of", "only best_of=1 is supported")
        if data.best_of is not None and (data.n or 1) > 1:
            raise refuse("best_of", "n > 1 returns every choice; best_of is not taken with it")
        # Tokenizing a long text takes a while: off the event loop.
        ids, text = await asyncio.to_thread(prompt_ids, state, data.prompt)
        constraint = await request_constraint(state, data, data.response_format)
        gen = generation_request(
            state,
            data,
            ids,
            data.max_tokens,
            scope=request.scope,
            prompt_param="prompt",
            logprobs=data.logprobs,
            constraint=constraint,
        )
        echo = (text if text is not None else state.tokenizer.decode(ids)) if data.echo else ""
        events = state.generate(gen)
        rid, created = new_id("cmpl"), now()
        extras = ChoiceExtras(
            None if data.logprobs is None else CompletionLogprobs(token_texts(state.tokenizer)),
            ids if data.return_token_ids else None,
        )
        if gen.n > 1:  # n choices of the one prompt: choices.py
            from ninfer_plugins.frontend_openai import choices

            who = (rid, created, model)
            return await choices.completion_reply(request, data, events, gen.n, echo, who, extras)
        if data.stream:
            first = await first_event(request, events)
            asked = StreamExtras.asked(data)
            return sse(stream(first, events, echo, rid, created, model, asked, extras))
        parts: list[str] = [echo]
        log = TokenLog()
        finish = await until_disconnect(request, collect(events, parts.append, log))
        choice = wire.CompletionChoice(0, "".join(parts), finish_reason(finish.reason))
        extras.fill(choice, log, first=True)
        spent = usage(finish.usage, with_spec=data.return_spec_stats)
        return Response(wire.Completion(rid, created, model, [choice], spent))

    return [completions]


@dataclass
class ChoiceExtras:
    """A choice's log probabilities (`logprobs` set) and vLLM's `return_token_ids`
    (`prompt_ids` set; the prompt's ids go on the first choice piece only)."""

    logprobs: CompletionLogprobs | None = None
    prompt_ids: list[int] | None = None

    @property
    def asked(self) -> bool:
        """Whether a chunk goes out for tokens whose text is held back (it has their ids)."""
        return self.logprobs is not None or self.prompt_ids is not None

    def fill(self, choice: wire.CompletionChoice, log: TokenLog, *, first: bool) -> None:
        if self.logprobs is not None:
            choice.logprobs = self.logprobs.take(log.logprobs)
        if self.prompt_ids is not None:
            choice.token_ids = log.ids
            if first:
                choice.prompt_token_ids = self.prompt_ids


async def stream(
    first: GenerationEvent,
    events: AsyncIterator[GenerationEvent],
    echo: str,
    rid: str,
    created: int,
    model: str,
    extras: StreamExtras,
    choice_extras: ChoiceExtras | None = None,
) -> AsyncIterator[str]:
    more = choice_extras or ChoiceExtras()
    log = TokenLog()
    sent = False

    def chunk(
        text: str, reason: str | None = None, stats: wire.SpecStats | UnsetType = UNSET
    ) -> str:
        nonlocal sent
        choice = wire.CompletionChoice(0, text, reason)
        more.fill(choice, log.take(), first=not sent)
        sent = True
        return wire.encode(wire.Completion(rid, created, model, [choice], spec_stats=stats))

    try:
        if echo:
            yield chunk(echo)
        event = first
        while not isinstance(event, FinishEvent):
            log.add(event)
            if event.text or more.asked:
                yield chunk(event.text)
            event = await anext(events)
        yield chunk("", finish_reason(event.reason), extras.on_finish(event.usage))
        spent = extras.usage_chunk(event.usage)
        if spent is not None:
            yield wire.encode(wire.Completion(rid, created, model, [], spent))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
