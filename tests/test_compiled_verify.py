"""Speculative rounds through compiled graphs (`--compile-decode` with `--spec`).

The round's forward (`engine/compiled_verify.py`) must compute every row as the compiled
decode step computes that token alone, bit for bit in bf16, or greedy output would change
with speculation: checked row by row at contexts on and off page boundaries, for one
sequence and two, and end to end through the engine (mtp, whose rounds all run the
graph, and ngram, whose rounds mix it with plain compiled decode steps). The MTP
drafter's compiled round (catch-up and draft steps in one graph,
`ninfer_plugins/draft_mtp/compiled.py`) only changes what is accepted: in fp32 it drafts
what the eager forwards draft.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from ninfer_core.builtin_model import BUILTIN_ARTIFACT
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.compiled_verify import verify_refusal
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
from ninfer_core.engine.sequence import Sequence
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.sampling import SamplingParams
from ninfer_core.spec.config import SpecConfig
from ninfer_core.text import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import builtin_corpus
from graph_helpers import count_traced

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

EXTRA = [50, 60, 70, 80, 90, 100]


@pytest.fixture(scope="module")
def host_device():
    return create_host(), probe_device(use_cuda=False)


def loaded_as(host_device, dtype: str):
    host, device = host_device
    return load_model(BUILTIN_ARTIFACT, host=host, device=device,
                      runtime=RuntimeConfig(dtype=dtype))  # fmt: skip


@pytest.fixture(scope="module")
def bf16(host_device):
    return loaded_as(host_device, "bf16")


def runtime_for(bf16, host_device, sequences: int = 1, draft_tokens: int = 0):
    host, device = host_device
    spec = RuntimeSpec.for_tokens(2048, compile_decode=True, max_sequences=sequences)
    runtime = build_runtime(bf16, host, device, spec)
    assert runtime.runner.compiled is not None
    if draft_tokens:
        assert runtime.runner.compile_rounds(draft_tokens) is None
    return runtime


def lone_rows(runtime, ids: list[int]) -> torch.Tensor:
    """The compiled decode step's logits for each of EXTRA decoded alone after `ids`."""
    runner, seq = runtime.runner, Sequence(ids + EXTRA)
    runner.run([(seq, len(ids))])
    rows = torch.cat([runner.run([(seq, 1)]) for _ in EXTRA])
    runtime.block_manager.free(seq)
    return rows


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 4000 + 5 for i in range(n)]


@pytest.mark.parametrize("attention", ["operator", "gathered"])
def test_a_rounds_rows_equal_lone_compiled_decodes_bit_for_bit_in_bf16(
    bf16, host_device, attention, monkeypatch
):
    """Through the CPU attention operator where it is built, and through the gathered
    pages (what every other CPU compiles)."""
    if attention == "gathered":
        monkeypatch.setenv("NINFER_CPU_ATTENTION", "0")  # read when the graphs are traced
    lone, rounds = runtime_for(bf16, host_device), runtime_for(bf16, host_device, 1, 3)
    runner = rounds.runner
    traced = count_traced(runner.verify._fn)
    # contexts on and off page boundaries (16-token pages; 47 + 4 rows cross one)
    for n in (40, 47, 150, 321):
        ids = prompt(n)
        want = lone_rows(lone, ids)
        for rows in (4, 3, 2):
            seq = Sequence(ids + EXTRA[:1])
            runner.run([(seq, n)])
            seq.draft_ids = EXTRA[1:rows]
            got = runner.step([(seq, rows)]).logits
            assert torch.equal(got, want[:rows]), (n, rows)
            seq.draft_ids = []
            rounds.block_manager.free(seq)
    assert runner.verify.failed is None and runner.verify.steps == 12
    assert len(traced) == 1  # one graph (batch 1, width 4): the rest were direct calls


def test_two_sequences_in_one_round_equal_their_lone_decodes(bf16, host_device):
    lone, rounds = runtime_for(bf16, host_device), runtime_for(bf16, host_device, 2, 3)
    a, b = prompt(33, 1), prompt(78, 2)
    want = [lone_rows(lone, ids) for ids in (a, b)]
    sa, sb = Sequence(a + EXTRA[:1]), Sequence(b + EXTRA[:1])
    rounds.runner.run([(sa, len(a))])
    rounds.runner.run([(sb, len(b))])
    sa.draft_ids, sb.draft_ids = EXTRA[1:4], EXTRA[1:2]  # 4 rows and 2 (padded to 4)
    out = rounds.runner.step([(sa, 4), (sb, 2)])
    assert torch.equal(out.logits[:4], want[0][:4])
    assert torch.equal(out.logits[4:], want[1][:2])
    assert rounds.runner.verify.steps == 1


def json_prompts(bf16) -> list[list[int]]:
    tokenizer = Tokenizer.from_artifact(bf16.artifact)
    template = builtin_corpus.ChatTemplate(builtin_corpus.CHAT_TEMPLATE)
    out = []
    for seed in (7, 11):
        transcript = builtin_corpus.transcript(random.Random(seed), template)
        cut = transcript.index("<tool_call>") + len("<tool_call>\n")
        out.append(tokenizer.encode(transcript[:cut], add_special_tokens=False))
    return out


