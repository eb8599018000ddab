"""`CompiledDecode`: the decode step captured with `torch.compile`.

An eager decode step of a 30-layer model is about 480 small ops, each a Python call and a
dispatch; on the CPU they cost more than the GEMMs of a 4-bit model
(docs/performance.md). Inductor fuses the norms, RoPE, residual adds and the attention's
softmax into a few C++ kernels around the GEMM calls. The model offers the step as one
traceable function (`CausalLM.decode_graph`: it reads the cache and returns the new K/V
instead of writing them); this module compiles it once, feeds it the step's inputs and
stores the K/V it returns (`KVStore.write_layers`). A model with per-sequence states (the
hybrid family's Gated DeltaNet layers) also reads each sequence's state from the state pool
and returns the next ones, which are written and committed here (`StepStates`), as after an
eager step.

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
import inspect
import logging
import re
import types
import warnings
from collections.abc import Callable, Collection, Mapping
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from ninfer_core.model.ops import decode_length

if TYPE_CHECKING:
    from ninfer_core.kv.state import SequenceStatePool, StepStates
    from ninfer_core.model.attention_meta import AttentionMetadata

log = logging.getLogger(__name__)


def capture_refusal(model: torch.nn.Module, kv_store) -> str | None:
    """Why the decode step of `model` over `kv_store` can't be captured, or None."""
    from ninfer_core.kernels.reference import TorchOps
    from ninfer_core.model.moe import SparseMoE

    if model.decode_graph is None:  # an optional `CausalLM` member, declared by every model
        return "the model family offers no decode graph"
    if any(isinstance(m, SparseMoE) for m in model.modules()):
        return "sparse MoE layers pick their experts on the host, which a graph cannot capture"
    if type(model.ops) is not TorchOps:
        return (
            f"kernel ops come from {model.ops.name!r}, not only the torch reference "
            "(the compiled step traces the reference's ops)"
        )
    if model.ops.device.type != "cpu":
        return "only the CPU decode step is compiled (GPUs get their own kernels)"
    return store_refusal(kv_store)


def store_refusal(kv_store, whose: str = "the KV store") -> str | None:
    """Why a graph can't attend over `kv_store`'s pages and store its K/V after the call,
    or None. It needs the optional `gather_heads` and `write_layers`; a store that keeps
    K/V rotated or coded (rk8v4, int8) must also describe its pages (`raw_pages`, with
    the encoder of each coded pool), so the graph reads its own rows as they will be
    stored (`decode_graph.read_back`, or the CPU kernel coding them itself)."""
    if kv_store.write_layers is None or kv_store.gather_heads is None:
        return f"{whose} has no write_layers / gather_heads"
    if kv_store.raw_pages is None:  # an optional member of the KVStore contract
        if kv_store.rotation is not None:
            return f"{whose} keeps K and V rotated and describes no pages (raw_pages)"
        return None
    pages = kv_store.raw_pages(0)
    if any(p.encoding != "float" and p.encoder is None for p in (pages.k, pages.v)):
        return f"{whose} keeps K and V as codes whose pages name no encoder"
    return None


def keeps_rows_as_read(kv_store, dtype: torch.dtype) -> bool:
    """Whether a step's own rows, as a graph reads them, are what a later step reads back
    from `kv_store` (given `store_refusal` is None): float pages of the model's `dtype`, or
    pages the store describes as coded or rotated (the graph codes its rows likewise)."""
    if kv_store.raw_pages is None:
        return False
    pages = kv_store.raw_pages(0)
    floats = pages.k.encoding == pages.v.encoding == "float"
    return not floats or pages.rotation is not None or pages.k.values.dtype == dtype


