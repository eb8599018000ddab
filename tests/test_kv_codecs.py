"""KV codec conformance: every registered codec, against float64 oracles and fp32 attention.

The codecs under test are the host's (`create_host().kv_codecs`: fp16/bf16/fp32, any
installed third-party codec) plus the quantized plugin modules registered in process
when the entry points do not already provide them. Each known codec has a float64
oracle of its own recipe written here, independently of `ninfer_core.kv.quant`; a
third-party codec without one still runs every other check. Measured figures quoted
in `docs/kv-cache.md` come from `measure_attention` and `measure_end_to_end`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checkpoints import open_checkpoint, write_tiny_qwen3

import ninfer_plugins.kv_fp8
import ninfer_plugins.kv_int8
import ninfer_plugins.kv_rk8v4
from ninfer_core.bench.agreement import logit_agreement, rel_rms
from ninfer_core.device import probe_device, simulated_device
from ninfer_core.engine import ModelRunner, RuntimeSpec, Sequence, assemble_runtime
from ninfer_core.errors import UnsupportedChoiceError
from ninfer_core.kv import KVLayout
from ninfer_core.kv.hadamard import HeadRotation, hadamard, hadamard_block
from ninfer_core.kv.quant import FP8, INT4, INT8, group_size
from ninfer_core.plugin_host import PluginHost, create_host
from ninfer_core.selection import choose
from ninfer_plugins.backend_torch import register_kernel_backends
from ninfer_plugins.model_dense import register_model_families

#: Our plugin modules, under the entry-point names the lead adds to pyproject.toml.
EXTRA_PLUGINS = [
    ("kv-int8", ninfer_plugins.kv_int8),
    ("kv-rk8v4", ninfer_plugins.kv_rk8v4),
    ("kv-fp8", ninfer_plugins.kv_fp8),
]


def codec_host() -> PluginHost:
    """The host's codecs plus ours, each plugin once (whatever name it was loaded under)."""
    base = create_host()
    missing = [
        (name, mod)
        for name, mod in EXTRA_PLUGINS
        if not base.pm.has_plugin(name) and not base.pm.is_registered(mod)
    ]
    return create_host(extra_plugins=missing) if missing else base


HOST = codec_host()
CODECS = {e.name: e.obj for e in HOST.kv_codecs.entries()}
CPU = probe_device(use_cuda=False)


# --------------------------------------------------------------------------
# Float64 oracles, written from the recipe in docs/kv-cache.md
# --------------------------------------------------------------------------


def oracle_scales(xg: torch.Tensor, qmax: float) -> torch.Tensor:
    """xg: [..., n, G] float64 -> scales [..., n] float64: fp16(fp32(amax / qmax)), floored."""
    s = (xg.abs().amax(-1) / qmax).float().half().double()
    return s.clamp(2.0**-24, 65504.0)


def oracle_int(x: torch.Tensor, qmax: float, lo: int, hi: int):
    """(integer codes [..., D] int64, scales [..., n]) of the symmetric group recipe."""
    xg = x.double().unflatten(-1, (-1, group_size(x.shape[-1])))
    s = oracle_scales(xg, qmax)
    codes = torch.round(xg / s[..., None]).clamp(lo, hi)  # round half to even
    return codes.flatten(-2).long(), s


def e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round float64 to the nearest float8 e4m3fn value (ties to even), saturating at 448."""
    a = y.abs().clamp(max=448.0)
    _, exp = torch.frexp(a)  # a = m * 2**exp, m in [0.5, 1)
    step = 2.0 ** ((exp - 1).clamp(min=-6) - 3).double()  # 3 mantissa bits; subnormals 2**-9
    return torch.sign(y) * (torch.round(a / step) * step).clamp(max=448.0)


def oracle_fp8(x: torch.Tensor):
    xg = x.double().unflatten(-1, (-1, group_size(x.shape[-1])))
    s = oracle_scales(xg, 448.0)
    return e4m3(xg / s[..., None]).flatten(-2), s


def dequant(values: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (values.double().unflatten(-1, (s.shape[-1], -1)) * s[..., None]).flatten(-2)


def sylvester(n: int) -> torch.Tensor:
    """Normalized Hadamard by Kronecker powers of [[1, 1], [1, -1]], float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h / n**0.5


