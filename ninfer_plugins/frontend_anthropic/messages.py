"""`POST /v1/messages`: one generation, answered whole or as Anthropic's event stream.

Everything that can be refused is refused before the engine sees the request (model
id, content, tools, budget, sampling), so those failures are plain HTTP errors. A
streamed response waits up to one ping interval for the first event, so a full queue
(429) or an early queue timeout (503) still gets its own status; after that the stream
starts and sends `ping`s while the request waits in the queue or in a long prefill,
and a later failure arrives as an `error` event, as Anthropic sends it mid-stream.
A client that leaves before the response starts cancels its request as well.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from litestar.response import ServerSentEvent, ServerSentEventMessage

from ninfer_core.engine.request import FinishEvent, GenerationRequest, TokenEvent, Usage
from ninfer_core.sampling.grammar import Constraint, GrammarError
from ninfer_core.serve import constraints as serve_constraints
from ninfer_core.serve.cache_salt import cache_salt, tenant
from ninfer_core.serve.errors import ApiError, invalid
from ninfer_core.serve.limits import until_disconnect
from ninfer_plugins.frontend_anthropic import convert
from ninfer_plugins.frontend_anthropic.blocks import BlockAssembler
from ninfer_plugins.frontend_anthropic.context import Context
from ninfer_plugins.frontend_anthropic.errors import error_body
from ninfer_plugins.frontend_anthropic.pump import TICK, EventPump
from ninfer_plugins.frontend_anthropic.usage import has_breakpoint, usage
from ninfer_plugins.frontend_anthropic.wire import MessagesRequest

log = logging.getLogger(__name__)

#: The caps on stop sequences, the same in both protocols (see the OpenAI frontend's).
MAX_STOPS, MAX_STOP_CHARS = 64, 256


@dataclass
class Plan:
    """A validated request: what to submit, and how to read the model's answer."""

    request: GenerationRequest
    model: str
    tools: list[dict[str, Any]] | None
    thinking_open: bool
    stop_sequences: tuple[str, ...]
    #: max_tokens was cut to the room the context had left.
    clamped: bool = False
    #: The prefilled start of a forced tool call, read before the model's text.
    opening: str = ""
    #: The final usage carries `spec_stats` (the request's `return_spec_stats`).
    spec_stats: bool = False
    #: The request marks a `cache_control` breakpoint: its cache writes count as such.
    breakpoint: bool = False

    def assembler(self) -> BlockAssembler:
        blocks = BlockAssembler(
            self.tools, parse_tools=self.tools is not None, thinking_open=self.thinking_open
        )
        blocks.feed(self.opening)  # an open <tool_call>: held, no event yet
        return blocks


def stop_sequences(given: list[str] | None) -> tuple[str, ...]:
    """The request's stop strings (empty ones dropped), within the caps the OpenAI frontend
    applies too: each is checked against every new piece of text, so one request with
    thousands of them would slow every other request's decode."""
    stops = tuple(s for s in given or () if s)
    if len(stops) > MAX_STOPS:
        raise invalid(
            f"stop_sequences: at most {MAX_STOPS} stop sequences, got {len(stops)}",
            param="stop_sequences",
        )
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise invalid(
            f"stop_sequences: a stop sequence has at most {MAX_STOP_CHARS} characters, "
            f"got {longest}",
            param="stop_sequences",
        )
    return stops


def structured_output(data: MessagesRequest) -> tuple[Constraint | None, str]:
    """Structured output: `output_config.format` (or the beta's `output_format`),
    `{"type": "json_schema", "schema": {...}}`, as the constraint the answer must match
    and the field it came from; anything else there is a 400 naming it."""
    asked = [
        (param, given)
        for param, given in (
            ("output_config.format", data.output_config and data.output_config.format),
            ("output_format", data.output_format),
        )
        if given is not None
    ]
    if not asked:
        return None, ""
    if len(asked) > 1:
        raise invalid(
            "output_format: cannot be combined with output_config.format", "output_format"
        )
    param, given = asked[0]
    if given.get("type") != "json_schema" or not isinstance(given.get("schema"), dict):
        raise invalid(f'{param}: must be {{"type": "json_schema", "schema": {{...}}}}', param)
    try:
        return Constraint.json_schema(given["schema"]), param
    except GrammarError as exc:
        raise invalid(f"{param}: {exc}", param) from None


async def plan(ctx: Context, data: MessagesRequest, scope: Mapping[str, Any]) -> Plan:
    """Everything a request can be refused for, checked before the engine sees it; `scope`
    (the request's ASGI scope) carries the key that salts its prefix-cache blocks."""
    ctx.check_model(data.model)
    output, output_param = structured_output(data)
    salt = cache_salt(scope, data.cache_salt)
    state = ctx.state
    stops = stop_sequences(data.stop_sequences)
    prompt = convert.to_prompt(data)
    # Rendering a long conversation takes a while; other streams keep flowing meanwhile.
    ids = await asyncio.to_thread(convert.render, state, prompt)
    # Agents ask for a fixed max_tokens (Claude Code: 32000) however long the conversation
    # has grown; like Anthropic's API, the budget shrinks to what the context has left and
    # the answer says so. A budget no context could hold is still refused.
    budget = data.max_tokens
    if budget <= state.max_context:
        budget = min(budget, max(1, state.max_context - len(ids)))
    # A forced call is constrained to an offered tool and its schema; else the format.
    constraint = await serve_constraints.forced_call(state, prompt.forced, prompt.tools)
    if constraint is None:
        constraint = await serve_constraints.checked(state, output, output_param)
    request = GenerationRequest(
        ids,
        state.sampling(temperature=data.temperature, top_p=data.top_p, top_k=data.top_k),
        max_tokens=state.max_tokens(budget, len(ids)),
        stop=stops,
        cache_salt=salt,
        tenant=tenant(scope),
        constraint=constraint,
    )
    thinking_open = convert.opens_thinking(state, ids)
    clamped = budget < data.max_tokens
    opening = convert.opening(state, prompt)
    served = state.options.model_id  # an alias (`--model-aliases`) answers as the model
    return Plan(request, served, prompt.tools, thinking_open, stops, clamped, opening,
                data.return_spec_stats, has_breakpoint(data))  # fmt: skip


