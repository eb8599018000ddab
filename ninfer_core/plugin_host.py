"""The plugin host: one pluggy manager and the registries built from it.

A host is created per engine or app (never a module global), so a test can add a
plugin for itself alone. Entry points of group `ninfer` are loaded one by one. A
plugin that fails to import, implements a hook no spec declares (a typo), or raises
from a hook is *broken*: recorded with its name and the reason, unregistered, and the
host carries on without it. An object that does not keep its kind's contract
(`ninfer_core.plugin_types`) is *refused*: recorded, not registered. A command fails
only when its configuration names something that is missing, and then the message
lists what failed to load.

Hooks are called through pluggy with keyword arguments, one implementation at a
time, so every object keeps the plugin and distribution it came from and one
plugin's exception is that plugin's failure alone.

Environment:
  NINFER_PLUGINS        comma-separated allowlist of entry-point names to load from
                        third-party distributions (unset: all; built-ins always load)
  NINFER_TRACE_PLUGINS  "1": pluggy's tracing of every hook call and its result, to stderr
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy

from ninfer_core import ENTRY_POINT_GROUP, PROJECT_NAME, conformance, hookspecs
from ninfer_core.errors import DuplicateNameError, UnknownNameError
from ninfer_core.hookspecs import EXTENSION_POINTS, ExtensionPoint
from ninfer_core.plugin_types import (
    ArtifactReader,
    DraftStrategy,
    Frontend,
    KernelBackend,
    KVCodec,
    ModelFamily,
)
from ninfer_core.registry import Registry

log = logging.getLogger(__name__)

#: The distribution whose entry points are the built-in plugins.
BUILTIN_DISTRIBUTION = "ninfer"


@dataclass(frozen=True, slots=True)
class PluginFailure:
    """A plugin that could not be used (broken), or one object of it that was refused."""

    plugin: str
    distribution: str
    reason: str
    #: "broken": the whole plugin is left out; "refused": one object it returned is.
    status: Literal["broken", "refused"] = "broken"
    #: For a refused object, the extension point it was returned for.
    point: str = ""

    def describe(self) -> str:
        return f"plugin {self.plugin!r} ({self.distribution}) {self.status}: {self.reason}"


@dataclass(frozen=True, slots=True)
class LoadedPlugin:
    name: str
    distribution: str
    version: str
    module: str


@dataclass
class PluginHost:
    """A plugin manager plus one registry per extension point."""

    pm: pluggy.PluginManager
    plugins: list[LoadedPlugin] = field(default_factory=list)
    failures: list[PluginFailure] = field(default_factory=list)
    registries: dict[str, Registry[Any]] = field(default_factory=dict)
    trace: bool = False

    def registry(self, point: str) -> Registry[Any]:
        """The registry of any extension point in `hookspecs.EXTENSION_POINTS`."""
        return self.registries[point]

    # Typed accessors for the registries the runtime uses most.
    @property
    def artifact_readers(self) -> Registry[ArtifactReader]:
        return self.registries["artifact_readers"]

    @property
    def model_families(self) -> Registry[ModelFamily]:
        return self.registries["model_families"]

    @property
    def kv_codecs(self) -> Registry[KVCodec]:
        return self.registries["kv_codecs"]

    @property
    def kernel_backends(self) -> Registry[KernelBackend]:
        return self.registries["kernel_backends"]

    @property
    def draft_strategies(self) -> Registry[DraftStrategy]:
        return self.registries["draft_strategies"]

    @property
    def frontends(self) -> Registry[Frontend]:
        return self.registries["frontends"]

    def family_for(self, architecture: str) -> ModelFamily:
        """The model family that builds `architecture` (a `config.json` name)."""
        for family in self.model_families:
            if architecture in family.architectures:
                return family
        known = [a for f in self.model_families for a in f.architectures]
        raise UnknownNameError(
            "architecture", architecture, known, note=self.model_families.unavailable_note()
        )

    def broken(self) -> list[PluginFailure]:
        """Plugins left out whole (they may have provided anything)."""
        return [f for f in self.failures if f.status == "broken"]


def _allowlist_from_env() -> set[str] | None:
    value = os.environ.get("NINFER_PLUGINS")
    if value is None:
        return None
    return {n.strip() for n in value.split(",") if n.strip()}


def _trace_writer(message: str) -> None:
    sys.stderr.write(f"[ninfer plugins] {message}")


def create_host(
    *,
    load_entry_points: bool = True,
    allowlist: Iterable[str] | None = None,
    trace: bool | None = None,
    extra_plugins: Sequence[tuple[str, object]] = (),
    hook_arguments: Mapping[str, object] | None = None,
    warn: bool = True,
) -> PluginHost:
    """Build a fresh host: load plugins, check them, fold their objects into registries.

    `extra_plugins` are (name, module-or-object) pairs registered after the entry
    points, the way a test or an embedding application adds its own plugin.
    `hook_arguments` are passed by keyword to every `register_*` hook; an
    implementation takes the subset it names (the built-in specs take none today).
    `warn` logs a warning per failure (`ninfer plugins` and `probe` list them instead).
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    if trace is None:
        trace = os.environ.get("NINFER_TRACE_PLUGINS", "") not in ("", "0")
    if trace:
        pm.trace.root.setwriter(_trace_writer)
        pm.enable_tracing()
    allowed = set(allowlist) if allowlist is not None else _allowlist_from_env()
    host = PluginHost(pm=pm, trace=trace)
    if load_entry_points:
        _load_entry_points(host, allowed)
    for name, plugin in extra_plugins:
        _register(host, plugin, name, "(registered in process)", "", repr(plugin))
    _drop_unmatched_hooks(host)
    _build_registries(host, dict(hook_arguments or {}))
    if warn:
        for failure in host.failures:
            log.warning("%s", failure.describe())
    return host


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "?"


