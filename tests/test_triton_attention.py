"""Triton paged attention (`backend_triton/attention.py`) in Triton's interpreter, against
a float64 softmax over the store's own decoded cache, for every codec it reads in place.

One step mixes what a serving step holds: decode rows with ragged contexts (1 and 17
keys), a prefill chunk after a cached prefix, and a speculative round of 3 rows, over
pages handed out in shuffled order, with grouped-query heads (H=4, Hkv=2), a head dim
that is a power of two (64) and one that is not (48).
"""

from __future__ import annotations

import pytest
import torch
from triton_helpers import interpreted_module

from ninfer_core.kernels.reference import TorchOps
from ninfer_core.kv.layout import KVLayout
from ninfer_core.kv.pages import KVPages
from ninfer_core.kv.plain import PlainKVStore
from ninfer_core.kv.quant import FP8
from ninfer_core.kv.quantized import QuantizedKVStore
from ninfer_core.model.attention_meta import AttentionMetadata, PagedSpan
from ninfer_core.plugin_host import create_host

attention = interpreted_module("ninfer_plugins.backend_triton.attention")

H, HKV, BLOCK, NUM_BLOCKS, LAYERS = 4, 2, 16, 14, 2
#: (cached tokens, new tokens) per sequence: two decode rows, a prefill chunk after a
#: cached prefix, a speculative round of three rows.
STEP = [(0, 1), (16, 1), (20, 20), (37, 3)]
TOL = {torch.float16: 1e-2, torch.float32: 1e-4}


@pytest.fixture(scope="module")
def codecs():
    return create_host().kv_codecs


def make_step(codec, codecs, dtype, head_dim, seed=0, heads=H):
    """A store holding random cached prefixes, and the step's q/k/v and metadata."""
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(LAYERS, HKV, head_dim, BLOCK, NUM_BLOCKS)
    store = codecs.get(codec).allocate(layout, "cpu", dtype)
    pages = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()  # page 0 unused
    seqs = []
    for i, (cached, new) in enumerate(STEP):
        n_pages = -(-(cached + new) // BLOCK)
        table, pages = pages[:n_pages], pages[n_pages:]
        seqs.append(PagedSpan(i, cached, table, cached + new))
        if cached:  # the prefix earlier steps stored, in both layers
            slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached)])
            for layer in range(LAYERS):
                k, v = (torch.randn(cached, HKV, head_dim, generator=gen) for _ in "kv")
                store.write(layer, slots, k.to(dtype), v.to(dtype))
    meta = AttentionMetadata.build([(s, n) for s, (_, n) in zip(seqs, STEP, strict=True)], BLOCK)
    t = meta.num_tokens
    q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    k_new, v_new = (torch.randn(t, HKV, head_dim, generator=gen).to(dtype) for _ in "kv")
    return store, meta, seqs, q, k_new, v_new


