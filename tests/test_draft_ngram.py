"""Draft strategy `ngram`: what prompt lookup proposes, its per-sequence state, its contract."""

from __future__ import annotations

import random
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from ninfer_core import conformance
from ninfer_core.device import probe_device
from ninfer_core.plugin_host import create_host
from ninfer_core.plugin_types import Drafter, DraftStrategy
from ninfer_core.spec.types import DraftInput, DraftOptions, DraftTarget
from ninfer_plugins import draft_ngram
from ninfer_plugins.draft_ngram import NGRAM_MAX, NGRAM_MIN, NgramDrafter, NgramStrategy, lookup

ROOT = Path(__file__).resolve().parents[1]


def proposal(
    drafter: NgramDrafter, tokens: Sequence[int], max_drafts: int = 4, seq_id: int = 0
) -> list[int]:
    """What `drafter` proposes for one decoding sequence holding `tokens`."""
    inp = DraftInput(
        seq_id=seq_id,
        token_ids=tokens,
        start=len(tokens) - 1,
        end=len(tokens) - 1,
        block_table=(),
        max_drafts=max_drafts,
    )
    [out] = drafter.propose([inp])
    assert out.probs is None  # one-hot drafts
    return list(out.token_ids)


def reference(tokens: Sequence[int], max_drafts: int) -> list[int]:
    """The rule spelled out: longest n first, then the most recent earlier occurrence."""
    length = len(tokens)
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        if n >= length:
            continue
        suffix = list(tokens[length - n :])
        for end in range(length - 2, n - 2, -1):  # an earlier n-gram ending at `end`
            if list(tokens[end - n + 1 : end + 1]) == suffix:
                # Copy what followed it, overlapping into the drafts themselves.
                out = list(tokens)
                for i in range(max_drafts):
                    out.append(out[end + 1 + i])
                return out[length:]
    return []


def test_a_repeated_line_proposes_its_continuation():
    line = [10, 11, 12, 13, 14, 15, 16]
    tokens = [1, 2, *line, 3, 4, *line[:3]]
    assert proposal(NgramDrafter(), tokens) == [13, 14, 15, 16]


def test_the_longest_matching_suffix_wins_over_a_more_recent_shorter_one():
    # [5, 6, 7] occurred early (followed by 40); [6, 7] alone more recently (followed by 50).
    tokens = [5, 6, 7, 40, 41, 9, 6, 7, 50, 51, 9, 5, 6, 7]
    assert proposal(NgramDrafter(), tokens, max_drafts=2) == [40, 41]


def test_the_most_recent_occurrence_wins_among_equally_long_ones():
    tokens = [1, 2, 30, 31, 1, 2, 60, 61, 7, 1, 2]
    assert proposal(NgramDrafter(), tokens, max_drafts=2) == [60, 61]
    line = [1, 2, 3, 4, 5]
    assert proposal(NgramDrafter(), [*line, 40, *line, 50, *line], max_drafts=1) == [50]


def test_a_single_token_match_proposes_nothing():
    """NGRAM_MIN = 2: the last token alone recurring is no evidence of a repeated span."""
    assert proposal(NgramDrafter(), [1, 2, 3, 4, 5, 3]) == []


def test_no_match_proposes_nothing():
    assert proposal(NgramDrafter(), list(range(50))) == []
    assert proposal(NgramDrafter(), [7]) == []
    assert proposal(NgramDrafter(), []) == []


def test_max_drafts_bounds_the_proposal():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert proposal(NgramDrafter(), tokens, max_drafts=3) == [3, 4, 5]
    assert proposal(NgramDrafter(), tokens, max_drafts=1) == [3]
    # The match ends just before the context does: what followed it goes on repeating.
    assert proposal(NgramDrafter(), [1, 2, 3, 1, 2], max_drafts=5) == [3, 1, 2, 3, 1]


def test_max_drafts_zero_proposes_nothing_and_keeps_nothing():
    drafter = NgramDrafter()
    assert proposal(drafter, [1, 2, 3, 1, 2], max_drafts=0) == []
    assert "0 sequences" in repr(drafter)


