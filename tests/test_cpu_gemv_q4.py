"""The decode GEMVs over 4- and 8-bit codes (`ninfer_cpu::gemv_q4` / `gemv_q8`,
`Q4GemvLinear` / `Q8GemvLinear`): their integer arithmetic against a float64 emulation
of their scheme (x in two int8 planes per 32 columns),
its error against the exact float64 product, the prefill path, the planner's bytes and
a compiled graph calling it."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.engine.compiled_step import compile_graph
from ninfer_core.kernels import cpu_gemv
from ninfer_core.kernels.cpu_gemv import Q4GemvLinear, Q8GemvLinear, codes_linear
from ninfer_core.kernels.reference import TorchOps
from ninfer_core.quant.codes import pack_codes
from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.tensor import QuantizedTensor, quantize

pytestmark = pytest.mark.skipif(
    not cpu_gemv.available(), reason=f"CPU GEMV not built: {cpu_gemv.unavailable()}"
)

FORMATS = ["Q4G32", "Q4G32M", "Q4G64", "W8G32", "W8G16", "Q5G64", "Q6G64", "W8G32M", "W8G16M",
           "Q3G16", "Q2G16M", "Q5G32", "Q5G32M", "Q6G16", "Q6G16M", "IQ4G32"]  # fmt: skip
#: The formats the 4-bit layer runs: 4-bit codes, 2- and 3-bit ones with a scale per 16,
#: 5- and 6-bit ones (nibbles and planes of high bits) and a code book's indices.
NIBBLE_FORMATS = ["Q4G32", "Q4G32M", "Q4G64", "Q3G16", "Q2G16M", "Q5G64", "Q6G64", "Q5G32",
                  "Q5G32M", "Q6G16", "Q6G16M", "IQ4G32"]  # fmt: skip


def _weight(fmt: str, out: int, inp: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(out, inp, generator=g) * 0.05 + 0.01, fmt)


def _x(rows: int, inp: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, inp, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _emulated(x: torch.Tensor, qt) -> torch.Tensor:
    """x as the kernels carry it, in two int8 planes per block of 32 columns: with
    s = x * (127 / max|x|) (fp32, as the kernel forms it), q = round(s) and
    r = min(round((s - q) * 256), 127) (half to even), x = dx * (q + r / 256),
    dx = max|x| / 127;
    then y = that x times the exact weights, in float64."""
    rows, cols = x.shape
    kp = -(-qt.padded_cols // 32) * 32  # whole blocks of x (W8G16 may pad 16 more)
    xp = torch.nn.functional.pad(x.float(), (0, kp - cols)).view(rows, -1, 32)
    amax = xp.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0)
    s = xp * inv
    q = torch.round(s)
    r = torch.round((s - q) * 256).clamp(max=127)
    xe = (q.double() + r.double() / 256) * (amax.double() / 127)
    w = torch.nn.functional.pad(qt.dequantize(torch.float64), (0, kp - cols))
    return xe.view(rows, kp) @ w.T


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("rows", "out", "inp"), [(1, 960, 576), (3, 37, 100), (16, 64, 1536)])
def test_the_integer_arithmetic_is_the_two_plane_schemes(fmt, rows, out, inp):
    qt = _weight(fmt, out, inp)
    x = _x(rows, inp)
    got = codes_linear(qt)(x)
    want = _emulated(x, qt)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    # Exact integer sums and fp32 scaling: mostly the float64 result rounded to bf16 (an
    # s exactly between two steps may round the other way where the kernel's fp32
    # arithmetic and torch's differ in the last bit); a wrong block scale or column
    # order would be off by percents.
    assert (got.double() == want.bfloat16().double()).float().mean() >= 0.9
    err = (got.double() - want).abs()
    assert (err <= want.abs() * 2**-8 + 1e-4 * want.abs().max()).all(), err.max().item()


@pytest.mark.parametrize("fmt", NIBBLE_FORMATS)
@pytest.mark.parametrize("blocks", [1, 3, 5, 15, 16, 17, 19, 31, 35])
def test_4_bit_rows_of_any_number_of_blocks(fmt, blocks):
    """The 4-bit layer interleaves a row's blocks 16 at a time and keeps the rest in
    order: every split of a row into whole steps and a tail gives the two-plane scheme's
    product, and the prefill path reads the same codes back."""
    inp = 32 * blocks
    qt = _weight(fmt, 40, inp, seed=blocks)
    x = _x(2, inp, seed=blocks)
    lin = codes_linear(qt)
    want = _emulated(x, qt)
    got = lin(x)
    assert (got.double() == want.bfloat16().double()).float().mean() >= 0.9
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-4 * want.abs().max()).all()
    assert torch.equal(lin.weight_rows(0, 40)[:, :inp], qt.dequantize(torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("blocks", [3, 16, 18, 48])
def test_each_row_of_a_call_is_that_row_alone(fmt, blocks):
    """Every row of a 1- to 16-row call must be bit for bit what that row computes alone,
    or a speculative round or a batch would change a greedy answer (a kernel that shares
    work between rows must keep each row's arithmetic the lone row's)."""
    inp = 32 * blocks
    lin = codes_linear(_weight(fmt, 24, inp, seed=blocks))
    x = _x(16, inp, seed=blocks)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(16)])
    for rows in (2, 3, 4, 5, 6, 7, 9, 16):
        assert torch.equal(lin(x[:rows]), alone[:rows]), (fmt, blocks, rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_and_prefill_rows_against_float64(fmt):
    qt = _weight(fmt, 300, 100)  # 100 columns: padded to the group
    exact_w = qt.dequantize(torch.float64)
    lin = TorchOps("cpu").pack_linear(qt, dtype=torch.bfloat16)
    assert isinstance(lin, Q4GemvLinear if qt.fmt.bits <= 6 else Q8GemvLinear)
    b = torch.randn(300).bfloat16()
    for rows in (1, 16, 17, 80):
        x = _x(rows, 100, seed=rows)
        want = x.double() @ exact_w.T + b.double()
        got = lin(x, b)
        rel = ((got.double() - want).norm() / want.norm()).item()
        # GEMV rows: x to within dx / 508 and the bf16 output (measured 0.17%); prefill
        # rows: bf16 weights from the exact dequantization, then a bf16 GEMM.
        assert rel < 4e-3, (rows, rel)
    # The prefill path's weights are the exact dequantization, rounded once.
    assert torch.equal(lin.weight_rows(0, 300)[:, :100], qt.dequantize(torch.bfloat16))


@pytest.mark.parametrize("fmt", NIBBLE_FORMATS)
@pytest.mark.parametrize("shape", [(16, 64), (300, 96), (40, 160), (8, 48)])
def test_the_planners_bytes_are_the_built_bytes(fmt, shape):
    qt = _weight(fmt, *shape)
    lin = Q4GemvLinear(qt)
    assert Q4GemvLinear.nbytes_for(qt.fmt, shape) == lin.nbytes
    # half a byte a weight, an eighth per plane of high bits (5- and 6-bit codes) and one
    # fp16 scale (and min) per group (Q4G64: 4.25 bits a weight), over whole blocks of 32
    # (48 columns of a scale per 16 hold 64)
    kp, group, planes = -(-qt.padded_cols // 32) * 32, qt.fmt.group, max(0, qt.fmt.bits - 4)
    codes = shape[0] * kp // 2 + shape[0] * kp // 8 * planes
    assert lin.nbytes == codes + shape[0] * kp // group * 2 * (2 if qt.fmt.mins else 1)


def test_the_8_bit_layer_holds_the_loaded_tensors():
    qt = _weight("W8G32", 40, 96)
    lin = codes_linear(qt)
    assert lin.codes.data_ptr() == qt.packed.data_ptr()
    assert lin.scales.data_ptr() == qt.scales.data_ptr()
    assert lin.nbytes == qt.nbytes
    assert cpu_gemv.codes_linear_nbytes(qt.fmt, qt.shape) is None  # nothing beyond them


def test_load_in_row_chunks_matches_one_piece(monkeypatch):
    qt = _weight("Q4G32M", 70, 64)
    whole = Q4GemvLinear(qt)
    monkeypatch.setattr(Q4GemvLinear, "CHUNK_ROWS", 16)
    chunked = Q4GemvLinear(qt)
    assert torch.equal(whole.codes, chunked.codes)


@pytest.mark.parametrize("op", ["gemv_q4", "gemv_q8"])
@pytest.mark.parametrize("blocks", [2, 4, 8, 16])
def test_one_scale_per_group_is_the_scale_repeated_per_block(op, blocks):
    """A group of 64-512 columns keeps one scale (and min) per group; the operator
    spreads it over the group's blocks of 32, exactly as the scales repeated per block
    (4- and 8-bit codes, with and without mins)."""
    g = torch.Generator().manual_seed(3)
    rows, cols = 24, 1536
    nbytes = cols // 2 if op == "gemv_q4" else cols
    codes = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=g)
    scales = (torch.rand(rows, cols // 32 // blocks, generator=g) * 0.02).half()
    mins = (torch.randn(rows, cols // 32 // blocks, generator=g) * 0.05).half()
    per_block = (scales.repeat_interleave(blocks, 1), mins.repeat_interleave(blocks, 1))
    x = _x(3, cols)
    run = getattr(torch.ops.ninfer_cpu, op)
    for m, mb in ((None, None), (mins, per_block[1])):
        assert torch.equal(run(x, codes, scales, m), run(x, codes, per_block[0], mb))


def test_a_code_book_with_mins_or_a_scale_per_16_is_refused():
    x, codes, book = _x(1, 64), torch.zeros(4, 32, dtype=torch.uint8), torch.arange(16).byte()
    per32, per16 = torch.ones(4, 2, dtype=torch.half), torch.ones(4, 4, dtype=torch.half)
    with pytest.raises(RuntimeError, match="code book"):
        torch.ops.ninfer_cpu.gemv_q4(x, codes, per32, torch.zeros_like(per32), None, book)
    with pytest.raises(RuntimeError, match="code book"):
        torch.ops.ninfer_cpu.gemv_q4(x, codes, per16, None, None, book)
    assert torch.ops.ninfer_cpu.gemv_q4(x, codes, per32, None, None, book).shape == (1, 4)


def test_a_group_the_operators_cant_spread_is_refused():
    x, codes = _x(1, 96), torch.zeros(4, 48, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="group of 16, 32, 64, 128, 256 or 512"):
        torch.ops.ninfer_cpu.gemv_q4(x, codes, torch.ones(4, 1, dtype=torch.half), None)


@pytest.mark.parametrize("fmt", ["Q5G64", "Q6G64", "Q5G32M", "Q6G16"])
@pytest.mark.parametrize("blocks", [16, 18, 35])
def test_5_and_6_bit_codes_are_nibbles_and_planes_of_high_bits(fmt, blocks):
    """5- and 6-bit codes keep their low four bits as the 4-bit layer's nibbles and the
    rest a bit a weight: the nibbles are those of the codes as a 4-bit layer lays them
    out, and the planes hold each code's high bits once, at the place the operator
    unpacks its nibble (whole steps of 16 blocks, and tails of 2 and 3 blocks)."""
    qt = _weight(fmt, 24, 32 * blocks, seed=blocks)
    cols = qt.padded_cols  # a group of 64 pads 35 blocks to 36
    blocks = cols // 32
    lin = TorchOps("cpu").pack_linear(qt, dtype=torch.bfloat16)
    assert isinstance(lin, Q4GemvLinear) and lin.planes == qt.fmt.bits - 4
    offset = -qt.fmt.qmin if qt.fmt.mins else 8 << lin.planes
    u = qt.codes().to(torch.int16) + offset  # 0 .. 2^bits - 1
    assert int(u.min()) >= 0 and int(u.max()) < 1 << qt.fmt.bits
    # the nibbles: a 4-bit layer of the codes' low four bits (its own layout)
    scales = torch.ones(24, blocks, dtype=torch.float16)
    four = QuantizedTensor(weight_format("Q4G32"), (24, cols), pack_codes((u & 15) - 8, 4), scales)
    assert torch.equal(lin.codes, Q4GemvLinear(four).codes)
    # the planes: unpacking the operator's chunks gives every column's high bits once
    bits = torch.stack([(lin.high >> i) & 1 for i in range(8)], dim=2).reshape(24, -1)
    chunks = cpu_gemv._high_bit_chunks(blocks)
    assert sorted(torch.cat(chunks).tolist()) == list(range(cols))
    at = 0
    for chunk in chunks:
        for p in range(lin.planes):
            assert torch.equal(bits[:, at : at + len(chunk)], ((u >> (4 + p)) & 1)[:, chunk])
            at += len(chunk)
    assert at == bits.shape[1]
    # 5 bits and a scale per 32 with a min: 6 bits a weight; 6 bits, a scale per 16: 7
    per_weight = 8 * lin.nbytes / (24 * cols)
    assert per_weight == qt.fmt.bits + 16 * (2 if qt.fmt.mins else 1) / qt.fmt.group


def test_other_dtypes_are_not_taken():
    assert not cpu_gemv.codes_supported(_weight("Q4G32", 8, 64).fmt, "cpu", torch.float32)
    assert not cpu_gemv.codes_supported(_weight("Q6G64", 8, 64).fmt, "cpu", torch.float16)


@pytest.mark.parametrize("fmt", ["Q4G32", "W8G32"])
def test_a_compiled_graph_calls_the_operator(fmt):
    lin = codes_linear(_weight(fmt, 40, 96))
    x = _x(2, 96)

    def fn(x):
        return torch.relu(lin(x * 2)) + 1

    got = compile_graph(fn)(x)  # as the decode step compiles
    assert torch.equal(got, fn(x))
