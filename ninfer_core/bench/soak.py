"""`ninfer bench soak`: mixed traffic at saturation for a count of requests or a duration,
with TTFT, inter-token gaps, errors and the server's RSS over time.

Requests vary in protocol (OpenAI chat, completions, Anthropic messages), streaming, prompt
length (so the engine meets many context lengths it has not seen) and output length, and
mix in what stresses a server beyond plain text: a stream the client leaves after its first
tokens (a cancel), a grammar (`structured_outputs` regex), an embeddings call, `n = 2`
choices (unless the server speculates, which refuses `n > 1`), and, with `--spec`,
speculative rounds throughout. `--concurrency` clients send back to back, so the queue stays
full.

Each time window (`--window-s`) reports its requests, errors (a status other than 200, or
no answer within the timeout: a request that hangs), p50/p99 time to the first text and
gap between text events of the streams that started in it (`carries_text`), and the
server's RSS. The figures that
matter: RSS after warm-up against RSS at the end and its peak (a server that grows with
each new shape fails here long before it fails a user), no errors, and latencies that stay
flat from the first window to the last. `--plot DIR` draws them (matplotlib, the `plot`
extra).
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ninfer_core.bench import kernel_ops_line
from ninfer_core.bench.server_process import ServerProcess, request, rss_bytes
from ninfer_core.config import opt

MIB = 2**20
WORDS = ["def", "return", "import", "class", "self", "value", "list", "dict", "print",
         "open", "file", "data", "for", "while", "if"]  # fmt: skip
#: The kinds of request in the mix, and their weights.
KINDS = {"chat": 4, "completions": 3, "messages": 3, "cancel": 1, "grammar": 1,
         "embeddings": 1, "choices": 1}  # fmt: skip
#: Seconds between two RSS samples.
RSS_EVERY_S = 2.0


@dataclass
class SoakBenchConfig:
    """Workload for `ninfer bench soak`."""

    requests: int = opt(2000, "requests in all (unless --duration-s)")
    duration_s: float = opt(0.0, "send for this long instead of a count of requests (0: off)")
    concurrency: int = opt(4, "requests in flight at once (also the server's --max-concurrency)")
    max_prompt_words: int = opt(1500, "longest prompt, in words (lengths are drawn uniformly)")
    max_tokens: int = opt(48, "longest answer (drawn uniformly from 1)")
    warmup_fraction: float = opt(0.1, "share of the run before the 'after warm-up' RSS")
    window_s: float = opt(60.0, "width of one time window of the report")
    spec: str | None = opt(None, "the server's --spec (ngram, ...): speculative rounds throughout")
    seed: int = opt(0, "random seed of the mix")
    threads: int = opt(1, "--threads for the server")
    timeout_s: float = opt(600.0, "a request with no answer by then counts as hung")
    plot: str | None = opt(None, "folder for PNG plots of the windows (needs matplotlib)")


@dataclass
class Record:
    """One request: when it started (seconds into the run), its kind, its status ("hung"
    or an exception's name when none came), its TTFT and gaps (streams only)."""

    start_s: float
    kind: str
    status: int | str
    ttft_s: float | None = None
    gaps_s: tuple[float, ...] = ()


def one_request(rng: random.Random, cfg: SoakBenchConfig, model_id: str) -> tuple[str, str, dict]:
    """(kind, path, body) of one request of the mix."""
    kinds = [k for k in KINDS if not (k == "choices" and cfg.spec)]
    kind = rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, cfg.max_prompt_words)))
    n, stream = rng.randint(1, cfg.max_tokens), rng.random() < 0.5
    chat = {"model": model_id, "max_tokens": n, "stream": stream,
            "messages": [{"role": "user", "content": text}]}  # fmt: skip
    if kind == "completions":
        return kind, "/v1/completions", {
            "model": model_id, "prompt": text, "max_tokens": n, "stream": stream
        }  # fmt: skip
    if kind == "messages":
        return kind, "/v1/messages", chat
    if kind == "cancel":
        return kind, "/v1/chat/completions", {**chat, "stream": True, "max_tokens": 64}
    if kind == "grammar":
        return kind, "/v1/chat/completions", {
            **chat, "structured_outputs": {"regex": "(yes|no), [a-z]{1,12}"}
        }  # fmt: skip
    if kind == "embeddings":
        return kind, "/v1/embeddings", {"model": model_id, "input": [text[:2000], "hi"]}
    if kind == "choices":
        return kind, "/v1/chat/completions", {**chat, "stream": False, "n": 2}
    return kind, "/v1/chat/completions", chat


