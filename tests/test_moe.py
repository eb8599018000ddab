"""`SparseMoE` against transformers' `Qwen3NextSparseMoeBlock`, from the same weights.

Weights are made in the Hub checkpoints' per-expert names (`mlp.experts.{e}.gate_proj.weight`
...) and handed to our block as they are, and to transformers' stacked the way its
`qwen2_moe` conversion does (`experts.gate_up_proj[e] = cat(gate_e, up_e)`).
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.errors import ModelLoadError
from ninfer_core.kernels.reference import TorchOps
from ninfer_core.model.moe import MoEConfig, SparseMoE, moe_slots, route
from ninfer_core.quant.tensor import QuantizedTensor, quantize

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    Qwen3NextSparseMoeBlock,
)

HIDDEN, EXPERTS, TOP_K, MOE_I, SHARED_I = 64, 8, 3, 32, 48
PREFIX = "model.layers.0.mlp."


def moe_config(norm_topk_prob: bool = True, shared: int = SHARED_I) -> MoEConfig:
    raw = {
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": MOE_I,
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": norm_topk_prob,
    }
    return MoEConfig.from_hf(raw)


def checkpoint(config: MoEConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 tensors under the checkpoint's names, scaled so outputs are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        slot.hf_name: torch.randn(slot.shape, generator=gen) / slot.shape[-1] ** 0.5 * 2
        for slot in moe_slots(config, HIDDEN, PREFIX, "")
    }


def hf_block(config: MoEConfig, tensors: dict[str, torch.Tensor]) -> Qwen3NextSparseMoeBlock:
    hf_config = transformers.Qwen3NextConfig(
        hidden_size=HIDDEN,
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size,
        norm_topk_prob=config.norm_topk_prob,
        hidden_act="silu",
    )
    hf_config._experts_implementation = "eager"  # the plain per-expert loop
    block = Qwen3NextSparseMoeBlock(hf_config)
    p = PREFIX
    experts = range(config.num_experts)
    state = {
        "gate.weight": tensors[p + "gate.weight"],
        "experts.gate_up_proj": torch.stack(
            [
                torch.cat(
                    [
                        tensors[f"{p}experts.{e}.gate_proj.weight"],
                        tensors[f"{p}experts.{e}.up_proj.weight"],
                    ]
                )
                for e in experts
            ]
        ),
        "experts.down_proj": torch.stack(
            [tensors[f"{p}experts.{e}.down_proj.weight"] for e in experts]
        ),
        "shared_expert_gate.weight": tensors[p + "shared_expert_gate.weight"],
    }
    for name in ("gate_proj", "up_proj", "down_proj"):
        state[f"shared_expert.{name}.weight"] = tensors[f"{p}shared_expert.{name}.weight"]
    block.load_state_dict(state, strict=True)
    return block.eval()


def ours(config: MoEConfig, tensors, dtype: torch.dtype = torch.float32) -> SparseMoE:
    return SparseMoE.from_checkpoint(tensors, config, HIDDEN, TorchOps("cpu"), dtype, PREFIX)


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to fp32 rounding: sums taken in another order (a GEMV's lanes, a BLAS's
    blocks) differ by a few ulps of the largest outputs, so the bound scales with them."""
    scale = max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * scale, (err, scale)


def inputs(tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 64])
@torch.no_grad()
def test_matches_transformers_fp32(tokens, norm):
    config = moe_config(norm)
    tensors = checkpoint(config)
    x = inputs(tokens)
    want = hf_block(config, tensors)(x[None])[0]
    got = ours(config, tensors)(x)
    assert got.shape == (tokens, HIDDEN) and got.dtype == torch.float32
    assert_fp32_close(got, want)


