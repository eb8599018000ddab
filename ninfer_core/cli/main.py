"""`ninfer`: one command, a subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ninfer_core import __version__
from ninfer_core.errors import NInferError

#: Subcommand → module with `add_parser(subparsers)` and `run(namespace) -> int`.
COMMANDS = {
    "generate": "ninfer_core.cli.generate_cmd",
    "probe": "ninfer_core.cli.probe_cmd",
    "plugins": "ninfer_core.cli.plugins_cmd",
    "plan": "ninfer_core.cli.plan_cmd",
    "bench": "ninfer_core.cli.bench_cmd",
    "pull": "ninfer_core.cli.pull_cmd",
    "convert": "ninfer_core.cli.convert_cmd",
    "inspect": "ninfer_core.cli.inspect_cmd",
    "eval-ppl": "ninfer_core.cli.eval_ppl_cmd",
    "draft-head": "ninfer_core.cli.draft_head_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description="NInfer: LLM inference engine")
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log plugin loading")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if ns.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(ns.run(ns) or 0)
    except NInferError as exc:
        sys.stderr.write(f"ninfer {ns.command}: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
