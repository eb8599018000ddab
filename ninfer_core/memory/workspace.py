"""Activation workspace: the memory one engine step needs beyond weights and the KV pool.

Two ways to get it:

- `estimate_workspace` computes it from shapes alone (what `ninfer plan` uses, with no
  weights loaded), for the attention kernel selection picked: one that reads the pages
  in place declares what it allocates (`KernelBackend.attention_scratch`, the Triton
  backend's), and nothing of the context is copied. Otherwise it follows the torch
  reference backend, where the step's largest live
  set is attention at any real context: each sequence's pages are gathered whole and
  decoded to the compute dtype (quantized codecs through fp32 temporaries), one sequence
  after another; on the CPU, decode rows over float pages read them in place instead
  (`kernels/cpu_attention.py`), and only a prefill chunk gathers. That term grows with
  the context, so at long contexts it dwarfs the projections. The SDPA kernel's internal
  scratch is not modelled (a flash or memory-efficient kernel needs O(T·H·D) beside its
  inputs). Checked against a live-bytes count of a real profiling step in
  `tests/test_memory_plan.py`. A hybrid model's state
  layers (`caches`) add their own stage, the Gated DeltaNet's through the reference
  `causal_conv1d` and chunked `gated_delta_rule` (`linear_attention_bytes`): per step
  tokens, whatever the context, so it sets the peak only at short contexts; only one
  layer's temporaries are live at a time, so the number of layers of either kind
  never enters (`tests/test_hybrid_workspace.py`).
- `measure_workspace` runs a profiling step at the configured prefill chunk and reads
  `torch.cuda.max_memory_allocated` on CUDA. The CPU has no allocator statistics, so
  there it returns the estimate (an upper bound of what the step allocates).

The worst step is the token budget `prefill_chunk` spread as the scheduler may spread
it: `concurrency - 1` decode tokens and one prefill chunk, every sequence at
`context` tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from ninfer_core import conformance
from ninfer_core.kernels import cpu_attention
from ninfer_core.kernels.reference import FEW_ROWS
from ninfer_core.model.caches import ModelCaches, SequenceState
from ninfer_core.model.config import ModelConfig
from ninfer_core.model.ops import decode_length
from ninfer_core.plugin_types import AttentionScratch, KVCodec, KVStore

if TYPE_CHECKING:
    from ninfer_core.device import DeviceInfo
    from ninfer_core.engine.runtime import Runtime
    from ninfer_core.loading import LoadedModel
    from ninfer_core.plugin_host import PluginHost


@dataclass(frozen=True)
class Workspace:
    """Peak bytes of one step, how they were obtained, and for which step."""

    nbytes: int
    method: Literal["estimate", "measured"]
    prefill_chunk: int
    context: int
    concurrency: int
    #: For an estimate, each stage's live bytes (the total is `step` + the largest stage).
    parts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def gather_scratch(store: KVStore) -> int:
    """Extra bytes per gathered value, beyond the compute-dtype copy, as the store's
    `gather_scratch_bytes` declares them (the `KVStore` contract); None: a plain cast,
    which gathers pages in the storage dtype and then converts (nothing when they match)."""
    if store.gather_scratch_bytes is not None:
        return store.gather_scratch_bytes
    storage, compute = store.dtype, store.compute_dtype
    return 0 if storage == compute else storage.itemsize + compute.itemsize


def probe_store(kv_codec: KVCodec, head_dim: int, compute_dtype: torch.dtype) -> KVStore:
    """A one-page, one-head store of `kv_codec` on the CPU (a few hundred bytes), to read
    what its contract declares before any pool exists (`ninfer plan`)."""
    from ninfer_core.kv.layout import KVLayout

    store = kv_codec.allocate(KVLayout(1, 1, head_dim, 1, 1), "cpu", compute_dtype=compute_dtype)
    conformance.check(store, KVStore, f"the KV store codec {kv_codec.name!r} allocated")
    return store


def step_shape(prefill_chunk: int, context: int, concurrency: int) -> tuple[int, int, int]:
    """(tokens T, sequences B, longest query) of the worst step within the token budget."""
    b = max(1, min(concurrency, prefill_chunk))
    t = min(prefill_chunk, (b - 1) + context)
    return t, b, t - (b - 1)


def estimate_workspace(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    kv_codec: KVCodec | None = None,
    kv_store: KVStore | None = None,
    prefill_chunk: int,
    context: int,
    concurrency: int = 1,
    logit_rows: int | None = None,
    block_size: int = 16,
    caches: ModelCaches | None = None,
    device_kind: str = "cpu",
    attention_scratch: AttentionScratch | None = None,
) -> Workspace:
    """Peak bytes of the worst step, stage by stage, from shapes (see the module doc).

    The KV pages are decoded by `kv_store`, or by a store of `kv_codec` (`probe_store`):
    one of them is needed. `logit_rows`: rows projected onto the vocabulary (default one
    per sequence; drafts being verified need one per draft token). `block_size`: the KV
    page, which a decode row's padded context (`decode_length`) is a multiple of.
    `caches`: what each layer keeps (the family's `layer_caches`); a state layer adds
    its stage (`linear_attention_bytes`). None: every layer is attention. `device_kind`:
    on the CPU, decode rows may read the pages in place (`cpu_attention.serves`), so only
    a prefill chunk gathers its context. `attention_scratch`: what the chosen attention
    kernel allocates instead of gathering (`KernelBackend.attention_scratch`: it reads
    the pages in place, builds no mask, and holds no copy of any context).
    """
    if kv_store is None:
        if kv_codec is None:
            raise TypeError("estimate_workspace() needs kv_codec or kv_store")
        kv_store = probe_store(kv_codec, config.head_dim, dtype)
    c = dtype.itemsize
    t, b, qmax = step_shape(prefill_chunk, context, concurrency)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    hq, hkv = config.num_heads, config.num_kv_heads
    s = context
    # A decode row reads its context padded to `decode_length` (up to 1/8 more keys).
    s_kv = decode_length(context, block_size) if b > 1 or qmax == 1 else context
    # One sequence's K (or V) at full context: [Hkv, S, D]. Sequences are gathered one at
    # a time, but the previous one's K and V stay bound while the next is gathered.
    gathered = s_kv * hkv * d
    previous = 2 * gathered * c if b > 1 else 0
    mask = qmax * s if qmax not in (1, s) else 0  # bool [Q, S] of a later prefill chunk
    scores = hq * s_kv * (4 + c) if b > 1 or qmax == 1 else 0  # a decode row's fp32 scores
    in_place = 0
    if device_kind == "cpu" and cpu_attention.serves(kv_store, hq // hkv):
        # Decode rows read the pages where they lie: fp32 q and output, and per row and
        # chunk of keys a partial of each head; only a prefill chunk gathers, alone.
        rows = (b - 1) + (qmax if qmax <= FEW_ROWS else 0)
        chunks = -(-(context + FEW_ROWS) // cpu_attention.CHUNK)
        in_place = rows * hq * (2 * d + chunks * (d + 2)) * 4
        gathered = context * hkv * d if qmax > FEW_ROWS else 0
        previous = scores = 0
    outputs = 2 * t * hq * d * c  # per sequence, then concatenated
    if attention_scratch is not None:
        few = (b - 1) + (qmax if qmax <= FEW_ROWS else 0)
        outputs = attention_scratch(
            tokens=t, few_rows=few, context=s_kv, num_heads=hq, head_dim=d, dtype_bytes=c,
            rotated=kv_store.rotation is not None,
        )  # fmt: skip
        gathered = previous = mask = scores = in_place = 0
    parts = {
        # Live all step: the residual stream (a layer's input and its output), the mask, RoPE.
        "step": 2 * t * h * c + mask + t * d * c,
        # RMSNorm statistics in fp32.
        "norm": t * h * c + 3 * t * h * 4,
        # Normed input, qkv, normed and rotated q/k; K/V gathered and decoded; SDPA's
        # additive copy of the mask or a decode row's scores; the per-sequence outputs
        # and their concatenation.
        "attention": (
            t * h * c
            + t * (hq + 2 * hkv) * d * c
            + 3 * t * (hq + hkv) * d * c
            + gathered * (2 * c + gather_scratch(kv_store))
            + previous
            + max(mask * c, scores)
            + in_place
            + outputs
        ),
        # Normed input, gate|up, silu(gate), silu(gate) * up, the down projection.
        "mlp": 2 * t * h * c + 4 * t * i * c,
        # The head's output in the compute dtype, then as fp32 logits.
        "logits": (logit_rows or b) * config.vocab_size * (c + 4),
    }
    states = caches.state_layers.values() if caches is not None else ()
    linear = [linear_attention_bytes(state, t, b, h, c) for state in states]
    if any(linear):
        parts["linear_attention"] = max(linear)
    total = parts["step"] + max(v for k, v in parts.items() if k != "step")
    return Workspace(total, "estimate", prefill_chunk, context, concurrency, parts)


#: Tokens per chunk of the chunked `gated_delta_rule` (`kernels/delta_rule.py`'s default).
DELTA_CHUNK = 64


def linear_attention_bytes(state: SequenceState, t: int, b: int, hidden: int, c: int) -> int:
    """Live bytes of a Gated DeltaNet layer over a step of `t` tokens and `b` sequences
    (`c` bytes a compute-dtype value), read off its state, the ops' contract: the conv's
    [C, K - 1] (C = q|k|v channels) and the recurrent [Hv, Dk, Dv]; 0 for any other state.

    At the chunked `gated_delta_rule`'s peak (its chunks' outputs being concatenated) the
    layer holds its normed input; the projections' output (q|k|v|z and b|a: z, a view,
    keeps it all); the conv's output; the states read for the step, and the running
    state; q and k normalised in fp32 and repeated per value head, v in fp32, the chunks'
    outputs and their concatenation, fp32; the output in the compute dtype; and, counted
    on top though it is freed before the concatenation, one chunk's scratch (four
    [Hv, C, C] and five [Hv, C, D] fp32, C = `DELTA_CHUNK`): next to the per-token terms
    it matters only for narrow heads. None of it depends on the context."""
    shapes = [tensor.shape for tensor in state.tensors]
    if sorted(len(s) for s in shapes) != [2, 3]:
        return 0
    channels = next(s for s in shapes if len(s) == 2)[0]
    hv, dk, dv = next(s for s in shapes if len(s) == 3)
    v = hv * dv
    return (
        t * hidden * c
        + t * (channels + v + 2 * hv) * c
        + t * channels * c
        + b * state.nbytes
        + hv * dk * dv * 4
        + 2 * t * hv * dk * 4
        + 3 * t * v * 4
        + t * v * c
        + hv * DELTA_CHUNK * (4 * DELTA_CHUNK + 5 * max(dk, dv)) * 4
    )


class RunnerLike(Protocol):
    """What `measure_workspace` needs of a `ModelRunner`."""

    model: Any
    kv_store: Any
    device: torch.device
    block_size: int

    def run(self, batch: list, *, all_tokens: bool = False) -> torch.Tensor: ...


def run_profiling_step(runner: RunnerLike, prefill_chunk: int, context: int, concurrency: int):
    """Run the worst step (dummy token ids) through `runner`; returns its logits.

    The KV store may be tiny: every sequence's block table cycles over its pages, so
    attention still gathers `context` tokens per sequence. Token id 0 everywhere gives
    finite K/V, which is all pages need (they are overwritten before any real read).
    A model with state layers gets a state slot for each sequence (the runner's pool,
    `profiling_runtime(concurrency=...)`), handed back after the step.
    """
    from ninfer_core.engine.sequence import Sequence

    _, b, qmax = step_shape(prefill_chunk, context, concurrency)
    num_blocks = runner.kv_store.layout.num_blocks
    table = [p % num_blocks for p in range(-(-context // runner.block_size))]
    states = getattr(runner, "states", None)
    batch = []
    for n in [qmax] + [1] * (b - 1):
        seq = Sequence([0] * context)
        seq.num_computed_tokens = context - n
        seq.block_table = list(table)
        if states is not None:
            seq.state_slot = states.allocate()
        batch.append((seq, n))
    try:
        return runner.run(batch)
    finally:
        if states is not None:
            for seq, _ in batch:
                states.free(seq.state_slot)


def measure_workspace(
    runner: RunnerLike,
    prefill_chunk: int,
    *,
    context: int,
    concurrency: int = 1,
    caches: ModelCaches | None = None,
) -> Workspace:
    """Peak bytes a profiling step allocates beyond what is allocated before it.

    CUDA: measured with `torch.cuda.max_memory_allocated` (the store's pages are
    already allocated, so they are not counted). CPU: `estimate_workspace` instead
    (`caches`: the model's, for its state layers' stage).
    """
    model = runner.model
    if runner.device.type != "cuda":
        return estimate_workspace(
            model.config,
            dtype=model.dtype,
            kv_store=runner.kv_store,
            prefill_chunk=prefill_chunk,
            context=context,
            concurrency=concurrency,
            block_size=runner.block_size,
            caches=caches,
        )
    dev = runner.device
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    logits = run_profiling_step(runner, prefill_chunk, context, concurrency)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del logits
    return Workspace(peak, "measured", prefill_chunk, context, concurrency, {"peak": peak})


def profiling_runtime(
    loaded: LoadedModel,
    host: PluginHost,
    device: DeviceInfo,
    *,
    kv_dtype: str,
    block_size: int,
    prefill_chunk: int,
    concurrency: int = 1,
) -> Runtime:
    """The runtime `run_profiling_step` runs in, before the pool is sized: built by the
    engine's own builder (`engine.runtime.build_runtime`, so the codec, store and runner are
    the ones the engine will use), with just enough pages for the step's writes and, for
    a model with state layers, a state slot for each of `concurrency` sequences."""
    from ninfer_core.engine.runtime import RuntimeSpec, build_runtime

    pages = -(-prefill_chunk // block_size) + 1
    spec = RuntimeSpec(
        num_blocks=pages, block_size=block_size, kv_dtype=kv_dtype, max_sequences=concurrency
    )
    return build_runtime(loaded, host, device, spec)
