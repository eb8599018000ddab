"""`ninfer bench serve`: figures from the stream, checked three ways.

1. `feed` and `summarize` on scripted event times: the figures are exactly the script's.
2. A fake OpenAI/Anthropic server whose prefill and decode speeds are scripted
   (`fake_llm_server`): the figures measured over HTTP are the scripted ones, within the
   scheduling noise of a shared machine (never a timing of this machine); C2's `wait` tells
   a server that prefills one request at a time from one that prefills both together; the
   plots are PNGs of the promised size with every line drawn.
3. A real `ninfer-serve` app on the tiny model, both APIs, both scenarios: every request
   answers and the prompts have the lengths asked for, in the server's tokens.
"""

from __future__ import annotations

import itertools
import json
import socket
import sys
from pathlib import Path

import pytest
from fake_llm_server import MODEL, Script, fake_server
from serve_fixtures import MODEL_ID, frontends_host, make_state, serving, write_serve_model

from ninfer_core.bench import serve_plot
from ninfer_core.bench.serve import ServeBenchConfig, run_serve_bench, summarize
from ninfer_core.bench.serve_report import markdown, write_outputs
from ninfer_core.bench.serve_stream import Sample, feed
from ninfer_core.bench.serve_workload import (
    SCENARIOS,
    anthropic_body,
    build,
    openai_body,
    parse_contexts,
)
from ninfer_core.cli.main import main as ninfer_main
from ninfer_core.errors import NInferError

KEY = "bench-key"
#: Scheduling noise on a busy 2-core box: the figures are scripted, the clock is not.
NOISE = 0.15

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- 1. figures from scripted event times, exactly --------------------------------------------


def openai_events(times: list[float], usage: dict) -> list[tuple[float, dict]]:
    events = [(t, {"choices": [{"index": 0, "delta": {"content": "x"}}]}) for t in times]
    return [*events, (times[-1] + 0.001, {"choices": [], "usage": usage})]


def test_openai_stream_figures_are_the_scripted_ones():
    sample = Sample(start=10.0)
    usage = {"prompt_tokens": 4000, "completion_tokens": 9,
             "spec_stats": {"rounds": 4, "draft_tokens": 12, "accepted_tokens": 5}}  # fmt: skip
    # first text at +0.5 s, then one piece every 50 ms; 9 tokens in 5 pieces (speculation)
    for t, data in openai_events([10.5, 10.55, 10.6, 10.65, 10.7], usage):
        feed(sample, "openai", data, t)
    assert sample.ttft_s == pytest.approx(0.5)
    assert sample.prefill_tok_s == pytest.approx(8000)
    assert sample.decode_tok_s == pytest.approx(8 / 0.2)  # tokens after the first, by usage
    assert sample.spec == {"rounds": 4, "draft_tokens": 12, "accepted_tokens": 5}


def test_anthropic_stream_and_llama_cpp_timings():
    sample = Sample(start=0.0)
    usage = {"input_tokens": 900, "cache_read_input_tokens": 100}
    start = {"type": "message_start", "message": {"usage": usage}}
    feed(sample, "anthropic", start, 0.01)
    for i in range(4):
        delta = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "a"}}
        feed(sample, "anthropic", delta, 0.25 + 0.1 * i)
    end = {"type": "message_delta", "usage": {"output_tokens": 4}}
    feed(sample, "anthropic", end, 0.6)
    assert (sample.prompt_tokens, sample.cached_tokens, sample.tokens) == (1000, 100, 4)
    assert sample.ttft_s == 0.25 and sample.decode_tok_s == pytest.approx(3 / 0.3)
    llama = Sample(start=0.0)  # llama.cpp: no usage.spec_stats, its own timings instead
    feed(llama, "openai", {"choices": [{"delta": {"content": "a"}}]}, 0.2)
    timings = {"prompt_per_second": 1234.5, "draft_n": 10, "draft_n_accepted": 7}
    feed(llama, "openai", {"choices": [{"delta": {}}], "timings": timings}, 0.3)
    assert llama.server_prefill_tok_s == 1234.5
    assert llama.spec == {"draft_tokens": 10, "accepted_tokens": 7}
    assert llama.tokens == 1 and llama.decode_tok_s is None  # one piece: nothing to time


