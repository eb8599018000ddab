"""Shutdown: when the graceful period runs out, every client gets its protocol's ending.

A real uvicorn server (`ServerThread`, the server `ninfer-serve` runs) with the OpenAI and
Anthropic frontends and an engine slowed to a few steps per second, so that requests are
still running and queued when the period ends; raw `httpx` reads the bytes each client got.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from litestar import get
from serve_fixtures import (
    MODEL_ID,
    frontends_host,
    make_state,
    serving,
    wait_for,
    write_serve_model,
)

from ninfer_core import hookimpl
from ninfer_core.plugin_types import Frontend
from ninfer_core.serve.config import ConnectionLimits
from ninfer_core.serve.limits import until_disconnect
from ninfer_core.serve.shutdown import SHUTTING_DOWN
from ninfer_core.support import Support

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}
MESSAGE = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}
LONG = {"max_tokens": 1500, "ignore_eos": True}


class Stuck(Frontend):
    """A route that never answers by itself (like a request busy outside the engine); the
    protocol's defaults for its optional members (no error paths of its own)."""

    name = "stuck"
    description = "a test frontend with a route that waits forever"

    def supports(self, device) -> Support:
        return Support.yes()

    def route_handlers(self, state) -> list:
        @get("/v1/stuck")
        async def stuck() -> dict:
            await asyncio.sleep(3600)
            return {}

        return [stuck]


class StuckPlugin:
    @staticmethod
    @hookimpl
    def register_frontends():
        return [Stuck()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_serve_model(tmp_path_factory.mktemp("serve-shutdown-model"))


def slowed(engine, seconds: float) -> None:
    """Each engine step takes at least `seconds`: a 1,500-token answer outlives the test."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step


def stream_lines(url: str, path: str, body: dict, started: Future) -> tuple[int, list[str]]:
    """A streamed request's status and every line it got, read to the end of the body."""
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        started.set_result(r.status_code)
        return r.status_code, [line for line in r.iter_lines() if line]


def test_every_client_gets_a_protocol_shaped_ending_when_the_grace_period_ends(model_dir):
    state = make_state(model_dir, max_concurrency=2, max_pending_requests=8, kv_capacity=8192)
    slowed(state.engine, 0.02)
    # No answer may end on its own before the grace period does: the Anthropic API has no
    # `ignore_eos`, and a sampled end-of-turn within ~40 tokens ended its stream early.
    state.engine.model_stop_ids = ()
    limits = ConnectionLimits(graceful_shutdown_s=0.5)
    server = serving(state, frontends_host(("stuck", StuckPlugin)), limits=limits,
                     end_requests=True)  # fmt: skip
    # the pool outside: on a failure the server stops first, and its streams with it
    with ThreadPoolExecutor(8) as pool, server as srv:
        engine, url = state.engine, srv.url
        # two running streams, one per protocol
        oai_started, ant_started = Future(), Future()
        oai_stream = pool.submit(
            stream_lines, url, "/v1/chat/completions", {**CHAT, **LONG, "stream": True},
            oai_started,
        )  # fmt: skip
        ant_stream = pool.submit(
            stream_lines, url, "/v1/messages",
            {**MESSAGE, "max_tokens": 1500, "stream": True}, ant_started,
        )  # fmt: skip
        wait_for(lambda: len(engine.scheduler.running) == 2)
        assert oai_started.result(timeout=20) == 200 and ant_started.result(timeout=20) == 200
        # three queued: a stream and two whole answers; and one stuck outside the engine
        queued_stream = pool.submit(
            stream_lines, url, "/v1/chat/completions", {**CHAT, **LONG, "stream": True}, Future()
        )
        queued_chat = pool.submit(httpx.post, url + "/v1/chat/completions", json={**CHAT, **LONG},
                                  timeout=30)  # fmt: skip
        queued_message = pool.submit(
            httpx.post, url + "/v1/messages", json={**MESSAGE, "max_tokens": 1500}, timeout=30
        )
        stuck = pool.submit(httpx.get, url + "/v1/stuck", timeout=30)
        wait_for(lambda: len(engine.scheduler.waiting) == 3)
        time.sleep(0.3)  # the stuck request reaches its handler

        srv.server.should_exit = True  # what SIGTERM does

        status, lines = oai_stream.result(timeout=30)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["message"] == SHUTTING_DOWN and error["code"] == "service_unavailable"

        status, lines = ant_stream.result(timeout=30)
        assert lines[-2:] == ["event: error", lines[-1]], lines[-3:]
        event = json.loads(lines[-1].removeprefix("data: "))
        assert event["type"] == "error" and event["error"]["type"] == "overloaded_error"
        assert event["error"]["message"] == SHUTTING_DOWN

        status, lines = queued_stream.result(timeout=30)
        assert status == 503  # not a 500 from a generator closed while it ran
        assert json.loads(lines[0])["error"]["code"] == "service_unavailable"

        r = queued_chat.result(timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"] == {"message": SHUTTING_DOWN, "type": "server_error",
                                     "param": None, "code": "service_unavailable"}  # fmt: skip
        r = queued_message.result(timeout=30)
        assert r.status_code == 503
        error = {"type": "overloaded_error", "message": SHUTTING_DOWN}
        assert r.json() == {"type": "error", "error": error}
        # uvicorn's cancellation, the last resort, answers in the shape too (not a text 500)
        r = stuck.result(timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    # `serving` closed the engine after the server
    assert not engine.scheduler.running and not engine.scheduler.waiting


class _Waiting:
    """A `Request` whose client never leaves."""

    async def receive(self) -> dict:
        await asyncio.sleep(3600)
        return {}


def test_cancelling_a_wait_for_the_first_event_leaves_the_generator_closable():
    """The queued stream's 500: a handler cancelled in `until_disconnect(anext(events))` then
    closes `events`; that must not find the generator still running."""

    async def scenario() -> None:
        async def events():
            await asyncio.sleep(3600)
            yield 1

        gen = events()
        task = asyncio.ensure_future(until_disconnect(_Waiting(), anext(gen)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen.aclose()  # RuntimeError "already running" before the fix

    asyncio.run(scenario())
