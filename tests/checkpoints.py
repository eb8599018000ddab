"""Tiny random-weight Hugging Face checkpoints for tests, written by transformers itself.

`write_tiny_qwen3(dir)` / `write_tiny_llama(dir)` build the model with a fixed seed and
`save_pretrained` it (safetensors), so our loader and runtime are checked against the
independent reference. Defaults: hidden 64, 3 layers, 4 query / 2 KV heads (head dim 16),
vocab 300, 256 positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: Llama-3.1-style scaling with a short original window, so a 64-token prompt crosses it and
#: the high, blended and low frequency bands all occur at head_dim 16.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

_SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    # Wider than transformers' 0.02 so logits are peaked and greedy output varies; at
    # 0.02 a tiny tied model just repeats one token, which would test nothing.
    initializer_range=0.1,
)


def _rope_parameters(theta: float, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    params = {"rope_type": "default", "rope_theta": theta}
    if rope_scaling:
        scaling = dict(rope_scaling)
        if "type" in scaling:  # the pre-v5 spelling
            scaling.setdefault("rope_type", scaling.pop("type"))
        params.update(scaling)
    return params


def _write(model: torch.nn.Module, path: Path, dtype: torch.dtype, max_shard_size) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = model.to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def tiny_qwen3_config(
    *, tie_word_embeddings: bool = True, rope_scaling=None, rope_theta=1e6, **overrides
):
    from transformers import Qwen3Config

    kw = {**_SMALL, "tie_word_embeddings": tie_word_embeddings, **overrides}
    return Qwen3Config(rope_parameters=_rope_parameters(rope_theta, rope_scaling), **kw)


def tiny_llama_config(
    *, tie_word_embeddings: bool = False, rope_scaling=LLAMA3_ROPE, rope_theta=1e4, **overrides
):
    from transformers import LlamaConfig

    kw = {**_SMALL, "tie_word_embeddings": tie_word_embeddings, **overrides}
    return LlamaConfig(rope_parameters=_rope_parameters(rope_theta, rope_scaling), **kw)


def write_tiny_qwen3(
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    **config_overrides,
) -> Path:
    """A Qwen3ForCausalLM folder (tied head by default); kwargs override `Qwen3Config` fields,
    plus `rope_scaling` (a dict like `{"rope_type": "yarn", "factor": 4.0, ...}`) and
    `rope_theta`. `max_shard_size` (e.g. "40KB") writes several shards and an index."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(**config_overrides))
    return _write(model, path, dtype, max_shard_size)


def write_tiny_llama(
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    **config_overrides,
) -> Path:
    """A LlamaForCausalLM folder: GQA, untied head and `LLAMA3_ROPE` scaling by default
    (`rope_scaling=None` for plain RoPE); kwargs override `LlamaConfig` fields."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**config_overrides))
    return _write(model, path, dtype, max_shard_size)


def load_reference(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers model from `path`, in eval mode (the parity reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def open_checkpoint(path: str | Path):
    """The folder through our real reader (`ninfer_plugins.artifact_safetensors`)."""
    from ninfer_plugins.artifact_safetensors import open_hf_folder

    return open_hf_folder(path)


def prompt_logits(loaded, ids: list[int]) -> torch.Tensor:
    """fp32 logits at every position of `ids`, one prefill through our engine's runner."""
    from ninfer_core.eval_ppl import sequence_logits

    return sequence_logits(loaded, ids)
