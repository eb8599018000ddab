"""`ninfer eval-ppl`: perplexity through our runner against transformers' own logits."""

from __future__ import annotations

import json
import math

import pytest
import torch
from checkpoints import write_tiny_qwen3
from text_fixtures import CORPUS, write_model_dir

from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.errors import NInferError
from ninfer_core.eval_ppl import eval_ppl, eval_ppl_file
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.text.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "<|im_start|>user\n" + " ".join(CORPUS[:7]) + "<|im_end|>\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = write_tiny_qwen3(tmp_path_factory.mktemp("hf") / "tiny", vocab_size=512)
    write_model_dir(path)
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "heldout.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def reference_nll(folder, ids: list[int], context: int) -> tuple[float, int]:
    """Summed NLL over the same windows from transformers' logits, in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), context):
            window = torch.tensor(ids[start : start + context])
            if len(window) < 2:
                break
            logits = model(window.unsqueeze(0)).logits[0, :-1].double()
            nll += float(torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum"))
            count += len(window) - 1
    return nll, count


@pytest.mark.parametrize("context", [16, 64])
def test_perplexity_matches_transformers(folder, context):
    loaded = load_model(
        folder, host=create_host(), device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype="fp32"),
    )  # fmt: skip
    ids = Tokenizer.from_artifact(loaded.artifact).encode(TEXT, add_special_tokens=False)
    assert ids.count(1) == 1, "the special token in the text must be read as one token"
    ours = eval_ppl(loaded, ids, context=context)
    nll, count = reference_nll(folder, ids, context)
    assert ours.tokens == count == len(ids) - ours.windows
    assert ours.nll == pytest.approx(nll, rel=1e-5)
    assert ours.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_command_prints_the_same_figure(folder, text_file, capsys):
    expected = eval_ppl_file(folder, text_file, context=32, runtime=RuntimeConfig(dtype="fp32"))
    code = main(["eval-ppl", str(folder), str(text_file), "--context", "32", "--dtype", "fp32",
                 "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["tokens"] == expected.tokens
    assert out["perplexity"] == pytest.approx(expected.perplexity, rel=1e-9)
    assert main(["eval-ppl", str(folder), str(text_file), "--max-tokens", "10"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("perplexity ") and "over 9 tokens in 1 windows of 512" in line


def test_bad_input_is_one_clear_line(folder, text_file, tmp_path, capsys):
    assert main(["eval-ppl", str(folder), str(tmp_path / "absent.txt")]) == 1
    err = capsys.readouterr().err
    assert "absent.txt: cannot read text" in err and len(err.strip().splitlines()) == 1
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["eval-ppl", str(folder), str(empty)]) == 1
    assert "shorter than two tokens" in capsys.readouterr().err
    with pytest.raises(NInferError, match="at least 2"):
        eval_ppl_file(folder, text_file, context=1)
