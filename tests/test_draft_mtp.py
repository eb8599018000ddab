"""Draft strategy `mtp`: the MTP layer against the training script's math, its K/V kept
across calls, drafting, both checkpoint namings, refusals, and its contract.

The reference is the built-in model's own training code (`tools/train_builtin_model.py`:
`build_model`, `MTPHead`, `head_logits`, transformers' Qwen3 layers) in float64 on the
dequantized weights; NInfer runs the target and the MTP layer in fp32 on the quantized ones.
"""

from __future__ import annotations

import random
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from spec_helpers import cpu_target

from ninfer_core import conformance
from ninfer_core.builtin_model import BUILTIN_ARTIFACT, ensure_random_model
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
from ninfer_core.loading import LoadedModel, load_model
from ninfer_core.model.attention_meta import AttentionMetadata
from ninfer_core.plugin_host import create_host
from ninfer_core.plugin_types import Drafter, DraftStrategy
from ninfer_core.quant.tensor import QuantizedTensor
from ninfer_core.spec.types import DraftInput, DraftOptions
from ninfer_core.text import Tokenizer
from ninfer_plugins import draft_mtp
from ninfer_plugins.draft_mtp import MTPDrafter, MTPStrategy
from ninfer_plugins.draft_mtp.weights import mtp_tensors

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import builtin_corpus  # noqa: E402
import train_builtin_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16
NO_OPTIONS = DraftOptions()
NUM_BLOCKS = 96
CODE = '''import os


def walk_sizes(root):
    """Yield (path, size) for every file under root."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
'''


class Target:
    """A loaded model, its KV pool, and a drafter made by the strategy for it."""

    def __init__(self, loaded: LoadedModel, host, options: DraftOptions = NO_OPTIONS):
        self.loaded, self.model = loaded, loaded.model
        spec = RuntimeSpec(num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_dtype="fp32")
        self.store = build_runtime(loaded, host, probe_device(use_cuda=False), spec).kv_store
        self.target = cpu_target(loaded, host, block_size=BLOCK, num_blocks=NUM_BLOCKS)
        self.options = options

    def drafter(self) -> MTPDrafter:
        return MTPStrategy().create(self.target, self.options)

    @torch.inference_mode()
    def hidden(self, ids: list[int], table: list[int]) -> torch.Tensor:
        """The target's final hidden states of `ids` (one prefill), [len(ids), hidden]."""
        n = len(ids)
        meta = AttentionMetadata.build([(Span(table, n), n)], BLOCK)
        return self.model(torch.tensor(ids), torch.arange(n), meta, self.store)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).double()


class Span:
    """A fresh sequence of `length` tokens, as `AttentionMetadata.build` reads one."""

    def __init__(self, table: list[int], length: int) -> None:
        self.seq_id, self.num_computed_tokens, self.block_table = 0, 0, table
        self.length = length

    def __len__(self) -> int:
        return self.length


