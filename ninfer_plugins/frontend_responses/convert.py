"""A Responses request as the chat request it amounts to, so that the OpenAI frontend's
prompt building (template, tools, forced tool choice, reasoning) serves both endpoints.

Input items become chat messages: a `message` item keeps its role (`developer` is rendered
as `system` further on), `function_call` items join the assistant turn before them as its
`tool_calls` (or open one), `function_call_output` items become `tool` messages, and a
`reasoning` item becomes the `reasoning_content` of the assistant turn that follows it. The
output items of an earlier response convert the same way, which is what makes
`previous_response_id` the same as sending the whole conversation again.
"""

from __future__ import annotations

from typing import Any

from ninfer_core.serve.errors import ApiError, invalid
from ninfer_plugins.frontend_openai import common
from ninfer_plugins.frontend_openai import wire as chat
from ninfer_plugins.frontend_openai.common import refuse
from ninfer_plugins.frontend_responses import wire

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
REASONING_PARTS = ("reasoning_text", "summary_text")
#: The `include` value that asks for log probabilities.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: OpenAI's own bounds on `metadata`.
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def check_request(data: wire.ResponsesRequest) -> int | None:
    """What this server cannot honour is refused rather than quietly served differently;
    returns `logprobs_asked(data)`, checked in its place among the other fields."""
    if data.background:
        raise refuse("background", "background responses are not supported by this server")
    if data.conversation is not None:
        raise refuse("conversation", "conversations are not supported; use previous_response_id")
    if data.prompt is not None:
        raise refuse("prompt", "prompt templates are not supported by this server")
    top = logprobs_asked(data)
    fmt = data.text.format if data.text is not None else None
    if fmt is not None and fmt.type not in ("text", "json_object", "json_schema"):
        raise refuse("text.format", "type must be text, json_object or json_schema")
    if data.max_output_tokens is not None and data.max_output_tokens < 1:
        raise refuse("max_output_tokens", f"must be at least 1, got {data.max_output_tokens}")
    check_metadata(data.metadata)
    if data.input is None and data.previous_response_id is None:
        raise refuse("input", "required unless previous_response_id is given")
    if isinstance(data.input, list) and not data.input and data.previous_response_id is None:
        raise refuse("input", "at least one input item is required")
    return top


def logprobs_asked(data: wire.ResponsesRequest) -> int | None:
    """How many alternatives per token the answer's log probabilities carry (None: none
    asked): `include: ["message.output_text.logprobs"]` or `top_logprobs` (0..20) ask."""
    asked = bool(data.include and LOGPROBS_INCLUDE in data.include)
    return common.logprobs_asked(asked or data.top_logprobs is not None, data.top_logprobs)


