"""The contract of every plugin kind and of what plugin objects return or build.

`register_*` hooks (see `hookspecs.py`) return objects of the registered kinds
(`ArtifactReader`, `ModelFamily`, `KVCodec`, `KernelBackend`, `DraftStrategy`,
`Frontend`); those build the runtime objects (`Artifact`, `CausalLM`, `KVStore`,
`KernelOps`, `Drafter`). Each is a Protocol listing every member the core uses, so nothing is
found by `hasattr`: `ninfer_core.conformance` checks an object against its protocol
(every member present, every method callable the way the core calls it) and the
host refuses a registered object that does not conform, naming plugin, object and
member.

Optional members are declared here with a default (`None`, `()`) that says what
the core does without them. An object must still declare them: either set the
member (to the default when it has nothing to offer) or subclass the protocol,
which inherits the defaults. An optional callable member's shape is the
`__call__` of the small protocol it is typed with (`GatherHeads`, ...).

The core passes a method's required arguments by position and its optional ones
by name, exactly as the protocol's signature spells them. An argument a contract
grew later (`workload` of `KernelBackend.provides` and `supports`) is passed, by name,
only to a method whose signature takes it (a parameter so named, or `**kwargs`), as
pluggy does for hook arguments: a plugin written before it keeps working.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ninfer_core.device import DeviceInfo
    from ninfer_core.kv.hadamard import HeadRotation
    from ninfer_core.kv.layout import KVLayout
    from ninfer_core.kv.pages import KVPages
    from ninfer_core.kv.state import StepStates
    from ninfer_core.memory.planner import PackedBytes
    from ninfer_core.model.attention_meta import AttentionMetadata
    from ninfer_core.model.caches import ModelCaches
    from ninfer_core.model.config import ModelConfig
    from ninfer_core.model.weights import WeightSlot
    from ninfer_core.serve.errors import ApiError
    from ninfer_core.spec.types import (
        DraftInput,
        DraftMemory,
        DraftOptions,
        DraftTarget,
        Proposal,
    )
    from ninfer_core.support import Support


@runtime_checkable
class Plugin(Protocol):
    """The part every registered object shares."""

    #: The name users configure it by (`--kv-dtype NAME`); unique per extension point.
    name: str
    #: One line for `ninfer plugins` and `ninfer probe`.
    description: str

    def supports(self, device: DeviceInfo) -> Support:
        """Whether it runs on `device`; a refusal says why (the reason reaches the user)."""
        ...


# --------------------------------------------------------------------------
# Shapes of optional callable members
# --------------------------------------------------------------------------


class TensorFile(Protocol):
    def __call__(self, name: str) -> Path:
        """The file holding tensor `name`, for messages about it."""
        ...


class LoadWeight(Protocol):
    def __call__(self, name: str) -> Any:
        """Tensor `name` as the model should hold it: a dense tensor or a `QuantizedTensor`."""
        ...


class TensorFormat(Protocol):
    def __call__(self, name: str) -> str:
        """The weight format tensor `name` is stored in (`q4g64`, `bf16`, ...)."""
        ...


class WithComponents(Protocol):
    def __call__(self, names: Iterable[str]) -> AbstractContextManager[Artifact]:
        """For a `with` block: the artifact with its optional components `names` listed and
        loadable too (weights loaded inside stay valid after the block)."""
        ...


class ObjectTable(Protocol):
    def __call__(self) -> list[Any]:
        """Every stored object with its `name` and `nbytes` (sizes without reading data)."""
        ...


class CheckArtifact(Protocol):
    def __call__(self, config: ModelConfig, artifact: Artifact) -> None:
        """Raise `ModelLoadError` when `artifact` lacks a weight `config` implies."""
        ...


class LayerCaches(Protocol):
    def __call__(self, config: ModelConfig) -> ModelCaches:
        """Per layer of a model of `config`, what it keeps: paged K/V per token or a
        fixed-size state per sequence (`ninfer_core.model.caches`)."""
        ...


class WeightSlots(Protocol):
    def __call__(self, config: ModelConfig) -> list[WeightSlot]:
        """Every checkpoint tensor a model of `config` holds, and the runtime parameter it
        fills (`ninfer_core.model.weights.WeightSlot`)."""
        ...


class GatherHeads(Protocol):
    def __call__(
        self,
        layer: int,
        block_table: torch.Tensor,
        length: int | None = None,
        *,
        rotated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `KVStore.gather`, head-major: k, v [(B,) Hkv, L, D]. With `rotated`, K and
        V stay in the store's `rotation` (a store without one ignores it)."""
        ...


