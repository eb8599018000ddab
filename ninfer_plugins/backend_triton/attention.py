"""Paged attention as Triton kernels that read the KV store's pages in place.

The store describes its live pools (`KVStore.raw_pages`, `ninfer_core.kv.pages`); the
kernels walk each sequence's block table and decode pages on the fly (`code * scale`
for int8 and int4 codes), so no dequantized copy of the context is ever made. One
kernel, `_attend`, serves both shapes of work, over a "tile" of query rows:

- few rows (a decode token, or a speculative round of up to `FEW_ROWS` rows): one tile
  per (sequence, KV head), holding every query row of every query head that shares the
  KV head (GQA), so each page is read once for all of them. Long contexts are split
  across programs (split-KV) and `_merge` combines the parts by their log-sum-exp;
- many rows (a prefill chunk): flash-attention tiles of query rows, causal with the
  mask offset by the cached prefix (row r of a `Q`-row chunk sits at `ctx - Q + r`).

Scores and the online softmax are fp32; the matmuls take the activations' dtype with
fp32 accumulation (fp32 activations multiply in full fp32, "ieee", not tf32). Head
dims that are not a power of two are padded to one with masks. For a rotated store
(rk8v4) the query is rotated by H before and the output by Hᵀ after, per query row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from ninfer_core.kernels.reference import FEW_ROWS
from ninfer_core.kv.pages import KVPages, PagePool
from ninfer_core.kv.plain import PlainKVStore
from ninfer_core.model.attention_meta import AttentionMetadata
from ninfer_plugins.backend_triton.table import MIN_SPLIT, interpreting

#: Where `prepare` leaves its per-step plan in `AttentionMetadata.plan`.
PLAN_KEY = "triton_attention"
#: Columns of `StepPlan.seqs`: query start, query length, context length, and the first
#: row of the sequence among all few-row sequences' rows (split-KV partials).
SEQ_COLS = 4
_INTERPRET = interpreting()
#: Tile sizes: tiny under the interpreter (every launch runs on the CPU with numpy).
KEY_BLOCK = 16 if _INTERPRET else 64
PREFILL_ROWS_BLOCK = 16 if _INTERPRET else 64
_LOG2E = 1.4426950408889634


@dataclass
class StepPlan:
    """Index tensors of one step, built once by `prepare`, read by every layer."""

    #: [B, SEQ_COLS] int32 on the device.
    seqs: torch.Tensor
    #: [nf, 2] int32: (batch index, first row 0) of each few-row sequence.
    few_tiles: torch.Tensor
    #: [n] int32: the token rows of the few-row sequences, in their order.
    few_rows: torch.Tensor
    #: Batch indices of the sequences with many query rows (prefill chunks).
    many: list[int]
    query_lens: list[int]
    max_few_rows: int
    max_few_ctx: int
    #: Prefill tile maps `[n_tiles, 2]` (batch index, first row) by rows per tile; the
    #: first layer builds the one its head grouping needs, the others reuse it.
    tiles: dict[int, torch.Tensor] = field(default_factory=dict)


def prepare(meta: AttentionMetadata) -> None:
    """Build the step's index tensors (one host-to-device copy) into `meta.plan`."""
    rows: list[list[int]] = []
    few_tiles: list[int] = []
    few_rows: list[int] = []
    many: list[int] = []
    start, few_offset, max_few_rows, max_few_ctx = 0, 0, 0, 0
    for b, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        if qlen <= FEW_ROWS:
            rows.append([start, qlen, ctx, few_offset])
            few_tiles += [b, 0]
            few_rows += range(start, start + qlen)
            few_offset += qlen
            max_few_rows, max_few_ctx = max(max_few_rows, qlen), max(max_few_ctx, ctx)
        else:
            rows.append([start, qlen, ctx, 0])
            many.append(b)
        start += qlen
    flat = [x for r in rows for x in r] + few_tiles + few_rows
    packed = torch.tensor(flat, dtype=torch.int32).to(meta.slot_mapping.device)
    nb, nf = len(rows), len(few_tiles) // 2
    seqs, rest = packed[: nb * SEQ_COLS], packed[nb * SEQ_COLS :]
    meta.plan[PLAN_KEY] = StepPlan(
        seqs=seqs.view(nb, SEQ_COLS),
        few_tiles=rest[: 2 * nf].view(nf, 2),
        few_rows=rest[2 * nf :],
        many=many,
        query_lens=list(meta.query_lens),
        max_few_rows=max_few_rows,
        max_few_ctx=max_few_ctx,
    )


