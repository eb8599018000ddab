"""`example-linear`: a kernel backend that provides one op, `linear`, written against
`ninfer_core` alone.

NInfer composes the model's ops per op (`docs/plugins.md`, `register_kernel_backends`): a
backend says which ops it provides (`provides`) and, for what will run (the `workload`: the
model's weight formats, the KV codec, the compute dtype), whether it can serve each, with
the reason. Everything it does not provide, or refuses, comes from the next backend that
serves it and finally from the core's reference ops. So this backend is only `linear`:
`torch.nn.functional.linear` over dense weights, as loaded. Quantized weights (`Q4G64`, ...)
reach `linear` as codes and scales, which it has no kernel for: it refuses them, and the
reference serves `linear` for such a model instead.

Its priority is below the reference's (0), so it is never picked by default: ask for it with
`--kernel linear=example-linear` (or `--gemm-backend example-linear`). Copy it, replace
`linear` with your GEMM, and raise the priority once it beats the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.support import Support

NAME = "example-linear"


class DenseLinearOps:
    """The ops of the one op it provides. `linear`'s other members, `pack_linear` and
    `packed_nbytes`, are left out: the weights stay as loaded (no repacking), and `ninfer
    plan` counts them as such."""

    name = NAME

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
        # x: [T, in], w: [out, in], b: [out] or None -> [T, out], all in the compute dtype
        assert isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == x.shape[-1], (
            f"{NAME}: linear takes a dense [out, in] weight, got {type(w).__name__}"
        )
        return F.linear(x, w, b)


class DenseLinearBackend:
    name = NAME
    description = "example plugin: linear only (F.linear, dense weights); reference for the rest"
    #: Below the reference's 0: serves `linear` only when asked for.
    priority = -10
    #: It provides no attention.
    attention_scratch = None

    def supports(self, device: DeviceInfo) -> Support:
        return Support.yes("F.linear runs wherever torch runs")

    def provides(self, device: DeviceInfo, *, workload=None) -> dict[str, Support]:
        """Only `linear`, and only for dense weights. `workload` (a `KernelWorkload`, None
        from an NInfer that does not pass one) says what the model holds; a refusal
        always says why, and `ninfer probe` shows it."""
        quantized = workload.quantized_formats if workload is not None else frozenset()
        if quantized:
            formats = ", ".join(sorted(quantized))
            return {"linear": Support.no(f"no kernel for {formats} weights (dense only)")}
        return {"linear": Support.yes("F.linear over dense weights")}

    def create_ops(self, device: DeviceInfo | torch.device | str) -> DenseLinearOps:
        return DenseLinearOps(device.torch_device if isinstance(device, DeviceInfo) else device)

    def __repr__(self) -> str:
        return f"DenseLinearBackend({self.name})"


@hookimpl
def register_kernel_backends() -> list[DenseLinearBackend]:
    return [DenseLinearBackend()]
