"""Property-based requests from the server's own OpenAPI schema (schemathesis): no 5xx.

The schema is the one litestar generates from the frontends' msgspec request types, served at
`/schema/openapi.json`; schemathesis draws bodies from it — valid ones and, in its negative
phases, invalid ones — for every API route. A bounded, reproducible run: a few examples per
operation, derandomized, against a real server on a tiny model with a short context, so a
generated `max_tokens` either fits in a few hundred tokens or is refused with a 400.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from serve_fixtures import MODEL_ID, frontends_host, make_state, serving, write_serve_model

import ninfer_plugins.frontend_responses as frontend_responses

OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("POST", "/v1/responses"),
]
#: Valid bodies and (schemathesis' negative mode) invalid ones; GET /v1/models takes no input
#: to make invalid.
CASES = [
    (m, p, g) for m, p in OPERATIONS for g in GenerationMode if m == "POST" or g.value == "positive"
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = make_state(write_serve_model(tmp_path_factory.mktemp("schemathesis-model")),
                       max_context=256, kv_capacity=1024)  # fmt: skip
    with serving(state, frontends_host(("frontend-responses", frontend_responses))) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/schema/openapi.json")


def served_model(case):
    """A body that names a model names the served one, so a valid body reaches the engine
    (any other name is a 404 before anything else is looked at)."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL_ID
    return case


# schemathesis' own `pytest.from_fixture` sets `request.node._nodeid`, which pytest 9 no longer
# has; so the operations are named here and their strategies drawn with Hypothesis directly.
@pytest.mark.parametrize(
    ("method", "path", "mode"), CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES]
)
def test_no_server_error(api_schema, server, method, path, mode):
    operation = api_schema[path][method]

    @settings(max_examples=15, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode).map(served_model))
    def check(case):
        case.call_and_validate(base_url=server.url, checks=[not_a_server_error], timeout=30)

    check()


def test_the_server_still_serves(server):
    health = httpx.get(server.url + "/health", timeout=10)
    answer = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )
    assert health.status_code == 200 and answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] >= 1
