"""`tools/train_mtp.py`: the layer it trains and writes is the layer NInfer's `mtp`
strategy loads and runs, computed the same way (transformers' decoder layer of the model's
own class is the reference)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from checkpoints import load_reference, write_tiny_llama
from test_draft_mtp import Target, inputs_for, pages
from text_fixtures import write_model_dir

from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import train_mtp


def test_the_written_layer_drafts_what_the_tool_computes(tmp_path):
    from transformers import AutoTokenizer

    path = write_tiny_llama(tmp_path / "hf", rope_scaling=None)
    write_model_dir(path)
    tok, lm = AutoTokenizer.from_pretrained(path), load_reference(path)
    torch.manual_seed(0)
    mtp = train_mtp.MTPLayer(lm)
    with torch.no_grad():  # a layer unlike its starting point, as a trained one is
        for p in mtp.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    out = train_mtp.save(tok, lm, mtp, tmp_path / "out")

    host = create_host()
    runtime = RuntimeConfig(dtype="fp32")
    target = Target(load_model(out, host=host, device=probe_device(use_cuda=False),
                               runtime=runtime), host)  # fmt: skip
    ids = [(13 * i + 5) % lm.config.vocab_size for i in range(37)]
    table = pages(0, len(ids) + 3)
    hidden = target.hidden(ids, table)
    [entries] = target.drafter().catch_up([inputs_for(ids, table, hidden, 0, len(ids) - 1, 3)])
    got = target.logits(entries).float()
    with torch.no_grad():
        body = lm.model(input_ids=torch.tensor([ids])).last_hidden_state
        pos = torch.arange(len(ids))[None]
        [want] = train_mtp.mtp_logits(lm, mtp, torch.tensor([ids]), body, pos)
    assert got.shape == want[0].shape == (len(ids) - 1, lm.config.vocab_size)
    assert (got - want[0]).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want[0].argmax(-1))


def _transcript(ids: list[int], answer_from: int, label: str = "json") -> dict:
    return {"class": label, "ids": torch.tensor(ids), "answer_from": answer_from}


def test_dedupe_keeps_the_first_of_identical_transcripts():
    a, b = _transcript([1, 2, 3], 1, "a"), _transcript([1, 2, 4], 1, "b")
    out = train_mtp.dedupe([a, b, _transcript([1, 2, 3], 2, "c"), b])
    assert [d["class"] for d in out] == ["a", "b"]


def test_windows_lie_at_least_half_in_the_answer():
    seq = 8
    data = [_transcript(list(range(40)), 30), _transcript(list(range(100, 120)), 2)]
    for d in data:
        d["hidden"] = d["ids"][:, None].float().expand(-1, 4)
        d["choice"] = d["ids"] + 1
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        ids, hidden, choice, pos = train_mtp.windows(data, gen, 4, seq)
        assert ids.shape == choice.shape == pos.shape == (4, seq + 1)
        for row in range(4):
            d = data[0] if ids[row, 0] < 100 else data[1]
            start = int(pos[row, 0])
            assert torch.equal(ids[row], d["ids"][start : start + seq + 1])
            assert torch.equal(hidden[row, :, 0], ids[row].float())
            assert start + seq + 1 <= len(d["ids"])
            assert start >= min(d["answer_from"] - seq // 2, len(d["ids"]) - seq - 1)


def test_teacher_states_take_the_engines_tokens_in_the_answer(tmp_path):
    path = write_tiny_llama(tmp_path / "hf", rope_scaling=None)
    lm = load_reference(path)
    vocab = lm.config.vocab_size
    data = [_transcript([(7 * i + 3) % vocab for i in range(n)], a) for n, a in ((12, 5), (9, 4))]
    train_mtp.teacher_states(lm, data, batch=2)
    lm16 = load_reference(path, dtype=torch.bfloat16)
    with torch.no_grad():
        for d in data:
            n, a = len(d["ids"]), d["answer_from"]
            body = lm16.model(input_ids=d["ids"][None]).last_hidden_state[0]
            assert d["hidden"].dtype == torch.bfloat16 and d["hidden"].shape == body.shape
            assert torch.allclose(d["hidden"].float(), body.float(), atol=0.05, rtol=0.02)
            assert torch.equal(d["choice"][a - 1 : n - 1], d["ids"][a:])  # the engine's tokens
            argmax = lm16.lm_head(body).argmax(-1)
            same = (d["choice"][: a - 1] == argmax[: a - 1]).float().mean().item()
            assert same >= 0.75  # transformers' own choice before the answer (bf16 ties aside)


def test_answers_are_the_engines_greedy_tokens_in_prompt_order(tmp_path):
    from ninfer_core.bench.greedy import greedy_stats
    from ninfer_core.generation import PromptText, one_request_engine
    from ninfer_core.text import Tokenizer

    path = write_tiny_llama(tmp_path / "hf", rope_scaling=None, vocab_size=400)
    write_model_dir(path)
    texts = ["def add(a, b):", "The weather today", '{"name": "x"']

    def make_prompts(text: PromptText) -> list[tuple[str, list[int]]]:
        return [(f"p{i}", text.raw_ids(t)) for i, t in enumerate(texts)]

    got = train_mtp.answers(path, make_prompts, new=6, batch=1)
    assert [d["class"] for d in got] == ["p0", "p1", "p2"]
    host, device = create_host(), probe_device(use_cuda=False)
    runtime = RuntimeConfig(dtype="bf16", max_context=64)
    loaded = load_model(path, host=host, device=device, runtime=runtime)
    text = PromptText.from_loaded(loaded, Tokenizer.from_artifact(loaded.artifact))
    engine = one_request_engine(loaded, host=host, device=device, runtime=runtime)
    try:
        for d, (_, prompt) in zip(got, make_prompts(text), strict=True):
            assert d["answer_from"] == len(prompt)
            want = greedy_stats(engine, prompt, 6).token_ids
            assert d["ids"].tolist() == prompt + list(want)
    finally:
        engine.close()
