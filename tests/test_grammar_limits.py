"""Grammars that compile but cannot get going are 400s before any decoding, with a bounded
body; a grammar that still dead-ends mid-answer ends its request with a 400-class error.

The built-in model (SmolLM2's vocabulary) behind a real server; the four grammars are the
ones that used to answer 500 "the step failed ... outside the request's grammar" with
llguidance's whole state (253 KB) in the body: a regex repeating a repeat, the empty class,
`"a"{1000000}` in GBNF and a GBNF of 8,000 alternatives.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_fixtures import MODEL_ID, make_state, serving

from ninfer_core.builtin_model import BUILTIN_ARTIFACT
from ninfer_core.sampling.grammar import MAX_REASON_CHARS, GrammarError, bounded

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALTERNATIVES = " | ".join(f'"w{i}x"' for i in range(8000))
CASES = {
    "repeated repeat": {"structured_outputs": {"regex": "(x{1000}){1000}"}},
    "empty class": {"structured_outputs": {"regex": r"[^\s\S]"}},
    "huge gbnf repeat": {"grammar": 'root ::= "a"{1000000}'},
    "8000 alternatives": {"grammar": f"root ::= {ALTERNATIVES}"},
}


@pytest.fixture(scope="module")
def server():
    with serving(make_state(BUILTIN_ARTIFACT, max_concurrency=2)) as srv:
        yield srv


def chat(server, stream: bool, **extra) -> httpx.Response:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Say x."}],
            "max_tokens": 8, "stream": stream, **extra}  # fmt: skip
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_grammar_that_cannot_start_is_a_400_with_a_bounded_body(server, name, stream, caplog):
    with caplog.at_level(logging.INFO):
        r = chat(server, stream, **CASES[name])
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "grammar" in error["message"] and len(r.content) < 1000, r.text[:1200]
    assert "<state>" not in r.text
    assert sum(len(rec.getMessage()) for rec in caplog.records) < 5000
    assert chat(server, False).status_code == 200  # the server goes on


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_grammar_that_dead_ends_mid_answer_ends_its_request_with_a_400(server, stream, caplog):
    """A grammar that passes the first tokens and fails later: ended as the request's own
    error (400-class), the message bounded, one log line; a request beside it is unharmed.
    The request's matcher is made to refuse its third token."""
    grammars = server.state.engine.grammars
    real = grammars.matcher

    def failing_later(constraint):
        matcher = real(constraint)
        consume, count = matcher.consume, [0]

        def consume_then_fail(token):
            count[0] += 1
            return consume(token) and count[0] < 3

        matcher.consume = consume_then_fail
        return matcher

    regex = {"structured_outputs": {"regex": "[a-z ]{1,40}"}}
    grammars.matcher = failing_later
    try:
        with caplog.at_level(logging.WARNING), ThreadPoolExecutor(2) as pool:
            doomed = pool.submit(chat, server, stream, **regex)
            plain = pool.submit(chat, server, False)
            doomed, plain = doomed.result(), plain.result()
    finally:
        grammars.matcher = real
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"]
    if stream:
        assert doomed.status_code == 200  # the stream had begun: its last event says why
        events = [json.loads(line[6:]) for line in doomed.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        error = events[-1]["error"]
    else:
        assert doomed.status_code == 400, doomed.text[:500]
        error = doomed.json()["error"]
    assert error["type"] == "invalid_request_error", error
    assert "grammar failed while decoding" in error["message"]
    assert len(error["message"]) < MAX_REASON_CHARS + 100
    lines = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(lines) == 1 and not lines[0].exc_info, [rec.getMessage() for rec in lines]


def test_grammar_errors_carry_one_bounded_line():
    long = "x" * 10_000 + "\n<state>" + json.dumps({"a": 1})
    assert len(bounded(long)) == MAX_REASON_CHARS and "<state>" not in bounded(long)
    assert str(GrammarError(long)) == bounded(long)
