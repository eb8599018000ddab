"""One request through the engine, in this thread: what `ninfer generate` and the decode
benches run.

There is one decode loop, `Engine.step`; the server drives it from its thread, this module
from the caller's. `one_request_engine` sizes an engine for a single request, `PromptText`
turns a prompt or a conversation into ids the way the server's frontends do (the chat
template, then the tokenizer without special tokens; a raw prompt with them), and `stream`
adds the request, steps the engine and yields each step's text as it comes, timing the first
and the last token. So `ninfer generate`, `Engine.generate` and the server give the same
greedy tokens for the same request, and the figures a bench prints are the engine's own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.config import RuntimeConfig
from ninfer_core.device import DeviceInfo
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import (
    FinishEvent,
    GenerationEvent,
    GenerationRequest,
    RequestTooLargeError,
    TokenEvent,
)
from ninfer_core.errors import NInferError
from ninfer_core.loading import LoadedModel
from ninfer_core.plugin_host import PluginHost
from ninfer_core.sampling import SamplingParams
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.stats import SpecUsage
from ninfer_core.text import ChatTemplate, GenerationDefaults, Tokenizer


@dataclass
class GenerationStats:
    """One request's figures, timed at its events: prefill is submission to the first
    token, decode the first token to the last."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""
    #: The sampled ids, in order (the benches compare them across engines).
    token_ids: list[int] = field(default_factory=list, repr=False)
    #: Its speculative rounds, when the engine speculates.
    spec: SpecUsage | None = None

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, over the time spent producing them."""
        n = self.completion_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds else 0.0


def one_request_engine(
    loaded: LoadedModel,
    *,
    host: PluginHost,
    device: DeviceInfo,
    runtime: RuntimeConfig,
    seed: int | None = None,
    spec: SpecConfig | None = None,
) -> Engine:
    """An engine for one request at a time, its KV pool one context long (as the server's
    default pool) and otherwise configured as the server's defaults, so the same request
    takes the same steps. No prefix cache: nothing is shared within a single request."""
    context = min(runtime.max_context, loaded.config.max_position_embeddings)
    config = EngineConfig(max_concurrency=1, max_context=context,
                          block_size=runtime.block_size, prefix_cache=False)  # fmt: skip
    return Engine(loaded, config, host=host, device=device, kv_dtype=runtime.kv_dtype,
                  compile_decode=runtime.compile_decode, spec=spec, seed=seed)  # fmt: skip


def room_for(engine: Engine, prompt_len: int, wanted: int) -> int:
    """`wanted` new tokens, cut to what the context has left after the prompt."""
    room = engine.max_context - prompt_len
    if room <= 0:
        raise RequestTooLargeError(
            f"the prompt has {prompt_len} tokens; the context holds {engine.max_context}"
        )
    return min(wanted, room)


def stream(
    engine: Engine, request: GenerationRequest, stats: GenerationStats | None = None
) -> Iterator[str]:
    """Yield `request`'s text step by step while stepping `engine` (whose thread must not
    be running); `stats` (if given) fills in as it goes. A request that ends in an error
    raises it; leaving early cancels the request, so its pages go back."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(request.prompt_ids)
    texts: list[str] = []
    finish: list[FinishEvent] = []
    start = first = time.perf_counter()

    def sink(event: GenerationEvent) -> None:
        nonlocal first
        if isinstance(event, TokenEvent):
            now = time.perf_counter()
            if not stats.token_ids:
                first = now
                stats.prefill_seconds = now - start
            stats.token_ids.extend(event.token_ids)
            stats.completion_tokens = len(stats.token_ids)
            stats.decode_seconds = now - first
            if event.text:
                texts.append(event.text)
        elif isinstance(event, FinishEvent):
            finish.append(event)

    engine.add(request, sink)
    try:
        while not finish and engine.has_work:
            engine.step()
            if texts:
                yield "".join(texts)
                texts.clear()
    finally:
        if not finish:  # closed early (or a step raised): end it, free its pages
            engine.cancel(request.request_id)
            while not finish and engine.has_work:
                engine.step()
    if finish and finish[0].error is not None:
        raise finish[0].error
    stats.finish_reason = finish[0].reason if finish else ""
    stats.spec = finish[0].usage.spec if finish else None


@dataclass(frozen=True)
class PromptText:
    """A model's text side for one-shot prompts: tokenizer, chat template, sampling defaults."""

    tokenizer: Tokenizer
    template: ChatTemplate | None
    defaults: GenerationDefaults
    path: str = ""

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, tokenizer: Tokenizer) -> PromptText:
        artifact = loaded.artifact
        template = ChatTemplate.from_artifact(artifact, tokenizer.special_tokens)
        return cls(
            tokenizer, template, GenerationDefaults.from_artifact(artifact), str(loaded.path)
        )

    def chat_ids(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> list[int]:
        """Token ids of a conversation through the model's chat template, as the server's
        chat route renders it."""
        if self.template is None:
            raise NInferError(f"{self.path}: the model has no chat template; use --raw")
        text = self.template.render(messages, tools=tools or None, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def raw_ids(self, text: str) -> list[int]:
        """A prompt sent as is, with the tokenizer's special tokens (the completions route)."""
        return self.tokenizer.encode(text, add_special_tokens=True)

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """The model's generation_config defaults, with the request's own values on top."""
        values = self.defaults.sampling_values()
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**values)
