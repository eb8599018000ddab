"""ggml types kept in codes of ours that are not their own layout: Q4_K as Q4G32M, Q6_K as
Q6G16, Q5_K as Q5G32M, Q5_0 as Q5G32 (the types of llama.cpp's Q4_K_M and Q5_K_M files);
Q3_K as Q3G16, Q2_K as Q2G16M, IQ4_NL and IQ4_XS as IQ4G32 (indices into its code book):
all of them their own codes, on the 4-bit GEMV.

The reference is gguf-py's dequantizer (`gguf.quants.dequantize`). Q5_0's values equal it
bit for bit, and so do IQ4_NL's; the K-quants' (IQ4_XS among them) to within one fp16
rounding of each sub-block's scale and min, and bit for bit where those products are fp16
values already. The W8G16 GEMV is checked against float64 math; a tiny Llama written
with K-quant matrices (mixed per layer as llama.cpp's Q4_K_M mixes them) loads with them
kept and gives transformers' logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package (a main dependency) is missing")
from gguf import GGMLQuantizationType, quants  # noqa: E402
from kquants import ENCODERS, IQ4_VALUES  # noqa: E402

from ninfer_core.cli.main import main  # noqa: E402
from ninfer_core.errors import ArtifactError  # noqa: E402
from ninfer_core.kernels import cpu_gemv  # noqa: E402
from ninfer_core.quant.formats import FORMATS  # noqa: E402
from ninfer_core.quant.ggml import K_FORMATS, from_ggml_blocks, kept_format  # noqa: E402
from ninfer_core.quant.tensor import QuantizedTensor, quantize  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
SUPER_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}
#: Where each super-block's fp16 fields (d, and dmin) start.
HALVES_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
             "IQ4_XS": (0,)}  # fmt: skip
#: One fp16 rounding of a normal value, relative (round to nearest: half an ulp).
FP16_HALF_ULP = 2.0**-11
needs_gemv = pytest.mark.skipif(
    not cpu_gemv.available(), reason=f"no CPU GEMV here: {cpu_gemv.unavailable()}"
)


def random_super_blocks(type_name: str, rows: int, cols: int, seed: int, *, d=None) -> np.ndarray:
    """Arbitrary super-block bytes (every code and sub-block scale byte), with fp16 `d` (and
    `dmin`) of either sign and magnitude 1e-3 .. 1e-2 unless `d` is given."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, (n, SUPER_BYTES[type_name]), dtype=np.uint8)

    def halves() -> np.ndarray:
        if d is not None:
            v = np.full(n, d)
        else:
            v = rng.uniform(1e-3, 1e-2, n) * rng.choice([-1.0, 1.0], n)
        return v.astype(np.float16).view(np.uint8).reshape(n, 2)

    for at in HALVES_AT[type_name]:
        blocks[:, at : at + 2] = halves()
    return blocks.reshape(rows, -1)


def ggml_values(type_name: str, blocks: np.ndarray) -> np.ndarray:
    return quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float32)


def term_bound(type_name: str, blocks: np.ndarray, cols: int) -> np.ndarray:
    """Per weight, a bound on |scale * code| + |min| (the largest its sub-block can give,
    from gguf-py's own field decoding; for a type without mins other than Q6_K, the
    weight's own |value|): what one fp16 rounding of the scale and min is relative to."""
    flat = blocks.reshape(-1, SUPER_BYTES[type_name])
    if type_name in ("Q3_K", "IQ4_XS"):
        return np.abs(ggml_values(type_name, blocks).astype(np.float64))
    if type_name == "Q2_K":  # |d sc u| <= |w| + |m|, so |d sc u| + |m| <= |w| + 2 |m|
        dmin = flat[:, 82:84].copy().view(np.float16).astype(np.float64)
        m = np.abs(dmin * (flat[:, 0:16] >> 4))  # [n, 16 sub-blocks of 16]
        w = np.abs(ggml_values(type_name, blocks).astype(np.float64))
        return w + 2 * np.repeat(m, 16, axis=1).reshape(-1, cols)
    if type_name in ("Q4_K", "Q5_K"):
        d = flat[:, 0:2].copy().view(np.float16).astype(np.float64)
        dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float64)
        sc, mn = quants.Q4_K.get_scale_min(flat[:, 4:16].copy())
        top = 15 if type_name == "Q4_K" else 31
        bound = top * np.abs(d * sc) + np.abs(dmin * mn)  # [n, 8 sub-blocks of 32]
        per = 32
    else:
        d = flat[:, 208:210].copy().view(np.float16).astype(np.float64)
        sc = flat[:, 192:208].copy().view(np.int8).astype(np.float64)
        bound = 32 * np.abs(d * sc)  # [n, 16 sub-blocks of 16]
        per = 16
    return np.repeat(bound, per, axis=1).reshape(-1, cols)


