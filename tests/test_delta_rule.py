"""The Gated DeltaNet reference ops (`ninfer_core.kernels.delta_rule`) against independent
references: a plain float64 recurrence written here, and transformers' Qwen3-Next torch
functions (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`causal_conv1d_fn`, `causal_conv1d_update`); plus the ragged batch and the state carried
across steps (prefill in pieces, then decode)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from ninfer_core.kernels import delta_rule
from ninfer_core.kernels.delta_rule import causal_conv1d, gated_delta_rule
from ninfer_core.kernels.reference import TorchOps

HQK, HV, DK, DV = 2, 4, 16, 8
CHANNELS, WIDTH = 12, 4


def inputs(length: int, seed: int, dtype=torch.float64, hv: int = HV) -> dict[str, torch.Tensor]:
    """Random q, k, v, g (<= 0, as -softplus makes it), beta (sigmoid) for `length` tokens."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {
        "q": randn(length, HQK, DK).to(dtype),
        "k": randn(length, HQK, DK).to(dtype),
        "v": randn(length, hv, DV).to(dtype),
        "g": (-F.softplus(randn(length, hv)) * 0.5).to(dtype),
        "beta": randn(length, hv).sigmoid().to(dtype),
    }


def initial_state(batch: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, HV, DK, DV, generator=gen, dtype=torch.float64) * 0.3).to(dtype)


def oracle(x: dict[str, torch.Tensor], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one token and one head at a time in float64, from its definition:
    S = e^g S; u = beta (v - Sᵀk); S += k uᵀ; o = Sᵀq, with q, k L2-normalised and q
    scaled by Dk**-0.5; value head j reads q/k head j // (Hv / Hqk)."""
    s = state.clone().double()  # [Hv, Dk, Dv]
    group = HV // HQK
    out = torch.zeros(x["v"].shape, dtype=torch.float64)
    for t in range(x["v"].shape[0]):
        for j in range(HV):
            q, k = x["q"][t, j // group].double(), x["k"][t, j // group].double()
            q = q / torch.sqrt(q @ q + 1e-6) / DK**0.5
            k = k / torch.sqrt(k @ k + 1e-6)
            s[j] = s[j] * torch.exp(x["g"][t, j].double())
            u = x["beta"][t, j].double() * (x["v"][t, j].double() - s[j].T @ k)
            s[j] = s[j] + torch.outer(k, u)
            out[t, j] = s[j].T @ q
    return out, s


def run(x: dict[str, torch.Tensor], state: torch.Tensor, cu_seqlens) -> torch.Tensor:
    return gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], state, cu_seqlens)


def rows(x: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    return {name: t[start:end] for name, t in x.items()}


def cat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 200])
def test_both_forms_equal_the_float64_recurrence(length):
    """Up to 16 tokens run the recurrent form, more the chunked one: each equals the
    definition, a nonzero state carried in and the state after updated in place."""
    x, state = inputs(length, seed=length), initial_state(1, seed=100 + length)
    want, want_state = oracle(x, state[0])
    got = run(x, state, [0, length])
    assert got.dtype == torch.float64
    assert torch.allclose(got, want, atol=1e-10, rtol=0)
    assert torch.allclose(state[0], want_state, atol=1e-10, rtol=0)


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 200])
def test_the_chunked_form_equals_the_recurrent_form(monkeypatch, length):
    """The same sequence forced through each form (float64, 1e-10)."""
    x, state = inputs(length, seed=length), initial_state(1, seed=7)
    monkeypatch.setattr(delta_rule, "RECURRENT_MAX_TOKENS", 10**9)
    recurrent_state = state.clone()
    recurrent = run(x, recurrent_state, [0, length])
    monkeypatch.setattr(delta_rule, "RECURRENT_MAX_TOKENS", 0)
    chunked_state = state.clone()
    chunked = run(x, chunked_state, [0, length])
    assert torch.allclose(chunked, recurrent, atol=1e-10, rtol=0)
    assert torch.allclose(chunked_state, recurrent_state, atol=1e-10, rtol=0)


