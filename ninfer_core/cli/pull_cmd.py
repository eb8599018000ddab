"""`ninfer pull`: fetch one file of a Hub repo at a pinned commit, optionally verified.

The path goes to stdout and nothing else does, so `MODEL=$(ninfer pull ...)` works;
progress bars and notes go to stderr. The work is `ninfer_core.hub.pull`.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pull",
        help="download one file of a Hugging Face repo at a pinned commit; prints its path",
        description=(
            "Download one file of a Hugging Face Hub repo into the hub cache and print its "
            "path. The revision must be a full commit sha. A file already in the cache is "
            "used without a request; with HF_HUB_OFFLINE=1 only the cache is used."
        ),
    )
    p.add_argument("repo", metavar="REPO", help="repo id, e.g. Qwen/Qwen3-0.6B")
    p.add_argument(
        "--revision",
        required=True,
        metavar="SHA",
        help="full 40-hex commit sha (a branch or tag only with --allow-unpinned)",
    )
    p.add_argument(
        "--file", required=True, metavar="NAME", help="file in the repo, e.g. config.json"
    )
    p.add_argument(
        "--sha256",
        metavar="HEX",
        help="expected sha256 of the file; a mismatch is an error and the file is removed",
    )
    p.add_argument(
        "--allow-unpinned",
        action="store_true",
        help="accept a branch or tag for --revision (what you get can change upstream)",
    )
    p.add_argument(
        "--dir",
        metavar="DIR",
        help="hub cache folder to use (default: HF_HUB_CACHE, else ~/.cache/huggingface/hub)",
    )
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from ninfer_core.hub import pull  # huggingface_hub loads only for this command

    pulled = pull(
        ns.repo,
        ns.file,
        revision=ns.revision,
        sha256=ns.sha256,
        allow_unpinned=ns.allow_unpinned,
        cache_dir=ns.dir,
    )
    if pulled.note:
        sys.stderr.write(f"ninfer pull: {pulled.note}\n")
    if pulled.commit and pulled.commit != ns.revision.lower():
        sys.stderr.write(
            f"ninfer pull: {ns.revision} is commit {pulled.commit}; "
            f"pin it with --revision {pulled.commit}\n"
        )
    if pulled.sha256:
        sys.stderr.write(f"ninfer pull: sha256 ok ({pulled.sha256})\n")
    sys.stdout.write(f"{pulled.path}\n")
    return 0
