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
    #: `--activation-dtype`: `int8` when prefill linears over quantized weights quantize
    #: their activations per token to int8 and multiply in integers (W8A8 / W4A8,
    #: `ninfer_core.kernels.int8_act`); None: activations stay in the compute dtype. A
    #: backend that serves `linear` and cannot do it refuses `linear` in `provides`.
    activation_dtype: str | None = None

    @property
    def int8_activations(self) -> bool:
        """Whether prefill linears over quantized weights quantize activations to int8."""
        return self.activation_dtype == "int8"

    @property
    def quantized_formats(self) -> frozenset[str]:
        """The weight formats that are not dense (empty when unknown)."""
        return frozenset(f for f in self.weight_formats or () if not _is_dense(f))

    def describe(self) -> str:
        """`weights bf16+Q4G64, KV rk8v4, compute bf16` (`, activations int8` when set);
        `?` for what is not known."""
        formats = "+".join(sorted(self.weight_formats)) if self.weight_formats else "?"
        dtype = dtype_name(self.compute_dtype) if self.compute_dtype is not None else "?"
        text = f"weights {formats}, KV {self.kv_codec or '?'}, compute {dtype}"
        return f"{text}, activations {self.activation_dtype}" if self.activation_dtype else text

    def to_json(self) -> dict[str, Any]:
        """Plain data; `activation_dtype` only when set (a run in the compute dtype
        reports what it did before the field existed)."""
        out: dict[str, Any] = {
            "weight_formats": sorted(self.weight_formats) if self.weight_formats else None,
            "kv_codec": self.kv_codec,
            "compute_dtype": dtype_name(self.compute_dtype) if self.compute_dtype else None,
        }
        if self.activation_dtype is not None:
            out["activation_dtype"] = self.activation_dtype
        return out


def dtype_name(dtype: torch.dtype) -> str:
    """`bf16` for torch.bfloat16: the name weight formats and `--dtype` use."""
    from ninfer_core.quant.recipes import source_format

    return source_format(dtype)


def _is_dense(fmt: str) -> bool:
    from ninfer_core.quant.formats import FORMATS

    known = FORMATS.get(fmt)
    return known is not None and not known.quantized


def workload_for(
    artifact: Artifact,
    compute_dtype: torch.dtype,
    kv_codec: str | None,
    activation_dtype: str | None = None,
) -> KernelWorkload:
    """The workload of `artifact` run in `compute_dtype` over `kv_codec`'s pages, with
    `activation_dtype` (`int8`, or None: the compute dtype) for prefill linears.

    Formats come from the artifact's `tensor_format` (headers only); a dense tensor,
    or every tensor of an artifact that names no formats, counts as the compute dtype
    it is cast to on loading. Int8 activations multiply quantized weights only: a
    model without any is refused here, with the reason, rather than run unchanged.
    """
    dense = dtype_name(compute_dtype)
    formats = {dense}
    fmt_of = artifact.tensor_format  # optional member of the Artifact contract
    if fmt_of is not None:
        for name in artifact.tensor_names():
            fmt = fmt_of(name) or dense
            formats.add(dense if _is_dense(fmt) else fmt)
    workload = KernelWorkload(frozenset(formats), kv_codec, compute_dtype, activation_dtype)
    if activation_dtype is not None and not workload.quantized_formats:
        from ninfer_core.errors import UnsupportedChoiceError

        raise UnsupportedChoiceError(
            f"--activation-dtype {activation_dtype}: int8 activations multiply quantized "
            f"weights (W8A8/W4A8), and {artifact.path} has none (every weight runs as {dense}); "
            "alternatives: --activation-dtype auto, or a quantized model (ninfer convert "
            "--recipe w8 or q4, or a Q8_0/Q4_0 GGUF)"
        )
    return workload