def test_a_ragged_batch_equals_each_sequence_alone():
    lengths = [70, 1, 9]  # chunked, decode, a speculative round's rows
    parts = [inputs(n, seed=10 + i) for i, n in enumerate(lengths)]
    states = initial_state(3, seed=3)
    before = states.clone()
    offsets = torch.tensor([0, 70, 71, 80])
    got = run(cat(parts), states, offsets)
    for i, part in enumerate(parts):
        alone = before[i : i + 1].clone()
        want = run(part, alone, [0, lengths[i]])
        start, end = int(offsets[i]), int(offsets[i + 1])
        assert torch.allclose(got[start:end], want, atol=1e-12, rtol=0)
        assert torch.allclose(states[i], alone[0], atol=1e-12, rtol=0)
        assert torch.allclose(want, oracle(part, before[i])[0], atol=1e-10, rtol=0)


DECODE_BATCHES = {
    "all one token": [1] * 8,
    "mixed short": [1, 3, 16, 2, 1],
    "short, empty and a prefill": [1, 0, 40, 5, 1],
}


@pytest.mark.parametrize("lengths", DECODE_BATCHES.values(), ids=DECODE_BATCHES.keys())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_decode_batch_equals_each_sequence_alone(lengths, dtype):
    """The short sequences of a step run as one batched recurrence (padded to the
    longest, the padding leaving states untouched): outputs and final states equal each
    sequence run alone, and the float64 definition."""
    parts = [inputs(n, seed=20 + i, dtype=dtype) for i, n in enumerate(lengths)]
    states = initial_state(len(lengths), seed=8, dtype=dtype)
    before = states.clone()
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    got = run(cat(parts), states, offsets)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for i, part in enumerate(parts):
        alone = before[i : i + 1].clone()
        want = run(part, alone, [0, lengths[i]])
        start, end = offsets[i], offsets[i + 1]
        assert torch.allclose(got[start:end], want, atol=tol, rtol=0)
        assert torch.allclose(states[i], alone[0], atol=tol, rtol=0)
        want64, state64 = oracle(part, before[i].double())
        assert torch.allclose(got[start:end].double(), want64, atol=100 * tol, rtol=0)
        assert torch.allclose(states[i].double(), state64, atol=100 * tol, rtol=0)


def test_a_decode_step_is_one_recurrent_update(monkeypatch):
    """B sequences decoding one token each cost one call of the recurrence (over B x Hv
    heads), not B."""
    calls = []
    recurrent = delta_rule._recurrent

    def counted(q, *rest):
        calls.append(q.shape[0])
        return recurrent(q, *rest)

    monkeypatch.setattr(delta_rule, "_recurrent", counted)
    batch = 6
    run(inputs(batch, seed=1), initial_state(batch, seed=2), list(range(batch + 1)))
    assert calls == [batch * HV]


@pytest.mark.parametrize("lengths", DECODE_BATCHES.values(), ids=DECODE_BATCHES.keys())
def test_conv_decode_batch_equals_each_sequence_alone(lengths):
    """The short sequences' convolution in one pass over padded windows: outputs equal
    each sequence alone up to rounding and the carried inputs exactly, and a decode
    token equals transformers' `causal_conv1d_update`."""
    x, weight, b = conv_inputs(sum(lengths), seed=5)
    carried = torch.randn(
        len(lengths), CHANNELS, WIDTH - 1, generator=torch.Generator().manual_seed(6)
    )
    states = carried.clone()
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    got = causal_conv1d(x, weight, b, states, offsets)
    for i, (start, end) in enumerate(pairwise(offsets)):
        alone = carried[i : i + 1].clone()
        want = causal_conv1d(x[start:end], weight, b, alone, [0, end - start])
        assert torch.allclose(got[start:end], want, atol=1e-6, rtol=0)
        assert torch.equal(states[i], alone[0])
        if end - start == 1:  # a decode token: transformers' causal_conv1d_update
            hf_state = carried[i : i + 1].clone()
            ref = hf.causal_conv1d_update(x[start:end].t()[None], hf_state, weight, b, "silu")
            assert torch.allclose(got[start:end], ref[0].t(), atol=1e-6, rtol=0)
            assert torch.equal(states[i : i + 1], hf_state)


