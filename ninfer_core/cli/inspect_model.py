"""`ninfer inspect MODEL` for what is not a `.ninfer` container (a GGUF file, a model folder):
the model as its reader presents it, through the `Artifact` contract alone.

It shows the reader that opened it, the architecture from its config, every tensor under
the name the model loads it by with its stored format and size (from the artifact's
`object_table` when it has one), per-format counts, and which text files it provides.
Nothing is dequantized; only headers are read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ninfer_core.errors import NInferError

#: The config fields shown, in this order, when present.
CONFIG_FIELDS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rope_theta", "rope_scaling", "tie_word_embeddings",
)  # fmt: skip
#: Text files the loader and the text layer read, listed when the artifact provides them.
TEXT_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "generation_config.json", "chat_template.jinja", "chat_template.json",
)  # fmt: skip


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def describe(path: Path) -> dict[str, Any]:
    """The artifact at `path` as plain data: reader, config, tensors, formats, texts, totals."""
    from ninfer_core.loading import open_artifact
    from ninfer_core.plugin_host import create_host

    host = create_host()
    artifact = open_artifact(host, path)
    reader = next((r.name for r in host.artifact_readers if r.can_read(path)), "?")
    records = {r.name: r for r in artifact.object_table()} if artifact.object_table else {}
    tensors = []
    for name in artifact.tensor_names():
        rec = records.get(name)
        shape = tuple(artifact.tensor_shape(name))
        fmt = getattr(rec, "format", None) or (
            artifact.tensor_format(name) if artifact.tensor_format else None
        )
        tensors.append(
            {
                "name": name,
                "format": fmt or "?",
                "shape": list(shape),
                "bytes": rec.nbytes if rec is not None else None,
            }
        )
    by_format: dict[str, list[int]] = {}
    for t in tensors:
        row = by_format.setdefault(t["format"], [0, 0, 0])
        row[0] += 1
        row[1] += _numel(t["shape"])
        row[2] += t["bytes"] or 0
    weights = sum(row[1] for row in by_format.values())
    known = all(t["bytes"] is not None for t in tensors)
    tensor_bytes = sum(row[2] for row in by_format.values()) if known else None
    close = getattr(artifact, "close", None)
    texts: dict[str, str] = {}  # name -> "ok", or why it cannot be read
    for name in TEXT_FILES:
        try:
            if artifact.read_text(name) is not None:
                texts[name] = "ok"
        except NInferError as exc:  # a GGUF tokenizer NInfer cannot build, say
            texts[name] = str(exc)
    config = {k: artifact.config[k] for k in CONFIG_FIELDS if k in artifact.config}
    if close is not None:
        close()
    return {
        "file": str(path),
        "reader": reader,
        "config": config,
        "tensors": tensors,
        "formats": {
            name: {
                "tensors": n,
                "weights": numel,
                "bytes": nbytes if known else None,
                "bits_per_weight": round(8 * nbytes / numel, 4) if known and numel else None,
            }
            for name, (n, numel, nbytes) in sorted(by_format.items())
        },
        "texts": texts,
        "totals": {
            "tensors": len(tensors),
            "weights": weights,
            "tensor_bytes": tensor_bytes,
            "bits_per_weight": round(8 * tensor_bytes / weights, 4)
            if tensor_bytes and weights
            else None,
            "file_bytes": path.stat().st_size if path.is_file() else None,
        },
    }


def render(info: dict[str, Any]) -> str:
    """The description as the table people read."""
    cfg = info["config"]
    arch = ", ".join(cfg.get("architectures") or ["?"])
    out = [f"{info['file']}: read by {info['reader']!r} as {arch}"]
    out += [f"  {k:<24} {json.dumps(v)}" for k, v in cfg.items() if k != "architectures"]
    rows = info["tensors"]
    width = max([len("tensor")] + [len(t["name"]) for t in rows])
    out += ["", f"{'tensor':<{width}}  {'format':<8}  {'shape':<14}  {'bytes':>12}"]
    for t in rows:
        shape = "x".join(str(d) for d in t["shape"]) or "scalar"
        size = f"{t['bytes']:,}" if t["bytes"] is not None else "?"
        out.append(f"{t['name']:<{width}}  {t['format']:<8}  {shape:<14}  {size:>12}")
    out += ["", f"{'format':<8} {'tensors':>8} {'weights':>14} {'bytes':>14} {'bits/weight':>12}"]
    for name, f in info["formats"].items():
        size = f"{f['bytes']:,}" if f["bytes"] is not None else "?"
        bits = f"{f['bits_per_weight']:.2f}" if f["bits_per_weight"] is not None else "?"
        out.append(f"{name:<8} {f['tensors']:>8} {f['weights']:>14,} {size:>14} {bits:>12}")
    tot = info["totals"]
    size = f"{tot['tensor_bytes']:,} tensor bytes" if tot["tensor_bytes"] is not None else ""
    disk = f", {tot['file_bytes']:,} bytes on disk" if tot["file_bytes"] is not None else ""
    out += [
        "",
        f"texts        {', '.join(info['texts']) or 'none'}",
        *(f"  {n}: {why}" for n, why in info["texts"].items() if why != "ok"),
        f"totals       {tot['tensors']} tensors, {tot['weights']:,} weights"
        + (f", {size}" if size else "")
        + disk,
    ]
    return "\n".join(out)


def run(path: Path, *, as_json: bool, verify: bool) -> int:
    if verify:
        raise NInferError(
            f"{path}: --verify checks .ninfer containers (every object's sha256); this is not one"
        )
    info = describe(path)
    sys.stdout.write((json.dumps(info, indent=2) if as_json else render(info)) + "\n")
    return 0
