"""From a path to a ready model: pick the reader, the family, the kernels, load weights.

Every failure on the way is a `ModelLoadError` or `UnsupportedChoiceError` with one
line naming the file and the problem, raised before any request is served.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ninfer_core import conformance
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import DeviceInfo
from ninfer_core.errors import ModelLoadError, UnknownNameError
from ninfer_core.kernels.compose import (
    OpChoice,
    backend_summary,
    compose_ops,
    composed_choices,
    plan_kernels,
)
from ninfer_core.kernels.int8_act import activation_dtype_name
from ninfer_core.kernels.workload import KernelWorkload, workload_for
from ninfer_core.kv import kv_codec_name
from ninfer_core.memory import huge_pages
from ninfer_core.model.config import ModelConfig
from ninfer_core.model.layers import held_tensors
from ninfer_core.plugin_host import PluginHost, create_host
from ninfer_core.plugin_types import Artifact, CausalLM, KernelOps, ModelFamily
from ninfer_core.quant.at_load import with_recipe

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """A model with its weights in place, and the choices made on the way."""

    path: Path
    artifact: Artifact
    config: ModelConfig
    family: ModelFamily
    model: CausalLM
    ops: KernelOps
    dtype: torch.dtype
    #: The backend serving every op, or `op=name,...` when several do (see `kernels`).
    backend: str
    load_seconds: float
    #: Which backend serves each op, and why (`ninfer_core.kernels.compose`): the one
    #: record of the choice that `ninfer-serve`'s startup and every bench print.
    kernels: list[OpChoice] = field(default_factory=list)
    #: What the kernels were chosen for: weight formats, KV codec, compute dtype.
    workload: KernelWorkload = field(default_factory=KernelWorkload)


def compute_dtype(name: str, device: DeviceInfo) -> torch.dtype:
    """`auto` is bf16 on the CPU (fast int/bf16 kernels there) and fp16 on CUDA."""
    if name == "auto":
        return torch.float16 if device.cuda is not None else torch.bfloat16
    try:
        return DTYPES[name]
    except KeyError:
        raise UnknownNameError("dtype", name, [*DTYPES, "auto"]) from None


@contextlib.contextmanager
def opened_artifact(path: str | Path, host: PluginHost | None = None) -> Iterator[Artifact]:
    """`open_artifact` for a `with` block: closed at its end where the reader can close
    (`close` is not part of the `Artifact` contract: a folder reader holds nothing open)."""
    artifact = open_artifact(host or create_host(), path)
    try:
        yield artifact
    finally:
        close = getattr(artifact, "close", None)
        if close is not None:
            close()


@contextlib.contextmanager
def with_components(artifact: Artifact, names: set[str]) -> Iterator[Artifact]:
    """`artifact` with its optional components `names` listed and loadable too, for a
    `with` block (`Artifact.with_components`; an artifact without that member lists every
    tensor already)."""
    if artifact.with_components is None:
        yield artifact
        return
    with artifact.with_components(names) as full:
        yield full


def open_artifact(host: PluginHost, path: str | Path) -> Artifact:
    """Open `path` with the first reader that recognises it."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    for reader in host.artifact_readers:
        if reader.can_read(path):
            artifact = reader.open(path)
            conformance.check(artifact, Artifact, f"the artifact reader {reader.name!r} opened")
            return artifact
    if path.is_file() and path.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
        raise ModelLoadError(
            f"{path}: pickle checkpoints are refused (loading them can run arbitrary code); "
            "use a Hugging Face folder with safetensors weights"
        )
    readers = ", ".join(f"{r.name} ({r.description})" for r in host.artifact_readers)
    raise ModelLoadError(f"{path}: no artifact reader recognises it; readers: {readers}")


def family_and_config(host: PluginHost, artifact: Artifact) -> tuple[ModelFamily, ModelConfig]:
    """The model family that builds the artifact's architecture, and its parsed config,
    checked against the artifact's tensors (when the family can) before anything is built."""
    archs = artifact.config.get("architectures") or []
    if not archs:
        raise ModelLoadError(f"{artifact.path / 'config.json'}: no 'architectures' entry")
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        raise ModelLoadError(
            f"{artifact.path / 'config.json'}: 'architectures' must be a list of class names"
        )
    try:
        family = host.family_for(archs[0])
    except UnknownNameError as exc:
        raise ModelLoadError(f"{artifact.path / 'config.json'}: {exc}") from None
    try:
        config = family.parse_config(artifact.config)
    except ModelLoadError as exc:  # name the model's own config.json, not just its name
        message = str(exc)
        if not message.startswith("config.json: "):
            raise
        where = artifact.path / "config.json"
        raise ModelLoadError(f"{where}: {message.removeprefix('config.json: ')}") from None
    if family.check_artifact is not None:  # optional (None: checked as the weights load)
        family.check_artifact(config, artifact)
    return family, config


def load_model(
    path: str | Path, *, host: PluginHost, device: DeviceInfo, runtime: RuntimeConfig
) -> LoadedModel:
    start = time.perf_counter()
    # `--recipe NAME` quantizes dense matrices on their way in (`auto` was resolved by the
    # memory plan: here it keeps the checkpoint's precision).
    artifact = with_recipe(open_artifact(host, path), runtime.recipe)
    family, config = family_and_config(host, artifact)
    dtype = compute_dtype(runtime.dtype, device)
    # The kernels are chosen for what will run: the artifact's weight formats (headers
    # only), the codec `--kv-dtype` names (resolved as the engine resolves `auto`) and
    # the compute dtype. A runtime later built over another codec is checked against
    # this choice (`compose.check_kv_codec`).
    # `--activation-dtype int8` is part of the workload: a linear backend that can't run
    # it refuses here, and the ops chosen read it at call time.
    activations = activation_dtype_name(runtime.activation_dtype)
    kv = kv_codec_name(runtime.kv_dtype, dtype)
    workload = workload_for(artifact, dtype, kv, activations)
    kernels = plan_kernels(host, device, runtime.gemm_backend, runtime.kernel, workload=workload)
    # checked against the KernelOps contract
    ops = compose_ops(host, device, kernels, workload=workload)
    kernels = composed_choices(ops, kernels)  # an op the backend's ops lack: the reference
    model = family.build(config, ops, dtype)
    conformance.check(model, CausalLM, f"the model built by family {family.name!r}")
    family.load_weights(model, artifact)
    model.pack_weights()
    model.eval()  # type: ignore[attr-defined]  # a torch.nn.Module
    if device.kind == "cpu":  # each step streams every weight: 2 MiB pages read faster
        log.info(huge_pages.consolidate(held_tensors(model)).describe("weights"))
    return LoadedModel(
        path=Path(path),
        artifact=artifact,
        config=config,
        family=family,
        model=model,
        ops=ops,
        dtype=dtype,
        backend=backend_summary(kernels),
        load_seconds=time.perf_counter() - start,
        kernels=kernels,
        workload=workload,
    )
