"""Which plugin serves each extension point on a device, and why.

Two kinds of extension point: *exclusive* ones (kernel backend, KV codec, draft
strategy) where one candidate is chosen, and *pooled* ones (artifact readers,
model families, frontends) where every supported candidate stays available.
A configured choice that the device refuses fails here, at startup, with the
reason and the names of the alternatives.

Kernel backends are also asked about the run (`KernelWorkload`: weight formats, KV
codec, compute dtype). Like a hook that grew an argument in pluggy, a method is passed
such a later argument by name only when its signature takes it (`call_accepting`), so
a plugin written before the argument existed keeps working.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from ninfer_core.device import DeviceInfo
from ninfer_core.errors import UnsupportedChoiceError
from ninfer_core.hookspecs import EXTENSION_POINTS, exclusive_points
from ninfer_core.plugin_host import PluginHost
from ninfer_core.support import Support

if TYPE_CHECKING:
    from ninfer_core.kernels.workload import KernelWorkload

Status = Literal["chosen", "available", "refused", "not chosen"]

#: The exclusive points and the option that picks each (from `hookspecs.EXTENSION_POINTS`).
OPTION_OF = {p.point: p.option for p in exclusive_points()}
EXCLUSIVE = tuple(OPTION_OF)


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    distribution: str
    description: str
    status: Status
    reason: str


@dataclass(frozen=True, slots=True)
class PointReport:
    point: str
    kind: str
    chosen: str | None
    candidates: list[Candidate]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` takes an argument `name` by keyword (a parameter so named, or
    `**kwargs`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing extra
        return False
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD or (p.name == name and p.kind in keyword)
        for p in params
    )


def call_accepting(fn: Callable[..., Any], *args: Any, **optional: Any) -> Any:
    """`fn(*args, **optional)`, each optional argument passed only if `fn` takes it: how
    a contract's method grows an argument without breaking the plugins written before."""
    return fn(*args, **{k: v for k, v in optional.items() if accepts_keyword(fn, k)})


def ask_supports(
    obj: Any, device: DeviceInfo, *, workload: KernelWorkload | None = None
) -> Support:
    """`obj.supports(device)`, with a crashing or malformed probe read as a refusal;
    `workload` goes to a `supports` that takes it (kernel backends, see the module doc)."""
    try:
        if workload is None:
            support = obj.supports(device)
        else:
            support = call_accepting(obj.supports, device, workload=workload)
    except Exception as exc:  # a probe that crashes refuses, it does not crash the host
        return Support.no(f"supports() raised {type(exc).__name__}: {exc}")
    if not isinstance(support, Support):
        return Support.no(f"supports() returned {support!r}, not a Support")
    return support


def default_kv_codec(device: DeviceInfo) -> str:
    """KV dtype for `auto`: the compute dtype the device runs models in."""
    if device.cuda is not None:
        return "fp16"
    return "bf16"


def choose(
    host: PluginHost,
    point: str,
    device: DeviceInfo,
    requested: str | None,
    *,
    workload: KernelWorkload | None = None,
) -> PointReport:
    """Report every candidate of `point`; for an exclusive point, pick one.

    `requested` is the configured name, `"auto"` (best supported) or None (nothing
    wanted: e.g. no `--spec`). A requested name that is unknown or refused raises.
    `workload`: what will run, for the kernel backends' `supports`.
    """
    registry = host.registries[point]
    kind = EXTENSION_POINTS[point].kind
    checks = {
        e.name: (ask_supports(e.obj, device, workload=workload), e) for e in registry.entries()
    }
    supported = [n for n, (s, _) in checks.items() if s.ok]
    chosen: str | None = None
    if point in EXCLUSIVE and requested not in (None, "none"):
        if requested == "auto":
            chosen = _auto_pick(point, supported, checks, device)
        else:
            if requested not in checks:
                registry.entry(requested)  # raises: the known names, and what failed to load
            support = checks[requested][0]
            if not support.ok:
                others = [n for n in supported if n != requested]
                alternatives = ", ".join(others) if others else "none on this device"
                raise UnsupportedChoiceError(
                    f"{OPTION_OF[point]} {requested}: {kind} {requested!r} cannot run on "
                    f"{device_name(device)}: {support.reason}; alternatives: {alternatives}"
                )
            chosen = requested
    candidates = []
    for name, (support, entry) in checks.items():
        if not support.ok:
            status: Status = "refused"
        elif point not in EXCLUSIVE:
            status = "available"
        else:
            status = "chosen" if name == chosen else "not chosen"
        candidates.append(
            Candidate(name, entry.distribution, entry.obj.description, status, support.reason)
        )
    return PointReport(point, kind, chosen, candidates)


def _auto_pick(point: str, supported: list[str], checks: dict, device: DeviceInfo) -> str | None:
    if not supported:
        return None
    if point == "kv_codecs":
        preferred = default_kv_codec(device)
        return preferred if preferred in supported else supported[0]
    if point == "kernel_backends":
        # Highest priority wins; registration order breaks ties.
        return max(supported, key=lambda n: checks[n][1].obj.priority)
    return supported[0]  # registration order


def device_name(device: DeviceInfo) -> str:
    """The device as error messages name it."""
    if device.cuda is not None:
        return f"{device.cuda.name} (SM{device.cuda.sm_version})"
    return "the CPU"


def probe(
    host: PluginHost,
    device: DeviceInfo,
    *,
    workload: KernelWorkload | None = None,
    **requested: str | None,
) -> list[PointReport]:
    """The whole selection, in the order `ninfer probe` prints it.

    `requested` maps each exclusive point's option, as an argparse destination
    (`gemm_backend`, `kv_dtype`, `spec`), to the configured name; an absent one gets
    its point's `default`. `workload`: what will run, for the kernel backends.
    """
    dests = {p.dest for p in exclusive_points()}
    unknown = set(requested) - dests
    if unknown:
        raise TypeError(f"probe() got unknown choices {sorted(unknown)}; known: {sorted(dests)}")
    return [
        choose(
            host,
            name,
            device,
            requested.get(p.dest or "", p.default),
            workload=workload if name == "kernel_backends" else None,
        )
        for name, p in EXTENSION_POINTS.items()
    ]