def test_an_empty_sequence_keeps_its_state():
    x, states = inputs(3, seed=1), initial_state(2, seed=2)
    before = states.clone()
    run(x, states, [0, 0, 3])
    assert torch.equal(states[0], before[0])
    assert not torch.equal(states[1], before[1])


def test_prefill_in_pieces_then_decode_equals_one_pass():
    """Uneven chunks (chunked, recurrent, chunked across the 64 boundary), then token by
    token, the state carried between calls: the same as the whole sequence at once."""
    length = 150
    x, state = inputs(length, seed=5), initial_state(1, seed=6)
    whole_state = state.clone()
    whole = run(x, whole_state, [0, length])
    cuts = [0, 40, 47, 130, *range(131, length + 1)]
    pieces = []
    for start, end in pairwise(cuts):
        pieces.append(run(rows(x, start, end), state, [0, end - start]))
    assert torch.allclose(torch.cat(pieces), whole, atol=1e-10, rtol=0)
    assert torch.allclose(state, whole_state, atol=1e-10, rtol=0)


def hf_layout(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """[T, H, D] -> transformers' [1, T, H, D]; it groups q/k heads by repeat_interleave."""
    return {name: t[None] for name, t in x.items()}


@pytest.mark.parametrize("length", [1, 9, 64, 100])
def test_matches_transformers_qwen3_next(length):
    """fp32 against `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`
    (use_qk_l2norm_in_kernel=True, output_final_state=True), state included."""
    x = inputs(length, seed=20 + length, dtype=torch.float32)
    state = initial_state(1, seed=21, dtype=torch.float32)
    h = hf_layout(x)
    common = {"initial_state": state.clone(), "output_final_state": True}
    common["use_qk_l2norm_in_kernel"] = True
    args = (h["q"], h["k"], h["v"], h["g"], h["beta"])
    references = [
        hf.torch_chunk_gated_delta_rule(*args, chunk_size=64, **common),
        hf.torch_recurrent_gated_delta_rule(*args, **common),
    ]
    got = run(x, state, [0, length])
    assert got.dtype == torch.float32
    for want, want_state in references:
        assert torch.allclose(got, want[0], atol=1e-5, rtol=0)
        assert torch.allclose(state, want_state, atol=1e-5, rtol=0)


def test_dtype_in_out_and_fp32_state():
    """bf16 activations: computed in fp32 against the fp32 state, returned in bf16."""
    x = {n: t.to(torch.bfloat16) for n, t in inputs(20, seed=3).items()}
    state = initial_state(1, seed=4, dtype=torch.float32)
    want = run({n: t.float() for n, t in x.items()}, state.clone(), [0, 20])
    got = run(x, state, [0, 20])
    assert got.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert torch.allclose(got.float(), want, atol=1e-2, rtol=0)


def test_bad_shapes_name_the_argument():
    x, state = inputs(4, seed=0), initial_state(1, seed=0)
    with pytest.raises(ValueError, match="states"):
        run(x, initial_state(2, seed=0), [0, 4])
    with pytest.raises(ValueError, match="cu_seqlens"):
        run(x, state, [0, 3])
    with pytest.raises(ValueError, match="g "):
        gated_delta_rule(x["q"], x["k"], x["v"], x["g"][:, :2], x["beta"], state, [0, 4])


# -- causal_conv1d -----------------------------------------------------------------------


def conv_inputs(length: int, seed: int, *, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen) * 0.5
    b = torch.randn(CHANNELS, generator=gen) if bias else None
    return x, weight, b


def hf_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """transformers' prefill: a depthwise nn.Conv1d, padding K - 1, cut to T, then SiLU."""
    conv = torch.nn.Conv1d(CHANNELS, CHANNELS, WIDTH, groups=CHANNELS, padding=WIDTH - 1)
    conv.bias = None if bias is None else torch.nn.Parameter(bias)
    conv.weight = torch.nn.Parameter(weight[:, None, :])
    with torch.no_grad():
        y = conv(x.t()[None])[..., : x.shape[0]]
        via_fn = hf.causal_conv1d_fn(x.t()[None], weight, bias, activation="silu")
    assert torch.allclose(F.silu(y), via_fn, atol=1e-6, rtol=0)
    return F.silu(y)[0].t()


@pytest.mark.parametrize("bias", [True, False])
def test_conv_prefill_matches_transformers_and_keeps_the_last_inputs(bias):
    x, weight, b = conv_inputs(10, seed=1, bias=bias)
    states = torch.zeros(1, CHANNELS, WIDTH - 1)
    got = causal_conv1d(x, weight, b, states, [0, 10])
    assert torch.allclose(got, hf_prefill(x, weight, b), atol=1e-6, rtol=0)
    assert torch.equal(states[0], x[-(WIDTH - 1) :].t())


def test_conv_prefill_then_decode_matches_transformers_update_and_one_pass():
    x, weight, b = conv_inputs(12, seed=2)
    whole = hf_prefill(x, weight, b)
    states = torch.zeros(1, CHANNELS, WIDTH - 1)
    hf_state = torch.zeros(1, CHANNELS, WIDTH - 1)
    pieces = [causal_conv1d(x[:2], weight, b, states, [0, 2])]  # shorter than K - 1
    hf.causal_conv1d_update(x[:2].t()[None], hf_state, weight, b, "silu")
    for t in range(2, 12):
        step = causal_conv1d(x[t : t + 1], weight, b, states, [0, 1])
        want = hf.causal_conv1d_update(x[t : t + 1].t()[None], hf_state, weight, b, "silu")
        assert torch.allclose(step, want[0].t(), atol=1e-6, rtol=0)
        assert torch.allclose(states, hf_state, atol=0, rtol=0)
        pieces.append(step)
    assert torch.allclose(torch.cat(pieces), whole, atol=1e-6, rtol=0)


def test_conv_ragged_batch_equals_each_sequence_alone():
    x, weight, b = conv_inputs(9, seed=3)
    carried = torch.randn(3, CHANNELS, WIDTH - 1, generator=torch.Generator().manual_seed(4))
    states = carried.clone()
    got = causal_conv1d(x, weight, b, states, torch.tensor([0, 5, 6, 9]))
    for i, (start, end) in enumerate([(0, 5), (5, 6), (6, 9)]):
        alone = carried[i : i + 1].clone()
        want = causal_conv1d(x[start:end], weight, b, alone, [0, end - start])
        # Vectorised SiLU rounds a row apart by where it falls in the batch; the carried
        # inputs are copied, so the states are exact.
        assert torch.allclose(got[start:end], want, atol=1e-6, rtol=0)
        assert torch.equal(states[i], alone[0])
    # The carried state is the K - 1 inputs before a sequence's first token.
    hf_state = carried[1:2].clone()
    want = hf.causal_conv1d_update(x[5:6].t()[None], hf_state, weight, b, "silu")
    assert torch.allclose(got[5:6], want[0].t(), atol=1e-6, rtol=0)


def test_the_reference_ops_serve_both():
    ops = TorchOps("cpu")
    x, state = inputs(3, seed=9), initial_state(1, seed=9)
    want = run(x, state.clone(), [0, 3])
    got = ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], state, [0, 3])
    assert torch.equal(got, want)
    cx, weight, b = conv_inputs(4, seed=9)
    states = torch.zeros(1, CHANNELS, WIDTH - 1)
    got = ops.causal_conv1d(cx, weight, b, states, [0, 4])
    assert torch.allclose(got, hf_prefill(cx, weight, b), atol=1e-6, rtol=0)
