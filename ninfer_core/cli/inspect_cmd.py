"""`ninfer inspect FILE.ninfer [--verify]`: what a container holds, and whether it is sound.

Reads the header only (no weights are mapped) unless `--verify`, which hashes every
object of every component against the checksum its record carries.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ninfer_core.artifact.layout import Header
from ninfer_core.quant.formats import FORMATS
from ninfer_core.quant.ggml import GGML_FORMATS, K_FORMATS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a .ninfer file: version, identity, components, tensors, resources, totals "
        "(a GGUF file or model folder: architecture, tensors, formats, counts)",
    )
    p.add_argument("file", metavar="FILE.ninfer")
    p.add_argument("--verify", action="store_true", help="check every object's sha256")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def _numel(shape: tuple[int, ...] | None) -> int:
    n = 1
    for d in shape or ():
        n *= d
    return n


def _format_description(name: str) -> str:
    """`Q4G32M` -> "4-bit codes, fp16 scale and min per 32 (ggml Q4_1)"; dense: its dtype."""
    fmt = FORMATS.get(name)
    if fmt is None:  # the header check refuses unknown formats; never reached
        return ""
    if not fmt.quantized:
        return f"dense {name}"
    per_group = "fp16 scale and min" if fmt.mins else "fp16 scale"
    ggml = [t for t, spec in (*GGML_FORMATS.items(), *K_FORMATS.items()) if spec[0] == name]
    also = f" (ggml {ggml[0]})" if ggml else ""
    codes = "indices into a code book" if fmt.book is not None else "codes"
    return f"{fmt.bits}-bit {codes}, {per_group} per {fmt.group}{also}"


def describe(path: Path, header: Header) -> dict[str, Any]:
    """The header as plain data, with per-component and overall totals."""
    tensors = [o for o in header.objects if o.kind == "tensor"]
    resources = [o for o in header.objects if o.kind == "resource"]
    files = [path] + [path.with_name(f"{path.name}.{v.name}") for v in header.volumes]
    weights = sum(_numel(o.shape) for o in tensors)
    tensor_bytes = sum(o.nbytes for o in tensors)
    by_format: dict[str, list[int]] = {}  # format -> [tensors, weights, bytes]
    for o in tensors:
        row = by_format.setdefault(o.format or "", [0, 0, 0])
        row[0] += 1
        row[1] += _numel(o.shape)
        row[2] += o.nbytes
    by_component: dict[str, list[int]] = {}
    for o in tensors:
        row = by_component.setdefault(o.component or "text", [0, 0, 0])
        row[0] += 1
        row[1] += _numel(o.shape)
        row[2] += o.nbytes
    return {
        "file": str(path),
        "version": header.version,
        "artifact_id": header.artifact_id.hex() if header.artifact_id else None,
        "identity": header.identity,
        "recipe": header.recipe,
        "components": {
            name: {
                "description": desc,
                "tensors": by_component.get(name, [0, 0, 0])[0],
                "bytes": by_component.get(name, [0, 0, 0])[2],
            }
            for name, desc in header.components.items()
        },
        "volumes": [{"file": f.name, "bytes": f.stat().st_size} for f in files if f.exists()],
        "tensors": [
            {
                "name": o.name,
                "format": o.format,
                "shape": list(o.shape or ()),
                "bytes": o.nbytes,
                "component": o.component or "text",
                "volume": o.volume,
            }
            for o in tensors
        ],
        "formats": {
            name: {
                "description": _format_description(name),
                "tensors": n,
                "weights": numel,
                "bytes": nbytes,
                "bits_per_weight": round(8 * nbytes / numel, 4) if numel else 0.0,
            }
            for name, (n, numel, nbytes) in sorted(by_format.items())
        },
        "resources": [{"name": o.name, "bytes": o.nbytes} for o in resources],
        "totals": {
            "tensors": len(tensors),
            "weights": weights,
            "tensor_bytes": tensor_bytes,
            "bits_per_weight": round(8 * tensor_bytes / weights, 4) if weights else 0.0,
            "resource_bytes": sum(o.nbytes for o in resources),
            "file_bytes": sum(f.stat().st_size for f in files if f.exists()),
        },
    }


def render(info: dict[str, Any]) -> str:
    """The description as the table people read."""
    out = [f"{info['file']}: .ninfer container v{info['version']}"]
    if info["artifact_id"]:
        out.append(f"artifact id  {info['artifact_id']}")
    if info["identity"]:
        ident = info["identity"]
        out.append(f"identity     model_id={ident['model_id']}  weights_id={ident['weights_id']}")
    if info["recipe"]:
        out.append(f"recipe       {info['recipe'].get('name', json.dumps(info['recipe']))}")
    comps = ", ".join(
        f"{n} ({c['tensors']} tensors, {c['bytes']:,} bytes)" for n, c in info["components"].items()
    )
    out.append(f"components   {comps}")
    vols = ", ".join(f"{v['file']} ({v['bytes']:,} bytes)" for v in info["volumes"])
    out.append(f"volumes      {vols}")
    rows = info["tensors"]
    width = max([len("tensor")] + [len(t["name"]) for t in rows])
    out += ["", f"{'tensor':<{width}}  {'format':<6}  {'shape':<16}  {'bytes':>12}  component"]
    for t in rows:
        shape = "x".join(str(d) for d in t["shape"]) or "scalar"
        out.append(
            f"{t['name']:<{width}}  {t['format']:<6}  {shape:<16}  {t['bytes']:>12,}  "
            f"{t['component']}"
        )
    out += ["", f"{'resource':<{width}}  {'bytes':>12}"]
    out += [f"{r['name']:<{width}}  {r['bytes']:>12,}" for r in info["resources"]]
    out += ["", f"{'format':<8} {'tensors':>8} {'weights':>14} {'bytes':>14} {'bits/weight':>12}"]
    for name, f in info["formats"].items():
        out.append(
            f"{name:<8} {f['tensors']:>8} {f['weights']:>14,} {f['bytes']:>14,} "
            f"{f['bits_per_weight']:>12.2f}  {f['description']}"
        )
    tot = info["totals"]
    out += [
        "",
        f"totals       {tot['tensors']} tensors, {tot['weights']:,} weights, "
        f"{tot['tensor_bytes']:,} tensor bytes ({tot['bits_per_weight']:.2f} bits/weight), "
        f"{tot['resource_bytes']:,} resource bytes, {tot['file_bytes']:,} bytes on disk",
    ]
    return "\n".join(out)


def _is_container(path: Path) -> bool:
    """Named `.ninfer`, or a file starting with the container magic (a damaged one too)."""
    from ninfer_core.artifact.layout import MAGIC

    if path.suffix == ".ninfer":
        return True
    if not path.is_file():  # a folder, or nothing there: the plugin host says which
        return False
    with path.open("rb") as fh:
        return fh.read(len(MAGIC)) == MAGIC


def run(ns: argparse.Namespace) -> int:
    from ninfer_core.artifact.reader import open_container, read_header

    path = Path(ns.file)
    if not _is_container(path):  # a GGUF file, a model folder: as its reader presents it
        from ninfer_core.cli import inspect_model

        return inspect_model.run(path, as_json=ns.json, verify=ns.verify)
    header, _ = read_header(path)
    info = describe(path, header)
    problems: list[str] | None = None
    if ns.verify:
        with open_container(path, components=list(header.components)) as art:
            problems = art.verify()
        info["verify"] = {"ok": not problems, "problems": problems}
    if ns.json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
    else:
        sys.stdout.write(render(info) + "\n")
        if problems is not None:
            if problems:
                sys.stdout.write(f"\nverify: {len(problems)} problem(s)\n")
                sys.stdout.writelines(f"  {p}\n" for p in problems)
            else:
                sys.stdout.write(
                    f"\nverify: ok, every object's sha256 matches ({len(header.objects)} objects)\n"
                )
    return 1 if problems else 0