class CompiledDecode:
    """Runs decode steps (one new token for each of up to `max_batch` sequences) through
    the compiled `decode_graph`: one graph per batch size, compiled when first seen."""

    #: The page table has at least this many columns: a dimension of size 1 would be
    #: specialised by the tracer (one more graph for contexts of one page).
    MIN_PAGES = 2
    #: Batch sizes compiled at most.
    MAX_BATCH = 8

    def __init__(
        self,
        model: torch.nn.Module,
        kv_store,
        block_size: int,
        max_batch: int = 1,
        states: SequenceStatePool | None = None,
    ) -> None:
        self.kv_store, self.block_size = kv_store, block_size
        #: The per-sequence states the graph reads and advances (None: a model without).
        self.states = states
        self.max_batch = max(1, min(max_batch, self.MAX_BATCH))
        self._fn = compile_graph(
            own_code(model.decode_graph), fixed=FIXED_ARGUMENTS, dynamic=DYNAMIC_ARGUMENTS
        )
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
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        step: StepStates | None = None,
    ) -> torch.Tensor | None:
        """logits [B, vocab] fp32 for the prepared decode step (its K/V stored, and the
        batch's next states written into `step`, for the caller to commit), or None when
        the compiled function failed: the caller runs the step eagerly."""
        table = page_table(meta, meta.context_lens, self.block_size)
        context = torch.tensor(meta.context_lens, dtype=torch.int64)
        args = (input_ids, positions, self.kv_store, table, context)
        try:
            logits, k, v, *states = self._fn(*args, *state_args(self.states, step))
        except Exception as exc:  # the compiler or its output, not the request
            self.failed = failure_reason(exc)
            log.warning("compiled decode step failed, decoding eagerly from now on: %s",
                        self.failed)  # fmt: skip
            return None
        self.kv_store.write_layers(meta.slot_mapping, k, v)
        write_states(step, states)
        self.steps += 1
        return logits


def state_args(pool: SequenceStatePool | None, step: StepStates | None) -> tuple:
    """The graph's trailing arguments for a model with state layers: the pool (fixed) and
    the batch's current rows of its buffers [B]; none for a model without."""
    if pool is None:
        return ()
    if step is None:
        raise ValueError("a model with per-sequence states needs the step's states")
    return pool, step.read_rows


def write_states(step: StepStates | None, states: Seq[torch.Tensor]) -> None:
    """Write the next states a graph returned (every state layer's tensors, in layer
    order) into `step`; committing them is the caller's, after the whole step."""
    if step is None:
        return
    at = 0
    for layer, bufs in step.pool.buffers.items():
        step.write(layer, states[at : at + len(bufs)])
        at += len(bufs)
    if at != len(states):
        raise ValueError(f"the graph returned {len(states)} state tensors, the pool keeps {at}")


#: The arguments of `decode_graph` and `verify_graph` fixed for a runtime's life.
FIXED_ARGUMENTS = ("self", "kv_store", "state_pool")
#: Their argument with a dynamic dimension: the page table's page count (`page_table`).
DYNAMIC_ARGUMENTS = {"block_table": 1}

#: Inductor's settings for these graphs. `cpp_wrapper`: the graph is called from C++, not
#: a Python function (`compile_graph`). `cpp.threads` 1: the generated kernels (norms,
#: rope, activations over one to a few rows) run without OpenMP regions, whose fork and
#: barriers cost more than vectors of a few thousand elements take; the GEMV and
#: attention operators keep torch's threads. Decode, in one process alternating with the
#: threaded kernels: Qwen3-0.6B `q4` 51.4 -> 55.2 tok/s, SmolLM2 F16 84.3 -> 87.3,
#: SmolLM2 Q4_1 130.8 -> 134.1 (2 threads), the same ids.
INDUCTOR_PATCHES = {"cpp_wrapper": True, "cpp.threads": 1}

#: Graphs the tracer may keep per compiled function. Its limit counts graphs per code
#: object, so every batch size adds one; its default, 8, is raised to this.
RECOMPILE_LIMIT = 64


def compile_graph(fn, fixed: Collection[str] = (), dynamic: Mapping[str, int] | None = None):
    """`fn` through `torch.compile` as every captured step is: the whole graph or a
    failure (`fullgraph`), the batch size static in each graph (`dynamic=False`; the page
    count is the one dynamic size, marked per call by `page_table`), and the kernels called
    from C++ instead of a Python function (`cpp_wrapper`): 9% faster decode (SmolLM2, 2
    threads: 97 and 94 against 88 and 87 tok/s) for about twice the compile time; the
    generated kernels on one thread (`INDUCTOR_PATCHES`).

    `fixed` names arguments that stay the same objects, unchanged, for as long as `fn`
    lives (a runtime's model and KV store: their weights, pools and attributes are set at
    build time), and `fn` a code object of its own (`own_code`): the guards on them, and
    on globals, are not kept (`fixed_guards_dropped`), and once a graph exists for a
    call's shapes, later calls skip the tracer (`CompiledGraph`). `dynamic` names the
    arguments with a dynamic dimension (argument name -> dim), the dims `page_table`
    marks."""
    return CompiledGraph(fn, fixed, dynamic or {})


