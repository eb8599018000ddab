"""Fixtures shared by several test modules."""

from __future__ import annotations

import logging

import pytest
import torch
from checkpoints import write_tiny_qwen3
from text_fixtures import write_model_dir

from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--retrain", action="store_true", help="run the tests that retrain the built-in model"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`retrain` tests take about 20 minutes, so they run only when asked for."""
    if config.getoption("--retrain"):
        return
    skip = pytest.mark.skip(reason="retrains the built-in model (~20 min); run with --retrain")
    for item in items:
        if "retrain" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_leftover_log_handlers():
    """A CLI run in-process (`main([...])`) calls `logging.basicConfig`, which gives the
    root logger a handler on the stderr pytest captured for that test; a thread logging
    after the test would then write to a closed stream. Handlers a test added go with it."""
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny GEMMs: a second intra-op thread only adds spin-waits (40x slower on a busy box).
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    """(loaded model, host, device): a 2-layer fp32 Qwen3 for engine tests."""
    path = tmp_path_factory.mktemp("engine-model")
    write_tiny_qwen3(path, vocab_size=400, num_hidden_layers=2, max_position_embeddings=1024)
    write_model_dir(path)
    host, device = create_host(), probe_device(use_cuda=False)
    loaded = load_model(path, host=host, device=device, runtime=RuntimeConfig(dtype="fp32"))
    return loaded, host, device
