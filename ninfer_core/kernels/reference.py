"""The reference kernels (`TorchOps`): what every other backend is checked against, and
what serves each op no other backend provides (`ninfer_core.kernels.compose`).
The built-in `torch` kernel backend (`ninfer_plugins/backend_torch.py`) registers them.

Plain PyTorch ops; runs wherever torch runs. Attention gathers each sequence's cached
pages and calls `F.scaled_dot_product_attention` (grouped-query heads through
`enable_gqa`) for prefill, two small matmuls for a decode row (or, on CPUs that build
it, the decode attention operator over the pages in place, `cpu_attention`); masks are
built once per step in `prepare`, not per layer. Decode rows of a plain fp32 matrix take
the fp32 GEMV operator where it is built (`cpu_gemv.gemv_f32`), not torch's BLAS. The
linear-attention ops (`gated_delta_rule`, `causal_conv1d`) are
`ninfer_core.kernels.delta_rule`'s.

Quantized weights (`QuantizedTensor`) run one of two ways. The reference dequantizes
row chunks into the activations' dtype and calls `F.linear` (exact: the same numbers a
dense model of the dequantized weights computes). On the CPU in bf16, `pack_linear`
instead repacks them for torch's int4 kernel (`_weight_int4pack_mm_for_cpu`, which
computes `(q - 8) * scale + zero` per group): Q4 codes directly (an asymmetric format's
`u * scale + min` as scale and zero `min + 8 * scale`); 5-, 6- and 8-bit codes as two
int4 halves, `code = 16 * hi + lo`, laid side by side along K against `[x, x]`.
The kernel suits decode (a few rows); a prefill chunk of many rows instead dequantizes
the packed weight to bf16 a row chunk at a time and runs dense GEMMs (no dense copy
stays resident).
The kernel takes bf16 scales, so fp16 scales lose 3 bits (relative error <= 2^-9 on
each weight); see `tests/test_quant_model.py` for the measured bound.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ninfer_core.kernels import cpu_attention, cpu_gemv, delta_rule, int8_act
from ninfer_core.kernels.cpu_gemv import GemvLinear
from ninfer_core.kernels.onednn_linear import OneDNNLinear
from ninfer_core.kernels.row_chunks import linear_by_row_chunks
from ninfer_core.model.attention_meta import AttentionMetadata
from ninfer_core.model.ops import KernelOps, PackedLinear, decode_length
from ninfer_core.quant.formats import WeightFormat, weight_format
from ninfer_core.quant.tensor import QuantizedTensor

if TYPE_CHECKING:
    from ninfer_core.kernels.workload import KernelWorkload

_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_INT4_CPU = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
    torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
)
#: Group sizes the CPU int4 kernel accepts.
_INT4_GROUPS = (32, 64, 128, 256)


class TorchOps(KernelOps):
    name = "torch"

    def __init__(
        self, device: torch.device | str = "cpu", workload: KernelWorkload | None = None
    ) -> None:
        super().__init__(device)
        #: What will run (None where the host did not say). With int8 activations
        #: (`int8_act`), quantized weights stay `QuantizedTensor`s (the int8 path reads
        #: their codes) and prefill rows take `int8_act.int8_linear`.
        self.workload = workload
        self._int8_acts = workload is not None and workload.int8_activations
        #: `apply_rope`'s full-width cos and signed sin, derived from the step's cos/sin
        #: by the first layer and reused by the rest (the step's tensors are the key).
        self._rope_tables: tuple[torch.Tensor, ...] = ()
        #: Plain fp32 matrices decode on `cpu_gemv.gemv_f32` (`linear`): set by
        #: `pack_linear` when it keeps one (`_keep_plain`).
        self._f32_gemv = False
        #: The step's rows and the groups its linears multiply apart (`prepare`).
        self._step_rows, self._row_groups = 0, [0]

    def linear(self, x, w, b=None):
        """A step's rows are multiplied in the groups `row_groups` makes of its
        sequences, so that each sequence's rows take the kernel they take alone: a decode
        GEMV and a prefill GEMM round differently (SmolLM2's logits moved by up to 0.25,
        0.875 for a 3-token chunk), so another client's prompt would otherwise change a
        greedy answer. A group beyond the first reads the weight once more. A compiled
        graph (a decode step or a round, never a prefill) does not split: it runs
        without `prepare`, so the step's groups would be the last eager step's."""
        if torch.compiler.is_compiling():
            return self._linear(x, w, b)
        groups = self._row_groups
        if len(groups) > 1 and x.shape[0] == self._step_rows:
            return torch.cat([self._linear(part, w, b) for part in x.split(groups)])
        return self._linear(x, w, b)

    def _linear(self, x, w, b=None):
        if isinstance(w, PackedLinear):  # what `pack_linear` made: it runs itself
            return w(x, b)
        if isinstance(w, QuantizedTensor):
            if self._int8_acts and x.shape[0] > int8_act.PREFILL_MIN_ROWS:
                return int8_act.int8_linear(x, w, b)  # W8A8 / W4A8 prefill
            return w.linear(x, b)
        if self._f32_gemv and cpu_gemv.f32_decodes(x, w):
            y = cpu_gemv.gemv_f32(x, w)
            return y if b is None else y + b
        return F.linear(x, w, b)

    def pack_linear(self, w, *, dtype=None):
        """A dense bf16 matrix on the CPU: kept row-major for the AVX512-BF16 decode
        GEMV (`cpu_gemv.GemvLinear`) where that is built, else reordered into oneDNN's
        blocked layout (`OneDNNLinear`), whose GEMVs run about 1.5-3x `F.linear` over
        row-major weights here; the same results to bf16 rounding either way.

        A `QuantizedTensor` with `dtype` bf16 on the CPU becomes a `Q4GemvLinear` or
        `Q8GemvLinear` (4-, or 5- to 8-bit codes, where the GEMVs are built) or else an
        `Int4Linear`. In
        any other dtype on the CPU (fp32, fp16) it is dequantized once, here, into a
        dense matrix of `dtype` (the exact numbers of the reference path, which would
        otherwise dequantize it again on every step): `dtype.itemsize` bytes a weight
        instead of about half a byte, which `packed_nbytes` tells `ninfer plan`. Elsewhere
        (a CUDA device, until a GPU kernel reads the codes) it stays as it is and
        `linear` runs the reference path. With int8 activations it stays as it is
        everywhere: prefill multiplies its codes (`int8_act`), decode dequantizes row
        chunks (`QuantizedTensor.linear`), the same numbers as the dense matrix."""
        if isinstance(w, QuantizedTensor):
            if self._int8_acts:
                return w
            if cpu_gemv.codes_supported(w.fmt, self.device, dtype):
                return cpu_gemv.codes_linear(w)
            if int4_format_supported(w.fmt, self.device, dtype):
                return Int4Linear(w)
            if self._dequantizes_once(dtype):
                return self._keep_plain(w.dequantize(dtype))
            return w
        if not self._reorders_dense(w.dtype):
            return self._keep_plain(w)
        return GemvLinear(w) if cpu_gemv.available() else OneDNNLinear(w)

    def _keep_plain(self, w: torch.Tensor) -> torch.Tensor:
        """A matrix `pack_linear` keeps as a plain tensor. An fp32 one on the CPU switches
        on the fp32 decode GEMV, decided here, at load: a compiled graph can't ask whether
        the operators are built, and a process that only plans (`ninfer plan`) never
        builds them."""
        if not self._f32_gemv and w.dtype == torch.float32 and self.device.type == "cpu":
            self._f32_gemv = cpu_gemv.available()
        return w

    def _dequantizes_once(self, dtype: torch.dtype | None) -> bool:
        """Whether `pack_linear` turns a quantized matrix the int4 kernel can't run for
        `dtype` into a dense one at load (the CPU, any float dtype)."""
        return self.device.type == "cpu" and dtype is not None and dtype.is_floating_point

    def _reorders_dense(self, dtype: torch.dtype | None) -> bool:
        """Whether `pack_linear` wraps a dense matrix of `dtype` (`GemvLinear`, `OneDNNLinear`)."""
        return self.device.type == "cpu" and dtype == torch.bfloat16 and _MKLDNN

    def packed_nbytes(self, fmt_name: str, shape: tuple[int, int], *, dtype) -> int | None:
        """Bytes `pack_linear` would hold for a `shape` matrix stored as `fmt_name` and run
        in `dtype`, or None where it keeps the matrix as loaded; computed from the shape
        alone, so `ninfer plan` sizes a quantized model without reading a weight."""
        fmt = weight_format(fmt_name)
        if fmt.quantized:
            if self._int8_acts:
                return None  # kept as loaded
            if cpu_gemv.codes_supported(fmt, self.device, dtype):
                return cpu_gemv.codes_linear_nbytes(fmt, shape)
            if int4_format_supported(fmt, self.device, dtype):
                return Int4Linear.nbytes_for(fmt, shape)
            if self._dequantizes_once(dtype):
                return shape[0] * shape[1] * dtype.itemsize  # the dense matrix
            return None
        if not self._reorders_dense(dtype) or cpu_gemv.available():
            return None  # kept as loaded (`GemvLinear` holds the loaded matrix itself)
        return shape[0] * shape[1] * dtype.itemsize  # oneDNN's blocked copy, same bytes

    def rms_norm(self, x, w, eps):
        # Statistics in fp32, then to the weight's dtype before the weight, as transformers
        # does (x.dtype there: the same unless x is the fp32 residual stream).
        # F.rms_norm: one fused kernel for the statistics and the scaling (same numbers).
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(w.dtype)

    def silu_and_mul(self, gate, up):
        return F.silu(gate) * up

    def apply_rope(self, q, k, cos, sin):
        """q and k rotated together, in four ops: x * cos + rotate_half(x) * sin with
        cos repeated to the full width and sin signed (-sin | sin), both derived once a
        step. Each output element rounds once (addcmul), not after every product."""
        # q: [T, H, D], k: [T, Hkv, D], cos/sin: [T, D/2] -> broadcast over heads
        cos_full, sin_signed = self._rope_full(cos, sin)  # [T, 1, D]
        qk = torch.cat((q, k), dim=1)  # [T, H + Hkv, D]
        x1, x2 = qk.chunk(2, dim=-1)
        out = torch.addcmul(qk * cos_full, torch.cat((x2, x1), dim=-1), sin_signed)
        return out[:, : q.shape[1]], out[:, q.shape[1] :]

    def _rope_full(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if torch.compiler.is_compiling():
            # A traced step derives them in its own fused kernels; reading the memo
            # would make the graph depend on (and guard on) the last eager step's.
            return _rope_tables(cos, sin)
        tables = self._rope_tables
        if not tables or tables[0] is not cos or tables[1] is not sin:
            self._rope_tables = tables = (cos, sin, *_rope_tables(cos, sin))
        return tables[2], tables[3]

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-sequence query offsets, the keys each sequence reads (a decode row's
        context padded to `decode_length`) with their page table, and, for prefill chunks
        after a cached prefix, the causal mask offset by that prefix; built once per
        step, not per layer."""
        starts, masks, lengths, tables, offset = [], [], [], [], 0
        dev, bs = meta.slot_mapping.device, meta.block_size
        rows = meta.block_tables
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
            starts.append(offset)
            offset += qlen
            # oneDNN compiles and keeps a kernel per shape on the CPU (docs/memory.md); the
            # reference pads on every device, so the workspace estimate fits all of them.
            # A few rows (a speculative round) pad alike: each row must sum over the
            # same key count as that token decoded alone, or the GEMM's tail handling
            # changes its last bits (seen with 326 keys against a lone decode's 352).
            length = decode_length(ctx, bs) if qlen <= FEW_ROWS else ctx
            lengths.append(length)
            tables.append(_page_table(rows[i], -(-length // bs)))
            if qlen == 1 or qlen == ctx:
                masks.append(None)  # decode, or a whole prompt (plain causal)
            else:
                # Query i sits at position ctx - qlen + i and sees keys up to it.
                q_pos = torch.arange(ctx - qlen, ctx, device=dev)
                masks.append(torch.arange(ctx, device=dev)[None, :] <= q_pos[:, None])
        # A few rows (a decode token, a speculative round) may run the CPU attention
        # operator over the pages in place: its table [1, P] and row 0's key count.
        few = [
            (table[None].long(), torch.tensor([ctx - qlen + 1]))
            if qlen <= FEW_ROWS and self.device.type == "cpu"  # the operator's device
            else None
            for qlen, ctx, table in zip(meta.query_lens, meta.context_lens, tables, strict=True)
        ]
        meta.plan.update(starts=starts, masks=masks, lengths=lengths, tables=tables, few=few)
        self._step_rows, self._row_groups = (
            offset,
            row_groups(meta.query_lens, meta.leading_decodes),
        )

    def paged_attention(self, q, k_new, v_new, kv_store, layer, meta, scale):
        """Each sequence attends over its own pages only: a ragged batch is never padded
        to its longest member (a decode row reads its L keys, not the batch maximum).

        A sequence's few rows (a decode token, a speculative round) read the pages in
        place through the CPU attention operator where the store's pages suit it
        (`cpu_attention.served_pages`): no gathered copy of the context, about a tenth of
        the gather and matmuls' time. Its row j computes what that token decoded alone
        computes, as `_decode_rows` does, so speculation stays lossless either way."""
        # q: [T, H, D], k_new/v_new: [T, Hkv, D]
        kv_store.write(layer, meta.slot_mapping, k_new, v_new)
        plan = meta.plan
        pages = cpu_attention.served_pages(kv_store, layer, q.shape[1])
        outs = []
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
            start, length = plan["starts"][i], plan["lengths"][i]
            qi = q[start : start + qlen]  # [Q, H, D]
            if pages is not None and qlen <= FEW_ROWS:
                rows = slice(start, start + qlen)  # row j's key is in the pool and here
                table, first = plan["few"][i]
                outs.append(cpu_attention.decode_attention(
                    qi, pages, table, first, k_new[rows], v_new[rows], qlen, scale
                ))  # fmt: skip
                continue
            # k, v: [Hkv, length, D]; a decode row's keys past ctx are padding (finite)
            k, v, rotation = gather_heads(kv_store, layer, plan["tables"][i], length, q.dtype)
            if rotation is not None:  # (qH)·(kH) = q·k; the output comes back by Hᵀ
                qi = rotation.forward(qi).to(q.dtype)
            if qlen <= FEW_ROWS:
                out = _decode_rows(qi, k, v, scale, valid=ctx)
            else:
                mask = plan["masks"][i]
                out = F.scaled_dot_product_attention(
                    qi.transpose(0, 1)[None],
                    k[None],
                    v[None],
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=scale,
                    enable_gqa=True,
                )[0].transpose(0, 1)  # [Q, H, D]
            outs.append(out if rotation is None else rotation.inverse(out).to(q.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def gated_delta_rule(self, q, k, v, g, beta, states, cu_seqlens, *, chunk=64):
        """`delta_rule.gated_delta_rule`: per sequence the recurrent form for a few
        tokens, the chunked one for more, in fp32 against the fp32 states."""
        return delta_rule.gated_delta_rule(q, k, v, g, beta, states, cu_seqlens, chunk=chunk)

    def causal_conv1d(self, x, weight, bias, states, cu_seqlens):
        """`delta_rule.causal_conv1d`: each sequence convolved behind its carried inputs."""
        return delta_rule.causal_conv1d(x, weight, bias, states, cu_seqlens)


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D/2] -> cos repeated to the full width and sin signed (-sin | sin),
    [T, 1, D] each, so rotating is `x * cos_full + rotate_half(x) * sin_signed`."""
    full = torch.cat((cos, cos), dim=-1)[:, None, :]
    signed = torch.cat((-sin, sin), dim=-1)[:, None, :]
    return full, signed


def _page_table(row: torch.Tensor, pages: int) -> torch.Tensor:
    """`pages` entries of a block-table row, padded with page 0 past its end (a real,
    zero-initialised page, so padded keys stay finite)."""
    if pages <= row.numel():
        return row[:pages]
    return torch.cat([row, row.new_zeros(pages - row.numel())])


def gather_heads(kv_store, layer: int, table: torch.Tensor, length: int, dtype: torch.dtype):
    """A sequence's (or batch's) K and V as `[(B,) Hkv, L, D]` in `dtype`, and the
    rotation they are in (or None).

    Stores that keep pages head-major offer `gather_heads`, which needs no
    transpose; any other store's token-major `gather` is transposed here. A store
    with a `rotation` (rk8v4) hands K and V over still rotated: the caller rotates
    the query and un-rotates the output, which for a decode step is two vectors per
    head instead of the whole context.
    """
    rotation = kv_store.rotation  # KVStore contract: None unless stored rotated
    if rotation is not None:
        k, v = kv_store.gather_heads(layer, table, length, rotated=True)
    elif kv_store.gather_heads is not None:  # optional: None means token-major only
        k, v = kv_store.gather_heads(layer, table, length)
    else:
        k, v = kv_store.gather(layer, table, length)
        k, v = k.transpose(-3, -2), v.transpose(-3, -2)
    return k.to(dtype), v.to(dtype), rotation


#: Query rows a sequence may run in one step and still attend the way a one-token decode
#: does: a speculative round verifies up to 1 + 8 drafts (`spec.config.MAX_DRAFT_TOKENS`).
FEW_ROWS = 9


#: Rows a linear takes and still runs its decode kernel (the GEMVs, torch's int4 kernel,
#: float activations beside int8 ones); more run a GEMM, which rounds differently.
DECODE_KERNEL_ROWS = GemvLinear.MAX_ROWS


def row_groups(query_lens: list[int], decodes: int | None = None) -> list[int]:
    """The row counts of the groups a step's linears multiply apart, in step order, such
    that every sequence's rows take the kernel they take when that sequence runs alone.

    The step's `decodes` leading sequences (decode tokens and speculative rounds, which
    the scheduler puts first; None: the leading ones of at most `FEW_ROWS` rows) form one
    group whatever their number: the rows they make once no prompt is prefilling beside
    them (past `DECODE_KERNEL_ROWS` rows that is a GEMM, and a decode's numbers then
    depend on how many others decode, which GEMVs of 16 rows would fix at about twice
    the linears' time). After them, prefill chunks of at most `DECODE_KERNEL_ROWS` rows
    share a group while it stays within that many rows (decode kernels are
    row-invariant; the decodes' group too, when it is within that many), and longer
    chunks share one (GEMMs, checked row-invariant by `tests/test_mixed_batch.py`)."""
    if decodes is None:
        decodes = next((i for i, q in enumerate(query_lens) if q > FEW_ROWS), len(query_lens))
    groups = [sum(query_lens[:decodes])] if decodes else []
    # short chunks may join the decodes' GEMV; nothing joins their GEMM
    last_short = True if groups and groups[0] <= DECODE_KERNEL_ROWS else None
    for qlen in query_lens[decodes:]:
        short = qlen <= DECODE_KERNEL_ROWS
        if (
            groups
            and short == last_short
            and (not short or groups[-1] + qlen <= DECODE_KERNEL_ROWS)
        ):
            groups[-1] += qlen
        else:
            groups.append(qlen)
        last_short = short
    return groups or [0]


def _decode_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, valid: int
) -> torch.Tensor:
    """A few query tokens (the last `Q` of `valid`), each over the keys up to its own
    position, grouped heads as two batched matmuls per row, all in fp32.

    One decode token is the case Q = 1. CPU SDPA spends most of its time on setup for a
    single query row on some CPUs; two small matmuls are as exact. They run in fp32
    whatever the model's dtype: for these shapes (a few query rows per KV head) the CPU's
    bf16 matmul costs about twice an fp32 one plus the casts (measured 72 against 36+12 us
    a layer at 320 keys, one thread), and fp32 keeps every score and probability
    unrounded.

    A speculative round's rows take this path too, one row at a time with the same
    shapes as that token decoded alone, so each row's output is bit for bit the lone
    decode's: greedy output does not change with speculation even in bf16. One matmul of
    all rows per head would be cheaper (about 120 against 200 us a layer for 4 rows at
    400 keys), but a GEMM with more rows may take another kernel with another summation
    order (seen on AVX512 CPUs: 139 of 908 random cases differed in the last bit). Keys
    past a row's position (its later rows, and the padding `decode_length` adds) get
    probability exactly 0, which leaves the sums bit for bit as without them (checked);
    they must be finite, which the zeroed pools guarantee.
    """
    # q: [Q, H, D], k/v: [Hkv, L, D] with L >= valid -> [Q, H, D]
    rows, h, d = q.shape
    hkv, length = k.shape[0], k.shape[1]
    qg = q.view(rows, hkv, h // hkv, d).float()  # [Q, Hkv, G, D]
    keys = k.float().transpose(1, 2)  # [Hkv, D, L]
    probs = []
    for row in range(rows):
        scores = torch.matmul(qg[row], keys).mul_(scale)  # [Hkv, G, L]
        end = valid - rows + 1 + row  # the keys this row sees
        if end < length:
            scores[..., end:] = float("-inf")
        probs.append(scores.softmax(dim=-1))
    del keys  # the widened K and V are never alive together (the workspace estimate)
    values = v.float()  # [Hkv, L, D]
    out = [torch.matmul(p, values) for p in probs]  # [Hkv, G, D] each
    mixed = out[0] if rows == 1 else torch.stack(out)
    return mixed.reshape(rows, h, d).to(q.dtype)


def int4_format_supported(
    fmt: WeightFormat, device: torch.device, dtype: torch.dtype | None
) -> bool:
    """Whether `Int4Linear` can run weights of `fmt` for `dtype` activations on `device`:
    codes of up to 8 bits, wider than 4 only without mins (its two halves carry no min);
    a code book's values count as 8-bit codes."""
    return (
        _INT4_CPU
        and dtype == torch.bfloat16
        and torch.device(device).type == "cpu"
        and fmt.group in _INT4_GROUPS
        and (fmt.code_bits <= 4 or (fmt.code_bits <= 8 and not fmt.mins))
    )


class Int4Linear(PackedLinear):
    """A quantized `[out, in]` weight repacked for torch's CPU int4 kernel (bf16 only).

    4-bit codes go in as `q = code + 8` with zero 0; an asymmetric format's stored value
    `u = code + 8` goes in as `q = u` with zero `min + 8 * scale` (computed in fp32, one
    rounding to bf16), since `u * scale + min = (u - 8) * scale + (min + 8 * scale)`. The
    kernel's own convention on torch 2.13, checked by the tests, is
    `w = (q - 8) * scale + zero`. Wider codes split as
    `code = 16 * hi + lo` (`lo = code & 15`, `hi = code >> 4`): the K axis holds the
    `lo` half (scale s, zero 8s, so `(lo - 8) s + 8s = lo s`) and then the `hi` half
    (`q = hi + 8`, scale 16s), and the activations go in twice, `[x, x]`. Resident
    bytes: 0.5 per weight for Q4, 1 for Q5/Q6/W8, plus 4 bytes of scale and zero per
    group (per half).
    """

    #: Rows converted at a time (a multiple of the kernel's 64-row blocks).
    CHUNK_ROWS = 4096
    #: Inputs of more rows than this take the dense path (`_dense`). The int4 kernel
    #: re-decodes the weight for every few rows (3-14x slower than bf16 past ~4 rows);
    #: the dense path decodes it once a call, which costs about what 80-100 rows through
    #: the kernel do (measured on a Xeon, 1 and 2 threads), then runs at bf16 speed.
    DENSE_MIN_ROWS = 96
    #: Weight elements dequantized at a time on the dense path (8 MiB of bf16): the
    #: whole dense matrix is never resident.
    DENSE_CHUNK_ELEMS = 1 << 22

    def __init__(self, w: QuantizedTensor) -> None:
        self.out_features, self.in_features = w.shape
        self.group, self.padded_in = w.fmt.group, w.padded_cols
        self.split = w.fmt.code_bits > 4  # a code book's values too
        self.mins = w.fmt.mins
        self.padded_out = -(-self.out_features // 16) * 16  # the kernel wants N % 16 == 0
        packed, sz = [], []
        for start in range(0, self.out_features, self.CHUNK_ROWS):
            n = min(self.CHUNK_ROWS, self.out_features - start)
            p, s = self._convert(w.narrow_rows(start, n), start + n == self.out_features)
            packed.append(p)
            sz.append(s)
        self.packed = torch.cat(packed) if len(packed) > 1 else packed[0]
        # scales_and_zeros: [K' / group, N_padded, 2]
        self.scales_and_zeros = torch.cat(sz, dim=1) if len(sz) > 1 else sz[0]

    def _convert(self, w: QuantizedTensor, last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        codes = w.codes()  # int8 [n, Kp]
        scale = w.scales.to(torch.bfloat16)  # [n, Kp / group]
        if self.split:
            lo, hi = codes & 15, codes >> 4  # two's complement: code = 16 * hi + lo
            q = torch.cat((lo.to(torch.int32), hi.to(torch.int32) + 8), dim=1)
            scales = torch.cat((scale, scale * 16), dim=1)
            zeros = torch.cat((scale * 8, torch.zeros_like(scale)), dim=1)
        elif w.mins is not None:
            q = codes.to(torch.int32) + 8  # the stored value u
            scales = scale
            zeros = (w.mins.float() + 8 * w.scales.float()).to(torch.bfloat16)
        else:
            q = codes.to(torch.int32) + 8
            scales, zeros = scale, torch.zeros_like(scale)
        pad = self.padded_out - self.out_features if last else 0
        if pad:  # zero rows: q = 8 with scale 0
            q = F.pad(q, (0, 0, 0, pad), value=8)
            scales, zeros = F.pad(scales, (0, 0, 0, pad)), F.pad(zeros, (0, 0, 0, pad))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 8)
        sz = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()
        return packed, sz

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2

    @staticmethod
    def nbytes_for(fmt: WeightFormat, shape: tuple[int, int]) -> int:
        """`nbytes` of the `Int4Linear` of a `shape` matrix in `fmt`, without building it:
        K' = padded columns (twice that for two halves), N rounded up to 16; the packed
        codes take K' / 2 bytes a row, and each group of each row a bf16 scale and zero."""
        rows, cols = int(shape[0]), int(shape[1])
        k = fmt.padded_cols(cols) * (2 if fmt.code_bits > 4 else 1)
        n = -(-rows // 16) * 16
        return n * k // 2 + (k // fmt.group) * n * 2 * 2

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] bf16 -> [T, out] bf16
        assert x.dtype == torch.bfloat16 and x.shape[-1] == self.in_features
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        if x.shape[0] > self.DENSE_MIN_ROWS and int4_layout_known():
            return self._dense(x, b)
        if self.split:
            x = torch.cat((x, x), dim=-1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, self.group, self.scales_and_zeros
        )
        if self.padded_out != self.out_features:
            y = y[:, : self.out_features]
        return y if b is None else y + b

    def dequantize_t(self, start: int, n: int, dtype=torch.float32) -> torch.Tensor:
        """Rows `start:start + n` of the weight, transposed: `[padded_in, n]` in `dtype`,
        with the kernel's numbers: `code * scale`, the code rebuilt as `q - 8` (Q4) or
        `16 (q_hi - 8) + q_lo` (two halves) and the bf16 scale of `_convert`, so each
        product rounds once into `dtype`; an asymmetric format's `(q - 8) * scale + zero`
        is computed in fp32 (the product exact, the sum rounded once) and then cast.
        `start` is a multiple of 64."""
        q = unpack_int4pack(self.packed, self.padded_out, start, n)  # [K', n] 0..15
        groups = self.padded_in // self.group
        # scales_and_zeros: [K' / group, N, 2]; the first `groups` hold s (lo half, or Q4)
        scales = self.scales_and_zeros[:groups, start : start + n, 0]  # [groups, n]
        # Codes are integers in [-128, 127]: exact in bf16, so they are built in `dtype`.
        if self.mins:
            zeros = self.scales_and_zeros[:groups, start : start + n, 1]  # [groups, n]
            w = q.to(torch.float32).sub_(8).view(groups, self.group, n)
            w.mul_(scales.float()[:, None]).add_(zeros.float()[:, None])
            return w.view(self.padded_in, n).to(dtype)
        if self.split:
            lo, hi = q[: self.padded_in], q[self.padded_in :]
            codes = lo.to(dtype).add_(hi.to(dtype), alpha=16).sub_(128)
        else:
            codes = q.to(dtype).sub_(8)
        w = codes.view(groups, self.group, n).mul_(scales.to(dtype)[:, None])
        return w.view(self.padded_in, n)

    def _dense(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """Many rows (a prefill chunk): dequantize the weight to bf16 one row chunk at a
        time and run dense GEMMs, which reuse each weight over every row of `x`."""
        # x: [T, padded_in] bf16 -> [T, out] bf16
        step = max(64, self.DENSE_CHUNK_ELEMS // self.padded_in // 64 * 64)
        return linear_by_row_chunks(
            x, b, self.out_features, step,
            lambda x, start, n: torch.matmul(x, self.dequantize_t(start, n, torch.bfloat16)),
        )  # fmt: skip

    def __repr__(self) -> str:
        halves = " (two int4 halves)" if self.split else " (scale and min)" if self.mins else ""
        return f"Int4Linear([{self.out_features}, {self.in_features}], group {self.group}{halves})"


#: Rows per block of the CPU int4 kernel's packed layout.
_INT4_BLOCK = 64


def unpack_int4pack(packed: torch.Tensor, rows: int, start: int, n: int) -> torch.Tensor:
    """Rows `start:start + n` of a `_convert_weight_to_int4pack_for_cpu` result, as uint8
    nibbles `[K, n]` (K-major, the layout the packing already has: no transpose);
    `rows` is the packed matrix's row count, `start` a multiple of 64.

    The layout (checked by `int4_layout_known` before it is relied on): rows in blocks
    of 64, each block `[K, 32]` bytes whose byte j holds row j (low nibble) and row
    j + 32 (high); a last block of fewer rows `[K, rows / 2]`, two adjacent rows a byte.
    """
    flat = packed.view(-1)
    k = flat.numel() * 2 // rows
    full = rows // _INT4_BLOCK * _INT4_BLOCK
    b0 = start // _INT4_BLOCK
    b1 = -(-min(start + n, full) // _INT4_BLOCK) if start < full else b0
    tail = rows - full if start + n > full else 0
    out = torch.empty(k, (b1 - b0) * _INT4_BLOCK + tail, dtype=torch.uint8)
    if b1 > b0:
        half = _INT4_BLOCK // 2
        blocks = flat[: full * k // 2].view(-1, k, half)[b0:b1].transpose(0, 1)  # [K, nb, 32]
        dst = out[:, : (b1 - b0) * _INT4_BLOCK].view(k, b1 - b0, _INT4_BLOCK)
        torch.bitwise_and(blocks, 15, out=dst[..., :half])
        torch.bitwise_right_shift(blocks, 4, out=dst[..., half:])
    if tail:
        packed_tail = flat[full * k // 2 :].view(k, tail // 2)
        dst = out[:, -tail:].view(k, tail // 2, 2)
        torch.bitwise_and(packed_tail, 15, out=dst[..., 0])
        torch.bitwise_right_shift(packed_tail, 4, out=dst[..., 1])
    return out[:, :n]


@functools.cache
def int4_layout_known() -> bool:
    """Whether this torch packs int4 weights the way `unpack_int4pack` reads them (the
    layout is the kernel's own, not a public format): one round trip, once a process.
    If not, `Int4Linear` keeps to the kernel for every batch size."""
    if not _INT4_CPU:
        return False
    q = torch.randint(0, 16, (80, 128), generator=torch.Generator().manual_seed(0))
    q = q.to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
    try:
        whole = unpack_int4pack(packed, 80, 0, 80)
        part = unpack_int4pack(packed, 80, 64, 16)
    except RuntimeError:
        return False
    return torch.equal(whole.t().to(torch.int32), q) and torch.equal(
        part.t().to(torch.int32), q[64:]
    )
