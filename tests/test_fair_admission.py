"""Fair admission (`Scheduler.next_in_turn`): priority, then the API key with the fewest
slots running, then arrival; `max_pending_per_key`; several keys on one server.

Engines are the tiny fp32 Qwen3 of the other engine tests, stepped by hand with one slot,
so the order in which requests start is the order in which they get their first token.
"""

from __future__ import annotations

import httpx
import pytest
from engine_helpers import prompt, tiny_engine
from serve_fixtures import MODEL_ID, frontends_host, make_state, serving, write_serve_model

from ninfer_core.engine.request import GenerationRequest, OverloadedError
from ninfer_core.sampling import SamplingParams
from ninfer_core.serve.config import ServeConfig

GREEDY = SamplingParams(temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def request(seed: int, **kw) -> GenerationRequest:
    return GenerationRequest(prompt(6, seed=seed), GREEDY, max_tokens=2, ignore_eos=True, **kw)


def start_order(engine, handles) -> list[str]:
    """Request ids in the order they started (first prefill step)."""
    order: list[str] = []
    ids = {h.request_id for h in handles}
    while engine.has_work:
        out = engine.step()
        order += [rid for rid in out.prefill if rid in ids and rid not in order]
    return order


def test_a_flooding_key_does_not_keep_another_key_waiting(engine_model):
    engine = tiny_engine(engine_model, clock=lambda: 0.0, max_concurrency=1)
    flood = [engine.add(request(i, tenant="a")) for i in range(4)]
    other = engine.add(request(9, tenant="b"))
    order = start_order(engine, [*flood, other])
    # "a" holds the slot with its first request; "b" holds none, so it is next
    assert order == [flood[0].request_id, other.request_id, *(h.request_id for h in flood[1:])]


def test_without_keys_the_queue_is_first_come_first_served(engine_model):
    engine = tiny_engine(engine_model, clock=lambda: 0.0, max_concurrency=1)
    handles = [engine.add(request(i)) for i in range(4)]
    assert start_order(engine, handles) == [h.request_id for h in handles]


def test_a_lower_priority_value_starts_first(engine_model):
    engine = tiny_engine(engine_model, clock=lambda: 0.0, max_concurrency=1)
    first = engine.add(request(1))
    engine.step()  # it holds the slot; the rest queue behind it
    late = engine.add(request(2, priority=5))
    urgent = engine.add(request(3, priority=-1))
    plain = engine.add(request(4))
    order = start_order(engine, [late, urgent, plain])
    assert order == [urgent.request_id, plain.request_id, late.request_id]
    assert first.finish is not None


def test_one_key_may_queue_at_most_max_pending_per_key(engine_model):
    engine = tiny_engine(engine_model, clock=lambda: 0.0, max_concurrency=1, max_pending_per_key=2)
    engine.add(request(0, tenant="a"))
    engine.step()  # running: it holds the slot, not a place in the queue
    engine.add(request(1, tenant="a"))
    engine.add(request(2, tenant="a"))
    with pytest.raises(OverloadedError, match="this API key has 2 requests queued") as err:
        engine.add(request(3, tenant="a"))
    assert err.value.retry_after >= 1
    engine.add(request(4, tenant="b"))  # another key still gets in
    engine.add(request(5))  # and so does a request with no key
    while engine.has_work:
        engine.step()
    engine.check_invariants()


@pytest.mark.parametrize("bad", ["a,,b", " , ", "a,"])
def test_an_empty_key_in_the_list_is_refused(bad):
    with pytest.raises(ValueError, match="empty"):
        ServeConfig(api_key=bad)


@pytest.fixture(scope="module")
def two_key_server(tmp_path_factory):
    model_dir = write_serve_model(tmp_path_factory.mktemp("two-keys"))
    state = make_state(model_dir, max_concurrency=2, kv_capacity=4096)
    with serving(state, frontends_host(), api_key="key-a, key-b") as server:
        yield server


def chat(server, key: str, content: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(
        server.url + "/v1/chat/completions", json=body,
        headers={"Authorization": f"Bearer {key}"}, timeout=60,
    )  # fmt: skip


def test_each_listed_key_is_accepted_and_a_tenant_of_its_own(two_key_server):
    assert chat(two_key_server, "key-c", "hi").status_code == 401
    assert chat(two_key_server, "key-a,key-b", "hi").status_code == 401
    long = "the same long system prompt, sent again and again " * 8
    cached = {}
    for key in ("key-a", "key-a", "key-b"):
        r = chat(two_key_server, key, long)
        assert r.status_code == 200, r.text
        details = r.json()["usage"]["prompt_tokens_details"]
        cached.setdefault(key, []).append(details["cached_tokens"])
    # the second request of key-a reads its first's blocks; key-b reads none of them
    assert cached["key-a"][0] == 0 and cached["key-a"][1] > 0 and cached["key-b"] == [0]
    r = httpx.post(
        two_key_server.url + "/v1/messages",
        json={"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": "key-b"}, timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
