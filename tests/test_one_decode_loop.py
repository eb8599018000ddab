"""One runtime, one decode loop: `ninfer generate`, `Engine.generate` and the server run the
same request through the same engine steps, so their greedy tokens are identical.

Tokens are recorded where every path meets, `Engine.add` (the server's `submit` calls it
too), so the comparison is of ids, not of text a frontend may have reshaped.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from serve_fixtures import MODEL_ID, make_state, serving, write_serve_model
from text_fixtures import reference_tokenizer

from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine import Engine, EngineConfig, GenerationRequest, RuntimeSpec, build_runtime
from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.request import RequestResult, TokenEvent
from ninfer_core.errors import UnknownNameError
from ninfer_core.generation import GenerationStats, one_request_engine, stream
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 24
RAW = "the weather today"
CHAT = [{"role": "user", "content": "What is the weather like today?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The server tests' tiny fp32 Qwen3: trained BPE tokenizer, chat template, im_end eos."""
    return write_serve_model(tmp_path_factory.mktemp("one-loop"))


@pytest.fixture(scope="module")
def tiny(model_dir):
    """(loaded model, host, device) for `model_dir`, fp32."""
    host, device = create_host(), probe_device(use_cuda=False)
    loaded = load_model(model_dir, host=host, device=device, runtime=RuntimeConfig(dtype="fp32"))
    return loaded, host, device


@pytest.fixture
def recorded(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, sampled ids) of every request any engine takes while the test runs."""
    seen: list[tuple[list[int], list[int]]] = []
    real_add = Engine.add

    def add(self, request, sink=None):
        sink = sink if sink is not None else RequestResult(request.request_id)
        tokens: list[int] = []
        seen.append((list(request.prompt_ids), tokens))

        def both(event):
            if isinstance(event, TokenEvent):
                tokens.extend(event.token_ids)
            sink(event)

        real_add(self, request, both)
        return sink

    monkeypatch.setattr(Engine, "add", add)
    return seen


def generate_cli(capsys, model_dir, *args: str) -> str:
    code = main(["generate", str(model_dir), "--greedy", "--max-new", str(NEW), "--dtype", "fp32",
                 "--max-context", "2048", *args])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out.removesuffix("\n")


def engine_result(tiny, ids: list[int]) -> RequestResult:
    """`Engine.generate` on an engine configured as the server fixture's."""
    model, host, device = tiny
    with Engine(model, EngineConfig(max_context=2048), host=host, device=device) as engine:
        request = GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=NEW)
        [result] = engine.generate([request])
    return result


