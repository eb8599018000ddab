"""The CPU decode attention (`kernels/cpu_attention.py`) against float64 math.

Keys and values are written into a real `PlainKVStore` through scattered block tables
and read back by the operator in place; the reference attends over the same K/V kept
aside, in float64. The coded stores (`int8`, `rk8v4`) likewise, against their pages
dequantized (and un-rotated) in float64. Also: a speculative round's row equals the lone
decode at its position bit for bit (what keeps speculation lossless), bad tables are
refused, and stores the operator can't read say why.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.kernels import cpu_attention
from ninfer_core.kv.hadamard import hadamard
from ninfer_core.kv.layout import KVLayout
from ninfer_core.kv.plain import PlainKVStore
from ninfer_core.kv.quant import FP8, INT4, INT8
from ninfer_core.kv.quantized import QuantizedKVStore

pytestmark = pytest.mark.skipif(
    cpu_attention.kernel_unavailable() is not None,
    reason=f"CPU attention not built: {cpu_attention.kernel_unavailable()}",
)

NUM_BLOCKS = 48


class Sequences:
    """B sequences with random K/V in a store's pages (each on its own scattered pages),
    and the same K/V kept in float64 for the reference."""

    def __init__(
        self, store: PlainKVStore | QuantizedKVStore, contexts: list[int], seed: int
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        layout = store.layout
        bs, hkv, d = layout.block_size, layout.num_kv_heads, layout.head_dim
        pages = torch.randperm(NUM_BLOCKS, generator=gen)
        dtype = store.dtype if store.dtype.is_floating_point else torch.float32  # codes: fp32
        width = max(-(-c // bs) for c in contexts)
        self.table = torch.zeros(len(contexts), width + 1, dtype=torch.int64)
        self.keys, self.values = [], []
        used = 0
        for b, n in enumerate(contexts):
            count = -(-n // bs)
            self.table[b, :count] = pages[used : used + count]
            used += count
            k = torch.randn(n, hkv, d, generator=gen).to(dtype)
            v = torch.randn(n, hkv, d, generator=gen).to(dtype)
            slots = self.table[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs
            store.write(0, slots, k, v)
            self.keys.append(k.double())
            self.values.append(v.double())


def reference(q, keys, values, scale):
    """q [H, D] over keys/values [n, Hkv, D], float64 -> [H, D]."""
    h, d = q.shape
    hkv = keys.shape[1]
    qg = q.double().view(hkv, h // hkv, d)
    scores = torch.einsum("hgd,nhd->hgn", qg, keys) * scale
    return torch.einsum("hgn,nhd->hgd", scores.softmax(-1), values).reshape(h, d)


CASES = [
    # (H, Hkv, D, block size, contexts, width)
    (9, 3, 64, 16, [1, 17, 300], 1),  # one key; a page and one; past two chunks
    (16, 8, 128, 16, [128, 129], 1),  # on and past a chunk boundary
    (4, 1, 32, 8, [40, 7], 3),  # a round of three rows a sequence
    (32, 2, 256, 16, [65], 2),  # sixteen query heads a KV head
    (12, 4, 64, 16, [257], 4),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("h", "hkv", "d", "bs", "contexts", "width"), CASES)
def test_matches_float64_attention(dtype, h, hkv, d, bs, contexts, width):
    """Row j of sequence b sees the b's cached keys (`context - 1`), then its own
    round's new K/V 0..j."""
    store = PlainKVStore(KVLayout(1, hkv, d, bs, NUM_BLOCKS), dtype)
    cached = [c - 1 for c in contexts]  # what the pool holds; row 0's own key is new
    seqs = Sequences(store, [max(c, 1) for c in cached], seed=len(contexts) * d + width)
    rows = len(contexts) * width
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(rows, h, d, generator=gen).to(dtype)
    k_new = torch.randn(rows, hkv, d, generator=gen).to(dtype)
    v_new = torch.randn(rows, hkv, d, generator=gen).to(dtype)
    context = torch.tensor(contexts)
    scale = d**-0.5
    got = cpu_attention.decode_attention(
        q, store.raw_pages(0), seqs.table, context, k_new, v_new, width, scale
    )
    assert got.dtype == dtype and got.shape == q.shape
    for r in range(rows):
        b, j = divmod(r, width)
        own = slice(b * width, b * width + j + 1)
        keys = torch.cat((seqs.keys[b][: cached[b]], k_new[own].double()))
        values = torch.cat((seqs.values[b][: cached[b]], v_new[own].double()))
        want = reference(q[r], keys, values, scale)
        err = (got[r].double() - want).abs().max() / want.abs().max()
        # fp32 sums; the output rounded to `dtype` (bf16: 2^-8 relative)
        bound = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
        assert err <= bound, (r, err.item())


