"""The Responses API frontend through a real server, driven by the official `openai` SDK.

The tiny random model answers noise, which is enough for text, budgets and storage; tool calls
and reasoning come from `test_serve_openai`'s `ScriptedSampler`, which plays a fixed reply for
a prompt holding a trigger. Everything after the choice of token (detokenizer, the chat
frontend's parsing, the items, the SDK's own stream accumulation) is the real path.
"""

from __future__ import annotations

import json
import time

import httpx
import msgspec
import openai
import pytest
from serve_fixtures import MODEL_ID, frontends_host, make_state, serving, write_serve_model
from test_serve_openai import SCRIPTS, ScriptedSampler

import ninfer_plugins.frontend_responses as frontend_responses
from ninfer_core import hookimpl
from ninfer_core.builtin_model import default_model
from ninfer_core.builtin_tools import TOOLS
from ninfer_core.serve.errors import ApiError
from ninfer_plugins.frontend_responses import ResponsesFrontend
from ninfer_plugins.frontend_responses import wire as rwire
from ninfer_plugins.frontend_responses.store import ResponseStore

#: Small, so that one test can show eviction through the API.
MAX_STORED = 4
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class SmallStore:
    """The frontend with a small store, registered as a plugin of the test's host."""

    @hookimpl
    def register_frontends(self) -> list[ResponsesFrontend]:
        return [ResponsesFrontend(max_stored=MAX_STORED)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = make_state(write_serve_model(tmp_path_factory.mktemp("responses-model")))
    state.engine.postprocess.sampler = ScriptedSampler(
        state.engine.postprocess.sampler, state.tokenizer, SCRIPTS
    )
    with serving(state, frontends_host(("frontend-responses", SmallStore()))) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


def chat_text(client, messages: list[dict], **kwargs) -> str:
    answer = client.chat.completions.create(model=MODEL_ID, messages=messages, **kwargs)
    return answer.choices[0].message.content or ""


def streamed(client, **kwargs) -> list:
    return list(client.responses.create(model=MODEL_ID, stream=True, **kwargs))


def streamed_text(events: list) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


# -- text ----------------------------------------------------------------------------------


def test_text_equals_the_chat_completions_greedy_text(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected = chat_text(client, messages, temperature=0, max_tokens=12)
    kwargs = dict(instructions="Be brief.", input="Hi!", temperature=0, max_output_tokens=12)
    whole = client.responses.create(model=MODEL_ID, **kwargs)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.output_text == expected and expected
    assert whole.output[0].type == "message" and whole.output[0].role == "assistant"
    events = streamed(client, **kwargs)
    assert streamed_text(events) == expected
    assert events[-1].response.output_text == expected
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_the_stream_sends_the_events_in_the_protocols_order(client):
    events = streamed(client, input="Say think first", max_output_tokens=100)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = [k for k in kinds[2:] if not k.endswith(".delta")]
    assert text == [
        *["response.output_item.added", "response.content_part.added"],  # reasoning
        *["response.reasoning_text.done", "response.content_part.done"],
        "response.output_item.done",
        *["response.output_item.added", "response.content_part.added"],  # message
        *["response.output_text.done", "response.content_part.done"],
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "Hello there!"
    assert [i.type for i in final.output] == ["reasoning", "message"]


def test_reasoning_comes_back_as_a_reasoning_item(client):
    chat = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Please think first"}], max_tokens=100
    ).choices[0]
    r = client.responses.create(model=MODEL_ID, input="Please think first", max_output_tokens=100)
    reasoning, message = r.output
    assert (
        message.type == "message"
        and reasoning.type == "reasoning"
        and reasoning.status == "completed"
    )
    assert reasoning.content[0].text == chat.message.reasoning_content
    assert "The user wants a greeting." in reasoning.content[0].text
    assert r.output_text == chat.message.content == "Hello there!"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


def test_usage_counts_the_prompt_and_the_answer(client, server):
    r = client.responses.create(
        model=MODEL_ID, input="How are you?", max_output_tokens=5, extra_body={"ignore_eos": True}
    )
    prompt = server.state.render([{"role": "user", "content": "How are you?"}])
    assert r.usage.input_tokens == len(prompt) and r.usage.output_tokens == 5
    assert r.usage.total_tokens == len(prompt) + 5
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_max_output_tokens_ends_incomplete(client):
    kwargs = dict(input="Tell me a story", max_output_tokens=3, extra_body={"ignore_eos": True})
    r = client.responses.create(model=MODEL_ID, **kwargs)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[-1].status == "incomplete"
    events = streamed(client, **kwargs)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_the_stream_helper_of_the_sdk_accumulates_the_response(client):
    with client.responses.stream(
        model=MODEL_ID, input="Please think first", max_output_tokens=100
    ) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == "Hello there!"


# -- conversation state ----------------------------------------------------------------------


def test_previous_response_id_equals_sending_the_whole_conversation(client):
    first = client.responses.create(
        model=MODEL_ID, input="Hello world!", instructions="Be brief.", temperature=0,
        max_output_tokens=8,
    )  # fmt: skip
    follow = dict(temperature=0, max_output_tokens=8)
    chained = client.responses.create(
        model=MODEL_ID, previous_response_id=first.id, input="And then?", **follow
    )
    # the instructions are not carried over, as OpenAI documents
    whole = [
        {"role": "user", "content": "Hello world!"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "And then?"},
    ]
    resent = client.responses.create(model=MODEL_ID, input=whole, **follow)
    assert chained.output_text == resent.output_text
    assert chained.usage.input_tokens == resent.usage.input_tokens
    assert chained.previous_response_id == first.id
    messages = [
        {"role": "user", "content": "Hello world!"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert chained.output_text == chat_text(client, messages, temperature=0, max_tokens=8)


def test_a_function_tool_call_round_trip(client):
    first = client.responses.create(
        model=MODEL_ID, input="What is the weather in Paris?", tools=[WEATHER],
        max_output_tokens=100,
    )  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert first.status == "completed" and first.output_text == ""
    answer = client.responses.create(
        model=MODEL_ID,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21C"}],
        tools=[WEATHER],
        max_output_tokens=100,
    )
    assert answer.output_text == "It is 21 degrees and clear in Paris."


def test_a_streamed_tool_call(client):
    events = streamed(
        client, input="What is the weather in Paris?", tools=[WEATHER], max_output_tokens=100
    )
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[4]
    assert done.name == "get_weather" and json.loads(done.arguments) == {"city": "Paris"}
    assert events[-1].response.output[0].call_id == events[5].item.call_id


def test_tool_choice_none_parses_no_call(client):
    r = client.responses.create(
        model=MODEL_ID, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice="none", max_output_tokens=100,
    )  # fmt: skip
    assert [i.type for i in r.output] == ["message"] and "<tool_call>" in r.output_text


def test_stored_responses_can_be_retrieved_and_deleted(client):
    r = client.responses.create(
        model=MODEL_ID, input="Hi", max_output_tokens=4, metadata={"k": "v"}
    )
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_an_unknown_previous_response_id_is_an_error(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL_ID, input="Hi", previous_response_id="resp_nope")
    error = caught.value.body
    assert error["param"] == "previous_response_id" and error["type"] == "invalid_request_error"
    huge = "resp_" + "x" * 1_000_000  # not echoed back whole
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL_ID, input="Hi", previous_response_id=huge)
    assert len(caught.value.body["message"]) < 300


def test_the_store_is_bounded_and_evicts_the_least_recently_used(client):
    ids = [
        client.responses.create(model=MODEL_ID, input=f"n{i}", max_output_tokens=2).id
        for i in range(MAX_STORED)
    ]
    client.responses.retrieve(ids[0])  # now the most recently used
    client.responses.create(model=MODEL_ID, input="one more", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_ID, input="x", previous_response_id=ids[1])
    assert client.responses.retrieve(ids[0]).id == ids[0]


def test_the_store_bounds_its_characters_too():
    def response(n: int) -> rwire.ResponseObject:
        return rwire.ResponseObject(id=f"resp_{n}", created_at=0, model="m", status="completed",
                                    output=[])  # fmt: skip

    items = [rwire.InputItem(role="user", content="x" * 1000)]
    one = len(msgspec.json.encode(response(0))) + len(msgspec.json.encode(items))
    store = ResponseStore(max_responses=100, max_chars=one * 5 // 2)  # room for two
    for n in range(3):
        assert store.put(response(n), items)
    assert len(store) == 2 and "resp_0" not in store and "resp_2" in store
    assert not store.put(response(9), items * 5)  # alone over the bound: not kept
    assert "resp_9" not in store and len(store) == 2


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(input="Hi", tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
         "input[0].content[0]"),
        (dict(input=[{"role": "tool", "content": "x"}]), "input[0].role"),
        (dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input[0]"),
        (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0].type"),
        (dict(input=[]), "input"),
        (dict(input="Hi " * 5000), "input"),
        (dict(input=[{"role": "user", "content": [{"type": "input_text"}]}]),
         "input[0].content[0].text"),
        (dict(input="Hi", max_output_tokens=0), "max_output_tokens"),
        (dict(input="Hi", max_output_tokens=10**6), "max_output_tokens"),
        (dict(input="Hi", temperature=-1), "temperature"),
        (dict(input="Hi", text={"format": {"type": "xml"}}), "text.format"),
        (dict(input="Hi", background=True), "background"),
        (dict(input="Hi", tool_choice="required"), "tool_choice"),
        (dict(input="Hi", tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}),
         "tool_choice"),
        (dict(input="Hi", metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
        (dict(input="Hi", top_logprobs=21), "top_logprobs"),
        (dict(input="Hi", top_logprobs=-1), "top_logprobs"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_in_openais_shape(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL_ID, **kwargs)
    assert caught.value.body["param"] == param
    assert caught.value.body["type"] == "invalid_request_error"


def test_malformed_bodies_are_400s_and_the_server_keeps_serving(server, client):
    for body in (b"{", b'{"input": 5}', b'{"input": [{"role": 1}]}', b"[]"):
        r = httpx.post(server.url + "/v1/responses", content=body, timeout=10,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="another-model", input="Hi")
    assert client.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=2).usage


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(server, client, monkeypatch):
    generate = server.state.generate

    async def failing(request):
        events = generate(request)
        try:
            yield await anext(events)
            raise ApiError(503, "unavailable", "the server is shutting down")
        finally:
            await events.aclose()

    monkeypatch.setattr(server.state, "generate", failing)
    events = streamed(client, input="Hi", max_output_tokens=50, extra_body={"ignore_eos": True})
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "service_unavailable" and "shutting down" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "service_unavailable"


# -- paths and disconnects -----------------------------------------------------------------


def test_the_routes_answer_without_v1_too(server):
    body = {"model": MODEL_ID, "input": "Hi", "max_output_tokens": 2}
    r = httpx.post(server.url + "/responses", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "response"
    missing = httpx.get(server.url + "/responses/resp_nope", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(server.url + "/chat/completions", json=chat, timeout=30).status_code == 200
    assert httpx.get(server.url + "/models", timeout=10).json()["data"][0]["id"] == MODEL_ID
    bad = httpx.post(server.url + "/chat/completions", content=b"{", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_a_client_that_goes_away_cancels_its_request(server):
    engine = server.state.engine
    baseline = engine.block_manager.num_used_blocks
    body = {"model": MODEL_ID, "input": "Hi", "max_output_tokens": 1500, "ignore_eos": True}

    def wait_for_baseline():
        deadline = time.monotonic() + 5
        while engine.has_work or engine.block_manager.num_used_blocks != baseline:
            assert time.monotonic() < deadline, "the request kept running after the disconnect"
            time.sleep(0.02)

    with httpx.stream("POST", server.url + "/v1/responses", json=body | {"stream": True}) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += line.startswith("event: response.output_text.delta")
            if deltas == 3:
                break
    wait_for_baseline()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/responses", json=body, timeout=0.5)
    wait_for_baseline()
    engine.check_invariants()


# -- the built-in model, unscripted ----------------------------------------------------------


@pytest.fixture(scope="module")
def builtin_client():
    state = make_state(default_model())
    with serving(state, frontends_host(("frontend-responses", frontend_responses))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        yield client, state.options.model_id
        client.close()


def flat(tool: dict) -> dict:
    """A chat tool definition in the Responses API's flat form."""
    return {"type": "function", **tool["function"]}


def test_the_builtin_model_calls_a_tool_and_reads_its_result(builtin_client):
    client, model = builtin_client
    tools = [TOOLS["get_weather"], TOOLS["calculator"]]
    system, question = "You are a helpful assistant.", "What's the weather in Oslo?"
    chat = client.chat.completions.create(
        model=model, tools=tools, temperature=0, max_tokens=48,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    ).choices[0].message  # fmt: skip
    first = client.responses.create(
        model=model, instructions=system, input=question, tools=[flat(t) for t in tools],
        temperature=0, max_output_tokens=48,
    )  # fmt: skip
    calls = [i for i in first.output if i.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in chat.tool_calls or []
    ]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "4C, rain"}
    answer = client.responses.create(
        model=model, instructions=system, previous_response_id=first.id, input=[result],
        tools=[flat(t) for t in tools], temperature=0, max_output_tokens=48,
    )  # fmt: skip
    assert answer.output and answer.usage.input_tokens > first.usage.input_tokens
