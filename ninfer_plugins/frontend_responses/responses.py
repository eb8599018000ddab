"""`POST /v1/responses` and `GET` / `DELETE /v1/responses/{id}` (also without `/v1`).

A request becomes the chat request it amounts to (`convert.py`, with the stored conversation
of `previous_response_id` in front), so the prompt is the one chat completions would build;
the answer goes through the chat frontend's parser and `ItemAssembler` into output items.
Streaming sends `response.created` and `response.in_progress`, the items' events as they
form, then `response.completed` (or `response.incomplete` when `max_output_tokens` cut it
off), every event with its `type` and `sequence_number`. A failure after the stream started
is an `error` event followed by `response.failed`. The stream waits for the engine's first
event before answering, so a full queue still gets its 429.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.openapi import ResponseSpec
from litestar.params import FromPath, JSONBody
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from ninfer_core.engine.request import FinishEvent, GenerationEvent
from ninfer_core.serve import constraints as serve_constraints
from ninfer_core.serve.errors import ApiError
from ninfer_core.serve.limits import until_disconnect
from ninfer_core.serve.state import ServeState
from ninfer_plugins.frontend_openai.common import (
    TokenLog,
    check_model,
    collect,
    first_event,
    generation_request,
    now,
)
from ninfer_plugins.frontend_openai.constraints import request_constraint
from ninfer_plugins.frontend_openai.conversation import forced_call
from ninfer_plugins.frontend_openai.errors import error_body
from ninfer_plugins.frontend_openai.logprobs import TokenTexts, chat_content, token_texts
from ninfer_plugins.frontend_openai.output import ChatOutput
from ninfer_plugins.frontend_openai.prompt import chat_prompt
from ninfer_plugins.frontend_responses import convert, wire
from ninfer_plugins.frontend_responses.items import Event, ItemAssembler, new_id
from ninfer_plugins.frontend_responses.store import ResponseStore

PATHS = ["/v1/responses", "/responses"]
ITEM_PATHS = ["/v1/responses/{response_id:str}", "/responses/{response_id:str}"]


@dataclass
class Run:
    """One response in the making: the request's echo, the parser and the items so far."""

    state: ServeState
    store: ResponseStore
    data: wire.ResponsesRequest
    response: wire.ResponseObject
    output: ChatOutput
    #: The conversation before this response's output (stored with it).
    items: list[wire.InputItem]
    assembler: ItemAssembler = field(default_factory=ItemAssembler)
    #: With log probabilities asked: each token's text, and the tokens' entries so far.
    texts: TokenTexts | None = None
    log: TokenLog = field(default_factory=TokenLog)

    def feed(self, text: str) -> list[Event]:
        return self.assembler.piece(self.output.feed(text))

    def finish(self, finish: FinishEvent) -> list[Event]:
        """The last events; `response` is complete afterwards (and stored if asked)."""
        incomplete = finish.reason == "length"
        events = self.assembler.piece(self.output.finish())
        events += self.assembler.finish("incomplete" if incomplete else "completed")
        r = self.response
        r.output = self.assembler.items
        self.attach_logprobs()
        r.status = "incomplete" if incomplete else "completed"
        if incomplete:
            r.incomplete_details = wire.IncompleteDetails("max_output_tokens")
        r.completed_at = now()
        r.usage = self.usage(finish)
        if self.data.store:
            self.store.put(r, [*self.items, *convert.output_as_input(r.output)])
        return events

    def attach_logprobs(self) -> None:
        """Every generated token's entry on the last message's text, those of reasoning and
        calls too, as vLLM attaches them (chat completions report the same list): which
        tokens a text part owns is not tracked. A stream's deltas carry none; its final
        response carries them."""
        messages = [i for i in self.assembler.items if isinstance(i, wire.MessageItem)]
        if self.texts is not None and messages:
            messages[-1].content[0].logprobs = chat_content(self.texts, self.log.logprobs)

    def usage(self, finish: FinishEvent) -> wire.ResponseUsage:
        u = finish.usage
        reasoning = self.assembler.reasoning
        # Reasoning and answer share tokens at their seam; counting the text is near enough.
        thought = len(self.state.tokenizer.encode(reasoning, add_special_tokens=False))
        return wire.ResponseUsage(
            input_tokens=u.prompt_tokens,
            output_tokens=u.completion_tokens,
            total_tokens=u.prompt_tokens + u.completion_tokens,
            input_tokens_details=wire.InputTokensDetails(cached_tokens=u.cached_tokens),
            output_tokens_details=wire.OutputTokensDetails(
                reasoning_tokens=min(thought, u.completion_tokens)
            ),
        )


