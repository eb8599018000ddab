"""`CompiledDecode`: the decode step captured with `torch.compile`.

An eager decode step of a 30-layer model is about 480 small ops, each a Python call and a
dispatch; on the CPU they cost more than the GEMMs of a 4-bit model
(docs/performance.md). Inductor fuses the norms, RoPE, residual adds and the attention's
softmax into a few C++ kernels around the GEMM calls. The model offers the step as one
traceable function (`CausalLM.decode_graph`: it reads the cache and returns the new K/V
instead of writing them); this module compiles it once, feeds it the step's inputs and
stores the K/V it returns (`KVStore.write_layers`).

The eager forward stays the reference and the fallback: every step the compiled
function does not take (prefill or a step mixing it, more than `max_batch` sequences,
logits for every token) runs eagerly, and so does every step after the compiled one has
failed once (a compiler missing, a model the tracer cannot capture): the failure is
logged once with its reason, and the step is rerun eagerly (the graph writes nothing,
so nothing is half done).

Compiling takes about 20-100 s on 2 cores (a C++ compiler builds the kernels), on the
first step it takes; it is opt-in (`--compile-decode`).
"""

from __future__ import annotations

import functools
import logging
import re
import types
import warnings
from collections.abc import Collection
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from ninfer_core.model.ops import decode_length

if TYPE_CHECKING:
    from ninfer_core.model.attention_meta import AttentionMetadata

log = logging.getLogger(__name__)


def capture_refusal(model: torch.nn.Module, kv_store) -> str | None:
    """Why the decode step of `model` over `kv_store` can't be captured, or None."""
    from ninfer_core.kernels.reference import TorchOps

    if model.decode_graph is None:  # an optional `CausalLM` member, declared by every model
        return "the model family offers no decode graph"
    if type(model.ops) is not TorchOps:
        return (
            f"kernel ops come from {model.ops.name!r}, not only the torch reference "
            "(the compiled step traces the reference's ops)"
        )
    if model.ops.device.type != "cpu":
        return "only the CPU decode step is compiled (GPUs get their own kernels)"
    return store_refusal(kv_store)


def store_refusal(kv_store, whose: str = "the KV store") -> str | None:
    """Why a graph can't attend over `kv_store`'s pages and store its K/V after the call
    (it needs the optional `gather_heads` and `write_layers`, and K/V kept as computed),
    or None."""
    if kv_store.write_layers is None or kv_store.gather_heads is None:
        return f"{whose} has no write_layers / gather_heads"
    if kv_store.rotation is not None:
        return f"{whose} keeps K and V rotated"
    return None


