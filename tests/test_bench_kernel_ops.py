"""Every bench prints which kernel backend served each op, from the one record the load
made (`LoadedModel.kernels`; a server reports it on `/health`)."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from serve_fixtures import (
    health_status,
    make_state,
    serve_process,
    serving,
    wait_for,
    write_serve_model,
)

from ninfer_core.bench import isolation, kernel_ops_line, memory_growth, soak, threads
from ninfer_core.cli.main import main
from ninfer_core.device import probe_device
from ninfer_core.kernels.compose import OpChoice, plan_kernels
from ninfer_core.plugin_host import create_host

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = probe_device(use_cuda=False)
EVERY_OP_TORCH = "kernel ops: torch (reference) for every op"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_serve_model(tmp_path_factory.mktemp("bench-kernels"))


def records() -> list[dict]:
    return [c.to_json() for c in plan_kernels(create_host(), CPU)]


def test_the_line_round_trips_the_records():
    mixed = [dict(r, backend="mine") if r["op"] == "linear" else r for r in records()]
    assert kernel_ops_line(records()) == EVERY_OP_TORCH
    assert kernel_ops_line(mixed).startswith("kernel ops: linear=mine, attention=torch (ref")
    assert [OpChoice.from_json(r).to_json() for r in mixed] == mixed
    assert "not reported" in kernel_ops_line(None)


def test_in_process_benches_print_the_per_op_choice(model_dir, capsys):
    args = ["--contexts", "48", "--codecs", "fp16", "--steps", "1"]
    assert main(["bench", "kv", str(model_dir), *args]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == EVERY_OP_TORCH
    assert main(["bench", "kv", str(model_dir), *args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kernel_ops"] == records()
    small = ["--prompt-tokens", "24", "--new-tokens", "3", "--prefill-chunk", "16",
             "--turns", "2", "--turn-tokens", "8", "--dtype", "fp32"]  # fmt: skip
    assert main(["bench", "engine", str(model_dir), *small]) == 0
    assert capsys.readouterr().out.splitlines()[1] == EVERY_OP_TORCH


def test_bench_decode_reports_the_choice_of_its_own_load(model_dir, monkeypatch, capsys):
    from ninfer_core.bench import decode

    run = decode.run_ninfer(model_dir, "fp32", list(range(20, 36)), new=3, repeats=1)
    assert run.kernel_ops == records()

    def fake_bench(cfg, model):  # the figures are beside the point: the header is
        row = dict.fromkeys(
            ("ninfer_decode_tok_s", "peer_decode_tok_s", "ratio", "ceiling_tok_s",
             "ninfer_pct_of_ceiling", "peer_pct_of_ceiling", "ninfer_prefill_tok_s",
             "peer_prefill_tok_s", "prefill_ratio", "ninfer_cpu_share", "peer_cpu_share",
             "weight_bytes_per_token", "kv_bytes_per_token"), 1.0,
        )  # fmt: skip
        row |= {"dtype": "fp32", "greedy_ids_agree": 3, "new_tokens": 3}
        row["kernel_ops"] = run.kernel_ops
        return {"model": model, "peer": "transformers", "threads": 1, "prompt_tokens": 16,
                "new_tokens": 3, "repeats": 1, "read_gb_s": 1.0, "rows": [row]}  # fmt: skip

    monkeypatch.setattr(decode, "run_bench", fake_bench)
    assert main(["bench", "decode", str(model_dir)]) == 0
    assert f"MB KV read per token; {EVERY_OP_TORCH}" in capsys.readouterr().out


def test_child_and_server_benches_render_the_choice():
    ops = records()
    memory = {"model": "m", "dtype": "bf16", "max_context": 64, "kernel_ops": ops,
              "phases": [], "growth_after_warmup": 0, "peak_rss": 0, "kv_pool_bytes": 0,
              "planned_runtime_bytes": 0}  # fmt: skip
    assert memory_growth.render(memory).splitlines()[1] == EVERY_OP_TORCH
    thread = {"model": "m", "cores": 1, "load": 0.0, "new": 1, "kernel_ops": ops, "rows": []}
    assert threads.render(thread).splitlines()[1] == EVERY_OP_TORCH
    assert isolation.render({"kernel_ops": ops, "rows": [], "health_after": 200}).startswith(
        EVERY_OP_TORCH
    )
    result = {"kernel_ops": ops, "statuses": {200: 1}, "wall_s": 1.0, "rss_start_mib": 1,
              "rss_after_warmup_mib": 1, "rss_end_mib": 1, "growth_after_warmup_mib": 0,
              "rss_peak_mib": 1, "health_after": 200, "windows": []}  # fmt: skip
    assert soak.render(result).startswith(EVERY_OP_TORCH)


def test_health_reports_the_choice_and_bench_serve_prints_it(model_dir, capsys):
    state = make_state(model_dir)
    tiny = ["--scenario", "coding", "--contexts", "1000", "--runs", "1", "--max-tokens", "2",
            "--concurrency", "1"]  # fmt: skip
    with serving(state) as srv:
        # A state made without its load's record (as the serve tests make them): nothing.
        assert "kernel_ops" not in httpx.get(srv.url + "/health").json()
        assert main(["bench", "serve", srv.url, *tiny]) == 0
        assert "kernel ops: not reported" in capsys.readouterr().out
        state.kernels = plan_kernels(create_host(), CPU)  # what `ninfer-serve` sets at load
        assert httpx.get(srv.url + "/health").json()["kernel_ops"] == records()
        assert main(["bench", "serve", srv.url, *tiny]) == 0
        assert EVERY_OP_TORCH in capsys.readouterr().out.splitlines()
        assert main(["bench", "serve", srv.url, *tiny, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["endpoints"][0]["kernel_ops"] == records()


def test_ninfer_serve_prints_the_model_s_kernels_and_reports_them_on_health(model_dir):
    """The real entry point: startup prints the per-op choice made for the model's weight
    formats, and `/health` reports the same record the benches read."""
    from ninfer_core.bench.server_process import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_process(model_dir, "--port", str(port))
    try:
        wait_for(lambda: proc.poll() is None and health_status(url) == 200, timeout=60)
        assert httpx.get(url + "/health").json()["kernel_ops"] == records()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert f"{EVERY_OP_TORCH} (weights fp32, KV fp32, compute fp32)" in out
