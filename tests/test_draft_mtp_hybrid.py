"""`--spec mtp` on the hybrid family (Qwen3-Next / Qwen3.5): its own MTP layer.

A tiny random Qwen3-Next (tests/test_hybrid_family.py's) is saved with random `mtp.*`
tensors, which transformers has no module for and drops: they come from an independent
reference built of transformers' own modules, following vLLM's `Qwen3NextMultiTokenPredictor`
(`fc(concat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)))`, one
`Qwen3NextDecoderLayer` configured as full attention, `Qwen3NextRMSNorm`s, the target's
embedding, RoPE and head). Our drafter, built by the `mtp` strategy from the family's
`mtp_layer`, must give its logits (to 1e-5, fp32) and its draft chain, for the MoE and
the dense-MLP variant and for a Qwen3.5-MoE multimodal checkpoint (`mtp.*` at the top
level); declare exactly the bytes it then holds, from a folder or a quantized `.ninfer`;
and refuse a checkpoint without (or with an incomplete) MTP layer with the reason. End to
end, greedy output with `--spec mtp` (1 and 3 drafts) is the output without speculation,
with drafts both accepted and rejected: an "echo" MTP layer on a target that repeats a
token now and then.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from engine_helpers import prompt
from hybrid_helpers import engine, greedy_request, load_fp32
from safetensors.torch import load_file, save_file
from spec_helpers import cpu_target
from test_hybrid_family import write_tiny_qwen3_next
from test_spec_memory import held_bytes

from ninfer_core.cli.main import build_parser
from ninfer_core.cli.plan_cmd import make_plan
from ninfer_core.config import RuntimeConfig
from ninfer_core.convert import convert
from ninfer_core.device import probe_device
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.errors import NInferError, UnsupportedChoiceError
from ninfer_core.loading import LoadedModel, load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.plugin_types import MTPBlock, MTPLayerKind
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.types import DraftInput, DraftOptions, DraftTarget
from ninfer_plugins.draft_mtp import MTPDrafter, MTPStrategy
from ninfer_plugins.model_hybrid import HybridMTP, HybridMTPLayer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK, PAGES = 16, 16
#: fp32 on both sides; the MTP layer adds one decoder layer's rounding to the target's.
TOL = 1e-5


def qwen3_next_modules() -> tuple[type, type]:
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    return m.Qwen3NextDecoderLayer, m.Qwen3NextRMSNorm


def qwen3_5_moe_modules() -> tuple[type, type]:
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    return m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm


class ReferenceMTP(torch.nn.Module):
    """vLLM's `Qwen3NextMultiTokenPredictor` (and `Qwen3_5MultiTokenPredictor`) of
    transformers' modules, `modules` the family's (decoder layer, RMSNorm); its
    `state_dict`, prefixed `mtp.`, is a checkpoint's MTP tensors (`checkpoint`)."""

    def __init__(self, config, modules: tuple[type, type]) -> None:
        layer_cls, norm_cls = modules
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        full = copy.deepcopy(config)  # the MTP layer is full attention, its MLP layer 0's
        full.layer_types = ["full_attention"] * config.num_hidden_layers
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm_cls(h, eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps)
        self.layers = torch.nn.ModuleList([layer_cls(full, 0)])
        self.norm = norm_cls(h, eps)

    def forward(self, embeds, hidden, rope, mask) -> torch.Tensor:
        # embeds, hidden: [1, T, H] -> [1, T, H]
        e_h = torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), -1)
        x = self.layers[0](self.fc(e_h), position_embeddings=rope, attention_mask=mask)
        return self.norm(x)

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The `mtp.*` tensors as Qwen3-Next checkpoints name them: one matrix per expert
        (transformers keeps them stacked, gate rows before up rows)."""
        out = {}
        for name, value in self.state_dict().items():
            if name.endswith("experts.gate_up_proj"):
                stem, i = name.removesuffix("gate_up_proj"), value.shape[1] // 2
                for e in range(value.shape[0]):
                    out[f"mtp.{stem}{e}.gate_proj.weight"] = value[e, :i].clone()
                    out[f"mtp.{stem}{e}.up_proj.weight"] = value[e, i:].clone()
            elif name.endswith("experts.down_proj"):
                stem = name.removesuffix("down_proj")
                for e in range(value.shape[0]):
                    out[f"mtp.{stem}{e}.down_proj.weight"] = value[e].clone()
            else:
                out[f"mtp.{name}"] = value.clone()
        return out


@torch.no_grad()
def random_mtp(config, seed: int, modules: tuple[type, type] | None = None) -> ReferenceMTP:
    """A seeded `ReferenceMTP` (Qwen3-Next's modules by default): matrices drawn as the
    target's (`initializer_range`; a module outside a `PreTrainedModel` is left
    uninitialised), norms drawn around zero (a wrong `1 + w` cannot pass)."""
    mtp = ReferenceMTP(config, modules or qwen3_next_modules()).eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in mtp.named_parameters():
        scale = 0.3 if name.endswith("norm.weight") else config.initializer_range
        p.copy_(scale * torch.randn(p.shape, generator=g))
    return mtp


def write_hybrid(path: Path, seed: int, mtp: dict[str, torch.Tensor] | None, **overrides):
    """The tiny Qwen3-Next at `path` with `mtp` as its only MTP tensors (None: none)."""
    reference = write_tiny_qwen3_next(path, seed=seed, **overrides)
    (path / "mtp.safetensors").unlink()  # the fixture's two stray mtp tensors
    if mtp is not None:
        save_file(mtp, str(path / "mtp.safetensors"))
    return reference


class Hybrid:
    """transformers' target and reference MTP, our loaded model and the strategy's drafter."""

    def __init__(self, path: Path, seed: int, **overrides) -> None:
        from test_hybrid_family import tiny_qwen3_next_config

        self.mtp = random_mtp(tiny_qwen3_next_config(**overrides), seed + 10)
        self.reference = write_hybrid(path, seed, self.mtp.checkpoint(), **overrides)
        self.loaded, self.host, _ = load_fp32(path)
        self.drafter = MTPStrategy().create(target(self.loaded, self.host), DraftOptions())

    def hidden(self, ids: list[int]) -> torch.Tensor:
        return target_hidden(self.reference, ids)

    def reference_logits(self, ids: list[int], fed: list[int] = ()) -> torch.Tensor:
        return reference_logits(self.reference, self.mtp, ids, fed)


@torch.no_grad()
def target_hidden(reference, ids: list[int]) -> torch.Tensor:
    """transformers' final-normed hidden states of `ids`, [len(ids), H]."""
    out = reference.model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.last_hidden_state[0]


