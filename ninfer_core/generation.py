"""One request from text to text on a loaded model: the path `ninfer generate` takes.

`Session` owns what one model needs to generate — tokenizer, chat template, KV store,
block manager, model runner and sampler — and runs one request at a time:
prefill the prompt, then decode token by token until a stop id, a stop string or
the token limit. The engine (continuous batching) drives the same runner.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.config import RuntimeConfig
from ninfer_core.device import DeviceInfo
from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.model_runner import ModelRunner
from ninfer_core.engine.sequence import Sequence as Seq
from ninfer_core.errors import NInferError
from ninfer_core.kv import kv_codec_name
from ninfer_core.kv.layout import KVLayout
from ninfer_core.loading import LoadedModel
from ninfer_core.plugin_host import PluginHost
from ninfer_core.sampling import Sampler, SamplingParams, SequenceTokens
from ninfer_core.selection import choose
from ninfer_core.text import (
    ChatTemplate,
    GenerationDefaults,
    IncrementalDetokenizer,
    StopChecker,
    Tokenizer,
    stop_token_ids,
)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, over the time spent producing them."""
        n = self.completion_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds else 0.0


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    stop: Sequence[str] = ()
    #: Stop token ids on top of the model's own (generation_config / eos).
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False


class Session:
    """A loaded model ready to generate, one request at a time."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        host: PluginHost,
        device: DeviceInfo,
        runtime: RuntimeConfig,
        seed: int | None = None,
    ) -> None:
        self.loaded = loaded
        artifact = loaded.artifact
        self.tokenizer = Tokenizer.from_artifact(artifact)
        self.template = ChatTemplate.from_artifact(artifact, self.tokenizer.special_tokens)
        self.defaults = GenerationDefaults.from_artifact(artifact)
        self.model_stop_ids = stop_token_ids(
            self.defaults, artifact.config, self.tokenizer.eos_token_id
        )
        cfg = loaded.config
        kv_name = kv_codec_name(runtime.kv_dtype, loaded.dtype)
        self.kv_codec = choose(host, "kv_codecs", device, kv_name).chosen
        self.max_context = min(runtime.max_context, cfg.max_position_embeddings)
        num_blocks = math.ceil(self.max_context / runtime.block_size)
        layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, runtime.block_size,
                          num_blocks)  # fmt: skip
        codec = host.kv_codecs.get(self.kv_codec)
        store = codec.allocate(layout, device.torch_device, compute_dtype=loaded.dtype)
        self.block_manager = BlockManager(num_blocks, runtime.block_size)
        self.runner = ModelRunner(loaded.model, store, self.block_manager)
        self.sampler = Sampler(seed)
        self.prefill_chunk = 2048

    # -- text in -------------------------------------------------------------------
    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None, **kw: Any
    ) -> list[int]:
        """Token ids of a conversation through the model's chat template."""
        if self.template is None:
            raise NInferError(f"{self.loaded.path}: the model has no chat template; use --raw")
        text = self.template.render(messages, tools=tools, add_generation_prompt=True, **kw)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """The model's generation_config defaults, with the request's own values on top."""
        values = self.defaults.sampling_values()
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**values)

    # -- generation ----------------------------------------------------------------
    def generate(self, request: Request, stats: GenerationStats | None = None) -> Iterator[str]:
        """Yield text deltas; `stats` (if given) is filled in as generation goes."""
        stats = stats if stats is not None else GenerationStats()
        prompt = list(request.prompt_ids)
        if not prompt:
            raise NInferError("the prompt is empty")
        budget = self.max_context - len(prompt)
        if budget <= 0:
            raise NInferError(
                f"the prompt has {len(prompt)} tokens; the context holds {self.max_context}"
            )
        max_new = min(request.max_new_tokens, budget)
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= set(self.model_stop_ids)
        stops = StopChecker(stop_token_ids=stop_ids, stop_strings=list(request.stop))
        detok = IncrementalDetokenizer(self.tokenizer, context_ids=prompt[-8:])
        history = SequenceTokens(prompt)
        seq = Seq(prompt)
        stats.prompt_tokens = len(prompt)
        try:
            start = time.perf_counter()
            while seq.num_pending_tokens > 1:  # prefill all but the last prompt token in chunks
                self.runner.run([(seq, min(self.prefill_chunk, seq.num_pending_tokens - 1))])
            logits = self.runner.run([(seq, 1)])
            stats.prefill_seconds = time.perf_counter() - start
            decode_start = time.perf_counter()
            for step in range(max_new):
                if step:
                    logits = self.runner.run([(seq, 1)])
                token = int(self.sampler.sample(logits, [request.params], [history])[0])
                history.append(token)
                seq.append_token(token)
                stats.completion_tokens += 1
                update = stops.feed(detok.feed(token), token)
                if update.text:
                    yield update.text
                if update.finished:
                    stats.finish_reason = "stop"
                    break
            else:
                stats.finish_reason = "length"
                tail = stops.feed(detok.finish()).text + stops.flush()
                if tail:
                    yield tail
            stats.decode_seconds = time.perf_counter() - decode_start
        finally:
            self.block_manager.free(seq)
