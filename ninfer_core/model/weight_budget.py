"""Does the artifact hold as many weights as its config.json says the model has?

A config is only a claim. `num_hidden_layers: 1000` with a 4 MiB file would have the
loader build a 1000-layer model (gigabytes of uninitialised parameters) before the first
missing tensor is noticed. The count here is arithmetic on the config (no list of slots,
no tensor) against the artifact's tensor headers, whose byte spans the readers have
already checked against the files' sizes, so it runs before anything is allocated.
"""

from __future__ import annotations

from ninfer_core.errors import ModelLoadError
from ninfer_core.model.config import ModelConfig
from ninfer_core.plugin_types import Artifact


def planned_weights(config: ModelConfig) -> int:
    """How many weights a dense decoder with this config loads (as `weight_plan` lists)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    per_layer = 2 * h + (q + 2 * kv) * h + h * q + 3 * i * h
    if config.attention_bias:
        per_layer += q + 2 * kv + h
    if config.mlp_bias:
        per_layer += 2 * i + h
    if config.qk_norm:
        per_layer += 2 * d
    heads = 1 if config.tie_word_embeddings else 2
    return heads * config.vocab_size * h + config.num_layers * per_layer + h


def held_weights(artifact: Artifact) -> int:
    """How many weights the artifact's tensors hold, from their headers' shapes."""
    total = 0
    for name in artifact.tensor_names():
        numel = 1
        for dim in artifact.tensor_shape(name):
            numel *= int(dim)
        total += numel
    return total


def check_weights_fit(config: ModelConfig, artifact: Artifact) -> None:
    """Raise when the config implies more weights than the artifact holds."""
    planned, held = planned_weights(config), held_weights(artifact)
    if planned > held:
        raise ModelLoadError(
            f"{artifact.path}: config.json describes {planned:,} weights "
            f"({config.num_layers:,} layers, hidden {config.hidden_size:,}, vocab "
            f"{config.vocab_size:,}), but the files hold only {held:,}: the config does not "
            "match the weights"
        )
