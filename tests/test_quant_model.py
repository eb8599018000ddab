"""The dense runtime on quantized weights, against a dense model of the same values.

A fake artifact wraps a tiny Hugging Face folder and hands back `quantize(...)` per
recipe from `load_weight`, the way the `.ninfer` reader does; the comparison model
loads the *dequantized* weights densely. In fp32 the quantized model runs the
reference path (row chunks dequantized, `F.linear`) and must match to 1e-5; in bf16
the torch backend's int4-kernel path must stay close to the bf16 dense model.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import open_checkpoint, write_tiny_llama, write_tiny_qwen3

from ninfer_core.device import probe_device
from ninfer_core.engine import RuntimeSpec, Sequence, assemble_runtime
from ninfer_core.errors import ModelLoadError
from ninfer_core.kernels.cpu_gemv import Q4GemvLinear, Q8GemvLinear
from ninfer_core.model.weights import weight_plan
from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.recipes import recipe
from ninfer_core.quant.tensor import QuantizedTensor, quantize
from ninfer_plugins import backend_torch
from ninfer_plugins.backend_torch import Int4Linear, register_kernel_backends
from ninfer_plugins.kv_plain import register_kv_codecs
from ninfer_plugins.model_dense import register_model_families

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16
FAMILIES = {arch: fam for fam in register_model_families() for arch in fam.architectures}
CODECS = {codec.name: codec for codec in register_kv_codecs()}
KV = {torch.float32: "fp32", torch.bfloat16: "bf16"}
RECIPES = ["q4", "q6", "w8", "mixed"]
#: Stored bits per weight of each format's matrices (codes + one fp16 scale per group).
BITS = {"Q4G64": 4 + 16 / 64, "Q5G64": 5 + 16 / 64, "Q6G64": 6 + 16 / 64, "W8G32": 8 + 16 / 32}


class QuantArtifact:
    """An HF folder seen as a quantized container: `load_weight` gives what `recipe`
    says (a QuantizedTensor or a dense tensor); `dequantized=True` instead serves every
    tensor densely with the quantized values (the comparison model), no `load_weight`."""

    # Optional `Artifact` members (see ninfer_core.plugin_types), declared at their defaults.
    tensor_file = load_weight = tensor_format = object_table = with_components = None

    def __init__(self, path, recipe_name: str, *, dequantized: bool = False, override=None):
        self._inner = open_checkpoint(path)
        self.path, self.config = self._inner.path, self._inner.config
        self._recipe = recipe(recipe_name)
        self._override = override or {}
        if not dequantized:
            self.load_weight = self._weight

    def tensor_names(self):
        return self._inner.tensor_names()

    def tensor_shape(self, name):
        return self._inner.tensor_shape(name)

    def format_of(self, name) -> str:
        t = self._inner.load_tensor(name)
        return self._override.get(name) or self._recipe.format_for(name, t.shape, t.dtype)

    def _weight(self, name):
        t = self._inner.load_tensor(name)
        fmt = weight_format(self.format_of(name))
        return quantize(t, fmt.name) if fmt.quantized else t.to(fmt.dtype)

    def load_tensor(self, name):
        w = self._weight(name)
        return w.dequantize() if isinstance(w, QuantizedTensor) else w

    def read_text(self, name):
        return self._inner.read_text(name)


def build(artifact, dtype=torch.float32, num_blocks=24, pack=True):
    """The runner and model of `artifact`; `pack=False` leaves the weights as loaded (the
    reference path a backend without a kernel for them runs, e.g. on a CUDA device)."""
    family = FAMILIES[artifact.config["architectures"][0]]
    config = family.parse_config(artifact.config)
    ops = register_kernel_backends()[0].create_ops(probe_device(use_cuda=False))
    model = family.build(config, ops, dtype)
    family.load_weights(model, artifact)
    if pack:
        model.pack_weights()
    spec = RuntimeSpec(num_blocks, BLOCK)
    return assemble_runtime(model, config, dtype, CODECS[KV[dtype]], spec).runner, model


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def logits(runner, ids: list[int], decode: int = 8) -> torch.Tensor:
    """Prefill `ids`, then decode `decode` fixed tokens: [len(ids) + decode, vocab]."""
    seq = Sequence(ids)
    out = [runner.run([(seq, len(ids))], all_tokens=True)]
    for step in range(decode):
        seq.append_token((7 * step + 3) % 300)
        out.append(runner.run([(seq, 1)]))
    return torch.cat(out)


def greedy(runner, ids: list[int], n: int = 24) -> list[int]:
    seq = Sequence(ids)
    out = runner.run([(seq, len(ids))])
    for _ in range(n):
        seq.append_token(int(out[0].argmax()))
        out = runner.run([(seq, 1)])
    return seq.completion_ids


@pytest.fixture(scope="module", params=["qwen3", "llama96"])
def ckpt(request, tmp_path_factory):
    """Qwen3: tied head, every width a multiple of 64. Llama: untied head, hidden 96 and
    intermediate 160, so the last group of every row is zero-padded."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        return write_tiny_qwen3(path, num_hidden_layers=2)
    return write_tiny_llama(
        path,
        num_hidden_layers=2,
        hidden_size=96,
        intermediate_size=160,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
    )