def generate(
    loaded, host_device, spec: SpecConfig | None, prompts, compile_decode: bool, kv: str = "auto"
):
    host, device = host_device
    config = EngineConfig(kv_capacity=2048)
    engine = Engine(loaded, config, host=host, device=device, spec=spec, kv_dtype=kv,
                    compile_decode=compile_decode)  # fmt: skip
    params = SamplingParams(temperature=0.0)
    requests = [GenerationRequest(ids, params, max_tokens=64, ignore_eos=True) for ids in prompts]
    return [r.token_ids for r in engine.generate(requests)], engine


@pytest.mark.parametrize("strategy", ["mtp", "ngram"])
def test_greedy_output_is_the_compiled_baselines_in_bf16(bf16, host_device, strategy):
    prompts = json_prompts(bf16)
    want, _ = generate(bf16, host_device, None, prompts, True)
    got, engine = generate(bf16, host_device, SpecConfig(spec=strategy, draft_tokens=3),
                           prompts, True)  # fmt: skip
    assert got == want
    assert engine.runner.verify.steps > 0 and engine.runner.verify.failed is None
    if strategy == "mtp":
        assert engine.drafter.compiled.steps > 0 and engine.drafter.compiled.failed is None
        assert engine.spec_counters.accepted > engine.spec_counters.drafted // 2


def test_compiled_draft_steps_draft_what_the_eager_ones_draft_in_fp32(host_device):
    fp32 = loaded_as(host_device, "fp32")
    prompts = json_prompts(fp32)
    spec = SpecConfig(spec="mtp", draft_tokens=4)
    eager_ids, eager = generate(fp32, host_device, spec, prompts, False)
    ids, compiled = generate(fp32, host_device, spec, prompts, True)
    assert compiled.drafter.compiled.steps > 0
    assert compiled.drafter.compiled._fn.direct_shapes >= 1  # rounds after the first: direct
    assert ids == eager_ids
    counts = [(e.spec_counters.drafted, e.spec_counters.accepted) for e in (eager, compiled)]
    assert counts[0] == counts[1]


#: How far the compiled step's logits over coded KV may be from eager's, and so how far
#: apart eager's top two may be where it picks the other one: its fused fp32 kernels
#: round a key a hair differently, which moves a value across a code boundary now and
#: then (measured on this model: up to 0.03 with int8, 0.16 with rk8v4, whose 4-bit V
#: codes are 18x coarser; about 1e-5 over float pages).
CODED_NEAR_TIE = {"int8": 0.1, "rk8v4": 0.3}


def forced_rows(runner, ids: list[int], n: int, forced: list[int] | None = None):
    """n greedy ids after `ids` (or the `forced` ones) and the logits each was chosen from."""
    seq, out, rows = Sequence(list(ids)), [], []
    logits = runner.run([(seq, len(ids))])
    for i in range(n):
        rows.append(logits[0])
        out.append(forced[i] if forced else int(logits[0].argmax()))
        seq.append_token(out[-1])
        if i < n - 1:
            logits = runner.run([(seq, 1)])
    runner.block_manager.free(seq)
    return out, torch.stack(rows)


@pytest.mark.parametrize("kv", ["int8", "rk8v4"])
def test_coded_kv_compiled_greedy_ids_follow_eager_and_mtp_rounds_keep_them(host_device, kv):
    """int8 and rk8v4 pages read in place by the compiled step and the verifying forward
    (head dim 32: the CPU kernel), their own rows coded as the store writes them after the
    graph, in fp32. Eager, fed the compiled step's tokens, has each as its argmax, or
    within `CODED_NEAR_TIE` of it; MTP rounds through the verify graph give the compiled
    step's greedy ids exactly (a round's rows code their keys as the lone steps do)."""
    fp32 = loaded_as(host_device, "fp32")
    host, device = host_device
    prompts = json_prompts(fp32)
    runners = [
        build_runtime(fp32, host, device, RuntimeSpec.for_tokens(
            2048, compile_decode=compiled, kv_dtype=kv)).runner
        for compiled in (False, True)
    ]  # fmt: skip
    parted = 0
    for ids in prompts:
        got, got_rows = forced_rows(runners[1], ids, 64)
        _, rows = forced_rows(runners[0], ids, 64, forced=got)
        assert (got_rows - rows).abs().max().item() <= CODED_NEAR_TIE[kv]
        for token, row in zip(got, rows, strict=True):
            best = int(row.argmax())
            if best != token:
                parted += 1
                assert (row[best] - row[token]).item() <= CODED_NEAR_TIE[kv], (best, token)
    assert parted <= 3, parted  # near-ties, not a drift
    assert runners[1].compiled.steps >= 2 * 63 and runners[1].compiled.failed is None
    want, _ = generate(fp32, host_device, None, prompts, True, kv)
    got, engine = generate(fp32, host_device, SpecConfig(spec="mtp", draft_tokens=3),
                           prompts, True, kv)  # fmt: skip
    assert got == want
    assert engine.runner.verify.steps > 0 and engine.runner.verify.failed is None
    assert 0 < engine.spec_counters.accepted < engine.spec_counters.drafted


def test_refusals_name_the_reason(bf16):
    class NoGraph:
        verify_graph = None

    assert verify_refusal(NoGraph(), None) == "the model family offers no verify graph"

    class Quantized:  # codes it does not describe (the KVStore contract's default)
        dtype = torch.bfloat16
        raw_pages = None

    assert "K and V as computed" in verify_refusal(bf16.model, Quantized())
