"""`ninfer bench isolation`: one client's stream while another sends hostile requests.

The victim streams a greedy answer of `--victim-tokens` tokens alone, then again while a
second client sends one class of hostile request in a loop (`--interval-s` apart; a row of
ordinary short requests is the reference for "any second client"). Per class the table gives the
victim's decode tok/s against the alone run, whether its text is unchanged (greedy, so it
must be), and the status codes the hostile client got.

The server checks two API keys, the victim's and the other client's, so the last two
classes are the fairness cases: an embeddings flood (`--embed-inputs` long inputs a call,
prefill only), and one key's flood (`--flood-clients` clients of one key sending long
prompts with no pause). Prefill beside a stream is paced (`engine/pacing.py`): the victim
is held to at least the server's `--decode-share` (0.5) of its rate alone in every row
(`--decode-share 0` here shows the same run without pacing).
"""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ninfer_core.bench import kernel_ops_line
from ninfer_core.bench.server_process import ServerProcess, request
from ninfer_core.config import opt

PATH = "/v1/chat/completions"


@dataclass
class IsolationBenchConfig:
    """Workload for `ninfer bench isolation`."""

    victim_tokens: int = opt(256, "tokens the victim stream generates")
    prompt_mib: float = opt(15.0, "size of the huge prompt (MiB)")
    stop_count: int = opt(10_000, "stop sequences in the stop-sequence attack")
    threads: int = opt(1, "--threads for the server")
    interval_s: float = opt(
        0.1, "pause between the hostile client's requests; 0 floods (a rate limit's job)"
    )
    embed_inputs: int = opt(16, "inputs of one call in the embeddings flood (~1,800 tokens each)")
    flood_clients: int = opt(8, "clients of one key sending at once in the one-key flood")
    decode_share: float | None = opt(
        None, "the server's --decode-share (0: no pacing, to see what it buys); default: its own"
    )


#: The two keys the server checks: the victim's, and the other client's.
VICTIM_KEY, OTHER_KEY = "victim-key", "other-key"
#: Classes whose client sends with no pause, from `flood_clients` connections at once.
FLOODS = ("one key's flood",)


def _chat(model_id: str, content: str, **extra: Any) -> dict:
    return {"model": model_id, "messages": [{"role": "user", "content": content}], **extra}


def hostile_requests(
    cfg: IsolationBenchConfig, model_id: str
) -> dict[str, Callable[[], tuple[str, dict]]]:
    """Class name → a function giving (path, body) of one hostile request."""
    huge = "word " * int(cfg.prompt_mib * 2**20 / 5)
    stops = [f"stop{i}" for i in range(cfg.stop_count)]
    long_input = " ".join(f"item{i % 97}" for i in range(900))  # ~1,800 tokens
    long_prompt = "Summarise this list: " + " ".join(f"entry{i % 89}" for i in range(300))
    return {
        # not hostile: the cost of any second client, to read the hostile rows against
        "ordinary short requests": lambda: (PATH, _chat(model_id, "hi", max_tokens=1)),
        "bad sampling values": lambda: (
            PATH, _chat(model_id, "hi", max_tokens=16, repetition_penalty=1e-45, temperature=1.0)
        ),
        f"{cfg.prompt_mib:g} MiB prompt": lambda: (PATH, _chat(model_id, huge, max_tokens=4)),
        f"{cfg.stop_count} stop sequences": lambda: (
            "/v1/messages",
            {"model": model_id, "max_tokens": 32, "stop_sequences": stops,
             "messages": [{"role": "user", "content": "write a story"}]},
        ),
        f"embeddings flood ({cfg.embed_inputs} inputs a call)": lambda: (
            "/v1/embeddings", {"model": model_id, "input": [long_input] * cfg.embed_inputs},
        ),
        FLOODS[0]: lambda: (PATH, _chat(model_id, long_prompt, max_tokens=32)),
    }  # fmt: skip


@dataclass
class VictimRun:
    tok_s: float
    text: str


def victim(port: int, model_id: str, tokens: int) -> VictimRun:
    body = _chat(
        model_id,
        "Write the function `dedent` from `textwrap`.",
        max_tokens=tokens, temperature=0, ignore_eos=True, stream=True,
    )  # fmt: skip
    reply = request(port, "POST", PATH, body, key=VICTIM_KEY)
    stamps = [
        t for t, e in reply.events if e.get("choices") and e["choices"][0]["delta"].get("content")
    ]
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for _, e in reply.events if e.get("choices")
    )
    tok_s = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return VictimRun(tok_s, text)


def _attack(port: int, cfg: IsolationBenchConfig, model_id: str, name: str, stop, results) -> None:
    """The hostile client, in a process of its own so that it never takes the victim
    client's GIL: one request of class `name` after another until `stop` is set."""
    make = hostile_requests(cfg, model_id)[name]
    seen: Counter = Counter()
    flood = name in FLOODS

    def client() -> None:
        while not stop.is_set():
            path, body = make()
            try:
                status = request(port, "POST", path, body, timeout=120, key=OTHER_KEY).status
                seen[status] += 1
            except OSError as exc:
                seen[type(exc).__name__] += 1
            if not flood:
                stop.wait(cfg.interval_s)

    clients = cfg.flood_clients if flood else 1
    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(client)
    results.put(dict(seen))


def run_bench(cfg: IsolationBenchConfig, model: str | None = None) -> dict:
    rows = []
    keys = ["--api-key", f"{VICTIM_KEY},{OTHER_KEY}"]
    if cfg.decode_share is not None:
        keys += ["--decode-share", str(cfg.decode_share)]
    with ServerProcess(model, keys, threads=cfg.threads) as server:
        models = request(server.port, "GET", "/v1/models", None, key=VICTIM_KEY).body
        model_id = models["data"][0]["id"]
        victim(server.port, model_id, 16)  # warm-up
        alone = victim(server.port, model_id, cfg.victim_tokens)
        rows.append({"class": "alone", "tok_s": alone.tok_s, "ratio": 1.0, "same_text": True,
                     "hostile_status": {}})  # fmt: skip
        spawn = multiprocessing.get_context("spawn")
        for name in hostile_requests(cfg, model_id):
            stop, results = spawn.Event(), spawn.Queue()
            args = (server.port, cfg, model_id, name, stop, results)
            attacker = spawn.Process(target=_attack, args=args)
            attacker.start()
            time.sleep(2.0)  # the attack is under way before the victim starts
            run = victim(server.port, model_id, cfg.victim_tokens)
            stop.set()
            seen = results.get(timeout=300)
            attacker.join()
            rows.append({
                "class": name, "tok_s": run.tok_s, "ratio": run.tok_s / alone.tok_s,
                "same_text": run.text == alone.text, "hostile_status": seen,
            })  # fmt: skip
        health = request(server.port, "GET", "/health", None, key=VICTIM_KEY).status
    return {"config": cfg.__dict__, "kernel_ops": server.kernel_ops, "rows": rows,
            "health_after": health}  # fmt: skip


def render(result: dict) -> str:
    lines = [kernel_ops_line(result.get("kernel_ops")),
             "| hostile client sends | victim tok/s | ratio | same text | hostile got |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in result["rows"]:
        got = ", ".join(f"{k}×{v}" for k, v in r["hostile_status"].items()) or "-"
        lines.append(
            f"| {r['class']} | {r['tok_s']:.1f} | {r['ratio']:.2f} | {r['same_text']} | {got} |"
        )
    lines.append(f"\n/health after the run: {result['health_after']}")
    return "\n".join(lines)
