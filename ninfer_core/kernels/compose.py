"""Kernels composed per op: each op from the highest-priority backend that provides it.

A kernel backend may provide any subset of the ops (`KernelBackend.provides`; None: all
of them), and answers per op for the device and for what will run (`KernelWorkload`:
the model's weight formats, the KV codec, the compute dtype), e.g. "linear: no kernel
for Q6G64 weights". At load time the host picks, per op, the backend forced by
`--kernel op=NAME`, else the one forced by `--gemm-backend NAME` where it serves the
op, else the supported backend of highest priority that serves it (registration order
breaks ties), and finally the core's reference (`reference.TorchOps`). Each choice
keeps its reason and the higher-ranked backends it passed over with theirs
(`OpChoice`); `ninfer probe`, `ninfer-serve`'s startup and every bench print them.

The workload reaches `provides(device, *, workload=None)` (and `supports`, and
`create_ops`) by name, and only when the method's signature takes it
(`selection.call_accepting`): a backend written when `provides` took the device alone
keeps working, as a pluggy hook implementation that takes a subset of the spec's
arguments does. A run with int8 activations (`workload.activation_dtype`) needs the ops
to know it at call time: a backend whose `create_ops` takes no `workload` is refused
`linear` for it, with that reason.

A backend that claims every op but whose ops object predates one the contract grew
later (`LATER_OPS`: the Gated DeltaNet ops) is not refused: that op comes from the
reference, and the record (`ComposedOps.choices`, `LoadedModel.kernels`) says so.

The ops object the model holds carries each chosen implementation as a bound method
(or, when one backend serves every op, is that backend's own ops object): nothing is
looked up per call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ninfer_core import conformance
from ninfer_core.errors import UnknownNameError, UnsupportedChoiceError
from ninfer_core.kernels.workload import KernelWorkload
from ninfer_core.plugin_types import KernelOps
from ninfer_core.selection import (
    PointReport,
    accepts_keyword,
    ask_supports,
    call_accepting,
    choose,
    device_name,
)
from ninfer_core.support import Support

if TYPE_CHECKING:
    import torch

    from ninfer_core.device import DeviceInfo
    from ninfer_core.plugin_host import PluginHost

#: Each op a backend can provide, and the `KernelOps` members that come with it.
OPS: dict[str, tuple[str, ...]] = {
    "linear": ("linear", "pack_linear", "packed_nbytes"),
    "attention": ("prepare", "paged_attention"),
    "rms_norm": ("rms_norm",),
    "rope": ("apply_rope",),
    "silu_and_mul": ("silu_and_mul",),
    "gated_delta_rule": ("gated_delta_rule",),
    "causal_conv1d": ("causal_conv1d",),
}
#: Ops the contract grew after backends were written against it (the linear attention
#: of Gated DeltaNet models). A backend that claims every op (`provides` None) but whose
#: ops object lacks one of these still serves the rest; the reference serves that one.
LATER_OPS: tuple[str, ...] = ("gated_delta_rule", "causal_conv1d")
#: Members a partial backend may leave out, and what stands in for them (the
#: `ninfer_core.model.ops.KernelOps` base's defaults: no per-step state, weights kept
#: as loaded, `ninfer plan` packs a probe weight).
_DEFAULTS: dict[str, Any] = {
    "prepare": lambda meta: None,
    "pack_linear": lambda w, *, dtype=None: w,
    "packed_nbytes": None,
}
#: The reference's name (the built-in `torch` backend registers the same ops).
REFERENCE = "torch"
KERNEL_OPTION = "--kernel"


@dataclass(frozen=True, slots=True)
class OpChoice:
    """Which backend serves `op`, and why; `passed_over`: the backends that would have
    won (forced or of higher priority) but refused the op, each with its reason."""

    op: str
    backend: str
    reason: str
    passed_over: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        return f"{self.backend} (reference)" if self.backend == REFERENCE else self.backend

    def describe(self) -> str:
        text = f"{self.op}: {self.label} - {self.reason}"
        if self.passed_over:
            text += "; passed over " + ", ".join(f"{n} ({why})" for n, why in self.passed_over)
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "backend": self.backend,
            "reason": self.reason,
            "passed_over": [{"backend": n, "reason": why} for n, why in self.passed_over],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpChoice:
        """Back from `to_json` (a bench child's or a server's report)."""
        passed = tuple((p["backend"], p["reason"]) for p in data.get("passed_over", ()))
        return cls(data["op"], data["backend"], data["reason"], passed)


def parse_kernel_option(text: str | None) -> dict[str, str]:
    """`linear=NAME,attention=NAME` -> {op: backend}; an unknown op names the known ones."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        op, sep, name = (s.strip() for s in part.partition("="))
        if not sep or not op or not name:
            raise UnknownNameError(
                "kernel op", part, OPS, note=f"{KERNEL_OPTION} takes op=BACKEND[,op=BACKEND]"
            )
        if op not in OPS:
            raise UnknownNameError("kernel op", op, OPS, note=f"in {KERNEL_OPTION} {text}")
        out[op] = name
    return out


