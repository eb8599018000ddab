"""`POST /v1/chat/completions`: a conversation in, an assistant message (or its stream) out.

The conversation goes through the model's chat template (tools included), the answer through
`ChatOutput` (reasoning, content, tool calls). A forced `tool_choice` ("required", a named
function) prefills the answer with the opening of the model's call form: the prompt ends
with it and `ChatOutput` reads it first, so the call parses whole. Streaming sends the role
first, then one chunk per piece of text or finished tool call, then the finish reason and,
when asked for (`stream_options.include_usage`), a last chunk with the usage. A request's
`spec_stats` (`return_spec_stats`) rides in that usage, or without one on the finish chunk.

Log probabilities (`logprobs`, `top_logprobs`) and vLLM's `return_token_ids` follow the
tokens, not the parsed text: a chunk carries those of the tokens that arrived since the last
chunk went out (text the parser holds back, a reasoning tag, defers them), and the finish
chunk carries the rest, so a stream's pieces joined are the whole answer's lists.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from litestar import Request, Response, post
from litestar.openapi import ResponseSpec
from litestar.params import JSONBody
from msgspec import UNSET, UnsetType

from ninfer_core.engine.request import FinishEvent, GenerationEvent
from ninfer_core.serve import constraints as serve_constraints
from ninfer_core.serve.limits import until_disconnect
from ninfer_core.serve.state import ServeState
from ninfer_core.text.tool_calls import ToolCall
from ninfer_plugins.frontend_openai import wire
from ninfer_plugins.frontend_openai.common import (
    StreamExtras,
    TokenLog,
    check_model,
    collect,
    first_event,
    generation_request,
    logprobs_asked,
    new_id,
    now,
    refuse_unsupported,
    sse,
    usage,
)
from ninfer_plugins.frontend_openai.constraints import request_constraint
from ninfer_plugins.frontend_openai.conversation import forced_call
from ninfer_plugins.frontend_openai.logprobs import TokenTexts, chat_content, token_texts
from ninfer_plugins.frontend_openai.output import ChatOutput, Piece
from ninfer_plugins.frontend_openai.prompt import chat_prompt


def finish_reason(reason: str, calls: list[ToolCall]) -> str:
    if reason == "stop" and calls:
        return "tool_calls"
    return reason if reason in ("stop", "length") else "stop"


def out_calls(calls: list[ToolCall]) -> list[wire.ToolCallOut] | None:
    return [
        wire.ToolCallOut(c.id, wire.FunctionCallOut(c.name, c.arguments)) for c in calls
    ] or None


def route_handlers(state: ServeState) -> list:
    @post(
        ["/v1/chat/completions", "/chat/completions"],
        status_code=200,
        summary="Create a chat completion",
        responses={
            200: ResponseSpec(
                wire.ChatCompletion,
                description="the completion, or with stream=true an event stream of chunks",
            )
        },
    )
    async def chat_completions(
        request: Request, data: JSONBody[wire.ChatCompletionRequest]
    ) -> Response:
        model = check_model(state, data.model)
        refuse_unsupported(data)
        top = logprobs_asked(data.logprobs, data.top_logprobs)
        prompt = await chat_prompt(state, data)
        forced = await serve_constraints.forced_call(state, forced_call(data), prompt.tools)
        constraint = await request_constraint(state, data, data.response_format, forced)
        budget = (
            data.max_completion_tokens
            if data.max_completion_tokens is not None
            else (data.max_tokens)
        )
        gen = generation_request(
            state,
            data,
            prompt.ids,
            budget,
            scope=request.scope,
            logprobs=top,
            constraint=constraint,
        )
        output = prompt.output
        events = state.generate(gen)
        rid, created = new_id("chatcmpl"), now()
        tokens = Tokens(
            token_texts(state.tokenizer) if top is not None else None,
            prompt.ids if data.return_token_ids else None,
        )
        if gen.n > 1:  # n choices of the one prompt: choices.py
            from ninfer_plugins.frontend_openai import choices

            ids = (rid, created, model)
            return await choices.chat_reply(request, data, events, gen.n, output, ids, tokens)
        if data.stream:
            first = await first_event(request, events)
            extras = StreamExtras.asked(data)
            return sse(stream(first, events, output, rid, created, model, extras, tokens))
        log = TokenLog()
        finish = await until_disconnect(request, collect(events, output.feed, log))
        output.finish()
        content = "".join(output.content)
        message = wire.AssistantMessage(
            content=content if content or not output.calls else None,
            reasoning_content="".join(output.reasoning) or None,
            tool_calls=out_calls(output.calls),
        )
        choice = wire.ChatChoice(0, message, finish_reason(finish.reason, output.calls))
        choice.logprobs, choice.token_ids = tokens.whole(log)
        spent = usage(finish.usage, with_spec=data.return_spec_stats)
        whole = wire.ChatCompletion(rid, created, model, [choice], spent)
        whole.prompt_token_ids = tokens.prompt_ids
        return Response(whole)

    return [chat_completions]


@dataclass(frozen=True)
class Tokens:
    """What a choice says of its tokens beyond the text, when asked: log probabilities
    (`texts` set) and vLLM's `return_token_ids` (`prompt_ids` set)."""

    texts: TokenTexts | None = None
    prompt_ids: list[int] | None = None

    def prompt(self) -> list[int] | UnsetType:
        return UNSET if self.prompt_ids is None else self.prompt_ids

    def extras(self, log: TokenLog) -> tuple[wire.ChoiceLogprobs | None, list[int] | UnsetType]:
        """(the choice's `logprobs`, its `token_ids`) for the tokens in `log`."""
        logprobs = None
        if self.texts is not None:
            logprobs = wire.ChoiceLogprobs(chat_content(self.texts, log.logprobs))
        return logprobs, (UNSET if self.prompt_ids is None else log.ids)

    def whole(self, log: TokenLog) -> tuple[wire.ChoiceLogprobs | None, list[int] | None]:
        """`extras` for a whole answer's choice: `token_ids` null rather than absent when
        not asked, as vLLM sends it (its clients read `choice.token_ids`); a chunk omits it."""
        logprobs, ids = self.extras(log)
        return logprobs, (None if isinstance(ids, UnsetType) else ids)


