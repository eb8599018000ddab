"""The plugin packages in `examples/`, installed as users install them (`pip install
./examples/<package>`), loaded through their `ninfer` entry points and used end to end.

Each test skips, naming the pip command, when its package is not installed: the examples are
separate distributions, and only an installed one has the entry point under test.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import httpx
import pytest
from serve_fixtures import make_state, serving, write_serve_model
from text_fixtures import reference_tokenizer

from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine import Engine, EngineConfig, GenerationRequest
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KV_CODEC_DIST = "ninfer-example-kv-codec"
ROUTE_DIST = "ninfer-example-route"
NEW = 24
RAW = "the weather today"


def installed(dist: str) -> pytest.MarkDecorator:
    """Skip unless `dist` is installed, saying how to install it."""
    try:
        importlib.metadata.distribution(dist)
        missing = False
    except importlib.metadata.PackageNotFoundError:
        missing = True
    return pytest.mark.skipif(
        missing, reason=f"{dist} is not installed: pip install ./examples/{dist}"
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The server tests' tiny fp32 Qwen3 with a trained BPE tokenizer and a chat template."""
    return write_serve_model(tmp_path_factory.mktemp("examples"))


def generate_cli(capsys, model_dir, kv_dtype: str) -> tuple[str, str]:
    """`ninfer generate --kv-dtype KV_DTYPE` greedy on a raw prompt: (stdout, stderr)."""
    code = main(["generate", str(model_dir), "--greedy", "--max-new", str(NEW), "--dtype", "fp32",
                 "--kv-dtype", kv_dtype, "--prompt", RAW, "--raw"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out, out.err


@installed(KV_CODEC_DIST)
def test_kv_codec_example_generates_exactly_what_bf16_generates(model_dir, capsys):
    """`example-bf16` stores what the built-in `bf16` stores (round to nearest bfloat16) in a
    store of its own, so greedy output is token-identical; any slip in its paging (a wrong
    slot, page or trim) would change the attention and so the tokens."""
    host, device = create_host(), probe_device(use_cuda=False)
    [entry] = [e for e in host.kv_codecs.entries() if e.name == "example-bf16"]
    assert entry.distribution == KV_CODEC_DIST
    assert not [f for f in host.failures if f.distribution == KV_CODEC_DIST]

    # The CLI, as a user runs it: the codec chosen by name from the entry point.
    text, err = generate_cli(capsys, model_dir, "example-bf16")
    assert "kv example-bf16)" in err
    assert text == generate_cli(capsys, model_dir, "bf16")[0]

    # The engine, token ids of a batch of ragged prompts decoded together (several pages each).
    loaded = load_model(model_dir, host=host, device=device, runtime=RuntimeConfig(dtype="fp32"))
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]

    def run(kv_dtype: str) -> tuple[list[list[int]], str]:
        """Greedy tokens per prompt, and the module of the KV store the engine allocated."""
        config = EngineConfig(max_context=2048, block_size=16)
        with Engine(loaded, config, host=host, device=device, kv_dtype=kv_dtype) as engine:
            requests = [GenerationRequest(p, SamplingParams(temperature=0.0), max_tokens=NEW,
                                          ignore_eos=True) for p in prompts]  # fmt: skip
            results = engine.generate(requests)
            return [r.token_ids for r in results], type(engine.runtime.kv_store).__module__

    got, store_module = run("example-bf16")
    assert store_module == "ninfer_example_kv_codec"
    assert got == run("bf16")[0]
    assert all(len(t) == NEW and len(set(t)) > 1 for t in got)  # real, varied output


@installed(ROUTE_DIST)
def test_route_example_serves_tokenize_and_detokenize(model_dir):
    """The real entry-point host mounts the example's routes (beside whatever other frontends
    are installed); they answer with the served model's tokenizer and the core error shape."""
    host = create_host()
    [entry] = [e for e in host.frontends.entries() if e.name == "example-tokenize"]
    assert entry.distribution == ROUTE_DIST
    assert not [f for f in host.failures if f.distribution == ROUTE_DIST]
    text = "Hello world, the weather today"
    want = reference_tokenizer(model_dir).encode(text, add_special_tokens=False)
    with serving(make_state(model_dir), host) as srv:
        tokenized = httpx.post(srv.url + "/tokenize", json={"content": text}, timeout=30)
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json() == {"tokens": want}
        back = httpx.post(srv.url + "/detokenize", json={"tokens": want}, timeout=30)
        assert back.status_code == 200, back.text
        assert back.json() == {"content": text}

        bad = httpx.post(srv.url + "/detokenize", json={"tokens": [1, 10**9]}, timeout=30)
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "tokens"
        assert "outside" in bad.json()["error"]["message"]
        wrong_field = httpx.post(srv.url + "/tokenize", json={"text": text}, timeout=30)
        assert wrong_field.status_code == 400, wrong_field.text


@installed(ROUTE_DIST)
def test_route_example_costs_nothing_until_a_server_asks_for_routes():
    """Loading the plugin host (as `ninfer generate` does) must not import the routes module,
    and litestar with it: a frontend plugin is paid for only by `ninfer-serve`."""
    code = ("import sys; from ninfer_core.plugin_host import create_host; create_host(); "
            "print('ninfer_example_route.routes' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
