"""A fused group whose parts differ in format, held in one format of the same values
(`ninfer_core.quant.widen`): which format, and that every value is the part's own, bit for
bit (against each part's dequantization, itself checked against float64 oracles in
tests/test_quant_formats.py and ggml's dequantizer in tests/test_quant_ggml.py)."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.tensor import quantize
from ninfer_core.quant.widen import common_format, widen


def _fmt(*names: str):
    return common_format(weight_format(n) for n in names)


@pytest.mark.parametrize(
    ("parts", "held"),
    [
        (("Q4G32", "Q4G32"), "Q4G32"),
        (("Q4G64", "Q4G32"), "Q4G32"),  # the narrower group: scales repeated
        (("Q4G32", "Q4G32M"), "Q4G32M"),  # Q4_0 beside Q4_1
        (("Q4G32", "W8G32"), "W8G32"),  # Q4_0 q, k beside a Q8_0 v
        (("Q4G32M", "W8G32"), "W8G32M"),  # Q4_1 gate beside a Q5_0 up
        (("Q4G32M", "W8G16"), "W8G16M"),
        (("Q4G32M", "Q6G16"), "Q6G16M"),  # Q4_K q, k beside a Q6_K v (Q4_K_M)
        (("Q5G32M", "Q6G16"), "Q6G16M"),  # Q5_K q, k beside a Q6_K v (Q5_K_M)
        (("Q4G32M", "Q5G32"), "Q5G32M"),  # Q4_1 gate beside a Q5_0 up
        (("Q3G16", "Q5G32M"), "Q6G16M"),  # no Q5G16M: the next width that has the group
        (("Q6G16", "W8G32"), "W8G16"),
        (("IQ4G32", "Q4G32"), "W8G32"),  # a code book's values are 8-bit codes
        (("IQ4G32", "Q4G32M"), "W8G32M"),
        (("Q3G16", "Q4G32M"), "Q4G16M"),  # Q3_K q, k beside a Q4_K v (Q3_K_M)
        (("Q2G16M", "Q3G16"), "Q4G16M"),  # Q2_K q, k beside a Q3_K v (Q2_K)
        (("Q3G16", "Q4G32"), "Q4G16"),
        (("Q3G16", "W8G32"), "W8G16"),  # beside an 8-bit part: 8-bit codes
        (("Q6G64", "Q4G64"), "Q6G64"),  # the `mixed` recipe's widths
        (("Q6G64", "Q5G32M"), "W8G32M"),  # no Q6G32M: 8-bit codes
        (("Q4G32", "fp16"), None),  # a dense part
    ],
)
def test_the_common_format(parts, held):
    got = _fmt(*parts)
    assert (got.name if got else None) == held


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ("Q4G64", "Q4G32"),
        ("Q4G32", "Q4G32M"),
        ("Q4G32", "W8G32"),
        ("Q4G32", "W8G32M"),
        ("Q4G32M", "W8G32M"),
        ("Q4G32M", "W8G16M"),
        ("W8G32", "W8G16M"),
        ("W8G16", "W8G16M"),
        ("Q4G64", "W8G16"),
        ("Q3G16", "Q4G16M"),
        ("Q2G16M", "Q4G16M"),
        ("Q4G32M", "Q4G16M"),
        ("Q3G16", "Q4G16"),
        ("Q4G32", "Q4G16"),
        ("Q3G16", "W8G16M"),
        ("Q4G32M", "Q6G16M"),
        ("Q5G32M", "Q6G16M"),
        ("Q6G16", "Q6G16M"),
        ("Q5G32", "Q5G32M"),
        ("Q3G16", "Q6G16M"),
        ("Q6G16", "W8G16M"),
        ("IQ4G32", "W8G32"),
        ("IQ4G32", "W8G16M"),
    ],
)
@pytest.mark.parametrize("cols", [100, 160])  # 100: padding beyond the last group
def test_the_values_are_the_parts_own_bit_for_bit(src, dst, cols):
    gen = torch.Generator().manual_seed(cols)
    w = torch.randn(37, cols, generator=gen) * 0.05 + 0.02
    w[0, :32] = 0  # an all-zero group
    w[1, :16] = -3.0  # a negative run (an asymmetric min of its own)
    part = quantize(w, src)
    held = widen(part, weight_format(dst))
    assert held.fmt.name == dst and held.shape == part.shape
    want = part.dequantize(torch.float32)
    assert torch.equal(held.dequantize(torch.float32).view(torch.int32), want.view(torch.int32))
    # rows move alike (a GGUF's q/k un-permutation comes after)
    ids = torch.tensor([5, 0, 36])
    assert torch.equal(held.index_rows(ids).dequantize(), want[ids])


def test_nothing_narrows():
    part = quantize(torch.randn(4, 64), "W8G32")
    for dst in ("Q4G32", "Q4G32M", "IQ4G32"):
        with pytest.raises(ValueError, match="do not fit"):
            widen(part, weight_format(dst))
    with pytest.raises(ValueError, match="do not fit"):  # its values take 8 bits
        widen(quantize(torch.randn(4, 64), "IQ4G32"), weight_format("Q6G16M"))
    with pytest.raises(ValueError, match="do not fit"):
        widen(quantize(torch.randn(4, 64), "Q4G32M"), weight_format("W8G32"))


def test_a_min_beyond_fp16_is_refused():
    part = quantize(torch.full((1, 32), 30000.0), "Q4G32")  # scale ~4286: -8 x scale fits
    assert torch.isfinite(widen(part, weight_format("Q4G32M")).mins).all()
    big = quantize(torch.full((1, 32), 65504.0), "W8G32")  # -128 x 515.5 does not
    with pytest.raises(ValueError, match="beyond fp16's range"):
        widen(big, weight_format("W8G32M"))
