"""GGUF files of the same weights at other types, for `ninfer bench decode FILE.gguf`.

To set NInfer's bf16 beside llama.cpp's f16 or Q4_0 on the same weights:

    python bench/peer_gguf.py all --out /tmp/m          # the standard set, below
    python bench/peer_gguf.py f16 SRC.gguf DST.gguf     # a quantized GGUF, dequantized to F16
    python bench/peer_gguf.py from-hf FOLDER DST.gguf   # a Llama/Qwen2/Qwen3 folder as F16
    python bench/peer_gguf.py quantize F16.gguf DST.gguf --type q4_0   # llama.cpp's quantizer

`all` writes `smol-f16.gguf` (SmolLM2-135M's Q4_1 file dequantized), `qwen06-f16.gguf`
(the Qwen3-0.6B-shaped benchmark checkpoint, built first if it is not cached) and
`qwen06-q4_0.gguf`, `qwen06-q8_0.gguf` (llama-cpp-python needed). The work is in
`ninfer_core.bench.peer_gguf`.
"""

from __future__ import annotations

import argparse
import sys

from ninfer_core.bench.peer_gguf import (
    FTYPES,
    gguf_to_f16,
    hf_to_gguf,
    make_peer_files,
    quantize,
)
from ninfer_core.errors import NInferError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("all", help="the standard set of peer files, in --out")
    a.add_argument("--out", required=True, help="folder for the files")
    a.add_argument("--checkpoint", help="benchmark checkpoint folder (default: its cache)")
    a.add_argument("--types", default="q4_0,q8_0", help="llama.cpp types of the checkpoint")
    f = sub.add_parser("f16", help="a quantized GGUF with every quantized tensor as F16")
    h = sub.add_parser("from-hf", help="a Hugging Face folder as an F16 GGUF")
    h.add_argument("--pre", help="tokenizer.ggml.pre (default: by model_type)")
    q = sub.add_parser("quantize", help="an F16 GGUF quantized by llama.cpp")
    q.add_argument("--type", default="q4_0", choices=sorted(FTYPES))
    q.add_argument("--pure", action="store_true", help="the head/embedding at --type too")
    for s in (f, h, q):
        s.add_argument("src")
        s.add_argument("dst")
    for s in (a, q):
        s.add_argument("--threads", type=int, default=0, help="quantizer threads (0: all)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        if ns.command == "all":
            types = tuple(t for t in ns.types.split(",") if t)
            written = make_peer_files(
                ns.out, checkpoint=ns.checkpoint, types=types, threads=ns.threads
            )
        elif ns.command == "f16":
            written = [gguf_to_f16(ns.src, ns.dst)]
        elif ns.command == "from-hf":
            written = [hf_to_gguf(ns.src, ns.dst, pre=ns.pre)]
        else:
            written = [quantize(ns.src, ns.dst, ns.type, threads=ns.threads, pure=ns.pure)]
    except NInferError as exc:
        print(f"peer_gguf: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