def test_which_types_are_kept():
    assert kept_format("Q4_K") == "Q4G32M" and kept_format("Q6_K") == "Q6G16"
    assert kept_format("Q5_K") == "Q5G32M" and kept_format("Q5_1") == "Q5G32M"
    assert kept_format("Q5_0") == "Q5G32"
    assert kept_format("Q3_K") == "Q3G16" and kept_format("Q2_K") == "Q2G16M"
    assert kept_format("IQ4_NL") == "IQ4G32" and kept_format("IQ4_XS") == "IQ4G32"
    assert kept_format("IQ2_XXS") is None and kept_format("F16") is None
    assert {fmt for fmt, _ in K_FORMATS.values()} <= set(FORMATS)
    assert from_ggml_blocks("IQ3_S", b"", (0, 256)) is None


@pytest.mark.parametrize("type_name", sorted(ENCODERS))  # the types the tests write
def test_the_test_encoders_write_what_gguf_py_reads(type_name):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((4, 512)) * 0.05 + rng.standard_normal((4, 1)) * 0.02).astype(
        np.float32
    )
    blocks = ENCODERS[type_name](w)
    assert blocks.shape == (4, 2 * SUPER_BYTES[type_name])
    back = ggml_values(type_name, blocks)
    rel = np.linalg.norm(back - w) / np.linalg.norm(w)
    # plain absmax scales (no search): loose at 2 and 3 bits, as a test file needs
    limits = {"Q2_K": 0.4, "Q3_K": 0.25, "Q4_K": 0.12, "Q5_K": 0.06, "IQ4_XS": 0.12}
    limit = limits.get(type_name, 0.03)
    assert rel < limit, rel


@pytest.mark.parametrize("type_name", K_TYPES)
def test_values_are_ggmls_to_one_fp16_rounding_of_the_scales(type_name):
    rows, cols = 6, 768
    blocks = random_super_blocks(type_name, rows, cols, seed=1)
    qt = from_ggml_blocks(type_name, blocks, (rows, cols))
    assert qt.fmt.name == K_FORMATS[type_name][0] and qt.shape == (rows, cols)
    ours = qt.dequantize(torch.float32).numpy().astype(np.float64)
    want = ggml_values(type_name, blocks).astype(np.float64)
    bound = term_bound(type_name, blocks, cols)
    err = np.abs(ours - want)
    assert (err <= (FP16_HALF_ULP + 2.0**-22) * bound).all(), (err / bound).max()
    # and the rounding is not nothing: these random products are rarely fp16 values
    assert (err > 0).any()


@pytest.mark.parametrize("type_name", K_TYPES)
def test_bit_for_bit_where_the_products_are_fp16_values(type_name):
    # d = 2^-10: d * sc (sc < 128) and dmin * m are exact in fp16, so nothing rounds
    rows, cols = 3, 512
    blocks = random_super_blocks(type_name, rows, cols, seed=2, d=2.0**-10)
    qt = from_ggml_blocks(type_name, blocks, (rows, cols))
    want = ggml_values(type_name, blocks)
    got = qt.dequantize(torch.float32).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # rows and embedding lookups move whole rows of codes, scales and mins
    ids = torch.tensor([2, 0])
    assert torch.equal(qt.embedding(ids), torch.from_numpy(want)[ids])


@pytest.mark.parametrize(("type_name", "nbytes"), [("Q5_0", 22), ("Q5_1", 24)])
def test_q5_blocks_are_ggmls_bit_for_bit(type_name, nbytes):
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((7, 96)) * 0.05 + 0.02).astype(np.float32)
    arbitrary = rng.integers(0, 256, (7 * 3, nbytes), dtype=np.uint8)  # every qh bit, nibble
    fields = 2 if type_name == "Q5_1" else 1
    halves = (rng.standard_normal((21, fields)) * 0.01).astype(np.float16)
    arbitrary[:, : 2 * fields] = halves.view(np.uint8)
    for blocks in (quants.quantize(w, GGMLQuantizationType[type_name]), arbitrary.reshape(7, -1)):
        qt = from_ggml_blocks(type_name, blocks, (7, 96))
        assert qt.fmt.name == kept_format(type_name)
        want = ggml_values(type_name, blocks)
        assert np.array_equal(qt.dequantize().numpy().view(np.uint32), want.view(np.uint32))
        # the scales (and mins) are the blocks' own fp16 bits
        head = blocks.reshape(-1, nbytes)[:, : 2 * fields].copy().view(np.uint16)
        assert np.array_equal(qt.scales.numpy().view(np.uint16), head[:, 0].reshape(7, 3))
        if fields == 2:
            assert np.array_equal(qt.mins.numpy().view(np.uint16), head[:, 1].reshape(7, 3))


