"""Embeddings: a prompt's final hidden states pooled into one vector (`/v1/embeddings`).

An embedding request (`GenerationRequest.pooling` set) is a prompt with no completion: it
waits in the same queue, is admitted by the same rule (its prompt's pages, no `max_tokens`)
and prefills in the same steps as everything else, chunked like any prompt. The runner hands
back every token's final hidden state, after the model's final norm (what transformers calls
`last_hidden_state`), for the steps that run such a prompt; the engine folds each chunk's rows
into the request's `Pooler`, and when the prompt is done the request ends with the vector on
its `FinishEvent` instead of sampling a token. No second forward path exists for it.

Pooling, for decoder-only models (none has a separate embedding head here):

- `last` (the default): the last token's hidden state. It is what decoder embedding models
  such as Qwen3-Embedding are trained for (their sentence-transformers config pools the last
  token), what vLLM's pooling runner uses by default for a decoder (`PoolingType.LAST`), and
  what llama.cpp reads from such a GGUF (`pooling_type` last).
- `mean`: the mean over every input token (BOS included when the tokenizer adds one), as
  llama.cpp's `--pooling mean` and sentence-transformers' mean pooling do.

The vector is then L2-normalised, as vLLM (`normalize=True`) and llama.cpp
(`--embd-normalize 2`, its default) do, unless the request says otherwise.

Every token's hidden state must be computed for `mean`, so an embedding request never
resumes from the prefix cache (a cached block's tokens would never run); its full blocks are
still indexed for later prompts.
"""

from __future__ import annotations

from typing import Literal

import torch

Pooling = Literal["mean", "last"]
POOLINGS: tuple[str, ...] = ("mean", "last")


class Pooler:
    """One request's pooled state, fed chunk by chunk as its prompt prefills."""

    def __init__(self, kind: Pooling, normalize: bool = True) -> None:
        if kind not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {kind!r}")
        self.kind, self.normalize = kind, normalize
        self._sum: torch.Tensor | None = None
        self._last: torch.Tensor | None = None
        self._count = 0

    def feed(self, rows: torch.Tensor) -> None:
        """rows: [n, hidden], the final hidden states of the prompt's next `n` tokens."""
        if not rows.shape[0]:
            return
        if self.kind == "mean":
            part = rows.float().sum(dim=0)
            self._sum = part if self._sum is None else self._sum + part
        self._last = rows[-1].float().clone()  # the step's buffer may be reused
        self._count += rows.shape[0]

    def result(self) -> torch.Tensor:
        """The embedding, fp32 on the CPU: [hidden]."""
        if self._last is None:
            raise ValueError("no hidden state was pooled")
        vector = self._sum / self._count if self.kind == "mean" else self._last
        if self.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.cpu()