@pytest.mark.parametrize("chat", [False, True], ids=["raw-prompt", "chat-template"])
def test_generate_engine_and_server_give_the_same_greedy_tokens(
    model_dir, tiny, recorded, capsys, chat
):
    tok = reference_tokenizer(model_dir)
    if chat:
        ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        cli_text = generate_cli(capsys, model_dir, "--prompt", CHAT[0]["content"])
        route, body = "/v1/chat/completions", {"messages": CHAT}
    else:
        ids = tok.encode(RAW)
        cli_text = generate_cli(capsys, model_dir, "--prompt", RAW, "--raw")
        route, body = "/v1/completions", {"prompt": RAW}
    engine = engine_result(tiny, ids)
    with serving(make_state(model_dir)) as srv:
        body = {"model": MODEL_ID, "max_tokens": NEW, "temperature": 0, **body}
        answer = httpx.post(srv.url + route, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    server_text = choice["message"]["content"] if chat else choice["text"]

    cli, direct, server = recorded
    assert cli[0] == direct[0] == server[0] == ids  # the same prompt on every path
    assert len(direct[1]) > 4 and len(set(direct[1])) > 2  # a real answer, not one token
    assert cli[1] == direct[1] == server[1] == engine.token_ids
    assert cli_text == engine.text == server_text


def test_stream_yields_each_step_and_frees_the_pages_when_left_early(tiny):
    model, host, device = tiny
    runtime = RuntimeConfig(dtype="fp32", max_context=256)
    engine = one_request_engine(model, host=host, device=device, runtime=runtime)
    free = engine.block_manager.num_free_blocks
    request = GenerationRequest(list(range(10, 40)), SamplingParams(temperature=0.0),
                                max_tokens=40, ignore_eos=True)  # fmt: skip
    stats = GenerationStats()
    pieces = stream(engine, request, stats)
    next(pieces)
    assert stats.completion_tokens == 1 and engine.block_manager.num_free_blocks < free
    for _ in range(3):  # text comes out as the steps make it, not at the end
        before = stats.completion_tokens
        next(pieces)
        assert before < stats.completion_tokens < 40
    pieces.close()  # the caller went away: the request is cancelled, its pages return
    assert not engine.has_work and engine.block_manager.num_free_blocks == free
    engine.check_invariants()


def test_whole_stream_fills_in_the_figures(tiny):
    model, host, device = tiny
    runtime = RuntimeConfig(dtype="fp32", max_context=256)
    engine = one_request_engine(model, host=host, device=device, runtime=runtime)

    def request() -> GenerationRequest:
        return GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0.0), max_tokens=12,
                                 ignore_eos=True)  # fmt: skip

    stats = GenerationStats()
    text = "".join(stream(engine, request(), stats))
    [again] = engine.generate([request()])
    assert text == again.text and stats.token_ids == again.token_ids
    assert (stats.prompt_tokens, stats.completion_tokens, stats.finish_reason) == (4, 12, "length")
    assert stats.prefill_seconds > 0 and stats.decode_seconds > 0 and stats.decode_tok_s > 0


def test_build_runtime_wires_codec_store_pages_and_runner(tiny):
    model, host, device = tiny
    runtime = build_runtime(model, host, device, RuntimeSpec(8, 16, prefix_cache=True))
    assert runtime.kv_codec == "fp32"  # `auto` keeps the model's own precision
    cfg = model.config
    assert (runtime.layout.num_layers, runtime.layout.num_kv_heads, runtime.layout.head_dim) == (
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    assert runtime.layout.num_blocks == runtime.block_manager.num_blocks == 8
    assert runtime.runner.kv_store is runtime.kv_store
    assert runtime.runner.block_manager is runtime.block_manager
    assert runtime.kv_store.compute_dtype == torch.float32
    # The prefix cache's keys are salted with the codec: other encodings never share a page.
    salted = BlockManager(8, 16, enable_prefix_cache=True, salt="kv-codec=fp32")
    assert runtime.block_manager.cache.root == salted.cache.root
    assert RuntimeSpec.for_tokens(33, 16).num_blocks == 3
    with pytest.raises(UnknownNameError, match="int8"):  # the known names are listed
        build_runtime(model, host, device, RuntimeSpec(8, kv_dtype="int3"))


def test_generate_refuses_a_prompt_that_fills_the_context(model_dir, capsys):
    code = main(["generate", str(model_dir), "--prompt", RAW * 20, "--raw", "--dtype", "fp32",
                 "--max-context", "16"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1 and "the context holds 16" in err and len(err.strip().splitlines()) == 1


def test_bench_decode_times_the_engine_path(model_dir, tiny):
    """`ninfer bench decode`'s NInfer figures come from the same engine steps."""
    from ninfer_core.bench.decode import run_ninfer

    ids = list(range(20, 52))
    run = run_ninfer(model_dir, "fp32", ids, new=10, repeats=1)
    request = GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=10,
                                ignore_eos=True)  # fmt: skip
    [direct] = one_request_engine(
        tiny[0], host=tiny[1], device=tiny[2], runtime=RuntimeConfig(dtype="fp32")
    ).generate([request])
    assert run.token_ids == direct.token_ids and len(run.token_ids) == 10
    assert run.decode_tok_s > 0 and run.prefill_tok_s > 0


def test_bench_kv_decodes_over_a_prefilled_pool(tiny):
    from ninfer_core.bench.kv import decode_tok_s

    model, host, device = tiny
    assert decode_tok_s(model, host, device, "int8", context=64, steps=2) > 0