def backend_provides(obj: Any, device: DeviceInfo, workload: KernelWorkload) -> dict[str, Support]:
    """What a backend provides for `workload`: {op: Support} (a refused backend refuses
    every op)."""
    support = ask_supports(obj, device, workload=workload)
    if not support.ok:
        return dict.fromkeys(OPS, support)
    if obj.provides is None:  # optional in the KernelBackend contract: every op
        return _activation_check(obj, workload, dict.fromkeys(OPS, support))
    try:
        # `workload` only to a `provides` that takes it: the contract grew it later.
        answer = call_accepting(obj.provides, device, workload=workload)
    except Exception as exc:  # a probe that crashes refuses, it does not crash the host
        return dict.fromkeys(OPS, Support.no(f"provides() raised {type(exc).__name__}: {exc}"))
    if not isinstance(answer, dict):
        return dict.fromkeys(OPS, Support.no(f"provides() returned {answer!r}, not a dict"))
    return _activation_check(
        obj,
        workload,
        {
            op: (
                s if isinstance(s, Support) else Support.no(f"provides() gave {s!r}, not a Support")
            )
            for op, s in answer.items()
            if op in OPS
        },
    )


def _activation_check(
    obj: Any, workload: KernelWorkload, provided: dict[str, Support]
) -> dict[str, Support]:
    """`provided`, with `linear` refused when the run wants activations other than the
    compute dtype (`--activation-dtype int8`) and the backend's `create_ops` takes no
    `workload`: its ops would never learn of it and would run float activations."""
    linear = provided.get("linear")
    if workload.activation_dtype is None or linear is None or not linear.ok:
        return provided
    if accepts_keyword(obj.create_ops, "workload"):
        return provided
    why = (
        f"its create_ops takes no workload, so its linear cannot run "
        f"{workload.activation_dtype} activations"
    )
    return {**provided, "linear": Support.no(why)}


def plan_kernels(
    host: PluginHost,
    device: DeviceInfo,
    gemm_backend: str | None = "auto",
    kernel: str | None = None,
    *,
    workload: KernelWorkload | None = None,
) -> list[OpChoice]:
    """Which backend serves each op on `device` for `workload` (None: nothing known but
    the device), and why; an impossible forced choice (`--gemm-backend`, `--kernel`)
    raises naming the alternatives."""
    workload = workload or KernelWorkload()
    # Validates the name; a backend refusing the whole workload is refused here.
    forced = choose(host, "kernel_backends", device, gemm_backend, workload=workload)
    overrides = parse_kernel_option(kernel)
    entries = host.kernel_backends.entries()
    provided = {e.name: backend_provides(e.obj, device, workload) for e in entries}
    priority = {e.name: e.obj.priority for e in entries}
    ranked = sorted(priority, key=lambda n: -priority[n])  # stable: registration order
    where = _where(device, workload)
    if gemm_backend not in (None, "auto", "none"):
        name = forced.chosen
        if not any(s.ok for s in provided[name].values()):
            raise UnsupportedChoiceError(
                f"--gemm-backend {name}: kernel backend {name!r} provides no op {where}; "
                f"alternatives: {_alternatives(provided, None, name)}"
            )
    else:
        name = None
    choices = []
    for op in OPS:
        if op in overrides:
            want = overrides[op]
            if want not in provided:
                host.kernel_backends.entry(want)  # raises: the known backends
            support = provided[want].get(op)
            if support is None or not support.ok:
                why = support.reason if support is not None else f"it does not provide {op}"
                raise UnsupportedChoiceError(
                    f"{KERNEL_OPTION} {op}={want}: kernel backend {want!r} cannot serve {op} "
                    f"{where}: {why}; alternatives: {_alternatives(provided, op, want)}"
                )
            choices.append(OpChoice(op, want, _why(f"{KERNEL_OPTION} {op}={want}", support)))
            continue
        passed: list[tuple[str, str]] = []
        if name is not None:
            support = provided[name].get(op)
            if support is not None and support.ok:
                choices.append(OpChoice(op, name, _why(f"--gemm-backend {name}", support)))
                continue
            if support is not None:  # it provides the op, but not for this run
                passed.append((name, support.reason))
        for n in ranked:
            support = provided[n].get(op)
            if support is not None and support.ok:
                how = f"highest priority providing it ({priority[n]})"
                choices.append(OpChoice(op, n, _why(how, support), tuple(passed)))
                break
            if support is not None and n != name:  # ranked above the one that serves it
                passed.append((n, support.reason))
        else:
            choices.append(
                OpChoice(op, REFERENCE, "no installed backend provides it", tuple(passed))
            )
    return choices


