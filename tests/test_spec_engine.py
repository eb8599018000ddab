"""Speculative decoding in the engine: lossless, rolled back exactly, and never in the way.

The target is the shipped built-in model in fp32 (its code and JSON text make drafts that
are right most of the time and wrong some of the time). A scripted drafter proposes the
tokens a run without speculation produced, corrupting some of them on purpose, so every
round exercises acceptance, rejection and the bonus token; the real strategies are checked
the same way against the same reference (a run without speculation).
"""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

import pytest
import torch
from spec_helpers import ScriptedDrafter, mixed_steps, speculate_with

from ninfer_core.builtin_model import BUILTIN_ARTIFACT
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.prefix_cache import chain_hashes
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.errors import UnknownNameError, UnsupportedChoiceError
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.sampling import SamplingParams
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.types import Proposal
from ninfer_core.text import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import builtin_corpus

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0)
CODE = '''import os


def walk_sizes(root):
    """Yield (path, size) for every file under root."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
'''


@pytest.fixture(scope="module")
def builtin():
    host, device = create_host(), probe_device(use_cuda=False)
    runtime = RuntimeConfig(dtype="fp32")
    loaded = load_model(BUILTIN_ARTIFACT, host=host, device=device, runtime=runtime)
    return loaded, host, device


@pytest.fixture(scope="module")
def prompts(builtin) -> dict[str, list[int]]:
    tokenizer = Tokenizer.from_artifact(builtin[0].artifact)
    template = builtin_corpus.ChatTemplate(builtin_corpus.CHAT_TEMPLATE)
    transcript = builtin_corpus.transcript(random.Random(10**9 + 7), template)
    # Up to the assistant's first tool call: the model continues with JSON.
    cut = transcript.index("<tool_call>") + len("<tool_call>\n")
    return {
        "code": tokenizer.encode(CODE, add_special_tokens=False),
        "json": tokenizer.encode(transcript[:cut], add_special_tokens=False),
    }


def make_engine(builtin, spec: SpecConfig | None = None, **config) -> Engine:
    loaded, host, device = builtin
    ec = EngineConfig(**{"kv_capacity": 2048, "max_concurrency": 4, **config})
    return Engine(loaded, ec, host=host, device=device, kv_dtype="fp32", spec=spec, seed=0)


def request(ids: list[int], n: int = 48, params: SamplingParams = GREEDY, **kw):
    return GenerationRequest(ids, params, max_tokens=n, ignore_eos=True, **kw)


def reference(builtin, ids: list[int], n: int = 48, **kw) -> list[int]:
    engine = make_engine(builtin)
    (result,) = engine.generate([request(ids, n, **kw)])
    return result.token_ids


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("content", ["code", "json"])
def test_greedy_output_is_the_same_with_drafts_accepted_and_rejected(builtin, prompts, k, content):
    ids = prompts[content]
    want = reference(builtin, ids)
    drafter = ScriptedDrafter([ids + want])
    engine = speculate_with(make_engine(builtin), drafter, k)
    (result,) = engine.generate([request(ids)])
    assert result.token_ids == want
    spec = result.finish.usage.spec
    assert 0 < spec.accepted < spec.drafted  # both paths ran
    assert spec.rounds >= 48 // (k + 1)
    assert engine.spec_counters.drafted == spec.drafted
    assert sum(engine.spec_counters.accepted_per_pos) == spec.accepted
    assert drafter.released  # told when the sequence ended
    engine.check_invariants()