def _register(
    host: PluginHost, plugin: object, name: str, dist: str, version: str, module: str
) -> None:
    try:
        host.pm.register(plugin, name=name)
    except Exception as exc:  # e.g. a hookimpl taking an argument its spec lacks
        reason = f"{type(exc).__name__}: {exc}"
        host.failures.append(PluginFailure(name, dist, reason))
        return
    host.plugins.append(LoadedPlugin(name, dist, version, module))


def _load_entry_points(host: PluginHost, allowed: set[str] | None) -> None:
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    # Built-ins first, then third-party plugins, each by entry-point name.
    for ep in sorted(eps, key=lambda e: (_dist_name(e) != BUILTIN_DISTRIBUTION, e.name)):
        dist = _dist_name(ep)
        version = ep.dist.version if ep.dist is not None else ""
        if allowed is not None and dist != BUILTIN_DISTRIBUTION and ep.name not in allowed:
            log.info("plugin %s (%s) skipped: not in NINFER_PLUGINS", ep.name, dist)
            continue
        if host.pm.has_plugin(ep.name):
            host.failures.append(PluginFailure(ep.name, dist, "a plugin of this name is loaded"))
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not take the host down
            reason = f"failed to load {ep.value}: {type(exc).__name__}: {exc}"
            host.failures.append(PluginFailure(ep.name, dist, reason))
            continue
        log.debug("plugin %s -> %s (%s %s)", ep.name, ep.value, dist, version)
        _register(host, plugin, ep.name, dist, version, ep.value)


def _drop_unmatched_hooks(host: PluginHost) -> None:
    """pluggy's `check_pending`, one plugin at a time: a plugin with a hook no spec
    declares (`register_kv_codec`, a typo) is unregistered and reported as broken."""
    while True:
        try:
            host.pm.check_pending()
            return
        except pluggy.PluginValidationError as exc:
            name = host.pm.get_name(exc.plugin) or repr(exc.plugin)
            host.pm.unregister(exc.plugin)
            loaded = next((p for p in host.plugins if p.name == name), None)
            if loaded is not None:
                host.plugins.remove(loaded)
            dist = loaded.distribution if loaded else "?"
            host.failures.append(PluginFailure(name, dist, str(exc)))


def _distribution_of(host: PluginHost, plugin_name: str) -> str:
    for p in host.plugins:
        if p.name == plugin_name:
            return p.distribution
    return "?"


def _call_one(host: PluginHost, point: ExtensionPoint, impl: Any, kwargs: dict) -> list[Any]:
    """Call `point`'s hook for one implementation only, through pluggy's hook execution.

    This is what `pm.hook.<name>(**kwargs)` runs, narrowed to one implementation:
    pluggy maps the keyword arguments onto the ones the implementation names and its
    tracing sees the call. (`pm.subset_hook_caller` would do the same but puts plugins
    in a set, and a plugin object need not be hashable.)
    """
    if host.trace:
        host.pm.trace.root.get("ninfer")(f"{point.hook} from plugin {impl.plugin_name!r}")
    results = host.pm._hookexec(point.hook, [impl], kwargs, False)
    return [obj for objects in results for obj in objects or ()]


def _build_registries(host: PluginHost, kwargs: dict[str, object]) -> None:
    """Call every `register_*` implementation once, check each object, fold by name."""
    for point in EXTENSION_POINTS.values():
        registry: Registry[Any] = Registry(point.kind)
        host.registries[point.point] = registry
        for impl in getattr(host.pm.hook, point.hook).get_hookimpls():  # registration order
            plugin_name = impl.plugin_name
            dist = _distribution_of(host, plugin_name)
            try:
                objects = _call_one(host, point, impl, kwargs)
            except Exception as exc:
                reason = f"{point.hook} raised {type(exc).__name__}: {exc}"
                host.failures.append(PluginFailure(plugin_name, dist, reason))
                continue
            for obj in objects:
                _add(host, registry, point, obj, plugin_name, dist)
    _check_architectures(host)
    notes = [f.describe() for f in host.broken()]
    for point, registry in host.registries.items():
        refused = [f.describe() for f in host.failures if f.point == point]
        registry.unavailable = [*notes, *refused]


def _add(
    host: PluginHost,
    registry: Registry[Any],
    point: ExtensionPoint,
    obj: object,
    plugin: str,
    dist: str,
) -> None:
    found = conformance.problems(obj, point.protocol)
    if found:
        reason = (
            f"{point.hook} returned a malformed {point.kind} {obj!r}: "
            f"{'; '.join(found)} (contract: ninfer_core.plugin_types.{point.protocol.__name__})"
        )
        host.failures.append(PluginFailure(plugin, dist, reason, "refused", point.point))
        return
    try:
        registry.add(obj.name, obj, plugin=plugin, distribution=dist)  # type: ignore[attr-defined]
    except DuplicateNameError as exc:
        host.failures.append(PluginFailure(plugin, dist, str(exc), "refused", point.point))


def _check_architectures(host: PluginHost) -> None:
    """Two families claiming one architecture: the later one is refused, naming both."""
    owner: dict[str, str] = {}
    registry = host.model_families
    for entry in registry.entries():
        clash = [a for a in entry.obj.architectures if a in owner]
        if clash:
            reason = (
                f"model family {entry.name!r} claims architecture {clash[0]!r}, "
                f"which model family {owner[clash[0]]!r} builds"
            )
            host.failures.append(
                PluginFailure(entry.plugin, entry.distribution, reason, "refused", "model_families")
            )
            registry.remove(entry.name)
            continue
        owner.update(dict.fromkeys(entry.obj.architectures, entry.name))
