"""A tiny model behind a real engine and `ServeState`, for frontend and server tests."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import torch
from checkpoints import write_tiny_qwen3
from text_fixtures import QWEN3_STYLE_TEMPLATE, reference_tokenizer, write_model_dir

import ninfer_plugins.frontend_anthropic as frontend_anthropic
import ninfer_plugins.frontend_openai as frontend_openai
from ninfer_core.cli.serve import ServerThread
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import PluginHost, create_host
from ninfer_core.serve.app import create_app
from ninfer_core.serve.config import API_KEY_ENV, ConnectionLimits
from ninfer_core.serve.shutdown import end_requests as end_outstanding_requests
from ninfer_core.serve.state import ServeOptions, ServeState
from ninfer_core.spec.config import SpecConfig
from ninfer_core.text import ChatTemplate, GenerationDefaults

MODEL_ID = "tiny-qwen3"
ROOT = Path(__file__).resolve().parents[1]


def write_serve_model(path: Path) -> Path:
    """Tiny random Qwen3 with a trained BPE tokenizer and a Qwen3-style chat template."""
    write_tiny_qwen3(path, dtype=torch.float32, vocab_size=400, max_position_embeddings=2048)
    write_model_dir(path, config={"chat_template": QWEN3_STYLE_TEMPLATE})
    im_end = reference_tokenizer(path).convert_tokens_to_ids("<|im_end|>")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    return path


def make_state(model_dir: Path, spec: SpecConfig | None = None, **engine_options) -> ServeState:
    """The model at `model_dir` behind an engine (`spec`: speculative decoding) and its state."""
    host, device = create_host(), probe_device()
    loaded = load_model(model_dir, host=host, device=device, runtime=RuntimeConfig(dtype="fp32"))
    config = EngineConfig(**{"max_context": 2048, **engine_options})
    engine = Engine(loaded, config, host=host, device=device, spec=spec)
    tokenizer = engine.tokenizer
    return ServeState(
        engine=engine,
        tokenizer=tokenizer,
        template=ChatTemplate.from_artifact(loaded.artifact, tokenizer.special_tokens),
        defaults=GenerationDefaults.from_artifact(loaded.artifact),
        options=ServeOptions(model_id=MODEL_ID, default_max_tokens=32),
    )


def frontends_host(*extra: tuple[str, object], anthropic: bool = True) -> PluginHost:
    """A plugin host with the OpenAI frontend, the Anthropic one unless `anthropic` is false,
    and the `extra` (name, plugin) pairs; no entry points, so no installed plugin claims a
    route too."""
    plugins = [("frontend-openai", frontend_openai)]
    if anthropic:
        plugins.append(("frontend-anthropic", frontend_anthropic))
    return create_host(load_entry_points=False, extra_plugins=[*plugins, *extra])


@contextlib.contextmanager
def serving(
    state: ServeState,
    host: PluginHost | None = None,
    *,
    limits: ConnectionLimits | None = None,
    end_requests: bool = False,
    **app_options,
) -> Iterator[ServerThread]:
    """`state` served by a real uvicorn server on a free port (`ServerThread` with `limits`),
    its app built with `host` (`frontends_host()` by default) and `app_options` (api_key=,
    body_timeout_s=, ...); with `end_requests`, the graceful period ends the outstanding
    requests as `ninfer-serve` does. Yields the server with `.state` set; closes the engine
    when done."""
    app = create_app(state, frontends_host() if host is None else host, **app_options)
    ender = (lambda: end_outstanding_requests(app)) if end_requests else None
    try:
        with ServerThread(app, limits=limits, end_requests=ender) as srv:
            srv.state = state
            yield srv
    finally:
        state.engine.close()


def openai_sdk(server: ServerThread) -> openai.OpenAI:
    """The official `openai` SDK as a client of `server`, without retries (a failure is the
    server's answer, not a retry's); a context manager that closes its connections."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def wait_for(condition: Callable[[], object], timeout: float = 20.0) -> None:
    """Polls `condition` until it holds; fails the test after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


# The command as users run it, in a process of its own. Until `frontend-openai` is an entry
# point of the installed package, the shim registers it the way the entry point will.
SERVE_SHIM = """
import sys
import ninfer_core.plugin_host as ph
import ninfer_plugins.frontend_openai as fo
real = ph.create_host
def create_host(**kw):
    host = real(**kw)
    return host if "openai" in host.frontends else real(extra_plugins=[("frontend-openai", fo)])
ph.create_host = create_host
from ninfer_core.cli.serve import main
sys.exit(main(sys.argv[1:]))
"""


def serve_process(model_dir: Path, *options: str) -> subprocess.Popen:
    """`ninfer-serve model_dir` (fp32, a 1024-token context, one thread, then `options`) in a
    child process, without an API key from the environment; text pipes for its output."""
    args = [sys.executable, "-c", SERVE_SHIM, str(model_dir), "--dtype", "fp32",
            "--max-context", "1024", "--threads", "1", *options]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip


def health_status(url: str) -> int:
    """GET /health's status code, or 0 while nothing answers."""
    try:
        return httpx.get(url + "/health", timeout=1).status_code
    except httpx.TransportError:
        return 0
