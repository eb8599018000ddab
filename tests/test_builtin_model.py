"""The shipped built-in model: what it is, that it learned something, that it is the default.

Held-out text comes from the training script's own corpus builder (transcripts from
held-out seeds, standard-library files in the held-out split), so these measure the
model on text it never saw. A model that learned nothing scores about its vocabulary
size (4096, the uniform distribution's perplexity); the training report's random
initialisation scored above that.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from ninfer_core.artifact.reader import open_container
from ninfer_core.builtin_model import BUILTIN_ARTIFACT, BUILTIN_NAME, default_model
from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.errors import NInferError
from ninfer_core.eval_ppl import eval_ppl
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.text.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import builtin_corpus

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAIN_SEED = 20261203


@pytest.fixture(scope="module")
def loaded():
    return load_model(
        default_model(), host=create_host(), device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype="fp32"),
    )  # fmt: skip


def test_the_shipped_file_is_a_small_mixed_v3_artifact_with_an_mtp_head():
    art = open_container(BUILTIN_ARTIFACT)
    assert art.version == 3
    assert BUILTIN_ARTIFACT.name == f"{BUILTIN_NAME}.ninfer"
    assert art.header.recipe["name"] == "mixed"
    assert art.header.identity["model_id"] == BUILTIN_NAME
    assert {"text", "mtp"} <= set(art.components)
    assert BUILTIN_ARTIFACT.stat().st_size < 6 * 2**20
    assert art.verify() == []


def _heldout_transcripts(n: int) -> str:
    template = builtin_corpus.ChatTemplate(builtin_corpus.CHAT_TEMPLATE)
    return "".join(
        builtin_corpus.transcript(random.Random(10**9 + TRAIN_SEED + i), template) for i in range(n)
    )


def _heldout_code(chars: int) -> str:
    files = [p for p in builtin_corpus.stdlib_files() if builtin_corpus.is_heldout(p)]
    return files[0].read_text(encoding="utf-8")[:chars]


@pytest.mark.parametrize(("source", "bound"), [("tools", 4.0), ("code", 150.0)])
def test_heldout_perplexity_is_far_below_a_model_that_learned_nothing(loaded, source, bound):
    text = _heldout_transcripts(6) if source == "tools" else _heldout_code(6000)
    ids = Tokenizer.from_artifact(loaded.artifact).encode(text, add_special_tokens=False)
    result = eval_ppl(loaded, ids, context=256)
    assert loaded.config.vocab_size == 4096
    assert result.perplexity < bound, result.perplexity


def test_it_answers_a_tool_request_with_a_well_formed_call(tmp_path, capsys):
    weather = builtin_corpus.TOOLS["get_weather"]
    chat = {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What's the weather in Oslo?"},
        ],
        "tools": [weather, builtin_corpus.TOOLS["calculator"]],
    }
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    code = main(["generate", str(default_model()), "--messages", str(tmp_path / "chat.json"),
                 "--greedy", "--max-new", "48"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    body = out.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    call = json.loads(body)
    assert call["name"] == "get_weather"
    # A 4M-parameter model picks the tool and writes valid arguments; it does not yet
    # reliably copy the city from the question (docs/builtin-model.md).
    assert isinstance(call["arguments"]["city"], str)


def test_a_missing_shipped_file_is_one_clear_error(monkeypatch, tmp_path):
    import ninfer_core.builtin_model as builtin

    monkeypatch.setattr(builtin, "BUILTIN_ARTIFACT", tmp_path / "gone.ninfer")
    with pytest.raises(NInferError, match="reinstall NInfer, or retrain"):
        builtin.default_model()
