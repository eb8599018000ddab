"""Per-token cost of stop-string checking against the number of stop strings.

    python bench/stop_strings.py [--tokens 1000] [--chars 4]

Feeds a stream that never matches (the worst case: every step must rule out every stop
string) through `StopChecker` with 1, 100 and 10k random stop strings, and prints the
build time and the time per token. The engine runs this on its step thread for every
token of every request, so it must not grow with the number of stop strings.
"""

from __future__ import annotations

import argparse
import random
import time

from ninfer_core.text import StopChecker


def measure(n_stops: int, tokens: int, chars: int, rng: random.Random) -> tuple[float, float]:
    """(build seconds, seconds per token) for `n_stops` stop strings of 4..40 characters."""
    # Every stop ends in "j", which the stream never holds: its prefixes occur, it never does.
    stops = [
        "".join(rng.choices("abcdefghi", k=rng.randrange(3, 39))) + "j" for _ in range(n_stops)
    ]
    start = time.perf_counter()
    checker = StopChecker(stop_strings=stops)
    build = time.perf_counter() - start
    text = "".join(rng.choices("abc klm", k=tokens * chars))  # prefixes, never a whole stop
    start = time.perf_counter()
    for i in range(0, len(text), chars):
        if checker.feed(text[i : i + chars]).finished:
            raise RuntimeError("the stream matched a stop string; the bench wants none")
    return build, (time.perf_counter() - start) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000, help="tokens fed per case")
    parser.add_argument("--chars", type=int, default=4, help="characters per token")
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"{'stops':>7}  {'build ms':>9}  {'us/token':>9}")
    for n in (1, 100, 10_000):
        build, per_token = measure(n, args.tokens, args.chars, rng)
        print(f"{n:>7}  {build * 1e3:>9.1f}  {per_token * 1e6:>9.1f}")


if __name__ == "__main__":
    main()