def _where(device: DeviceInfo, workload: KernelWorkload) -> str:
    """`on the CPU` or `on the CPU for weights fp32, KV fp32, compute fp32`."""
    known = workload != KernelWorkload()
    return f"on {device_name(device)}" + (f" for {workload.describe()}" if known else "")


def check_kv_codec(
    host: PluginHost,
    device: DeviceInfo,
    choices: list[OpChoice],
    workload: KernelWorkload,
    kv_codec: str,
) -> None:
    """Raise when the backend chosen for attention at load (for `workload.kv_codec`)
    refuses `kv_codec`, the codec a runtime is now built with: ops are composed once,
    before the weights load, so the attention kernel cannot change afterwards."""
    attention = next((c for c in choices if c.op == "attention"), None)
    if kv_codec == workload.kv_codec or attention is None:
        return
    if attention.backend not in host.kernel_backends:
        return  # the core's reference reads every codec's pages
    obj = host.kernel_backends.get(attention.backend)
    support = backend_provides(obj, device, replace(workload, kv_codec=kv_codec)).get("attention")
    if support is None or not support.ok:
        why = support.reason if support is not None else "it does not provide attention"
        raise UnsupportedChoiceError(
            f"--kv-dtype {kv_codec}: attention was composed from kernel backend "
            f"{attention.backend!r} for KV codec {workload.kv_codec!r}, and it cannot read "
            f"{kv_codec!r}: {why}; load the model with --kv-dtype {kv_codec} (or "
            f"{KERNEL_OPTION} attention={REFERENCE})"
        )


def _why(how: str, support: Support) -> str:
    return f"{how}: {support.reason}" if support.reason else how


def _alternatives(provided: dict[str, dict[str, Support]], op: str | None, but: str) -> str:
    names = [
        n
        for n, ops in provided.items()
        if n != but and any(s.ok for o, s in ops.items() if op is None or o == op)
    ]
    return ", ".join(names) if names else "none on this device"


def _member_problems(ops: Any, members: tuple[str, ...]) -> list[str]:
    shapes = {m.name: m for m in conformance.members(KernelOps)}
    out = []
    for member in members:
        value = getattr(ops, member, None)
        if value is None:
            if member not in _DEFAULTS:
                out.append(f"no {member}")
            continue
        problem = conformance.call_problem(member, value, shapes[member].signature)
        if problem:
            out.append(problem)
    return out


def compose_ops(
    host: PluginHost,
    device: DeviceInfo | torch.device | str,
    choices: list[OpChoice],
    *,
    workload: KernelWorkload | None = None,
) -> KernelOps:
    """The ops object the model holds: each op's members from its chosen backend, each
    backend's ops made for `workload` (the one `plan_kernels` chose them for)."""
    made: dict[str, Any] = {}
    for backend in dict.fromkeys(c.backend for c in choices):
        made[backend] = create_ops(host, device, backend, workload)
    choices = _reference_for_later_ops(choices, made)
    if REFERENCE in {c.backend for c in choices} and REFERENCE not in made:
        made[REFERENCE] = create_ops(host, device, REFERENCE, workload)
    made = {b: made[b] for b in dict.fromkeys(c.backend for c in choices)}
    if len(made) == 1:
        [(backend, ops)] = made.items()
        conformance.check(ops, KernelOps, f"the ops of kernel backend {backend!r}")
        return ops
    for c in choices:
        found = _member_problems(made[c.backend], OPS[c.op])
        if found:
            raise conformance.ContractError(
                f"the ops of kernel backend {c.backend!r} ({made[c.backend]!r}) cannot serve "
                f"{c.op}: {'; '.join(found)}"
            )
    composed = ComposedOps(choices, made)
    conformance.check(composed, KernelOps, "the composed kernel ops")
    return composed


