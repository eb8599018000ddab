"""`plan_memory`: where a device's memory goes at startup, decided before anything is allocated.

The plan is pure accounting over numbers its caller gathers: the weights' bytes (from the
artifact's shapes, formats and object sizes and the kernel backend's packing, never its
data), the KV codec's bytes per token of each layer that keeps paged K/V and the state
bytes of each layer that keeps a per-sequence state (times `--max-concurrency`: every
running sequence holds one), both from the family's `layer_caches`, the activation workspace
(`workspace.py`), what a speculative drafter will hold (`DraftStrategy.memory`: its own
weights, and K/V per token of the pool's pages) and the memory free on the device. Without
the drafter's share a plan said a configuration fits that `--spec mtp` then pushed past
the card's memory after startup. So `ninfer plan` can answer for a
card this machine does not have, and `ninfer-serve` can refuse a configuration that will
not fit before it loads a single weight.

`--kv-capacity auto` gives the pool whatever is left after weights, workspace and a
headroom that is a fraction of the memory being divided, not a fixed amount: a fixed GiB
is too much for a small budget and too little for an 80 GiB card. On the CPU the memory
is the machine's, shared with everything else on it, so there `auto` takes at most
`--max-context x --max-concurrency` tokens and `CPU_AUTO_POOL_FRACTION` of the available
memory (issue 13: it took 21 GiB of a 24 GiB box for a 4 MiB model), and the plan
counts the CPU runtime's kernel caches (`cpu_runtime_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from ninfer_core.config import opt
from ninfer_core.errors import NInferError
from ninfer_core.kv.state import STATE_BUFFERS
from ninfer_core.memory.workspace import Workspace
from ninfer_core.model.caches import ModelCaches, PagedKV, dense_caches
from ninfer_core.model.config import ModelConfig
from ninfer_core.plugin_types import Artifact, ModelFamily
from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.recipes import source_format
from ninfer_core.spec.types import DraftMemory

if TYPE_CHECKING:
    from ninfer_core.model.weights import WeightSlot

GIB = 1 << 30
MIB = 1 << 20
#: Share of the memory being divided that the plan leaves unallocated: allocator slack,
#: kernel libraries' own workspaces. 3% of an idle 24 GiB card is 0.7 GiB.
DEFAULT_HEADROOM = 0.03
#: The headroom never goes below this, however small the budget.
HEADROOM_FLOOR = 256 * MIB
#: On the CPU, the most of the available memory `--kv-capacity auto` gives the KV pool:
#: host RAM is shared with the rest of the machine, which must stay usable.
CPU_AUTO_POOL_FRACTION = 0.25
#: What oneDNN keeps per compiled CPU matmul shape: 0.6-1.4 MiB measured (torch 2.13, bf16
#: decode attention and projections of the built-in and Qwen3-0.6B shapes), rounded up.
KERNEL_CACHE_BYTES_PER_SHAPE = int(1.5 * MIB)

Capacity = int | Literal["auto"]


class MemoryPlanError(NInferError):
    """A KV pool configuration that cannot work; raised before anything is allocated."""


class CapacityBelowContextError(MemoryPlanError):
    """`--kv-capacity` cannot hold even one sequence of `--max-context` tokens."""


class CapacityDoesNotFitError(MemoryPlanError):
    """An explicit `--kv-capacity` needs more memory than is free."""

    def __init__(self, message: str, largest_fit: int) -> None:
        super().__init__(message)
        self.largest_fit = largest_fit


class AutoCapacityTooSmallError(MemoryPlanError):
    """`--kv-capacity auto` leaves room for fewer than `--max-context` tokens."""

    def __init__(self, message: str, tokens: int) -> None:
        super().__init__(message)
        self.tokens = tokens


@dataclass
class MemoryConfig:
    """How much of the device the engine may take, and how big its KV pool is."""

    kv_capacity: str | None = opt(
        None,
        "KV pool size in tokens, shared by all sequences, or `auto`: all memory left after "
        "weights, workspace and headroom; unset: --max-context",
    )
    memory_budget: float | None = opt(
        None, "GiB this process may use at most (CPU: of the available RAM; CUDA: of free memory)"
    )
    memory_headroom: float = opt(DEFAULT_HEADROOM, "fraction of that memory left unallocated")


def parse_kv_capacity(value: str | int | None) -> Capacity | None:
    """`"auto"`, a positive token count, or None (one full context); anything else fails."""
    if value is None or value == "auto" or isinstance(value, int):
        tokens = value
    else:
        try:
            tokens = int(str(value).replace("_", ""))
        except ValueError:
            raise MemoryPlanError(
                f"--kv-capacity {value}: expected a token count or auto"
            ) from None
    if isinstance(tokens, int) and tokens <= 0:
        raise MemoryPlanError(f"--kv-capacity {value}: must be a positive token count or auto")
    return tokens


class KVCodecLike(Protocol):
    name: str

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int: ...


@dataclass(frozen=True, slots=True)
class LayerKV:
    """What one layer keeps: bytes per cached token (`paged`), or per running sequence
    (`state`, both of its buffers: `kv/state.py`)."""

    layer: int
    kind: str
    bytes_per_token: int
    bytes_per_sequence: int = 0


def kv_layers(caches: ModelCaches, codec: KVCodecLike) -> list[LayerKV]:
    """Per-layer cost from the family's declaration: a hybrid model's state layers cost
    per sequence, not per token."""
    out = []
    for i, cache in enumerate(caches.layers):
        if isinstance(cache, PagedKV):
            per_token = codec.bytes_per_token(1, cache.num_kv_heads, cache.head_dim)
            out.append(LayerKV(i, "paged", per_token))
        else:
            out.append(LayerKV(i, "state", 0, STATE_BUFFERS * cache.nbytes))
    return out


#: Parameters the kernel backend's `pack_linear` sees (`DenseDecoder.pack_weights`): a
#: packed projection replaces the loaded matrix; the head is packed too (a tied one as a copy).
#: The hybrid (Qwen3-Next / Qwen3.5) decoder also packs its Gated DeltaNet's projections
#: (`model_hybrid.model.pack_layer`) and each `SparseMoE`'s router and shared-expert gate
#: (`SparseMoE.pack_weights`): a quantized router is dequantized there like any projection,
#: so it costs its packed bytes, not its stored ones.
PACKED_PARAMS = (
    "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head",
    "in_proj_qkvz", "in_proj_ba", "out_proj", "router", "shared_expert_gate",
)  # fmt: skip

#: `(format name, [rows, cols]) -> bytes` the kernel backend's packed form of such a
#: matrix holds, or None where it keeps the matrix as loaded (see `TorchOps.packed_nbytes`).
PackedBytes = Callable[[str, tuple[int, int]], "int | None"]


@dataclass(frozen=True, slots=True)
class _Param:
    """One runtime parameter: the checkpoint tensors fused into it, and their format."""

    name: str
    shape: tuple[int, ...]
    fmt: str
    stored: int  # bytes of its tensors as the artifact stores them


def _slots(config: ModelConfig, artifact: Artifact | None, family: ModelFamily | None) -> list:
    """The tensors the model holds: as the family declares (`weight_slots`; a dense
    decoder's when there is no family), checked against the artifact; every tensor of the
    artifact, each its own parameter, for a family that declares none."""
    from ninfer_core.model.weights import WeightSlot, check_weights, weight_plan

    declared = weight_plan if family is None else family.weight_slots
    if declared is None:
        if artifact is None:
            raise MemoryPlanError(f"family {family.name!r} sizes its weights from the artifact")
        names = artifact.tensor_names()
        return [WeightSlot(n, n, 0, tuple(artifact.tensor_shape(n))) for n in names]
    plan = declared(config)
    return plan if artifact is None else check_weights(config, artifact, plan)


def _params(
    config: ModelConfig,
    dtype: torch.dtype,
    artifact: Artifact | None,
    family: ModelFamily | None = None,
) -> list[_Param]:
    """Every parameter of the model with its fused shape (see `_slot_params`)."""
    return _slot_params(_slots(config, artifact, family), dtype, artifact)


def _slot_params(
    slots: Sequence[WeightSlot],
    dtype: torch.dtype,
    artifact: Artifact | None,
) -> list[_Param]:
    """The parameters `slots` fill, each with its fused shape; formats and stored sizes
    from the artifact (a `.ninfer` names each tensor's format and object size; a folder
    quantized while loading, `quant/at_load.py`, the recipe's), else dense `dtype`."""
    dense = source_format(dtype)
    # Optional members of the `Artifact` contract: declared by every artifact, None when
    # the artifact has nothing to say (every tensor dense, sizes from shapes).
    fmt_of = artifact.tensor_format if artifact is not None else None
    table = artifact.object_table if artifact is not None else None
    # Object sizes, used where the artifact stores a tensor in the format it is held in
    # (a `.ninfer`); a GGUF's records name ggml types, and a tensor held in a format of
    # ours (its Q4_K as Q4G32M) is sized by that format.
    sizes = {rec.name: (rec.format, rec.nbytes) for rec in table()} if table else {}
    groups: dict[str, list] = {}
    for slot in slots:
        groups.setdefault(slot.param, []).append(slot)
    out = []
    for name, group in groups.items():
        rows = sum(slot.shape[0] for slot in group)
        shape = (rows, *group[0].shape[1:])
        fmt = (fmt_of(group[0].hf_name) if fmt_of else "") or dense
        if not weight_format(fmt).quantized:  # cast on loading
            fmt, stored = _dense_param(group, shape, dtype)
        else:
            stored = sum(_stored_nbytes(sizes.get(s.hf_name), fmt, s.shape) for s in group)
        out.append(_Param(name, shape, fmt, stored))
    return out


def _stored_nbytes(record: tuple[str, int] | None, fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of one tensor held in `fmt`: the artifact's object size where it stores the
    tensor in that format (`record`: format and size), else the format's size for `shape`."""
    if record is not None and record[0] == fmt and record[1]:
        return record[1]
    return weight_format(fmt).stored_nbytes(shape)


def _dense_param(
    group: Sequence[WeightSlot], shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[str, int]:
    """(format, bytes) of a dense parameter of `shape`: in the dtype its slots say it is
    held in (`WeightSlot.dtype`), else the compute dtype."""
    held = group[0].dtype or dtype
    return source_format(held), math.prod(shape) * held.itemsize


def weights_bytes(
    config: ModelConfig,
    dtype: torch.dtype,
    *,
    artifact: Artifact | None = None,
    packed_bytes: PackedBytes | None = None,
    family: ModelFamily | None = None,
) -> int:
    """Bytes the runtime holds for the weights, as loaded and then packed.

    With `artifact`, shapes (and, for a `.ninfer`, formats and object sizes) come from
    its headers, checked against `config`; without, from `config` alone. A dense tensor
    is cast to `dtype`; a quantized one keeps its stored codes and scales. Tensors the
    family skips (a tied model's `lm_head`, extra MTP layers) cost nothing.

    `packed_bytes`: what the kernel backend packs each projection into (the torch
    backend on the CPU: 0.5 byte a weight for Q4, 1 for Q5/Q6/W8, plus scales). A packed
    projection costs its packed bytes instead of its loaded ones; a tied head packed as
    its own copy costs them on top of the embedding. None: nothing is repacked.
    """
    total = 0
    for param in _params(config, dtype, artifact, family):
        tied_head = param.name == "embed_tokens" and config.tie_word_embeddings
        projection = tied_head or param.name.rpartition(".")[2] in PACKED_PARAMS
        packed = _packed(param, packed_bytes) if projection else None
        if tied_head:
            total += param.stored + (packed or 0)  # the lookup keeps the loaded matrix
        else:
            total += param.stored if packed is None else packed
    return total


def _packed(param: _Param, packed_bytes: PackedBytes | None) -> int | None:
    """Bytes the backend packs the matrix `param` into, or None: it keeps it as loaded."""
    if packed_bytes is None or len(param.shape) != 2:
        return None
    return packed_bytes(param.fmt, (param.shape[0], param.shape[1]))


def slots_bytes(
    slots: Sequence[WeightSlot],
    dtype: torch.dtype,
    *,
    artifact: Artifact | None = None,
    packed_bytes: PackedBytes | None = None,
    packed: Collection[str] = PACKED_PARAMS,
) -> int:
    """Bytes the runtime holds for the tensors `slots` name, by the rules `weights_bytes`
    applies to the model's: for a plugin's own weights (an MTP layer, a reduced draft
    head), sized from the artifact's headers before anything loads.

    `slots` (already checked against `artifact`) say which tensors fill which parameter;
    a parameter whose last name part is in `packed` is a projection the plugin hands to
    the backend's `pack_linear`, and costs what `packed_bytes` says it packs into.
    """
    total = 0
    for param in _slot_params(slots, dtype, artifact):
        size = _packed(param, packed_bytes) if param.name.rpartition(".")[2] in packed else None
        total += param.stored if size is None else size
    return total


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The memory a plan divides: free before the weights are placed, and where that came from.

    `host_ram`: the machine's RAM (the CPU device), shared with every other process, rather
    than a card this process has to itself."""

    device: str
    total: int
    free: int
    source: str
    host_ram: bool = False


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of RAM a new allocation can get without swapping, in bytes."""
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def device_memory(
    device: Any, *, memory_budget: float | None = None, in_use: int = 0
) -> DeviceMemory:
    """Free memory of `device` (a `DeviceInfo`), capped by `memory_budget` GiB.

    CUDA: the free memory the probe saw (an idle card, for a `--device-spec`). CPU: the
    host's `MemAvailable`. `in_use`: bytes this process already holds that the plan
    counts (the weights, when planning after loading), added back before the cap.
    """
    if device.cuda is not None:
        cuda = device.cuda
        name = f"{cuda.name} (SM{cuda.sm_version}{', simulated' if device.simulated else ''})"
        total, free = cuda.total_memory, cuda.free_memory
        idle = f"--device-spec {device.simulated}, an idle card"
        source = idle if device.simulated else "cudaMemGetInfo"
    else:
        name, total = f"CPU ({device.cpu.model})", device.cpu.memory_bytes
        available = mem_available()
        free, source = (total, "physical RAM") if available is None else (available, "MemAvailable")
    free += in_use
    if memory_budget is not None:
        if memory_budget <= 0:
            raise MemoryPlanError(f"--memory-budget {memory_budget}: must be positive (GiB)")
        cap = int(memory_budget * GIB)
        if cap < free:
            free, source = cap, f"--memory-budget {memory_budget:g} GiB"
        total = min(total, cap)
    return DeviceMemory(name, total, free, source, host_ram=device.cuda is None)


def cpu_runtime_bytes(capacity: int | None = None) -> int:
    """Bytes the CPU runtime's kernel caches can reach: oneDNN compiles and keeps one kernel
    per matmul shape, up to `capacity` (default: the process's, `kernel_cache_capacity`;
    the entry points set 128). Every prompt length is a new projection shape, so the
    capacity, not the model, is the bound; decode attention's shapes are few
    (`decode_length`), so steady decoding never evicts them."""
    from ninfer_core.device import kernel_cache_capacity

    cap = kernel_cache_capacity() if capacity is None else capacity
    return cap * KERNEL_CACHE_BYTES_PER_SHAPE


@dataclass(frozen=True)
class MemoryPlan:
    """Every byte of the startup budget; `free_after_bytes` always covers the headroom."""

    memory: DeviceMemory
    weights_bytes: int
    weights_dtype: str
    kv_codec: str
    kv_layers: tuple[LayerKV, ...]
    block_size: int
    max_context: int
    max_concurrency: int
    #: As configured: a token count, "auto", or None (one full context).
    kv_capacity: Capacity | None
    pool_pages: int
    workspace: Workspace
    headroom_fraction: float
    headroom_bytes: int
    #: The largest pool (in tokens, whole pages) that would fit beside the rest.
    largest_fit_tokens: int
    #: CPU runtime caches that grow to a bound as shapes are first seen (`cpu_runtime_bytes`).
    runtime_bytes: int = 0
    #: Why `--kv-capacity auto` chose its size ("" otherwise).
    auto_reason: str = ""
    #: The draft strategy (`--spec`) and what its drafter holds; "" and None: no speculation.
    draft_strategy: str = ""
    draft: DraftMemory | None = None
    #: A model with state layers: the state snapshots its prefix cache keeps (0: none).
    state_snapshots: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        """The target's K/V of one token (the drafter's are `draft_kv_bytes_per_token`)."""
        return sum(layer.bytes_per_token for layer in self.kv_layers)

    @property
    def draft_bytes(self) -> int:
        """The drafter's weights and tables: held whatever the pool's size."""
        return self.draft.fixed_bytes if self.draft else 0

    @property
    def draft_kv_bytes_per_token(self) -> int:
        return self.draft.kv_bytes_per_token if self.draft else 0

    @property
    def draft_kv_bytes(self) -> int:
        """The drafter's K/V: its bytes per token over every token of the pool's pages."""
        return self.pool_tokens * self.draft_kv_bytes_per_token

    @property
    def state_bytes_per_sequence(self) -> int:
        return sum(layer.bytes_per_sequence for layer in self.kv_layers)

    @property
    def state_bytes(self) -> int:
        """The per-sequence state pool: one slot per sequence that may run at once."""
        return self.state_bytes_per_sequence * self.max_concurrency

    @property
    def snapshot_bytes_each(self) -> int:
        """One prefix-cache state snapshot (`engine/state_snapshots.py`): one buffer of a
        sequence's states and a page of every paged layer (its partial tail); 0 for a
        model without state layers."""
        return bytes_per_snapshot(self.kv_layers, self.block_size)

    @property
    def snapshot_bytes(self) -> int:
        return self.state_snapshots * self.snapshot_bytes_each

    @property
    def pool_tokens(self) -> int:
        return self.pool_pages * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.pool_tokens * self.kv_bytes_per_token

    @property
    def used_bytes(self) -> int:
        return (
            self.weights_bytes + self.pool_bytes + self.state_bytes + self.workspace.nbytes
            + self.runtime_bytes + self.draft_bytes + self.draft_kv_bytes + self.snapshot_bytes
        )  # fmt: skip

    @property
    def free_after_bytes(self) -> int:
        return self.memory.free - self.used_bytes

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["workspace"] = self.workspace.to_json()
        for name in ("kv_bytes_per_token", "pool_tokens", "pool_bytes", "state_bytes_per_sequence",
                     "state_bytes", "draft_bytes", "draft_kv_bytes_per_token", "draft_kv_bytes",
                     "snapshot_bytes_each", "snapshot_bytes", "free_after_bytes"):  # fmt: skip
            out[name] = getattr(self, name)
        return out


def bytes_per_snapshot(layers: Sequence[LayerKV], block_size: int) -> int:
    """Bytes of one state snapshot: one of the two buffers of every state layer, and one
    page of every paged layer; 0 when no layer keeps a state (nothing is snapshot)."""
    states = sum(layer.bytes_per_sequence for layer in layers)
    if not states:
        return 0
    return states // STATE_BUFFERS + block_size * sum(layer.bytes_per_token for layer in layers)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def plan_memory(
    model: ModelConfig,
    *,
    weights_bytes: int,
    codec: KVCodecLike,
    memory: DeviceMemory,
    workspace: Workspace,
    max_context: int,
    max_concurrency: int = 1,
    kv_capacity: Capacity | None = None,
    block_size: int = 16,
    weights_dtype: str = "",
    headroom_fraction: float = DEFAULT_HEADROOM,
    headroom_floor: int = HEADROOM_FLOOR,
    caches: ModelCaches | None = None,
    draft: DraftMemory | None = None,
    draft_strategy: str = "",
    state_snapshots: int = 0,
) -> MemoryPlan:
    """Size the KV pool and check that everything fits; raise a `MemoryPlanError` if not.

    `kv_capacity`: tokens (rounded up to whole pages of `block_size`), `"auto"` (the
    largest whole number of pages that fits), or None (`max_context`). `caches`: what
    each layer keeps, as the model's family declares (None: paged K/V in every layer);
    the per-sequence states of `max_concurrency` sequences come off the top. `draft`:
    what the drafter of `draft_strategy` holds (`DraftStrategy.memory`; None: no
    speculation): its weights come off the top too, and its per-token K/V, kept in as
    many pages as the target's pool, add to every page's cost. `state_snapshots`: the
    prefix cache's snapshots of a model with state layers, fixed bytes each, off the top.
    """
    if min(max_context, max_concurrency, block_size) <= 0:
        raise MemoryPlanError("--max-context, --max-concurrency and --block-size must be positive")
    if not 0 <= headroom_fraction < 1:
        raise MemoryPlanError(f"--memory-headroom {headroom_fraction}: must be in [0, 1)")
    capacity = max_context if kv_capacity is None else kv_capacity
    if capacity != "auto" and capacity < max_context:
        raise CapacityBelowContextError(
            f"--kv-capacity {capacity} is smaller than --max-context {max_context}"
        )
    layers = tuple(kv_layers(caches or dense_caches(model), codec))
    draft_per_token = draft.kv_bytes_per_token if draft else 0
    page_bytes = block_size * (sum(layer.bytes_per_token for layer in layers) + draft_per_token)
    states = max_concurrency * sum(layer.bytes_per_sequence for layer in layers)
    snapshots = state_snapshots * bytes_per_snapshot(layers, block_size)
    headroom = max(int(memory.free * headroom_fraction), headroom_floor)
    runtime = cpu_runtime_bytes() if memory.host_ram else 0
    drafter = draft.fixed_bytes if draft else 0
    fixed = weights_bytes + drafter + states + snapshots + workspace.nbytes + runtime + headroom
    left = memory.free - fixed
    context_pages = -(-max_context // block_size)
    if left < 0:
        largest = 0
    elif page_bytes == 0:  # no layer keeps per-token KV: any pool costs nothing
        largest = context_pages if capacity == "auto" else -(-capacity // block_size)
    else:
        largest = left // page_bytes
    spent = f"weights {_gib(weights_bytes)}, workspace {_gib(workspace.nbytes)}"
    spent += f", draft weights {_gib(drafter)}" if drafter else ""
    spent += f", sequence states {_gib(states)}" if states else ""
    spent += f", state snapshots {_gib(snapshots)}" if snapshots else ""
    spent += f", CPU runtime {_gib(runtime)}" if runtime else ""
    spent += f" and headroom {_gib(headroom)} GiB"
    reason = ""
    if capacity == "auto":
        pages = largest
        if memory.host_ram and page_bytes:
            pages, reason = _host_auto_pages(
                largest, page_bytes, memory, max_context, max_concurrency, block_size
            )
        if pages < context_pages:
            raise AutoCapacityTooSmallError(
                f"--kv-capacity auto: the {_gib(max(left, 0))} GiB left for the KV pool (of "
                f"{_gib(memory.free)} GiB free, after {spent}) holds {pages * block_size} "
                f"tokens, fewer than --max-context {max_context}, which needs "
                f"{_gib(context_pages * page_bytes)} GiB; free memory from {memory.source}",
                pages * block_size,
            )
    else:
        pages = -(-capacity // block_size)
        need = fixed + pages * page_bytes
        if need > memory.free:
            below = f", less than --max-context {max_context}" if largest < context_pages else ""
            pool = "KV pool" + (" with the drafter's K/V" if draft_per_token else "")
            raise CapacityDoesNotFitError(
                f"--kv-capacity {capacity} needs {_gib(need)} GiB, {_gib(memory.free)} GiB free; "
                f"the largest that fits is {largest * block_size} tokens{below} ({pool} "
                f"{_gib(pages * page_bytes)} GiB, {spent}; free memory from {memory.source})",
                largest * block_size,
            )
    return MemoryPlan(
        memory=memory,
        weights_bytes=weights_bytes,
        weights_dtype=weights_dtype,
        kv_codec=codec.name,
        kv_layers=layers,
        block_size=block_size,
        max_context=max_context,
        max_concurrency=max_concurrency,
        kv_capacity=kv_capacity,
        pool_pages=pages,
        workspace=workspace,
        headroom_fraction=headroom_fraction,
        headroom_bytes=headroom,
        largest_fit_tokens=largest * block_size,
        runtime_bytes=runtime,
        auto_reason=reason,
        draft_strategy=draft_strategy,
        draft=draft,
        state_snapshots=state_snapshots if snapshots else 0,
    )


def _host_auto_pages(
    largest: int,
    page_bytes: int,
    memory: DeviceMemory,
    max_context: int,
    max_concurrency: int,
    block_size: int,
) -> tuple[int, str]:
    """`--kv-capacity auto` on host RAM: pages for `max_context x max_concurrency` tokens
    (more can never be in use at once), capped at `CPU_AUTO_POOL_FRACTION` of the available
    memory but never below one `--max-context`; and the reason, for the plan to print."""
    demand = -(-max_context * max_concurrency // block_size)
    share = int(memory.free * CPU_AUTO_POOL_FRACTION) // page_bytes
    context_pages = -(-max_context // block_size)
    pages = max(min(largest, demand, share), min(largest, context_pages))
    fraction = f"{CPU_AUTO_POOL_FRACTION:.0%} of the {_gib(memory.free)} GiB available"
    if pages == demand:
        why = f"--max-context {max_context} x --max-concurrency {max_concurrency}"
    elif pages == share:
        why = f"{fraction}, fewer than --max-context x --max-concurrency"
    elif pages == context_pages:
        why = f"one --max-context, though more than {fraction}"
    else:
        why = "all that fits"
    return pages, f"auto on the CPU: {why}"


def with_measured_workspace(plan: MemoryPlan, measured: Workspace) -> MemoryPlan:
    """`plan` with the workspace a profiling step measured in place of its estimate.

    A measurement at or below the estimate changes nothing but the record (the pool is
    already allocated to the estimate, and the difference stays free). Above it, the pool
    gives up the whole pages the estimate missed: `--kv-capacity auto` shrinks, down to
    one `--max-context`; an explicit capacity keeps its size while the headroom covers the
    difference. Anything else raises `MemoryPlanError` with both figures, before the pool
    is allocated.
    """
    extra = measured.nbytes - plan.workspace.nbytes
    out = replace(plan, workspace=measured)
    if extra <= 0 or out.free_after_bytes >= plan.headroom_bytes:
        return out
    page = plan.block_size * (plan.kv_bytes_per_token + plan.draft_kv_bytes_per_token)
    short = plan.headroom_bytes - out.free_after_bytes
    pages = plan.pool_pages - -(-short // page) if page else plan.pool_pages
    context_pages = -(-plan.max_context // plan.block_size)
    said = (
        f"the activation workspace measured by a profiling step is {_gib(measured.nbytes)} GiB, "
        f"{_gib(extra)} GiB more than the {_gib(plan.workspace.nbytes)} GiB estimated"
    )
    if plan.kv_capacity != "auto":
        raise CapacityDoesNotFitError(
            f"{said}: --kv-capacity {plan.kv_capacity} no longer fits; the largest that does "
            f"is {max(pages, 0) * plan.block_size} tokens",
            max(pages, 0) * plan.block_size,
        )
    if pages < context_pages:
        raise AutoCapacityTooSmallError(
            f"{said}: --kv-capacity auto now holds {max(pages, 0) * plan.block_size} tokens, "
            f"fewer than --max-context {plan.max_context}",
            max(pages, 0) * plan.block_size,
        )
    return replace(out, pool_pages=pages)
