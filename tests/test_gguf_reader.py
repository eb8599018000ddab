"""The GGUF reader on tiny synthetic files, against transformers loading the same file.

Each file is written here with gguf-py's `GGUFWriter` from a tiny random transformers model,
the way llama.cpp's converter writes one: llama.cpp tensor names, Q/K rows permuted for
Llama, a few tensors quantized (Q8_0, Q4_1, Q5_0) or half (F16, BF16), a byte-level BPE
vocabulary trained on the spot. transformers (`from_pretrained(dir, gguf_file=...)`) is the
independent reference for config, tensors, tokenizer and logits; the original model's
weights check the un-permutation without it. Bad files (truncated, an architecture or tensor
type we do not read, a hostile array length) fail through the CLI in one line.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package (a main dependency) is missing")
pytest.importorskip("transformers", reason="transformers (the reference) needs ninfer[dev]")
pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate")

from checkpoints import tiny_llama_config, tiny_qwen3_config  # noqa: E402
from text_fixtures import CORPUS, SPECIALS, train_backend  # noqa: E402

from ninfer_core.bench.gguf_write import (  # noqa: E402
    Vocab,
    add_hparams,
    add_vocab,
    add_weights,
    bpe_vocab,
    gguf_name,
    write_file,
)
from ninfer_core.cli.main import main  # noqa: E402
from ninfer_core.engine import RuntimeSpec, Sequence, assemble_runtime  # noqa: E402
from ninfer_core.errors import ModelLoadError  # noqa: E402
from ninfer_core.loading import family_and_config, open_artifact  # noqa: E402
from ninfer_core.plugin_host import create_host  # noqa: E402
from ninfer_core.text.chat_template import ChatTemplate  # noqa: E402
from ninfer_core.text.tokenizer import Tokenizer  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
Q = gguf.GGMLQuantizationType
TOL = 1e-4
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# --------------------------------------------------------------------------
# Writing GGUF files as llama.cpp's converter does
# --------------------------------------------------------------------------


def vocabulary(size: int) -> Vocab:
    """A byte-level BPE trained on `CORPUS` (its special tokens CONTROL)."""
    return bpe_vocab(json.loads(train_backend(vocab_size=size).to_str()))


def write_gguf(
    path: Path,
    arch: str,
    model,
    *,
    types: dict[str, object] | None = None,
    pre: str = "llama-bpe",
    add_bos: bool = False,
    tokenizer: bool = True,
    edit=None,
) -> Path:
    """`model` (a transformers decoder) as a GGUF of `arch`, every tensor F32 unless `types`
    (GGUF name -> ggml type) says otherwise; the writing is `ninfer_core.bench.gguf_write`'s."""
    cfg = model.config.to_dict()
    w = gguf.GGUFWriter(str(path), arch)
    add_hparams(w, cfg)
    if tokenizer:
        vocab = vocabulary(cfg["vocab_size"])
        ids = {t: vocab.tokens.index(t) for t in SPECIALS}
        add_vocab(
            w, vocab, pre=pre, bos=ids["<|im_start|>"], eos=ids["<|im_end|>"],
            pad=ids["<|endoftext|>"], add_bos=add_bos, template=TEMPLATE,
        )  # fmt: skip
    if edit is not None:
        edit(w)
    tensors = ((n, t.float().numpy()) for n, t in model.state_dict().items())
    add_weights(w, arch, cfg, tensors, matrices=Q.F32, types=types)
    write_file(w)
    return path


#: Llama: untied head, GQA; tensors in every type the reader turns into numbers here.
LLAMA_TYPES = {
    "token_embd.weight": Q.Q8_0,
    "blk.0.attn_q.weight": Q.Q8_0,
    "blk.0.attn_k.weight": Q.Q4_1,
    "blk.1.ffn_up.weight": Q.Q4_1,
    "blk.1.ffn_down.weight": Q.Q5_0,
    "blk.2.attn_v.weight": Q.F16,
    "blk.2.ffn_gate.weight": Q.BF16,
    "output.weight": Q.Q8_0,
}


