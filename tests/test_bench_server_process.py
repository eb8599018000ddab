"""`ninfer bench isolation` and `ninfer bench soak`, run small against a real ninfer-serve."""

from __future__ import annotations

import pytest

from ninfer_core.bench.isolation import IsolationBenchConfig
from ninfer_core.bench.isolation import render as render_isolation
from ninfer_core.bench.isolation import run_bench as run_isolation
from ninfer_core.bench.soak import (
    KINDS,
    MIB,
    Record,
    SoakBenchConfig,
    carries_text,
    plot,
    windows,
)
from ninfer_core.bench.soak import render as render_soak
from ninfer_core.bench.soak import run_bench as run_soak


@pytest.mark.slow
def test_isolation_hostile_clients_leave_the_victims_text_alone():
    cfg = IsolationBenchConfig(
        victim_tokens=24, prompt_mib=1.0, stop_count=500, embed_inputs=2, flood_clients=2
    )
    result = run_isolation(cfg)
    rows = {r["class"]: r for r in result["rows"]}
    assert result["health_after"] == 200
    assert len(rows) == 7 and rows["alone"]["tok_s"] > 0
    # the fairness cases ran: the other key's embeddings and prompts were served
    assert rows["embeddings flood (2 inputs a call)"]["hostile_status"].get(200, 0) >= 1
    assert rows["one key's flood"]["hostile_status"].get(200, 0) >= 1
    assert set(rows["ordinary short requests"]["hostile_status"]) == {200}
    for row in rows.values():
        assert row["same_text"], row  # greedy: another client must not change the answer
    # a repetition_penalty that underflows to 0 is refused, never run
    assert set(rows["bad sampling values"]["hostile_status"]) == {400}
    assert "| bad sampling values |" in render_isolation(result)


@pytest.mark.slow
def test_soak_counts_every_request_and_reads_rss(tmp_path):
    """Every kind of the mix (cancels, grammars, embeddings, n = 2 included) answers 200;
    the windows count them all, with stream latencies and RSS."""
    cfg = SoakBenchConfig(requests=40, concurrency=2, max_prompt_words=40, max_tokens=4,
                          window_s=2.0, seed=0)  # fmt: skip
    result = run_soak(cfg)
    assert result["statuses"] == {"200": 40}, result["statuses"]
    assert set(result["kinds"]) == set(KINDS), result["kinds"]  # the mix reached each kind
    assert result["health_after"] == 200
    assert 0 < result["rss_start_mib"] <= result["rss_peak_mib"]
    assert result["rss_end_mib"] <= result["rss_peak_mib"]
    rows = result["windows"]
    assert sum(r["requests"] for r in rows) == 40 and not any(r["errors"] for r in rows)
    assert any(r["ttft_p50_ms"] for r in rows) and any(r["gap_p99_ms"] for r in rows)
    assert "| from s | requests |" in render_soak(result)


def test_soak_windows_take_percentiles_of_their_own_requests():
    records = [Record(0.5, "chat", 200, 0.010, (0.001, 0.003)),
               Record(1.5, "chat", 200, 0.030, (0.002,)),
               Record(2.5, "cancel", "hung")]  # fmt: skip
    rows = windows(records, [(0.2, 100 * MIB), (2.2, 120 * MIB)], 2.0)
    assert [r["requests"] for r in rows] == [2, 1] and [r["errors"] for r in rows] == [0, 1]
    assert rows[0]["ttft_p50_ms"] == pytest.approx(30.0) and rows[0]["gap_p99_ms"] == pytest.approx(
        3.0
    )
    assert rows[1]["ttft_p50_ms"] is None and rows[1]["rss_mib"] == 120


def test_soak_plots_its_windows(tmp_path):
    pytest.importorskip("matplotlib", reason="the optional plot extra")
    rows = windows([Record(0.5, "chat", 200, 0.010, (0.001, 0.003))], [(0.2, 100 * MIB)], 2.0)
    paths = plot({"windows": rows}, tmp_path)
    assert [p.name for p in paths] == ["soak_latency.png", "soak_rss.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)


def test_only_events_with_text_time_a_stream():
    assert carries_text({"type": "content_block_delta", "delta": {"text": "a"}})
    assert not carries_text({"type": "ping"}) and not carries_text({"type": "message_start"})
    assert carries_text({"choices": [{"delta": {"content": "a"}}]})
    assert carries_text({"choices": [{"text": "a"}]})
    assert not carries_text({"choices": [{"delta": {"role": "assistant"}}]})
    assert not carries_text({"choices": [], "usage": {"prompt_tokens": 1}})