def test_release_forgets_the_sequence():
    drafter = NgramDrafter()
    proposal(drafter, [1, 2, 3, 1, 2], seq_id=7)
    proposal(drafter, [4, 5, 6, 4, 5], seq_id=8)
    assert "2 sequences" in repr(drafter)
    drafter.release(7)
    drafter.release(7)  # twice, or a sequence never seen: no error
    drafter.release(99)
    assert "1 sequences" in repr(drafter)


def test_incremental_appends_answer_as_a_fresh_drafter_does():
    rng = random.Random(0)
    tokens: list[int] = []
    drafter = NgramDrafter()
    for _ in range(300):
        # One to four accepted tokens a step, from a small vocabulary so matches happen.
        tokens.extend(rng.randrange(6) for _ in range(rng.randint(1, 4)))
        assert proposal(drafter, tokens) == proposal(NgramDrafter(), tokens)


def test_a_restarted_sequence_is_rebuilt():
    drafter = NgramDrafter()
    proposal(drafter, [1, 2, 3, 4, 1, 2, 3, 9, 9], seq_id=1)
    shorter = [5, 6, 7, 5, 6]
    assert proposal(drafter, shorter, max_drafts=3, seq_id=1) == [7, 5, 6]
    # Same length again, other tokens: rebuilt too (the last kept token differs).
    other = [8, 9, 4, 8, 9]
    assert proposal(drafter, other, max_drafts=3, seq_id=1) == [4, 8, 9]


def test_sequences_keep_separate_state():
    drafter = NgramDrafter()
    a, b = [1, 2, 3, 1, 2], [4, 5, 6, 4, 5]
    inputs = [
        DraftInput(seq_id=i, token_ids=t, start=0, end=len(t) - 1, block_table=(), max_drafts=2)
        for i, t in ((0, a), (1, b))
    ]
    assert [list(p.token_ids) for p in drafter.propose(inputs)] == [[3, 1], [6, 4]]


def test_the_search_matches_the_rule_spelled_out():
    rng = random.Random(1)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 40))]
        max_drafts = rng.randint(1, 5)
        got = lookup(np.asarray(tokens, dtype=np.int32), max_drafts)
        assert got == reference(tokens, max_drafts), tokens


def test_a_long_run_of_one_token_proposes_it_again():
    """Every position is a candidate: the most recent full-length match wins."""
    tokens = [3] * 1000
    assert proposal(NgramDrafter(), tokens, max_drafts=4) == [3, 3, 3, 3]


def test_the_strategy_and_drafter_keep_their_contracts():
    strategy = NgramStrategy()
    conformance.check(strategy, DraftStrategy, "draft strategy 'ngram'")
    # Prompt lookup reads nothing of the target model.
    target = cast(DraftTarget, None)
    assert strategy.supports(probe_device(use_cuda=False))
    assert strategy.supports_model(target, DraftOptions())
    drafter = strategy.create(target, DraftOptions())
    conformance.check(drafter, Drafter, "the drafter of 'ngram'")
    assert drafter.uses_hidden is False


def test_register_draft_strategies_returns_the_strategy():
    [strategy] = draft_ngram.register_draft_strategies()
    assert strategy.name == "ngram"


def test_the_host_lists_ngram_under_draft_strategies():
    host = create_host(load_entry_points=False, extra_plugins=[("draft-ngram", draft_ngram)])
    assert "ngram" in host.draft_strategies.names()
    assert isinstance(host.draft_strategies.get("ngram"), NgramStrategy)


def test_the_plugin_is_declared_as_an_entry_point():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["entry-points"]["ninfer"]["draft-ngram"] == "ninfer_plugins.draft_ngram"


@pytest.mark.parametrize("frequency", [None, 2])
def test_a_propose_on_a_long_context_stays_cheap(frequency):
    """100k tokens, the last one rare or at every other position: well under a millisecond
    a step once the context is kept (a loose bound here, so a busy machine does not fail)."""
    import time

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32_000, 100_000).tolist()
    if frequency:
        tokens[::frequency] = [13] * len(tokens[::frequency])
        tokens[-1] = 13
    drafter = NgramDrafter()
    proposal(drafter, tokens)
    times = []
    for step in range(50):
        tokens += [int(rng.integers(0, 32_000)), 13 if frequency else step]
        start = time.perf_counter()
        proposal(drafter, tokens)
        times.append(time.perf_counter() - start)
    assert sorted(times)[len(times) // 2] < 0.005
