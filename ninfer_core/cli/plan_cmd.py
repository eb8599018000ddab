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
from ninfer_core.kernels.compose import REFERENCE, OpChoice, plan_kernels
from ninfer_core.kernels.int8_act import activation_dtype_name
from ninfer_core.kernels.workload import KernelWorkload, workload_for
from ninfer_core.memory.planner import (
    AutoCapacityTooSmallError,
    CapacityDoesNotFitError,
    MemoryConfig,
    MemoryPlan,
    MemoryPlanError,
    PackedBytes,
    device_memory,
    parse_kv_capacity,
    plan_memory,
    weights_bytes,
)
from ninfer_core.memory.table import render_json, render_table
from ninfer_core.memory.workspace import estimate_workspace
from ninfer_core.plugin_host import PluginHost
from ninfer_core.plugin_types import Artifact, AttentionScratch, KVCodec, ModelFamily
from ninfer_core.quant.at_load import AUTO_RECIPE, KEEP, QuantizingArtifact, quantizes, with_recipe
from ninfer_core.quant.recipes import recipe
from ninfer_core.serve.config import ServeConfig
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.types import DraftMemory


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show where memory goes at startup (weights, KV pool, workspace); loads nothing",
    )
    p.add_argument("model", nargs="?", help="model folder (default: the small built-in model)")
    # Every `ninfer-serve` option, so that a serve command plans as it is pasted; the
    # server's own (address, key, queue) change nothing in the plan. `--kv-capacity` (which
    # may be `auto`) is MemoryConfig's.
    add_config_arguments(p, RuntimeConfig, skip=("block_size", "max_context"))
    add_config_arguments(p, EngineConfig, skip=("kv_capacity",))
    add_config_arguments(p, SpecConfig)
    add_config_arguments(p, MemoryConfig)
    add_config_arguments(p, ServeConfig)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def _packed_bytes(
    host: PluginHost,
    device: DeviceInfo,
    choices: list[OpChoice],
    dtype: torch.dtype,
    workload: KernelWorkload | None = None,
) -> PackedBytes | None:
    """What the kernel backend packs each projection into, or None: it repacks nothing.

    Asked of the backend `choices` picked for `linear` (`packed_nbytes`, from shapes
    alone; a backend whose `packed_nbytes` is None is probed with a 1x1 dense weight);
    only on the CPU, where packing happens and asking touches no GPU.
    """
    from ninfer_core.kernels.compose import create_ops
    from ninfer_core.quant.formats import weight_format

    if device.cuda is not None:
        return None
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


def _attention_scratch(host: PluginHost, choices: list[OpChoice]) -> AttentionScratch | None:
    """What the chosen attention kernel allocates in place of a gathered context, or None:
    it gathers (the reference), and the workspace estimate counts that."""
    [attention] = [c for c in choices if c.op == "attention"]
    if attention.backend == REFERENCE:
        return None
    return host.kernel_backends.get(attention.backend).attention_scratch


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
    source = open_artifact(host, path)
    family, config = family_and_config(host, source)
    dtype = compute_dtype(runtime.dtype, device)
    context = engine.context_for(config.max_position_embeddings)
    if context < engine.max_context:
        # Sized and served for what the model can hold, never for what was asked.
        sys.stderr.write(
            f"warning: --max-context {engine.max_context} is more than the "
            f"{config.max_position_embeddings} positions {path} was trained for; "
            f"serving {context}\n"
        )
    caches = caches_for(family, config)
    dtype_name = {v: k for k, v in DTYPES.items()}[dtype]

    def plan_for(artifact: Artifact, label: str) -> MemoryPlan:
        # The kernels the load would choose for these weights (formats from the headers).
        activations = activation_dtype_name(runtime.activation_dtype)
        workload = workload_for(artifact, dtype, codec_name, activations)
        choices = plan_kernels(
            host, device, runtime.gemm_backend, runtime.kernel, workload=workload
        )
        packed = _packed_bytes(host, device, choices, dtype, workload)
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
            attention_scratch=_attention_scratch(host, choices),
        )
        strategy, draft = _draft_memory(
            host, device, spec, artifact, config, dtype, codec, packed, family
        )
        return plan_memory(
            config,
            weights_bytes=weights_bytes(
                config, dtype, artifact=artifact, packed_bytes=packed, family=family
            ),
            weights_dtype=dtype_name + label,
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

    chosen = runtime.recipe
    if chosen not in KEEP:
        plan = plan_for(with_recipe(source, chosen), f", {chosen} recipe")
    else:
        try:
            plan = plan_for(source, "")
            chosen = "none"
        except (CapacityDoesNotFitError, AutoCapacityTooSmallError) as exc:
            # `--recipe auto`: the checkpoint's precision does not fit; quantized by the
            # default recipe while loading, it may.
            fallback = recipe(AUTO_RECIPE)
            if chosen == "none" or not quantizes(source, fallback):
                raise
            label = f", {AUTO_RECIPE} recipe (--recipe auto: {dtype_name} did not fit)"
            try:
                plan = plan_for(QuantizingArtifact(source, fallback), label)
            except MemoryPlanError as quantized:
                raise MemoryPlanError(
                    f"{quantized}: the weights quantized by --recipe {AUTO_RECIPE} while "
                    f"loading, since at the checkpoint's {dtype_name} they fit even less"
                ) from exc
            chosen = AUTO_RECIPE
    about = {"model": str(path), "architecture": config.architecture, "recipe": chosen}
    return plan, about


def run(ns: argparse.Namespace) -> int:
    plan, about = make_plan(ns)
    if ns.json:
        sys.stdout.write(render_json(plan, **about) + "\n")
        return 0
    print(f"plan for {about['model']} ({about['architecture']}) on {plan.memory.device}")
    print(render_table(plan))
    return 0
