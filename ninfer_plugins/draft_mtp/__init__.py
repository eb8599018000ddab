"""Draft strategy `mtp`: drafts from the model's own multi-token-prediction layer.

A model trained with an MTP layer (DeepSeek-V3, Qwen3-Next, NInfer's built-in model)
carries one extra decoder layer that predicts the token after next from the target's
hidden state and the next token's embedding. Run once per draft token, it drafts far
better than a guess from the context, for one layer's cost instead of the whole model's.

- `weights.py`: where the artifact keeps the layer's tensors (either naming).
- `layer.py`: `MTPLayer`, the layer as a torch module on the target's kernels.
- `drafter.py`: `MTPDrafter`, the layer's K/V kept in step with the target, and drafting.
- `compiled.py`: a decoding round's catch-up and drafts as one compiled graph, used when
  the engine compiles its own steps (`--compile-decode`).

A family whose MTP layer is not a dense decoder layer (the hybrid Qwen3-Next / Qwen3.5:
gated attention, zero-centred norms, MoE) says so in its contract
(`ModelFamily.mtp_layer`, kept on the model it builds as `CausalLM.mtp_layer`): the
strategy then checks, sizes and builds that `MTPLayerKind`'s block instead of
`MTPLayer`, and drafts with it the same way.
"""

from __future__ import annotations

import torch

from ninfer_core import conformance, hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.errors import ModelLoadError, UnsupportedChoiceError
from ninfer_core.kv.layout import KVLayout
from ninfer_core.memory.planner import PackedBytes
from ninfer_core.model.config import ModelConfig
from ninfer_core.plugin_types import Artifact, KVCodec, ModelFamily, MTPBlock, MTPLayerKind
from ninfer_core.spec.draft_head import DraftHead, FullHead
from ninfer_core.spec.types import DraftMemory, DraftOptions, DraftTarget
from ninfer_core.support import Support
from ninfer_plugins.draft_mtp.drafter import MTPDrafter, embed_table_bytes
from ninfer_plugins.draft_mtp.layer import MTPLayer
from ninfer_plugins.draft_mtp.weights import DENSE_MTP, mtp_tensors

__all__ = ["MTPDrafter", "MTPLayer", "MTPStrategy", "mtp_kind", "register_draft_strategies"]

#: What the MTP layer uses of the target beyond the `CausalLM` contract (`DenseDecoder`
#: has them): the shared embedding, the rotary embedding, the kernels.
_TARGET_MEMBERS = ("embed", "rotary", "ops")


class MTPStrategy:
    """Needs the artifact's MTP weights; runs wherever the target runs."""

    name = "mtp"
    description = "the model's multi-token-prediction layer drafts the next tokens"

    def supports(self, device: DeviceInfo) -> Support:
        return Support.yes()

    def supports_model(self, target: DraftTarget, options: DraftOptions) -> Support:
        kind = mtp_kind(target.model.mtp_layer)
        problem = _artifact_problem(kind, target.artifact, target.config, options)
        if problem:
            return Support.no(problem)
        lacking = [m for m in _TARGET_MEMBERS if getattr(target.model, m, None) is None]
        if lacking:
            return Support.no(
                f"the model {type(target.model).__name__} does not expose "
                f"{', '.join(lacking)}, which the MTP layer shares; `--spec ngram` needs no weights"
            )
        return Support.yes()

    def memory(
        self,
        artifact: Artifact,
        config: ModelConfig,
        options: DraftOptions,
        dtype: torch.dtype,
        codec: KVCodec,
        *,
        packed_bytes: PackedBytes | None = None,
        family: ModelFamily | None = None,
    ) -> DraftMemory:
        """The MTP layer's own weights (fc, norms, one decoder layer: embedding and head
        are the target's), the normed-embedding table (`embed_table_bytes`), with
        `--lm-head-draft` the reduced head and its id map, and one attention layer's K/V
        per token in the target's codec (the drafter's one-layer pool). `family`: whose
        `mtp_layer` the layer is (None: a dense one)."""
        kind = mtp_kind(None if family is None else family.mtp_layer)
        problem = _artifact_problem(kind, artifact, config, options)
        if problem:
            raise UnsupportedChoiceError(f"--spec {self.name}: {problem}")
        with mtp_tensors(artifact) as full:
            weights = kind.weights_bytes(config, full, dtype, packed_bytes)
        tables = embed_table_bytes(config.vocab_size, config.hidden_size, dtype)
        if options.lm_head_draft:
            from ninfer_core.spec.draft_head import draft_head_bytes

            head, ids = draft_head_bytes(
                artifact, dtype, packed_bytes, config=config, rows=options.draft_vocab
            )
            weights, tables = weights + head, tables + ids
        per_token = codec.bytes_per_token(1, config.num_kv_heads, config.head_dim)
        return DraftMemory(weights_bytes=weights, table_bytes=tables, kv_bytes_per_token=per_token)

    def create(self, target: DraftTarget, options: DraftOptions) -> MTPDrafter:
        model = target.model
        kind = mtp_kind(model.mtp_layer)
        layer = kind.build(target.config, model.ops, model.dtype)
        conformance.check(layer, MTPBlock, f"the MTP layer {kind!r} built")
        with mtp_tensors(target.artifact) as full:
            layer.load(full)
        layer.eval()
        c = target.config
        layout = KVLayout(1, c.num_kv_heads, c.head_dim, target.block_size, target.num_blocks)
        store = target.kv_codec.allocate(layout, target.device, compute_dtype=model.dtype)
        steps = options.num_tokens - 1 if target.compile_steps else 0  # after draft 1
        return MTPDrafter(layer, model, _head(target, options), store, target.block_size,
                          compile_steps=steps)  # fmt: skip

    def __repr__(self) -> str:
        return "MTPStrategy()"


def mtp_kind(declared: MTPLayerKind | None) -> MTPLayerKind:
    """The MTP layer a family or model declares (`mtp_layer`), checked against its
    contract, or the dense one when it declares none."""
    if declared is None:
        return DENSE_MTP
    conformance.check(declared, MTPLayerKind, "the model's mtp_layer")
    return declared


def _artifact_problem(
    kind: MTPLayerKind, artifact: Artifact, config: ModelConfig, options: DraftOptions
) -> str:
    """Why `artifact` cannot feed the drafter (no MTP layer, a misshapen one), or "":
    asked at planning and again at startup. `--lm-head-draft` needs nothing of it: a
    model without a reduced head gets one built from its head while loading."""
    try:
        with mtp_tensors(artifact) as tensors:
            kind.weight_slots(config, tensors)
    except LookupError as exc:
        return f"{exc}; `--spec ngram` needs no weights"
    except ModelLoadError as exc:
        return f"its MTP layer does not fit the model: {exc}"
    return ""


def _head(target: DraftTarget, options: DraftOptions) -> DraftHead:
    """The head drafts are picked with: the reduced one with `--lm-head-draft`, the
    artifact's or, when it ships none, one built now from the model's head."""
    if options.lm_head_draft:
        from ninfer_core.spec.draft_head import ReducedHead, has_draft_head

        if has_draft_head(target.artifact):
            return ReducedHead.from_artifact(target.artifact, target.model)
        return ReducedHead.built(target.artifact, target.model, options.draft_vocab)
    return FullHead(target.model)


@hookimpl
def register_draft_strategies() -> list[MTPStrategy]:
    return [MTPStrategy()]