def test_iq4_nl_blocks_are_ggmls_bit_for_bit():
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (5 * 4, 18), dtype=np.uint8)  # every nibble
    blocks[:, 0:2] = (rng.standard_normal((20, 1)) * 0.01).astype(np.float16).view(np.uint8)
    blocks = blocks.reshape(5, -1)
    qt = from_ggml_blocks("IQ4_NL", blocks, (5, 128))
    assert qt.fmt.name == "IQ4G32"
    want = ggml_values("IQ4_NL", blocks)
    assert np.array_equal(qt.dequantize().numpy().view(np.uint32), want.view(np.uint32))
    # the scales are the blocks' own fp16 bits, the codes IQ4_NL's values themselves
    head = blocks.reshape(-1, 18)[:, 0:2].copy().view(np.uint16)
    assert np.array_equal(qt.scales.numpy().view(np.uint16), head.reshape(5, 4))
    assert set(qt.codes().unique().tolist()) <= set(IQ4_VALUES.tolist())


def test_a_scale_beyond_fp16_fails_with_the_reason():
    blocks = random_super_blocks("Q6_K", 1, 256, seed=3, d=60000.0)
    blocks[0, 192:208] = 100  # sc = 100: d * sc = 6e6
    with pytest.raises(ArtifactError, match="beyond fp16's range"):
        from_ggml_blocks("Q6_K", blocks, (1, 256))


def test_rows_of_whole_super_blocks_only():
    with pytest.raises(ArtifactError, match="256-weight blocks"):
        from_ggml_blocks("Q4_K", bytes(144), (1, 288))
    with pytest.raises(ArtifactError, match="takes 288 bytes"):
        from_ggml_blocks("Q4_K", bytes(144), (1, 512))


# --------------------------------------------------------------------------
# The GEMVs over the kept codes
# --------------------------------------------------------------------------


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


@needs_gemv
@pytest.mark.parametrize("type_name", sorted(ENCODERS))  # the types the tests write
def test_gemv_over_kept_codes_against_float64(type_name):
    rows, cols = 70, 1280  # 5 super-blocks a row: a step of 8 blocks of 32 and a part one
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    qt = from_ggml_blocks(type_name, ENCODERS[type_name](w), (rows, cols))
    layer = cpu_gemv.codes_linear(qt)
    want = cpu_gemv.Q4GemvLinear if qt.fmt.bits <= 6 else cpu_gemv.Q8GemvLinear
    assert isinstance(layer, want)
    # the prefill path's rows are the codes' exact values
    assert torch.equal(layer.weight_rows(0, rows, torch.float32), qt.dequantize(torch.float32))
    w64 = qt.dequantize(torch.float64)
    gen = torch.Generator().manual_seed(0)
    for t in (1, 3, layer.MAX_ROWS + 1):  # the GEMV, a speculative round, the dense path
        x = torch.randn(t, cols, generator=gen).bfloat16()
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (t, rows)
        # bf16 output rounding alone is 2^-9 relative
        assert rel_rms(got, x.double() @ w64.T) < 4e-3, t


@needs_gemv
@pytest.mark.parametrize("cols", [16, 48, 100, 160])
def test_w8g16_of_any_width(cols):
    # quantize() writes W8G16 of any width: an odd number of 16s pads one sub-block more
    gen = torch.Generator().manual_seed(cols)
    qt = quantize(torch.randn(9, cols, generator=gen), "W8G16")
    layer = cpu_gemv.codes_linear(qt)
    x = torch.randn(2, cols, generator=gen).bfloat16()
    assert rel_rms(layer(x), x.double() @ qt.dequantize(torch.float64).T) < 4e-3