def _prefill_tiles(plan: StepPlan, rows_per_tile: int, device: torch.device) -> torch.Tensor:
    tiles = plan.tiles.get(rows_per_tile)
    if tiles is None:
        flat = [
            x
            for b in plan.many
            for r0 in range(0, plan.query_lens[b], rows_per_tile)
            for x in (b, r0)
        ]
        tiles = torch.tensor(flat, dtype=torch.int32).to(device).view(-1, 2)
        plan.tiles[rows_per_tile] = tiles
    return tiles


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv_store,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    *,
    split_tokens: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V, then attend (the `KernelOps.paged_attention` contract).

    q: [T, H, D], k_new/v_new: [T, Hkv, D] -> [T, H, D] in q.dtype. `split_tokens` forces
    the keys per split-KV part of few-row sequences (None: chosen from the GPU's size).
    """
    if kv_store.raw_pages is None:
        raise NotImplementedError(
            f"{type(kv_store).__name__} offers no in-place page access (KVStore.raw_pages), "
            "which Triton attention reads"
        )
    pages = kv_store.raw_pages(layer)
    _check_pages(pages, q)  # before writing: a refused store is left as it was
    if isinstance(kv_store, PlainKVStore):
        write_plain(pages, meta.slot_mapping, k_new, v_new)
    else:  # codes: the store's own encoder (rotation, rounding) decides them
        kv_store.write(layer, meta.slot_mapping, k_new, v_new)
    plan = meta.plan.get(PLAN_KEY)
    if plan is None:
        prepare(meta)
        plan = meta.plan[PLAN_KEY]
    t, h, d = q.shape
    group = h // pages.num_kv_heads
    if pages.rotation is not None:  # (qH)·(kH) = q·k; the output comes back by Hᵀ
        q = pages.rotation.forward(q).to(q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    if plan.few_tiles.shape[0]:
        _launch_few(q, out, pages, meta, plan, scale, group, split_tokens)
    if plan.many:
        _launch_many(q, out, pages, meta, plan, scale, group)
    if pages.rotation is not None:
        out = pages.rotation.inverse(out).to(q.dtype)
    return out


def write_plain(pages: KVPages, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new tokens into float pages in one launch, K and V together: what
    `PlainKVStore.write` does (a cast to the storage dtype) without its transposes.
    slots: [T] int64; k, v: [T, Hkv, D] (views with a contiguous head dim are fine)."""
    t, hkv, d = k.shape
    assert pages.k.encoding == pages.v.encoding == "float" and v.shape == k.shape
    assert slots.dtype == torch.int64 and slots.shape == (t,)
    k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (k, v))
    kp, vp = pages.k.values, pages.v.values
    if t:
        _write_plain[(t,)](
            k, v, slots, kp, vp, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *kp.stride(), *vp.stride(), hkv, pages.block_size, D=d,
            BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        )  # fmt: skip


