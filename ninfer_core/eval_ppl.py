"""Perplexity of a model on a text file, computed by NInfer's own runner.

The text is tokenized as is (special tokens written in it, such as `<|im_start|>` in a
chat transcript, become their ids) and cut into non-overlapping windows of `context`
tokens; each window is one prefill and scores every token after its first. Windows do
not carry context over, so the figure depends on `context` and is comparable only at
the same window length (the usual fixed-window perplexity, as in llama.cpp's
`perplexity` with its default of non-overlapping chunks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from ninfer_core.config import RuntimeConfig
from ninfer_core.errors import NInferError
from ninfer_core.loading import LoadedModel, load_model

if TYPE_CHECKING:
    from ninfer_core.device import DeviceInfo
    from ninfer_core.engine.runtime import Runtime
    from ninfer_core.plugin_host import PluginHost


@dataclass(frozen=True)
class Perplexity:
    """Summed negative log-likelihood over `tokens` scored tokens."""

    tokens: int
    nll: float
    windows: int
    context: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def bits_per_token(self) -> float:
        return self.nll / self.tokens / math.log(2)


def scoring_runtime(
    loaded: LoadedModel,
    tokens: int,
    *,
    host: PluginHost | None = None,
    device: DeviceInfo | None = None,
) -> Runtime:
    """A throwaway runtime for `loaded` with fp32 KV (no codec error in the score) for
    windows of up to `tokens` tokens; `host` and `device` default to fresh ones."""
    from ninfer_core.device import probe_device
    from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
    from ninfer_core.plugin_host import create_host

    host = host if host is not None else create_host()
    if device is None:
        device = probe_device(use_cuda=loaded.ops.device.type == "cuda")
    spec = RuntimeSpec.for_tokens(tokens + 1, kv_dtype="fp32")
    return build_runtime(loaded, host, device, spec)


def sequence_logits(
    loaded: LoadedModel, ids: list[int], runtime: Runtime | None = None
) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] at every position: one prefill through the runner,
    into `runtime`'s KV (a `scoring_runtime` just large enough for `ids` when None)."""
    from ninfer_core.engine.sequence import Sequence

    runtime = runtime if runtime is not None else scoring_runtime(loaded, len(ids))
    seq = Sequence(ids)
    states = runtime.states  # a model with state layers: the window starts from zero
    if states is not None:
        seq.state_slot = states.allocate()
    try:
        return runtime.runner.run([(seq, len(ids))], all_tokens=True)
    finally:
        runtime.block_manager.free(seq)
        if states is not None:
            states.free(seq.state_slot)


def eval_ppl(
    loaded: LoadedModel,
    ids: list[int],
    *,
    context: int = 512,
    host: PluginHost | None = None,
    device: DeviceInfo | None = None,
) -> Perplexity:
    """Perplexity of `ids` in windows of `context` tokens, all through one runtime."""
    if context < 2:
        raise NInferError(f"--context must be at least 2 tokens, got {context}")
    runtime = scoring_runtime(loaded, min(context, len(ids)), host=host, device=device)
    nll, scored, windows = 0.0, 0, 0
    for start in range(0, len(ids), context):
        window = ids[start : start + context]
        if len(window) < 2:
            break
        logits = sequence_logits(loaded, window, runtime)[:-1]
        target = torch.tensor(window[1:], device=logits.device)
        nll += float(F.cross_entropy(logits.double(), target, reduction="sum"))
        scored += len(window) - 1
        windows += 1
    if not scored:
        raise NInferError("the text is shorter than two tokens; nothing to score")
    return Perplexity(tokens=scored, nll=nll, windows=windows, context=context)


def eval_ppl_file(
    model: str | Path,
    text_file: str | Path,
    *,
    context: int = 512,
    max_tokens: int | None = None,
    runtime: RuntimeConfig | None = None,
) -> Perplexity:
    """Load `model` (an HF folder or `.ninfer` file) and score `text_file` with it."""
    from ninfer_core.device import probe_device
    from ninfer_core.plugin_host import create_host
    from ninfer_core.text.tokenizer import Tokenizer

    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NInferError(f"{text_file}: cannot read text: {exc}") from None
    runtime = runtime or RuntimeConfig()
    host, device = create_host(), probe_device()
    loaded = load_model(model, host=host, device=device, runtime=runtime)
    ids = Tokenizer.from_artifact(loaded.artifact).encode(text, add_special_tokens=False)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return eval_ppl(loaded, ids, context=context, host=host, device=device)