async def stream(
    first: GenerationEvent,
    events: AsyncIterator[GenerationEvent],
    output: ChatOutput,
    rid: str,
    created: int,
    model: str,
    extras: StreamExtras,
    tokens: Tokens | None = None,
) -> AsyncIterator[str]:
    tokens = tokens or Tokens()
    log = TokenLog()

    def chunk(
        delta: wire.Delta,
        reason: str | None = None,
        stats: wire.SpecStats | UnsetType = UNSET,
    ) -> str:
        choice = wire.ChunkChoice(0, delta, reason)
        choice.logprobs, choice.token_ids = tokens.extras(log.take())
        return wire.encode(
            wire.ChatCompletionChunk(rid, created, model, [choice], spec_stats=stats)
        )

    def deltas(piece: Piece) -> list[str]:
        out = []
        if piece.reasoning:
            out.append(chunk(wire.Delta(reasoning_content=piece.reasoning)))
        if piece.content:
            out.append(chunk(wire.Delta(content=piece.content)))
        if piece.calls:
            start = len(output.calls) - len(piece.calls)
            calls = [
                wire.ToolCallDelta(start + i, c.id, wire.FunctionCallOut(c.name, c.arguments))
                for i, c in enumerate(piece.calls)
            ]
            out.append(chunk(wire.Delta(tool_calls=calls)))
        return out

    try:
        head = wire.ChatCompletionChunk(
            rid, created, model, [wire.ChunkChoice(0, wire.Delta(role="assistant", content=""))]
        )
        head.prompt_token_ids = tokens.prompt()
        yield wire.encode(head)
        event = first
        while not isinstance(event, FinishEvent):
            log.add(event)
            for text in deltas(output.feed(event.text)):
                yield text
            event = await anext(events)
        for text in deltas(output.finish()):
            yield text
        reason = finish_reason(event.reason, output.calls)
        yield chunk(wire.Delta(), reason, extras.on_finish(event.usage))
        spent = extras.usage_chunk(event.usage)
        if spent is not None:
            yield wire.encode(wire.ChatCompletionChunk(rid, created, model, [], spent))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