def route_handlers(state: ServeState, store: ResponseStore) -> list:
    @post(
        PATHS,
        status_code=200,
        summary="Create a model response",
        responses={
            200: ResponseSpec(
                wire.ResponseObject,
                description="the response, or with stream=true an event stream",
            )
        },
    )
    async def create_response(
        request: Request, data: JSONBody[wire.ResponsesRequest]
    ) -> Response | ServerSentEvent:
        model = check_model(state, data.model)
        top = convert.check_request(data)
        history: list[wire.InputItem] = []
        if data.previous_response_id is not None:
            history = store.get(data.previous_response_id, param="previous_response_id").items
        new = convert.input_items(data.input)
        messages = convert.chat_messages([*history, *new], offset=-len(history))
        chat = convert.chat_request(data, messages)
        try:
            prompt = await chat_prompt(state, chat)
            forced = await serve_constraints.forced_call(state, forced_call(chat), prompt.tools)
            constraint = await request_constraint(state, chat, chat.response_format, forced)
            gen = generation_request(
                state,
                chat,
                prompt.ids,
                data.max_output_tokens,
                scope=request.scope,
                logprobs=top,
                constraint=constraint,
            )
        except ApiError as exc:
            raise convert.renamed(exc) from None
        run = Run(
            state,
            store,
            data,
            skeleton(data, model, gen.params.temperature, gen.params.top_p),
            prompt.output,
            [*history, *new],
            texts=token_texts(state.tokenizer) if top is not None else None,
        )
        events = state.generate(gen)
        if data.stream:
            first = await first_event(request, events)
            return ServerSentEvent(stream(first, events, run))
        finish = await until_disconnect(request, collect(events, run.feed, run.log))
        run.finish(finish)
        return Response(run.response)

    @get(ITEM_PATHS, sync_to_thread=False, summary="Retrieve a stored model response")
    def retrieve_response(response_id: FromPath[str]) -> wire.ResponseObject:
        return store.get(response_id).response

    @delete(ITEM_PATHS, status_code=200, sync_to_thread=False, summary="Delete a model response")
    def delete_response(response_id: FromPath[str]) -> wire.DeletedResponse:
        store.get(response_id)  # a 404 when unknown
        store.delete(response_id)
        return wire.DeletedResponse(response_id)

    return [create_response, retrieve_response, delete_response]


def skeleton(
    data: wire.ResponsesRequest, model: str, temperature: float, top_p: float
) -> wire.ResponseObject:
    """The response as `response.created` shows it: the request echoed, no output yet."""
    return wire.ResponseObject(
        id=new_id("resp"),
        created_at=now(),
        model=model,
        status="in_progress",
        output=[],
        instructions=data.instructions,
        max_output_tokens=data.max_output_tokens,
        metadata=dict(data.metadata or {}),
        parallel_tool_calls=data.parallel_tool_calls is not False,
        previous_response_id=data.previous_response_id,
        reasoning=wire.ReasoningOut(
            data.reasoning.effort if data.reasoning else None,
            data.reasoning.summary if data.reasoning else None,
        ),
        store=data.store,
        temperature=temperature,
        top_p=top_p,
        tool_choice=msgspec.to_builtins(data.tool_choice) if data.tool_choice else "auto",
        tools=msgspec.to_builtins(data.tools or []),
        truncation=data.truncation or "disabled",
        user=data.user,
        text=wire.TextOut(
            msgspec.to_builtins(data.text.format)
            if data.text is not None and data.text.format is not None
            else {"type": "text"}
        ),
    )


async def stream(
    first: GenerationEvent, events: AsyncIterator[GenerationEvent], run: Run
) -> AsyncIterator[ServerSentEventMessage]:
    numbers = itertools.count()

    def sse(kind: str, fields: dict) -> ServerSentEventMessage:
        body = {"type": kind, "sequence_number": next(numbers), **fields}
        return ServerSentEventMessage(data=msgspec.json.encode(body).decode(), event=kind)

    try:
        yield sse("response.created", {"response": run.response})
        yield sse("response.in_progress", {"response": run.response})
        event = first
        while not isinstance(event, FinishEvent):
            run.log.add(event)
            for kind, fields in run.feed(event.text):
                yield sse(kind, fields)
            event = await anext(events)
        for kind, fields in run.finish(event):
            yield sse(kind, fields)
        done = (
            "response.incomplete" if run.response.status == "incomplete" else "response.completed"
        )
        yield sse(done, {"response": run.response})
    except ApiError as exc:
        shaped = error_body(exc)["error"]
        code = shaped["code"] or shaped["type"]
        yield sse("error", {"code": code, "message": exc.message, "param": exc.param})
        run.response.status = "failed"
        run.response.output = run.assembler.items
        run.response.error = wire.ResponseError(code, exc.message)
        yield sse("response.failed", {"response": run.response})
    finally:
        await events.aclose()  # type: ignore[attr-defined]
