"""The dense runtime against transformers: logits parity through the paged KV cache.

Tiny random-weight checkpoints (see `checkpoints.py`) are written by transformers and
read back by our loader; every test compares our logits or tokens with the
transformers model from the same folder. Block size 16, so a 64-token prompt spans
four KV pages.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import (
    LLAMA3_ROPE,
    load_reference,
    open_checkpoint,
    write_tiny_llama,
    write_tiny_qwen3,
)

from ninfer_core.device import CudaInfo, probe_device
from ninfer_core.engine import BlockManager, RuntimeSpec, Sequence, assemble_runtime
from ninfer_core.errors import ModelLoadError
from ninfer_core.kv import KVLayout
from ninfer_plugins.backend_torch import register_kernel_backends
from ninfer_plugins.kv_plain import register_kv_codecs
from ninfer_plugins.model_dense import register_model_families

TOL = 1e-4
BLOCK = 16
FAMILIES = {arch: fam for fam in register_model_families() for arch in fam.architectures}
CODECS = {codec.name: codec for codec in register_kv_codecs()}
WRITERS = {"qwen3": write_tiny_qwen3, "llama": write_tiny_llama}


def build(path, dtype=torch.float32, kv="fp32", num_blocks=48):
    """(runner, model) for the checkpoint at `path`, through our plugins only."""
    artifact = open_checkpoint(path)
    family = FAMILIES[artifact.config["architectures"][0]]
    config = family.parse_config(artifact.config)
    ops = register_kernel_backends()[0].create_ops(probe_device(use_cuda=False))
    model = family.build(config, ops, dtype)
    family.load_weights(model, artifact)
    runtime = assemble_runtime(model, config, dtype, CODECS[kv], RuntimeSpec(num_blocks, BLOCK))
    return runtime.runner, model


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def reference_logits(ref, ids: list[int]) -> torch.Tensor:
    return ref(torch.tensor([ids])).logits[0].float()  # [T, vocab]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def ckpt(request, tmp_path_factory):
    """(path, transformers model): Qwen3 tied; Llama GQA, untied, llama3 rope scaling."""
    path = WRITERS[request.param](tmp_path_factory.mktemp(request.param))
    config = json.loads((path / "config.json").read_text())
    if request.param == "llama":
        assert config["rope_parameters"]["rope_type"] == "llama3"
        assert not config["tie_word_embeddings"]
        assert config["num_key_value_heads"] < config["num_attention_heads"]
    else:
        assert config["tie_word_embeddings"]
    return path, load_reference(path)


# --------------------------------------------------------------------------
# Logits parity, fp32
# --------------------------------------------------------------------------


def test_prefill_parity(ckpt):
    path, ref = ckpt
    runner, _ = build(path)
    ids = prompt(64)
    seq = Sequence(ids)
    got = runner.run([(seq, 64)], all_tokens=True)  # [64, vocab]
    assert len(seq.block_table) == 64 // BLOCK and seq.num_computed_tokens == 64
    assert max_err(got, reference_logits(ref, ids)) <= TOL


def test_decode_token_by_token_parity(ckpt):
    path, ref = ckpt
    runner, _ = build(path)
    ids = prompt(64)
    seq = Sequence(ids)
    got = torch.cat([runner.run([(seq, 1)]) for _ in range(64)])  # [64, vocab]
    assert max_err(got, reference_logits(ref, ids)) <= TOL


def test_chunked_prefill_parity(ckpt):
    path, ref = ckpt
    runner, _ = build(path)
    ids = prompt(64)
    seq = Sequence(ids)
    # Chunk edges fall inside KV pages (20 and 50 are not multiples of 16).
    got = torch.cat([runner.run([(seq, n)], all_tokens=True) for n in (20, 30, 14)])
    assert max_err(got, reference_logits(ref, ids)) <= TOL


def test_batch_of_two_in_one_forward(ckpt):
    path, ref = ckpt
    runner, _ = build(path)
    a, b = Sequence(prompt(64, seed=2)), Sequence(prompt(37, seed=3))
    got = runner.run([(a, 64), (b, 37)], all_tokens=True)  # one forward, [101, vocab]
    assert max_err(got[:64], reference_logits(ref, a.token_ids)) <= TOL
    assert max_err(got[64:], reference_logits(ref, b.token_ids)) <= TOL
    # Then decode both together, at different context lengths, pages interleaving.
    for step in range(20):
        a.append_token(step + 5)
        b.append_token(2 * step + 7)
        last = runner.run([(a, 1), (b, 1)])  # [2, vocab]
        assert max_err(last[0], reference_logits(ref, a.token_ids)[-1]) <= TOL
        assert max_err(last[1], reference_logits(ref, b.token_ids)[-1]) <= TOL


def test_mixed_prefill_chunk_and_decode_in_one_forward(ckpt):
    path, ref = ckpt
    runner, _ = build(path)
    a, b = Sequence(prompt(40, seed=4)), Sequence(prompt(50, seed=5))
    runner.run([(a, 40), (b, 18)])
    a.append_token(11)
    got = runner.run([(a, 1), (b, 32)], all_tokens=True)  # decode a, rest of b's prompt
    assert max_err(got[0], reference_logits(ref, a.token_ids)[-1]) <= TOL
    assert max_err(got[1:], reference_logits(ref, b.token_ids)[18:]) <= TOL


def test_greedy_generation_matches_transformers(ckpt):
    path, ref = ckpt
    runner, _ = build(path)
    ids = prompt(16, seed=6)
    ref.generation_config.eos_token_id = None  # generate exactly 32 tokens, like our loop
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, 16, dtype=torch.long),
            do_sample=False,
            max_new_tokens=32,
            pad_token_id=0,
        )[0, 16:].tolist()
    seq = Sequence(ids)
    logits = runner.run([(seq, len(ids))])
    for _ in range(32):
        seq.append_token(int(logits[0].argmax()))
        if len(seq.completion_ids) == 32:
            break
        logits = runner.run([(seq, 1)])
    assert len(set(want)) > 8  # a model stuck on one token would prove little
    assert seq.completion_ids == want


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        LLAMA3_ROPE,
    ],
    ids=lambda s: (s or {}).get("rope_type", "default"),
)
def test_rope_scaling_types_prefill_and_decode(tmp_path, scaling):
    path = write_tiny_qwen3(tmp_path, rope_scaling=scaling, num_hidden_layers=2)
    ref = load_reference(path)
    runner, _ = build(path)
    ids = prompt(48, seed=7)
    seq = Sequence(ids)
    chunks = [runner.run([(seq, n)], all_tokens=True) for n in (40, 8)]
    got = torch.cat(chunks)
    assert max_err(got, reference_logits(ref, ids)) <= TOL


# --------------------------------------------------------------------------
# Low precision on the CPU
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "kv"), [(torch.bfloat16, "bf16"), (torch.float16, "fp16")], ids=["bf16", "fp16"]
)
def test_low_precision_models_run_on_cpu(ckpt, dtype, kv):
    path, ref = ckpt
    ids = prompt(64)
    want = reference_logits(ref, ids)
    runner, model = build(path, dtype=dtype, kv=kv)
    assert model.embed_tokens.dtype == dtype and runner.kv_store.dtype == dtype
    seq = Sequence(ids)
    got = torch.cat(
        [runner.run([(seq, 48)], all_tokens=True), *(runner.run([(seq, 1)]) for _ in range(16))]
    )
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # bf16 lands near 2.5% of the logit range on these models, fp16 near 0.3%.
    assert max_err(got, want) <= 0.05 * want.abs().max().item()


def test_checkpoint_stored_in_bf16_loads_into_an_fp32_model(tmp_path):
    path = write_tiny_qwen3(tmp_path, dtype=torch.bfloat16, num_hidden_layers=2)
    runner, model = build(path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ref = load_reference(path, dtype=torch.float32)  # transformers upcasts the same way
    ids = prompt(20)
    got = runner.run([(Sequence(ids), 20)], all_tokens=True)
    assert max_err(got, reference_logits(ref, ids)) <= TOL


# --------------------------------------------------------------------------
# Loading: shards, missing and misshapen tensors, extras
# --------------------------------------------------------------------------


def test_multi_shard_checkpoint_loads_the_same_weights(tmp_path):
    one = write_tiny_llama(tmp_path / "one")
    many = write_tiny_llama(tmp_path / "many", max_shard_size="40KB")
    assert (many / "model.safetensors.index.json").exists()
    assert len(list(many.glob("*.safetensors"))) > 2
    _, a = build(one)
    _, b = build(many)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_weight_plan_fills_every_parameter(ckpt):
    from ninfer_core.model.weights import weight_plan

    _, model = build(ckpt[0])
    filled = {s.param for s in weight_plan(model.config)}
    assert filled == {name for name, _ in model.named_parameters()}


def _rewrite(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_one_line_naming_it(tmp_path):
    path = write_tiny_qwen3(tmp_path, num_hidden_layers=2)
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError) as err:
        build(path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg
    assert "'model.layers.1.mlp.up_proj.weight'" in msg and "[128, 64]" in msg


def test_misshapen_tensor_names_file_and_both_shapes(tmp_path):
    path = write_tiny_qwen3(tmp_path, num_hidden_layers=2)
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(path, lambda t: t.update({name: torch.zeros(16, 64)}))
    with pytest.raises(ModelLoadError) as err:
        build(path)
    msg = str(err.value)
    assert "\n" not in msg and "model.safetensors" in msg
    assert "'model.layers.0.self_attn.k_proj.weight'" in msg
    assert "has shape [16, 64], expected [32, 64]" in msg


def test_unexpected_tensors_are_ignored(tmp_path):
    path = write_tiny_qwen3(tmp_path, num_hidden_layers=2)
    extra = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
        "lm_head.weight": torch.zeros(300, 64),  # a tied model's spare copy: not used
    }
    ref = load_reference(path)  # before the edit: transformers would load the zero head
    _rewrite(path, lambda t: t.update(extra))
    runner, _ = build(path)
    ids = prompt(20)
    got = runner.run([(Sequence(ids), 20)], all_tokens=True)
    assert max_err(got, reference_logits(ref, ids)) <= TOL


# --------------------------------------------------------------------------
# RoPE frequencies against transformers' own formulas
# --------------------------------------------------------------------------

ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False,
    },
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}  # fmt: skip


@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("context_len", [None, 1024])
def test_rope_frequencies_match_transformers(case, context_len):
    from checkpoints import tiny_llama_config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from ninfer_core.model.config import ModelConfig
    from ninfer_core.model.rope import inv_frequencies, rope_type_of

    hf = tiny_llama_config(rope_scaling=ROPE_CASES[case], head_dim=32, num_attention_heads=2)
    ours = ModelConfig.from_hf(hf.to_dict(), qk_norm=False)
    rope_type = rope_type_of(ours.rope_scaling)
    init = ROPE_INIT_FUNCTIONS.get(rope_type, LlamaRotaryEmbedding.compute_default_rope_parameters)
    # transformers' prefill of `context_len` tokens; only dynamic depends on it.
    want, want_scale = init(hf, seq_len=context_len)
    got, scale = inv_frequencies(ours, context_len)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale)


def test_unsupported_rope_type_is_refused_with_the_supported_list():
    from ninfer_core.model.config import ModelConfig
    from ninfer_core.model.rope import inv_frequencies

    raw = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
    }  # fmt: skip
    with pytest.raises(ModelLoadError, match="'longrope' is not supported; supported: default"):
        inv_frequencies(ModelConfig.from_hf(raw, qk_norm=False))


# --------------------------------------------------------------------------
# Plugins, KV store and pages
# --------------------------------------------------------------------------


def test_register_hooks_return_the_dense_plugins():
    assert {f.name: f.architectures for f in register_model_families()} == {
        "qwen3": ("Qwen3ForCausalLM",),
        "llama": ("LlamaForCausalLM", "MistralForCausalLM"),
    }
    (backend,) = register_kernel_backends()
    cpu = probe_device(use_cuda=False)
    assert backend.name == "torch" and backend.priority == 0 and backend.supports(cpu)
    assert sorted(CODECS) == ["bf16", "fp16", "fp32"]
    assert CODECS["fp16"].bytes_per_token(3, 2, 16) == 2 * 3 * 2 * 16 * 2
    assert CODECS["fp32"].bytes_per_token(3, 2, 16) == 2 * 3 * 2 * 16 * 4


def test_bf16_kv_is_refused_before_sm80_with_a_reason():
    from dataclasses import replace

    cpu = probe_device(use_cuda=False)
    gib = 1 << 30
    t4 = replace(cpu, cuda=CudaInfo("Tesla T4", (7, 5), 16 * gib, 15 * gib))
    a100 = replace(cpu, cuda=CudaInfo("NVIDIA A100", (8, 0), 80 * gib, 79 * gib))
    refused = CODECS["bf16"].supports(t4)
    assert not refused and "SM80" in refused.reason and "fp16" in refused.reason
    assert CODECS["bf16"].supports(a100) and CODECS["bf16"].supports(cpu)
    assert CODECS["fp16"].supports(t4) and CODECS["fp32"].supports(t4)


def test_kv_store_write_then_gather_through_a_block_table():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=6)
    store = CODECS["fp16"].allocate(layout, "cpu", compute_dtype=torch.float32)
    assert store.nbytes == 2 * 2 * 6 * 4 * 2 * 8 * 2
    table = torch.tensor([5, 1, 3])  # 10 tokens over scattered pages
    slots = torch.tensor([int(table[p // 4]) * 4 + p % 4 for p in range(10)])
    k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    store.write(1, slots, k, v)
    gk, gv = store.gather(1, table, 10)
    assert gk.dtype == torch.float32 and gk.shape == (10, 2, 8)
    assert torch.equal(gk, k.half().float()) and torch.equal(gv, v.half().float())
    assert not store.gather(0, table, 10)[0].any()  # other layers untouched
    batched, _ = store.gather(1, torch.stack([table, table]))  # [B, nb * block, Hkv, D]
    assert batched.shape == (2, 12, 2, 8) and torch.equal(batched[1, :10], gk)


def test_block_manager_allocates_grows_and_frees():
    bm = BlockManager(num_blocks=4, block_size=16)
    a, b = Sequence(range(40)), Sequence(range(30))
    assert bm.can_allocate(a, 40)
    bm.allocate(a, 40)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 1
    bm.allocate(a, 40)  # already covered: no-op
    assert bm.num_free_blocks == 1 and not bm.can_allocate(b, 30)
    from ninfer_core.engine import OutOfBlocksError

    with pytest.raises(OutOfBlocksError):
        bm.allocate(b, 30)
    bm.free(a)
    assert bm.num_free_blocks == 4 and a.block_table == [] and a.num_computed_tokens == 0
    bm.allocate(b, 30)
    assert len(b.block_table) == 2