def leave_early(port: int, path: str, body: dict, events: int, timeout: float) -> tuple[int, float]:
    """Stream `body` and hang up after `events` data lines: (status, seconds to the first)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        first, seen = 0.0, 0
        for line in resp:
            if line.startswith(b"data:"):
                first = first or time.perf_counter() - start
                seen += 1
                if seen >= events:
                    break
        return resp.status, first
    finally:
        conn.close()  # the server sees the client leave and cancels the request


def send(port: int, item: tuple[str, str, dict], timeout: float, t0: float) -> Record:
    kind, path, body = item
    start = time.perf_counter()
    try:
        if kind == "cancel":
            status, first = leave_early(port, path, body, 3, timeout)
            return Record(start - t0, kind, status, first or None)
        reply = request(port, "POST", path, body, timeout=timeout)
    except TimeoutError:
        return Record(start - t0, kind, "hung")
    except OSError as exc:
        return Record(start - t0, kind, type(exc).__name__)
    stamps = [t for t, event in reply.events if carries_text(event)]
    if not stamps:
        return Record(start - t0, kind, reply.status)
    gaps = tuple(b - a for a, b in itertools.pairwise(stamps))
    return Record(start - t0, kind, reply.status, stamps[0] - start, gaps)


def carries_text(event: Any) -> bool:
    """Whether a stream's event carries answer text: an OpenAI chunk with content, text or a
    tool call's piece, an Anthropic `content_block_delta`. Not a role chunk, a usage or
    finish chunk, nor Anthropic's `ping`s (every 5 s while a request waits), whose times
    would read as a first token or a 5 s gap between tokens."""
    if not isinstance(event, dict):
        return False
    if "type" in event:
        return event["type"] == "content_block_delta"
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or choice.get("text"):
            return True
    return False


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def windows(records: list[Record], rss: list[tuple[float, int]], width: float) -> list[dict]:
    """The report's rows: per window of `width` seconds, by the requests' start times."""
    last = max([r.start_s for r in records] + [t for t, _ in rss] + [0.0])
    rows = []
    for w in range(int(last // width) + 1):
        lo, hi = w * width, (w + 1) * width
        inside = [r for r in records if lo <= r.start_s < hi]
        ttfts = [r.ttft_s for r in inside if r.ttft_s is not None]
        gaps = [g for r in inside for g in r.gaps_s]
        mem = [b for t, b in rss if lo <= t < hi]
        rows.append({
            "start_s": lo, "requests": len(inside),
            "errors": sum(1 for r in inside if r.status != 200),
            "ttft_p50_ms": _ms(percentile(ttfts, 0.5)), "ttft_p99_ms": _ms(percentile(ttfts, 0.99)),
            "gap_p50_ms": _ms(percentile(gaps, 0.5)), "gap_p99_ms": _ms(percentile(gaps, 0.99)),
            "rss_mib": max(mem) / MIB if mem else None,
        })  # fmt: skip
    return rows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def run_bench(cfg: SoakBenchConfig, model: str | None = None) -> dict:
    if cfg.plot:
        from ninfer_core.bench.serve_plot import require_matplotlib

        require_matplotlib()  # before an hour of measuring, not after
    rng = random.Random(cfg.seed)
    records: list[Record] = []
    rss: list[tuple[float, int]] = []
    lock, stop = threading.Lock(), threading.Event()
    args = ["--max-concurrency", str(cfg.concurrency)]
    if cfg.spec:
        args += ["--spec", cfg.spec]
    with ServerProcess(model, args, threads=cfg.threads) as server:
        model_id = request(server.port, "GET", "/v1/models", None).body["data"][0]["id"]
        start_rss = rss_bytes(server.pid)
        t0 = time.perf_counter()
        sent = 0

        def next_item() -> tuple[str, str, dict] | None:
            nonlocal sent
            with lock:
                over = (time.perf_counter() - t0 >= cfg.duration_s if cfg.duration_s
                        else sent >= cfg.requests)  # fmt: skip
                if over:
                    return None
                sent += 1
                return one_request(rng, cfg, model_id)

        def client() -> None:
            while (item := next_item()) is not None:
                record = send(server.port, item, cfg.timeout_s, t0)
                with lock:
                    records.append(record)

        def sample() -> None:
            while not stop.wait(RSS_EVERY_S):
                rss.append((time.perf_counter() - t0, rss_bytes(server.pid)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with ThreadPoolExecutor(cfg.concurrency) as pool:
            for _ in range(cfg.concurrency):
                pool.submit(client)
        stop.set()
        sampler.join()
        wall = time.perf_counter() - t0
        peak = rss_bytes(server.pid, "VmHWM")
        end_rss = rss_bytes(server.pid)
        health = request(server.port, "GET", "/health", None).status
    warm = next((b for t, b in rss if t >= wall * cfg.warmup_fraction), end_rss)
    result = {
        "config": cfg.__dict__,
        "kernel_ops": server.kernel_ops,
        "wall_s": wall,
        "statuses": dict(Counter(str(r.status) for r in records)),
        "kinds": dict(Counter(r.kind for r in records)),
        "health_after": health,
        "rss_start_mib": start_rss / MIB,
        "rss_after_warmup_mib": warm / MIB,
        "rss_end_mib": end_rss / MIB,
        "rss_peak_mib": peak / MIB,
        "growth_after_warmup_mib": (end_rss - warm) / MIB,
        "windows": windows(records, rss, cfg.window_s),
    }
    if cfg.plot:
        result["plots"] = [str(p) for p in plot(result, Path(cfg.plot))]
    return result


def plot(result: dict, out: Path) -> list[Path]:
    """PNGs of the windows: latency percentiles, and RSS, against time."""
    from ninfer_core.bench.serve_plot import require_matplotlib

    require_matplotlib().use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    rows = result["windows"]
    minutes = [r["start_s"] / 60 for r in rows]
    paths = []
    for stem, keys, label in (
        ("soak_latency", ("ttft_p50_ms", "ttft_p99_ms", "gap_p50_ms", "gap_p99_ms"), "ms"),
        ("soak_rss", ("rss_mib",), "RSS (MiB)"),
    ):
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        for key in keys:
            points = [(m, r[key]) for m, r in zip(minutes, rows, strict=True) if r[key] is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=key)
        ax.set_xlabel("minutes into the run")
        ax.set_ylabel(label)
        if len(keys) > 1:
            ax.set_yscale("log")
        ax.legend()
        ax.grid(True, alpha=0.3)
        path = out / f"{stem}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def _cell(value: float | None, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def render(result: dict) -> str:
    statuses = ", ".join(f"{k}×{v}" for k, v in sorted(result["statuses"].items()))
    lines = [
        kernel_ops_line(result.get("kernel_ops")),
        f"{sum(result['statuses'].values())} requests in {result['wall_s']:.0f} s ({statuses});"
        f" /health after: {result['health_after']}",
        f"RSS at start {result['rss_start_mib']:.0f} MiB, after warm-up "
        f"{result['rss_after_warmup_mib']:.0f} MiB, at the end {result['rss_end_mib']:.0f} MiB "
        f"(growth after warm-up {result['growth_after_warmup_mib']:+.0f} MiB), "
        f"peak {result['rss_peak_mib']:.0f} MiB",
        "",
        "| from s | requests | errors | TTFT p50 / p99 ms | gap p50 / p99 ms | RSS MiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["windows"]:
        lines.append(
            f"| {r['start_s']:.0f} | {r['requests']} | {r['errors']} | "
            f"{_cell(r['ttft_p50_ms'])} / {_cell(r['ttft_p99_ms'])} | "
            f"{_cell(r['gap_p50_ms'])} / {_cell(r['gap_p99_ms'])} | {_cell(r['rss_mib'])} |"
        )
    lines += [f"wrote {p}" for p in result.get("plots", [])]
    return "\n".join(lines)
