"""`/v1/embeddings` through a real server and the `openai` SDK, against transformers.

The tiny random Qwen3 of `serve_fixtures` with a 32-token prefill chunk, so that a long input
is pooled across several steps. The reference is transformers' `last_hidden_state` (after
the final norm) of the same token ids, pooled (last token or mean) and L2-normalised.
"""

from __future__ import annotations

import base64
import dataclasses
import struct

import httpx
import pytest
import torch
from checkpoints import load_reference
from serve_fixtures import MODEL_ID, make_state, openai_sdk, serving, write_serve_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x * 2\n" * 6]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_serve_model(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    state = make_state(model_dir, max_concurrency=2, prefill_chunk=32)
    with serving(state) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai_sdk(server) as client:
        yield client


@pytest.fixture(params=["last", "mean"])
def pooling(request, server):
    server.state.options.pooling = request.param
    yield request.param
    server.state.options.pooling = "last"


@torch.no_grad()
def expected(reference, ids: list[int], pooling: str) -> torch.Tensor:
    hidden = reference.model(torch.tensor([ids])).last_hidden_state[0].float()  # [T, H]
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0)


def test_vectors_equal_a_pooling_of_transformers_hidden_states(client, server, reference, pooling):
    ids = [server.state.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    assert len(ids[1]) > 64  # pooled over three prefill chunks at least
    answer = client.embeddings.create(model=MODEL_ID, input=TEXTS, encoding_format="float")
    assert answer.object == "list" and answer.model == MODEL_ID
    assert [d.index for d in answer.data] == [0, 1]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    for item, tokens in zip(answer.data, ids, strict=True):
        got = torch.tensor(item.embedding)
        assert got.shape == (64,)
        assert (got - expected(reference, tokens, pooling)).abs().max().item() < TOL
    # Token ids give the same vectors; a second run (its blocks now cached) too.
    again = client.embeddings.create(model=MODEL_ID, input=ids, encoding_format="float")
    for a, b in zip(answer.data, again.data, strict=True):
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding, strict=True)) < 1e-6
    server.state.engine.check_invariants()


def test_base64_is_the_float32_bytes(client, server):
    floats = client.embeddings.create(model=MODEL_ID, input=TEXTS[0], encoding_format="float")
    # The SDK asks for base64 by default and decodes it.
    decoded = client.embeddings.create(model=MODEL_ID, input=TEXTS[0])
    assert decoded.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-7)
    raw = httpx.post(
        server.url + "/v1/embeddings",
        json={"input": [5, 6, 7], "encoding_format": "base64"},
    ).json()
    data = base64.b64decode(raw["data"][0]["embedding"])
    assert len(data) == 64 * 4
    vector = struct.unpack("<64f", data)
    assert sum(x * x for x in vector) == pytest.approx(1.0, abs=1e-5)


def test_a_single_token_id_list_and_a_batch_of_them(client):
    one = client.embeddings.create(model=MODEL_ID, input=[11, 12, 13], encoding_format="float")
    batch = client.embeddings.create(
        model=MODEL_ID, input=[[11, 12, 13], [14, 15], [11, 12, 13]], encoding_format="float"
    )
    assert len(one.data) == 1 and len(batch.data) == 3
    assert batch.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-6)
    assert batch.data[2].embedding == pytest.approx(one.data[0].embedding, abs=1e-6)
    assert batch.usage.prompt_tokens == 8


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": ["a", [1, 2]]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [1, 100000]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": "x " * 5000}, "input"),
        ({"input": "hi", "dimensions": 32}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, None),
        ({"input": 5}, None),
        ({}, None),
        ({"input": "hi", "model": "nope"}, "model"),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(server, body, param):
    response = httpx.post(server.url + "/v1/embeddings", json=body)
    status = 404 if param == "model" else 400
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    server.state.engine.check_invariants()


def test_embeddings_and_completions_share_the_engine(client, server):
    """An embedding queued beside a streaming completion: both answer, nothing leaks."""
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True
    )
    first = next(iter(stream))
    answer = client.embeddings.create(model=MODEL_ID, input=TEXTS, encoding_format="float")
    rest = list(stream)
    assert first and rest and len(answer.data) == 2
    engine = server.state.engine
    assert engine.block_manager.num_used_blocks == 0
    engine.check_invariants()


def test_one_call_may_send_at_most_max_embedding_tokens(client, server):
    """The work one call asks for is bounded (a 2,048-input call of long texts used to hold
    the engine for minutes): past `--max-embedding-tokens` together it is a 400."""
    state = server.state
    kept = state.options
    ids = [list(range(10, 40))] * 3  # 90 tokens together
    state.options = dataclasses.replace(kept, max_embedding_tokens=89)
    try:
        response = httpx.post(server.url + "/v1/embeddings", json={"input": ids})
        fits = httpx.post(server.url + "/v1/embeddings", json={"input": ids[:2]})
    finally:
        state.options = kept
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input" and "90 tokens" in error["message"]
    assert "--max-embedding-tokens" in error["message"]
    assert fits.status_code == 200 and len(fits.json()["data"]) == 2