@torch.no_grad()
def test_bf16_within_bf16_tolerance():
    """Same bf16 weights and input: our error against transformers' fp32 output is no
    worse than transformers' own bf16 run's (both route the same: same bf16 logits)."""
    config = moe_config()
    tensors = {k: v.bfloat16() for k, v in checkpoint(config).items()}
    x = inputs(64).bfloat16()
    exact = hf_block(config, {k: v.float() for k, v in tensors.items()})(x.float()[None])[0]
    theirs = hf_block(config, tensors).bfloat16()(x[None])[0]
    got = ours(config, tensors, torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16
    ours_err = (got.float() - exact).abs().max().item()
    their_err = (theirs.float() - exact).abs().max().item()
    assert ours_err <= 2e-2 * exact.abs().max().item()
    assert ours_err <= 1.5 * their_err + 1e-3


@torch.no_grad()
def test_experts_without_tokens():
    """A router that sends every token to experts 0..k-1 leaves the rest idle; a decode
    token (T = 1) and an empty step (T = 0) also leave most experts without rows."""
    config = moe_config()
    tensors = checkpoint(config)
    router = torch.zeros(EXPERTS, HIDDEN)
    router[:TOP_K, 0] = torch.tensor([3.0, 2.0, 1.0])
    tensors[PREFIX + "gate.weight"] = router
    x = inputs(16)
    x[:, 0] = x[:, 0].abs() + 1  # positive feature 0: experts 0, 1, 2 win every token
    block = ours(config, tensors)
    _, ids = route(x @ router.T, TOP_K, True)
    assert set(ids.flatten().tolist()) == set(range(TOP_K))
    want = hf_block(config, tensors)(x[None])[0]
    assert_fp32_close(block(x), want)
    assert block(x[:0]).shape == (0, HIDDEN)


@torch.no_grad()
def test_router_ties_do_not_crash():
    """An all-zero router ties every expert: each token still gets k distinct experts,
    each weighted 1/k (renormalised) or 1/E (not)."""
    for norm in (True, False):
        config = moe_config(norm)
        tensors = checkpoint(config)
        tensors[PREFIX + "gate.weight"] = torch.zeros(EXPERTS, HIDDEN)
        x = inputs(7)
        weights, ids = route(torch.zeros(7, EXPERTS), TOP_K, norm)
        assert all(len(set(row)) == TOP_K for row in ids.tolist())
        assert torch.allclose(weights, torch.full_like(weights, 1 / (TOP_K if norm else EXPERTS)))
        out = ours(config, tensors)(x)
        assert out.shape == (7, HIDDEN) and torch.isfinite(out).all()


@torch.no_grad()
def test_no_shared_expert():
    """shared_expert_intermediate_size 0 (Qwen3-MoE): routed experts only."""
    config = moe_config(shared=0)
    tensors = checkpoint(config)
    assert not any("shared" in name for name in tensors)
    block = ours(config, tensors)
    x = inputs(5)
    with_shared = moe_config()
    full = ours(with_shared, {**checkpoint(with_shared), **tensors})
    shared = torch.sigmoid(x @ full.shared_expert_gate.T) * full.shared_expert(x)
    assert_fp32_close(block(x), full(x) - shared)


class KeepQuantized(TorchOps):
    """The `KernelOps` default `pack_linear`: a quantized weight stays as it is and
    `linear` runs `QuantizedTensor.linear` (what a CUDA device does today)."""

    def pack_linear(self, w, *, dtype=None):
        return w


@torch.no_grad()
def test_quantized_experts_match_their_dequantized_weights():
    """Quantized matrices stay quantized through `from_checkpoint` (gate|up stacked with
    `cat_rows`) and compute what the block of their dequantized values does."""
    config = moe_config()
    tensors = checkpoint(config)
    quant = {k: quantize(v, "Q4G32") if ".experts." in k else v for k, v in tensors.items()}
    dense = {k: v.dequantize() if isinstance(v, QuantizedTensor) else v for k, v in quant.items()}
    x = inputs(9)
    want = ours(config, dense)(x)
    kept = SparseMoE.from_checkpoint(
        quant, config, HIDDEN, KeepQuantized("cpu"), torch.float32, PREFIX
    )
    assert isinstance(kept.experts[0].gate_up_proj, QuantizedTensor)
    assert kept.experts[0].gate_up_proj.shape == (2 * MOE_I, HIDDEN)
    assert_fp32_close(kept(x), want)
    assert_fp32_close(ours(config, quant)(x), want)  # dequantized once


@torch.no_grad()
def test_stacked_experts_layout():
    """Qwen3.5-MoE checkpoints stack the experts (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]): the same weights give the same block."""
    config = moe_config()
    tensors = checkpoint(config)
    experts = range(EXPERTS)
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    stacked[PREFIX + "experts.gate_up_proj"] = torch.stack(
        [
            torch.cat([tensors[f"{PREFIX}experts.{e}.{n}_proj.weight"] for n in ("gate", "up")])
            for e in experts
        ]
    )
    stacked[PREFIX + "experts.down_proj"] = torch.stack(
        [tensors[f"{PREFIX}experts.{e}.down_proj.weight"] for e in experts]
    )
    x = inputs(7)
    assert torch.equal(ours(config, stacked)(x), ours(config, tensors)(x))
    stacked[PREFIX + "experts.down_proj"] = stacked[PREFIX + "experts.down_proj"][:, :, :-1]
    with pytest.raises(ModelLoadError, match=r"experts\.down_proj"):
        ours(config, stacked)


def test_bad_checkpoint_fails_with_the_tensor_name():
    config = moe_config()
    tensors = checkpoint(config)
    del tensors[PREFIX + "experts.5.up_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"experts\.5\.up_proj"):
        ours(config, tensors)
    tensors = checkpoint(config)
    tensors[PREFIX + "gate.weight"] = torch.zeros(EXPERTS + 1, HIDDEN)
    with pytest.raises(ModelLoadError, match=r"mlp\.gate\.weight"):
        ours(config, tensors)


def test_config_fields():
    raw = {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512}
    config = MoEConfig.from_hf(raw)
    assert config.norm_topk_prob and config.shared_expert_intermediate_size == 0
    assert all(config.is_sparse(n) for n in range(4))
    step = MoEConfig.from_hf({**raw, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [step.is_sparse(n) for n in range(6)] == [False, True, False, False, False, True]
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        MoEConfig.from_hf({**raw, "num_experts_per_tok": 513})
    with pytest.raises(ModelLoadError, match="mlp_only_layers"):
        MoEConfig.from_hf({**raw, "mlp_only_layers": "3"})