def pages(first: int, tokens: int) -> list[int]:
    """Pages first, first + 1, ... covering `tokens` tokens."""
    return list(range(first, first + -(-tokens // BLOCK)))


def inputs_for(ids, table, hidden, start, end, max_drafts=0, seq_id=0) -> DraftInput:
    return DraftInput(
        seq_id=seq_id,
        token_ids=ids,
        start=start,
        end=end,
        block_table=table,
        max_drafts=max_drafts,
        hidden=hidden[start:end],
    )


class Reference:
    """The training script's model and MTP head in float64, on the dequantized weights."""

    def __init__(self, artifact) -> None:
        model, mtp = train_builtin_model.build_model(0)
        with mtp_tensors(artifact) as tensors:
            weights = {n: _dense(tensors.load_weight(n)) for n in tensors.tensor_names()}
        mtp_weights = {k.removeprefix("mtp."): v for k, v in weights.items() if k[:4] == "mtp."}
        missing, unexpected = model.load_state_dict(
            {k: v for k, v in weights.items() if k[:4] != "mtp."}, strict=False
        )
        assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied head
        mtp.load_state_dict(mtp_weights)
        self.model, self.mtp = model.double().eval(), mtp.double().eval()

    @torch.no_grad()
    def catch_up_logits(self, ids: list[int]) -> torch.Tensor:
        """MTP logits of entries 0 .. len(ids) - 2, by the training script's `head_logits`
        (one token more appended: entry j reads tokens up to j + 1 only)."""
        _, extra = train_builtin_model.head_logits(self.model, self.mtp, torch.tensor([[*ids, 0]]))
        return extra[0]

    @torch.no_grad()
    def chain_logits(self, ids: list[int], fed: list[int]) -> torch.Tensor:
        """MTP logits of entries 0 .. len(ids) - 2 + len(fed): past the prompt, entry t
        reads draft t - len(ids) + 2's embedding (`fed`) and the MTP's own output at t - 1."""
        body = self.model.model
        hidden = body(input_ids=torch.tensor([ids])).last_hidden_state[:, :-1]
        embeds = body.embed_tokens(torch.tensor([ids[1:] + fed]))
        while True:
            n = hidden.shape[1]
            rope = body.rotary_emb(embeds[:, :n], torch.arange(n).unsqueeze(0))
            out = self.mtp(embeds[:, :n], hidden, rope)
            if n == embeds.shape[1]:
                return self.model.lm_head(out)[0]
            hidden = torch.cat((hidden, out[:, -1:]), dim=1)


def _dense(w) -> torch.Tensor:
    dense = w.dequantize(torch.float32) if isinstance(w, QuantizedTensor) else w
    return dense.double()


@pytest.fixture(scope="module")
def host():
    return create_host()


@pytest.fixture(scope="module")
def builtin(host) -> Target:
    runtime = RuntimeConfig(dtype="fp32")
    device = probe_device(use_cuda=False)
    return Target(load_model(BUILTIN_ARTIFACT, host=host, device=device, runtime=runtime), host)


@pytest.fixture(scope="module")
def reference(builtin) -> Reference:
    return Reference(builtin.loaded.artifact)


@pytest.fixture(scope="module")
def prompts(builtin) -> dict[str, list[int]]:
    tokenizer = Tokenizer.from_artifact(builtin.loaded.artifact)
    template = builtin_corpus.ChatTemplate(builtin_corpus.CHAT_TEMPLATE)
    transcript = builtin_corpus.transcript(random.Random(10**9 + 7), template)
    # Up to the assistant's first tool call: the model continues with JSON.
    cut = transcript.index("<tool_call>") + len("<tool_call>\n")
    return {
        "code": tokenizer.encode(CODE, add_special_tokens=False),
        "json": tokenizer.encode(transcript[:cut], add_special_tokens=False),
    }


# --------------------------------------------------------------------------
# The MTP layer against the reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["code", "json"])
def test_catch_up_logits_match_the_training_math_in_float64(builtin, reference, prompts, prompt):
    """Every entry of one catch-up over a whole prompt (the last token pending)."""
    ids = prompts[prompt]
    table = pages(0, len(ids) + 3)
    hidden = builtin.hidden(ids, table)
    [out] = builtin.drafter().catch_up([inputs_for(ids, table, hidden, 0, len(ids) - 1, 3)])
    got, want = builtin.logits(out), reference.catch_up_logits(ids)
    assert got.shape == want.shape == (len(ids) - 1, builtin.loaded.config.vocab_size)
    diff = (got - want).abs().max().item()
    assert diff < 2e-4, f"max |logit diff| {diff:.2e} over {len(ids) - 1} entries"
    # The layer is the trained one: it predicts token t + 2 often (JSON: nearly always).
    hits = (want[:-1].argmax(-1) == torch.tensor(ids[2:])).double().mean().item()
    assert hits > {"code": 0.25, "json": 0.9}[prompt]


def test_drafts_follow_the_reference_chain(builtin, reference, prompts):
    """k = 3 on a JSON tool-call prompt: draft 1 is the MTP's argmax at the last entry;
    drafts 2 and 3 are the argmax (or within a near-tie of it) of the float64 chain fed
    the MTP's own hidden states and the previous drafts."""
    ids = prompts["json"]
    table = pages(0, len(ids) + 3)
    hidden = builtin.hidden(ids, table)
    drafter = builtin.drafter()
    inp = inputs_for(ids, table, hidden, 0, len(ids) - 1, 3)
    [proposal] = drafter.propose([inp])
    drafts = list(proposal.token_ids)
    assert len(drafts) == 3 and proposal.probs is None
    [out] = drafter.catch_up([inp])
    assert drafts[0] == int(builtin.logits(out[-1:]).argmax())
    chain = reference.chain_logits(ids, drafts[:-1])[len(ids) - 2 :]  # drafts 1, 2, 3
    for row, token in zip(chain, drafts, strict=True):
        assert row[token] > row.max() - 1e-3


# --------------------------------------------------------------------------
# The drafter's K/V and batching
# --------------------------------------------------------------------------


def test_catch_up_in_two_chunks_equals_one(builtin, prompts):
    """The second chunk reads the first's K/V from the store (a prefill in two steps)."""
    ids = prompts["code"]
    n, cut = len(ids) - 1, (len(ids) - 1) // 2 + 5
    drafter = builtin.drafter()
    one, two = pages(0, n + 1), pages(40, n + 1)
    hidden = builtin.hidden(ids, one)
    [whole] = drafter.catch_up([inputs_for(ids, one, hidden, 0, n)])
    [first] = drafter.catch_up([inputs_for(ids, two, hidden, 0, cut)])
    [second] = drafter.catch_up([inputs_for(ids, two, hidden, cut, n)])
    torch.testing.assert_close(torch.cat((first, second)), whole, rtol=0, atol=1e-5)


def test_a_batch_proposes_what_each_sequence_proposes_alone(builtin, prompts):
    """One ragged forward per MTP step: sequences with different drafts allowed (3, 1, and
    0 while prefilling) get what they get one at a time."""
    code, json_ids = prompts["code"], prompts["json"]
    tables = [pages(0, len(code) + 3), pages(30, len(json_ids) + 3), pages(70, len(code))]
    hidden = [builtin.hidden(code, tables[0]), builtin.hidden(json_ids, tables[1])]
    batch = [
        inputs_for(code, tables[0], hidden[0], 0, len(code) - 1, 3, seq_id=1),
        inputs_for(json_ids, tables[1], hidden[1], 0, len(json_ids) - 1, 1, seq_id=2),
        inputs_for(code, tables[2], hidden[0], 0, 20, 0, seq_id=3),  # prefilling
    ]
    together = builtin.drafter().propose(batch)
    alone = [builtin.drafter().propose([inp])[0] for inp in batch]
    assert [list(p.token_ids) for p in together] == [list(p.token_ids) for p in alone]
    assert [len(p.token_ids) for p in together] == [3, 1, 0]


def test_a_decode_round_catches_up_on_the_accepted_tokens(builtin, prompts):
    """After a step that verified drafts, the catch-up covers the pending token and the
    accepted drafts; it equals a catch-up of the whole sequence at once."""
    ids = prompts["code"]
    prompt = ids[:-4]  # then the target accepted 3 drafts and sampled a 4th token
    table = pages(0, len(ids) + 3)
    hidden = builtin.hidden(ids, table)
    drafter = builtin.drafter()
    drafter.propose([inputs_for(prompt, table, hidden, 0, len(prompt) - 1, 3)])
    round_ = inputs_for(ids, table, hidden, len(prompt) - 1, len(ids) - 1, 3)
    [after] = drafter.catch_up([round_])
    [whole] = builtin.drafter().catch_up(
        [inputs_for(ids, pages(50, len(ids)), hidden, 0, len(ids) - 1)]
    )
    torch.testing.assert_close(after, whole[len(prompt) - 1 :], rtol=0, atol=1e-5)


def test_hidden_states_are_required(builtin, prompts):
    ids = prompts["code"]
    inp = DraftInput(0, ids, 0, 4, pages(0, 8), 0, hidden=None)
    with pytest.raises(ValueError, match="hidden states"):
        builtin.drafter().propose([inp])


# --------------------------------------------------------------------------
# Checkpoints: both namings, refusals
# --------------------------------------------------------------------------


def _mtp_tensors(config: dict, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random MTP tensors under Qwen3-Next names for a model of `config`."""
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (q, h),
        "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (i, h),
        "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i),
    }
    out = {f"mtp.{k}": torch.randn(*s, generator=gen) * 0.05 for k, s in shapes.items()}
    for name, size in [
        ("pre_fc_norm_embedding", h),
        ("pre_fc_norm_hidden", h),
        ("norm", h),
        ("layers.0.input_layernorm", h),
        ("layers.0.post_attention_layernorm", h),
        ("layers.0.self_attn.q_norm", d),
        ("layers.0.self_attn.k_norm", d),
    ]:
        out[f"mtp.{name}.weight"] = 1 + 0.1 * torch.randn(size, generator=gen)
    return out


def _deepseek(tensors: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The same tensors under DeepSeek-V3's names (layer `layers` of the checkpoint)."""
    p = f"model.layers.{layers}."
    renames = {
        "mtp.fc.weight": p + "eh_proj.weight",
        "mtp.pre_fc_norm_embedding.weight": p + "enorm.weight",
        "mtp.pre_fc_norm_hidden.weight": p + "hnorm.weight",
        "mtp.norm.weight": p + "shared_head.norm.weight",
    }
    return {renames.get(k, k.replace("mtp.layers.0.", p)): v for k, v in tensors.items()}


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory) -> Path:
    return ensure_random_model(tmp_path_factory.mktemp("random") / "model")


def _folder(base: Path, out: Path, extra: dict[str, torch.Tensor]) -> Path:
    """The random model at `base` with `extra` tensors added, as a folder at `out`."""
    out.mkdir()
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(
        {**load_file(str(base / "model.safetensors")), **extra}, str(out / "model.safetensors")
    )
    return out


def _target(host, path: Path, options: DraftOptions = NO_OPTIONS) -> Target:
    runtime, device = RuntimeConfig(dtype="fp32"), probe_device(use_cuda=False)
    return Target(load_model(path, host=host, device=device, runtime=runtime), host, options)


def test_a_model_without_mtp_weights_is_refused_with_the_alternative(host, random_dir):
    target = _target(host, random_dir)
    assert not any(n.startswith("mtp.") for n in target.loaded.artifact.tensor_names())
    support = MTPStrategy().supports_model(target.target, DraftOptions())
    assert not support.ok
    assert "mtp.fc.weight" in support.reason and "model.layers.4.eh_proj.weight" in support.reason
    assert "--spec ngram" in support.reason


def test_a_misshapen_mtp_tensor_is_refused_by_name(host, random_dir, tmp_path):
    extra = _mtp_tensors(train_config(random_dir))
    extra["mtp.layers.0.mlp.up_proj.weight"] = extra["mtp.layers.0.mlp.up_proj.weight"][:-1]
    target = _target(host, _folder(random_dir, tmp_path / "bad", extra))
    support = MTPStrategy().supports_model(target.target, DraftOptions())
    assert not support.ok and "mtp.layers.0.mlp.up_proj.weight" in support.reason


def test_deepseek_names_load_to_the_same_logits_as_qwen3_next_names(host, random_dir, tmp_path):
    config = train_config(random_dir)
    qwen = _mtp_tensors(config)
    seek = _deepseek(qwen, config["num_hidden_layers"])
    logits = []
    for name, extra in [("qwen3-next", qwen), ("deepseek-v3", seek)]:
        target = _target(host, _folder(random_dir, tmp_path / name, extra))
        assert MTPStrategy().supports_model(target.target, DraftOptions()).ok
        ids = list(range(40, 80))
        table = pages(0, len(ids) + 2)
        hidden = target.hidden(ids, table)
        drafter = target.drafter()
        [out] = drafter.catch_up([inputs_for(ids, table, hidden, 0, len(ids) - 1)])
        logits.append(target.logits(out))
    assert torch.equal(logits[0], logits[1])


def test_lm_head_draft_without_a_draft_head_is_served_by_one_built_while_loading(
    host, random_dir, tmp_path
):
    from ninfer_core.spec.draft_head import ReducedHead, has_draft_head

    target = _target(
        host, _folder(random_dir, tmp_path / "m", _mtp_tensors(train_config(random_dir))),
        DraftOptions(lm_head_draft=True, draft_vocab=64),
    )  # fmt: skip
    assert not has_draft_head(target.loaded.artifact)
    assert MTPStrategy().supports_model(target.target, DraftOptions(lm_head_draft=True)).ok
    head = target.drafter().head
    assert isinstance(head, ReducedHead) and head.rows == 64


def train_config(folder: Path) -> dict:
    import json

    return json.loads((folder / "config.json").read_text())


# --------------------------------------------------------------------------
# Contract and registration
# --------------------------------------------------------------------------


def test_the_strategy_and_drafter_keep_their_contracts(builtin):
    strategy = MTPStrategy()
    conformance.check(strategy, DraftStrategy, "draft strategy 'mtp'")
    assert strategy.supports(probe_device(use_cuda=False))
    assert strategy.supports_model(builtin.target, DraftOptions())
    drafter = strategy.create(builtin.target, DraftOptions())
    conformance.check(drafter, Drafter, "the drafter of 'mtp'")
    assert drafter.uses_hidden is True
    assert drafter.store.layout.num_layers == 1
    assert drafter.store.layout.num_blocks == NUM_BLOCKS
    drafter.release(0)  # nothing kept per sequence


def test_register_draft_strategies_returns_the_strategy():
    [strategy] = draft_mtp.register_draft_strategies()
    assert strategy.name == "mtp"


def test_the_host_lists_mtp_under_draft_strategies():
    host = create_host(load_entry_points=False, extra_plugins=[("draft-mtp", draft_mtp)])
    assert isinstance(host.draft_strategies.get("mtp"), MTPStrategy)


def test_the_plugin_is_declared_as_an_entry_point():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["entry-points"]["ninfer"]["draft-mtp"] == "ninfer_plugins.draft_mtp"