def rotate(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    p = hadamard_block(x.shape[-1])
    h = sylvester(p)
    return (x.double().unflatten(-1, (-1, p)) @ (h.T if inverse else h)).flatten(-2)


def oracle_int8(x):
    return dequant(*oracle_int(x, 127.0, -127, 127))


def oracle_int4(x):
    return dequant(*oracle_int(x, 7.0, -8, 7))


def oracle_toy(x):
    s = (x.double().abs().amax(-1, keepdim=True) / 32767).float().clamp_min(1e-12).double()
    return torch.round(x.double() / s).clamp(-32767, 32767) * s


#: codec -> (oracle_k, oracle_v, tolerance of store vs oracle: 0 means bit-exact).
ORACLES = {
    "fp32": (lambda x: x.double(), lambda x: x.double(), 0.0),
    "fp16": (lambda x: x.half().double(), lambda x: x.half().double(), 0.0),
    "bf16": (lambda x: x.bfloat16().double(), lambda x: x.bfloat16().double(), 0.0),
    "int8": (oracle_int8, oracle_int8, 0.0),
    "fp8": (lambda x: dequant(*oracle_fp8(x)), lambda x: dequant(*oracle_fp8(x)), 0.0),
    # fp32 rotation vs float64 rotation may move a value across a rounding edge.
    "rk8v4": (
        lambda x: rotate(oracle_int8(rotate(x)), inverse=True),
        lambda x: rotate(oracle_int4(rotate(x)), inverse=True),
        1e-3,
    ),
    # fp32 scales (24 bits) leave fp32 division a rare off-by-one code: one step allowed.
    "toy-int16": (oracle_toy, oracle_toy, 1e-4),
}


def kv_data(t: int, hkv: int, d: int, outliers: bool, seed: int = 0):
    """Random K, V [t, hkv, d]; with `outliers`, channel 5 of every head scaled ×50."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    if outliers:
        k[..., 5] *= 50
        v[..., 5] *= 50
    return k, v


# --------------------------------------------------------------------------
# Quantizers: exact codes against the oracle
# --------------------------------------------------------------------------


def quant_inputs(d: int) -> torch.Tensor:
    """[6, 4, d]: normal, outlier-heavy, tiny, zero, low-precision and tie-heavy vectors."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, d, generator=g)
    x[1, :, 3] *= 50
    x[2] *= 1e-5
    x[3, 0] = 0.0
    x[4] = x[4].bfloat16().float()
    # Exact half-way quotients: scale 2**-3 (amax 127/8) and values (n + 0.5) / 8.
    x[5] = (torch.randint(-100, 100, (4, d), generator=g) + 0.5) / 8
    x[5, :, 0::16] = 127 / 8
    return x


@pytest.mark.parametrize("d", [128, 16])
def test_int8_codes_are_exact(d):
    x = quant_inputs(d)
    codes, scales = INT8.encode(x)
    want_codes, want_s = oracle_int(x, 127.0, -127, 127)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16
    assert codes.shape == x.shape and scales.shape == (6, 4, d // group_size(d))
    assert torch.equal(codes.long(), want_codes) and torch.equal(scales.double(), want_s)
    assert torch.equal(INT8.decode(codes, scales).double(), dequant(want_codes, want_s))


@pytest.mark.parametrize("d", [128, 16])
def test_int4_codes_are_exact_and_packed_two_per_byte(d):
    x = quant_inputs(d)
    packed, scales = INT4.encode(x)
    want_codes, want_s = oracle_int(x, 7.0, -8, 7)
    u = want_codes + 8  # element 2i in the low nibble, 2i+1 in the high one
    assert packed.dtype == torch.uint8 and packed.shape == (6, 4, d // 2)
    assert torch.equal(packed.long(), u[..., 0::2] + 16 * u[..., 1::2])
    assert torch.equal(scales.double(), want_s)
    assert torch.equal(INT4.decode(packed, scales).double(), dequant(want_codes, want_s))


@pytest.mark.parametrize("d", [128, 16])
def test_fp8_codes_are_exact_e4m3(d):
    x = quant_inputs(d)
    codes, scales = FP8.encode(x)
    want_values, want_s = oracle_fp8(x)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert torch.equal(codes.view(torch.float8_e4m3fn).double(), want_values)
    assert torch.equal(scales.double(), want_s)
    assert torch.equal(FP8.decode(codes, scales).double(), dequant(want_values, want_s))


def test_group_size_is_64_where_the_head_dim_allows():
    assert [group_size(d) for d in (64, 128, 256, 16, 96, 80)] == [64, 64, 64, 16, 32, 16]


# --------------------------------------------------------------------------
# Hadamard rotation
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128, 256])
def test_hadamard_is_orthonormal_to_1e6(n):
    h = hadamard(n)  # fp32, as the store uses it
    assert torch.equal(h.double(), sylvester(n).float().double()) and torch.equal(h, h.T)
    eye = torch.eye(n, dtype=torch.float64)
    assert (h.double() @ h.double().T - eye).abs().max() <= 1e-6
    assert (h @ h.T - eye.float()).abs().max() <= 1e-6


def test_hadamard_refuses_non_power_of_two_and_blocks_other_head_dims():
    with pytest.raises(ValueError, match="power-of-two order, got 96"):
        hadamard(96)
    assert [hadamard_block(d) for d in (128, 96, 80, 16)] == [128, 32, 16, 16]
    rot = HeadRotation(96)
    x = torch.randn(5, 2, 96)
    y = rot.forward(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-6)
    assert (rot.inverse(y) - x).abs().max() <= 1e-5
    assert torch.allclose(y.double(), rotate(x), atol=1e-5)


def test_rotation_spreads_an_outlier_channel():
    x = torch.zeros(128)
    x[5] = 50.0
    y = HeadRotation(128).forward(x)
    assert torch.allclose(y.abs(), torch.full((128,), 50 / 128**0.5))


# --------------------------------------------------------------------------
# Every codec: paged store round trip against its oracle
# --------------------------------------------------------------------------

BS = 16
TABLE = torch.tensor([5, 1, 3, 6])  # scattered pages, the last one partial
NTOK = 3 * BS + 7


def slots_of(table: torch.Tensor, n: int) -> torch.Tensor:
    return torch.tensor([int(table[p // BS]) * BS + p % BS for p in range(n)])


def filled_store(codec, d: int = 128, outliers: bool = False, compute=torch.float32):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=d, block_size=BS, num_blocks=8)
    store = codec.allocate(layout, "cpu", compute_dtype=compute)
    k, v = kv_data(NTOK, 2, d, outliers)
    store.write(1, slots_of(TABLE, NTOK), k, v)
    return store, k, v


@pytest.mark.parametrize("name", list(CODECS))
def test_paged_write_through_scattered_table_and_partial_page(name):
    codec = CODECS[name]
    store, k, v = filled_store(codec)
    gk, gv = store.gather(1, TABLE, NTOK)
    assert gk.shape == gv.shape == (NTOK, 2, 128) and gk.dtype == torch.float32
    assert rel_rms(gk, k) < 0.2 and rel_rms(gv, v) < 0.2  # int4 V: ~0.11
    zk, zv = store.gather(0, TABLE)  # the other layer: untouched, zeroed, finite
    assert not zk.any() and not zv.any()
    # Whole pages, batched [B, nb]: the written tokens, then the zeroed rest of page 6.
    bk, _ = store.gather(1, torch.stack([TABLE, TABLE.flip(0)]))
    assert bk.shape == (2, 4 * BS, 2, 128) and torch.equal(bk[0, :NTOK], gk)
    assert not bk[0, NTOK:].any() and torch.equal(bk[1, :BS], bk[0, 3 * BS :])
    # Overwriting one slot changes that token only.
    store.write(1, slots_of(TABLE, NTOK)[:1], 2 * k[:1], 2 * v[:1])
    gk2, _ = store.gather(1, TABLE, NTOK)
    assert torch.equal(gk2[1:], gk[1:]) and not torch.equal(gk2[0], gk[0])
    assert store.nbytes == codec.bytes_per_token(2, 2, 128) * 8 * BS


@pytest.mark.parametrize("name", list(CODECS))
def test_head_major_gather_is_the_token_major_one_transposed(name):
    store, _, _ = filled_store(CODECS[name])
    if store.gather_heads is None:  # optional in the KVStore contract
        pytest.skip(f"{name!r} offers only the token-major gather")
    gk, gv = store.gather(1, TABLE, NTOK)
    hk, hv = store.gather_heads(1, TABLE, NTOK)
    assert torch.equal(hk, gk.transpose(0, 1)) and torch.equal(hv, gv.transpose(0, 1))
    rotation = store.rotation
    if rotation is None:
        return
    # Still rotated: the stored space, which rotating back (x·Hᵀ, fp64) returns to gather's.
    rk, rv = store.gather_heads(1, TABLE, NTOK, rotated=True)
    h = rotation.matrix.double()
    for rot, want in ((rk, gk), (rv, gv)):
        back = (rot.double().unflatten(-1, (-1, h.shape[0])) @ h.T).flatten(-2)
        assert rel_rms(back.transpose(0, 1), want) < 1e-6
        assert rel_rms(rot.transpose(0, 1), want) > 0.5  # it really is another space


@pytest.mark.parametrize("name", list(CODECS))
def test_write_layers_stores_what_write_stores_layer_by_layer(name):
    """A compiled step's K/V of every layer in one call: the pages `write` leaves, bit
    for bit (codes and scales alike)."""
    codec = CODECS[name]
    one = codec.allocate(KVLayout(2, 2, 128, BS, 8), "cpu")
    if one.write_layers is None:  # optional in the KVStore contract
        pytest.skip(f"{name!r} stores layer by layer only")
    every = codec.allocate(KVLayout(2, 2, 128, BS, 8), "cpu")
    slots = slots_of(TABLE, NTOK)
    k, v = (torch.randn(2, NTOK, 2, 128, generator=torch.Generator().manual_seed(s))
            for s in (1, 2))  # fmt: skip
    for layer in range(2):
        one.write(layer, slots, k[layer], v[layer])
    every.write_layers(slots, k, v)
    blocks = torch.arange(8)
    for a, b in zip(one.save_pages(blocks), every.save_pages(blocks), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("outliers", [False, True], ids=["random", "outliers"])
@pytest.mark.parametrize("name", list(CODECS))
def test_store_matches_float64_oracle(name, outliers):
    if name not in ORACLES:
        pytest.skip(f"no float64 oracle for third-party codec {name!r}")
    oracle_k, oracle_v, tol = ORACLES[name]
    store, k, v = filled_store(CODECS[name], outliers=outliers)
    gk, gv = store.gather(1, TABLE, NTOK)
    for got, want in ((gk, oracle_k(k)), (gv, oracle_v(v))):
        if tol == 0.0:
            assert torch.equal(got.double(), want)
        else:
            assert rel_rms(got, want) <= tol


# --------------------------------------------------------------------------
# Every codec: attention output against fp32 attention
# --------------------------------------------------------------------------

#: Upper bounds on attention-output rel RMS, (random, outliers): about 1.5-2x the
#: worst of 8 seeds (docs/kv-cache.md). Outliers make softmax peaky, so even fp16 grows;
#: unrotated int8 suffers most, because one ×50 channel sets its whole group's scale.
ATTENTION_BOUNDS = {
    "fp32": (1e-6, 1e-6),
    "fp16": (5e-4, 8e-3),
    "bf16": (4e-3, 4e-2),
    "int8": (1.5e-2, 0.3),
    "fp8": (6e-2, 5e-2),
    "rk8v4": (0.17, 0.15),
    "toy-int16": (1e-4, 2e-3),
}
UNKNOWN_CODEC_BOUND = 0.2


def measure_attention(codec, outliers: bool, seed: int = 0) -> float:
    """rel RMS of decode-style attention (8 queries, GQA 8:2, D 128, 250 cached tokens)."""
    t, hkv, h, d = 250, 2, 8, 128
    nb = -(-t // BS)
    layout = KVLayout(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=BS, num_blocks=nb + 2)
    store = codec.allocate(layout, "cpu", compute_dtype=torch.float32)
    table = torch.randperm(nb + 2, generator=torch.Generator().manual_seed(seed))[:nb]
    k, v = kv_data(t, hkv, d, outliers, seed)
    q = torch.randn(1, h, 8, d, generator=torch.Generator().manual_seed(seed + 1))
    store.write(0, slots_of(table, t), k, v)
    gk, gv = store.gather(0, table, t)

    def attend(k_, v_):  # [T, Hkv, D] -> [1, H, 8, D]
        k_, v_ = k_.float().transpose(0, 1)[None], v_.float().transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q, k_, v_, enable_gqa=True)

    return rel_rms(attend(gk, gv), attend(k, v))


@pytest.mark.parametrize("outliers", [False, True], ids=["random", "outliers"])
@pytest.mark.parametrize("name", list(CODECS))
def test_attention_error_against_fp32(name, outliers):
    bound = ATTENTION_BOUNDS.get(name, (UNKNOWN_CODEC_BOUND,) * 2)[outliers]
    assert measure_attention(CODECS[name], outliers) <= bound


def test_rotation_is_what_keeps_rk8v4_accurate_on_outliers():
    from ninfer_core.kv.quantized import QuantizedKVCodec

    unrotated = QuantizedKVCodec("k8v4", "test only: rk8v4 without the rotation", INT8, INT4)
    assert measure_attention(CODECS["rk8v4"], True) < 0.5 * measure_attention(unrotated, True)


# --------------------------------------------------------------------------
# Capability and sizes
# --------------------------------------------------------------------------


def test_fp8_is_refused_on_sm86_with_the_reason_and_alternatives():
    rtx3090 = simulated_device("rtx3090")
    reason = "fp8 KV needs SM89 or newer (this GPU is SM86); use --kv-dtype int8 or rk8v4"
    assert CODECS["fp8"].supports(rtx3090).reason == reason
    with pytest.raises(UnsupportedChoiceError) as err:
        choose(HOST, "kv_codecs", rtx3090, "fp8")
    assert reason in str(err.value) and "int8" in str(err.value) and "rk8v4" in str(err.value)
    for name in ("int8", "rk8v4"):
        assert choose(HOST, "kv_codecs", rtx3090, name).chosen == name


def test_fp8_is_accepted_on_sm89_and_emulated_on_the_cpu():
    report = choose(HOST, "kv_codecs", simulated_device("rtx4090"), "fp8")
    assert report.chosen == "fp8"
    assert choose(HOST, "kv_codecs", simulated_device("h100"), "fp8").chosen == "fp8"
    assert "emulated" in CODECS["fp8"].supports(CPU).reason


def test_register_kv_codecs_of_the_quantized_plugins():
    modules = (ninfer_plugins.kv_int8, ninfer_plugins.kv_rk8v4, ninfer_plugins.kv_fp8)
    names = [c.name for m in modules for c in m.register_kv_codecs()]
    assert names == ["int8", "rk8v4", "fp8"] and set(names) <= set(CODECS)


def test_bytes_per_token_match_a_hand_computation():
    # Qwen3-8B shapes: 36 layers, 8 KV heads, head dim 128; groups of 64 -> 2 fp16 scales.
    shape = (36, 8, 128)
    assert CODECS["fp16"].bytes_per_token(*shape) == 36 * 8 * 2 * 128 * 2 == 147456
    assert CODECS["int8"].bytes_per_token(*shape) == 36 * 8 * 2 * (128 + 2 * 2) == 76032
    assert CODECS["fp8"].bytes_per_token(*shape) == 76032
    # K: 128 int8 + 4 bytes of scales; V: 64 bytes of nibbles + 4.
    assert CODECS["rk8v4"].bytes_per_token(*shape) == 36 * 8 * (132 + 68) == 57600
    # Head dim 16 (the tiny test models): one group of 16 per head vector.
    assert CODECS["int8"].bytes_per_token(3, 2, 16) == 3 * 2 * 2 * (16 + 2) == 216
    assert CODECS["rk8v4"].bytes_per_token(3, 2, 16) == 3 * 2 * ((16 + 2) + (8 + 2)) == 168


def test_odd_head_dim_is_refused_for_packed_int4():
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=15, block_size=BS, num_blocks=1)
    with pytest.raises(ValueError, match="head dim 15 does not split into groups of whole bytes"):
        CODECS["rk8v4"].allocate(layout, "cpu")


# --------------------------------------------------------------------------
# End to end: greedy generation on a tiny Qwen3 (head dim 64: real group-64 scales)
# --------------------------------------------------------------------------

PROMPTS = [
    torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(s)).tolist()
    for s in range(4)
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3-kv"), head_dim=64)


def build_runner(path, kv: str) -> ModelRunner:
    artifact = open_checkpoint(path)
    family = {a: f for f in register_model_families() for a in f.architectures}[
        artifact.config["architectures"][0]
    ]
    config = family.parse_config(artifact.config)
    ops = register_kernel_backends()[0].create_ops(CPU)
    model = family.build(config, ops, torch.float32)
    family.load_weights(model, artifact)
    return assemble_runtime(model, config, torch.float32, CODECS[kv], RuntimeSpec(32, BS)).runner


def greedy_reference(path) -> tuple[list[list[int]], torch.Tensor]:
    """fp16 KV: each prompt's greedy completion and the logits of every step [P * N, vocab]."""
    runner, completions, logits = build_runner(path, "fp16"), [], []
    for ids in PROMPTS:
        seq = Sequence(ids)
        out = runner.run([(seq, len(ids))])
        for _ in range(NEW_TOKENS):
            logits.append(out[0])
            seq.append_token(int(out[0].argmax()))
            out = runner.run([(seq, 1)])
        completions.append(seq.completion_ids)
        runner.block_manager.free(seq)
    return completions, torch.stack(logits)


def measure_end_to_end(path, kv: str, reference=None) -> tuple[float, float]:
    """(logit rel RMS, top-1 agreement) vs fp16 KV, teacher-forced on fp16's greedy tokens.

    Feeding every codec the same tokens compares each step's logits like for like; a
    free-running comparison would stop meaning anything after the first divergence.
    """
    completions, ref = reference or greedy_reference(path)
    runner, logits = build_runner(path, kv), []
    for ids, completion in zip(PROMPTS, completions, strict=True):
        seq = Sequence(ids)
        out = runner.run([(seq, len(ids))])
        for token in completion:
            logits.append(out[0])
            seq.append_token(token)
            out = runner.run([(seq, 1)])
        runner.block_manager.free(seq)
    agreement = logit_agreement(torch.stack(logits), ref)
    return agreement.rel_rms, agreement.top1


@pytest.fixture(scope="module")
def fp16_reference(qwen3_path):
    return greedy_reference(qwen3_path)


@pytest.mark.parametrize(
    ("kv", "max_rms", "min_top1"),
    [("int8", 0.03, 0.95), ("fp8", 0.08, 0.85), ("rk8v4", 0.25, 0.75)],
)
def test_greedy_generation_stays_close_to_fp16(qwen3_path, fp16_reference, kv, max_rms, min_top1):
    completions, _ = fp16_reference
    assert len({t for c in completions for t in c}) > 8  # the model does not just repeat
    rms, top1 = measure_end_to_end(qwen3_path, kv, fp16_reference)
    assert rms <= max_rms and top1 >= min_top1
