"""A huge prompt is refused without being tokenized in full, and tokenizing a big one never
stops the server from answering others (issue 13, item 2).

The tokenizer's backend is wrapped by a recorder that counts the characters it is asked to
encode (and, for the liveness test, holds an encode until the test lets it go), so the tests
check the work done and the server's answers rather than timings.
"""

from __future__ import annotations

import threading
from typing import Any

import anthropic
import httpx
import openai
import pytest
from serve_fixtures import MODEL_ID, make_state, serving, write_serve_model

from ninfer_core.text.tokenizer import PIECE_CHARS, TooManyTokensError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: About 8 MiB of text: some 2 million tokens, against a context of 2048.
HUGE = "The quick brown fox jumps over the lazy dog. " * 190_000


class RecordingBackend:
    """The real `tokenizers` backend, counting the characters handed to its encoders; while
    `gate` is set to an unset Event, encodes wait for it (and `entered` tells they do)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.encoded_chars = 0
        #: The longest text given to `encode`, which holds the GIL while it runs.
        self.longest_gil_held = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def _record(self, texts: list[str]) -> None:
        self.encoded_chars += sum(len(t) for t in texts)
        if self.gate is not None:
            self.entered.set()
            self.gate.wait(timeout=60)

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self._record([text])
        self.longest_gil_held = max(self.longest_gil_held, len(text))
        return self.real.encode(text, *args, **kwargs)

    def encode_batch(self, texts: list[str], *args: Any, **kwargs: Any) -> Any:
        self._record(texts)
        return self.real.encode_batch(texts, *args, **kwargs)

    def encode_batch_fast(self, texts: list[str], *args: Any, **kwargs: Any) -> Any:
        self._record(texts)
        return self.real.encode_batch_fast(texts, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = make_state(write_serve_model(tmp_path_factory.mktemp("big-prompt-model")))
    with serving(state) as srv:
        yield srv


@pytest.fixture
def recorder(server, monkeypatch) -> RecordingBackend:
    tokenizer = server.state.tokenizer
    recorder = RecordingBackend(tokenizer.backend)
    monkeypatch.setattr(tokenizer, "backend", recorder)
    return recorder


def test_the_tokenizer_counts_a_long_text_in_pieces_and_stops_past_the_limit(server, recorder):
    tokenizer = server.state.tokenizer
    with pytest.raises(TooManyTokensError) as caught:
        tokenizer.encode(HUGE, add_special_tokens=False, limit=2048)
    assert caught.value.at_least > 2048 and caught.value.limit == 2048
    assert recorder.encoded_chars <= 2 * PIECE_CHARS  # of 8.6 million characters
    # Within the limit, the ids are exactly those of encoding the text whole.
    text = "The quick brown fox. " * (PIECE_CHARS // 10)
    n = len(recorder.real.encode(text, add_special_tokens=False).ids)
    ids = tokenizer.encode(text, add_special_tokens=False, limit=n)
    assert ids == recorder.real.encode(text, add_special_tokens=False).ids
    with pytest.raises(TooManyTokensError):
        tokenizer.encode(text, add_special_tokens=False, limit=n - 1)
    with pytest.raises(TooManyTokensError):  # a short text is checked exactly
        tokenizer.encode("The quick brown fox.", add_special_tokens=False, limit=2)
    # Long texts go through the batch call, which releases the GIL while it works.
    assert recorder.longest_gil_held <= PIECE_CHARS


@pytest.mark.parametrize(
    "text",
    [
        "<|im_start|>" * 20_000,  # added tokens and no whitespace: cuts land inside them
        "word " * 40_000 + "x" * 100_000,  # a long run without whitespace at the end
        "a\n\n  b " * 30_000,
    ],
)
def test_the_piecewise_count_is_a_lower_bound(server, text):
    tokenizer = server.state.tokenizer
    whole = len(tokenizer.backend.encode(text, add_special_tokens=False).ids)
    assert tokenizer.count_at_least(text, limit=10**9) <= whole
    ids = tokenizer.encode(text, add_special_tokens=False, limit=whole)
    assert len(ids) == whole


def test_a_huge_prompt_is_refused_before_it_is_tokenized_in_full(server, recorder):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as oai:
        with pytest.raises(openai.BadRequestError) as chat:
            oai.chat.completions.create(
                model=MODEL_ID, messages=[{"role": "user", "content": HUGE}], max_tokens=5
            )
        with pytest.raises(openai.BadRequestError) as completion:
            oai.completions.create(model=MODEL_ID, prompt=HUGE, max_tokens=5)
    assert chat.value.body["code"] == "context_length_exceeded"
    assert chat.value.body["param"] == "messages"
    assert completion.value.body["code"] == "context_length_exceeded"
    assert completion.value.body["param"] == "prompt"
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as claude:
        messages = [{"role": "user", "content": HUGE}]
        with pytest.raises(anthropic.BadRequestError, match="context"):
            claude.messages.create(model=MODEL_ID, max_tokens=5, messages=messages)
        # Three requests to run, of 8.6 million characters each: a few pieces of each were
        # tokenized.
        assert recorder.encoded_chars <= 3 * 2 * PIECE_CHARS
        # Counting goes past the context (an agent asks how far over it is), up to a
        # million tokens: refused there, having tokenized about that much and no more.
        before = recorder.encoded_chars
        with pytest.raises(anthropic.BadRequestError, match="more than 1,000,000 tokens"):
            claude.messages.count_tokens(model=MODEL_ID, messages=messages)
    counted = recorder.encoded_chars - before
    assert counted < len(HUGE) * 0.75, (counted, len(HUGE))


def test_completions_context_errors_name_the_prompt(server):
    """A prompt that fills the context on its own (token ids here) names `prompt`."""
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with oai, pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL_ID, prompt=[5] * 2048, max_tokens=5)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert caught.value.body["param"] == "prompt"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 500}]}),
        ("/v1/completions", {"prompt": "hi " * 500}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi " * 500}]}),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi " * 500}]}),
    ],
)
def test_health_answers_while_a_big_request_is_tokenized(server, recorder, path, body):
    """The tokenizer is held inside an encode of the request; /health must still answer,
    which it cannot if the encode runs on the event loop."""
    body = {"model": MODEL_ID, "max_tokens": 3, **body}
    if path.endswith("count_tokens"):
        del body["max_tokens"]
    recorder.gate = threading.Event()
    answer: dict[str, httpx.Response] = {}

    def send() -> None:
        answer["response"] = httpx.post(server.url + path, json=body, timeout=60)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert recorder.entered.wait(timeout=30), "the request never reached the tokenizer"
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200
    finally:
        recorder.gate.set()
        sender.join(timeout=60)
    assert answer["response"].status_code == 200, answer["response"].text