class CompiledGraph:
    """`fn` compiled (`compile_graph`), called without the tracer's per-call work where a
    graph for the call's shapes already exists.

    Through `torch.compile`, every call checks its guards and then reads, attribute by
    attribute, each tensor the graph takes (a 30-layer model's graph takes about 490:
    weights, scales, page views) to hand the compiled code its list of inputs: 0.25-0.45
    ms of SmolLM2's 7-8 ms decode step. The tensors reached through the `fixed` arguments
    are the same objects at every call (what `fixed` promises), so that list need only be
    built once: the compiler's backend here keeps the compiled code and the inputs it was
    compiled with, and a later call with the same shapes (dynamic dims aside), dtypes and
    grad mode fills in the slots of its own arguments and calls the compiled code itself.

    A direct call is only set up where every slot is accounted for (each input is one of
    the call's tensors, a dynamic size of one, or a tensor reached through a fixed
    argument) and where it returned, on the call that compiled the graph, exactly what
    the tracer's call returned; otherwise that shape goes through the tracer, as
    without `fixed`. Arguments must come in standard contiguous layout for the direct
    path (their strides follow from their shapes, so the shapes pick the graph); other
    layouts take the tracer's path."""

    def __init__(self, fn, fixed: Collection[str], dynamic: Mapping[str, int]) -> None:
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        options: dict[str, object] = {}
        if fixed:
            options["guard_filter_fn"] = functools.partial(fixed_guards_dropped, frozenset(fixed))
        self._traced = torch.compile(
            fn, fullgraph=True, dynamic=False, backend=self._compile, options=options
        )
        names = list(inspect.signature(fn).parameters)
        #: Positions of the arguments a direct call takes from each call (not `fixed`).
        self._own = [i for i, name in enumerate(names) if name not in fixed]
        #: Per position, the dynamic dim of that argument (from `dynamic`), if any.
        self._dynamic = {names.index(name): dim for name, dim in dynamic.items()}
        self._direct_ok = bool(fixed)
        #: Direct calls by the call shapes they serve (`_key`).
        self._direct: dict[tuple, Callable] = {}
        #: The compiled code and its inputs, left by `_compile` during a traced call.
        self._captured: tuple[Callable, list] | None = None

    @property
    def direct_shapes(self) -> int:
        """Call shapes served by direct calls so far."""
        return len(self._direct)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """The backend: inductor's compiled code for `gm`, kept with its inputs."""
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs, config_patches=INDUCTOR_PATCHES)
        self._captured = (compiled, list(example_inputs))
        return compiled

    def __call__(self, *args):
        key = self._key(args) if self._direct_ok else None
        direct = self._direct.get(key) if key is not None else None
        if direct is not None:
            return direct(args)
        self._captured = None
        with warnings.catch_warnings():  # the compiler's notes (a fused kernel reading
            warnings.simplefilter("ignore")  # bf16 and fp16, deprecations): not the user's
            out = self._traced(*args)
        if key is not None and self._captured is not None:
            direct = self._bind(args, *self._captured)
            self._captured = None
            if direct is not None and _same_outputs(direct, args, out):
                self._direct[key] = direct
        return out

    def _key(self, args: tuple) -> tuple | None:
        """What picks the graph for `args`: each own argument's dtype and shape (of its
        dynamic dim only whether it is 0, 1 or more) or its value, and the grad mode;
        None where an argument can't be told apart that way (a non-contiguous tensor, an
        object)."""
        key: list[object] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
        for i in self._own:
            a = args[i]
            if isinstance(a, torch.Tensor):
                if a.stride() != _contiguous_strides(a.shape):
                    return None
                shape = list(a.shape)
                if i in self._dynamic:  # sizes 0 and 1 are specialised: a graph of their own
                    shape[self._dynamic[i]] = -min(shape[self._dynamic[i]], 2)
                key.append((a.dtype, a.device, tuple(shape)))
            elif a is None or isinstance(a, (bool, int, float, str)):
                key.append(a)
            else:
                return None
        return tuple(key)

    def _bind(self, args: tuple, compiled: Callable, inputs: list) -> Callable | None:
        """The direct call of `compiled` for calls shaped as `args`, or None where an
        input is not accounted for."""
        own = {id(args[i]): i for i in self._own if isinstance(args[i], torch.Tensor)}
        template = list(inputs)
        tensors: list[tuple[int, int]] = []  # (input slot, argument)
        sizes: list[tuple[int, int, int]] = []  # (input slot, argument, dim)
        dynamic = list(self._dynamic.items())
        for slot, value in enumerate(inputs):
            if isinstance(value, torch.SymInt):
                if len(dynamic) != 1:  # which dim a size is: only told where there is one
                    return None
                sizes.append((slot, *dynamic[0]))
                template[slot] = None
            elif isinstance(value, torch.Tensor) and id(value) in own:
                tensors.append((slot, own[id(value)]))
                template[slot] = None
            elif not isinstance(value, torch.Tensor):
                return None  # a Python number the graph takes: its source is not known
        if len(sizes) != len(dynamic):
            return None  # a dynamic dim was specialised: each size needs its own graph

        def call(args: tuple):
            values = template.copy()
            for slot, i in tensors:
                values[slot] = args[i]
            for slot, i, dim in sizes:
                values[slot] = args[i].shape[dim]
            return tuple(compiled(*values))

        return call


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _same_outputs(direct: Callable, args: tuple, want) -> bool:
    """Whether `direct(args)` returns the traced call's outputs `want`, value for value."""
    try:
        got = direct(args)
    except Exception:  # a slot filled wrongly: the compiled code's own checks refuse it
        log.debug("a direct call of a compiled graph failed", exc_info=True)
        return False
    if not isinstance(want, tuple) or len(got) != len(want):
        return False
    return all(
        isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and g.shape == w.shape
        and g.dtype == w.dtype and torch.equal(g, w)
        for g, w in zip(got, want, strict=True)
    )  # fmt: skip


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


