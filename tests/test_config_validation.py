"""Hostile config.json files fail in one line naming the field, before anything is allocated.

Each case of issue 13 item 7 (sizes of 1e9-1e12, negative values, strings, infinity,
`max_position_embeddings: 0`, `eos_token_id: "x"`, 100k-deep JSON, `rms_norm_eps: -1`, a yarn
`factor` of 0) is checked on the parser, and a few through the `generate` and `plan` commands.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from checkpoints import write_tiny_qwen3

from ninfer_core.cli.main import main
from ninfer_core.errors import ModelLoadError
from ninfer_core.model.weight_budget import check_weights_fit, planned_weights
from ninfer_core.safe_json import JSONLimitError, loads_limited
from ninfer_core.text.chat_template import ChatTemplate
from ninfer_core.text.generation_config import GenerationDefaults
from ninfer_plugins.model_dense import register_model_families

GOOD = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    "tie_word_embeddings": True,
    "bos_token_id": None,
    "eos_token_id": None,
    "dtype": "float32",
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def parse(raw):
    qwen3 = next(f for f in register_model_families() if f.name == "qwen3")
    return qwen3.parse_config(raw)


def with_(**changes):
    return {**GOOD, **changes}


def test_the_good_config_parses():
    config = parse(GOOD)
    assert (config.num_layers, config.head_dim, config.rope_theta) == (3, 16, 1e6)
    # Exporters that write 4096.0 and HF's defaults (no head_dim, no kv heads) still work.
    config = parse({k: v for k, v in with_(hidden_size=64.0).items() if k != "head_dim"})
    assert config.hidden_size == 64 and config.head_dim == 16


BAD = {
    "layers-1e9": (with_(num_hidden_layers=1e9), "num_hidden_layers"),
    "vocab-1e12": (with_(vocab_size=10**12), "vocab_size"),
    "intermediate-1e9": (with_(intermediate_size=10**9), "intermediate_size"),
    "head_dim-1e9": (with_(head_dim=1e9), "head_dim"),
    "hidden-negative": (with_(hidden_size=-64), "hidden_size"),
    "heads-string": (with_(num_attention_heads="4"), "num_attention_heads"),
    "layers-bool": (with_(num_hidden_layers=True), "num_hidden_layers"),
    "layers-fraction": (with_(num_hidden_layers=2.5), "num_hidden_layers"),
    "hidden-infinity": (with_(hidden_size=math.inf), "hidden_size"),
    "eps-infinity": (with_(rms_norm_eps=math.inf), "rms_norm_eps"),
    "eps-nan": (with_(rms_norm_eps=math.nan), "rms_norm_eps"),
    "eps-negative": (with_(rms_norm_eps=-1), "rms_norm_eps"),
    "positions-0": (with_(max_position_embeddings=0), "max_position_embeddings"),
    "eos-string": (with_(eos_token_id="x"), "eos_token_id"),
    "eos-outside-vocab": (with_(eos_token_id=[2, 300]), "eos_token_id"),
    "bos-negative": (with_(bos_token_id=-1), "bos_token_id"),
    "kv-heads-0": (with_(num_key_value_heads=0), "num_key_value_heads"),
    "heads-not-multiple": (with_(num_key_value_heads=3), "num_key_value_heads=3"),
    "head_dim-odd": (with_(head_dim=15), "head_dim"),
    "hidden-not-multiple": (
        {k: v for k, v in with_(hidden_size=66).items() if k != "head_dim"},
        "hidden_size=66",
    ),
    "tie-string": (with_(tie_word_embeddings="false"), "tie_word_embeddings"),
    "architectures-string": (with_(architectures="Qwen3ForCausalLM"), "architectures"),
    "theta-0": (with_(rope_parameters={"rope_theta": 0, "rope_type": "default"}), "rope_theta"),
    "rope-not-object": (with_(rope_scaling=[1, 2]), "rope_scaling"),
    "yarn-factor-0": (with_(rope_scaling={**YARN, "factor": 0}), "rope_scaling.factor"),
    "yarn-factor-string": (with_(rope_scaling={**YARN, "factor": "4"}), "rope_scaling.factor"),
    "yarn-original-0": (
        with_(rope_scaling={**YARN, "original_max_position_embeddings": 0}),
        "original_max_position_embeddings",
    ),
    "linear-factor-negative": (
        with_(rope_scaling={"rope_type": "linear", "factor": -2}),
        "rope_scaling.factor",
    ),
    "llama3-low-equals-high": (
        with_(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}),
        "rope_scaling.high_freq_factor",
    ),
    "dynamic-factor-missing": (
        with_(rope_scaling={"rope_type": "dynamic"}),
        "rope_scaling.factor",
    ),
}


@pytest.mark.parametrize("raw, field", BAD.values(), ids=BAD.keys())
def test_bad_field_is_one_line_naming_it(raw, field):
    with pytest.raises(ModelLoadError) as info:
        parse(raw)
    message = str(info.value)
    assert field in message and "\n" not in message and message.startswith("config.json: ")


def test_valid_rope_scalings_still_parse():
    assert parse(with_(rope_scaling=YARN)).rope_scaling == YARN
    assert parse(with_(rope_scaling=LLAMA3)).rope_scaling == LLAMA3


# --- JSON limits -------------------------------------------------------------------------


def test_deep_json_is_a_value_error_not_a_recursion_error():
    with pytest.raises(JSONLimitError, match="100,000 levels deep"):
        loads_limited("[" * 100_000 + "]" * 100_000)
    with pytest.raises(JSONLimitError, match="characters"):
        loads_limited('"' + "x" * 100 + '"', max_chars=50)
    # Brackets inside strings are text, not nesting.
    assert loads_limited(json.dumps({"a": "[[[[" * 1000, "b": [[1]]})) == {
        "a": "[[[[" * 1000,
        "b": [[1]],
    }


class _Files:
    """An artifact that serves text files from a dict."""

    def __init__(self, **files: str) -> None:
        self.files, self.path = files, Path("model")

    def read_text(self, name: str) -> str | None:
        return self.files.get(name.replace(".", "_"))


DEEP = "[" * 100_000 + "]" * 100_000


def test_deep_generation_config_and_tokenizer_config_are_refused_in_one_line():
    with pytest.raises(ModelLoadError, match=r"generation_config\.json .*levels deep"):
        GenerationDefaults.from_artifact(_Files(generation_config_json=DEEP))
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json .*levels deep"):
        ChatTemplate.from_artifact(_Files(tokenizer_config_json=DEEP))


# --- weights against the config -----------------------------------------------------------


def test_config_claiming_more_weights_than_the_files_hold_is_refused():
    config = parse(GOOD)
    shapes = {"a": (planned_weights(config) - 1,)}
    artifact = types.SimpleNamespace(
        path=Path("m"), tensor_names=lambda: list(shapes), tensor_shape=shapes.__getitem__
    )
    with pytest.raises(ModelLoadError, match=r"describes .* weights .* hold only"):
        check_weights_fit(config, artifact)
    shapes["a"] = (planned_weights(config),)
    check_weights_fit(config, artifact)


# --- through the commands ----------------------------------------------------------------


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("good"), dtype=torch.float32)


def hostile_dir(good_dir: Path, tmp_path: Path, config_text: str) -> Path:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in good_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(config_text)
    return bad


def one_line_error(argv: list[str], capsys) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


CLI_CASES = {
    "layers-1e9": lambda c: {**c, "num_hidden_layers": 1e9},
    "vocab-1e12": lambda c: {**c, "vocab_size": 10**12},
    "rms-eps-negative": lambda c: {**c, "rms_norm_eps": -1},
    "layers-too-many-for-the-file": lambda c: {**c, "num_hidden_layers": 1000},
    "hidden-larger-than-the-file": lambda c: {**c, "hidden_size": 4096, "head_dim": 1024},
}


@pytest.mark.parametrize("command", ["generate", "plan"])
@pytest.mark.parametrize("mutate", CLI_CASES.values(), ids=CLI_CASES.keys())
def test_commands_print_one_line(good_dir, tmp_path, capsys, command, mutate):
    raw = json.loads((good_dir / "config.json").read_text())
    bad = hostile_dir(good_dir, tmp_path, json.dumps(mutate(raw)))
    extra = ["--prompt", "hi", "--raw", "--max-new", "1"] if command == "generate" else []
    err = one_line_error([command, str(bad), *extra], capsys)
    assert f"ninfer {command}: error:" in err


def test_deep_config_json_is_one_line(good_dir, tmp_path, capsys):
    bad = hostile_dir(good_dir, tmp_path, DEEP)
    err = one_line_error(["plan", str(bad)], capsys)
    assert "config.json" in err and "levels deep" in err


def test_serve_prints_one_line(good_dir, tmp_path):
    raw = json.loads((good_dir / "config.json").read_text())
    bad = hostile_dir(good_dir, tmp_path, json.dumps({**raw, "max_position_embeddings": 0}))
    run = subprocess.run(
        [sys.executable, "-m", "ninfer_core.cli.serve", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr and "max_position_embeddings" in run.stderr
    assert run.stderr.strip().count("\n") == 0, run.stderr
