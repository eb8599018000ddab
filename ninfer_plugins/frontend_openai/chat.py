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

`n` > 1 asks for several choices of the prompt: each its own parser and token log
(`ChatChoices`), served by the same loop as one choice (`choices.py`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from litestar import Request, Response, post
from litestar.openapi import ResponseSpec
from litestar.params import JSONBody
from msgspec import UNSET, UnsetType

from ninfer_core.engine.request import FinishEvent, TokenEvent
from ninfer_core.serve import constraints as serve_constraints
from ninfer_core.serve.state import ServeState
from ninfer_core.text.tool_calls import ToolCall
from ninfer_plugins.frontend_openai import wire
from ninfer_plugins.frontend_openai.choices import Choices, Head, reply
from ninfer_plugins.frontend_openai.common import (
    TokenLog,
    check_model,
    generation_request,
    logprobs_asked,
    new_id,
    now,
    refuse_unsupported,
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
        events = state.generate(gen)
        head = Head(new_id("chatcmpl"), now(), model)
        tokens = Tokens(
            token_texts(state.tokenizer) if top is not None else None,
            prompt.ids if data.return_token_ids else None,
        )
        return await reply(request, data, events, ChatChoices(head, gen.n, prompt.output, tokens))

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


class ChatChoices(Choices):
    """A chat request's choices: each its own parser (a copy of the prompt's, which may have
    read a forced call's opening already, `prompt.py`) and token log."""

    def __init__(self, head: Head, n: int, output: ChatOutput, tokens: Tokens) -> None:
        super().__init__(head, n)
        self.tokens = tokens
        # Copies taken before any answer text reached the prompt's parser.
        self.outputs = [output, *(copy.deepcopy(output) for _ in range(n - 1))]
        self.logs = [TokenLog() for _ in range(n)]

    def record(self, event: TokenEvent) -> None:
        self._feed(event)

    def _feed(self, event: TokenEvent) -> Piece:
        self.logs[event.index].add(event)
        return self.outputs[event.index].feed(event.text)

    # -- a stream ------------------------------------------------------------------------

    def opening(self) -> list[str]:
        out = []
        for index in range(self.n):
            role = wire.ChunkChoice(index, wire.Delta(role="assistant", content=""))
            head = wire.ChatCompletionChunk(*self.head, [role])
            if index == 0:  # the request's prompt, once
                head.prompt_token_ids = self.tokens.prompt()
            out.append(wire.encode(head))
        return out

    def token(self, event: TokenEvent) -> list[str]:
        return self._deltas(event.index, self._feed(event))

    def finish(self, event: FinishEvent, stats: wire.SpecStats | UnsetType) -> list[str]:
        index, output = event.index, self.outputs[event.index]
        out = self._deltas(index, output.finish())
        reason = finish_reason(event.reason, output.calls)
        out.append(self._chunk(index, wire.Delta(), reason, stats))
        return out

    def usage_chunk(self, spent: wire.Usage) -> str:
        return wire.encode(wire.ChatCompletionChunk(*self.head, [], spent))

    def _chunk(
        self,
        index: int,
        delta: wire.Delta,
        reason: str | None = None,
        stats: wire.SpecStats | UnsetType = UNSET,
    ) -> str:
        choice = wire.ChunkChoice(index, delta, reason)
        choice.logprobs, choice.token_ids = self.tokens.extras(self.logs[index].take())
        return wire.encode(wire.ChatCompletionChunk(*self.head, [choice], spec_stats=stats))

    def _deltas(self, index: int, piece: Piece) -> list[str]:
        out = []
        if piece.reasoning:
            out.append(self._chunk(index, wire.Delta(reasoning_content=piece.reasoning)))
        if piece.content:
            out.append(self._chunk(index, wire.Delta(content=piece.content)))
        if piece.calls:
            start = len(self.outputs[index].calls) - len(piece.calls)
            calls = [
                wire.ToolCallDelta(start + i, c.id, wire.FunctionCallOut(c.name, c.arguments))
                for i, c in enumerate(piece.calls)
            ]
            out.append(self._chunk(index, wire.Delta(tool_calls=calls)))
        return out

    # -- a whole answer ------------------------------------------------------------------

    def answer(self, finishes: list[FinishEvent], spent: wire.Usage) -> wire.ChatCompletion:
        choices = [self._choice(finish) for finish in finishes]
        whole = wire.ChatCompletion(*self.head, choices, spent)
        whole.prompt_token_ids = self.tokens.prompt_ids
        return whole

    def _choice(self, finish: FinishEvent) -> wire.ChatChoice:
        output = self.outputs[finish.index]
        output.finish()
        content = "".join(output.content)
        message = wire.AssistantMessage(
            content=content if content or not output.calls else None,
            reasoning_content="".join(output.reasoning) or None,
            tool_calls=out_calls(output.calls),
        )
        choice = wire.ChatChoice(finish.index, message, finish_reason(finish.reason, output.calls))
        choice.logprobs, choice.token_ids = self.tokens.whole(self.logs[finish.index])
        return choice