def stop_reason(plan: Plan, finish: FinishEvent, tool_use: bool) -> tuple[str, str | None]:
    if tool_use:
        return "tool_use", None
    if finish.reason == "length":
        return ("model_context_window_exceeded" if plan.clamped else "max_tokens"), None
    if isinstance(finish.matched, str) and finish.matched in plan.stop_sequences:
        return "stop_sequence", finish.matched
    return "end_turn", None


def message(mid: str, plan: Plan, content: list[Any], **rest: Any) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": plan.model,
            "content": content, "stop_reason": None, "stop_sequence": None} | rest  # fmt: skip


async def collect(events: AsyncIterator[Any], blocks: BlockAssembler) -> FinishEvent:
    """Run a generation to its end, feeding its text to `blocks`."""
    async for event in events:
        if isinstance(event, FinishEvent):
            blocks.finish()
            return event
        blocks.feed(event.text)
    raise ApiError(500, "internal", "the generation ended without a finish")


@post("/messages", status_code=200, summary="Create a message (Anthropic Messages API)")
async def create_message(
    request: Request[Any, Any, Any],
    data: JSONBody[MessagesRequest],
    anthropic: NamedDependency[Context],
) -> Response[Any]:
    p = await plan(anthropic, data, request.scope)
    state, mid = anthropic.state, "msg_" + uuid.uuid4().hex[:24]
    headers = {"request-id": "req_" + p.request.request_id[:24]}
    if data.stream:
        rid = p.request.request_id
        pump = EventPump(state.generate(p.request), on_close=lambda: state.engine.cancel(rid))
        try:
            await until_disconnect(request, pump.start(anthropic.ping_interval_s))
        except BaseException:
            pump.close()
            raise
        headers |= {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return ServerSentEvent(stream(anthropic, p, pump, mid), headers=headers)
    blocks = p.assembler()
    finish = await until_disconnect(request, collect(state.generate(p.request), blocks))
    reason, sequence = stop_reason(p, finish, blocks.has_tool_use)
    spent = usage(
        finish.usage, state.engine.config, breakpoint=p.breakpoint, with_spec=p.spec_stats
    )
    body = message(mid, p, blocks.blocks, stop_reason=reason, stop_sequence=sequence,
                   usage=spent)  # fmt: skip
    return Response(body, status_code=200, headers=headers)


def _sse(event: dict[str, Any]) -> ServerSentEventMessage:
    return ServerSentEventMessage(event=event["type"], data=msgspec.json.encode(event).decode())


PING = {"type": "ping"}


async def stream(
    ctx: Context, plan: Plan, pump: EventPump, mid: str
) -> AsyncIterator[ServerSentEventMessage]:
    """message_start, ping, content_block_* …, message_delta, message_stop.

    Leaving early (the client went away) closes the pump, which cancels the request.
    """
    try:
        # The first event (waited for before the stream started) says what the prefix cache
        # supplied, so message_start already splits the prompt, as Anthropic's does.
        first = pump.peek()
        cached = first.cached_tokens if isinstance(first, TokenEvent) else None
        start = Usage(len(plan.request.prompt_ids), 0, cached or 0)
        config = ctx.state.engine.config
        head = message(mid, plan, [], usage=usage(start, config, breakpoint=plan.breakpoint))
        yield _sse({"type": "message_start", "message": head})
        yield _sse(PING)
        blocks, finish = plan.assembler(), None
        while finish is None:
            item = await pump.next(ctx.ping_interval_s)
            if item is TICK:
                yield _sse(PING)
            elif item is None:
                raise ApiError(500, "internal", "the generation ended without a finish")
            elif isinstance(item, FinishEvent):
                finish = item
            else:
                for event in blocks.feed(item.text):
                    yield _sse(event)
        for event in blocks.finish():
            yield _sse(event)
        reason, sequence = stop_reason(plan, finish, blocks.has_tool_use)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        spent = usage(finish.usage, config, breakpoint=plan.breakpoint, with_spec=plan.spec_stats)
        yield _sse({"type": "message_delta", "delta": delta, "usage": spent})
        yield _sse({"type": "message_stop"})
    except ApiError as exc:
        yield _sse(error_body(exc.status, exc.message, exc.kind))
    except Exception:
        log.exception("stream %s failed", mid)
        yield _sse(error_body(500, "internal server error"))
    finally:
        pump.close()