class WriteLayers(Protocol):
    def __call__(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one step's new tokens of every layer at once. slots: [T] int64;
        k, v: [num_layers, T, Hkv, D] in any float dtype."""
        ...


class SavePages(Protocol):
    def __call__(self, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Raw copies of pages `blocks` ([n] int64) of every layer, exactly as stored
        (codes and scales for a quantized store), on the store's device: what
        `load_pages` puts back bit for bit. The engine counts their bytes."""
        ...


class LoadPages(Protocol):
    def __call__(self, blocks: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> None:
        """Overwrite pages `blocks` ([n] int64, possibly others than were saved) of every
        layer with what `save_pages` returned for as many pages."""
        ...


class RawPages(Protocol):
    def __call__(self, layer: int) -> KVPages:
        """Layer `layer`'s live K and V pools as stored (`ninfer_core.kv.pages.KVPages`:
        views, not copies, with their encoding, scales and rotation), for kernels that
        read and decode pages in place."""
        ...


class DecodeGraph(Protocol):
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_store: KVStore,
        block_table: torch.Tensor,
        context: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """One decode token of each of B sequences as a single traceable function (no
        host reads, no Python branching on tensor values) for `torch.compile`:
        input_ids, positions: [B]; block_table: [B, P] int64 pages covering each
        context, padded with page 0; context: [B] int64, each context length with this
        token. Reads the cached K/V but writes nothing: returns (logits [B, vocab] fp32,
        the tokens' k and v [paged layers, B, Hkv, D]) for the caller to store
        (`KVStore.write_layers`).

        A model with state layers (`ModelFamily.layer_caches`) takes two more arguments,
        `state_pool` (the runtime's `SequenceStatePool`) and `state_rows` [B] int64, the
        rows of the pool's buffers holding each sequence's current state
        (`StepStates.read_rows`); it reads them but writes nothing either, and returns
        after k and v every state layer's next states, in layer order, each layer's
        tensors as it declares them ([B, *shape]), for the caller to write and commit
        (`StepStates.write`). A model without is called without them."""
        ...


class VerifyGraph(Protocol):
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_store: KVStore,
        block_table: torch.Tensor,
        context: torch.Tensor,
        width: int,
    ) -> tuple[torch.Tensor, ...]:
        """A speculative round's forward as one traceable function: each of B sequences
        runs `width` rows (its pending token, then its drafts), input_ids, positions
        [B * width] sequence-major; block_table [B, P] as `DecodeGraph`'s; context [B]
        int64, each sequence's context with its first row. Each row must be computed as
        `DecodeGraph` computes that token decoded alone (bit for bit where its kernels
        allow: speculation's greedy output must not change). Writes nothing: returns
        (logits [B * width, vocab] fp32, final hidden states [B * width, hidden], k, v
        [paged layers, B * width, Hkv, D]) for the caller to store the real rows'.

        A sequence with fewer real rows is padded with copies of its last row (its
        position repeated). A model with state layers takes `state_pool`, `state_rows`
        and returns the next states after k and v, as `DecodeGraph` does: the states
        after each sequence's real rows, padded ones left out."""
        ...


class PackedSizer(Protocol):
    def __call__(self, fmt: str, shape: tuple[int, int], *, dtype: torch.dtype) -> int | None:
        """Bytes `pack_linear` would hold for a `shape` matrix stored as `fmt` and run in
        `dtype`, or None where it keeps the matrix as loaded."""
        ...


class AttentionScratch(Protocol):
    def __call__(
        self,
        *,
        tokens: int,
        few_rows: int,
        context: int,
        num_heads: int,
        head_dim: int,
        dtype_bytes: int,
        rotated: bool,
    ) -> int:
        """Bytes `paged_attention` allocates for one layer of a step of `tokens` query
        rows, `few_rows` of them in decode-shaped sequences (one token, or a speculative
        round), every sequence at `context` tokens, the output included; `rotated`: the
        store keeps K and V rotated (rk8v4), so q and the output are rotated on the way.
        For a backend whose attention reads the pages where they lie, so that the memory
        plan counts that instead of a gathered copy of each sequence's context."""
        ...


class ProvidesOps(Protocol):
    def __call__(self, device: DeviceInfo) -> dict[str, Support]:
        """Per op this backend provides (`ninfer_core.kernels.compose.OPS`: `linear`,
        `attention`, `rms_norm`, `rope`, `silu_and_mul`), whether it can serve it on
        `device`, with the reason; an op left out is not provided.

        It may also take `workload` (`ninfer_core.kernels.workload.KernelWorkload`: the
        model's weight formats, the KV codec, the compute dtype; a field is None where
        not known) to answer for what will run, e.g. `Support.no("no kernel for Q6G64
        weights")`. Declare it `*, workload=None`: the host passes it by name, and only
        to a `provides` whose signature takes it, so one taking `device` alone (written
        before the argument existed) keeps working. `supports` may take it the same way.
        """
        ...


class ErrorBody(Protocol):
    def __call__(self, error: ApiError) -> dict[str, Any]:
        """The JSON body of `error` in this frontend's protocol shape."""
        ...


# --------------------------------------------------------------------------
# Formats: artifacts and model families
# --------------------------------------------------------------------------


@runtime_checkable
class Artifact(Protocol):
    """An opened model artifact: config, weights and the text files beside them."""

    path: Path

    @property
    def config(self) -> dict[str, Any]:
        """The Hugging Face style `config.json` contents."""
        ...

    def tensor_names(self) -> list[str]: ...

    def tensor_shape(self, name: str) -> tuple[int, ...]: ...

    def load_tensor(self, name: str) -> torch.Tensor:
        """The named tensor on the CPU, in its stored dtype."""
        ...

    def read_text(self, name: str) -> str | None:
        """A text file shipped with the model (`tokenizer.json`, ...), or None when absent."""
        ...

    #: None: messages about a tensor name the artifact's `path`.
    tensor_file: TensorFile | None = None
    #: None: weights are loaded with `load_tensor` (dense, cast to the model dtype).
    load_weight: LoadWeight | None = None
    #: None: every tensor is dense, in its stored dtype.
    tensor_format: TensorFormat | None = None
    #: None: sizes are computed from shapes and formats.
    object_table: ObjectTable | None = None
    #: None: every tensor the artifact holds is listed already (a folder, a GGUF file).
    #: Otherwise optional components (MTP layers, a draft head) stay unlisted until a
    #: user of them asks (`with artifact.with_components({"mtp"}) as full: ...`).
    with_components: WithComponents | None = None


@runtime_checkable
class ArtifactReader(Plugin, Protocol):
    """Opens one artifact format (a Hugging Face folder, a `.ninfer` container, ...)."""

    def can_read(self, path: Path) -> bool:
        """Cheap check on the path alone (suffix, a marker file); no weights are read."""
        ...

    def open(self, path: Path) -> Artifact:
        """Open the artifact; raises `ModelLoadError` naming the file and the problem."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """The model a family builds (a `torch.nn.Module`): one forward over a step's tokens
    from every sequence flattened into one ragged batch, logits only for chosen rows."""

    config: ModelConfig
    #: The compute dtype of activations (and of dense weights).
    dtype: torch.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_store: KVStore,
        states: StepStates | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] (all sequences flattened) -> hidden states [T, hidden].

        Writes the step's K/V into `kv_store` at `meta.slot_mapping` on the way. `states`:
        the batch's per-sequence states (in batch order), when the family declares state
        layers (`ModelFamily.layer_caches`); each state layer reads them and writes the
        next ones once per forward. None for a model without state layers."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the rows to sample from) -> logits [N, vocab] fp32."""
        ...

    def pack_weights(self) -> None:
        """Hand every weight to the kernel backend's `pack_linear`, once, after loading."""
        ...

    #: None: every step runs `forward`. Otherwise the decode step (one token for each
    #: sequence) as one function `torch.compile` can capture whole
    #: (`ninfer_core/engine/compiled_step.py`).
    decode_graph: DecodeGraph | None = None
    #: None: a speculative round's forward runs `forward`. Otherwise the round (1 + k
    #: rows for each sequence) as one capturable function (`engine/compiled_verify.py`).
    verify_graph: VerifyGraph | None = None
    #: None: the model's MTP layer, if its artifact has one, is a dense decoder layer
    #: (what a draft strategy builds by default). Otherwise its family's `mtp_layer`,
    #: kept on the model for whoever holds only the loaded model (`DraftTarget.model`).
    mtp_layer: MTPLayerKind | None = None

    def weight_bytes(self) -> int:
        """Bytes the weights hold, packed copies included, each object counted once."""
        ...


@runtime_checkable
class ModelFamily(Plugin, Protocol):
    """An architecture family: which `config.json` architectures it builds, and how."""

    #: The `config.json` `architectures` names it builds (`Qwen3ForCausalLM`).
    architectures: tuple[str, ...]

    def parse_config(self, raw: dict[str, Any]) -> ModelConfig:
        """The checked config; `raw` is untrusted, every field read is validated."""
        ...

    def build(self, config: ModelConfig, ops: KernelOps, dtype: torch.dtype) -> CausalLM:
        """A model with empty (meta or uninitialised) weights, ready for `load_weights`."""
        ...

    def load_weights(self, model: CausalLM, artifact: Artifact) -> None:
        """Fill `model`'s weights from `artifact`."""
        ...

    #: None: the artifact's tensors are first checked when the weights load.
    check_artifact: CheckArtifact | None = None
    #: None: every layer keeps paged K/V of the config's `num_kv_heads` x `head_dim`.
    #: The memory plan, the runtime's allocation and admission all read this one answer.
    layer_caches: LayerCaches | None = None
    #: None: the model holds every tensor of the artifact, each as stored (what the memory
    #: plan counts). A family that fuses, skips or ties tensors says which it holds.
    weight_slots: WeightSlots | None = None
    #: None: a multi-token-prediction layer in its checkpoints, if any, is one dense
    #: decoder layer (Qwen3-Next / DeepSeek-V3 naming; the `mtp` draft strategy's default).
    #: Otherwise the family's own MTP layer: its tensors and what computes it.
    mtp_layer: MTPLayerKind | None = None


@runtime_checkable
class MTPBlock(Protocol):
    """A model's multi-token-prediction layer as built (a `torch.nn.Module`), for a draft
    strategy to run with the target's kernels (`ninfer_plugins.draft_mtp`).

    At position t it reads the target's final-normed hidden state h_t and the embedding of
    token t + 1 and returns its own final-normed output, which the target's head turns into
    logits for token t + 2: `norm(layer(fc(concat(norm_e(embed), norm_h(h)))))`. Its one
    attention layer is layer 0 of a paged K/V store of its own, of the target's KV geometry
    (`num_kv_heads` x `head_dim`); embedding, RoPE and head are the target's."""

    config: ModelConfig
    #: The compute dtype.
    dtype: torch.dtype
    ops: KernelOps

    def load(self, artifact: Artifact) -> str:
        """Fill every weight from `artifact` (checked first) and pack the projections;
        returns the naming found, for messages."""
        ...

    def embed_input(self, embeds: torch.Tensor) -> torch.Tensor:
        """embeds: [T, hidden] (the target's embedding of token t + 1) -> the normed
        embedding `forward` reads, [T, hidden] in the compute dtype. A function of the token
        alone, so a drafter may keep it as a table."""
        ...

    def forward(
        self,
        embed_input: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_store: KVStore,
    ) -> torch.Tensor:
        """embed_input: [T, hidden] (`embed_input`'s), hidden: [T, hidden] (the target's
        final-normed hidden at t, or this layer's own output), cos, sin: the target's RoPE
        at t -> [T, hidden] after the final norm; writes the T entries' K/V into layer 0 of
        `kv_store` at `meta.slot_mapping` (`ops.prepare(meta)` done)."""
        ...


@runtime_checkable
class MTPLayerKind(Protocol):
    """How a family's checkpoints keep their multi-token-prediction layer, and what builds
    it (`ModelFamily.mtp_layer`). Asked from the artifact's headers before anything loads
    (the memory plan), at startup (whether the artifact has the layer) and to build it.

    `artifact` is one whose MTP tensors are listed (a `.ninfer` file opened with its `mtp`
    component: `ninfer_core.loading.with_components`)."""

    def weight_slots(self, config: ModelConfig, artifact: Artifact) -> list[WeightSlot]:
        """Every tensor of `artifact`'s MTP layer and the `MTPBlock` parameter it fills,
        each checked: `LookupError` when the artifact has no MTP layer at all (the message
        names the tensor looked for), `ModelLoadError` naming the first tensor missing or
        misshapen."""
        ...

    def weights_bytes(
        self,
        config: ModelConfig,
        artifact: Artifact,
        dtype: torch.dtype,
        packed_bytes: PackedBytes | None = None,
    ) -> int:
        """Bytes the loaded, packed `MTPBlock` will hold in `dtype`, from the headers
        alone (`packed_bytes` as for `DraftStrategy.memory`); raises as `weight_slots`."""
        ...

    def build(self, config: ModelConfig, ops: KernelOps, dtype: torch.dtype) -> MTPBlock:
        """An `MTPBlock` with uninitialised weights on `ops.device`; fill it with `load`."""
        ...


# --------------------------------------------------------------------------
# Runtime: KV cache and kernels
# --------------------------------------------------------------------------


@runtime_checkable
class KVStore(Protocol):
    """The paged K/V pool of one model, as a codec allocated it (see `ninfer_core.kv`)."""

    layout: KVLayout
    #: Storage dtype (of the K codes for a quantized store), for reports.
    dtype: torch.dtype
    #: The dtype `gather` returns: the model's compute dtype.
    compute_dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds."""
        ...

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode and store new tokens. slots: [T] int64 flat slot; k, v: [T, Hkv, D]."""
        ...

    def gather(
        self, layer: int, block_table: torch.Tensor, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode whole pages. block_table: [nb] or [B, nb] -> k, v: [(B,) L, Hkv, D]."""
        ...

    #: None: attention transposes what `gather` returns.
    gather_heads: GatherHeads | None = None
    #: None: a step's K/V go in layer by layer (`write`). A compiled decode step stores
    #: every layer's in one call when the store offers it, and needs it.
    write_layers: WriteLayers | None = None
    #: None: K and V are stored as given. Otherwise they are stored rotated, and
    #: `gather_heads(..., rotated=True)` (then required) returns them still rotated.
    rotation: HeadRotation | None = None
    #: None: `gather` only casts pages from `dtype` to `compute_dtype` (one more copy
    #: when they differ). Otherwise the bytes per gathered value it holds beside its
    #: compute-dtype output while decoding (codes, fp32 temporaries): what `ninfer plan`'s
    #: workspace estimate counts for it.
    gather_scratch_bytes: int | None = None
    #: None: the prefix cache of a model with state layers resumes only at block
    #: boundaries (`engine/state_snapshots.py`). Both set: it also snapshots a partly
    #: filled page, so a prompt shorter than a block can resume from its own earlier run.
    save_pages: SavePages | None = None
    load_pages: LoadPages | None = None
    #: None: the store offers no in-place access, and a fused attention kernel that reads
    #: pages through the block table (the Triton backend's) refuses it. Otherwise
    #: `raw_pages(layer)` describes the layer's live pools (`KVPages`: `[NB, BS, Hkv, W]`
    #: values or codes, fp16 group scales, bits, group size, rotation), so a kernel
    #: dequantizes inside instead of gathering a decoded copy of the context.
    raw_pages: RawPages | None = None


@runtime_checkable
class KVCodec(Plugin, Protocol):
    """How keys and values are stored in the paged pool (fp16, int8, ...)."""

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one token over every layer and KV head."""
        ...

    def allocate(
        self, layout: KVLayout, device: torch.device | str, compute_dtype: torch.dtype | None = None
    ) -> KVStore:
        """A zeroed store for `layout`; its `gather` returns `compute_dtype` (None: the
        codec's own choice)."""
        ...


class PackedLinear(Protocol):
    """A weight `KernelOps.pack_linear` repacked into a layer that runs itself (the
    reference's `GemvLinear`, `Q4GemvLinear`, `Q8GemvLinear`, `OneDNNLinear`,
    `Int4Linear`): `KernelOps.linear(x, w, b)` is `w(x, b)`, and `CausalLM.weight_bytes`
    counts its `nbytes`, since none of its tensors is a parameter.

    Not `runtime_checkable`: an implementation subclasses the base class
    `ninfer_core.model.ops.PackedLinear`, which `linear` checks for by type (an
    `isinstance` against this protocol would probe each member, per projection per
    step)."""

    @property
    def nbytes(self) -> int:
        """Bytes the layer holds (codes, scales, a reordered copy of the weight)."""
        ...

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] -> [T, out] in x.dtype: `F.linear(x, weight, b)` of the weight it
        holds, to the rounding of its kernel."""
        ...


@runtime_checkable
class KernelOps(Protocol):
    """Every tensor op the model calls; `ninfer_core.model.ops.KernelOps` is the base
    class whose docstrings spell out shapes. T = tokens in the step."""

    name: str
    device: torch.device

    def prepare(self, meta: AttentionMetadata) -> None: ...

    def linear(self, x: torch.Tensor, w: Any, b: torch.Tensor | None = None) -> torch.Tensor: ...

    def pack_linear(self, w: Any, *, dtype: torch.dtype | None = None) -> Any: ...

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...

    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...

    def apply_rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def paged_attention(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        kv_store: KVStore,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...

    # The linear-attention ops (Gated DeltaNet). A backend's ops object may leave them
    # out: the composed ops (`ninfer_core.kernels.compose`) then take the reference's.
    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        cu_seqlens: Sequence[int] | torch.Tensor,
        *,
        chunk: int = 64,
    ) -> torch.Tensor: ...

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        states: torch.Tensor,
        cu_seqlens: Sequence[int] | torch.Tensor,
    ) -> torch.Tensor: ...

    #: None: `ninfer plan` sizes packed weights by packing a probe weight.
    packed_nbytes: PackedSizer | None = None


@runtime_checkable
class KernelBackend(Plugin, Protocol):
    """A set of kernels (GEMM, norms, attention) the model calls through."""

    #: Higher wins when several are supported and none is configured.
    priority: int

    def create_ops(self, device: DeviceInfo) -> KernelOps:
        """The ops object the host takes each op this backend serves from. A backend
        that provides only some ops needs only their members (see `provides`).

        A `create_ops` that also takes a keyword `workload` (`create_ops(device, *,
        workload=None)`) is passed the `KernelWorkload` the ops were chosen for, by name
        (`selection.call_accepting`, as for `provides`): ops whose kernels depend on the
        run read it at call time (`workload.activation_dtype == "int8"`: prefill linears
        over quantized weights in W8A8/W4A8). One that does not take it keeps working,
        but is refused `linear` for a run with int8 activations, which it could not see.
        """
        ...

    #: None: its `paged_attention` (if it provides one) gathers each sequence's pages into
    #: a dense copy, as the reference does, and the memory plan counts that copy. Otherwise
    #: what its attention allocates instead, reading the pages in place (`AttentionScratch`).
    attention_scratch: AttentionScratch | None = None

    #: None: every op, wherever `supports` says yes. Otherwise the ops it provides, each
    #: with a `Support` for the device and (when it takes `workload`) for what will run;
    #: every other op, and every op it refuses, comes from the next backend that serves
    #: it, and finally from the core's reference (`ninfer_core.kernels.reference`).
    provides: ProvidesOps | None = None


# --------------------------------------------------------------------------
# Decoding and serving
# --------------------------------------------------------------------------


@runtime_checkable
class Drafter(Protocol):
    """One runtime's draft proposer, made by `DraftStrategy.create` (see `spec/types.py`).

    The engine calls `propose` once per step, after verification, with every sequence the
    step's forward ran (prefill chunks too: a drafter with state of its own, like the MTP
    layer's K/V, learns from them), and verifies what comes back in the next step's forward.
    Whatever a drafter proposes, the output is the target's: drafts only decide how many
    tokens a forward yields. A drafter that raises proposes nothing that step (the engine
    logs it once and decodes those sequences one token at a time).
    """

    #: Whether `DraftInput.hidden` must carry the target's final hidden states (MTP), so
    #: the runner keeps them; False: None is passed (n-gram).
    uses_hidden: bool

    def propose(self, inputs: Sequence[DraftInput]) -> list[Proposal]:
        """One `Proposal` per input, in order; each at most `max_drafts` long."""
        ...

    def release(self, seq_id: int) -> None:
        """The sequence ended (however it ended): forget what is kept for it."""
        ...


@runtime_checkable
class DraftStrategy(Plugin, Protocol):
    """Proposes draft tokens for speculative decoding (`--spec NAME`: MTP, n-gram, ...).

    `supports(device)` answers for the hardware; `supports_model` for the model, at
    startup, before any request: a strategy that needs weights the artifact lacks (MTP
    layers, a reduced draft head) refuses there with the reason, and the host names the
    strategies that would run. Before either, `memory` says what its drafter will hold, so
    the memory plan that sizes the KV pool counts it.
    """

    def supports_model(self, target: DraftTarget, options: DraftOptions) -> Support:
        """Whether it can draft for `target` with `options` (a refusal names what is missing)."""
        ...

    def create(self, target: DraftTarget, options: DraftOptions) -> Drafter:
        """The drafter for one runtime (called after `supports_model` said yes)."""
        ...

    def memory(
        self,
        artifact: Artifact,
        config: ModelConfig,
        options: DraftOptions,
        dtype: torch.dtype,
        codec: KVCodec,
        *,
        packed_bytes: PackedBytes | None = None,
    ) -> DraftMemory:
        """What `create` would make will hold on the device, from `artifact`'s headers
        alone (shapes, formats, object sizes; nothing is loaded): its own weights held in
        `dtype` (`packed_bytes`: what the kernel backend packs a `(format, [rows, cols])`
        projection into, None where it packs nothing), fixed tables, and per-token K/V in
        `codec`. The startup memory plan (`ninfer plan`, `ninfer-serve`) counts it before
        the target loads; an artifact that lacks what the strategy needs raises an
        `NInferError` saying what, as `supports_model` would refuse.

        It may also take `family` (the `ModelFamily` that builds the target, for a drafter
        shaped by the family: its `mtp_layer`). Declare it `*, family=None`: the planner
        passes it by name, and only to a `memory` whose signature takes it, so a strategy
        written before the argument existed keeps working."""
        ...


@runtime_checkable
class Frontend(Plugin, Protocol):
    """An HTTP API dialect (OpenAI, Anthropic): routes that turn requests into generations."""

    def route_handlers(self, app_state: Any) -> list[Any]:
        """The litestar route handlers, given the app's shared `ServeState`."""
        ...

    #: Path prefixes whose errors take this frontend's shape (the longest prefix wins).
    #: (): every error keeps the core shape.
    error_paths: tuple[str, ...] = ()
    #: None: errors keep the core shape even under `error_paths`.
    error_body: ErrorBody | None = None