class CompiledDecode:
    """Runs decode steps (one new token for each of up to `max_batch` sequences) through
    the compiled `decode_graph`: one graph per batch size, compiled when first seen."""

    #: The page table has at least this many columns: a dimension of size 1 would be
    #: specialised by the tracer (one more graph for contexts of one page).
    MIN_PAGES = 2
    #: Batch sizes compiled at most.
    MAX_BATCH = 8

    def __init__(
        self, model: torch.nn.Module, kv_store, block_size: int, max_batch: int = 1
    ) -> None:
        self.kv_store, self.block_size = kv_store, block_size
        self.max_batch = max(1, min(max_batch, self.MAX_BATCH))
        self._fn = compile_graph(own_code(model.decode_graph), fixed=FIXED_ARGUMENTS)
        #: Why the compiled step stopped being used, once it failed; None while it works.
        self.failed: str | None = None
        #: Steps the compiled function ran.
        self.steps = 0

    def takes(self, batch: Seq[tuple[object, int]]) -> bool:
        """Whether this step is one it runs: every sequence adds one token."""
        return (
            self.failed is None
            and 0 < len(batch) <= self.max_batch
            and all(n == 1 for _, n in batch)
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """logits [B, vocab] fp32 for the prepared decode step (its K/V stored), or None
        when the compiled function failed: the caller runs the step eagerly."""
        table = page_table(meta, meta.context_lens, self.block_size)
        context = torch.tensor(meta.context_lens, dtype=torch.int64)
        try:
            logits, k, v = call_graph(self._fn, input_ids, positions, self.kv_store,
                                      table, context)  # fmt: skip
        except Exception as exc:  # the compiler or its output, not the request
            self.failed = failure_reason(exc)
            log.warning("compiled decode step failed, decoding eagerly from now on: %s",
                        self.failed)  # fmt: skip
            return None
        self.kv_store.write_layers(meta.slot_mapping, k, v)
        self.steps += 1
        return logits


#: The arguments of `decode_graph` and `verify_graph` fixed for a runtime's life.
FIXED_ARGUMENTS = ("self", "kv_store")

#: Graphs the tracer may keep per compiled function. Its limit counts graphs per code
#: object, so every batch size adds one; its default, 8, is raised to this.
RECOMPILE_LIMIT = 64


def compile_graph(fn, fixed: Collection[str] = ()):
    """`fn` through `torch.compile` as every captured step is: the whole graph or a
    failure (`fullgraph`), the batch size static in each graph (`dynamic=False`; the page
    count is the one dynamic size, marked per call by `page_table`), and the kernels called
    from C++ instead of a Python function (`cpp_wrapper`): 9% faster decode (SmolLM2, 2
    threads: 97 and 94 against 88 and 87 tok/s) for about twice the compile time.

    `fixed` names arguments that stay the same objects, unchanged, for as long as `fn`
    lives (a runtime's model and KV store: their weights, pools and attributes are set at
    build time), and `fn` a code object of its own (`own_code`): the guards on them, and
    on globals, are not kept (`fixed_guards_dropped`)."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    options: dict[str, object] = {"cpp_wrapper": True}
    if fixed:
        options["guard_filter_fn"] = functools.partial(fixed_guards_dropped, frozenset(fixed))
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options)


def fixed_guards_dropped(fixed: frozenset[str], entries) -> list[bool]:
    """Which of the compiler's guards to keep: not those on the `fixed` arguments or on
    globals. Every call would check them all (some 7,000 for a 30-layer model: every
    weight's shape, dtype and strides, the store's pools, the model's attributes) to
    learn what cannot change; the guards on the step's own inputs (the batch size that
    picks a graph, the page table's width) and the global state stay. A guard's name is
    the source it reads, sometimes inside calls (`type(self.layers[0].mlp).__call__`,
    the code a packed layer runs): its argument is the first name past them."""
    return [not (e.is_global or _ROOT.match(e.name).group(1) in fixed) for e in entries]


#: The argument a guard's source starts from: the first name past any calls around it.
_ROOT = re.compile(r"^(?:\w+\()*(\w*)")


def call_graph(fn, *args):
    """`fn(*args)` with the compiler's own notes silenced (a fused kernel reading bf16 and
    fp16, the deprecations of modules it imports: not the user's to act on)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


def page_table(meta: AttentionMetadata, ends: Seq[int], block_size: int) -> torch.Tensor:
    """The step's page table for a graph: [B, P] int64, P the pages of the longest
    `decode_length` of the sequences' contexts `ends` (so a graph's attention sums over
    the key count the eager decode does), at least `CompiledDecode.MIN_PAGES`, padded with
    page 0; P is marked dynamic, so one graph serves every context."""
    bs = block_size
    pages = max(CompiledDecode.MIN_PAGES, *(-(-decode_length(c, bs) // bs) for c in ends))
    rows = meta.block_tables.long()  # [B, max_blocks], padded with page 0
    if pages <= rows.shape[1]:
        table = rows[:, :pages]
    else:
        table = torch.cat((rows, rows.new_zeros(rows.shape[0], pages - rows.shape[1])), 1)
    torch._dynamo.maybe_mark_dynamic(table, 1)
    return table


def own_code(method):
    """`method` (bound) over a copy of its function's code object.

    torch.compile keeps compiled graphs, and the guards that pick one, per code object:
    with its own, a compiled step's graphs are only its own batch sizes', never another
    model's (another `CompiledDecode` in the process) — what makes dropping the guards
    on its fixed arguments safe (`compile_graph`)."""
    func = method.__func__
    clone = types.FunctionType(
        func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
        func.__closure__,
    )  # fmt: skip
    return types.MethodType(clone, method.__self__)


def failure_reason(exc: BaseException) -> str:
    """One line for a failure: the innermost cause (the compiler wraps what went wrong
    in `BackendCompilerFailed`, as `inner_exception`), its type and the first line of
    its message."""
    while True:
        inner = exc.__cause__ or getattr(exc, "inner_exception", None)
        if inner is None or inner is exc:
            break
        exc = inner
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
