"""Quantized weight formats against an independent numpy float64 oracle.

The oracle (`oracle_quantize`, `oracle_pack`) restates the definition in
`ninfer_core/quant/tensor.py` with numpy and Python integers only: per group absmax,
scale = fp16(min(absmax / qmax, 65504)) (numpy's float64 -> float16 cast rounds once),
codes = clip(rint(w / scale)) or 0 where the scale is 0, each row a little-endian bit
stream of offset-binary codes. Every format must give exactly its codes, scales, bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ninfer_core.errors import ArtifactError, UnknownNameError
from ninfer_core.quant import codes as codes_mod
from ninfer_core.quant import tensor as tensor_mod
from ninfer_core.quant.codes import pack_codes, unpack_codes
from ninfer_core.quant.formats import FORMATS, weight_format
from ninfer_core.quant.recipes import RECIPES, ROLE_GROUPS, recipe
from ninfer_core.quant.tensor import QuantizedTensor, quantize

#: The symmetric formats, which this oracle defines; the asymmetric ones (Q4G32M) have
#: their own oracle in tests/test_quant_ggml.py, and the code book (IQ4G32) its own below.
QUANTIZED = [name for name, f in FORMATS.items() if f.quantized and not f.mins and f.book is None]


# --------------------------------------------------------------------------
# The float64 oracle
# --------------------------------------------------------------------------


def oracle_quantize(w: np.ndarray, fmt_name: str) -> tuple[np.ndarray, np.ndarray]:
    """w: float64 [rows, cols] -> codes int64 [rows, padded], scales float16 [rows, groups]."""
    fmt = weight_format(fmt_name)
    rows, cols = w.shape
    group = fmt.group
    padded = -(-cols // group) * group
    qmax = 2 ** (fmt.bits - 1) - 1
    wp = np.zeros((rows, padded), dtype=np.float64)
    wp[:, :cols] = w
    g = wp.reshape(rows, padded // group, group)
    absmax = np.abs(g).max(axis=-1)
    scales = np.minimum(absmax / qmax, 65504.0).astype(np.float16)
    s = scales.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(g / s), -qmax - 1, qmax)  # rint: round half to even
    q = np.where(s > 0, q, 0.0)
    return q.astype(np.int64).reshape(rows, padded), scales


def oracle_pack(codes: np.ndarray, bits: int) -> bytes:
    """Rows of codes -> the stored code block, one Python integer per row."""
    out = b""
    for row in codes:
        acc = 0
        for i, c in enumerate(row):
            acc |= (int(c) + 2 ** (bits - 1)) << (i * bits)
        out += acc.to_bytes(len(row) * bits // 8, "little")
    return out


def oracle_stored(w: np.ndarray, fmt_name: str) -> bytes:
    codes, scales = oracle_quantize(w, fmt_name)
    return oracle_pack(codes, weight_format(fmt_name).bits) + scales.astype("<f2").tobytes()


def check_against_oracle(w: torch.Tensor, fmt_name: str) -> QuantizedTensor:
    qt = quantize(w, fmt_name)
    want_codes, want_scales = oracle_quantize(w.double().numpy(), fmt_name)
    assert np.array_equal(qt.codes().numpy().astype(np.int64), want_codes)
    assert np.array_equal(qt.scales.numpy().view(np.uint16), want_scales.view(np.uint16))
    # Dequantized values: code * scale, exact in float64 and in fp32.
    cols = w.shape[1]
    want = (want_codes * want_scales.astype(np.float64).repeat(qt.fmt.group, axis=1))[:, :cols]
    got = qt.dequantize(torch.float32)
    assert np.array_equal(got.double().numpy(), want)
    assert qt.to_stored().numpy().tobytes() == oracle_stored(w.double().numpy(), fmt_name)
    return qt


def rand(rows: int, cols: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 0.05).to(dtype)


# --------------------------------------------------------------------------
# Encoder vs oracle
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_matrices_match_oracle(fmt, dtype):
    for i, (rows, cols) in enumerate([(8, 256), (5, 100), (3, 65), (1, 31), (4, 64)]):
        qt = check_against_oracle(rand(rows, cols, seed=i, dtype=dtype), fmt)
        assert qt.shape == (rows, cols)
        assert qt.nbytes == qt.fmt.stored_nbytes((rows, cols)) == qt.to_stored().numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_code_book_takes_the_nearest_value(dtype):
    """IQ4G32 (ggml's IQ4_NL code book): per group of 32 the fp16 scale absmax / 127 and,
    per weight, the index of the book value nearest w / scale (the lower on a tie), in
    float64; its codes are the values themselves."""
    fmt = weight_format("IQ4G32")
    book = np.array(fmt.book, dtype=np.float64)
    for i, (rows, cols) in enumerate([(8, 256), (5, 100), (3, 64)]):
        w = rand(rows, cols, seed=i, dtype=dtype)
        w[0, :32] = 0  # an all-zero group: scale 0, every weight 0
        qt = quantize(w, "IQ4G32")
        wp = np.zeros((rows, -(-cols // 32) * 32))
        wp[:, :cols] = w.double().numpy()
        g = wp.reshape(rows, -1, 32)
        scales = np.minimum(np.abs(g).max(-1) / 127, 65504.0).astype(np.float16)
        s = scales.astype(np.float64)[..., None]
        units = np.divide(g, s, out=np.zeros_like(g), where=s > 0)
        index = np.abs(units[..., None] - book).argmin(-1)  # the first of equals: the lower
        assert np.array_equal(qt.scales.numpy().view(np.uint16), scales.view(np.uint16))
        assert np.array_equal(qt.codes().numpy().reshape(index.shape), book[index].astype(np.int8))
        want = (book[index] * s).reshape(rows, -1)[:, :cols]
        assert np.array_equal(qt.dequantize(torch.float32).double().numpy(), want)
        assert qt.nbytes == fmt.stored_nbytes((rows, cols)) == rows * (-(-cols // 32)) * 18
    ties = torch.tensor([[-127.0, 7.0, -4.5, 101.0] + [0.0] * 28])  # scale 1; 7 is mid 1, 13
    assert quantize(ties, "IQ4G32").codes()[0, :4].tolist() == [-127, 1, -10, 89]


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_edge_case_groups(fmt):
    f = weight_format(fmt)
    g = f.group
    w = rand(6, 3 * g + 5, seed=3)
    w[0, :g] = 0  # an all-zero group: scale 0, codes 0
    w[1, 5] = 1000.0  # one huge outlier: the rest of its group rounds to 0
    w[2, g : 2 * g] = 1e-9  # a scale that rounds to 0 in fp16: codes 0
    w[3, :g] = 3e-6  # a subnormal fp16 scale
    w[4, 2 * g + 1] = -2e9  # absmax / qmax beyond fp16: scale clamps to 65504, codes saturate
    qt = check_against_oracle(w, fmt)
    codes, scales = qt.codes(), qt.scales.float()
    assert scales[0, 0] == 0 and not codes[0, :g].any()
    assert scales[2, 1] == 0 and not codes[2, g : 2 * g].any()
    assert scales[4, 2] == 65504 and codes[4, 2 * g + 1] == f.qmin
    assert codes[1, 5] == f.qmax and (codes[1, :g] != 0).sum() == 1
    assert not codes[:, 3 * g + 5 :].any()  # the zero padding of the last group


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_exact_half_multiples_round_half_to_even(fmt):
    f = weight_format(fmt)
    s = 2.0**-8  # an exact fp16 scale: the group's absmax is qmax * s
    halves = np.arange(-f.qmax, f.qmax) + 0.5  # ties within [-qmax, qmax]
    halves = halves[np.linspace(0, len(halves) - 1, min(len(halves), f.group - 1)).astype(int)]
    row = np.zeros(f.group)
    row[0] = f.qmax
    row[1 : 1 + len(halves)] = halves
    w = torch.tensor(row * s, dtype=torch.float32)[None]
    qt = check_against_oracle(w, fmt)
    assert qt.scales[0, 0].item() == s
    got = qt.codes()[0, 1 : 1 + len(halves)].numpy()
    assert np.array_equal(got, np.rint(halves))
    assert (got % 2 == 0).all()  # ties went to the even neighbour


def test_fp16_scale_is_rounded_once_not_twice():
    # absmax / 7 = 1 + 2^-11 + 2^-40: just above an fp16 midpoint, but rounding to fp32
    # first lands on the midpoint and then rounds down to 1.0; the right answer is up.
    w = torch.zeros(1, 64, dtype=torch.float64)
    w[0, 0] = 7 * (1 + 2**-11 + 2**-40)
    qt = check_against_oracle(w, "Q4G64")
    assert qt.scales[0, 0].item() == 1 + 2**-10
    x = torch.rand(20_000, dtype=torch.float64) * 1e-3 * torch.logspace(0, 9, 20_000).double()
    x = x.clamp(max=65504)
    want = x.numpy().astype(np.float16).view(np.uint16)
    assert np.array_equal(tensor_mod._round_fp16(x).numpy().view(np.uint16), want)


def test_refuses_non_finite_dense_and_non_matrix():
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize(torch.tensor([[1.0, float("nan")]]), "Q4G64")
    with pytest.raises(ValueError, match="dense format"):
        quantize(torch.ones(2, 64), "bf16")
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.ones(64), "Q4G64")
    with pytest.raises(UnknownNameError, match="Q4G64"):
        quantize(torch.ones(2, 64), "Q3G64")


def test_row_chunking_gives_the_same_result(monkeypatch):
    w = rand(37, 100, seed=9)
    whole = {f: quantize(w, f).to_stored() for f in QUANTIZED}
    monkeypatch.setattr(tensor_mod, "_CHUNK_ELEMS", 300)
    monkeypatch.setattr(codes_mod, "_CHUNK_CODES", 200)
    for f in QUANTIZED:
        qt = quantize(w, f)
        assert torch.equal(qt.to_stored(), whole[f])
        x = rand(3, 100, seed=1)
        assert torch.allclose(qt.linear(x), x @ qt.dequantize().T, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------
# The stored bytes, by hand
# --------------------------------------------------------------------------


def test_hand_checked_code_streams():
    def stream(codes, bits):
        row = torch.zeros(1, 64, dtype=torch.int8)
        row[0, : len(codes)] = torch.tensor(codes, dtype=torch.int8)
        return pack_codes(row, bits)[0].tolist()

    # 4 bits: two codes a byte, low nibble first; -8 -> 0x0, 7 -> 0xF, 0 -> 0x8.
    assert stream([-8, 7, 0, 1, -1, 3], 4)[:4] == [0xF0, 0x98, 0xB7, 0x88]
    # 5 bits: c0 = -16 -> 00000, c1 = 15 -> 11111 at bits 5..9, c2 = 0 -> 10000 at 10..14.
    b5 = stream([-16, 15], 5)
    assert b5[:2] == [0xE0, 0x43] and len(b5) == 40
    # 6 bits: c1 = 31 -> 111111 at bits 6..11, c2 = 0 -> 100000 at bits 12..17.
    b6 = stream([-32, 31], 6)
    assert b6[:3] == [0xC0, 0x0F, 0x82] and len(b6) == 48
    assert stream([-128, 127, 0, -1], 8)[:4] == [0x00, 0xFF, 0x80, 0x7F]


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_pack_unpack_round_trip_matches_oracle(bits):
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    codes = torch.randint(lo, hi, (7, 128), generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes.to(torch.int8), bits)
    assert packed.shape == (7, 128 * bits // 8)
    assert packed.numpy().tobytes() == oracle_pack(codes.numpy(), bits)
    assert torch.equal(unpack_codes(packed, bits), codes.to(torch.int8))


def test_stored_layout_is_codes_then_little_endian_scales():
    w = rand(3, 100, seed=5)
    qt = quantize(w, "Q5G64")
    data = qt.to_stored()
    code_bytes = qt.fmt.code_bytes((3, 100))
    assert code_bytes == 3 * 128 * 5 // 8
    assert data[:code_bytes].numpy().tobytes() == qt.packed.numpy().tobytes()
    assert data[code_bytes:].numpy().tobytes() == qt.scales.numpy().astype("<f2").tobytes()


# --------------------------------------------------------------------------
# QuantizedTensor
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_from_stored_round_trip_is_zero_copy(fmt):
    qt = quantize(rand(9, 100, seed=2), fmt)
    data = qt.to_stored()
    back = QuantizedTensor.from_stored(fmt, (9, 100), data)
    assert torch.equal(back.to_stored(), data)
    assert torch.equal(back.dequantize(), qt.dequantize())
    assert back.packed.data_ptr() == data.data_ptr()
    assert back.scales.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
    # An odd start address (a byte-packed container) still reads; the scales get copied.
    odd = torch.cat((torch.zeros(1, dtype=torch.uint8), data))[1:]
    assert torch.equal(
        QuantizedTensor.from_stored(fmt, [9, 100], odd).dequantize(), qt.dequantize()
    )


def test_from_stored_refuses_wrong_sizes():
    data = quantize(rand(4, 64), "Q4G64").to_stored()
    with pytest.raises(ArtifactError, match="needs"):
        QuantizedTensor.from_stored("Q4G64", (4, 64), data[:-1])
    with pytest.raises(ArtifactError, match="needs"):
        QuantizedTensor.from_stored("Q4G64", (4, 64), data.view(torch.int8))
    with pytest.raises(UnknownNameError):
        QuantizedTensor.from_stored("Q7G64", (4, 64), data)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_cat_rows_equals_quantizing_the_stack(fmt):
    a, b, c = rand(5, 100, seed=1), rand(3, 100, seed=2), rand(1, 100, seed=3)
    stacked = QuantizedTensor.cat_rows([quantize(a, fmt), quantize(b, fmt), quantize(c, fmt)])
    assert stacked.shape == (9, 100)
    assert torch.equal(stacked.to_stored(), quantize(torch.cat((a, b, c)), fmt).to_stored())


def test_cat_rows_refuses_mixed_formats_and_widths():
    with pytest.raises(ValueError, match="one format"):
        QuantizedTensor.cat_rows([quantize(rand(2, 64), "Q4G64"), quantize(rand(2, 64), "Q5G64")])
    with pytest.raises(ValueError, match="one format"):
        QuantizedTensor.cat_rows([quantize(rand(2, 64), "Q4G64"), quantize(rand(2, 96), "Q4G64")])


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows(fmt, dtype):
    qt = quantize(rand(50, 100, seed=4), fmt)
    ids = torch.tensor([[3, 0, 49], [7, 7, 12]])
    got = qt.embedding(ids, dtype)
    assert got.shape == (2, 3, 100) and got.dtype == dtype
    assert torch.equal(got, qt.dequantize(dtype)[ids])


def test_reference_linear_equals_dense_of_dequantized():
    qt = quantize(rand(40, 100, seed=6), "W8G32")
    x, b = rand(4, 100, seed=7), rand(1, 40, seed=8)[0]
    for dtype in (torch.float32, torch.bfloat16):
        want = torch.nn.functional.linear(x.to(dtype), qt.dequantize(dtype), b.to(dtype))
        assert torch.equal(qt.linear(x.to(dtype), b.to(dtype)), want)


# --------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------

HF_NAMES = {
    "model.embed_tokens.weight": (300, 64),
    "lm_head.weight": (300, 64),
    "model.norm.weight": (64,),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.layers.0.post_attention_layernorm.weight": (64,),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.self_attn.k_proj.weight": (32, 64),
    "model.layers.0.self_attn.v_proj.weight": (32, 64),
    "model.layers.0.self_attn.q_proj.bias": (64,),
    "model.layers.0.self_attn.o_proj.weight": (64, 64),
    "model.layers.0.self_attn.q_norm.weight": (16,),
    "model.layers.0.mlp.gate_proj.weight": (128, 64),
    "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 128),
    "model.layers.0.mlp.router.weight": (8, 64),  # a matrix of no known role
}


def formats(name: str, dtype=torch.bfloat16) -> dict[str, str]:
    r = recipe(name)
    return {n: r.format_for(n, shape, dtype) for n, shape in HF_NAMES.items()}


def test_mixed_recipe_assignments():
    got = formats("mixed")
    layer = "model.layers.0."
    assert got["model.embed_tokens.weight"] == got["lm_head.weight"] == "Q6G64"
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj"):
        assert got[layer + proj + ".weight"] == "Q4G64"
    assert got[layer + "mlp.up_proj.weight"] == "Q4G64"
    assert got[layer + "self_attn.o_proj.weight"] == got[layer + "mlp.down_proj.weight"] == "Q5G64"
    assert got[layer + "mlp.router.weight"] == "bf16"
    for name, shape in HF_NAMES.items():
        if len(shape) == 1:
            assert got[name] == "bf16"
    assert formats("mixed", torch.float32)["model.norm.weight"] == "fp32"
    assert formats("mixed", torch.float16)[layer + "self_attn.q_proj.bias"] == "fp16"


@pytest.mark.parametrize(("name", "fmt"), [("q4", "Q4G64"), ("q6", "Q6G64"), ("w8", "W8G32")])
def test_uniform_recipes_quantize_every_matrix(name, fmt):
    for tensor, f in formats(name, torch.float32).items():
        assert f == (fmt if len(HF_NAMES[tensor]) == 2 else "fp32"), tensor


def test_bf16_recipe_stores_everything_bf16():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert set(formats("bf16", dtype).values()) == {"bf16"}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fused_groups_get_one_format_and_describe_is_json(name):
    r = recipe(name)
    for group in ROLE_GROUPS.values():
        for layer in (0, 17):
            for attn_or_mlp in ("self_attn", "mlp"):
                got = {
                    r.format_for(f"model.layers.{layer}.{attn_or_mlp}.{m}.weight", (64, 64), dt)
                    for m in group
                    for dt in (torch.bfloat16,)
                }
                assert len(got) == 1, (name, group, got)
    described = json.loads(json.dumps(r.describe()))
    assert described["name"] == name and set(described["roles"]) == set(ROLE_GROUPS)


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(UnknownNameError) as err:
        recipe("q3")
    message = str(err.value)
    assert "'q3'" in message
    for name in ("bf16", "mixed", "q4", "q6", "w8"):
        assert name in message
