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