@torch.no_grad()
def reference_logits(reference, mtp: ReferenceMTP, ids: list[int], fed=()) -> torch.Tensor:
    """The reference MTP's logits of entries 0 .. len(ids) - 2 + len(fed), through the
    target `reference`'s embedding, RoPE and head: entry t reads token t + 1's embedding
    (past the prompt, the drafts `fed`) and the target's hidden at t, past the prompt's
    last entry the MTP's own previous output."""
    body = reference.model
    hidden = target_hidden(reference, ids)[None, :-1]
    embeds = body.embed_tokens(torch.tensor([ids[1:] + list(fed)]))
    while True:
        n = hidden.shape[1]
        rope = body.rotary_emb(embeds[:, :n], torch.arange(n)[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = mtp(embeds[:, :n], hidden, rope, mask)
        if n == embeds.shape[1]:
            return reference.lm_head(out)[0]
        hidden = torch.cat((hidden, out[:, -1:]), dim=1)


def target(loaded: LoadedModel, host) -> DraftTarget:
    return cpu_target(loaded, host, block_size=BLOCK, num_blocks=PAGES)


def draft_input(ids: list[int], hidden: torch.Tensor, max_drafts: int = 0) -> DraftInput:
    """A fresh sequence of `ids` (all computed: its last one pending for the drafts)."""
    table = list(range(-(-(len(ids) + max_drafts) // BLOCK)))
    return DraftInput(0, ids, 0, len(ids) - 1, table, max_drafts, hidden[: len(ids) - 1])


#: The two MLP kinds of the MTP layer: layer 0's, `SparseMoE` by default; `mlp_only_layers`
#: with 0 gives a dense SwiGLU.
VARIANTS = {"moe": {}, "dense-mlp": {"mlp_only_layers": [0, 1]}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def hybrid(request, tmp_path_factory) -> Hybrid:
    path = tmp_path_factory.mktemp(f"qwen3-next-mtp-{request.param}")
    return Hybrid(path, seed=21, **VARIANTS[request.param])


# --------------------------------------------------------------------------
# The layer against the reference
# --------------------------------------------------------------------------


def test_the_family_offers_its_own_mtp_layer(hybrid):
    loaded = hybrid.loaded
    assert isinstance(loaded.family.mtp_layer, HybridMTP)
    assert loaded.model.mtp_layer is loaded.family.mtp_layer
    assert isinstance(loaded.family.mtp_layer, MTPLayerKind)
    layer = hybrid.drafter.layer
    assert isinstance(layer, HybridMTPLayer) and isinstance(layer, MTPBlock)
    assert layer.layer.self_attn is not None and layer.layer.linear_attn is None
    sparse = type(layer.layer.mlp).__name__ == "SparseMoE"
    assert sparse == (loaded.config.raw["mlp_only_layers"] == [1])


def test_catch_up_logits_match_the_reference(hybrid):
    ids = prompt(37, seed=5)
    hidden = hybrid.hidden(ids)
    (out,) = hybrid.drafter.catch_up([draft_input(ids, hidden)])
    ours = hybrid.loaded.model.compute_logits(out)
    ref = hybrid.reference_logits(ids)
    assert ours.shape == ref.shape == (36, 512)
    assert (ours - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item())


def test_drafts_follow_the_reference_chain(hybrid):
    """Draft 1 from the catch-up's last entry, drafts 2 and 3 from the MTP's own output."""
    ids = prompt(29, seed=6)
    (proposal,) = hybrid.drafter.propose([draft_input(ids, hybrid.hidden(ids), max_drafts=3)])
    drafts = list(proposal.token_ids)
    assert len(drafts) == 3
    want = []
    for _ in range(3):
        want.append(int(hybrid.reference_logits(ids, want)[-1].argmax()))
    assert drafts == want


def test_a_qwen3_5_multimodal_checkpoint_drafts_from_its_top_level_mtp(tmp_path):
    """The Hub's Qwen3.5-MoE layout: the decoder under `model.language_model.`, the MTP
    layer at the top level (`mtp.*`, as vLLM's `Qwen3_5MTP` reads it), every MLP sparse."""
    from test_hybrid_qwen3_5 import write_tiny_qwen3_5

    text, nested = tmp_path / "text", tmp_path / "multimodal"
    text.mkdir(), nested.mkdir()
    reference = write_tiny_qwen3_5(text, "moe", seed=5)
    mtp = random_mtp(reference.config, 31, qwen3_5_moe_modules())
    config = json.loads((text / "config.json").read_text())
    multimodal = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {k: v for k, v in config.items() if k != "architectures"},
        "vision_config": {"depth": 1, "hidden_size": 8},
    }
    (nested / "config.json").write_text(json.dumps(multimodal))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (nested / name).write_bytes((text / name).read_bytes())
    tensors = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
        for k, v in load_file(str(text / "model.safetensors")).items()
    }
    save_file({**tensors, **mtp.checkpoint()}, str(nested / "model.safetensors"))
    loaded, host, _ = load_fp32(nested)
    assert loaded.family.name == "qwen3.5"
    assert loaded.model.hybrid.prefix == "model.language_model."
    drafter = MTPStrategy().create(target(loaded, host), DraftOptions())
    assert type(drafter.layer.layer.mlp).__name__ == "SparseMoE"
    ids = prompt(33, seed=7)
    (out,) = drafter.catch_up([draft_input(ids, target_hidden(reference, ids))])
    ours = loaded.model.compute_logits(out)
    ref = reference_logits(reference, mtp, ids)
    assert (ours - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item())


# --------------------------------------------------------------------------
# Memory: declared from the headers, equal to what the drafter holds
# --------------------------------------------------------------------------


PLAN = ["--device-spec", "cpu", "--max-context", "256", "--kv-dtype", "fp32", "--spec", "mtp"]


def plan_for(path: Path, dtype: str):
    ns = build_parser().parse_args(["plan", str(path), *PLAN, "--dtype", dtype])
    plan, _ = make_plan(ns)
    return plan


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_plan_declares_the_bytes_the_loaded_layer_holds(hybrid, dtype):
    path = hybrid.loaded.artifact.path
    plan = plan_for(path, dtype)
    host = create_host()
    runtime = RuntimeConfig(dtype=dtype)
    loaded = load_model(path, host=host, device=probe_device(use_cuda=False), runtime=runtime)
    drafter = MTPStrategy().create(target(loaded, host), DraftOptions())
    assert plan.draft_strategy == "mtp"
    assert plan.draft.weights_bytes == held_bytes(drafter.layer) > 0
    assert plan.draft.table_bytes == drafter.embed_table.nbytes
    cfg = loaded.config
    per_token = host.kv_codecs.get("fp32").bytes_per_token(1, cfg.num_kv_heads, cfg.head_dim)
    assert plan.draft.kv_bytes_per_token == per_token
    assert per_token * BLOCK * PAGES == drafter.store.nbytes


@pytest.mark.parametrize("recipe", ["w8", "mixed"])
def test_a_converted_file_keeps_the_layer_apart_and_declares_its_bytes(hybrid, tmp_path, recipe):
    """`ninfer convert` puts `mtp.*` in the `mtp` component (quantized like the rest: W8
    routers too, which the backend packs); the plan's count is still the loaded layer's."""
    out = tmp_path / "model.ninfer"
    convert(hybrid.loaded.artifact.path, out, recipe_name=recipe)
    host, device = hybrid.host, probe_device(use_cuda=False)
    for dtype in ("fp32", "bf16"):
        plan = plan_for(out, dtype)
        loaded = load_model(out, host=host, device=device, runtime=RuntimeConfig(dtype=dtype))
        assert not any(name.startswith("mtp.") for name in loaded.artifact.tensor_names())
        drafter = MTPStrategy().create(target(loaded, host), DraftOptions())
        assert plan.draft.weights_bytes == held_bytes(drafter.layer) > 0


def test_without_the_family_the_dense_layer_does_not_fit(hybrid):
    """`family` is what makes `memory` size the hybrid's layer: a caller that does not
    pass it gets the dense layer's shapes, which the hybrid's tensors do not have."""
    loaded = hybrid.loaded
    codec = hybrid.host.kv_codecs.get("fp32")
    args = (loaded.artifact, loaded.config, DraftOptions(), torch.float32, codec)
    assert MTPStrategy().memory(*args, family=loaded.family).weights_bytes > 0
    with pytest.raises(UnsupportedChoiceError, match="does not fit the model"):
        MTPStrategy().memory(*args)


# --------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def without_mtp(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-next-no-mtp")
    write_hybrid(path, seed=3, mtp=None)
    return path


def test_a_hybrid_without_mtp_weights_is_refused_with_the_reason(without_mtp):
    loaded, host, _ = load_fp32(without_mtp)
    support = MTPStrategy().supports_model(target(loaded, host), DraftOptions())
    assert not support.ok
    assert "no MTP layer ('mtp.fc.weight' is not among its tensors)" in support.reason
    assert "`--spec ngram` needs no weights" in support.reason
    with pytest.raises(NInferError, match=r"--spec mtp: .*no MTP layer"):
        plan_for(without_mtp, "fp32")


def test_an_incomplete_mtp_layer_is_refused_naming_the_missing_tensor(tmp_path):
    write_tiny_qwen3_next(tmp_path, seed=4)  # only mtp.fc and mtp.norm
    loaded, host, _ = load_fp32(tmp_path)
    support = MTPStrategy().supports_model(target(loaded, host), DraftOptions())
    assert not support.ok and "its MTP layer does not fit the model" in support.reason
    assert "missing tensor 'mtp.pre_fc_norm_embedding.weight'" in support.reason


def test_the_engine_names_the_refusal_and_the_strategy_that_runs(without_mtp):
    loaded, host, device = load_fp32(without_mtp)
    cfg = EngineConfig(kv_capacity=1024, max_concurrency=2)
    with pytest.raises(UnsupportedChoiceError) as info:
        Engine(loaded, cfg, host=host, device=device, kv_dtype="fp32", spec=SpecConfig(spec="mtp"))
    message = str(info.value)
    assert "no MTP layer" in message
    if "recurrent state" not in message:
        assert "strategies this model supports: ngram" in message


# --------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------


@torch.no_grad()
def echo_mtp(config) -> dict[str, torch.Tensor]:
    """MTP tensors that draft "the next token again": fc passes the normed embedding
    through, the layer adds nothing (zero output projections), every norm is the plain
    RMSNorm (w = 0). Through a tied head, token x's own row scores highest, so the drafts
    repeat the token they follow."""
    mtp = random_mtp(config, 0)
    h = config.hidden_size
    state = mtp.checkpoint()
    for name, value in state.items():
        if name.endswith("norm.weight") or name.endswith(("o_proj.weight", "down_proj.weight")):
            value.zero_()
    state["mtp.fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    return state


#: What the target's layers add to the residual stream is scaled by this: its embedding
#: then carries through often enough that the tied head repeats a token now and then
#: (where the echo drafts are accepted), not always (where they are rejected).
TARGET_LAYER_SCALE = 0.5


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """(None, loaded, host, device): a tied tiny Qwen3-Next whose layer outputs are halved,
    with `echo_mtp` as its MTP layer: drafts both accepted and rejected."""
    from test_hybrid_family import tiny_qwen3_next_config

    path = tmp_path_factory.mktemp("qwen3-next-echo-mtp")
    overrides = {"tie_word_embeddings": True}
    write_hybrid(path, 11, echo_mtp(tiny_qwen3_next_config(**overrides)), **overrides)
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    for name, value in tensors.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            value.mul_(TARGET_LAYER_SCALE)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return (None, *load_fp32(path))


def spec_engine(hybrid, k: int) -> Engine:
    _, loaded, host, device = hybrid
    cfg = EngineConfig(kv_capacity=1024, max_concurrency=4)
    spec = SpecConfig(spec="mtp", draft_tokens=k)
    try:
        return Engine(loaded, cfg, host=host, device=device, kv_dtype="fp32", spec=spec, seed=0)
    except UnsupportedChoiceError as exc:
        if "recurrent state" in str(exc):
            pytest.skip(f"the engine still refuses --spec for state models: {exc}")
        raise


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_with_mtp_is_the_output_without(echo, k):
    prompts = [prompt(21, seed=12), prompt(8, seed=13)]
    plain = [
        engine(echo).generate([greedy_request(f"p{i}", p, 40)])[0] for i, p in enumerate(prompts)
    ]
    eng = spec_engine(echo, k)
    assert isinstance(eng.drafter, MTPDrafter)
    results = eng.generate([greedy_request(f"s{i}", p, 40) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert len(set(plain[0].token_ids)) > 10  # not one token repeated: a real check
    for result in results:  # each sequence had drafts accepted and drafts rejected
        assert 0 < result.finish.usage.spec.accepted < result.finish.usage.spec.drafted
    eng.check_invariants()
