"""Helpers shared by the hybrid-family tests (`qwen3-next`, `qwen3.5`) against transformers.

A hybrid fixture is the tuple `(reference, loaded, host, device)`: transformers' model
and ours, both fp32, loaded from the same `save_pretrained` folder. The `check_*` functions
are the comparisons every hybrid family must pass, written once so each family's test file
runs the same ones.
"""

from __future__ import annotations

from pathlib import Path

import torch
from engine_helpers import prompt
from text_fixtures import write_model_dir

from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.model_runner import ModelRunner
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
from ninfer_core.engine.sequence import Sequence
from ninfer_core.loading import LoadedModel, load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.sampling import SamplingParams

TOL = 1e-4
#: 3 Gated DeltaNet layers and 1 full-attention layer, not in the default 3:1 order.
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


@torch.no_grad()
def save_perturbed(model: torch.nn.Module, path: Path, seed: int) -> None:
    """Perturb every weight transformers initialises to a constant (the zero-centred
    norms, the gated norm, dt_bias, A_log), so a wrong `1 + w` or a swapped gate cannot
    pass, then `save_pretrained` (fp32) with a tokenizer (the engine needs one)."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "dt_bias")):
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        elif name.endswith("A_log"):  # decays exp(g) spread over (0, 1)
            p.copy_(torch.empty(p.shape).uniform_(-2.0, 1.0, generator=g))
    model.save_pretrained(path)
    write_model_dir(path)


def load_fp32(path: Path) -> tuple[LoadedModel, object, object]:
    """(loaded, host, device): our loader on `path`, fp32 on the CPU."""
    host, device = create_host(), probe_device(use_cuda=False)
    loaded = load_model(path, host=host, device=device, runtime=RuntimeConfig(dtype="fp32"))
    return loaded, host, device


@torch.no_grad()
def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `ids`, one pass without a cache."""
    return reference(torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def reference_greedy(reference, ids: list[int], n: int) -> list[int]:
    """transformers' `generate`: `n` greedy tokens after `ids`, no EOS stop."""
    out = reference.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
        pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def runner_for(hybrid) -> ModelRunner:
    _, loaded, host, device = hybrid
    return build_runtime(loaded, host, device, RuntimeSpec(8, 16, kv_dtype="fp32")).runner


def new_sequence(runner: ModelRunner, ids: list[int]) -> Sequence:
    seq = Sequence(ids)
    seq.state_slot = runner.states.allocate()
    return seq


def engine(hybrid, **config) -> Engine:
    _, loaded, host, device = hybrid
    cfg = EngineConfig(**{"kv_capacity": 1024, "max_concurrency": 4, **config})
    return Engine(loaded, cfg, host=host, device=device, kv_dtype="fp32")


def greedy_request(rid: str, ids: list[int], max_tokens: int) -> GenerationRequest:
    params = SamplingParams(temperature=0.0)
    return GenerationRequest(ids, params, max_tokens=max_tokens, ignore_eos=True, request_id=rid)


def check_one_shot_prefill(hybrid) -> None:
    """A 40-token prompt prefilled in one chunk: our logits at every position equal
    transformers' one pass over it."""
    reference = hybrid[0]
    ids = prompt(40, seed=1)
    runner = runner_for(hybrid)
    ours = runner.run([(new_sequence(runner, ids), len(ids))], all_tokens=True)
    assert (ours - reference_logits(reference, ids)).abs().max().item() <= TOL


def check_chunked_prefill_then_decode(hybrid) -> None:
    """13 + 27 prompt tokens (the states carried between the chunks), then 8 decode
    steps of one token: every row equals transformers' one pass over all 48."""
    reference = hybrid[0]
    ids = prompt(48, seed=2)
    ref = reference_logits(reference, ids)
    runner = runner_for(hybrid)
    seq = new_sequence(runner, ids)
    rows = [runner.run([(seq, 13)], all_tokens=True), runner.run([(seq, 27)], all_tokens=True)]
    rows += [runner.run([(seq, 1)]) for _ in range(8)]
    ours = torch.cat(rows)
    assert ours.shape == ref.shape
    assert (ours[:40] - ref[:40]).abs().max().item() <= TOL
    assert (ours[40:] - ref[40:]).abs().max().item() <= TOL


def check_greedy_generation(hybrid, n: int) -> None:
    """`n` greedy tokens through our engine equal transformers' `generate`."""
    reference = hybrid[0]
    ids = prompt(20, seed=3)
    expected = reference_greedy(reference, ids, n)
    (result,) = engine(hybrid).generate([greedy_request("a", ids, n)])
    assert result.token_ids == expected
    assert len(set(expected)) > 3  # a model that repeats one token would test nothing
