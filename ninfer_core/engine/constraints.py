"""Constrained decoding in the step: each constrained request's rows masked by its grammar.

Only rows of requests with a `constraint` pay (one mask of the vocabulary per token, see
`sampling/grammar.py`); a batch without one is untouched, not even copied. The mask comes
after the penalties (the sampler applies them to the masked logits; -inf stays -inf) and
before temperature and the filters, so greedy and sampled rows alike can only pick a token
the grammar allows. The request's stop tokens are allowed exactly when the grammar accepts
the answer so far; once nothing may follow (`stopped`), the request ends with "stop".

A speculative round's row i is masked by the grammar after the round's first i drafts: the
drafts are consumed to compute the rows' masks and rolled back, so a draft the grammar
refuses is masked out of its own row and rejected there, and the accepted tokens are then
consumed one by one as every token is (`advance`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ninfer_core.engine.request import InvalidRequestError, RequestState
from ninfer_core.sampling.grammar import GrammarCompiler, GrammarMatcher, bounded, mask_rows


class GrammarFailed(InvalidRequestError):
    """The request's grammar dead-ended while decoding (past llguidance's limits at some
    token, or no token left that it allows): the request's own fault, so it ends with a
    400-class error whose message is bounded, and nothing else is affected. Compiling
    already refuses what fails on the first token (`GrammarCompiler`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the request's grammar failed while decoding: {bounded(reason)}")


def matcher_of(live: RequestState, compiler: GrammarCompiler) -> GrammarMatcher | None:
    """The request's matcher, made on its first token (compiled grammars are cached, and the
    frontend compiled it already to refuse a bad one with a 400)."""
    if live.request.constraint is None:
        return None
    if live.grammar is None:
        live.grammar = compiler.matcher(live.request.constraint)
    return live.grammar


def allowed(matcher: GrammarMatcher, live: RequestState, vocab: int) -> np.ndarray:
    """[vocab] bool: the grammar's tokens, with the request's stop tokens allowed exactly
    when the answer may end here."""
    if matcher.error:  # past llguidance's limits, or a token it refused: end the request
        raise GrammarFailed(matcher.error)
    mask = matcher.allowed()
    stops = [t for t in live.stops.stop_token_ids if 0 <= t < vocab]
    if stops:
        mask[stops] = matcher.accepting
    return mask


def mask_grammar(
    logits: torch.Tensor, lives: Sequence[RequestState], compiler: GrammarCompiler | None
) -> torch.Tensor:
    """logits [B, V] with each constrained row masked by its grammar (no copy when none is)."""
    if compiler is None:
        return logits
    rows = []
    for i, live in enumerate(lives):
        matcher = matcher_of(live, compiler)
        if matcher is not None:
            rows.append((i, allowed(matcher, live, logits.shape[1])))
    return mask_rows(logits, rows)


def mask_round_grammar(
    rows: torch.Tensor, live: RequestState, drafts: Sequence[int], compiler: GrammarCompiler | None
) -> torch.Tensor:
    """A round's rows [k + 1, V]: row i masked by the grammar after drafts[:i]. Rows past
    the first draft the grammar refuses stay as they are: that draft is masked out of its
    row, so it is rejected and they are never read."""
    if compiler is None:
        return rows
    matcher = matcher_of(live, compiler)
    if matcher is None:
        return rows
    masks, consumed = [], 0
    try:
        for i in range(rows.shape[0]):
            row = allowed(matcher, live, rows.shape[1])
            masks.append((i, row))
            if i == len(drafts) or drafts[i] in live.stops.stop_token_ids:
                break
            if not bool(row[drafts[i]]) or not matcher.consume(drafts[i]):
                break  # refused here: never consumed, since a refusal is a lasting error
            consumed += 1
    finally:
        matcher.rollback(consumed)
    return mask_rows(rows, masks)


def advance(live: RequestState, token: int) -> bool:
    """Consume an accepted token; True when the grammar allows nothing after it (the answer
    is complete). A stop token is not consumed: it ends the request anyway."""
    matcher = live.grammar
    if matcher is None or token in live.stops.stop_token_ids:
        return False
    if not matcher.consume(token):
        raise GrammarFailed(f"token {token} is outside it: {matcher.error}")
    return matcher.stopped