def scripted(start: float, ttft: float, prompt: int = 1000) -> Sample:
    return Sample(start, [start + ttft, start + ttft + 0.1], prompt, 2)


def test_summary_medians_spread_and_the_c2_wait():
    key = {"endpoint": "A", "scenario": "coding", "context": 1000, "concurrency": 2}
    # two runs of two requests; alone, a prefill takes 0.2 s
    runs = [[scripted(0, 0.2), scripted(0, 0.4)], [scripted(5, 0.2), scripted(5, 0.3)]]
    cell = summarize(key, runs, solo_ttft_s=0.2)
    assert cell["ttft_ms"] == {"median": pytest.approx(250), "min": pytest.approx(200),
                               "max": pytest.approx(400), "n": 4}  # fmt: skip
    # wait: the later first token ÷ both prefills alone
    assert cell["wait"]["min"] == pytest.approx(0.3 / 0.4)
    assert cell["wait"]["max"] == pytest.approx(0.4 / 0.4)
    assert cell["decode_tok_s"]["median"] == pytest.approx(10)
    assert cell["itl_ms"] == {"p50": pytest.approx(100), "p90": pytest.approx(100)}
    assert cell["errors"] == 0 and cell["acceptance"] is None
    alone = summarize({**key, "concurrency": 1}, [[scripted(0, 0.2)]], None)
    assert alone["wait"] is None


# -- the workload ----------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_contexts_grow_with_their_budget_and_differ_only_by_salt(scenario):
    sizes = [build(scenario, chars, 1).chars() for chars in (3000, 30000, 300000)]
    for want, got in zip((3000, 30000, 300000), sizes, strict=True):
        assert abs(got - want) <= 0.03 * want + 120
    a, b = build(scenario, 30000, 1), build(scenario, 30000, 2)
    assert a.system != b.system and a.messages == b.messages  # no shared prefix, same work
    text = json.dumps([a.system, a.messages, a.tools], ensure_ascii=False)
    assert sum("\u4e00" <= ch <= "\u9fff" for ch in text) > 100  # mixed Chinese/English
    if scenario == "agent":
        assert (
            a.tools
            and a.tools[0]["function"]["description"] != b.tools[0]["function"]["description"]
        )  # the salt is in the tools too: a template may put them first


def test_agent_bodies_in_both_apis():
    conv = build("agent", 20000, 3)
    chat = openai_body(conv, "m", 5, {"ignore_eos": True})
    assert chat["messages"][0]["role"] == "system" and chat["ignore_eos"] is True
    assert {m["role"] for m in chat["messages"]} == {"system", "user", "assistant", "tool"}
    msgs = anthropic_body(conv, "m", 5, {})
    roles = [m["role"] for m in msgs["messages"]]
    assert all(a != b for a, b in itertools.pairwise(roles))  # turns alternate
    assert roles[0] == "user" and msgs["tools"][0]["input_schema"]["type"] == "object"
    kinds = {b["type"] for m in msgs["messages"] for b in m["content"]}
    assert kinds == {"text", "tool_use", "tool_result"}


def test_options_are_checked_before_any_request():
    assert parse_contexts("8k, 32K,1000") == [8192, 32768, 1000]
    with pytest.raises(NInferError, match="--contexts"):
        parse_contexts("8k,lots")
    with pytest.raises(NInferError, match="--concurrency"):
        ServeBenchConfig(url="http://x", concurrency="1,x").check()
    with pytest.raises(NInferError, match="--url"):
        ServeBenchConfig().check()


# -- 2. a fake server with scripted speeds ---------------------------------------------------


