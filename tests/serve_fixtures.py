"""A tiny model behind a real engine and `ServeState`, for frontend and server tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from checkpoints import write_tiny_qwen3
from text_fixtures import QWEN3_STYLE_TEMPLATE, reference_tokenizer, write_model_dir

from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.serve.state import ServeOptions, ServeState
from ninfer_core.text import ChatTemplate, GenerationDefaults

MODEL_ID = "tiny-qwen3"


def write_serve_model(path: Path) -> Path:
    """Tiny random Qwen3 with a trained BPE tokenizer and a Qwen3-style chat template."""
    write_tiny_qwen3(path, dtype=torch.float32, vocab_size=400, max_position_embeddings=2048)
    write_model_dir(path, config={"chat_template": QWEN3_STYLE_TEMPLATE})
    im_end = reference_tokenizer(path).convert_tokens_to_ids("<|im_end|>")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    return path


def make_state(model_dir: Path, **engine_options) -> ServeState:
    host, device = create_host(), probe_device()
    loaded = load_model(model_dir, host=host, device=device, runtime=RuntimeConfig(dtype="fp32"))
    config = EngineConfig(**{"max_context": 2048, **engine_options})
    engine = Engine(loaded, config, host=host, device=device)
    tokenizer = engine.tokenizer
    return ServeState(
        engine=engine,
        tokenizer=tokenizer,
        template=ChatTemplate.from_artifact(loaded.artifact, tokenizer.special_tokens),
        defaults=GenerationDefaults.from_artifact(loaded.artifact),
        options=ServeOptions(model_id=MODEL_ID, default_max_tokens=32),
    )
