"""`ninfer plugins`: every plugin, where it came from and what it registers."""

from __future__ import annotations

import argparse
import json
import sys

from ninfer_core.plugin_host import create_host


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="list every plugin with the distribution it came from")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    host = create_host(warn=False)  # failures are listed below
    provides: dict[str, list[str]] = {p.name: [] for p in host.plugins}
    for registry in host.registries.values():
        for entry in registry.entries():
            provides.setdefault(entry.plugin, []).append(f"{registry.kind} {entry.name}")
    rows = [
        {
            "name": p.name,
            "distribution": p.distribution,
            "version": p.version,
            "module": p.module,
            "provides": provides.get(p.name, []),
        }
        for p in host.plugins
    ]
    # "broken": the plugin is left out whole; "refused": one object it returned is.
    failed = [
        {"name": f.plugin, "distribution": f.distribution, "status": f.status, "reason": f.reason}
        for f in host.failures
    ]
    if ns.json:
        json.dump({"plugins": rows, "failures": failed}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for r in rows:
        print(f"{r['name']:<18} {r['distribution']} {r['version']}  ({r['module']})")
        for item in r["provides"]:
            print(f"    {item}")
    for f in failed:
        print(f"{f['name']:<18} {f['distribution']}  {f['status'].upper()}: {f['reason']}")
    return 0
