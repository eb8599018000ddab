"""An OpenAI chat request as the chat template sees it: plain message dicts and tool schemas.

Text parts are joined with newlines (as vLLM does). A tool call's `arguments` travel as JSON
text on the wire but templates index them as a mapping, so a valid JSON object is handed to
the template parsed. `developer` is OpenAI's newer name for `system`, which is what chat
templates know.
"""

from __future__ import annotations

import json
from typing import Any

from ninfer_core.text.tool_choice import ForcedCall
from ninfer_plugins.frontend_openai import wire
from ninfer_plugins.frontend_openai.common import refuse

#: Template variables a request may not set through `chat_template_kwargs`.
RESERVED_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "template_name",
    }
)


def text_of(content: str | list[wire.ContentPart] | None, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise refuse(
                f"{where}.content[{i}]",
                f"content parts of type {part.type!r} are not supported; only 'text'",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_messages(messages: list[wire.ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise refuse("messages", "at least one message is required")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        content = text_of(m.content, where)
        if content is None and m.role in ("system", "developer", "user", "tool"):
            raise refuse(f"{where}.content", f"a {m.role} message needs content")
        message: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content or "",
        }
        if m.name is not None:
            message["name"] = m.name
        if m.role == "assistant":
            if m.reasoning_content:
                message["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _arguments(c.function.arguments),
                        },
                    }
                    for c in m.tool_calls
                ]
        if m.role == "tool" and m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def template_tools(data: wire.ChatCompletionRequest) -> tuple[list[dict] | None, bool]:
    """(the tools to render, whether to parse tool calls out of the answer).

    `tool_choice` "none" still shows the tools (the conversation may refer to them) but
    nothing is parsed; a named choice shows only that tool. "required" and a named choice
    are forced by a prefill (`forced_call`, `ninfer_core.text.tool_choice`).
    """
    if not data.tools:
        if isinstance(data.tool_choice, wire.NamedToolChoice) or data.tool_choice == "required":
            raise refuse("tool_choice", "a tool is required but the request defines no tools")
        return None, False
    tools = data.tools
    if isinstance(data.tool_choice, wire.NamedToolChoice):
        name = data.tool_choice.function.name
        tools = [t for t in tools if t.function.name == name]
        if not tools:
            raise refuse("tool_choice", f"names the tool {name!r}, which is not in tools")
    schemas = []
    for t in tools:
        fn = {"name": t.function.name}
        if t.function.description is not None:
            fn["description"] = t.function.description
        fn["parameters"] = t.function.parameters or {"type": "object", "properties": {}}
        schemas.append({"type": "function", "function": fn})
    return schemas, data.tool_choice != "none"


def forced_call(data: wire.ChatCompletionRequest) -> ForcedCall | None:
    """The call "required" or a named choice forces (checked by `template_tools`)."""
    if isinstance(data.tool_choice, wire.NamedToolChoice):
        return ForcedCall(data.tool_choice.function.name)
    if data.tool_choice == "required" and data.tools:
        return ForcedCall.among([t.function.name for t in data.tools])
    return None


def template_kwargs(data: wire.ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(data.chat_template_kwargs or {})
    bad = sorted(RESERVED_KWARGS & kwargs.keys())
    if bad:
        raise refuse("chat_template_kwargs", f"may not set {', '.join(bad)}")
    return kwargs


def continuation(data: wire.ChatCompletionRequest) -> dict[str, bool]:
    """vLLM's `add_generation_prompt` / `continue_final_message`, as `ServeState.render`
    takes them. Continuing the final message implies no generation prompt (vLLM asks the
    client to say so; an explicit `add_generation_prompt: true` beside it is a 400), and
    cannot be combined with a forced tool call, whose opening would follow the message."""
    if not data.continue_final_message:
        add = data.add_generation_prompt
        return {"add_generation_prompt": add is not False}
    if data.add_generation_prompt:
        raise refuse(
            "continue_final_message",
            "cannot be combined with add_generation_prompt: true; send false",
        )
    if forced_call(data) is not None:
        raise refuse("continue_final_message", "cannot be combined with a forced tool_choice")
    last = data.messages[-1] if data.messages else None
    if last is None or last.role != "assistant":
        raise refuse("continue_final_message", "the final message must be an assistant message")
    return {"add_generation_prompt": False, "continue_final_message": True}
