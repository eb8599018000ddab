"""Anthropic Messages API request bodies, as msgspec Structs.

Litestar decodes bodies straight into these, so a wrong type or a missing field fails
before a handler runs, with msgspec's message naming the field (`errors.py` turns it
into Anthropic's error shape), and the OpenAPI schema shows the real request types.
Fields this server has no use for (`citations`, `service_tier`, …)
are accepted and ignored rather than refused, because clients send them routinely.
Responses are built as plain dicts in `blocks.py` and `messages.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

# -- content blocks ------------------------------------------------------------------------


class TextBlock(Struct, tag="text", kw_only=True):
    text: str
    #: A prompt-cache breakpoint; what it changes here is how `usage` counts (`usage.py`).
    cache_control: dict[str, Any] | None = None


class ImageBlock(Struct, tag="image", kw_only=True):
    """Accepted by the decoder only so that it can be refused with a clear message."""

    source: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class DocumentBlock(Struct, tag="document", kw_only=True):
    """Accepted by the decoder only so that it can be refused with a clear message."""

    source: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(Struct, tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Struct, tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(Struct, tag="thinking", kw_only=True):
    thinking: str
    #: Opaque to this server: thinking blocks are taken back as they are, unverified.
    signature: str | None = None


class RedactedThinkingBlock(Struct, tag="redacted_thinking", kw_only=True):
    data: str = ""


ContentBlock = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class Message(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


# -- tools ---------------------------------------------------------------------------------


class Tool(Struct, kw_only=True):
    name: str
    #: Required for a client tool; optional here only so that a server tool (which has a
    #: `type` and no schema) is refused by name rather than by a missing field.
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceAuto(Struct, tag="auto", kw_only=True):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Struct, tag="any", kw_only=True):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Struct, tag="tool", kw_only=True):
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Struct, tag="none", kw_only=True):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


# -- thinking ------------------------------------------------------------------------------


class ThinkingEnabled(Struct, tag="enabled", kw_only=True):
    #: Accepted, not enforced: the model thinks until it closes its think block.
    budget_tokens: int | None = None
    display: str | None = None


class ThinkingDisabled(Struct, tag="disabled", kw_only=True):
    pass


class ThinkingAdaptive(Struct, tag="adaptive", kw_only=True):
    display: str | None = None


class ThinkingBetweenTools(Struct, tag="between_tools", kw_only=True):
    pass


Thinking = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | ThinkingBetweenTools


# -- requests ------------------------------------------------------------------------------


class OutputConfig(Struct, kw_only=True):
    format: dict[str, Any] | None = None
    effort: str | None = None


class PromptFields(Struct, kw_only=True):
    """What decides the prompt: shared by `/v1/messages` and `/v1/messages/count_tokens`."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class CountTokensRequest(PromptFields, kw_only=True):
    pass


class MessagesRequest(PromptFields, kw_only=True):
    #: Required, as Anthropic requires it.
    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    #: Not in the official SDK's signature any more; clients send them via `extra_body`.
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    #: Only requests with the same salt share prefix-cache blocks (vLLM's field; see
    #: ninfer_core/serve/cache_salt.py).
    cache_salt: str | None = None
    #: Ours: return the request's speculative-decoding figures as `usage.spec_stats`.
    return_spec_stats: bool = False
    #: `format` (structured output) is refused until decoding can be constrained;
    #: `effort` and the rest are accepted and ignored.
    output_config: OutputConfig | None = None
    #: The structured-output beta's older spelling of `output_config.format`: refused too.
    output_format: dict[str, Any] | None = None
