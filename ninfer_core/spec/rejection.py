"""The acceptance rule of speculative decoding: which drafts the target keeps, and what follows.

Greedy rows keep the longest prefix of drafts equal to the target's argmax, then the
target's own token (`greedy_round`). Sampled rows use speculative rejection sampling
(Leviathan et al. 2023; Chen et al. 2023): a draft d drawn from q is kept with probability
min(1, p(d)/q(d)), and on rejection the token is drawn from the residual max(0, p - q),
normalised. The output distribution is then exactly the target's p: a token x is emitted
either as an accepted draft, with probability q(x) min(1, p(x)/q(x)) = min(p(x), q(x)), or
through a rejection, which happens with probability 1 - sum_y min(p(y), q(y)) =
sum_y max(0, p(y) - q(y)) and then picks x with probability max(0, p(x) - q(x)) over that
same sum; the two add up to min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x). Each later row is
the target's distribution given the tokens accepted before it, so a round emits a sequence
distributed as the target would have sampled it one token at a time; drafts only decide how
many tokens a forward yields. A seeded request stays reproducible for the same drafts, but
draws more numbers than without speculation (one uniform per acceptance test, plus the
residual or bonus draw): the same distribution, other samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer_core.sampling.sampler import draw


def greedy_round(target_ids: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a greedy round emits: 1..k+1 of them, k = len(drafts).

    target_ids: the target's argmax of rows 0..k (row i follows the pending token and
    drafts[:i]). Drafts are kept while they equal the target's choice; the first mismatch
    is replaced by the target's token (the correction), and when all k match, row k's token
    follows them (the bonus). Identical to decoding the target greedily one token at a time.
    """
    k = len(drafts)
    if len(target_ids) != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} target tokens, got {len(target_ids)}")
    out: list[int] = []
    for target, drafted in zip(target_ids, drafts, strict=False):
        out.append(int(target))
        if int(target) != int(drafted):
            return out
    out.append(int(target_ids[k]))
    return out


def _uniform(device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """One fp64 uniform in [0, 1) from `generator`, as a 0-d tensor on `device`."""
    return torch.rand((), dtype=torch.float64, device=device, generator=generator)


def accept_row(
    p: torch.Tensor,
    draft: int,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int, bool]:
    """Verify one draft against the target's row: (the emitted token, whether it is the draft).

    p: [V] fp32, the target's distribution at this position (one-hot for a greedy row);
    q: [V], the distribution the draft was drawn from, or None for a one-hot draft. Draws
    one fp64 uniform from `generator` for the acceptance test and, on rejection, one more
    for the residual (`draw`), so a seeded request's stream advances deterministically.
    """
    vocab = p.shape[-1]
    if p.dim() != 1 or (q is not None and q.shape != p.shape):
        raise ValueError(
            f"p must be [V] and q [V] or None, got {tuple(p.shape)} and "
            f"{None if q is None else tuple(q.shape)}"
        )
    if not 0 <= draft < vocab:
        raise ValueError(f"draft token {draft} is outside the vocabulary of {vocab}")
    # One host read for the numbers the test needs (one sync on CUDA, not three).
    picked = [p[draft].double(), _uniform(p.device, generator)]
    if q is not None:
        picked.append(q[draft].double())
    values = torch.stack(picked).tolist()
    p_d, u = values[0], values[1]
    # One-hot draft: q = 1 at the draft and 0 elsewhere, so min(1, p/q) is p[d].
    q_d = values[2] if q is not None else 1.0
    if not q_d > 0:
        # q says the draft could not have been drawn (rounding, a drafter's own filter), or
        # is NaN. Treat the draft as one-hot instead: that rule is exact for any draft in
        # hand, whatever chose it, so p is still what comes out.
        q, q_d = None, 1.0
    ratio = p_d / q_d
    # u < min(1, ratio) with u in [0, 1): a ratio >= 1 always accepts, 0 never does, so a
    # greedy row (p one-hot) keeps exactly its argmax.
    if u < ratio:
        return draft, True
    p64 = p.double()
    if q is None:
        # The one-hot residual max(0, p - q): p with the draft's entry zeroed.
        residual = p64.clone()
        residual[draft] = 0.0
    else:
        residual = (p64 - q.double()).clamp_min(0.0)
    # The residual is all zero when q >= p everywhere (p = q up to rounding, or a q that does
    # not sum to 1); then any rule is as exact as the inputs allow: draw from p itself.
    # (`where`, not a branch: no host sync on CUDA.)
    residual = torch.where(residual.sum() > 0, residual, p64)
    return int(draw(residual[None], generator)[0]), False


def speculative_round(
    p_rows: torch.Tensor,
    drafts: Sequence[int],
    q_rows: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens a sampled round emits: 1..k+1 of them, k = len(drafts).

    p_rows: [k+1, V] fp32, the target's distribution at each row; q_rows: [k, V] or None
    (one-hot drafts). Only for rows whose distributions do not depend on which earlier
    tokens were accepted (no penalties over the growing history); with penalties the
    engine calls `accept_row` row by row (`engine/speculation.py`). Stops at the first rejection,
    whose replacement is the last token; when every draft is kept, the bonus token is
    drawn from row k.
    """
    k = len(drafts)
    if p_rows.dim() != 2 or p_rows.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need [{k + 1}, V] p_rows, got {tuple(p_rows.shape)}")
    if q_rows is not None and tuple(q_rows.shape) != (k, p_rows.shape[1]):
        raise ValueError(f"q_rows must be [{k}, {p_rows.shape[1]}], got {tuple(q_rows.shape)}")
    out: list[int] = []
    for i, drafted in enumerate(drafts):
        q = None if q_rows is None else q_rows[i]
        token, accepted = accept_row(p_rows[i], int(drafted), q, generator)
        out.append(token)
        if not accepted:
            return out
    out.append(int(draw(p_rows[k : k + 1], generator)[0]))
    return out
