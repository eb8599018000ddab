"""`ninfer bench soak`: thousands of mixed requests, the server's RSS sampled throughout.

Requests vary in protocol (OpenAI chat, completions, Anthropic messages), streaming, prompt
length (so the engine meets many context lengths it has not seen) and output length. The
figures that matter are RSS after warm-up against RSS at the end and its peak: a server that
grows without bound with each new shape fails here long before it fails a user.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ninfer_core.bench import kernel_ops_line
from ninfer_core.bench.server_process import ServerProcess, request, rss_bytes
from ninfer_core.config import opt

MIB = 2**20
WORDS = [
    "def",
    "return",
    "import",
    "class",
    "self",
    "value",
    "list",
    "dict",
    "print",
    "open",
    "file",
    "data",
    "for",
    "while",
    "if",
]


@dataclass
class SoakBenchConfig:
    """Workload for `ninfer bench soak`."""

    requests: int = opt(2000, "requests in all")
    concurrency: int = opt(4, "requests in flight at once")
    max_prompt_words: int = opt(1500, "longest prompt, in words (lengths are drawn uniformly)")
    max_tokens: int = opt(48, "longest answer (drawn uniformly from 1)")
    warmup_fraction: float = opt(0.1, "share of the requests before the 'after warm-up' RSS")
    seed: int = opt(0, "random seed of the mix")
    threads: int = opt(1, "--threads for the server")


def one_request(rng: random.Random, cfg: SoakBenchConfig, model_id: str) -> tuple[str, dict]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, cfg.max_prompt_words)))
    n, stream = rng.randint(1, cfg.max_tokens), rng.random() < 0.5
    kind = rng.choice(("chat", "completions", "messages"))
    if kind == "completions":
        return "/v1/completions", {
            "model": model_id,
            "prompt": text,
            "max_tokens": n,
            "stream": stream,
        }
    body = {"model": model_id, "max_tokens": n, "stream": stream,
            "messages": [{"role": "user", "content": text}]}  # fmt: skip
    if kind == "chat":
        return "/v1/chat/completions", body
    return "/v1/messages", body


def run_bench(cfg: SoakBenchConfig, model: str | None = None) -> dict:
    rng = random.Random(cfg.seed)
    statuses: Counter = Counter()
    done = 0
    lock = threading.Lock()
    samples: list[tuple[int, int]] = []  # (requests done, RSS)
    with ServerProcess(model, ["--max-concurrency", str(cfg.concurrency)],
                       threads=cfg.threads) as server:  # fmt: skip
        model_id = request(server.port, "GET", "/v1/models", None).body["data"][0]["id"]
        work = [one_request(rng, cfg, model_id) for _ in range(cfg.requests)]
        start_rss = rss_bytes(server.pid)
        started = time.perf_counter()

        def send(item: tuple[str, dict]) -> None:
            nonlocal done
            status = request(server.port, "POST", item[0], item[1]).status
            with lock:
                statuses[status] += 1
                done += 1
                if done % max(1, cfg.requests // 50) == 0:
                    samples.append((done, rss_bytes(server.pid)))

        with ThreadPoolExecutor(cfg.concurrency) as pool:
            list(pool.map(send, work))
        wall = time.perf_counter() - started
        peak = rss_bytes(server.pid, "VmHWM")
        end_rss = rss_bytes(server.pid)
    warm = next((rss for n, rss in samples if n >= cfg.requests * cfg.warmup_fraction), end_rss)
    return {
        "config": cfg.__dict__,
        "kernel_ops": server.kernel_ops,
        "wall_s": wall,
        "statuses": dict(statuses),
        "rss_start_mib": start_rss / MIB,
        "rss_after_warmup_mib": warm / MIB,
        "rss_end_mib": end_rss / MIB,
        "rss_peak_mib": peak / MIB,
        "growth_after_warmup_mib": (end_rss - warm) / MIB,
        "samples": [(n, rss / MIB) for n, rss in samples],
    }


def render(result: dict) -> str:
    statuses = ", ".join(f"{k}×{v}" for k, v in sorted(result["statuses"].items()))
    return (
        f"{kernel_ops_line(result.get('kernel_ops'))}\n"
        f"{sum(result['statuses'].values())} requests in {result['wall_s']:.0f} s ({statuses})\n"
        f"RSS at start {result['rss_start_mib']:.0f} MiB, after warm-up "
        f"{result['rss_after_warmup_mib']:.0f} MiB, at the end {result['rss_end_mib']:.0f} MiB "
        f"(growth after warm-up {result['growth_after_warmup_mib']:+.0f} MiB), "
        f"peak {result['rss_peak_mib']:.0f} MiB"
    )
