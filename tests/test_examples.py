"""The plugin packages in `examples/`, installed as users install them (`pip install
./examples/<package>`), loaded through their `ninfer` entry points and used end to end.

Each test skips, naming the pip command, when its package is not installed: the examples are
separate distributions, and only an installed one has the entry point under test.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import httpx
import pytest
import torch
from serve_fixtures import make_state, serving, write_serve_model
from text_fixtures import reference_tokenizer

from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine import Engine, EngineConfig, GenerationRequest
from ninfer_core.kernels.compose import OPS
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KV_CODEC_DIST = "ninfer-example-kv-codec"
ROUTE_DIST = "ninfer-example-route"
LINEAR_DIST = "ninfer-example-linear"
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


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny_checkpoint(request, tmp_path_factory):
    """(folder, transformers model): the fp32 parity checkpoints of test_model_parity."""
    from checkpoints import load_reference, write_tiny_llama, write_tiny_qwen3

    writer = {"qwen3": write_tiny_qwen3, "llama": write_tiny_llama}[request.param]
    path = writer(tmp_path_factory.mktemp(request.param))
    return path, load_reference(path)


@installed(LINEAR_DIST)
def test_linear_example_keeps_fp32_parity_with_transformers(tiny_checkpoint):
    """`--kernel linear=example-linear`: every projection through the example's `F.linear`,
    everything else through the core's reference; logits within the reference's tolerance
    of transformers, prefill and decode through the paged KV cache."""
    from test_model_parity import BLOCK, TOL, max_err, prompt, reference_logits

    from ninfer_core.engine import RuntimeSpec, Sequence, build_runtime

    path, ref = tiny_checkpoint
    host, device = create_host(), probe_device(use_cuda=False)
    assert not [f for f in host.failures if f.distribution == LINEAR_DIST]
    runtime = RuntimeConfig(dtype="fp32", kv_dtype="fp32", kernel="linear=example-linear")
    loaded = load_model(path, host=host, device=device, runtime=runtime)
    served = {c.op: c.backend for c in loaded.kernels}
    assert served == {op: "torch" for op in OPS} | {"linear": "example-linear"}
    assert type(loaded.ops.linear.__self__).__module__ == "ninfer_example_linear"
    assert type(loaded.ops.paged_attention.__self__).__module__ == "ninfer_core.kernels.reference"
    rt = build_runtime(loaded, host, device, RuntimeSpec(48, BLOCK))
    ids = prompt(64)
    seq = Sequence(ids)
    got = torch.cat(
        [rt.runner.run([(seq, 40)], all_tokens=True)]
        + [rt.runner.run([(seq, 1)]) for _ in range(24)]
    )
    assert max_err(got, reference_logits(ref, ids)) <= TOL


@installed(LINEAR_DIST)
def test_linear_example_in_probe_and_unpicked_by_default(capsys):
    """`ninfer probe` shows `linear` served by the example and every other op by the
    reference; its priority is below the reference's, so nothing picks it unasked."""
    host = create_host()
    [entry] = [e for e in host.kernel_backends.entries() if e.name == "example-linear"]
    assert entry.distribution == LINEAR_DIST
    assert main(["probe", "--kernel", "linear=example-linear"]) == 0
    out = capsys.readouterr().out
    assert "linear: example-linear - --kernel linear=example-linear: F.linear" in out
    for op in OPS:
        if op != "linear":
            assert f"{op}: torch (reference)" in out
    assert "kernel backends -> linear=example-linear,attention=torch," in out
    assert main(["probe", "--json"]) == 0
    ops = {r["op"]: r["backend"] for r in json.loads(capsys.readouterr().out)["kernel_ops"]}
    assert ops == dict.fromkeys(OPS, "torch")


@installed(LINEAR_DIST)
def test_linear_example_refuses_quantized_weights_with_the_reason():
    from ninfer_core.errors import UnsupportedChoiceError
    from ninfer_core.kernels.compose import plan_kernels
    from ninfer_core.kernels.workload import KernelWorkload

    host, device = create_host(), probe_device(use_cuda=False)
    q4 = KernelWorkload(frozenset({"bf16", "Q4G64"}), "bf16", torch.bfloat16)
    with pytest.raises(UnsupportedChoiceError) as info:
        plan_kernels(host, device, "auto", "linear=example-linear", workload=q4)
    message = str(info.value)
    assert "no kernel for Q4G64 weights (dense only)" in message
    assert "alternatives: torch" in message
    dense = KernelWorkload(frozenset({"bf16"}), "bf16", torch.bfloat16)
    [linear] = [c for c in plan_kernels(host, device, "example-linear", workload=dense)
                if c.op == "linear"]  # fmt: skip
    assert linear.backend == "example-linear"
