"""The two error figures every docs table uses, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer_core.bench.agreement import logit_agreement, rel_rms


def test_rel_rms_is_the_norm_ratio():
    want = torch.tensor([3.0, 4.0])  # norm 5
    got = torch.tensor([3.0, 5.0])  # error norm 1
    assert rel_rms(got, want) == pytest.approx(0.2)
    assert rel_rms(want, want) == 0.0


def test_logit_agreement_counts_positions_with_the_same_top1():
    want = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    got = want.clone()
    got[1] = torch.tensor([0.0, 2.0, 0.0])  # top-1 moves from 0 to 1
    a = logit_agreement(got, want)
    assert a.top1 == 0.75
    assert a.rel_rms == pytest.approx(math.sqrt(8) / math.sqrt(7))


def test_logit_agreement_refuses_different_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        logit_agreement(torch.zeros(2, 3), torch.zeros(3, 3))