def _check_pages(pages: KVPages, q: torch.Tensor) -> None:
    for name, pool in (("K", pages.k), ("V", pages.v)):
        if pool.encoding == "float" and pool.bits in (16, 32):
            continue
        if pool.encoding == "int" and pool.bits in (4, 8):
            continue
        raise NotImplementedError(
            f"Triton attention reads float and int8/int4 pages, not {pool.bits}-bit "
            f"{pool.encoding} {name} pages"
        )
    h, d = q.shape[1], q.shape[2]
    if d != pages.head_dim or h % pages.num_kv_heads:
        raise ValueError(
            f"q [T, {h}, {d}] does not fit pages of {pages.num_kv_heads} KV heads "
            f"of dim {pages.head_dim}"
        )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_len(plan: StepPlan, programs: int, device: torch.device, forced: int | None) -> int:
    """Keys per split-KV part: enough parts to give every SM two programs."""
    if forced is not None:
        return max(KEY_BLOCK, -(-forced // KEY_BLOCK) * KEY_BLOCK)
    want = -(-2 * _num_sms(device) // programs)
    parts = max(1, min(want, plan.max_few_ctx // MIN_SPLIT))
    length = -(-plan.max_few_ctx // parts)
    return -(-length // KEY_BLOCK) * KEY_BLOCK


def _pool_args(pool: PagePool) -> tuple:
    scales = pool.scales if pool.scales is not None else pool.values
    return (pool.values, scales, *pool.values.stride(), *scales.stride())


def _launch_few(q, out, pages, meta, plan, scale, group, split_tokens) -> None:
    d = q.shape[2]
    hkv = pages.num_kv_heads
    block_m = max(16, triton.next_power_of_2(plan.max_few_rows * group))
    nf = plan.few_tiles.shape[0]
    split = _split_len(plan, nf * hkv, q.device, split_tokens)
    parts = -(-plan.max_few_ctx // split)
    n_rows = plan.few_rows.shape[0]
    if parts > 1:
        partial = torch.empty(parts, n_rows, q.shape[1], d, dtype=torch.float32, device=q.device)
        stats = torch.empty(parts, n_rows, q.shape[1], 2, dtype=torch.float32, device=q.device)
    else:
        partial = stats = out  # not read: the kernel writes `out` directly
    _run_attend(
        q, out, partial, stats, pages, meta, plan.seqs, plan.few_tiles, scale, group,
        rows=block_m // group, block_m=block_m, split=split, parts=parts,
    )  # fmt: skip
    if parts > 1:
        _merge[(n_rows, q.shape[1])](
            partial, stats, out, plan.few_rows, out.stride(0), out.stride(1), n_rows, q.shape[1],
            parts, D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_S=triton.next_power_of_2(parts),
        )  # fmt: skip


def _launch_many(q, out, pages, meta, plan, scale, group) -> None:
    block_m = max(PREFILL_ROWS_BLOCK, triton.next_power_of_2(group))
    rows = block_m // group
    tiles = _prefill_tiles(plan, rows, q.device)
    _run_attend(
        q, out, out, out, pages, meta, plan.seqs, tiles, scale, group,
        rows=rows, block_m=block_m, split=1 << 30, parts=1,
    )  # fmt: skip


def _run_attend(
    q, out, partial, stats, pages, meta, seqs, tiles, scale, group, *, rows, block_m, split, parts
) -> None:
    d = q.shape[2]
    table = meta.block_tables
    assert table.dtype == torch.int32 and table.stride(1) == 1, "block table rows: int32"
    assert q.stride(2) == 1 and out.is_contiguous()
    block_d = max(16, triton.next_power_of_2(d))
    grid = (tiles.shape[0], pages.num_kv_heads, parts)
    n_rows = partial.shape[1] if parts > 1 else 0
    _attend[grid](
        q, out, partial, stats, seqs, tiles, table,
        *_pool_args(pages.k), *_pool_args(pages.v),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), table.stride(0),
        scale * _LOG2E, q.shape[1], n_rows, split, pages.block_size,
        D=d, G=group, ROWS=rows,
        K_BITS=pages.k.bits, K_GROUP=pages.k.group, K_SCALED=pages.k.scales is not None,
        V_BITS=pages.v.bits, V_GROUP=pages.v.group, V_SCALED=pages.v.scales is not None,
        BLOCK_M=block_m, BLOCK_N=KEY_BLOCK, BLOCK_D=block_d, SPLIT=parts > 1,
        # fp32 activations multiply in full fp32 (tf32 would round the inputs to 10 bits);
        # None: the backend's default for 16-bit operands.
        PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=4 if block_m * block_d <= 64 * 128 else 8,
    )  # fmt: skip


# Only Triton builtins and this module's jit functions inside the kernels: `tl.sum`,
# `tl.max` and `tl.zeros` are themselves jit functions, decorated when Triton is first
# imported, which a process that imported Triton before turning its interpreter on
# cannot call interpreted; `tl.reduce` with the combiners below computes the same.


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _load_page(
    P, PS, page, slot, kvh, d, mask,
    s_b, s_s, s_h, s_d, ss_b, ss_s, ss_h, ss_g,
    BITS: tl.constexpr, GROUP: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, BLOCK_D] fp32 values of keys at (page, slot) of KV head `kvh`."""
    base = page[:, None] * s_b + slot[:, None] * s_s + kvh * s_h
    if BITS == 4:  # two codes a byte, element 2i low; stored code + 8
        byte = tl.load(P + base + (d[None, :] // 2) * s_d, mask=mask, other=0).to(tl.int32)
        x = (((byte >> ((d[None, :] % 2) * 4)) & 15) - 8).to(tl.float32)
    else:
        x = tl.load(P + base + d[None, :] * s_d, mask=mask, other=0).to(tl.float32)
    if SCALED:
        sbase = page[:, None] * ss_b + slot[:, None] * ss_s + kvh * ss_h
        sc = tl.load(PS + sbase + (d[None, :] // GROUP) * ss_g, mask=mask, other=0)
        x = x * sc.to(tl.float32)
    return x


@triton.jit
def _write_plain(
    K, V, SLOTS, KP, VP, sk_t, sk_h, sv_t, sv_h,
    skp_b, skp_s, skp_h, skp_d, svp_b, svp_s, svp_h, svp_d, heads, block_size,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Token `program_id(0)`: every KV head of its K and V into its slot's page."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t)
    page, off = slot // block_size, slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < D)
    k = tl.load(K + t * sk_t + h * sk_h + d, mask=mask)
    v = tl.load(V + t * sv_t + h * sv_h + d, mask=mask)
    k_dst = KP + page * skp_b + off * skp_s + h * skp_h + d * skp_d
    v_dst = VP + page * svp_b + off * svp_s + h * svp_h + d * svp_d
    tl.store(k_dst, k.to(KP.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(VP.dtype.element_ty), mask=mask)


@triton.jit
def _attend(
    Q, Out, OP, ML, SEQS, TILES, BT,
    K, KS, sk_b, sk_s, sk_h, sk_d, sks_b, sks_s, sks_h, sks_g,
    V, VS, sv_b, sv_s, sv_h, sv_d, svs_b, svs_s, svs_h, svs_g,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    qk_scale, num_heads, n_rows, split_len, block_size,
    D: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr,
    K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_SCALED: tl.constexpr,
    V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: `ROWS` query rows x the `G` query heads of KV head `kvh`, over the keys
    of split part `part` (all of them without SPLIT). Scores are in log2 units
    (`qk_scale` carries log2 e)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq = tl.load(TILES + tile * 2)
    r0 = tl.load(TILES + tile * 2 + 1)
    q_start = tl.load(SEQS + seq * 4)
    q_len = tl.load(SEQS + seq * 4 + 1)
    ctx = tl.load(SEQS + seq * 4 + 2)
    row_base = tl.load(SEQS + seq * 4 + 3)

    m = tl.arange(0, BLOCK_M)
    row = r0 + m // G  # query row within the sequence
    head = kvh * G + m % G
    row_ok = (m < ROWS * G) & (row < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_off = (q_start + row)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
    q = tl.load(Q + q_off + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = ctx - q_len + row  # each row sees keys 0..pos (causal, after the cached prefix)
    last = tl.minimum(r0 + ROWS, q_len) - 1
    kv_end = ctx - q_len + last + 1
    if SPLIT:
        lo = part * split_len
        hi = tl.minimum(lo + split_len, kv_end)
    else:
        lo = 0
        hi = kv_end

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.load(BT + seq * stride_bt + n // block_size, mask=n_ok, other=0).to(tl.int64)
        slot = n % block_size
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _load_page(
            K, KS, page, slot, kvh, d, kv_mask, sk_b, sk_s, sk_h, sk_d,
            sks_b, sks_s, sks_h, sks_g, K_BITS, K_GROUP, K_SCALED,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        visible = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.reduce(p, 1, _add)
        v = _load_page(
            V, VS, page, slot, kvh, d, kv_mask, sv_b, sv_s, sv_h, sv_d,
            svs_b, svs_s, svs_h, svs_g, V_BITS, V_GROUP, V_SCALED,
        )  # fmt: skip
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:  # unnormalized parts and their (max, sum), merged by `_merge`
        idx = (part * n_rows + row_base + row) * num_heads + head  # [BLOCK_M]
        tl.store(OP + idx[:, None].to(tl.int64) * D + d[None, :], acc, mask=out_mask)
        tl.store(ML + idx * 2, m_i, mask=row_ok)
        tl.store(ML + idx * 2 + 1, l_i, mask=row_ok)
    else:
        o = acc / l_i[:, None]
        o_off = (q_start + row)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
        tl.store(Out + o_off + d[None, :], o.to(Out.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge(
    OP, ML, Out, ROWS_T, stride_ot, stride_oh, n_rows, num_heads, parts,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Combine the split-KV parts of one (row, head): weights 2^(m_s - max m)."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.load(ROWS_T + j)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < parts
    idx = (s * n_rows + j) * num_heads + h
    m = tl.load(ML + idx * 2, mask=s_ok, other=-1.0e30)
    l_s = tl.load(ML + idx * 2 + 1, mask=s_ok, other=0.0)
    w = tl.where(s_ok, tl.exp2(m - tl.reduce(m, 0, _max)), 0.0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    acc = tl.load(
        OP + idx[:, None].to(tl.int64) * D + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    o = tl.reduce(acc * w[:, None], 0, _add) / tl.reduce(w * l_s, 0, _add)
    o_ptr = Out + t.to(tl.int64) * stride_ot + h * stride_oh + d
    tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=d_ok)