@needs_gemv
def test_a_scale_per_16_on_4_bit_codes():
    """4-bit codes with a scale (and min) per 16 columns: against the same sums with the
    halves' scales applied in float64 (only x's two-plane rounding differs)."""
    g = torch.Generator().manual_seed(8)
    rows, cols = 12, 32 * 19  # a whole step of 16 blocks and a tail of 3
    blocks = torch.randint(0, 256, (rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = (torch.rand(rows, cols // 16, generator=g) * 0.02).half()
    mins = (torch.randn(rows, cols // 16, generator=g) * 0.05).half()
    x = torch.randn(2, cols, generator=g).bfloat16()
    # the operator's byte layout: blocks interleaved 16 at a time, nibbles j and j + 16
    codes = cpu_gemv._interleave_blocks(blocks)
    u = torch.cat((blocks & 15, blocks >> 4), dim=2).reshape(rows, cols).double()
    for m in (None, mins):
        d = scales.double().repeat_interleave(16, 1)
        w = u * d + (-8 * d if m is None else m.double().repeat_interleave(16, 1))
        got = torch.ops.ninfer_cpu.gemv_q4(x, codes, scales, m)
        assert rel_rms(got, x.double() @ w.T) < 4e-3


# --------------------------------------------------------------------------
# A model written with K-quants, end to end
# --------------------------------------------------------------------------

#: Layer 0 uniform per fused group (kept), its o Q5_K; layer 1's q|k|v mixes Q4_K and
#: Q6_K, as llama.cpp's Q4_K_M does in some layers (that group is held as Q6G16M, the same
#: values), and its o is Q5_0; layer 2 has the types of Q2_K and Q3_K_M files (q and k Q3_K beside
#: a Q4_K v: held as Q4G16M) and IQ4_XS. Untied Q6_K head.
TYPES = {
    "token_embd.weight": "Q4_K",
    "blk.0.attn_q.weight": "Q4_K",
    "blk.0.attn_k.weight": "Q4_K",
    "blk.0.attn_v.weight": "Q4_K",
    "blk.0.attn_output.weight": "Q5_K",
    "blk.0.ffn_gate.weight": "Q4_K",
    "blk.0.ffn_up.weight": "Q4_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "Q4_K",
    "blk.1.attn_k.weight": "Q4_K",
    "blk.1.attn_v.weight": "Q6_K",
    "blk.1.attn_output.weight": "Q5_0",
    "blk.1.ffn_gate.weight": "Q4_K",
    "blk.1.ffn_up.weight": "Q4_K",
    "blk.1.ffn_down.weight": "Q6_K",
    "blk.2.attn_q.weight": "Q3_K",
    "blk.2.attn_k.weight": "Q3_K",
    "blk.2.attn_v.weight": "Q4_K",
    "blk.2.attn_output.weight": "IQ4_XS",
    "blk.2.ffn_gate.weight": "Q2_K",
    "blk.2.ffn_up.weight": "Q2_K",
    "blk.2.ffn_down.weight": "Q3_K",
    "output.weight": "Q6_K",
}
L0, L1, L2 = "model.layers.0.", "model.layers.1.", "model.layers.2."
MIXED_GROUP = {L1 + f"self_attn.{p}_proj.weight" for p in "qkv"}
MIXED_NIBBLES = {L2 + f"self_attn.{p}_proj.weight" for p in "qkv"}
IDS = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(6)).tolist()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    pytest.importorskip("transformers", reason="transformers (the model writer) needs ninfer[dev]")
    from checkpoints import tiny_llama_config
    from test_gguf_reader import write_gguf
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(
        rope_scaling=None, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        head_dim=64, initializer_range=0.05,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    original = quants.quantize

    def quantize_k(a, kind):  # gguf-py cannot write K-quants: the tests' encoders do
        name = GGMLQuantizationType(kind).name
        return ENCODERS[name](a) if name in ENCODERS else original(a, kind)

    types = {name: GGMLQuantizationType[t] for name, t in TYPES.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quants, "quantize", quantize_k)
        return write_gguf(tmp_path_factory.mktemp("k") / "tiny-k.gguf", "llama", model,
                          types=types)  # fmt: skip


def _load(path, dtype: str, *, dense: bool = False):
    from test_gguf_quantized import load

    return load(path, dtype, dense=dense)


def _logits(loaded):
    from test_gguf_quantized import logits

    return logits(*loaded, ids=IDS)


def test_k_quant_matrices_load_kept(path):
    from ninfer_core.loading import open_artifact
    from ninfer_core.plugin_host import create_host

    art = open_artifact(create_host(), path)
    kept = 0
    for name in art.tensor_names():
        if len(art.tensor_shape(name)) != 2:
            continue
        weight = art.load_weight(name)
        kept += 1
        assert isinstance(weight, QuantizedTensor), name
        held = ("Q4G32M", "Q6G16", "Q5G32M", "Q5G32", "IQ4G32", "Q3G16", "Q2G16M")
        held = "Q6G16M" if name in MIXED_GROUP else "Q4G16M" if name in MIXED_NIBBLES else held
        assert weight.fmt.name == art.tensor_format(name) in held, name
        dense = art.load_tensor(name)  # gguf-py's values (q/k rows un-permuted alike)
        err = (weight.dequantize() - dense).abs().max() / dense.abs().max()
        assert err < 2 * FP16_HALF_ULP, (name, err)
    assert kept == len(TYPES)
    # the 2- and 3-bit K-quants in their own codes, IQ4_XS in its code book's indices
    assert art.tensor_format(L2 + "self_attn.q_proj.weight") == "Q4G16M"
    assert art.tensor_format(L2 + "mlp.down_proj.weight") == "Q3G16"
    assert art.tensor_format(L2 + "self_attn.o_proj.weight") == "IQ4G32"
    assert art.tensor_format(L2 + "mlp.up_proj.weight") == "Q2G16M"


def test_fp32_logits_are_transformers(path):
    from test_gguf_reader import reference

    got = _logits(_load(path, "fp32"))
    dense = _logits(_load(path, "fp32", dense=True))
    with torch.no_grad():
        want = reference(path)(torch.tensor([IDS])).logits[0]
    assert (dense - want).abs().max().item() <= 1e-4  # the dequantized path: exact values
    # kept: the scales rounded once to fp16 (2^-11 of each weight at most) move the logits
    # of these three layers by far less than bf16's weights would (rel < 0.03 below)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 3e-3, rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95


def test_bf16_runs_the_kept_codes(path):
    loaded = _load(path, "bf16")
    model = loaded[0].model
    if cpu_gemv.available():
        # Q6_K's, Q5_K's and Q4_K's codes on the 4-bit GEMV (5 and 6 bits with high bits)
        for proj in (model.layers[0].mlp.down_proj, model.layers[0].self_attn.o_proj,
                     model.layers[1].self_attn.qkv_proj, model.packed_head):  # fmt: skip
            assert isinstance(proj, cpu_gemv.Q4GemvLinear) and proj.high is not None
        assert isinstance(model.layers[0].mlp.gate_up_proj, cpu_gemv.Q4GemvLinear)
        for proj in (model.layers[2].self_attn.qkv_proj, model.layers[2].mlp.gate_up_proj):
            assert isinstance(proj, cpu_gemv.Q4GemvLinear)  # Q3_K|Q4_K's and Q2_K's codes
        o_proj = model.layers[2].self_attn.o_proj  # IQ4_XS: nibbles through the code book
        assert isinstance(o_proj, cpu_gemv.Q4GemvLinear) and o_proj.book is not None
    got, want = _logits(loaded), _logits(_load(path, "fp32", dense=True))
    rel = ((got - want).norm() / want.norm()).item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert rel < 0.03 and top1 >= 0.9, (rel, top1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_plan_sizes_what_the_load_holds(path, dtype, capsys):
    assert main(["plan", str(path), "--dtype", dtype, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["weights_bytes"]
    assert planned == _load(path, dtype)[0].model.weight_bytes()


def test_convert_keeps_the_codes(path, tmp_path, capsys):
    from ninfer_core.loading import open_artifact
    from ninfer_core.plugin_host import create_host

    out = tmp_path / "tiny-k.ninfer"
    assert main(["convert", str(path), str(out), "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    kept = {"Q4G32M", "Q6G16", "Q5G32M", "Q5G32", "IQ4G32", "Q6G16M", "Q3G16", "Q2G16M", "Q4G16M"}
    assert kept <= set(summary["by_format"])
    src, packed = open_artifact(create_host(), path), open_artifact(create_host(), out)
    for name in src.tensor_names():
        if src.tensor_format(name) in kept:
            assert packed.tensor_format(name) == src.tensor_format(name), name
            assert torch.equal(packed.load_weight(name).to_stored(),
                               src.load_weight(name).to_stored()), name  # fmt: skip
    assert main(["inspect", str(out)]) == 0
    assert "6-bit codes, fp16 scale per 16 (ggml Q6_K)" in capsys.readouterr().out