# --------------------------------------------------------------------------
# fp32: the reference path is the dense model of the dequantized weights
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECIPES)
def test_fp32_logits_match_dequantized_dense_model(ckpt, name):
    runner, model = build(QuantArtifact(ckpt, name), pack=False)
    dense_runner, _ = build(QuantArtifact(ckpt, name, dequantized=True))
    matrices = [
        model.embed_tokens,
        model.layers[0].self_attn.qkv_proj,
        model.layers[1].mlp.down_proj,
    ]
    assert all(isinstance(m, QuantizedTensor) for m in matrices)  # installed, never densified
    assert "embed_tokens" not in dict(model.named_parameters())
    ids = prompt(40)
    got, want = logits(runner, ids), logits(dense_runner, ids)
    assert (got - want).abs().max().item() <= 1e-5
    assert greedy(runner, ids[:12]) == greedy(dense_runner, ids[:12])
    # Packed for fp32 compute, the torch backend dequantizes the projections once, at
    # load: the same numbers, and no step dequantizes anything again.
    packed_runner, packed = build(QuantArtifact(ckpt, name))
    assert isinstance(packed.embed_tokens, QuantizedTensor)  # a lookup: rows only
    for layer in packed.layers:
        for w in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(w, torch.Tensor) and w.dtype == torch.float32
    assert (logits(packed_runner, ids) - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", RECIPES)
def test_weight_bytes_count_the_stored_formats(ckpt, name):
    artifact = QuantArtifact(ckpt, name)
    _, model = build(artifact, pack=False)
    _, dense = build(QuantArtifact(ckpt, name, dequantized=True), pack=False)
    saved = 0
    for slot in weight_plan(model.config):
        fmt = weight_format(artifact.format_of(slot.hf_name))
        if fmt.quantized:
            saved += slot.shape[0] * slot.shape[1] * 4 - fmt.stored_nbytes(slot.shape)
    assert saved > 0
    assert model.weight_bytes() == dense.weight_bytes() - saved


def test_weight_bytes_per_weight_match_the_formats_bits(tmp_path):
    # Every width a multiple of 64, so no padded groups: exactly BITS per weight.
    path = write_tiny_qwen3(tmp_path, num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                            head_dim=32, vocab_size=256)  # fmt: skip
    _, dense = build(QuantArtifact(path, "bf16"))  # bf16 values in fp32 parameters
    matrices = sum(s.shape[0] * s.shape[1] for s in weight_plan(dense.config) if len(s.shape) == 2)
    rest = dense.weight_bytes() - 4 * matrices  # norms (and any caches) stay as they are
    bits = {
        r: (build(QuantArtifact(path, r), pack=False)[1].weight_bytes() - rest) * 8 / matrices
        for r in RECIPES
    }
    assert bits["q4"] == BITS["Q4G64"] == 4.25
    assert bits["q6"] == BITS["Q6G64"] == 6.25
    assert bits["w8"] == BITS["W8G32"] == 8.5
    assert BITS["Q4G64"] < bits["mixed"] < BITS["Q6G64"]


# --------------------------------------------------------------------------
# bf16: the int4-kernel fast path
# --------------------------------------------------------------------------


@pytest.mark.skipif(not backend_torch._INT4_CPU, reason="torch lacks the CPU int4 kernel")
@pytest.mark.parametrize("name", RECIPES)
def test_bf16_fast_path_is_as_close_as_bf16_dense(ckpt, name):
    runner, model = build(QuantArtifact(ckpt, name), dtype=torch.bfloat16)
    packed = (Int4Linear, Q4GemvLinear, Q8GemvLinear)
    assert isinstance(model.layers[0].self_attn.qkv_proj, packed)
    assert isinstance(model.layers[1].mlp.down_proj, packed)
    assert isinstance(model.packed_head, packed)
    assert isinstance(model.embed_tokens, QuantizedTensor)  # lookups dequantize rows only
    dense_bf16, _ = build(QuantArtifact(ckpt, name, dequantized=True), dtype=torch.bfloat16)
    exact, _ = build(QuantArtifact(ckpt, name, dequantized=True))  # fp32, same weights
    ids = prompt(40)
    want = logits(exact, ids)
    span = want.abs().max().item()
    err_fast = (logits(runner, ids) - want).abs().max().item() / span
    err_dense = (logits(dense_bf16, ids) - want).abs().max().item() / span
    # bf16 on these models lands 1.1-1.6% of the logit range off fp32 either way; the
    # fast path (bf16 scales, the kernel's own accumulation order) measured 1.1-1.7%,
    # at most 1.12x the dense bf16 error.
    assert err_fast <= 0.025
    assert err_fast <= 1.5 * err_dense


@pytest.mark.skipif(not backend_torch._INT4_CPU, reason="torch lacks the CPU int4 kernel")
@pytest.mark.parametrize("fmt", ["Q4G64", "Q5G64", "Q6G64", "W8G32"])
def test_int4_linear_against_exact_dequantized_gemm(fmt, monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=g) * 0.05  # 300 rows: padded to 304 for the kernel
    x = torch.randn(5, 96, generator=g).bfloat16()
    b = torch.randn(300, generator=g).bfloat16()
    qt = quantize(w, fmt)
    exact = x.double() @ qt.dequantize(torch.float64).T + b.double()
    fast = Int4Linear(qt)(x, b)
    ref = qt.linear(x, b)  # the bf16 reference path: weights rounded to bf16, F.linear
    assert fast.shape == (5, 300) and fast.dtype == torch.bfloat16
    scale = exact.abs().max().item()
    err_fast = (fast.double() - exact).abs().max().item() / scale
    err_ref = (ref.double() - exact).abs().max().item() / scale
    # Both carry bf16 rounding of the output (2^-9 relative); neither may be far off.
    assert err_fast <= 2**-7 and err_ref <= 2**-7  # measured <= 0.4% at [1024, 1024]
    # Converting in row chunks packs exactly like converting the whole matrix.
    monkeypatch.setattr(Int4Linear, "CHUNK_ROWS", 64)
    chunked = Int4Linear(qt)
    assert torch.equal(chunked(x, b), fast)


def test_fp32_quantized_weights_are_dequantized_once_at_load(ckpt):
    ops = register_kernel_backends()[0].create_ops(probe_device(use_cuda=False))
    qt = quantize(torch.randn(64, 64), "Q4G64")
    dense = ops.pack_linear(qt, dtype=torch.float32)
    assert torch.equal(dense, qt.dequantize(torch.float32))
    assert ops.packed_nbytes("Q4G64", (64, 64), dtype=torch.float32) == dense.nbytes
    assert ops.pack_linear(qt) is qt  # no compute dtype said: kept as it is


# --------------------------------------------------------------------------
# Loading errors
# --------------------------------------------------------------------------


def test_mixed_dense_and_quantized_in_a_fused_group_is_refused(ckpt):
    k = "model.layers.0.self_attn.k_proj.weight"
    artifact = QuantArtifact(ckpt, "q4", override={k: "fp32"})
    with pytest.raises(ModelLoadError) as err:
        build(artifact)
    msg = str(err.value)
    assert "\n" not in msg and "qkv_proj" in msg
    assert "model.layers.0.self_attn.q_proj.weight (Q4G64)" in msg and f"{k} (dense)" in msg


def test_two_formats_in_a_fused_group_are_refused(ckpt):
    up = "model.layers.1.mlp.up_proj.weight"
    artifact = QuantArtifact(ckpt, "q4", override={up: "Q6G64"})
    with pytest.raises(ModelLoadError, match="different formats") as err:
        build(artifact)
    assert f"{up} (Q6G64)" in str(err.value)
