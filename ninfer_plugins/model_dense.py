"""Model families `qwen3` and `llama`: dense decoders built as `DenseDecoder`."""

from __future__ import annotations

from typing import Any

import torch

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.model.caches import ModelCaches, dense_caches
from ninfer_core.model.config import ModelConfig
from ninfer_core.model.dense import DenseDecoder
from ninfer_core.model.ops import KernelOps
from ninfer_core.model.rope import check_rope
from ninfer_core.model.weight_budget import check_weights_fit
from ninfer_core.model.weights import WeightSlot, check_weights, load_weights, weight_plan
from ninfer_core.plugin_types import Artifact
from ninfer_core.support import Support


class DenseFamily:
    """Qwen3 and Llama differ, for us, only in whether q and k are normalised per head."""

    #: Their MTP layer, when a checkpoint has one, is a dense decoder layer: the `mtp`
    #: draft strategy's default.
    mtp_layer = None

    def __init__(
        self, name: str, architectures: tuple[str, ...], qk_norm: bool, description: str
    ) -> None:
        self.name, self.architectures = name, architectures
        self.qk_norm, self.description = qk_norm, description

    def supports(self, device: DeviceInfo) -> Support:
        return Support.yes()

    def parse_config(self, raw: dict[str, Any]) -> ModelConfig:
        """The checked config: field types and ranges, and the RoPE parameters (computed
        once here, so a scaling that yields NaN fails before any weight exists)."""
        config = ModelConfig.from_hf(raw, qk_norm=self.qk_norm)
        check_rope(config)
        return config

    def check_artifact(self, config: ModelConfig, artifact: Artifact) -> None:
        """Before anything is allocated: every tensor the config implies is there with the
        shape the config gives (the first one that is not is named), and in total the
        config's weights fit in what the artifact's tensor headers hold."""
        check_weights(config, artifact)
        check_weights_fit(config, artifact)

    def layer_caches(self, config: ModelConfig) -> ModelCaches:
        """Paged K/V in every layer."""
        return dense_caches(config)

    def weight_slots(self, config: ModelConfig) -> list[WeightSlot]:
        """q/k/v and gate/up fused, a tied head not loaded, MTP layers skipped."""
        return weight_plan(config)

    def build(
        self,
        config: ModelConfig,
        ops: KernelOps,
        dtype: torch.dtype,
        context_len: int | None = None,
    ) -> DenseDecoder:
        """Uninitialised parameters on `ops.device`; fill them with `load_weights`."""
        return DenseDecoder(config, ops, dtype, context_len)

    def load_weights(self, model: DenseDecoder, artifact: Artifact) -> None:
        load_weights(model, artifact)

    def __repr__(self) -> str:
        return f"DenseFamily({self.name})"


@hookimpl
def register_model_families() -> list[DenseFamily]:
    return [
        DenseFamily(
            "qwen3",
            ("Qwen3ForCausalLM",),
            qk_norm=True,
            description="Qwen3 dense decoders (per-head q/k RMSNorm, GQA)",
        ),
        DenseFamily(
            "llama",
            ("LlamaForCausalLM", "MistralForCausalLM"),
            qk_norm=False,
            description="Llama / Mistral dense decoders (GQA, llama3 / yarn RoPE scaling)",
        ),
    ]