def reference(q, store, layer, seqs, meta, scale) -> torch.Tensor:
    """Float64 causal softmax attention over each sequence's cache as `gather` decodes it."""
    outs, start, group = [], 0, q.shape[1] // HKV
    for seq, qlen, ctx in zip(seqs, meta.query_lens, meta.context_lens, strict=True):
        k, v = store.gather(layer, torch.tensor(seq.block_table), ctx)  # [ctx, Hkv, D]
        k = k.double().repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        qi = q[start : start + qlen].double()  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        pos = torch.arange(ctx - qlen, ctx)[:, None]  # row r sits at ctx - qlen + r
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += qlen
    return torch.cat(outs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


CASES = [
    ("fp16", torch.float16, 64, None),
    ("fp16", torch.float16, 48, 16),
    ("fp32", torch.float32, 64, 16),
    ("int8", torch.float16, 64, 16),
    ("int8", torch.float32, 48, None),
    ("rk8v4", torch.float16, 64, None),
    ("rk8v4", torch.float32, 48, 16),
]


@pytest.mark.parametrize(("codec", "dtype", "head_dim", "split"), CASES)
def test_a_mixed_step_matches_float64_attention_over_the_decoded_cache(
    codecs, codec, dtype, head_dim, split
):
    store, meta, seqs, q, k_new, v_new = make_step(codec, codecs, dtype, head_dim)
    scale = head_dim**-0.5
    attention.prepare(meta)
    out = attention.paged_attention(q, k_new, v_new, store, 1, meta, scale, split_tokens=split)
    assert out.shape == q.shape and out.dtype == dtype
    ref = reference(q, store, 1, seqs, meta, scale)
    assert rel_err(out, ref) <= TOL[dtype]
    # Each sequence separately: a bug that mixes rows of two sequences can't hide.
    start = 0
    for qlen in meta.query_lens:
        rows = slice(start, start + qlen)
        assert rel_err(out[rows], ref[rows]) <= TOL[dtype]
        start += qlen


def test_three_query_heads_per_kv_head(codecs):
    """A group size that is not a power of two (H=6, Hkv=2): rows of a tile split unevenly."""
    store, meta, seqs, q, k_new, v_new = make_step("int8", codecs, torch.float32, 64, 9, heads=6)
    attention.prepare(meta)
    out = attention.paged_attention(q, k_new, v_new, store, 0, meta, 0.125, split_tokens=32)
    assert rel_err(out, reference(q, store, 0, seqs, meta, 0.125)) <= 1e-4


def test_split_kv_agrees_with_one_pass(codecs):
    """Forced parts of 16 keys (3 parts for a 40-key context) merge to the one-pass result."""
    store, meta, seqs, q, k_new, v_new = make_step("fp32", codecs, torch.float32, 64, seed=3)
    attention.prepare(meta)
    whole = attention.paged_attention(q, k_new, v_new, store, 0, meta, 0.125)
    parts = attention.paged_attention(q, k_new, v_new, store, 0, meta, 0.125, split_tokens=16)
    assert (whole - parts).abs().max().item() < 1e-5
    assert rel_err(parts, reference(q, store, 0, seqs, meta, 0.125)) <= 1e-4


def test_a_speculative_row_does_not_see_later_rows(codecs):
    """Changing the last row's new key changes only the last row's output."""
    store, meta, _, q, k_new, v_new = make_step("fp32", codecs, torch.float32, 64, seed=5)
    attention.prepare(meta)
    before = attention.paged_attention(q, k_new, v_new, store, 0, meta, 0.125)
    k_new[-1] += 3.0
    after = attention.paged_attention(q, k_new, v_new, store, 0, meta, 0.125)
    assert torch.equal(before[:-1], after[:-1])
    assert not torch.allclose(before[-1], after[-1])


@pytest.mark.parametrize("codec", ["fp16", "fp32", "int8", "rk8v4"])
def test_raw_pages_are_the_live_pools(codecs, codec):
    """A write through `write` shows in `raw_pages` at (page, offset, head), as stored."""
    layout = KVLayout(LAYERS, HKV, 64, BLOCK, NUM_BLOCKS)
    store = codecs.get(codec).allocate(layout, "cpu", torch.float32)
    k, v = torch.randn(1, HKV, 64), torch.randn(1, HKV, 64)
    page, offset = 5, 9
    store.write(1, torch.tensor([page * BLOCK + offset]), k, v)
    pages = store.raw_pages(1)
    assert isinstance(pages, KVPages) and pages.block_size == BLOCK and pages.num_kv_heads == HKV
    for pool, x in ((pages.k, k), (pages.v, v)):
        assert pool.values.shape[:3] == (NUM_BLOCKS, BLOCK, HKV)
        stored = pool.values[page, offset]  # [Hkv, W]
        if pool.encoding == "float":
            assert pool.scales is None and pool.bits == store.dtype.itemsize * 8
            assert torch.equal(stored, x[0].to(store.dtype))
        else:
            quant = store.quant[0 if x is k else 1]
            if pages.rotation is not None:
                x = pages.rotation.forward(x)
            codes, scales = quant.encode(x[0])
            assert torch.equal(stored, codes) and torch.equal(pool.scales[page, offset], scales)
            assert pool.bits == 8 // quant.values_per_byte
        assert pool.values[page, offset - 1].abs().sum() == 0  # the neighbour untouched
    assert (pages.rotation is not None) == (codec == "rk8v4")


def test_a_store_without_in_place_pages_is_refused():
    class GatherOnly(PlainKVStore):
        raw_pages = None

    layout = KVLayout(1, HKV, 64, BLOCK, 4)
    store = GatherOnly(layout, torch.float32)
    meta = AttentionMetadata.build([(PagedSpan(0, 0, [1], 1), 1)], BLOCK)
    x = torch.zeros(1, HKV, 64)
    with pytest.raises(NotImplementedError, match="raw_pages"):
        attention.paged_attention(torch.zeros(1, H, 64), x, x, store, 0, meta, 0.125)


def test_fp8_pages_are_refused_naming_their_encoding():
    layout = KVLayout(1, HKV, 64, BLOCK, 4)
    store = QuantizedKVStore(layout, FP8, FP8)
    assert store.raw_pages(0).k.encoding == "fp8_e4m3"
    meta = AttentionMetadata.build([(PagedSpan(0, 0, [1], 1), 1)], BLOCK)
    x = torch.zeros(1, HKV, 64)
    with pytest.raises(NotImplementedError, match="fp8_e4m3"):
        attention.paged_attention(torch.zeros(1, H, 64), x, x, store, 0, meta, 0.125)


@pytest.mark.parametrize(("codec", "dtype"), [("rk8v4", torch.float16), ("int8", torch.float32)])
def test_agrees_with_the_reference_ops(codecs, codec, dtype):
    """The same step through `TorchOps.paged_attention`, the op the model otherwise runs
    (it writes the same K/V to the same slots again, which changes nothing)."""
    store, meta, _, q, k_new, v_new = make_step(codec, codecs, dtype, 64, seed=7)
    attention.prepare(meta)
    out = attention.paged_attention(q, k_new, v_new, store, 0, meta, 0.125)
    torch_ops = TorchOps("cpu")
    torch_ops.prepare(meta)
    ref = torch_ops.paged_attention(q, k_new, v_new, store, 0, meta, 0.125)
    assert rel_err(out, ref.double()) <= TOL[dtype]


@pytest.mark.parametrize(
    ("store_dtype", "dtype"), [(torch.float16, torch.float32), (torch.float32, torch.float16)]
)
def test_the_fused_plain_write_stores_what_write_stores(store_dtype, dtype):
    """Bit for bit `PlainKVStore.write`, from strided views of one projection output."""
    layout = KVLayout(LAYERS, HKV, 48, BLOCK, NUM_BLOCKS)
    ours, theirs = (PlainKVStore(layout, store_dtype, "cpu", dtype) for _ in "ab")
    kv = torch.randn(5, 2, HKV, 48).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([3, 40, 41, 17, 200])
    attention.write_plain(ours.raw_pages(1), slots, k, v)
    theirs.write(1, slots, k, v)
    assert torch.equal(ours.pool, theirs.pool) and ours.pool.abs().sum() > 0


class TritonAttentionOps(TorchOps):
    """The reference ops with this module's attention and `norms.py`'s kernels in place:
    the model calls them with the shapes and views it really makes."""

    name = "torch+triton"

    def __init__(self, device="cpu") -> None:
        super().__init__(device)
        self.norms = interpreted_module("ninfer_plugins.backend_triton.norms")

    def prepare(self, meta):
        attention.prepare(meta)

    def rms_norm(self, x, w, eps):
        return self.norms.rms_norm(x, w, eps)

    def silu_and_mul(self, gate, up):
        return self.norms.silu_and_mul(gate, up)

    def apply_rope(self, q, k, cos, sin):
        return self.norms.apply_rope(q, k, cos, sin)

    def paged_attention(self, q, k_new, v_new, kv_store, layer, meta, scale):
        return attention.paged_attention(q, k_new, v_new, kv_store, layer, meta, scale)


@pytest.mark.parametrize("writer", ["llama", "qwen3"])
def test_a_tiny_model_through_the_kernels_matches_transformers(tmp_path, writer):
    """fp32 logits of a prefill chunk after a cached prefix beside a decode row, through
    the model's real calls (GQA llama with llama3 RoPE; Qwen3 with its q/k norms)."""
    from checkpoints import load_reference, open_checkpoint, write_tiny_llama, write_tiny_qwen3

    from ninfer_core.engine import RuntimeSpec, Sequence, assemble_runtime
    from ninfer_plugins.kv_plain import register_kv_codecs
    from ninfer_plugins.model_dense import register_model_families

    path = {"llama": write_tiny_llama, "qwen3": write_tiny_qwen3}[writer](tmp_path)
    artifact = open_checkpoint(path)
    [family] = [
        f
        for f in register_model_families()
        if artifact.config["architectures"][0] in f.architectures
    ]
    config = family.parse_config(artifact.config)
    model = family.build(config, TritonAttentionOps(), torch.float32)
    family.load_weights(model, artifact)
    [fp32] = [c for c in register_kv_codecs() if c.name == "fp32"]
    runner = assemble_runtime(model, config, torch.float32, fp32, RuntimeSpec(12, BLOCK)).runner
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    a, b = Sequence(ids[:8]), Sequence(ids)
    runner.run([(a, 8), (b, 10)])
    a.append_token(11)
    got = runner.run([(a, 1), (b, 14)], all_tokens=True)  # decode a, the rest of b
    ref = load_reference(path)
    with torch.no_grad():
        want_a = ref(torch.tensor([a.token_ids])).logits[0, -1].float()
        want_b = ref(torch.tensor([b.token_ids])).logits[0, 10:].float()
    assert (got[0] - want_a).abs().max().item() <= 1e-4
    assert (got[1:] - want_b).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("codec", "dtype"), [("rk8v4", torch.float16), ("fp16", torch.float16)])
