"""`ninfer bench serve URL` against a real `ninfer-serve` app (tiny model, uvicorn on a thread):
the figures hang together, and an unreachable server is one clear line."""

from __future__ import annotations

import json
import socket

import pytest
from serve_fixtures import MODEL_ID, frontends_host, make_state, serving, write_serve_model

from ninfer_core.bench.serve import ServeBenchConfig, percentile, prompt_text, run_serve_bench
from ninfer_core.cli.main import main as ninfer_main
from ninfer_core.errors import NInferError

KEY = "bench-key"
TINY = ["--requests", "2", "--max-tokens", "4", "--prompt-tokens", "24", "--api-key", KEY]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = make_state(write_serve_model(tmp_path_factory.mktemp("bench-serve-model")))
    with serving(state, frontends_host(anthropic=False), api_key=KEY) as srv:
        yield srv


def bench_json(capsys, *args: str) -> dict:
    assert ninfer_main(["bench", "serve", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_levels_count_every_request_and_usage_tokens(server, capsys, api):
    result = bench_json(capsys, server.url, *TINY, "--api", api, "--concurrency", "1,2")
    assert result["model"] == MODEL_ID  # from GET /v1/models
    assert [r["concurrency"] for r in result["levels"]] == [1, 2]
    for r in result["levels"]:
        assert r["requests"] == 2 and r["errors"] == 0 and r["first_error"] is None
        assert r["completion_tokens"] == [4, 4] and r["tokens_from_usage"] is True
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"]
        assert r["decode_tok_s_median"] > 0 and r["aggregate_tok_s"] > 0
        # The aggregate is every token of the level over its wall time.
        assert r["aggregate_tok_s"] == pytest.approx(8 / r["wall_s"])
        assert r["prompt_tokens_median"] > 0
    c2 = result["ratios"]["C2/C1"]
    assert c2["aggregate_tok_s"] == pytest.approx(
        result["levels"][1]["aggregate_tok_s"] / result["levels"][0]["aggregate_tok_s"]
    )


def test_the_table_names_each_level_and_the_ratio(server, capsys):
    assert ninfer_main(["bench", "serve", server.url + "/v1/", *TINY, "--model", MODEL_ID]) == 0
    out = capsys.readouterr().out
    rows = [
        line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")
    ]
    assert len(rows) == 2 and all(row.split(" | ")[1:3] == ["2", "0"] for row in rows)
    assert "C2/C1: TTFT p50" in out and "TTFT p50 ms" in out


def test_the_prompt_length_is_calibrated_by_the_servers_usage(server):
    cfg = ServeBenchConfig(api_key=KEY, requests=1, max_tokens=2, prompt_tokens=64, concurrency="1")
    result = run_serve_bench(server.url, cfg)
    # A trained 400-token BPE splits words; the calibrated prompt lands near the target.
    assert result["prompt_words"] < 64
    assert abs(result["levels"][0]["prompt_tokens_median"] - 64) <= 16


def test_a_wrong_api_key_fails_as_one_line(server, capsys):
    assert ninfer_main(["bench", "serve", server.url, "--api-key", "nope", "--requests", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ninfer bench: error: GET ") and "401" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_unreachable_server_is_one_clear_line(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert ninfer_main(["bench", "serve", url, "--requests", "1"]) == 1
    err = capsys.readouterr().err
    expected = f"GET {url}/v1/models failed: APIConnectionError: Connection error."
    assert err == f"ninfer bench: error: {expected}\n"
    with pytest.raises(NInferError, match=r"warm-up request .* failed: APIConnectionError"):
        run_serve_bench(url, ServeBenchConfig(model="m", requests=1))


def test_bad_levels_and_helpers():
    with pytest.raises(NInferError, match="--concurrency"):
        ServeBenchConfig(concurrency="1,x").levels()
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5 and percentile([5.0], 0.9) == 5.0
    assert prompt_text(5, 1) == prompt_text(5, 1) != prompt_text(5, 2)
    assert len(prompt_text(5, 1).split()) == 5
