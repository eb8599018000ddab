"""The plugin host: one pluggy manager and the registries built from it.

A host is created per engine or app (never a module global), so a test can add a
plugin for itself alone. Entry points of group `ninfer` are loaded one by one; a
plugin that fails to import or returns malformed objects is recorded with its
name and the reason, and the host carries on without it.

Environment:
  NINFER_PLUGINS        comma-separated allowlist of entry-point names to load from
                        third-party distributions (unset: all; built-ins always load)
  NINFER_TRACE_PLUGINS  "1" prints every hook call and what it returned to stderr
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from ninfer_core import ENTRY_POINT_GROUP, PROJECT_NAME, hookspecs
from ninfer_core.errors import DuplicateNameError, NInferError
from ninfer_core.registry import Registry

log = logging.getLogger(__name__)

#: The distribution whose entry points are the built-in plugins.
BUILTIN_DISTRIBUTION = "ninfer"

#: Extension point → (hook name, human name of one object). Order is the probe's order.
EXTENSION_POINTS: dict[str, tuple[str, str]] = {
    "artifact_readers": ("register_artifact_readers", "artifact reader"),
    "model_families": ("register_model_families", "model family"),
    "kv_codecs": ("register_kv_codecs", "KV codec"),
    "kernel_backends": ("register_kernel_backends", "kernel backend"),
    "draft_strategies": ("register_draft_strategies", "draft strategy"),
    "frontends": ("register_frontends", "API frontend"),
}


@dataclass(frozen=True, slots=True)
class PluginFailure:
    """A plugin that could not be used, and why."""

    plugin: str
    distribution: str
    reason: str


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

    # Typed accessors for the registries the runtime uses most.
    @property
    def artifact_readers(self) -> Registry[Any]:
        return self.registries["artifact_readers"]

    @property
    def model_families(self) -> Registry[Any]:
        return self.registries["model_families"]

    @property
    def kv_codecs(self) -> Registry[Any]:
        return self.registries["kv_codecs"]

    @property
    def kernel_backends(self) -> Registry[Any]:
        return self.registries["kernel_backends"]

    @property
    def draft_strategies(self) -> Registry[Any]:
        return self.registries["draft_strategies"]

    @property
    def frontends(self) -> Registry[Any]:
        return self.registries["frontends"]

    def family_for(self, architecture: str) -> Any:
        """The model family that builds `architecture` (a `config.json` name)."""
        from ninfer_core.errors import UnknownNameError

        for family in self.model_families:
            if architecture in family.architectures:
                return family
        known = [a for f in self.model_families for a in f.architectures]
        raise UnknownNameError("architecture", architecture, known)


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
) -> PluginHost:
    """Build a fresh host: load plugins, check them, fold their objects into registries.

    `extra_plugins` are (name, module-or-object) pairs registered after the entry
    points, the way a test or an embedding application adds its own plugin.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    if trace is None:
        trace = os.environ.get("NINFER_TRACE_PLUGINS", "") not in ("", "0")
    allowed = set(allowlist) if allowlist is not None else _allowlist_from_env()
    host = PluginHost(pm=pm, trace=trace)
    if load_entry_points:
        _load_entry_points(host, allowed)
    for name, plugin in extra_plugins:
        pm.register(plugin, name=name)
        host.plugins.append(LoadedPlugin(name, "(registered in process)", "", repr(plugin)))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = host.pm.get_name(exc.plugin) or repr(exc.plugin)
        raise NInferError(f"plugin {name!r}: {exc}") from None
    if trace:
        pm.trace.root.setwriter(_trace_writer)
        pm.enable_tracing()
    _build_registries(host)
    return host


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "?"


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
            host.pm.register(plugin, name=ep.name)
        except Exception as exc:  # a broken plugin must not take the host down
            reason = f"failed to load {ep.value}: {type(exc).__name__}: {exc}"
            log.warning("plugin %s (%s) %s", ep.name, dist, reason)
            host.failures.append(PluginFailure(ep.name, dist, reason))
            continue
        log.debug("plugin %s -> %s (%s %s)", ep.name, ep.value, dist, version)
        host.plugins.append(LoadedPlugin(ep.name, dist, version, ep.value))


def _distribution_of(host: PluginHost, plugin_name: str) -> str:
    for p in host.plugins:
        if p.name == plugin_name:
            return p.distribution
    return "?"


def _build_registries(host: PluginHost) -> None:
    """Call every `register_*` implementation once and fold the results by name."""
    for point, (hook_name, kind) in EXTENSION_POINTS.items():
        registry: Registry[Any] = Registry(kind)
        host.registries[point] = registry
        hook = getattr(host.pm.hook, hook_name)
        # Called implementation by implementation so each object keeps its source.
        for impl in hook.get_hookimpls():  # registration order
            plugin_name = impl.plugin_name
            dist = _distribution_of(host, plugin_name)
            try:
                objects = impl.function() or []
            except Exception as exc:
                reason = f"{hook_name} raised {type(exc).__name__}: {exc}"
                host.failures.append(PluginFailure(plugin_name, dist, reason))
                continue
            if host.trace:
                names = [getattr(o, "name", repr(o)) for o in objects]
                _trace_writer(f"{hook_name} [{plugin_name}] -> {names}\n")
            for obj in objects:
                problem = _malformed(obj)
                if problem:
                    reason = f"{hook_name} returned a malformed {kind}: {problem}"
                    host.failures.append(PluginFailure(plugin_name, dist, reason))
                    continue
                try:
                    registry.add(obj.name, obj, plugin=plugin_name, distribution=dist)
                except DuplicateNameError as exc:
                    host.failures.append(PluginFailure(plugin_name, dist, str(exc)))
    _check_architectures(host)


def _malformed(obj: object) -> str:
    for attr in ("name", "description"):
        if not isinstance(getattr(obj, attr, None), str) or not getattr(obj, attr):
            return f"{obj!r} has no {attr} string"
    if not callable(getattr(obj, "supports", None)):
        return f"{obj!r} has no supports(device)"
    return ""


def _check_architectures(host: PluginHost) -> None:
    owner: dict[str, str] = {}
    for entry in host.model_families.entries():
        for arch in getattr(entry.obj, "architectures", ()):
            if arch in owner:
                raise DuplicateNameError(
                    f"architecture {arch!r} is claimed by model families {owner[arch]!r} "
                    f"and {entry.name!r}"
                )
            owner[arch] = entry.name
