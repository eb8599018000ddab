"""The Responses API's wire types as msgspec Structs: the request litestar validates, and the
response object and output items this server sends.

Input items are one lenient Struct rather than a tagged union: OpenAI's "easy" input message
carries no `type`, and a union needs its tag. `convert.py` checks each item against its
kind and answers a 400 naming the field. Unknown fields are ignored, as OpenAI-compatible
servers do (`include`, `service_tier`, `prompt_cache_key`, ...).
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct, field

from ninfer_plugins.frontend_openai.wire import JsonSchemaFormat

# -- requests ------------------------------------------------------------------------------


class Part(Struct):
    """A content part: `input_text`, `output_text` (a message), `reasoning_text` /
    `summary_text` (a reasoning item); others are refused where they appear."""

    type: str
    text: str | None = None


class InputItem(Struct, kw_only=True, omit_defaults=True):
    """One input item: a message (the default when `type` is absent), `function_call`,
    `function_call_output` or `reasoning`. Output items fed back as input fit it too."""

    type: str = "message"
    role: str | None = None
    content: str | list[Part] | None = None
    id: str | None = None
    status: str | None = None
    #: function_call / function_call_output
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None
    #: reasoning
    summary: list[Part] | None = None


class ToolDef(Struct, kw_only=True):
    """A tool; only `function` tools are served (flat, unlike chat's nested `function`)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(Struct, kw_only=True):
    type: str
    name: str | None = None


class ReasoningConfig(Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class TextFormat(JsonSchemaFormat, kw_only=True):
    """`text.format`: chat's `response_format.json_schema` object (`name`, `description`,
    `schema`, `strict`) flattened beside its `type`."""

    #: "text", "json_object" or "json_schema" (with the schema's fields).
    type: str = "text"


class TextConfig(Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(Struct, kw_only=True):
    #: Optional, as the other endpoints take it: none means the served model.
    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    #: Extra output to include; only `message.output_text.logprobs` is looked at.
    include: list[str] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # Extensions the chat endpoint takes too (vLLM's names).
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# -- responses -----------------------------------------------------------------------------


class OutputText(Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(Struct, tag="reasoning_text", tag_field="type"):
    text: str


Status = Literal["in_progress", "completed", "incomplete"]


class MessageItem(Struct, tag="message", tag_field="type"):
    id: str
    status: Status
    content: list[OutputText]
    role: str = "assistant"


class ReasoningItem(Struct, tag="reasoning", tag_field="type"):
    id: str
    status: Status
    content: list[ReasoningText]
    summary: list[Any] = []


class FunctionCallItem(Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(Struct):
    cached_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(Struct):
    reason: str


class ResponseError(Struct):
    code: str
    message: str


class ReasoningOut(Struct):
    effort: str | None = None
    summary: str | None = None


class TextOut(Struct):
    format: dict[str, Any]


class ResponseObject(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    completed_at: int | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningOut = field(default_factory=ReasoningOut)
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: TextOut = field(default_factory=lambda: TextOut({"type": "text"}))
    tool_choice: Any = "auto"
    tools: list[Any] = []
    truncation: str = "disabled"
    user: str | None = None
    background: bool = False
    object: str = "response"


class DeletedResponse(Struct):
    id: str
    deleted: bool = True
    object: str = "response"