def test_the_declared_scratch_bounds_what_the_kernel_allocates(codecs, codec, dtype):
    """`attention_scratch` (what the memory plan counts instead of a gathered context)
    against the storages the op really creates for a step, counted op by op; the step's
    own K/V written into the store are not scratch and are excluded as the store's."""
    from test_memory_plan import LiveBytes

    from ninfer_plugins.backend_triton import table

    store, meta, _, q, k_new, v_new = make_step(codec, codecs, dtype, 64, seed=3)
    attention.prepare(meta)
    pages = store.raw_pages(0)
    pools = [t for pool in (pages.k, pages.v) for t in (pool.values, pool.scales) if t is not None]
    known = [*pools, q, k_new, v_new]
    with LiveBytes(known) as mode:
        out = attention.paged_attention(q, k_new, v_new, store, 0, meta, 0.125)
    few = sum(n for n in meta.query_lens if n <= 4)
    declared = table.attention_scratch(
        tokens=meta.num_tokens, few_rows=few, context=max(meta.context_lens), num_heads=H,
        head_dim=64, dtype_bytes=dtype.itemsize, rotated=store.rotation is not None,
    )  # fmt: skip
    assert out.shape == q.shape
    assert mode.peak <= declared <= 4 * mode.peak, (mode.peak, declared)