def create_ops(
    host: PluginHost, device: Any, backend: str, workload: KernelWorkload | None = None
) -> Any:
    """The ops object of `backend`, or the core's reference when no `torch` backend is
    registered. `workload` goes, by name, to a `create_ops` that takes it (ops whose
    kernels depend on the run, e.g. `--activation-dtype int8`, read it at call time)."""
    from ninfer_core.kernels.reference import TorchOps

    if backend in host.kernel_backends:
        make = host.kernel_backends.get(backend).create_ops
        return call_accepting(make, device, workload=workload)
    return TorchOps(getattr(device, "torch_device", device), workload)


def _reference_for_later_ops(choices: list[OpChoice], made: dict[str, Any]) -> list[OpChoice]:
    """`choices`, with each of `LATER_OPS` whose chosen ops object lacks its members moved
    to the reference, saying why (a backend written before the op keeps serving the
    rest); `ComposedOps.choices` and `LoadedModel.kernels` record the result."""
    out = []
    for c in choices:
        missing = [m for m in OPS[c.op] if getattr(made[c.backend], m, None) is None]
        if c.op in LATER_OPS and c.backend != REFERENCE and missing:
            why = f"its ops have no {', '.join(missing)}"
            passed = (*c.passed_over, (c.backend, why))
            c = OpChoice(c.op, REFERENCE, f"{c.backend} {why}", passed)
        out.append(c)
    return out


def composed_choices(ops: Any, planned: list[OpChoice]) -> list[OpChoice]:
    """What serves each op in `ops` (a `compose_ops` result): `planned`, unless
    composing moved an op to the reference (`LATER_OPS`)."""
    return list(ops.choices) if isinstance(ops, ComposedOps) else planned


class ComposedOps:
    """Ops from several backends: each member is the chosen backend's bound method,
    set once here, so a call costs what calling that backend's ops directly does."""

    def __init__(self, choices: list[OpChoice], made: dict[str, Any]) -> None:
        self.choices = list(choices)
        self.name = ",".join(f"{c.op}={c.backend}" for c in choices)
        by_op = {c.op: made[c.backend] for c in choices}
        self.device = by_op["linear"].device
        for op, members in OPS.items():
            for member in members:
                value = getattr(by_op[op], member, None)
                setattr(self, member, _DEFAULTS[member] if value is None else value)

    def __repr__(self) -> str:
        return f"ComposedOps({self.name})"


def backend_summary(choices: list[OpChoice]) -> str:
    """One name when one backend serves every op, else `op=name,...`."""
    names = {c.backend for c in choices}
    if len(names) == 1:
        return next(iter(names))
    return ",".join(f"{c.op}={c.backend}" for c in choices)


def kernel_line(choices: list[OpChoice]) -> str:
    """The per-op choice in one line, as every bench prints it in its header:
    `kernel ops: torch (reference) for every op` or `kernel ops: linear=mine, ...`."""
    if len({c.backend for c in choices}) == 1:
        return f"kernel ops: {choices[0].label} for every op"
    return "kernel ops: " + ", ".join(f"{c.op}={c.label}" for c in choices)


def kernel_report(report: PointReport, choices: list[OpChoice]) -> PointReport:
    """The kernel backends' selection report made to say what the per-op plan did: the
    summary names one backend only when it serves every op (else `op=name,...`), and a
    candidate is `chosen` when it serves at least one op, which its reason lists."""
    served: dict[str, list[str]] = {}
    for c in choices:
        served.setdefault(c.backend, []).append(c.op)
    candidates = []
    for c in report.candidates:
        if c.status == "refused":
            candidates.append(c)
            continue
        ops = served.get(c.name)
        if ops is None:
            candidates.append(replace(c, status="not chosen"))
            continue
        what = "every op" if len(ops) == len(OPS) else ", ".join(ops)
        reason = f"{c.reason}; serves {what}" if c.reason else f"serves {what}"
        candidates.append(replace(c, status="chosen", reason=reason))
    return replace(report, chosen=backend_summary(choices), candidates=candidates)