def test_round_rows_equal_lone_decodes_bit_for_bit():
    """Row j of a round computes exactly what a lone decode computes once rows 0..j-1
    are in the pool: the chunks a row's keys fall into depend on its position only."""
    hkv, d, bs, h = 2, 64, 16, 6
    store = PlainKVStore(KVLayout(1, hkv, d, bs, NUM_BLOCKS), torch.bfloat16)
    context0 = 126  # the round's rows cross the 128-key chunk boundary
    seqs = Sequences(store, [context0 + 3], seed=5)  # pages for the round's keys too
    gen = torch.Generator().manual_seed(9)
    width = 4
    q = torch.randn(width, h, d, generator=gen).bfloat16()
    k_new = torch.randn(width, hkv, d, generator=gen).bfloat16()
    v_new = torch.randn(width, hkv, d, generator=gen).bfloat16()
    pages = store.raw_pages(0)
    round_out = cpu_attention.decode_attention(
        q, pages, seqs.table, torch.tensor([context0]), k_new, v_new, width, 0.125
    )
    for j in range(width):
        if j:  # the lone decode at row j's position finds rows 0..j-1 in the pool
            p = context0 - 2 + j
            slot = seqs.table[0, p // bs] * bs + p % bs
            store.write(0, slot.view(1), k_new[j - 1 : j], v_new[j - 1 : j])
        lone = cpu_attention.decode_attention(
            q[j : j + 1], pages, seqs.table, torch.tensor([context0 + j]),
            k_new[j : j + 1], v_new[j : j + 1], 1, 0.125,
        )  # fmt: skip
        assert torch.equal(lone[0], round_out[j]), j


def test_bad_tables_are_refused():
    store = PlainKVStore(KVLayout(1, 2, 64, 16, 4), torch.bfloat16)
    pages = store.raw_pages(0)
    x = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="page out of range"):
        cpu_attention.decode_attention(
            q, pages, torch.tensor([[7, 0]]), torch.tensor([20]), x, x, 1, 0.125
        )
    with pytest.raises(RuntimeError, match="longer than its page table"):
        cpu_attention.decode_attention(
            q, pages, torch.tensor([[0, 1]]), torch.tensor([40]), x, x, 1, 0.125
        )


def test_stores_it_cannot_read_say_why():
    layout = KVLayout(1, 2, 64, 16, 4)
    assert cpu_attention.unsupported(PlainKVStore(layout, torch.bfloat16).raw_pages(0), 4) is None
    for k, v in ((INT8, INT8), (INT8, INT4)):
        coded = QuantizedKVStore(layout, k, v, rotate=v is INT4).raw_pages(0)
        assert cpu_attention.unsupported(coded, 4) is None
    fp8 = QuantizedKVStore(layout, FP8, FP8).raw_pages(0)
    assert "fp8_e4m38 K" in cpu_attention.unsupported(fp8, 4)
    wide = PlainKVStore(KVLayout(1, 2, 80, 16, 4), torch.bfloat16).raw_pages(0)
    assert "head dim 80" in cpu_attention.unsupported(wide, 4)
    assert "3 query heads" in cpu_attention.unsupported(
        PlainKVStore(layout, torch.bfloat16).raw_pages(0), 3
    )


