"""`ninfer bench threads`: decode ms/token by thread count and OpenMP wait policy, with
and without other processes competing for the cores.

Issue 13: on a busy 2-core box one 300-token request took 17-40 s with `--threads 0`
(two threads) and 0.9-3.6 s with `--threads 1`. torch's OpenMP threads spin at each
barrier waiting for each other (GNU OpenMP's default spins before it sleeps),
so when one of them is descheduled the others burn the time slice it needed.
The policy is read when the OpenMP runtime loads, so each configuration runs in a child
process started with its environment; `hog` adds busy-looping processes, one per core,
for the whole run. Every figure is against the first configuration of the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from ninfer_core.bench import kernel_ops_line
from ninfer_core.config import opt

#: The child: load the model, warm up, then time greedy generations; print JSON.
CHILD = r"""
import json, sys, time, torch
from ninfer_core.builtin_model import default_model
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device, thread_summary
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.sampling import SamplingParams
threads, new, repeats, model = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if threads:
    torch.set_num_threads(threads)
host, device = create_host(), probe_device()
loaded = load_model(model or str(default_model()), host=host, device=device,
                    runtime=RuntimeConfig(dtype="bf16"))
engine = Engine(loaded, EngineConfig(max_context=new + 64, max_concurrency=1), host=host,
                device=device)
def run(n):
    req = GenerationRequest(list(range(10, 42)), SamplingParams(temperature=0.0),
                            max_tokens=n, ignore_eos=True)
    t = time.perf_counter(); c = time.process_time()
    engine.generate([req])
    return time.perf_counter() - t, time.process_time() - c
run(8)
times = [run(new) for _ in range(repeats)]
wall, cpu = min(times)
print(json.dumps({"ms_per_token": 1000 * wall / new, "cpu_s": cpu, "wall_s": wall,
                  "threads": torch.get_num_threads(), "summary": thread_summary(),
                  "kernel_ops": [c.to_json() for c in loaded.kernels]}))
"""


@dataclass
class ThreadsBenchConfig:
    """What `ninfer bench threads` compares."""

    threads: str = opt("1,2", "comma-separated torch thread counts")
    policies: str = opt(
        "spin:10000,passive,unset",
        "comma-separated OMP_WAIT_POLICY values (unset: OpenMP's default; spin:N: "
        "GOMP_SPINCOUNT=N instead; spin:10000 is what ninfer sets)",
    )
    new: int = opt(300, "tokens per timed generation (greedy, eos ignored)")
    repeats: int = opt(2, "timed generations per configuration; the best counts")
    hog: bool = opt(True, "also run each configuration beside one busy-looping process per core")
    as_json: bool = opt(False, "print the figures as JSON", flag="--json")


def _hogs(n: int) -> list[subprocess.Popen]:
    """`n` processes that keep a core busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _child(threads: int, policy: str, cfg: ThreadsBenchConfig, model: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy.startswith("spin:"):  # GNU OpenMP's spin count before a thread sleeps
        env["GOMP_SPINCOUNT"] = policy.removeprefix("spin:")
    elif policy != "unset":
        env["OMP_WAIT_POLICY"] = policy.upper()
    args = [str(threads), str(cfg.new), str(cfg.repeats), model or ""]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_bench(cfg: ThreadsBenchConfig, model: str | None) -> dict[str, Any]:
    """Every (contention, threads, policy) configuration, each in a fresh child process."""
    threads = [int(t) for t in cfg.threads.split(",") if t.strip()]
    policies = [p.strip().lower() for p in cfg.policies.split(",") if p.strip()]
    cores = len(os.sched_getaffinity(0))
    rows = []
    for hogged in (False, True) if cfg.hog else (False,):
        hogs = _hogs(cores) if hogged else []
        try:
            time.sleep(0.5 if hogs else 0)
            for n in threads:
                for policy in policies:
                    row = _child(n, policy, cfg, model)
                    rows.append({"hog": hogged, "threads_asked": n, "policy": policy, **row})
        finally:
            for proc in hogs:
                proc.kill()
                proc.wait()
    base = rows[0]["ms_per_token"]
    for row in rows:
        row["vs_first"] = row["ms_per_token"] / base
    return {
        "model": model or "the built-in model",
        "cores": cores,
        "load": os.getloadavg()[0],
        "new": cfg.new,
        # Every child loads the same model the same way: the first one's choice.
        "kernel_ops": rows[0].pop("kernel_ops", None),
        "rows": [{k: v for k, v in r.items() if k != "kernel_ops"} for r in rows],
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} (bf16), {result['cores']} cores, load average "
        f"{result['load']:.1f}, {result['new']} tokens per run",
        kernel_ops_line(result.get("kernel_ops")),
        "| busy-loop hogs | threads | wait policy | ms/token | vs first row | CPU s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        hog = f"{result['cores']}" if r["hog"] else "0"
        lines.append(
            f"| {hog} | {r['threads']} | {r['policy']} | {r['ms_per_token']:.2f} | "
            f"{r['vs_first']:.2f} | {r['cpu_s']:.2f} |"
        )
    return "\n".join(lines)