def check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise refuse("metadata", f"at most {MAX_METADATA_KEYS} keys, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise refuse("metadata", f"a key has at most {MAX_METADATA_KEY} characters")
        if len(value) > MAX_METADATA_VALUE:
            raise refuse("metadata", f"a value has at most {MAX_METADATA_VALUE} characters")


def input_items(value: str | list[wire.InputItem] | None) -> list[wire.InputItem]:
    """The request's input as items (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [wire.InputItem(role="user", content=value)]
    return list(value)


def _texts(parts: str | list[wire.Part] | None, where: str, kinds: tuple[str, ...]) -> str | None:
    if parts is None or isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if part.type not in kinds:
            raise refuse(
                f"{where}[{j}]",
                f"content parts of type {part.type!r} are not supported here; "
                f"only {', '.join(map(repr, kinds))}",
            )
        if part.text is None:
            raise refuse(f"{where}[{j}].text", f"a {part.type!r} part needs text")
        texts.append(part.text)
    return "\n".join(texts)


def chat_messages(items: list[wire.InputItem], offset: int = 0) -> list[chat.ChatMessage]:
    """The chat messages of `items`; a bad item is a 400 naming `input[offset + i]`."""
    out: list[chat.ChatMessage] = []
    reasoning: list[str] = []  # reasoning items waiting for their assistant turn

    def assistant_turn() -> chat.ChatMessage:
        """The turn a function call joins: the assistant message just before, else a new one."""
        last = out[-1] if out else None
        if last is not None and last.role == "assistant" and not reasoning:
            return last
        message = chat.ChatMessage(role="assistant", reasoning_content=_pop(reasoning))
        out.append(message)
        return message

    for i, item in enumerate(items):
        where = f"input[{offset + i}]"
        if item.type == "message":
            if item.role not in ROLES:
                raise refuse(f"{where}.role", f"must be one of {', '.join(ROLES)}")
            content = _texts(item.content, f"{where}.content", TEXT_PARTS)
            if content is None and item.role != "assistant":
                raise refuse(f"{where}.content", f"a {item.role} message needs content")
            message = chat.ChatMessage(role=item.role, content=content)  # type: ignore[arg-type]
            if item.role == "assistant":
                message.reasoning_content = _pop(reasoning)
            out.append(message)
        elif item.type == "function_call":
            if not item.call_id or not item.name:
                raise refuse(where, "a function_call item needs call_id and name")
            turn = assistant_turn()
            call = chat.ToolCallIn(
                chat.FunctionCall(item.name, item.arguments or "{}"), item.call_id
            )
            turn.tool_calls = [*(turn.tool_calls or []), call]
        elif item.type == "function_call_output":
            if not item.call_id:
                raise refuse(f"{where}.call_id", "a function_call_output item needs call_id")
            output = _texts(item.output, f"{where}.output", TEXT_PARTS)
            if output is None:
                raise refuse(f"{where}.output", "a function_call_output item needs output")
            out.append(chat.ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
        elif item.type == "reasoning":
            text = _texts(item.content, f"{where}.content", REASONING_PARTS)
            if not text:
                text = _texts(item.summary, f"{where}.summary", REASONING_PARTS)
            if text:
                reasoning.append(text)
        else:
            raise refuse(
                f"{where}.type",
                f"input items of type {item.type!r} are not supported; only message, "
                "function_call, function_call_output and reasoning",
            )
    return out


def _pop(reasoning: list[str]) -> str | None:
    text = "\n".join(reasoning) or None
    reasoning.clear()
    return text


def output_as_input(items: list[wire.OutputItem]) -> list[wire.InputItem]:
    """A response's output items as the input items a client would send them back as."""
    out = []
    for item in items:
        if isinstance(item, wire.MessageItem):
            parts = [wire.Part("output_text", c.text) for c in item.content]
            out.append(wire.InputItem(role="assistant", content=parts, id=item.id))
        elif isinstance(item, wire.ReasoningItem):
            parts = [wire.Part("reasoning_text", c.text) for c in item.content]
            out.append(wire.InputItem(type="reasoning", content=parts, id=item.id))
        else:
            out.append(
                wire.InputItem(
                    type="function_call",
                    id=item.id,
                    call_id=item.call_id,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
    return out


def chat_tools(tools: list[wire.ToolDef] | None) -> list[chat.Tool] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.type != "function":
            raise refuse(
                f"tools[{i}].type",
                f"only function tools are supported by this server, not {t.type!r}",
            )
        if not t.name:
            raise refuse(f"tools[{i}].name", "a function tool needs a name")
        out.append(chat.Tool(chat.FunctionDef(t.name, t.description, t.parameters, t.strict)))
    return out


def chat_tool_choice(
    choice: str | wire.ToolChoiceObject | None,
) -> str | chat.NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type in ("none", "auto", "required"):
        return choice.type
    if choice.type != "function" or not choice.name:
        raise refuse(
            "tool_choice",
            'only "none", "auto", "required" or {"type": "function", "name": ...} are supported',
        )
    return chat.NamedToolChoice(chat.NamedFunction(choice.name))


def template_kwargs(data: wire.ResponsesRequest) -> dict[str, Any] | None:
    """`reasoning.effort` "none" turns a template's thinking off, any other effort on;
    without `reasoning` the template keeps its default. `chat_template_kwargs` wins."""
    kwargs = dict(data.chat_template_kwargs or {})
    effort = data.reasoning.effort if data.reasoning is not None else None
    if effort is not None:
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs or None


def chat_request(
    data: wire.ResponsesRequest, messages: list[chat.ChatMessage]
) -> chat.ChatCompletionRequest:
    """The chat request `data` amounts to, over the whole conversation `messages`."""
    if data.instructions:
        messages = [chat.ChatMessage(role="system", content=data.instructions), *messages]
    if not messages:
        raise invalid("the conversation is empty", param="input")
    return chat.ChatCompletionRequest(
        model=data.model,
        messages=messages,
        tools=chat_tools(data.tools),
        tool_choice=chat_tool_choice(data.tool_choice),  # type: ignore[arg-type]
        max_completion_tokens=data.max_output_tokens,
        temperature=data.temperature,
        top_p=data.top_p,
        top_k=data.top_k,
        min_p=data.min_p,
        presence_penalty=data.presence_penalty,
        frequency_penalty=data.frequency_penalty,
        repetition_penalty=data.repetition_penalty,
        seed=data.seed,
        ignore_eos=data.ignore_eos,
        cache_salt=data.cache_salt,
        chat_template_kwargs=template_kwargs(data),
        response_format=response_format(data),
    )


def response_format(data: wire.ResponsesRequest) -> chat.ResponseFormat | None:
    """`text.format` as chat's `response_format` (structured output)."""
    fmt = data.text.format if data.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    schema = chat.JsonSchemaFormat(name=fmt.name, schema_=fmt.schema_, strict=fmt.strict)
    return chat.ResponseFormat(type=fmt.type, json_schema=schema)


#: Chat's field names in the errors of the pieces shared with it, and this API's names.
RENAMED = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def renamed(exc: ApiError) -> ApiError:
    """An error of chat's prompt building or budget, naming this API's field instead."""
    name = RENAMED.get(exc.param or "")
    if name is not None:
        exc.message = exc.message.replace(str(exc.param), name)
        exc.param = name
    return exc