def tiny_llama(vocab: int = 400):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(rope_scaling=None, vocab_size=vocab)).eval()


def tiny_qwen3(vocab: int = 400):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(1)
    # transformers reads no head_dim from a qwen3 GGUF (its Qwen3Config default, 128, applies)
    config = tiny_qwen3_config(
        vocab_size=vocab, head_dim=128, num_attention_heads=2, num_key_value_heads=1
    )
    return Qwen3ForCausalLM(config).eval()


def reference(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def reference_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def gguf_open(path: Path):
    return open_artifact(create_host(), path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{arch: (path, original transformers model, transformers model loaded from the GGUF)}."""
    root = tmp_path_factory.mktemp("gguf")
    llama, qwen3 = tiny_llama(), tiny_qwen3()
    out = {
        "llama": write_gguf(root / "llama.gguf", "llama", llama, types=LLAMA_TYPES),
        "qwen3": write_gguf(root / "qwen3.gguf", "qwen3", qwen3, pre="qwen2"),
    }
    models = {"llama": llama, "qwen3": qwen3}
    return {arch: (p, models[arch], reference(p)) for arch, p in out.items()}


# --------------------------------------------------------------------------
# Config, tensors, logits
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_host_picks_the_gguf_reader_and_the_config_matches_transformers(files, arch):
    path, _, ref = files[arch]
    host = create_host()
    assert [r.name for r in host.artifact_readers if r.can_read(path)] == ["gguf"]
    artifact = open_artifact(host, path)
    _, config = family_and_config(host, artifact)
    want = ref.config
    assert config.architecture == type(ref).__name__
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (
        want.hidden_size, want.intermediate_size, want.num_hidden_layers)  # fmt: skip
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        want.num_attention_heads, want.num_key_value_heads, want.head_dim)  # fmt: skip
    assert config.vocab_size == want.vocab_size
    assert config.tie_word_embeddings == want.tie_word_embeddings == (arch == "qwen3")
    assert config.rope_theta == pytest.approx(want.rope_parameters["rope_theta"])
    assert config.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    assert config.qk_norm == (arch == "qwen3")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_tensor_equals_transformers_and_unpermuted_q_k_equal_the_original(files, arch):
    path, original, ref = files[arch]
    artifact = gguf_open(path)
    theirs, source = ref.state_dict(), original.state_dict()
    names = artifact.tensor_names()
    assert set(names) == {n for n in theirs if not (arch == "qwen3" and n == "lm_head.weight")}
    for name in names:
        ours = artifact.load_tensor(name)
        assert tuple(ours.shape) == artifact.tensor_shape(name) == tuple(theirs[name].shape)
        assert torch.equal(ours.float(), theirs[name]), name
        if gguf_name(name) not in LLAMA_TYPES or arch != "llama":  # stored as float32
            assert torch.equal(ours, source[name]), name
    # the stored dtypes: F16 and BF16 as they are, quantized ones dequantized to float32
    assert artifact.load_tensor("model.layers.0.self_attn.k_proj.weight").dtype == torch.float32
    if arch == "llama":
        assert artifact.load_tensor("model.layers.2.self_attn.v_proj.weight").dtype == (
            torch.float16
        )
        assert artifact.load_tensor("model.layers.2.mlp.gate_proj.weight").dtype == (torch.bfloat16)
        records = {r.name: r for r in artifact.object_table()}
        assert records["model.layers.1.mlp.up_proj.weight"].format == "Q4_1"
        assert records["model.embed_tokens.weight"].gguf_name == "token_embd.weight"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_match_transformers_prefill_chunks_and_decode(files, arch):
    path, _, ref = files[arch]
    host = create_host()
    artifact = open_artifact(host, path)
    family, config = family_and_config(host, artifact)
    from ninfer_core.device import probe_device
    from ninfer_plugins.backend_torch import register_kernel_backends
    from ninfer_plugins.kv_plain import register_kv_codecs

    ops = register_kernel_backends()[0].create_ops(probe_device(use_cuda=False))
    model = family.build(config, ops, torch.float32)
    family.load_weights(model, artifact)
    codec = {c.name: c for c in register_kv_codecs()}["fp32"]

    def runner():
        return assemble_runtime(model, config, torch.float32, codec, RuntimeSpec(16, 16)).runner

    ids = torch.randint(0, 400, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    one = runner().run([(Sequence(ids), 70)], all_tokens=True)
    seq, r = Sequence(ids), runner()
    chunks = torch.cat([r.run([(seq, n)], all_tokens=True) for n in (21, 30, 19)])
    seq, r = Sequence(ids), runner()
    steps = torch.cat([r.run([(seq, 1)]) for _ in ids])
    for got in (one, chunks, steps):
        assert (got - want).abs().max().item() <= TOL


# --------------------------------------------------------------------------
# Tokenizer and chat template
# --------------------------------------------------------------------------

TEXTS = [
    *CORPUS[:7],
    "class A:\n    def f(self, x):\n        return x ** 2  # 12345\n\n\n\t\tend",
    "   leading, trailing   \n\n\n   and runs      of spaces",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
]


@pytest.mark.parametrize(
    ("arch", "pre"),
    [("llama", "llama-bpe"), ("qwen3", "qwen2"), ("llama", "smollm"), ("llama", "gpt2"),
     ("llama", "default")],
)  # fmt: skip
def test_tokenizer_ids_match_transformers(tmp_path, arch, pre):
    model = tiny_llama() if arch == "llama" else tiny_qwen3()
    path = write_gguf(tmp_path / f"{pre}.gguf", arch, model, pre=pre)
    ours = Tokenizer.from_artifact(gguf_open(path))
    theirs = reference_tokenizer(path)
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.all_special_ids >= {ours.token_to_id(t) for t in SPECIALS}


def test_add_bos_token_prepends_bos_like_transformers(tmp_path):
    path = write_gguf(tmp_path / "bos.gguf", "llama", tiny_llama(), add_bos=True)
    ours = Tokenizer.from_artifact(gguf_open(path))
    theirs = reference_tokenizer(path)
    assert ours.adds_bos
    assert ours.encode("Hello world") == theirs("Hello world")["input_ids"]
    assert ours.encode("Hello world")[0] == ours.bos_token_id


def test_chat_template_renders_like_transformers(files):
    path, _, _ = files["llama"]
    artifact = gguf_open(path)
    ours = Tokenizer.from_artifact(artifact)
    template = ChatTemplate.from_artifact(artifact, ours.special_tokens)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    want = reference_tokenizer(path).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert template.render(messages, add_generation_prompt=True) == want


def test_an_unknown_pre_tokenizer_fails_in_one_line(tmp_path):
    path = write_gguf(tmp_path / "odd.gguf", "llama", tiny_llama(), pre="no-such-pre")
    with pytest.raises(ModelLoadError) as err:
        Tokenizer.from_artifact(gguf_open(path))
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    assert "'no-such-pre'" in message and "llama-bpe" in message


def test_a_file_without_a_tokenizer_still_opens(tmp_path):
    path = write_gguf(tmp_path / "bare.gguf", "llama", tiny_llama(), tokenizer=False)
    artifact = gguf_open(path)
    assert artifact.read_text("tokenizer.json") is None
    assert json.loads(artifact.read_text("config.json"))["architectures"] == ["LlamaForCausalLM"]


def test_qwen2_keeps_its_qkv_biases_and_unpermuted_rows(tmp_path):
    """Qwen2 (q/k/v biases, no permutation): config and tensors, against transformers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    config = Qwen2Config(
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    path = write_gguf(tmp_path / "qwen2.gguf", "qwen2", model, pre="qwen2")
    artifact, ref = gguf_open(path), reference(path)
    assert artifact.config["architectures"] == ["Qwen2ForCausalLM"]
    theirs, source = ref.state_dict(), model.state_dict()
    assert "model.layers.1.self_attn.q_proj.bias" in artifact.tensor_names()
    for name in artifact.tensor_names():
        assert torch.equal(artifact.load_tensor(name), theirs[name]), name
        assert torch.equal(artifact.load_tensor(name), source[name]), name


# --------------------------------------------------------------------------
# The CLI: inspect, convert, and bad files in one line
# --------------------------------------------------------------------------


def test_inspect_shows_architecture_types_and_counts(files, capsys):
    path, _, _ = files["llama"]
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "read by 'gguf' as LlamaForCausalLM" in out
    assert "model.layers.0.self_attn.q_proj.weight" in out and "Q8_0" in out
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["formats"]["Q4_1"]["tensors"] == 2 and info["formats"]["BF16"]["tensors"] == 1
    assert info["totals"]["tensors"] == len(gguf_open(path).tensor_names())
    assert "tokenizer.json" in info["texts"]


def test_convert_to_ninfer_keeps_the_dequantized_weights(files, tmp_path, capsys):
    path, _, _ = files["llama"]
    out = tmp_path / "llama.ninfer"
    assert main(["convert", str(path), str(out), "--recipe", "bf16", "--no-progress"]) == 0
    capsys.readouterr()
    src, packed = gguf_open(path), open_artifact(create_host(), out)
    assert sorted(packed.tensor_names()) == sorted(src.tensor_names())
    for name in src.tensor_names():
        want = src.load_tensor(name).to(torch.bfloat16)
        assert torch.equal(packed.load_tensor(name), want), name
    assert packed.read_text("tokenizer.json") == src.read_text("tokenizer.json")
    assert json.loads(packed.read_text("config.json")) == src.config


def one_line_error(path: Path, capsys) -> str:
    code = main(["generate", str(path), "--prompt", "hi", "--raw", "--max-new", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ninfer generate: error: {path}: ")
    return lines[0]


def test_a_truncated_file_fails_in_one_line(files, tmp_path, capsys):
    data = files["llama"][0].read_bytes()
    for cut in (3, 200, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        assert "truncated GGUF file" in one_line_error(bad, capsys)


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path, capsys):
    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    line = one_line_error(tmp_path / "gemma.gguf", capsys)
    assert "architecture 'gemma2' is not supported" in line
    assert "llama, mistral, qwen2, qwen3" in line


def _patch_tensor_type(path: Path, tensor: str, raw_type: int) -> None:
    """Overwrite the ggml type of `tensor` in its header record."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, raw_type)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("raw_type", "expected"),
    [(99, "unknown tensor type 99"), (int(Q.Q8_1), "has type Q8_1, which NInfer cannot read")],
)
def test_an_unknown_or_unsupported_tensor_type_names_tensor_and_type(
    files, tmp_path, capsys, raw_type, expected
):
    bad = tmp_path / "type.gguf"
    bad.write_bytes(files["qwen3"][0].read_bytes())  # all F32: Q8_1's block (32) fits
    _patch_tensor_type(bad, "blk.1.attn_v.weight", raw_type)
    line = one_line_error(bad, capsys)
    assert "'blk.1.attn_v.weight'" in line and expected in line


def test_a_hostile_array_length_fails_fast(tmp_path, capsys):
    """An array claiming 2**40 elements is refused before any element is walked."""
    path = write_gguf(
        tmp_path / "huge.gguf", "llama", tiny_llama(), edit=lambda w: w.add_array("x.big", [7])
    )
    data = bytearray(path.read_bytes())
    key = b"x.big"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 4  # type, item
    struct.pack_into("<Q", data, at, 1 << 40)
    path.write_bytes(bytes(data))
    start = time.perf_counter()
    line = one_line_error(path, capsys)
    assert time.perf_counter() - start < 5
    assert "1,099,511,627,776 elements" in line
