"""The acceptance rule of speculative decoding against exact arithmetic.

Speculation must not change what the target samples: the emitted tokens' distribution is
compared with the target's p by a chi-square test at a fixed seed (so each test is
deterministic), with enough trials that a wrong residual or acceptance test fails by a
wide margin (each test also checks that the statistic would reject the wrong answer).
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.spec.rejection import accept_row, greedy_round, speculative_round

#: Upper 0.1% points of the chi-square distribution by degrees of freedom (scipy is not a
#: dependency): a correct rule fails a test here once in a thousand seeds.
CHI2_CRITICAL_0_001 = {
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
}

TRIALS = 12_000


def chi_square(tokens: list[int], p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `tokens` against `p` [V], and its degrees of freedom.

    A token p forbids must never appear; those categories are left out of the statistic.
    """
    counts = torch.bincount(torch.tensor(tokens), minlength=p.numel()).double()
    expected = p.double() * len(tokens)
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, f"tokens p forbids were emitted: {counts.tolist()}"
    stat = ((counts - expected)[allowed] ** 2 / expected[allowed]).sum()
    return float(stat), int(allowed.sum()) - 1


def assert_distributed_as(tokens: list[int], p: torch.Tensor, wrong: torch.Tensor) -> None:
    """`tokens` fit `p`, and the same sample would tell `wrong` apart (the test has power)."""
    stat, df = chi_square(tokens, p)
    assert stat < CHI2_CRITICAL_0_001[df], f"chi2 {stat:.1f} with {df} dof for {len(tokens)}"
    wrong_counts = torch.bincount(torch.tensor(tokens), minlength=p.numel()).double()
    wrong_expected = wrong.double() * len(tokens)
    mask = wrong_expected > 0
    wrong_stat = ((wrong_counts - wrong_expected)[mask] ** 2 / wrong_expected[mask]).sum()
    assert wrong_stat > 10 * CHI2_CRITICAL_0_001[df]


