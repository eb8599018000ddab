"""Draft strategy `mtp`: drafts from the model's own multi-token-prediction layer.

A model trained with an MTP layer (DeepSeek-V3, Qwen3-Next, NInfer's built-in model)
carries one extra decoder layer that predicts the token after next from the target's
hidden state and the next token's embedding. Run once per draft token, it drafts far
better than a guess from the context, for one layer's cost instead of the whole model's.

- `weights.py`: where the artifact keeps the layer's tensors (either naming).
- `layer.py`: `MTPLayer`, the layer as a torch module on the target's kernels.
- `drafter.py`: `MTPDrafter`, the layer's K/V kept in step with the target, and drafting.
"""

from __future__ import annotations

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.errors import ModelLoadError
from ninfer_core.kv.layout import KVLayout
from ninfer_core.spec.draft_head import DraftHead, FullHead
from ninfer_core.spec.types import DraftOptions, DraftTarget
from ninfer_core.support import Support
from ninfer_plugins.draft_mtp.drafter import MTPDrafter
from ninfer_plugins.draft_mtp.layer import MTPLayer
from ninfer_plugins.draft_mtp.weights import checked_plan, mtp_tensors

__all__ = ["MTPDrafter", "MTPLayer", "MTPStrategy", "register_draft_strategies"]

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
        try:
            with mtp_tensors(target.artifact) as tensors:
                checked_plan(target.config, tensors)
        except LookupError as exc:
            return Support.no(f"{exc}; `--spec ngram` needs no weights")
        except ModelLoadError as exc:
            return Support.no(f"its MTP layer does not fit the model: {exc}")
        lacking = [m for m in _TARGET_MEMBERS if getattr(target.model, m, None) is None]
        if lacking:
            return Support.no(
                f"the model {type(target.model).__name__} does not expose "
                f"{', '.join(lacking)}, which the MTP layer shares; `--spec ngram` needs no weights"
            )
        if options.lm_head_draft:
            from ninfer_core.spec.draft_head import has_draft_head

            if not has_draft_head(target.artifact):
                return Support.no(
                    f"--lm-head-draft: {target.artifact.path} has no reduced draft head; "
                    "write one with `ninfer draft-head build`"
                )
        return Support.yes()

    def create(self, target: DraftTarget, options: DraftOptions) -> MTPDrafter:
        model = target.model
        layer = MTPLayer(target.config, model.ops, model.dtype)
        layer.load(target.artifact)
        layer.eval()
        c = target.config
        layout = KVLayout(1, c.num_kv_heads, c.head_dim, target.block_size, target.num_blocks)
        store = target.kv_codec.allocate(layout, target.device, compute_dtype=model.dtype)
        return MTPDrafter(layer, model, _head(target, options), store, target.block_size)

    def __repr__(self) -> str:
        return "MTPStrategy()"


def _head(target: DraftTarget, options: DraftOptions) -> DraftHead:
    """The head drafts are picked with: the reduced one with `--lm-head-draft`."""
    if options.lm_head_draft:
        from ninfer_core.spec.draft_head import ReducedHead

        return ReducedHead.from_artifact(target.artifact, target.model)
    return FullHead(target.model)


@hookimpl
def register_draft_strategies() -> list[MTPStrategy]:
    return [MTPStrategy()]
