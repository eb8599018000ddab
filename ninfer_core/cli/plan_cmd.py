"""`ninfer plan`: where memory would go at startup, for this machine or a named card.

Reads only the model's config and tensor headers (no weights are loaded; a `.ninfer`
file's headers give each tensor's format and size), so it answers for a 24 GiB card on
a laptop: `ninfer plan MODEL --device-spec rtx3090 --kv-dtype rk8v4`.
Options are the ones `ninfer-serve` takes, generated from the same config dataclasses.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from ninfer_core.cli.args import add_config_arguments, config_from_args
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import DeviceInfo
from ninfer_core.engine.config import EngineConfig
from ninfer_core.errors import NInferError
from ninfer_core.kernels.int8_act import activation_dtype_name
from ninfer_core.kernels.workload import KernelWorkload, workload_for
from ninfer_core.memory.planner import (
    MemoryConfig,
    MemoryPlan,
    PackedBytes,
    device_memory,
    parse_kv_capacity,
    plan_memory,
    weights_bytes,
)
from ninfer_core.memory.table import render_json, render_table
from ninfer_core.memory.workspace import estimate_workspace
from ninfer_core.plugin_host import PluginHost
from ninfer_core.plugin_types import Artifact, KVCodec, ModelFamily
from ninfer_core.quant.recipes import recipe
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.types import DraftMemory

#: EngineConfig fields that do not change the memory plan (kv_capacity: MemoryConfig's).
#: `--prefix-cache` does: a model with state layers keeps state snapshots for it.
ENGINE_SKIP = (
    "max_pending_requests", "pending_timeout_ms", "kv_capacity", "state_snapshot_interval"
)  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show where memory goes at startup (weights, KV pool, workspace); loads nothing",
    )
    p.add_argument("model", nargs="?", help="model folder (default: the small built-in model)")
    add_config_arguments(p, RuntimeConfig, skip=("block_size", "max_context", "threads"))
    add_config_arguments(p, EngineConfig, skip=ENGINE_SKIP)
    add_config_arguments(p, SpecConfig)
    add_config_arguments(p, MemoryConfig)
    p.add_argument(
        "--recipe",
        metavar="NAME",
        help="plan the weights as `ninfer convert --recipe NAME` would store them "
        "(a conversion not yet made; see `ninfer convert --help` for the names)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def _packed_bytes(
    host: PluginHost,
    device: DeviceInfo,
    backend: str,
    dtype: torch.dtype,
    kernel: str | None = None,
    workload: KernelWorkload | None = None,
) -> PackedBytes | None:
    """What the kernel backend packs each projection into, or None: it repacks nothing.

    Asked of the backend itself (`packed_nbytes`, from shapes alone; a backend whose
    `packed_nbytes` is None is probed with a 1x1 dense weight); only on the CPU, where
    packing happens and asking touches no GPU.
    """
    from ninfer_core.kernels.compose import create_ops, plan_kernels
    from ninfer_core.quant.formats import weight_format

    if device.cuda is not None:
        return None
    choices = plan_kernels(host, device, backend, kernel, workload=workload)
    [linear] = [c for c in choices if c.op == "linear"]
    ops = create_ops(host, device, linear.backend, workload)  # as compose_ops makes them
    sizer = getattr(ops, "packed_nbytes", None)  # optional; a partial backend may omit it
    if sizer is not None:
        return lambda fmt, shape: sizer(fmt, shape, dtype=dtype)
    weight = torch.zeros(1, 1, dtype=dtype)
    pack = getattr(ops, "pack_linear", None)
    if pack is None or pack(weight) is weight:
        return None
    return lambda fmt, shape: (
        None if weight_format(fmt).quantized else shape[0] * shape[1] * dtype.itemsize
    )


def _draft_memory(
    host: PluginHost,
    device: DeviceInfo,
    spec: SpecConfig,
    artifact: Artifact,
    config: Any,
    dtype: torch.dtype,
    codec: KVCodec,
    packed: PackedBytes | None,
    family: ModelFamily | None = None,
) -> tuple[str, DraftMemory | None]:
    """The `--spec` strategy's name and what its drafter will hold ("", None: no
    speculation), asked of the strategy the engine will build (`DraftStrategy.memory`)
    from the headers alone. A name no plugin registers, a strategy the device refuses, or
    one whose weights the artifact lacks fails here, before anything loads. `family` goes
    to a `memory` that takes it (the contract grew it later)."""
    from ninfer_core.selection import call_accepting, choose

    if not spec.enabled:
        return "", None
    name = choose(host, "draft_strategies", device, spec.spec).chosen
    strategy = host.draft_strategies.get(name)
    memory = call_accepting(
        strategy.memory,
        artifact,
        config,
        spec.options,
        dtype,
        codec,
        packed_bytes=packed,
        family=family,
    )
    return name, memory


def _spec_config(ns: argparse.Namespace) -> SpecConfig:
    try:
        return config_from_args(SpecConfig, ns)
    except ValueError as exc:
        raise NInferError(str(exc)) from None


def make_plan(
    ns: argparse.Namespace, spec: SpecConfig | None = None
) -> tuple[MemoryPlan, dict[str, Any]]:
    """The plan for the parsed options, and what it was made for (model, device).

    `spec`: speculative decoding as the caller configured it (`ninfer-serve` passes its
    own); None: from `ns` (`--spec`, `--draft-tokens`, `--lm-head-draft`), off if absent.
    """
    from ninfer_core.builtin_model import default_model
    from ninfer_core.device import probe_device, simulated_device
    from ninfer_core.loading import DTYPES, compute_dtype, family_and_config, open_artifact
    from ninfer_core.model.caches import caches_for
    from ninfer_core.plugin_host import create_host
    from ninfer_core.selection import choose

    runtime = config_from_args(RuntimeConfig, ns)
    memory_cfg = config_from_args(MemoryConfig, ns)
    try:
        # `--kv-capacity` (which may be `auto`) is MemoryConfig's; the engine's keeps its default.
        shared = {k: v for k, v in vars(ns).items() if k != "kv_capacity"}
        engine = config_from_args(EngineConfig, argparse.Namespace(**shared))
    except ValueError as exc:
        raise NInferError(str(exc)) from None
    spec = _spec_config(ns) if spec is None else spec
    capacity = parse_kv_capacity(memory_cfg.kv_capacity)
    device = simulated_device(runtime.device_spec) if runtime.device_spec else probe_device()
    host = create_host()
    codec_name = choose(host, "kv_codecs", device, runtime.kv_dtype).chosen
    if codec_name is None:
        raise NInferError("no KV codec supports this device (see `ninfer probe`)")
    codec = host.kv_codecs.get(codec_name)
    path = ns.model or str(default_model())
    artifact = open_artifact(host, path)
    family, config = family_and_config(host, artifact)
    dtype = compute_dtype(runtime.dtype, device)
    # The linear kernel the load would choose for these weights (formats from the headers).
    activations = activation_dtype_name(runtime.activation_dtype)
    workload = workload_for(artifact, dtype, codec_name, activations)
    packed = _packed_bytes(host, device, runtime.gemm_backend, dtype, runtime.kernel, workload)
    strategy, draft = _draft_memory(
        host, device, spec, artifact, config, dtype, codec, packed, family
    )
    context = engine.context_for(config.max_position_embeddings)
    if context < engine.max_context:
        # Sized and served for what the model can hold, never for what was asked.
        sys.stderr.write(
            f"warning: --max-context {engine.max_context} is more than the "
            f"{config.max_position_embeddings} positions {path} was trained for; "
            f"serving {context}\n"
        )
    caches = caches_for(family, config)
    workspace = estimate_workspace(
        config,
        dtype=dtype,
        kv_codec=codec,
        prefill_chunk=engine.prefill_chunk,
        context=context,
        concurrency=engine.max_concurrency,
        block_size=engine.block_size,
        caches=caches,
        device_kind=device.kind,
    )
    # `ninfer plan --recipe`; serve plans what it loads (its namespace has no recipe)
    name = vars(ns).get("recipe")
    planned = recipe(name) if name else None
    plan = plan_memory(
        config,
        weights_bytes=weights_bytes(
            config, dtype, artifact=artifact, packed_bytes=packed, family=family, recipe=planned
        ),
        weights_dtype={v: k for k, v in DTYPES.items()}[dtype]
        + (f", {planned.name} recipe" if planned else ""),
        codec=codec,
        memory=device_memory(device, memory_budget=memory_cfg.memory_budget),
        workspace=workspace,
        max_context=context,
        max_concurrency=engine.max_concurrency,
        kv_capacity=capacity,
        block_size=engine.block_size,
        headroom_fraction=memory_cfg.memory_headroom,
        caches=caches,
        draft=draft,
        draft_strategy=strategy,
        state_snapshots=engine.snapshot_count,
    )
    about = {"model": str(path), "architecture": config.architecture}
    return plan, about


def run(ns: argparse.Namespace) -> int:
    plan, about = make_plan(ns)
    if ns.json:
        sys.stdout.write(render_json(plan, **about) + "\n")
        return 0
    print(f"plan for {about['model']} ({about['architecture']}) on {plan.memory.device}")
    print(render_table(plan))
    return 0
