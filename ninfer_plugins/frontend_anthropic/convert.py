"""Anthropic messages → the chat-template messages Hugging Face templates understand.

Anthropic carries tool calls and results as content blocks inside ordinary turns; chat
templates (Qwen's among them) expect OpenAI-style messages: an assistant turn with
`tool_calls`, and one `role: "tool"` message per result. Thinking blocks become
`reasoning_content`, which templates render back into the model's own `<think>` form.
A final assistant turn is a prefill: the prompt ends inside it and the model continues.
A forced `tool_choice` (`any`, `tool`) ends the prompt with the opening of the model's call
form (`ninfer_core.text.tool_choice`), so counted tokens include it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ninfer_core.serve.errors import ApiError, invalid
from ninfer_core.serve.state import ServeState
from ninfer_core.text.tool_choice import ForcedCall, call_opening, ends_in_thinking, with_opening
from ninfer_plugins.frontend_anthropic import wire


@dataclass
class Prompt:
    """A request's conversation in template terms, plus how to read the model's answer."""

    messages: list[dict[str, Any]]
    #: Tools in the OpenAI function shape templates render; None when there are none.
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: The last message is the assistant's own start; the model continues it.
    prefill: bool = False
    #: The call `tool_choice` `any` or `tool` forces.
    forced: ForcedCall | None = None


def _text_of(blocks: list[Any], where: str) -> str:
    """The text of a list of blocks; anything but text is refused, naming where it was."""
    parts = []
    for j, block in enumerate(blocks):
        if isinstance(block, wire.TextBlock):
            parts.append(block.text)
        else:
            raise _unsupported(block, f"{where}.{j}")
    return "\n".join(parts)


def _unsupported(block: Any, where: str) -> ApiError:
    kind = type(block).__name__
    if isinstance(block, wire.ImageBlock | wire.DocumentBlock):
        kind = "image" if isinstance(block, wire.ImageBlock) else "document"
        return invalid(
            f"{where}: {kind} content is not supported; this model reads text only",
            param=where,
        )
    return invalid(f"{where}: a {kind} is not allowed here", param=where)


def _system(system: str | list[wire.TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n\n".join(block.text for block in system)


def _user_turn(content: list[Any], i: int, names: dict[str, str]) -> list[dict[str, Any]]:
    """A user turn's blocks, in order: tool results as `tool` messages, text as user ones."""
    out: list[dict[str, Any]] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            out.append({"role": "user", "content": "\n".join(text)})
            text.clear()

    for j, block in enumerate(content):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, wire.TextBlock):
            text.append(block.text)
        elif isinstance(block, wire.ToolResultBlock):
            flush()
            result = block.content
            if isinstance(result, list):
                result = _text_of(result, f"{where}.content")
            result = result or ""
            if block.is_error:
                result = f"Error: {result}"
            message = {"role": "tool", "content": result, "tool_call_id": block.tool_use_id}
            if block.tool_use_id in names:
                message["name"] = names[block.tool_use_id]
            out.append(message)
        else:
            raise _unsupported(block, where)
    flush()
    return out


def _assistant_turn(content: list[Any], i: int, names: dict[str, str]) -> dict[str, Any]:
    text, thinking, calls = [], [], []
    for j, block in enumerate(content):
        if isinstance(block, wire.TextBlock):
            text.append(block.text)
        elif isinstance(block, wire.ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, wire.RedactedThinkingBlock):
            continue  # nothing readable to give back to the model
        elif isinstance(block, wire.ToolUseBlock):
            names[block.id] = block.name
            call = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": call})
        else:
            raise _unsupported(block, f"messages.{i}.content.{j}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(request: wire.PromptFields) -> list[dict[str, Any]] | None:
    if isinstance(request.tool_choice, wire.ToolChoiceNone) or not request.tools:
        return None  # `none`: the model is not told about the tools at all
    tools = []
    for k, tool in enumerate(request.tools):
        if tool.type not in (None, "custom"):
            raise invalid(
                f"tools.{k}: server tool {tool.type!r} is not available; "
                "only client tools (name, description, input_schema) are",
                param=f"tools.{k}",
            )
        if tool.input_schema is None:
            raise invalid(f"tools.{k}.input_schema: field required", param=f"tools.{k}")
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    choice, names = request.tool_choice, {t.name for t in request.tools}
    if isinstance(choice, wire.ToolChoiceTool) and choice.name not in names:
        raise invalid(f"tool_choice.name: no tool named {choice.name!r}", param="tool_choice")
    return tools


def to_prompt(request: wire.PromptFields) -> Prompt:
    """The request as template messages; a 400 for anything this server cannot take."""
    if not request.messages:
        raise invalid("messages: at least one message is required", param="messages")
    if isinstance(request.tool_choice, wire.ToolChoiceAny | wire.ToolChoiceTool) and not (
        request.tools
    ):
        raise invalid("tool_choice: requires tools to be given", param="tool_choice")
    messages: list[dict[str, Any]] = []
    if system := _system(request.system):
        messages.append({"role": "system", "content": system})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that follow
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, str):
            messages.append({"role": message.role, "content": content})
        elif message.role == "user":
            messages.extend(_user_turn(content, i, names))
        else:
            messages.append(_assistant_turn(content, i, names))
    last = messages[-1] if messages else None
    prefill = bool(last and last["role"] == "assistant" and not last.get("tool_calls"))
    if prefill and not last["content"]:
        messages.pop()  # an empty prefill is just "the assistant's turn"
        prefill = False
    if not any(m["role"] != "system" for m in messages):
        raise invalid("messages: the conversation has no content", param="messages")
    kwargs = {}
    if request.thinking is not None:
        kwargs["enable_thinking"] = not isinstance(request.thinking, wire.ThinkingDisabled)
    choice = request.tool_choice
    forced = None
    if isinstance(choice, wire.ToolChoiceAny):
        forced = ForcedCall.among([tool.name for tool in request.tools or ()])
    elif isinstance(choice, wire.ToolChoiceTool):
        forced = ForcedCall(choice.name)
    return Prompt(messages, _tools(request), kwargs, prefill, forced)


def opening(state: ServeState, prompt: Prompt) -> str:
    """The start of a forced call, which the prompt ends with and the answer's parser reads
    first ("" when nothing is forced or the template's call form is unknown)."""
    return call_opening(state.template, prompt.forced)


def render(state: ServeState, prompt: Prompt, *, whole: bool = False) -> list[int]:
    """Prompt token ids; a prefill is rendered open, so the model continues its text; a
    forced call's opening comes last. `whole`: counted past the context (count_tokens)."""
    ids = _render(state, prompt, whole=whole)
    return with_opening(state.tokenizer, ids, opening(state, prompt))


def _render(state: ServeState, prompt: Prompt, *, whole: bool = False) -> list[int]:
    """The same render as OpenAI chat's `continue_final_message` for a prefill, so one
    conversation is one prompt through both protocols."""
    return state.render(
        prompt.messages,
        prompt.tools,
        continue_final_message=prompt.prefill,
        whole=whole,
        **prompt.template_kwargs,
    )


def opens_thinking(state: ServeState, prompt_ids: list[int]) -> bool:
    """Whether the prompt itself ends inside `<think>` (templates that open it for the model)."""
    return ends_in_thinking(state.tokenizer.decode(prompt_ids[-32:]))
