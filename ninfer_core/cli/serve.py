"""`ninfer-serve`: the HTTP server."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    sys.stderr.write(
        "ninfer-serve: the HTTP server is not part of this build yet; "
        "use `ninfer generate` for one-shot generation\n"
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
