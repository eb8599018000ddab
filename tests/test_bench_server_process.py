"""`ninfer bench isolation` and `ninfer bench soak`, run small against a real ninfer-serve."""

from __future__ import annotations

import pytest

from ninfer_core.bench.isolation import IsolationBenchConfig
from ninfer_core.bench.isolation import render as render_isolation
from ninfer_core.bench.isolation import run_bench as run_isolation
from ninfer_core.bench.soak import SoakBenchConfig
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
def test_soak_counts_every_request_and_reads_rss():
    cfg = SoakBenchConfig(requests=12, concurrency=2, max_prompt_words=40, max_tokens=4)
    result = run_soak(cfg)
    assert result["statuses"] == {200: 12}
    assert 0 < result["rss_start_mib"] <= result["rss_peak_mib"]
    assert result["rss_end_mib"] <= result["rss_peak_mib"]