def distribution(vocab: int, seed: int, spread: float = 1.0) -> torch.Tensor:
    """A random [vocab] fp32 distribution with every entry > 0."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=g) * spread).softmax(dim=-1)


def drafts_from(q: torch.Tensor, n: int, seed: int) -> list[int]:
    """n drafts drawn independently from q (what a sampling drafter proposes)."""
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(q, n, replacement=True, generator=g).tolist()


# --- greedy -----------------------------------------------------------------------------


def test_greedy_keeps_every_matching_draft_and_adds_the_bonus():
    assert greedy_round([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]


def test_greedy_stops_at_the_first_mismatch_with_the_targets_token():
    assert greedy_round([5, 9, 7, 8], [5, 6, 7]) == [5, 9]
    assert greedy_round([4, 6, 7, 8], [5, 6, 7]) == [4]


def test_greedy_without_drafts_is_one_plain_decode_step():
    assert greedy_round([3], []) == [3]


def test_greedy_needs_one_target_token_more_than_drafts():
    with pytest.raises(ValueError, match="2 drafts need 3 target tokens"):
        greedy_round([1, 2], [1, 2])


# --- one row ----------------------------------------------------------------------------


@pytest.mark.parametrize("q_kind", ["one-hot", "dense", "zero at the draft"])
def test_a_one_hot_target_row_always_yields_its_argmax(q_kind):
    """A greedy row under rejection sampling behaves exactly like argmax, whatever q says."""
    vocab, argmax = 6, 4
    p = torch.zeros(vocab)
    p[argmax] = 1.0
    g = torch.Generator().manual_seed(1)
    for seed in range(20):
        for draft in range(vocab):
            q = None
            if q_kind != "one-hot":
                q = distribution(vocab, seed)
            if q_kind == "zero at the draft":
                q[draft] = 0.0
            assert accept_row(p, draft, q, g) == (argmax, draft == argmax)


def test_a_draft_drawn_from_q_leaves_the_output_distributed_as_p():
    vocab = 7
    p, q = distribution(vocab, 10), distribution(vocab, 11)
    g = torch.Generator().manual_seed(12)
    drafts = drafts_from(q, TRIALS, 13)
    results = [accept_row(p, d, q, g) for d in drafts]
    tokens = [token for token, _ in results]
    assert_distributed_as(tokens, p, wrong=q)
    # Accepted as often as theory says: sum_x min(p(x), q(x)).
    rate = sum(accepted for _, accepted in results) / TRIALS
    assert rate == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.015)


@pytest.mark.parametrize("draft_source", ["fixed", "unrelated distribution"])
def test_one_hot_drafts_leave_the_output_distributed_as_p(draft_source):
    """q None: the rule is exact for a draft chosen any way at all (n-gram, argmax)."""
    vocab = 6
    p = distribution(vocab, 20)
    g = torch.Generator().manual_seed(21)
    if draft_source == "fixed":
        drafts = [2] * TRIALS
    else:
        drafts = drafts_from(distribution(vocab, 22, spread=2.0), TRIALS, 23)
    tokens = [accept_row(p, d, None, g)[0] for d in drafts]
    wrong = torch.full((vocab,), 1 / vocab)
    assert_distributed_as(tokens, p, wrong=wrong)


def test_tokens_the_target_forbids_are_never_emitted():
    """p filtered by top-k (zeros) while q spreads over everything: drafts outside p's
    support are always rejected and the residual never picks them."""
    vocab = 8
    p = distribution(vocab, 30)
    p[[1, 5, 6]] = 0.0
    p /= p.sum()
    q = distribution(vocab, 31)
    g = torch.Generator().manual_seed(32)
    results = [accept_row(p, d, q, g) for d in drafts_from(q, TRIALS, 33)]
    assert all(not accepted for token, accepted in results if p[token] == 0)
    assert_distributed_as([token for token, _ in results], p, wrong=q)


def test_a_draft_q_calls_impossible_is_judged_as_one_hot():
    """q[d] = 0 (a drafter whose q disagrees with its own draft): still exactly p."""
    vocab = 6
    p, q = distribution(vocab, 40), distribution(vocab, 41)
    q[3] = 0.0
    g = torch.Generator().manual_seed(42)
    tokens = [accept_row(p, 3, q, g)[0] for _ in range(TRIALS)]
    assert_distributed_as(tokens, p, wrong=torch.full((vocab,), 1 / vocab))


def test_an_empty_residual_falls_back_to_p():
    """q >= p everywhere (a q that sums to more than 1): rejections draw from p itself."""
    vocab = 5
    p = distribution(vocab, 50)
    p[0] = 0.0
    p /= p.sum()
    q = 2 * p
    q[0] = 0.5
    g = torch.Generator().manual_seed(51)
    results = [accept_row(p, d, q, g) for d in [0, 1, 2] * 200]
    assert any(not accepted for _, accepted in results)
    assert all(p[token] > 0 for token, _ in results)


def test_accept_row_refuses_a_draft_outside_the_vocabulary():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        accept_row(distribution(4, 0), 4, None, None)


# --- whole rounds -----------------------------------------------------------------------


def test_a_round_emits_each_position_with_the_targets_distribution():
    """k = 2, context-independent rows: position 1 is p0; position 2, given the first draft
    kept, is p1; the bonus, given both kept, is p2."""
    vocab, rounds = 6, 20_000
    p_rows = torch.stack([distribution(vocab, s) for s in (60, 61, 62)])
    q_rows = torch.stack([distribution(vocab, s) for s in (63, 64)])
    first = drafts_from(q_rows[0], rounds, 65)
    second = drafts_from(q_rows[1], rounds, 66)
    g = torch.Generator().manual_seed(67)
    outs = [
        speculative_round(p_rows, [a, b], q_rows, g) for a, b in zip(first, second, strict=True)
    ]
    assert {len(out) for out in outs} == {1, 2, 3}
    uniform = torch.full((vocab,), 1 / vocab)
    assert_distributed_as([out[0] for out in outs], p_rows[0], wrong=q_rows[0])
    assert_distributed_as([out[1] for out in outs if len(out) >= 2], p_rows[1], wrong=q_rows[1])
    assert_distributed_as([out[2] for out in outs if len(out) == 3], p_rows[2], wrong=uniform)
    # A kept draft is the draft itself.
    assert all(out[0] == a for out, a in zip(outs, first, strict=True) if len(out) >= 2)


def test_a_round_without_drafts_samples_the_bonus_from_its_only_row():
    vocab = 6
    p_rows = distribution(vocab, 70)[None]
    g = torch.Generator().manual_seed(72)
    tokens = [speculative_round(p_rows, [], None, g)[0] for _ in range(TRIALS)]
    assert_distributed_as(tokens, p_rows[0], wrong=torch.full((vocab,), 1 / vocab))


def test_one_hot_rounds_keep_a_greedy_target_exact():
    """Greedy rows through the sampled path: the same tokens `greedy_round` gives."""
    vocab = 5
    targets = [3, 1, 4]
    p_rows = torch.zeros(3, vocab)
    p_rows[torch.arange(3), torch.tensor(targets)] = 1.0
    for drafts in ([3, 1], [3, 2], [0, 1]):
        assert speculative_round(p_rows, drafts, None, None) == greedy_round(targets, drafts)


def test_a_seeded_round_is_reproducible():
    p_rows = torch.stack([distribution(8, s) for s in (80, 81, 82, 83)])
    q_rows = torch.stack([distribution(8, s) for s in (84, 85, 86)])

    def run() -> list[list[int]]:
        g = torch.Generator().manual_seed(87)
        return [speculative_round(p_rows, [1, 2, 3], q_rows, g) for _ in range(50)]

    assert run() == run()


def test_a_round_checks_its_shapes():
    with pytest.raises(ValueError, match=r"2 drafts need \[3, V\] p_rows"):
        speculative_round(torch.ones(2, 4) / 4, [0, 1], None, None)
    with pytest.raises(ValueError, match=r"q_rows must be \[2, 4\]"):
        speculative_round(torch.ones(3, 4) / 4, [0, 1], torch.ones(3, 4) / 4, None)
