"""Model families `qwen3-next` (`Qwen3NextForCausalLM`) and `qwen3.5` (Qwen3.5 / 3.6,
dense and MoE): the hybrid Qwen3-Next decoder and its successor.

Three of every four layers (by default) are Gated DeltaNet linear attention, which keep
a fixed-size state per sequence; the rest are gated full attention over the paged KV
pool. The family declares that split once (`layer_caches`), and the engine sizes and
allocates both from it. MLPs are sparse mixtures of experts (`ninfer_core.model.moe`)
except on `mlp_only_layers`, or dense everywhere when the config has no experts.

Qwen3.5 is the same network (transformers' `qwen3_5` modules subclass `qwen3_next`'s;
its M-RoPE is plain RoPE for text, whose three position axes are equal). Its checkpoints
differ in the DeltaNet's input projections (`HybridConfig.grouped_projections`) and, for
the multimodal ones the Hub ships, in nesting the text model (`text_config`,
`model.language_model.`): `Qwen3_5Family` is `Qwen3NextFamily` with that switch set, and
only the text model is loaded.

Both carry a multi-token-prediction layer under `mtp.` that the model does not load; the
family offers it to the `mtp` draft strategy (`mtp_layer`, `mtp.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.errors import ModelLoadError
from ninfer_core.model.caches import ModelCaches, PagedKV, SequenceState, StateTensor
from ninfer_core.model.config import ModelConfig
from ninfer_core.model.ops import KernelOps
from ninfer_core.model.rope import check_rope
from ninfer_core.model.stacked_experts import first_stacked
from ninfer_core.model.weight_budget import held_weights
from ninfer_core.model.weights import WeightSlot, check_weights, load_weights
from ninfer_core.plugin_types import Artifact
from ninfer_core.support import Support
from ninfer_plugins.model_hybrid.config import HybridConfig, text_fields, with_mlp_width
from ninfer_plugins.model_hybrid.model import HybridDecoder, planned_weights, weight_plan
from ninfer_plugins.model_hybrid.mtp import HybridMTP, HybridMTPLayer

__all__ = [
    "HybridConfig",
    "HybridDecoder",
    "HybridMTP",
    "HybridMTPLayer",
    "Qwen3NextFamily",
    "Qwen3_5Family",
    "register_model_families",
]


def linear_state(config: HybridConfig) -> SequenceState:
    """What a Gated DeltaNet layer keeps per sequence: the conv's last K - 1 inputs and
    the recurrent state, both fp32 (the ops' `states` arguments, without the batch)."""
    c = config.linear
    return SequenceState(
        (
            StateTensor("conv", (c.conv_dim, c.conv_kernel - 1), torch.float32),
            StateTensor(
                "recurrent", (c.num_value_heads, c.key_head_dim, c.value_head_dim), torch.float32
            ),
        )
    )


class Qwen3NextFamily:
    """Qwen3-Next: hybrid Gated DeltaNet / gated attention with sparse MoE MLPs."""

    name = "qwen3-next"
    architectures: tuple[str, ...] = ("Qwen3NextForCausalLM",)
    description = "Qwen3-Next hybrid decoders (Gated DeltaNet + gated attention, MoE)"
    #: The checkpoint's DeltaNet projection layout (`HybridConfig.grouped_projections`).
    grouped_projections = True
    #: The MTP layer its checkpoints carry under `mtp.` (`mtp.py`), for `--spec mtp`.
    mtp_layer = HybridMTP(grouped_projections=True)

    def hybrid_config(self, config: ModelConfig) -> HybridConfig:
        """The hybrid fields of a config `parse_config` accepted."""
        return HybridConfig.from_model_config(config, grouped_projections=self.grouped_projections)

    def supports(self, device: DeviceInfo) -> Support:
        return Support.yes()

    def parse_config(self, raw: dict[str, Any]) -> ModelConfig:
        """The shared `ModelConfig`, after the hybrid fields and the (partial) RoPE have
        been checked, so a bad config fails before any weight is allocated."""
        config = ModelConfig.from_hf(with_mlp_width(text_fields(raw)), qk_norm=True)
        if config.attention_bias:
            raise ModelLoadError(f"config.json: attention_bias is not supported for {self.name}")
        check_rope(self.hybrid_config(config).rope_config())
        return config

    def check_artifact(self, config: ModelConfig, artifact: Artifact) -> None:
        """Before anything is allocated: no experts stacked where the reader does not
        list them per expert (a `.ninfer` converted before that), the config's weights
        fit in what the tensor headers hold (arithmetic, `planned_weights`), then every
        planned tensor is there with its shape (the first that is not is named)."""
        hybrid = self.hybrid_config(config)
        stacked = first_stacked(artifact.tensor_names())
        if stacked is not None:
            raise ModelLoadError(
                f"{artifact.path}: MoE experts stored stacked ({stacked!r}) are read only from "
                "a model folder; convert the folder again (`ninfer convert` writes one matrix "
                "per expert)"
            )
        planned, held = planned_weights(hybrid), held_weights(artifact)
        if planned > held:
            raise ModelLoadError(
                f"{artifact.path}: config.json describes {planned:,} weights, but the files "
                f"hold only {held:,}: the config does not match the weights"
            )
        check_weights(config, artifact, weight_plan(hybrid))

    def layer_caches(self, config: ModelConfig) -> ModelCaches:
        """Paged K/V for the full-attention layers, a sequence state for the others."""
        hybrid = self.hybrid_config(config)
        kv, state = PagedKV(config.num_kv_heads, config.head_dim), linear_state(hybrid)
        return ModelCaches(
            tuple(state if hybrid.is_linear(i) else kv for i in range(config.num_layers))
        )

    def weight_slots(self, config: ModelConfig) -> list[WeightSlot]:
        """q|k|v and every gate|up fused; `mtp.*` (`mtp_layer`'s) and a tied head not loaded."""
        return weight_plan(self.hybrid_config(config))

    def build(
        self,
        config: ModelConfig,
        ops: KernelOps,
        dtype: torch.dtype,
        context_len: int | None = None,
    ) -> HybridDecoder:
        """Uninitialised parameters on `ops.device`; fill them with `load_weights`."""
        return HybridDecoder(self.hybrid_config(config), ops, dtype, context_len, self.mtp_layer)

    def load_weights(self, model: HybridDecoder, artifact: Artifact) -> None:
        load_weights(model, artifact, weight_plan(model.hybrid))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class Qwen3_5Family(Qwen3NextFamily):
    """Qwen3.5 / Qwen3.6: Qwen3-Next's network with flat DeltaNet projections, a dense
    MLP (`Qwen3_5ForCausalLM`) or MoE on every layer (`Qwen3_5MoeForCausalLM`).

    The `...ForConditionalGeneration` checkpoints are loaded as their text model: the
    vision tower is not read, so image inputs are not supported."""

    name = "qwen3.5"
    architectures = (
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
    )
    description = "Qwen3.5 / 3.6 hybrid decoders, dense and MoE (text only)"
    grouped_projections = False
    mtp_layer = HybridMTP(grouped_projections=False)


@hookimpl
def register_model_families() -> list[Qwen3NextFamily]:
    return [Qwen3NextFamily(), Qwen3_5Family()]
