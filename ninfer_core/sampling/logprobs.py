"""Log probabilities of the tokens a request was given, for OpenAI's `logprobs`.

Which distribution: the model's, after the penalties (repetition, frequency, presence) and
before temperature, top-k, top-p, min-p and the `min_tokens` mask. vLLM v1 reports the raw
logits' distribution by default (`logprobs_mode="raw_logprobs"`, before penalties too) and
vLLM v0 the fully processed one (after temperature and the filters). We take the penalised
one because it is the distribution greedy decoding takes its argmax of: a greedy token is
then always the most likely entry of its own `top_logprobs`. Temperature and the filters stay
out, as in OpenAI's API, where the same text gets the same log probabilities whatever the
temperature, and a filter's -inf says nothing about the model. Without penalties (the usual
case) the figures are vLLM v1's defaults exactly.

Only rows that ask pay for it: the engine calls `token_logprobs` with those rows alone, and
the one log-softmax over the vocabulary per row happens here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Most alternatives a request may ask for per token (OpenAI's `top_logprobs` maximum).
MAX_TOP_LOGPROBS = 20
#: What an impossible token (-inf) is reported as: JSON has no -inf, and vLLM sends this.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One emitted token's log probability and the most likely tokens at its position."""

    token_id: int
    logprob: float
    #: (token id, log probability) of the k most likely tokens, most likely first.
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], top: Sequence[int]
) -> list[TokenLogprobs]:
    """logits: [R, V], the rows the tokens were chosen from (already penalised); row i gives
    `token_ids[i]` its log probability and its `top[i]` most likely alternatives.

    Computed in fp32 whatever the logits' dtype, with one host transfer for the batch.
    """
    if logits.dim() != 2 or not len(token_ids) == len(top) == logits.shape[0]:
        raise ValueError(
            f"{tuple(logits.shape)} logits for {len(token_ids)} tokens and {len(top)} top counts"
        )
    if not token_ids:
        return []
    logprobs = logits.float().log_softmax(dim=-1).clamp(min=LOGPROB_FLOOR)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    k = min(max(top), logprobs.shape[1])
    best_values: list[list[float]] = [[] for _ in token_ids]
    best_ids: list[list[int]] = [[] for _ in token_ids]
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)  # sorted, most likely first
        best_values, best_ids = values.tolist(), indices.tolist()
    return [
        TokenLogprobs(
            int(token),
            float(lp),
            tuple(zip(best_ids[i][: top[i]], best_values[i][: top[i]], strict=True)),
        )
        for i, (token, lp) in enumerate(zip(token_ids, chosen, strict=True))
    ]
