"""`KernelWorkload`: what the kernels will run, as a kernel backend is asked about it.

A backend's `supports(device)` says whether it runs on the machine at all; what it can
serve also depends on the run: a GEMM kernel exists for some weight formats only, an
attention kernel reads some KV codecs' pages only, a kernel may need bf16 activations.
The host builds one `KernelWorkload` per load (`workload_for`, from the artifact's
headers: no weight is read) and passes it, by name, to every backend whose
`provides` (or `supports`) declares a `workload` parameter; a backend written before it
existed takes `device` alone and keeps working (`ninfer_core.kernels.compose`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ninfer_core.plugin_types import Artifact


@dataclass(frozen=True, slots=True)
class KernelWorkload:
    """The model's weight formats, the KV codec and the compute dtype a run will use.

    Each field is None where it is not known (`ninfer probe` without a model): a
    backend then answers for what it can tell from the device alone.
    """

    #: The formats the model's weights reach `linear` in: `weight_format` names such as
    #: `Q4G64` for quantized matrices, and the compute dtype's name (`bf16`, `fp32`) for
    #: dense ones (the loader casts every dense tensor to it).
    weight_formats: frozenset[str] | None = None
    #: The KV codec's name (`fp16`, `rk8v4`, ...), `--kv-dtype` resolved as the engine
    #: resolves `auto`.
    kv_codec: str | None = None
    #: The dtype of activations (and of dense weights).
    compute_dtype: torch.dtype | None = None

    @property
    def quantized_formats(self) -> frozenset[str]:
        """The weight formats that are not dense (empty when unknown)."""
        return frozenset(f for f in self.weight_formats or () if not _is_dense(f))

    def describe(self) -> str:
        """`weights bf16+Q4G64, KV rk8v4, compute bf16`; `?` for what is not known."""
        formats = "+".join(sorted(self.weight_formats)) if self.weight_formats else "?"
        dtype = dtype_name(self.compute_dtype) if self.compute_dtype is not None else "?"
        return f"weights {formats}, KV {self.kv_codec or '?'}, compute {dtype}"

    def to_json(self) -> dict[str, Any]:
        return {
            "weight_formats": sorted(self.weight_formats) if self.weight_formats else None,
            "kv_codec": self.kv_codec,
            "compute_dtype": dtype_name(self.compute_dtype) if self.compute_dtype else None,
        }


def dtype_name(dtype: torch.dtype) -> str:
    """`bf16` for torch.bfloat16: the name weight formats and `--dtype` use."""
    from ninfer_core.quant.recipes import source_format

    return source_format(dtype)


def _is_dense(fmt: str) -> bool:
    from ninfer_core.quant.formats import FORMATS

    known = FORMATS.get(fmt)
    return known is not None and not known.quantized


def workload_for(
    artifact: Artifact, compute_dtype: torch.dtype, kv_codec: str | None
) -> KernelWorkload:
    """The workload of `artifact` run in `compute_dtype` over `kv_codec`'s pages.

    Formats come from the artifact's `tensor_format` (headers only); a dense tensor,
    or every tensor of an artifact that names no formats, counts as the compute dtype
    it is cast to on loading.
    """
    dense = dtype_name(compute_dtype)
    formats = {dense}
    fmt_of = artifact.tensor_format  # optional member of the Artifact contract
    if fmt_of is not None:
        for name in artifact.tensor_names():
            fmt = fmt_of(name) or dense
            formats.add(dense if _is_dense(fmt) else fmt)
    return KernelWorkload(frozenset(formats), kv_codec, compute_dtype)