def test_the_reference_ops_decode_rows_read_the_pages_in_place(monkeypatch):
    """`TorchOps.paged_attention`: a batch with a decode row, a three-row round and a
    prefill chunk gives what its gathered path gives (the prefill runs SDPA either way)."""
    from ninfer_core.kernels.reference import TorchOps
    from ninfer_core.model.attention_meta import AttentionMetadata, PagedSpan

    hkv, h, d, bs = 2, 8, 64, 16
    gen = torch.Generator().manual_seed(4)

    def run() -> torch.Tensor:
        store = PlainKVStore(KVLayout(1, hkv, d, bs, NUM_BLOCKS), torch.float32)
        prompt = [(PagedSpan(0, 0, [3, 9, 4], 40), 40), (PagedSpan(1, 0, [7, 1], 20), 20)]
        step = [(PagedSpan(0, 40, [3, 9, 4], 41), 1), (PagedSpan(1, 20, [7, 1], 23), 3),
                (PagedSpan(2, 0, [11, 12], 18), 18)]  # fmt: skip
        ops, out = TorchOps("cpu"), None
        for batch in (prompt, step):
            meta = AttentionMetadata.build(batch, bs)
            ops.prepare(meta)
            rows = sum(n for _, n in batch)
            q = torch.randn(rows, h, d, generator=torch.Generator().manual_seed(rows))
            k, v = (torch.randn(rows, hkv, d, generator=gen) for _ in "kv")
            out = ops.paged_attention(q, k, v, store, 0, meta, d**-0.5)
        return out

    state = gen.get_state()
    monkeypatch.setenv("NINFER_CPU_ATTENTION", "0")
    gathered = run()
    gen.set_state(state)
    monkeypatch.setenv("NINFER_CPU_ATTENTION", "1")
    in_place = run()
    assert in_place.shape == gathered.shape == (22, h, d)
    assert torch.allclose(in_place, gathered, rtol=1e-5, atol=1e-6)
    assert not torch.equal(in_place[:4], gathered[:4])  # two summations: both paths ran
    assert torch.equal(in_place[4:], gathered[4:])  # the prefill chunk: the same SDPA


#: The coded stores the operator reads: (K quantizer, V quantizer, rotated).
CODECS = {"int8": (INT8, INT8, False), "rk8v4": (INT8, INT4, True)}


