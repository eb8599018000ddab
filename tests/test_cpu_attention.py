"""The CPU decode attention (`kernels/cpu_attention.py`) against float64 math.

Keys and values are written into a real `PlainKVStore` through scattered block tables
and read back by the operator in place; the reference attends over the same K/V kept
aside, in float64. Also: a speculative round's row equals the lone decode at its
position bit for bit (what keeps speculation lossless), bad tables are refused, and
stores the operator can't read say why.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.kernels import cpu_attention
from ninfer_core.kv.layout import KVLayout
from ninfer_core.kv.plain import PlainKVStore
from ninfer_core.kv.quant import INT8
from ninfer_core.kv.quantized import QuantizedKVStore

pytestmark = pytest.mark.skipif(
    cpu_attention.kernel_unavailable() is not None,
    reason=f"CPU attention not built: {cpu_attention.kernel_unavailable()}",
)

NUM_BLOCKS = 48


class Sequences:
    """B sequences with random K/V in a store's pages (each on its own scattered pages),
    and the same K/V kept in float64 for the reference."""

    def __init__(self, store: PlainKVStore, contexts: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        layout = store.layout
        bs, hkv, d = layout.block_size, layout.num_kv_heads, layout.head_dim
        pages = torch.randperm(NUM_BLOCKS, generator=gen)
        width = max(-(-c // bs) for c in contexts)
        self.table = torch.zeros(len(contexts), width + 1, dtype=torch.int64)
        self.keys, self.values = [], []
        used = 0
        for b, n in enumerate(contexts):
            count = -(-n // bs)
            self.table[b, :count] = pages[used : used + count]
            used += count
            k = torch.randn(n, hkv, d, generator=gen).to(store.dtype)
            v = torch.randn(n, hkv, d, generator=gen).to(store.dtype)
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
    coded = QuantizedKVStore(layout, INT8, INT8).raw_pages(0)
    assert cpu_attention.unsupported(coded, 4) == "the pages hold codes"
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