def page_table(meta: AttentionMetadata, ends: Seq[int], block_size: int) -> torch.Tensor:
    """The step's page table for a graph (`graph_table`): the pages of the longest
    `decode_length` of the sequences' contexts `ends`, so a graph's attention sums over
    the key count the eager decode does."""
    bs = block_size
    pages = max(-(-decode_length(c, bs) // bs) for c in ends)
    return graph_table(meta.block_tables, pages)


def graph_table(rows: torch.Tensor, pages: int) -> torch.Tensor:
    """Block tables `rows` [B, N] (padded with page 0) as a graph takes them: [B, P]
    int64, P = `pages` but at least `CompiledDecode.MIN_PAGES`, cut or padded with page
    0; laid out contiguous (strides from the shape, as `CompiledGraph`'s direct calls
    take their arguments); P marked dynamic, so one graph serves every context."""
    pages = max(pages, CompiledDecode.MIN_PAGES)
    if pages <= rows.shape[1]:
        table = rows[:, :pages].to(torch.int64, memory_format=torch.contiguous_format)
    else:
        pad = rows.new_zeros(rows.shape[0], pages - rows.shape[1])
        table = torch.cat((rows, pad), 1).long()
    torch._dynamo.maybe_mark_dynamic(table, 1)
    return table


def own_code(fn):
    """`fn` (a function, or a bound method) over a copy of its function's code object.

    torch.compile keeps compiled graphs, and the guards that pick one, per code object:
    with its own, a compiled step's graphs are only its own batch sizes', never another
    model's (another `CompiledDecode` in the process) — what makes dropping the guards
    on its fixed arguments safe (`compile_graph`)."""
    func = fn.__func__ if isinstance(fn, types.MethodType) else fn
    clone = types.FunctionType(
        func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
        func.__closure__,
    )  # fmt: skip
    return types.MethodType(clone, fn.__self__) if isinstance(fn, types.MethodType) else clone


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