def fake_run(script: Script, **options) -> dict:
    with fake_server(script) as url:
        cfg = ServeBenchConfig(**{"url": url, "scenario": "coding", "contexts": "2000",
                                  "max_tokens": 16, "runs": 2, "seed": 7, **options})  # fmt: skip
        return run_serve_bench(cfg)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_figures_over_http_are_the_scripted_ones(api):
    script = Script(prefill_tok_s=10_000, decode_tok_s=80, serial_prefill=True)
    result = fake_run(script, api=api)
    (size,) = result["sizes"]
    # counted by the server: count_tokens where the API has it, else a probe's usage
    assert size["counted_by"] == (
        "count_tokens" if api == "anthropic" else "usage.prompt_tokens of a probe request"
    )
    assert abs(size["tokens"] - 2000) <= 20
    c1, c2 = result["cells"]
    assert (c1["concurrency"], c2["concurrency"]) == (1, 2)
    assert (c1["requests"], c2["requests"], c1["errors"], c2["errors"]) == (2, 4, 0, 0)
    assert c1["prompt_tokens"] == size["tokens"] and c1["completion_tokens"] == 16
    prefill_s = size["tokens"] / 10_000
    assert c1["ttft_ms"]["median"] == pytest.approx(prefill_s * 1000, rel=NOISE)
    assert c1["prefill_tok_s"]["median"] == pytest.approx(10_000, rel=NOISE)
    assert c1["decode_tok_s"]["median"] == pytest.approx(80, rel=NOISE)
    assert c2["decode_tok_s"]["median"] == pytest.approx(80, rel=NOISE)
    # one prefill at a time: the second request waits for the whole of the first's
    assert c2["wait"]["median"] == pytest.approx(1.0, abs=NOISE)
    assert c2["ttft_ms"]["max"] == pytest.approx(2 * prefill_s * 1000, rel=NOISE)
    # scripted speculation: 9 of 15 drafts accepted in 5 rounds
    assert c1["acceptance"] == pytest.approx(0.6) and c1["tokens_per_round"] == pytest.approx(2.8)
    body = script.bodies[-1]
    assert body["ignore_eos"] is True and body["return_spec_stats"] is True
    assert body["model"] == MODEL  # from GET /v1/models


def test_a_server_that_prefills_both_together_waits_half():
    # and a probe whose one token brought no text still counts the prompt
    script = Script(serial_prefill=False, count_tokens=False, silent_probe=True)
    result = fake_run(script, api="anthropic", runs=1)
    assert result["sizes"][0]["counted_by"] == "usage.prompt_tokens of a probe request"
    assert result["cells"][1]["wait"]["median"] == pytest.approx(0.5, abs=NOISE)