def test_a_batch_of_four_beside_a_prefill_with_the_prefix_cache(builtin, prompts):
    code, js = prompts["code"], prompts["json"]
    starts = [code, js, code[:40], js[:-3]]
    wants = [reference(builtin, ids) for ids in starts]
    long_prompt = (code * 6)[:300]
    long_want = reference(builtin, long_prompt, 16)
    drafter = ScriptedDrafter([s + w for s, w in zip(starts, wants, strict=True)])
    engine = speculate_with(make_engine(builtin, prefill_chunk=64), drafter, 3)
    results = [engine.add(request(ids)) for ids in starts]
    for _ in range(6):
        engine.step()
    late = engine.add(request(long_prompt, 16))  # prefilled in chunks beside the decodes
    assert mixed_steps(engine) >= 2
    assert [r.token_ids for r in results] == wants
    assert late.token_ids == long_want
    assert engine.spec_counters.accepted > 0


def test_rejected_rounds_leave_pages_and_the_prefix_cache_as_a_plain_run(builtin, prompts):
    ids = prompts["code"]
    plain, spec = make_engine(builtin), make_engine(builtin)
    want = reference(builtin, ids, 60)
    speculate_with(spec, ScriptedDrafter([ids + want], wrong_every=3), 4)
    seen: dict[str, dict[int, tuple]] = {"plain": {}, "spec": {}}
    for name, engine in (("plain", plain), ("spec", spec)):
        result = engine.add(request(ids, 60))
        while engine.has_work:
            engine.step()
            (seq,) = engine.scheduler.running or [None]
            if seq is not None:
                bm = engine.block_manager
                computed = seq.num_computed_tokens
                table = tuple(seq.block_table[: bm.blocks_for(computed)])
                seen[name][len(seq.token_ids)] = (computed, table, tuple(seq.block_hashes))
        assert result.token_ids == want
    common = seen["plain"].keys() & seen["spec"].keys()
    assert len(common) >= 10
    for n in common:
        assert seen["spec"][n] == seen["plain"][n]
    # The cache indexes the same blocks, under keys of accepted tokens only.
    plain_index, spec_index = (
        dict(plain.block_manager.cache.items()),
        dict(spec.block_manager.cache.items()),
    )
    assert spec_index == plain_index and len(spec_index) >= 4
    root = spec.block_manager.cache.root
    accepted_keys = set(chain_hashes(ids + want, 16, root))
    assert set(spec_index) <= accepted_keys
    # ... and those blocks hold the same K/V: no rejected token's K/V was ever cached.
    for block in spec_index.values():
        table = torch.tensor([block])
        for layer in range(builtin[0].config.num_layers):
            k_plain, v_plain = plain.runtime.kv_store.gather(layer, table)
            k_spec, v_spec = spec.runtime.kv_store.gather(layer, table)
            torch.testing.assert_close(k_spec, k_plain, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v_spec, v_plain, atol=1e-4, rtol=1e-4)


def test_penalties_stop_strings_and_max_tokens_see_the_same_tokens(builtin, prompts):
    ids = prompts["code"]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)
    want = reference(builtin, ids, 40, params=params)
    engine = make_engine(builtin)
    text = engine.tokenizer.decode(want)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    (plain,) = make_engine(builtin).generate([request(ids, 40, params, stop=[stop])])
    for k in (2, 5):
        drafter = ScriptedDrafter([ids + want], wrong_every=5)
        spec = speculate_with(make_engine(builtin), drafter, k)
        (full,) = spec.generate([request(ids, 40, params)])
        assert full.token_ids == want
        (stopped,) = spec.generate([request(ids, 40, params, stop=[stop])])
        assert (stopped.text, stopped.finish.reason) == (plain.text, plain.finish.reason)
        assert stopped.finish.usage.completion_tokens == plain.finish.usage.completion_tokens
        # A limit inside a round: 7 tokens is never a multiple of a round's yield here.
        (short,) = spec.generate([request(ids, 7, params)])
        assert short.token_ids == want[:7] and short.finish.reason == "length"
        spec.check_invariants()


