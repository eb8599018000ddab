"""OpenAI's wire types as msgspec Structs: what litestar validates bodies against and what the
OpenAPI schema describes.

Unknown fields are ignored, as OpenAI-compatible servers do (clients send `user`, `store`,
`metadata`, ...). Fields this server cannot honour are declared, so that a request relying on
them is refused with a message instead of being silently served differently (see
`common.refuse_unsupported`). `top_k`, `min_p`, `repetition_penalty`, `ignore_eos` and
`chat_template_kwargs`, `min_tokens`, `return_token_ids`, `continue_final_message`,
`add_generation_prompt` and `structured_outputs` are the extensions vLLM made common;
`return_spec_stats` is ours.

Extension fields of a response (`spec_stats`) are `UNSET` unless asked for, and msgspec
leaves an `UNSET` field out: a response nobody asked extras of is the plain OpenAI shape.
The exception is a whole chat answer's `token_ids` and `prompt_token_ids`, null when not
asked, as vLLM sends them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

# -- requests ------------------------------------------------------------------------------


class ContentPart(Struct):
    """One part of a message's content; only `text` parts are understood."""

    type: str
    text: str | None = None


class FunctionCall(Struct):
    name: str
    #: A JSON object, as text.
    arguments: str = "{}"


class ToolCallIn(Struct):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    #: The reasoning of an earlier assistant turn, as this server returned it.
    reasoning_content: str | None = None


class FunctionDef(Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct):
    function: NamedFunction
    type: Literal["function"] = "function"


class StreamOptions(Struct):
    include_usage: bool = False


class JsonSchemaFormat(Struct, kw_only=True):
    """`response_format.json_schema`: the schema the answer must match."""

    name: str | None = None
    description: str | None = None
    #: `schema` on the wire; `schema_` here, not to shadow anything a Struct may define.
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    #: "text", "json_object" or "json_schema".
    type: str
    json_schema: JsonSchemaFormat | None = None
    #: llama.cpp's spelling: `{"type": "json_object", "schema": {...}}`.
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")


class StructuredOutputs(Struct, kw_only=True):
    """vLLM's `structured_outputs`: at most one of these constrains the answer. Its other
    fields (`structural_tag`, `whitespace_pattern`, `disable_*`) are ignored."""

    #: A JSON schema, as an object or as JSON text.
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    #: GBNF (or Lark) grammar text.
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(Struct, kw_only=True):
    """What chat and completions requests share."""

    #: Optional, as vLLM and llama.cpp take it: none means the served model.
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    #: Only requests with the same salt share prefix-cache blocks (vLLM's field; see
    #: ninfer_core/serve/cache_salt.py).
    cache_salt: str | None = None
    #: Return the request's speculative-decoding figures (`spec_stats`) with its usage.
    return_spec_stats: bool = False
    #: vLLM's: no stop token, stop string or EOS ends the answer before this many tokens.
    min_tokens: int | None = None
    #: vLLM's: the prompt's token ids and each choice's generated ids with the answer.
    return_token_ids: bool = False
    #: llama.cpp's: the answer is JSON matching this schema.
    json_schema: dict[str, Any] | None = None
    #: vLLM's: admission order, lower first (before API keys' turns and arrival).
    priority: int = 0
    #: llama.cpp's: the answer matches this GBNF grammar.
    grammar: str | None = None
    #: vLLM's: a schema, regex, choice or grammar the answer must match.
    structured_outputs: StructuredOutputs | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's: end the prompt with the assistant's turn opened (None: yes, unless
    #: `continue_final_message`).
    add_generation_prompt: bool | None = None
    #: vLLM's: the final (assistant) message is left open and the answer continues it.
    continue_final_message: bool = False


class CompletionRequest(SamplingFields, kw_only=True):
    #: Text, token ids, or a list of one of either (msgspec takes one array-like per union).
    prompt: str | list[str | int | list[int]]
    #: As chat's (vLLM takes it on completions too): JSON, or JSON matching a schema.
    response_format: ResponseFormat | None = None
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None


# -- responses -----------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class SpecStats(Struct):
    """One request's speculative rounds (`SpecUsage.to_json()`), for `return_spec_stats`."""

    #: Rounds that verified at least one draft.
    rounds: int
    #: Drafts verified, and how many of them the model accepted.
    draft_tokens: int
    accepted_tokens: int
    #: accepted_tokens / draft_tokens (0 without drafts).
    acceptance_rate: float
    #: Tokens a verifying forward yielded on average: 1 + accepted_tokens / rounds.
    tokens_per_round: float


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    #: Only with `return_spec_stats` on an engine that speculates.
    spec_stats: SpecStats | UnsetType = UNSET


class FunctionCallOut(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    """Chat's per-choice `logprobs` (`logprobs: true`)."""

    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(Struct):
    """The legacy completions `logprobs` (`logprobs: k`), one entry per token in each list."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None
    #: With `return_token_ids`: the ids generated; else null, present as in vLLM, so a
    #: client reading `choice.token_ids` gets None rather than a missing attribute.
    token_ids: list[int] | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None
    #: With `return_token_ids`: the rendered prompt's ids; else null (as `token_ids`).
    prompt_token_ids: list[int] | None = None


class ToolCallDelta(Struct):
    index: int
    id: str
    function: FunctionCallOut
    type: str = "function"


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    #: With `return_token_ids`: the ids behind this chunk.
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    #: On the finish chunk, with `return_spec_stats` but no usage chunk to carry it.
    spec_stats: SpecStats | UnsetType = UNSET
    #: With `return_token_ids`, on the first chunk: the rendered prompt's ids.
    prompt_token_ids: list[int] | UnsetType = UNSET


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    #: With `return_token_ids` (as vLLM places them): the prompt's ids (whole answer, first
    #: chunk) and the ids generated (whole answer, or this chunk's).
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    #: On the finish chunk, with `return_spec_stats` but no usage chunk to carry it.
    spec_stats: SpecStats | UnsetType = UNSET


class Model(Struct):
    id: str
    created: int
    owned_by: str = "ninfer"
    max_model_len: int | None = None
    object: str = "model"


class ModelList(Struct):
    data: list[Model]
    object: str = "list"


def encode(value: Struct) -> str:
    return msgspec.json.encode(value).decode()
