"""Hugging Face folder (or GGUF file) → `.ninfer` file: quantize each tensor by a recipe and
pack it. A tensor the source holds quantized (a GGUF's Q4_0, Q4_1 and Q8_0 matrices) keeps
its codes, or is dequantized when the recipe stores it dense (`bf16`).

Peak memory is one tensor at a time: each tensor is read from the (memory-mapped)
safetensors shard, encoded, handed to the container writer and dropped before the
next is read. The container carries the model's text files as resources, so the
`.ninfer` file alone serves the model.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ninfer_core.errors import ModelLoadError, NInferError
from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.tensor import QuantizedTensor

#: Files beside the weights that a served model needs, copied as resources when present.
RESOURCE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)

#: Tensor-name fragments of optional components; everything else is `text`.
COMPONENT_MARKERS = (("mtp", "mtp"), ("vision", "vision"), ("visual", "vision"))


def component_of(name: str) -> str:
    """Which component a checkpoint tensor belongs to (loaded only when enabled)."""
    parts = name.split(".")
    for marker, component in COMPONENT_MARKERS:
        if any(p == marker or p.startswith(marker + "_") for p in parts):
            return component
    return "text"


@dataclass
class ConvertSummary:
    """What a conversion wrote: per format counts, weights and bytes."""

    path: Path
    recipe: str
    version: int
    tensors: int = 0
    weights: int = 0
    tensor_bytes: int = 0
    resources: list[str] = field(default_factory=list)
    by_format: dict[str, list[int]] = field(
        default_factory=dict
    )  # fmt -> [tensors, weights, bytes]
    volumes: int = 1

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.tensor_bytes / self.weights if self.weights else 0.0

    def add(self, fmt: str, numel: int, nbytes: int) -> None:
        self.tensors += 1
        self.weights += numel
        self.tensor_bytes += nbytes
        row = self.by_format.setdefault(fmt, [0, 0, 0])
        row[0] += 1
        row[1] += numel
        row[2] += nbytes

    def render(self) -> str:
        lines = [f"{'format':<8} {'tensors':>8} {'weights':>14} {'bytes':>14} {'bits/weight':>12}"]
        for fmt, (n, numel, nbytes) in sorted(self.by_format.items()):
            lines.append(f"{fmt:<8} {n:>8} {numel:>14,} {nbytes:>14,} {8 * nbytes / numel:>12.2f}")
        lines.append(
            f"{'total':<8} {self.tensors:>8} {self.weights:>14,} {self.tensor_bytes:>14,} "
            f"{self.bits_per_weight:>12.2f}"
        )
        lines.append(
            f"wrote {self.path} (container v{self.version}, recipe {self.recipe}, "
            f"{self.volumes} volume(s), resources: {', '.join(self.resources) or 'none'})"
        )
        return "\n".join(lines)


def _stored_bytes(tensor: torch.Tensor, fmt: str) -> torch.Tensor:
    """The stored bytes (1-D uint8) of `tensor` encoded as `fmt`."""
    wf = weight_format(fmt)
    if wf.quantized:
        from ninfer_core.quant.tensor import quantize

        return quantize(tensor, fmt).to_stored()
    return tensor.to(wf.dtype).contiguous().reshape(-1).view(torch.uint8)


def _is_gguf(path: Path) -> bool:
    """A file starting with the GGUF magic (llama.cpp's format)."""
    try:
        with path.open("rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def _kept_or_dense(
    name: str, weight: QuantizedTensor, plan: Any, digest: Any
) -> tuple[str, torch.Tensor]:
    """(format, stored bytes) for a tensor the source holds quantized: its own
    codes where the recipe quantizes that tensor, else dequantized into the recipe's dense
    format. The digest takes the source's codes either way (`weights_id` is the recipe's
    business no more than for a dense source)."""
    stored = weight.to_stored()
    digest.update(f"{name}:{list(weight.shape)}:{weight.fmt.name}\n".encode())
    digest.update(stored.numpy().tobytes())
    fmt = plan.format_for(name, weight.shape, torch.float32)
    if weight_format(fmt).quantized:
        return weight.fmt.name, stored
    return fmt, _stored_bytes(weight.dequantize(torch.float32), fmt)


def convert(
    source: str | Path,
    out: str | Path,
    *,
    recipe_name: str = "mixed",
    version: int = 3,
    model_id: str | None = None,
    volume_limit: int | None = None,
    progress: Callable[[int, str], Any] | None = None,
) -> ConvertSummary:
    """Convert the HF folder (or GGUF file) `source` into the `.ninfer` file `out`.

    `progress(total, name)` is called once per tensor (a progress bar's hook).
    """
    from ninfer_core.artifact.writer import ContainerWriter
    from ninfer_core.loading import open_artifact
    from ninfer_core.plugin_host import create_host
    from ninfer_core.quant.recipes import recipe

    plan = recipe(recipe_name)
    # every artifact declares tensor_file (the contract's optional member), so the folder
    # itself is what says "a Hugging Face model": a .ninfer file may hold packed codes.
    # A GGUF file (its magic says so) is the other source.
    if not Path(source).exists():
        raise ModelLoadError(f"{source}: no such file or folder")
    if not (Path(source).is_dir() or _is_gguf(Path(source))):
        raise ModelLoadError(f"{source}: convert reads Hugging Face model folders and GGUF files")
    src = open_artifact(create_host(), source)
    out = Path(out)
    if out.resolve() == Path(source).resolve():
        raise NInferError(f"{out}: the output would overwrite the source")
    names = sorted(src.tensor_names())
    # weights_id: what the weights are, whatever recipe packs them — a digest over the
    # source tensors' names, shapes and bytes, in name order.
    digest = hashlib.sha256()
    summary = ConvertSummary(path=out, recipe=recipe_name, version=version)
    identity = None
    recipe_json = None
    if version >= 2:
        # weights_id is known once every tensor is read; a placeholder until then.
        default_id = Path(source).resolve().name
        if Path(source).is_file():  # `model.Q4_1.gguf` -> `model.Q4_1`
            default_id = Path(source).resolve().stem
        identity = {"model_id": model_id or default_id, "weights_id": "pending"}
        recipe_json = plan.describe()
    kwargs: dict[str, Any] = {"version": version}
    if version >= 2:
        kwargs.update(identity=identity, recipe=recipe_json)
    if volume_limit is not None:
        kwargs["volume_limit"] = volume_limit
    writer = ContainerWriter(out, **kwargs)
    # A source may hand a tensor out quantized (a GGUF's Q4_0/Q4_1/Q8_0 blocks): it is never
    # quantized again. A recipe that quantizes it keeps its codes as they are; one that
    # stores it dense (`bf16`) dequantizes it.
    load = src.load_weight or src.load_tensor
    try:
        for name in names:
            tensor = load(name)
            if isinstance(tensor, QuantizedTensor):
                shape = tensor.shape
                fmt, data = _kept_or_dense(name, tensor, plan, digest)
            else:
                shape = tuple(tensor.shape)
                fmt = plan.format_for(name, shape, tensor.dtype)
                digest.update(f"{name}:{list(shape)}:{tensor.dtype}\n".encode())
                digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                data = _stored_bytes(tensor, fmt)
            # Versions 1 and 2 have no components: optional parts travel as text.
            component = component_of(name) if version >= 3 else "text"
            writer.add_tensor(name, fmt, shape, data, component=component)
            summary.add(fmt, math.prod(shape), data.numel())
            del tensor, data
            if progress is not None:
                progress(len(names), name)
        for res in RESOURCE_FILES:
            text = src.read_text(res)
            if text is not None:
                writer.add_resource(res, text)
                summary.resources.append(res)
        if writer.identity is not None:
            writer.identity["weights_id"] = "sha256:" + digest.hexdigest()
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        src.close()
    summary.volumes = 1 + len(list(out.parent.glob(out.name + ".part-*")))
    return summary


def tqdm_progress() -> Callable[[int, str], Any]:
    """A tqdm bar on stderr, created on the first call (when the total is known)."""
    from tqdm import tqdm

    bar: list[Any] = []

    def step(total: int, name: str) -> None:
        if not bar:
            bar.append(tqdm(total=total, unit="tensor", file=sys.stderr, leave=False))
        bar[0].set_postfix_str(name[-40:], refresh=False)
        bar[0].update(1)
        if bar[0].n >= total:
            bar[0].close()

    return step


def summary_json(summary: ConvertSummary) -> str:
    return json.dumps(
        {
            "path": str(summary.path),
            "recipe": summary.recipe,
            "container_version": summary.version,
            "tensors": summary.tensors,
            "weights": summary.weights,
            "tensor_bytes": summary.tensor_bytes,
            "bits_per_weight": round(summary.bits_per_weight, 4),
            "by_format": {
                f: {"tensors": n, "weights": w, "bytes": b}
                for f, (n, w, b) in summary.by_format.items()
            },
            "resources": summary.resources,
            "volumes": summary.volumes,
        },
        indent=2,
    )