def test_the_drafter_hears_what_was_accepted(builtin, prompts):
    ids = prompts["json"]
    want = reference(builtin, ids, 24)
    drafter = ScriptedDrafter([ids + want], wrong_every=3)
    engine = speculate_with(make_engine(builtin), drafter, 3)
    (result,) = engine.generate([request(ids, 24)])
    told = [item.accepted for item in drafter.inputs if item.accepted is not None]
    spec = result.finish.usage.spec
    # Every verified round is reported, except the last (the request ended in it).
    assert len(told) >= spec.rounds - 1 and sum(told) <= spec.accepted


def test_a_failing_drafter_is_logged_once_and_decoding_goes_on(builtin, prompts, caplog):
    ids = prompts["code"]
    want = reference(builtin, ids, 20)

    class Broken(ScriptedDrafter):
        def propose(self, inputs):
            raise RuntimeError("drafter broke")

    engine = speculate_with(make_engine(builtin), Broken([]), 3)
    with caplog.at_level(logging.ERROR):
        (result,) = engine.generate([request(ids, 20)])
    assert result.token_ids == want
    assert sum("drafter failed" in r.message for r in caplog.records) == 1


def test_bad_proposals_are_dropped_not_sent(builtin, prompts):
    ids = prompts["code"]
    want = reference(builtin, ids, 12)

    class OutOfVocab(ScriptedDrafter):
        def propose(self, inputs):
            return [Proposal([10**6]) for _ in inputs]

    engine = speculate_with(make_engine(builtin), OutOfVocab([]), 3)
    (result,) = engine.generate([request(ids, 12)])
    assert result.token_ids == want


def test_seeded_sampling_with_drafts_is_reproducible(builtin, prompts):
    ids = prompts["json"]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    want = reference(builtin, ids, 32)
    runs = []
    for _ in range(2):
        drafter = ScriptedDrafter([ids + want], wrong_every=3)
        engine = speculate_with(make_engine(builtin), drafter, 3)
        (result,) = engine.generate([request(ids, 32, params)])
        runs.append(result.token_ids)
        assert len(result.token_ids) == 32
    assert runs[0] == runs[1]


def test_ngram_is_lossless_and_accepts_on_repeated_code(builtin, prompts):
    ids = prompts["code"] * 2  # the continuation repeats what came before
    want = reference(builtin, ids, 40)
    engine = make_engine(builtin, spec=SpecConfig(spec="ngram", draft_tokens=4))
    (result,) = engine.generate([request(ids, 40)])
    assert result.token_ids == want
    assert result.finish.usage.spec.accepted > 0


def test_spec_options_are_checked(builtin):
    with pytest.raises(ValueError, match="needs --spec"):
        SpecConfig(draft_tokens=3)
    with pytest.raises(ValueError, match="draft_tokens"):
        SpecConfig(spec="ngram", draft_tokens=0)
    with pytest.raises(UnknownNameError):
        make_engine(builtin, spec=SpecConfig(spec="nope"))


STRATEGIES = [SpecConfig(spec="ngram", draft_tokens=k) for k in (1, 3, 5)] + [
    SpecConfig(spec="mtp", draft_tokens=k) for k in (1, 3, 5)
]


@pytest.mark.parametrize("spec", STRATEGIES, ids=lambda s: f"{s.spec}-k{s.draft_tokens}")
def test_each_strategy_is_lossless_alone_and_in_a_batch_beside_a_prefill(builtin, prompts, spec):
    code, js = prompts["code"], prompts["json"]
    starts = [code, js, code * 2, js[:-5]]
    wants = [reference(builtin, ids, 32) for ids in starts]
    engine = make_engine(builtin, spec=spec, prefill_chunk=64)
    assert engine.spec_name == spec.spec
    for ids, want in zip(starts[:2], wants, strict=False):  # alone
        (result,) = engine.generate([request(ids, 32)])
        assert result.token_ids == want
    results = [engine.add(request(ids, 32)) for ids in starts]  # four at once
    for _ in range(3):
        engine.step()
    late = engine.add(request((js * 3)[:250], 8))  # a prefill beside the decodes
    while engine.has_work:
        engine.step()
    assert [r.token_ids for r in results] == wants
    assert late.token_ids == reference(builtin, (js * 3)[:250], 8)
    counters = engine.spec_counters
    assert counters.rounds and 0 < counters.accepted <= counters.drafted
    engine.check_invariants()