def test_compare_runs_the_same_text_and_prints_ratios(tmp_path, capsys):
    fast, slow = Script(decode_tok_s=100), Script(decode_tok_s=50, prefill_tok_s=5_000)
    with fake_server(fast) as a, fake_server(slow) as b:
        args = ["bench", "serve", "--url", a, "--compare", b, "--scenario", "coding",
                "--contexts", "1500", "--concurrency", "1", "--runs", "1", "--max-tokens", "12",
                "--seed", "3", "--out", str(tmp_path)]  # fmt: skip
        assert ninfer_main(args) == 0
    out = capsys.readouterr().out
    assert "B ÷ A" in out and out.count("| coding | 1500 | 1 |") == 3
    result = json.loads((tmp_path / "serve.json").read_text())
    (ratio,) = result["compare"]
    assert ratio["decode_tok_s"] == pytest.approx(0.5, rel=NOISE)
    assert ratio["ttft_ms"] == pytest.approx(2.0, rel=NOISE)
    # the very same messages went to both (only the salt line differs)
    strip = [json.dumps(body["messages"][1:]) for body in (fast.bodies[-1], slow.bodies[-1])]
    assert strip[0] == strip[1]
    assert (tmp_path / "serve.md").read_text().strip() == out.strip()


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_plots_are_pngs_with_every_line_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    result = fake_run(Script(), contexts="1000,3000", runs=1)
    paths = write_outputs(result, tmp_path, plot=True)
    assert [p.name for p in paths] == ["serve.json", "serve.md", "ttft.png", "prefill.png",
                                       "decode.png"]  # fmt: skip
    for metric, (stem, _, _) in serve_plot.METRICS.items():
        path = tmp_path / f"{stem}.png"
        assert png_size(path) == (800, 500)
        drawn = serve_plot.lines(result, metric)
        assert [line.label for line in drawn] == ["coding C1", "coding C2"]
        assert all(line.xs == [1000, 3000] for line in drawn)
        pixels = imread(path)[:, :, :3]
        if metric == "ttft_ms":  # C2 waits, so its line lies apart from C1's: both visible
            for line in drawn:
                rgb = [int(line.color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
                hits = (abs(pixels - rgb).max(axis=2) < 0.02).sum()
                assert hits > 400, (line.label, hits)  # a legend swatch alone is ~100


# -- 3. a real ninfer-serve on the tiny model ------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = make_state(write_serve_model(tmp_path_factory.mktemp("bench-serve-model")))
    with serving(state, frontends_host(), api_key=KEY) as srv:
        yield srv


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_against_ninfer_serve_both_scenarios(server, capsys, api):
    args = ["bench", "serve", server.url, "--api", api, "--api-key", KEY, "--contexts", "1500",
            "--runs", "1", "--max-tokens", "4", "--json"]  # fmt: skip
    assert ninfer_main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["endpoints"][0]["model"] == MODEL_ID
    assert [(c["scenario"], c["concurrency"]) for c in result["cells"]] == [
        ("coding", 1), ("coding", 2), ("agent", 1), ("agent", 2)
    ]  # fmt: skip
    counted_by = "count_tokens" if api == "anthropic" else "usage.prompt_tokens of a probe request"
    for size in result["sizes"]:
        assert abs(size["tokens"] - 1500) <= 16 and size["counted_by"] == counted_by, size
    for cell in result["cells"]:
        assert cell["errors"] == 0, cell["first_error"]
        assert cell["ttft_ms"]["median"] > 0 and abs(cell["prompt_tokens"] - 1500) <= 16
    if api == "openai":  # ignore_eos: every answer is --max-tokens long
        assert all(c["completion_tokens"] == 4 for c in result["cells"])
    assert "| agent | 1500 | 2 |" in markdown(result)


def test_speculation_figures_from_a_speculating_ninfer_serve(tmp_path):
    from ninfer_core.spec.config import SpecConfig

    spec = SpecConfig(spec="ngram", draft_tokens=3)
    with serving(make_state(write_serve_model(tmp_path), spec=spec)) as srv:
        cfg = ServeBenchConfig(url=srv.url, scenario="coding", contexts="1500",
                               concurrency="1", runs=1, max_tokens=24, seed=5)  # fmt: skip
        (cell,) = run_serve_bench(cfg)["cells"]
    # usage.spec_stats, asked for with return_spec_stats: one round at least per request
    assert cell["errors"] == 0 and cell["tokens_per_round"] >= 1
    assert cell["acceptance"] is None or 0 <= cell["acceptance"] <= 1


def test_a_wrong_api_key_fails_as_one_line(server, capsys):
    assert ninfer_main(["bench", "serve", server.url, "--api-key", "nope", "--runs", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ninfer bench: error: GET ") and "401" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_unreachable_server_is_one_clear_line(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert ninfer_main(["bench", "serve", "--url", f"http://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ninfer bench: error: GET http://127.0.0.1:{port}/v1/models failed")
    assert len(err.strip().splitlines()) == 1


def test_out_without_matplotlib_names_the_extra_before_any_request(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    script = Script()
    with fake_server(script) as url:
        assert ninfer_main(["bench", "serve", "--url", url, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "pip install 'ninfer[plot]'" in err and len(err.strip().splitlines()) == 1
    assert script.bodies == []  # stopped before the first request, not after the run