def dequantized(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [..., W] and fp16 scales [..., n] in float64 (the layout `kv/pages.py` states)
    -> [..., D]."""
    if bits == 4:  # element 2i in the low nibble of byte i, stored + 8
        values = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2).double() - 8
    else:
        values = codes.double()
    groups = scales.shape[-1]
    return (values.unflatten(-1, (groups, -1)) * scales.double()[..., None]).flatten(-2)


def unrotated(x: torch.Tensor) -> torch.Tensor:
    """x·Hᵀ in float64, H block-diagonal (`kv/hadamard.py`) over x's last dim."""
    d = x.shape[-1]
    block = d & -d
    return (x.unflatten(-1, (-1, block)) @ hadamard(block, torch.float64).T).flatten(-2)


def stored(store: QuantizedKVStore, k: torch.Tensor, v: torch.Tensor):
    """k, v [T, Hkv, D] as the store keeps them, read back in float64 (un-rotated)."""
    out = []
    for kv, x in enumerate((k, v)):
        if store.rotation is not None:
            x = store.rotation.forward(x)
        codes, scales = store.quant[kv].encode(x)
        y = dequantized(codes, scales, 8 // store.quant[kv].values_per_byte)
        out.append(unrotated(y) if store.rotation is not None else y)
    return out


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize(("h", "hkv", "d", "bs", "contexts", "width"), CASES)
def test_coded_pages_match_float64_attention_over_their_dequantized_pages(
    codec, q_dtype, h, hkv, d, bs, contexts, width
):
    """int8 and rk8v4 pages decoded as they are read: the oracle dequantizes the very
    pages (and this step's rows, coded as the store will write them) in float64,
    un-rotates them and attends. The eager path, over the same pages gathered and
    dequantized exactly in fp32, is as close (fp32 sums; bf16 rounds the output)."""
    k_quant, v_quant, rotate = CODECS[codec]
    store = QuantizedKVStore(KVLayout(1, hkv, d, bs, NUM_BLOCKS), k_quant, v_quant, rotate=rotate)
    cached = [c - 1 for c in contexts]
    seqs = Sequences(store, [max(c, 1) for c in cached], seed=len(contexts) * d + width)
    pages = store.raw_pages(0)
    rows = len(contexts) * width
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(rows, h, d, generator=gen).to(q_dtype)
    k_new, v_new = (torch.randn(rows, hkv, d, generator=gen) for _ in "kv")
    context = torch.tensor(contexts)
    scale = d**-0.5
    got = cpu_attention.decode_attention(q, pages, seqs.table, context, k_new, v_new, width, scale)
    assert got.dtype == q_dtype and got.shape == q.shape
    keys_new, values_new = stored(store, k_new, v_new)
    for r in range(rows):
        b, j = divmod(r, width)
        slots = seqs.table[b, torch.arange(cached[b]) // bs] * bs + torch.arange(cached[b]) % bs
        old = []
        for kv in (0, 1):
            codes = store.codes[kv][0].flatten(0, 1)[slots]
            scales = store.scales[kv][0].flatten(0, 1)[slots]
            x = dequantized(codes, scales, pages.v.bits if kv else pages.k.bits)
            old.append(unrotated(x) if rotate else x)
        own = slice(b * width, b * width + j + 1)
        keys = torch.cat((old[0], keys_new[own]))
        values = torch.cat((old[1], values_new[own]))
        want = reference(q[r], keys, values, scale)
        err = (got[r].double() - want).abs().max() / want.abs().max()
        bound = {torch.bfloat16: 8e-3, torch.float32: 1e-5}[q_dtype]
        assert err <= bound, (r, err.item())


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_coded_round_rows_equal_lone_decodes(codec):
    """Row j of a round over coded pages reads rows 0..j-1 coded as the store writes them:
    int8 bit for bit; rk8v4 to fp32 rounding (its rotation is a matmul, which may round
    a row differently beside others)."""
    k_quant, v_quant, rotate = CODECS[codec]
    hkv, d, bs, h = 2, 64, 16, 6
    store = QuantizedKVStore(KVLayout(1, hkv, d, bs, NUM_BLOCKS), k_quant, v_quant, rotate=rotate)
    context0 = 126  # the round's rows cross the 128-key chunk boundary
    seqs = Sequences(store, [context0 + 3], seed=5)
    gen = torch.Generator().manual_seed(9)
    width = 4
    q = torch.randn(width, h, d, generator=gen)
    k_new, v_new = (torch.randn(width, hkv, d, generator=gen) for _ in "kv")
    pages = store.raw_pages(0)
    round_out = cpu_attention.decode_attention(
        q, pages, seqs.table, torch.tensor([context0]), k_new, v_new, width, 0.125
    )
    for j in range(width):
        if j:
            p = context0 - 2 + j
            slot = seqs.table[0, p // bs] * bs + p % bs
            store.write(0, slot.view(1), k_new[j - 1 : j], v_new[j - 1 : j])
        lone = cpu_attention.decode_attention(
            q[j : j + 1], pages, seqs.table, torch.tensor([context0 + j]),
            k_new[j : j + 1], v_new[j : j + 1], 1, 0.125,
        )  # fmt: skip
        if rotate:
            assert torch.allclose(lone[0], round_out[j], rtol=1e-5, atol=1e-6), j
        else:
            assert torch.equal(lone[0], round_out[j]), j