@pytest.fixture(scope="module")
def with_draft_head(builtin, prompts, tmp_path_factory):
    """The built-in model with a 256-row draft head ranked over a small code/JSON corpus,
    loaded like `builtin`."""
    from ninfer_core.draft_head_build import build_draft_head

    corpus = tmp_path_factory.mktemp("corpus")
    tokenizer = Tokenizer.from_artifact(builtin[0].artifact)
    (corpus / "code.py").write_text(CODE * 3, encoding="utf-8")
    (corpus / "calls.json").write_text(tokenizer.decode(prompts["json"]), encoding="utf-8")
    out = tmp_path_factory.mktemp("head") / "builtin.draft-head.ninfer"
    build_draft_head(BUILTIN_ARTIFACT, corpus, 256, out=out, heldout_fraction=0.0,
                     runtime=RuntimeConfig(dtype="fp32"))  # fmt: skip
    _, host, device = builtin
    return (
        load_model(out, host=host, device=device, runtime=RuntimeConfig(dtype="fp32")),
        host,
        device,
    )


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mtp_with_the_reduced_draft_head_is_lossless(builtin, with_draft_head, prompts, k):
    spec = SpecConfig(spec="mtp", draft_tokens=k, lm_head_draft=True)
    engine = make_engine(with_draft_head, spec=spec)
    starts = [prompts["code"], prompts["json"]]
    results = engine.generate([request(ids, 32) for ids in starts])
    assert [r.token_ids for r in results] == [reference(builtin, ids, 32) for ids in starts]
    assert engine.spec_counters.accepted > 0


def test_lm_head_draft_without_a_draft_head_builds_one_while_loading(builtin, prompts):
    """The built-in model ships no reduced head: `--lm-head-draft` makes one of its
    lowest `--draft-vocab` ids, the stop tokens among them, and greedy output is the
    target's whatever the drafts."""
    from ninfer_core.spec.draft_head import ReducedHead, id_order_rows, special_ids

    loaded = builtin[0]
    spec = SpecConfig(spec="mtp", draft_tokens=3, lm_head_draft=True, draft_vocab=256)
    engine = make_engine(builtin, spec=spec)
    head = engine.drafter.head
    assert isinstance(head, ReducedHead) and head.rows == 256
    special = special_ids(loaded.artifact, loaded.config.vocab_size)
    assert set(special) <= set(head.token_ids.tolist())
    assert head.token_ids.tolist() == id_order_rows(loaded.config.vocab_size, special, 256)
    starts = [prompts["code"], prompts["json"]]
    results = engine.generate([request(ids, 32) for ids in starts])
    assert [r.token_ids for r in results] == [reference(builtin, ids, 32) for ids in starts]
    assert engine.spec_counters.accepted > 0


def test_mtp_on_a_model_without_an_mtp_layer_names_ngram(engine_model):
    loaded, host, device = engine_model
    with pytest.raises(UnsupportedChoiceError, match="ngram"):
        Engine(loaded, EngineConfig(kv_capacity=256), host=host, device=device,
               spec=SpecConfig(spec="mtp"))  # fmt: skip


@pytest.fixture(scope="module")
def builtin_bf16(builtin):
    _, host, device = builtin
    runtime = RuntimeConfig(dtype="bf16")
    return load_model(BUILTIN_ARTIFACT, host=host, device=device, runtime=runtime), host, device


