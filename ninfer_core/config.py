"""Typed configuration, one dataclass per subsystem.

Each field carries its help text and, for `Literal` fields, its choices; the CLI is
generated from these (`ninfer_core.cli.args`) so options are never written twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DType = Literal["auto", "fp32", "bf16", "fp16"]
#: `auto`: activations in the compute dtype; `int8`: see `ninfer_core.kernels.int8_act`.
ActivationDType = Literal["auto", "int8"]


def opt(default, help: str, **extra):
    """A dataclass field with its CLI help (and optional `flag`/`metavar`) in metadata."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class RuntimeConfig:
    """How the model runs: precision, kernels, KV cache."""

    dtype: DType = opt("auto", "compute dtype; auto: bf16 on CPU, fp16 on CUDA")
    activation_dtype: ActivationDType = opt(
        "auto",
        "prefill linears over quantized weights quantize activations per token to int8 "
        "(W8A8/W4A8, integer MMA on GPUs; on the CPU an emulation, slower); decode keeps "
        "the compute dtype; auto: the compute dtype everywhere",
    )
    kv_dtype: str = opt("auto", "KV cache codec (see `ninfer probe`); auto: the compute dtype")
    recipe: str = opt(
        "auto",
        "quantize the checkpoint's dense matrices while loading, as `ninfer convert --recipe "
        "NAME` stores them (mixed, q4, q6, w8, bf16); none: keep its precision; auto: keep it "
        "where the memory plan fits, else mixed",
    )
    gemm_backend: str = opt(
        "auto", "kernel backend for the ops it provides (see `ninfer probe`); auto: per op"
    )
    kernel: str | None = opt(
        None,
        "per-op kernel backends, e.g. linear=NAME,attention=NAME; ops: linear, attention, "
        "rms_norm, rope, silu_and_mul",
    )
    block_size: int = opt(16, "tokens per KV cache block")
    max_context: int = opt(4096, "longest sequence (prompt + output) in tokens")
    threads: int = opt(0, "CPU threads for torch; 0: one per available core")
    compile_decode: bool = opt(
        False,
        "compile the decode step with torch.compile (CPU, torch kernels; "
        "the first decode step of each batch size takes ~1 min to compile)",
    )
    device_spec: str | None = opt(None, "probe as if on this device (rtx3090, h100, cpu, ...)")


@dataclass
class GenerateConfig:
    """One-shot generation from the command line."""

    prompt: str | None = opt(None, "prompt text (rendered through the chat template unless --raw)")
    messages: str | None = opt(None, "JSON file: a list of chat messages, or {messages, tools}")
    raw: bool = opt(False, "send --prompt to the model as is, without the chat template")
    max_new: int = opt(128, "maximum number of new tokens")
    greedy: bool = opt(False, "greedy decoding (same as --temperature 0)")
    stop: list[str] = field(
        default_factory=list, metadata={"help": "stop string (repeatable)", "action": "append"}
    )
