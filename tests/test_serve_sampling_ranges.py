"""A sampling value out of its range is a 400 that names the field, on both protocols.

`SamplingParams` refuses the value with a `ValueError` whose first word is the field;
`ServeState.sampling` turns that into a 400 with `param` (OpenAI's error shape has the field,
Anthropic's only a message, which then starts with it). Before this, values such as
`repetition_penalty: 1e-45` were accepted and broke the whole batch's decode step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from litestar.testing import TestClient
from serve_fixtures import MODEL_ID, make_state, write_serve_model

from ninfer_core.plugin_host import create_host
from ninfer_core.serve.app import create_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[TestClient]:
    state = make_state(write_serve_model(tmp_path_factory.mktemp("model")))
    try:
        with TestClient(create_app(state, create_host())) as client:
            yield client
    finally:
        state.engine.close()


OPENAI_CASES = [
    ("repetition_penalty", 1e-45),
    ("repetition_penalty", 1000.0),
    ("temperature", 1e6),
    ("top_p", 0.0),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("top_k", -7),
    ("seed", 2**64),
]


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize(("field", "value"), OPENAI_CASES, ids=[f for f, _ in OPENAI_CASES])
def test_openai_answers_400_naming_the_field(client, route, field, value):
    body = {"model": MODEL_ID, "max_tokens": 2, field: value}
    if route == "chat":
        path, body["messages"] = "/v1/chat/completions", HELLO
    else:
        path, body["prompt"] = "/v1/completions", "Hello"
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field and error["message"].startswith(f"{field} must be")


ANTHROPIC_CASES = [("temperature", 1e6), ("top_p", 0.0), ("top_k", -7)]


@pytest.mark.parametrize(("field", "value"), ANTHROPIC_CASES, ids=[f for f, _ in ANTHROPIC_CASES])
def test_anthropic_answers_400_naming_the_field(client, field, value):
    body = {"model": MODEL_ID, "max_tokens": 2, "messages": HELLO, field: value}
    response = client.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(f"{field} must be")


def test_a_valid_request_still_answers(client):
    body = {"model": MODEL_ID, "max_tokens": 2, "messages": HELLO, "repetition_penalty": 1.1}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
