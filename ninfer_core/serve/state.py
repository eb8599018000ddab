"""`ServeState`: what every frontend needs from the running model, and nothing protocol-shaped.

Frontends turn a protocol request into chat messages + options, call `render` for the
prompt ids and `generate` for the event stream, and turn events back into their own
wire format. Tensors never reach this layer.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import EngineError, GenerationEvent, GenerationRequest
from ninfer_core.kernels.compose import OpChoice  # at run time: litestar reads the fields
from ninfer_core.sampling import SamplingParams
from ninfer_core.serve.errors import ApiError, from_engine_error, invalid
from ninfer_core.text import ChatTemplate, ChatTemplateError, GenerationDefaults, Tokenizer
from ninfer_core.text.generation_config import SAMPLING_FIELDS
from ninfer_core.text.tokenizer import TooManyTokensError

#: The longest prompt token counting counts (`render(whole=True)`): past the context, so an
#: agent learns how far over it is, and bounded, as a million tokens is the largest context
#: a client could mean (about 4 MB of text, a second or two of work).
MAX_COUNTED_TOKENS = 1_000_000


@dataclass
class ServeOptions:
    """Per-server settings the frontends apply to every request."""

    model_id: str
    default_max_tokens: int = 1024
    #: Other names a request may send as `model` ("*": any); answers name `model_id`.
    #: Clients written for llama.cpp, which ignores `model`, often send a fixed one.
    model_aliases: tuple[str, ...] = ()
    #: Sampling values used when a request gives none (None: the model's own defaults).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    #: How `/v1/embeddings` pools the final hidden states: "last" or "mean"
    #: (`engine/pooling.py`).
    pooling: str = "last"
    #: Tokens one `/v1/embeddings` call may send, its inputs together.
    max_embedding_tokens: int = 300_000

    def serves(self, model: str) -> bool:
        """Whether a request naming `model` is for the served model."""
        return model == self.model_id or model in self.model_aliases or "*" in self.model_aliases


@dataclass
class ServeState:
    engine: Engine
    tokenizer: Tokenizer
    template: ChatTemplate | None
    defaults: GenerationDefaults
    options: ServeOptions
    created: int = field(default_factory=lambda: int(time.time()))
    #: Which kernel backend serves each op (`LoadedModel.kernels`), for `/health`.
    kernels: list[OpChoice] = field(default_factory=list)

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        whole: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Prompt ids for a conversation, through the model's chat template. With
        `continue_final_message` (and no generation prompt) the last message is left open
        and the answer continues it: an assistant prefill. With `whole`, a prompt longer
        than the context is counted all the same (token counting), up to
        `MAX_COUNTED_TOKENS`, where a prompt to run is refused past the context."""
        if self.template is None:
            raise invalid("this model has no chat template; use the completions endpoint")
        try:
            text = self.template.render(
                messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **template_kwargs,
            )
        except ChatTemplateError as exc:
            raise invalid(f"the chat template rejected the conversation: {exc}") from None
        return self.encode_prompt(text, add_special_tokens=False, counting=whole)

    def encode_prompt(
        self,
        text: str,
        *,
        add_special_tokens: bool,
        param: str = "messages",
        counting: bool = False,
    ) -> list[int]:
        """A prompt's ids, refused (400, naming `param`) once they cannot fit the context
        (`counting`: past `MAX_COUNTED_TOKENS`): a huge text is counted in pieces and given
        up early, never tokenized in full. Slow for a long text: frontends call it (and
        `render`) in a worker thread."""
        limit = MAX_COUNTED_TOKENS if counting else self.max_context
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, limit=limit)
        except TooManyTokensError as exc:
            why = (
                f"more than {limit:,} tokens, the most this server counts"
                if counting
                else f"at least {exc.at_least} tokens; this model's context is {limit} tokens"
            )
            raise ApiError(
                400, "context_length_exceeded", f"the prompt has {why}", param=param
            ) from None

    def sampling(self, **given: Any) -> SamplingParams:
        """The request's values over the server's defaults over the model's; 400 if invalid."""
        values = self.defaults.sampling_values()
        for name in SAMPLING_FIELDS:
            if getattr(self.options, name) is not None:
                values[name] = getattr(self.options, name)
        values.update({k: v for k, v in given.items() if v is not None})
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            param = str(exc).split(" ", 1)[0]
            raise invalid(str(exc), param=param) from None

    def max_tokens(
        self, requested: int | None, prompt_len: int, *, prompt_param: str = "messages"
    ) -> int:
        """New-token budget: the request's, else the server default, within the context.
        A prompt that fills the context is a 400 naming `prompt_param` (the field that
        carried it: `messages`, `prompt`)."""
        room = self.max_context - prompt_len
        if room <= 0:
            raise ApiError(
                400,
                "context_length_exceeded",
                f"the prompt has {prompt_len} tokens; this model's context is "
                f"{self.max_context} tokens",
                param=prompt_param,
            )
        if requested is None:
            return min(self.options.default_max_tokens, room)
        if requested < 1:
            raise invalid(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
        if requested > room:
            raise ApiError(
                400,
                "context_length_exceeded",
                f"max_tokens={requested} plus the prompt's {prompt_len} tokens exceeds this "
                f"model's context of {self.max_context} tokens",
                param="max_tokens",
            )
        return requested

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """The request's events; engine refusals surface as `ApiError`s.

        Leaving the loop early (the client disconnected, the stream was closed)
        cancels the request in the engine, so its pages free within one step.
        """
        try:
            stream = self.engine.submit(request)
        except EngineError as exc:
            raise from_engine_error(exc) from None
        try:
            async for event in stream:
                yield event
        except EngineError as exc:
            raise from_engine_error(exc) from None
        finally:
            await stream.aclose()
