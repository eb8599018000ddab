"""`ninfer probe`: the device, and for each extension point which plugin and why."""

from __future__ import annotations

import argparse
import json
import sys

from ninfer_core.device import DEVICE_SPECS, DeviceInfo, probe_device, simulated_device
from ninfer_core.hookspecs import exclusive_points
from ninfer_core.kernels.compose import kernel_report, plan_kernels
from ninfer_core.kernels.workload import KernelWorkload
from ninfer_core.plugin_host import PluginHost, create_host
from ninfer_core.selection import probe


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="show the hardware and which plugins it gets, and why")
    p.add_argument(
        "model", nargs="?", help="model folder: also show each KV codec's bytes per token for it"
    )
    p.add_argument(
        "--device-spec",
        metavar="NAME",
        help=f"simulate a device: {', '.join(DEVICE_SPECS)}",
    )
    for point in exclusive_points():  # --gemm-backend, --kv-dtype, --spec
        text = f"{point.kind}, as ninfer-serve would be given"
        p.add_argument(point.option, default=point.default, help=text)
    p.add_argument(
        "--kernel",
        default=None,
        metavar="OP=NAME,...",
        help="per-op kernel backends, as ninfer-serve would be given (linear=NAME,...)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp16", "fp32"],
        help="compute dtype, as ninfer-serve would be given (the kernels are chosen for it)",
    )
    p.add_argument(
        "--activation-dtype",
        default="auto",
        choices=["auto", "int8"],
        help="prefill activations, as ninfer-serve would be given (int8: W8A8/W4A8 linears)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    device = simulated_device(ns.device_spec) if ns.device_spec else probe_device()
    host = create_host(warn=False)  # failures are listed below
    requested = {p.dest: getattr(ns, p.dest) for p in exclusive_points() if p.dest}
    workload = _workload(host, device, ns)
    reports = probe(host, device, workload=workload, **requested)
    kernels = plan_kernels(host, device, ns.gemm_backend, ns.kernel, workload=workload)
    # Truthful about a partial backend: the summary names one backend only when it
    # serves every op, and each candidate says which ops it serves.
    reports = [kernel_report(r, kernels) if r.point == "kernel_backends" else r for r in reports]
    kv_bytes = _kv_bytes_per_token(host, ns.model) if ns.model else {}
    failures = [
        {"plugin": f.plugin, "distribution": f.distribution, "status": f.status, "reason": f.reason}
        for f in host.failures
    ]
    if ns.json:
        out = {
            "device": device.to_json(),
            "extension_points": [r.to_json() for r in reports],
            "kernel_workload": workload.to_json(),
            "kernel_ops": [c.to_json() for c in kernels],
            "plugin_failures": failures,
        }
        if kv_bytes:
            out["kv_bytes_per_token"] = kv_bytes
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(device.describe())
    for report in reports:
        chosen = f" -> {report.chosen}" if report.chosen else ""
        print(f"\n{report.point.replace('_', ' ')}{chosen}")
        if not report.candidates:
            print("  (none installed)")
        for c in report.candidates:
            reason = f": {c.reason}" if c.reason else ""
            size = f" {kv_bytes[c.name]} B/token" if c.name in kv_bytes else ""
            print(f"  {c.status:<10} {c.name:<16} [{c.distribution}]{size}{reason}")
        if report.point == "kernel_backends":
            print(f"\nkernel ops (which backend serves each, and why) for {workload.describe()}")
            for choice in kernels:
                print(f"  {choice.describe()}")
    for f in failures:
        what = "not loaded" if f["status"] == "broken" else "refused an object"
        print(f"\nplugin {f['plugin']} ({f['distribution']}) {what}: {f['reason']}")
    return 0


def _workload(host: PluginHost, device: DeviceInfo, ns: argparse.Namespace) -> KernelWorkload:
    """What the kernels are chosen for: with a model, its weight formats (headers only),
    else only the KV codec and the compute dtype the options name."""
    from ninfer_core.kernels.int8_act import activation_dtype_name
    from ninfer_core.kernels.workload import workload_for
    from ninfer_core.kv import kv_codec_name
    from ninfer_core.loading import compute_dtype, open_artifact

    dtype = compute_dtype(ns.dtype, device)
    kv = kv_codec_name(ns.kv_dtype, dtype)
    activations = activation_dtype_name(ns.activation_dtype)
    if ns.model:
        return workload_for(open_artifact(host, ns.model), dtype, kv, activations)
    return KernelWorkload(None, kv, dtype, activations)


def _kv_bytes_per_token(host, model: str) -> dict[str, int]:
    """Each KV codec's bytes per token for the model's shapes (headers only, no weights)."""
    from ninfer_core.loading import family_and_config, open_artifact

    _, cfg = family_and_config(host, open_artifact(host, model))
    return {
        e.name: e.obj.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        for e in host.kv_codecs.entries()
    }
