"""What some requests ask of a step beyond a sampled token: `min_tokens` and `logprobs`.

Both are per request and cost nothing for a batch whose requests ask for neither: the mask
copies the logits only when a row is still below its `min_tokens`, and the log-softmax over
the vocabulary runs only over the rows of requests that set `logprobs`.

Speculative rounds get the same figures as decoding one token at a time: row i of a round
is the distribution of the round's i-th token, masked as a step would mask it after i more
tokens, and its log probabilities are penalised over the history at the moment the token is
accepted, which is the history a step without speculation samples it with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ninfer_core.engine.request import RequestState
from ninfer_core.sampling import Sampler, TokenLogprobs, token_logprobs

_NEG_INF = float("-inf")


def _stop_columns(live: RequestState, device: torch.device) -> torch.Tensor:
    ids = sorted(live.stops.stop_token_ids)
    return torch.tensor(ids, dtype=torch.long, device=device)


def mask_min_tokens(logits: torch.Tensor, lives: Sequence[RequestState]) -> torch.Tensor:
    """logits [B, V] with every stop token of row i made impossible while request i is below
    its `min_tokens`; the same tensor when no row is (no copy)."""
    rows = [
        i for i, live in enumerate(lives) if live.below_min_tokens and live.stops.stop_token_ids
    ]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        columns = _stop_columns(lives[i], logits.device)
        logits[i, columns[columns < vocab]] = _NEG_INF
    return logits


def mask_round(rows: torch.Tensor, live: RequestState) -> torch.Tensor:
    """A speculative round's rows [k + 1, V]: row i decides the token after i more, so it is
    masked while the completion plus i is below `min_tokens` (no copy when none is)."""
    below = live.request.min_tokens - len(live.seq.completion_ids)
    if below <= 0 or not live.stops.stop_token_ids:
        return rows
    rows = rows.clone()
    columns = _stop_columns(live, rows.device)
    rows[: min(below, rows.shape[0]), columns[columns < rows.shape[1]]] = _NEG_INF
    return rows


def batch_logprobs(
    logits: torch.Tensor, lives: Sequence[RequestState], tokens: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Each token's log probabilities for the requests that ask (None for the others, and
    for rows whose token is None); `logits` unmasked, as the model and penalties left them."""
    asking = [
        i
        for i, (live, token) in enumerate(zip(lives, tokens, strict=True))
        if live.request.logprobs is not None and token is not None
    ]
    out: list[TokenLogprobs | None] = [None] * len(lives)
    if not asking:
        return out
    index = torch.tensor(asking, dtype=torch.long, device=logits.device)
    picked = [lives[i] for i in asking]
    rows = Sampler.penalised(
        logits.index_select(0, index),
        [live.request.params for live in picked],
        [live.history for live in picked],
    )
    found = token_logprobs(
        rows, [int(tokens[i]) for i in asking], [live.request.logprobs for live in picked]
    )
    for i, item in zip(asking, found, strict=True):
        out[i] = item
    return out


def round_acceptor(
    live: RequestState,
    rows: torch.Tensor,
    accept: Callable[[int, TokenLogprobs | None], bool],
) -> Callable[[int], bool]:
    """`verify`'s `accept` for one round: the i-th call hands on the i-th token with its
    log probabilities from row i (when the request asks), penalised over the history as it
    stands then, before the token joins it."""
    k = live.request.logprobs
    if k is None:
        return lambda token: accept(token, None)
    position = 0

    def accept_with_logprobs(token: int) -> bool:
        nonlocal position
        row = Sampler.penalised(
            rows[position : position + 1], [live.request.params], [live.history]
        )
        position += 1
        return accept(token, token_logprobs(row, [token], [k])[0])

    return accept_with_logprobs