def test_verify_rows_equal_one_token_decodes_bit_for_bit_in_bf16(builtin_bf16):
    """Why greedy output stays the same in bf16: a round's rows are each computed exactly
    as that token decoded alone (row-invariant GEMMs, `_decode_rows` attention)."""
    from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
    from ninfer_core.engine.sequence import Sequence

    loaded, host, device = builtin_bf16
    extra = [50, 60, 70, 80, 90]
    # contexts on and off the padded key counts a lone decode reads (`decode_length`)
    for prompt in (40, 150, 321):
        ids = [(7 * i) % 4000 + 5 for i in range(prompt)]
        runs = []
        for rows in (1, len(extra)):
            runtime = build_runtime(loaded, host, device, RuntimeSpec.for_tokens(512))
            seq = Sequence(ids + extra)
            runtime.runner.run([(seq, len(ids))])
            if rows == 1:
                runs.append(torch.cat([runtime.runner.run([(seq, 1)]) for _ in extra]))
            else:
                runs.append(runtime.runner.run([(seq, rows)], all_tokens=True))
        assert torch.equal(runs[0], runs[1]), prompt


class _Fresh:
    """A sequence of `length` tokens with `computed` in the store (`AttentionMetadata.build`)."""

    def __init__(self, table: list[int], computed: int, length: int) -> None:
        self.seq_id, self.num_computed_tokens, self.block_table = 0, computed, table
        self.length = length

    def __len__(self) -> int:
        return self.length


@pytest.mark.parametrize("heads", [(4, 2, 32), (3, 3, 64)])  # built-in, SmolLM2 (Hkv, G, D)
def test_a_rounds_attention_rows_equal_lone_decodes_at_every_length(heads):
    """The reference's paged attention of a round's rows against each row decoded alone,
    at many contexts and round sizes, over random bf16 K/V: a GEMM whose kernel or
    summation order depends on the row count or the key count shows here (both did on
    an AVX512 CPU: one matmul for all rows, and rows over 326 keys where a lone decode
    reads its padded 352)."""
    from ninfer_core.kernels.reference import FEW_ROWS, TorchOps
    from ninfer_core.kv.layout import KVLayout
    from ninfer_core.model.attention_meta import AttentionMetadata

    hkv, group, dim = heads
    bs, pages = 16, 48
    gen = torch.Generator().manual_seed(5)
    store = (
        create_host()
        .kv_codecs.get("bf16")
        .allocate(KVLayout(1, hkv, dim, bs, pages), "cpu", torch.bfloat16)
    )
    table = list(range(pages))
    ops = TorchOps("cpu")
    # scaled up: peaked attention, as a trained model's, shows last-bit differences more
    keys = (3 * torch.randn(pages * bs, hkv, dim, generator=gen)).bfloat16()
    store.write(0, torch.arange(pages * bs), keys, keys.flip(0))

    def attend(q: torch.Tensor, computed: int) -> torch.Tensor:
        n = q.shape[0]
        meta = AttentionMetadata.build([(_Fresh(table, computed, computed + n), n)], bs)
        ops.prepare(meta)
        k, v = keys[computed : computed + n], keys.flip(0)[computed : computed + n]
        return ops.paged_attention(q, k, v, store, 0, meta, 0.17)

    for end in range(FEW_ROWS + 1, 700):
        for rows in (4,) if end % 7 else (2, 4, FEW_ROWS):
            q = (3 * torch.randn(rows, hkv * group, dim, generator=gen)).bfloat16()
            together = attend(q, end - rows)
            for row in range(rows):
                alone = attend(q[row : row + 1], end - rows + row)
                assert torch.equal(together[row : row + 1], alone), (end, rows, row)


@pytest.mark.parametrize("strategy", ["mtp", "ngram"])
def test_greedy_output_is_the_same_in_bf16(builtin_bf16, prompts, strategy):
    loaded, host, device = builtin_bf16

    def run(spec):
        engine = Engine(loaded, EngineConfig(kv_capacity=2048), host=host, device=device,
                        spec=spec)  # fmt: skip
        return [
            r.token_ids for r in engine.generate([request(ids, 96) for ids in prompts.values()])
        ]

    assert run(SpecConfig(spec=strategy, draft_tokens=3)) == run(None)
