"""The peer GGUF files (`ninfer_core.bench.peer_gguf`) on tiny random models.

- `hf_to_gguf`: a tiny Qwen3 (and Llama: Q/K rows permuted) folder as an F16 GGUF; NInfer's
  GGUF reader gives transformers' logits on the folder (the folder holds fp16-representable
  weights, so F16 storage loses nothing) and its tokenizer's ids.
- `gguf_to_f16`: a Q4_0/Q4_1/Q8_0 GGUF dequantized; each tensor equals gguf-py's
  dequantization rounded to half, Q4_0 also a numpy decoding of the blocks written here;
  every metadata key is kept; NInfer's logits on both files are close.
- `quantize` (llama-cpp-python, skipped without it): llama.cpp's quantizer makes Q4_0
  matrices and llama.cpp loads the file; llama.cpp's own logits on the F16 file are
  transformers' (the independent check that llama.cpp reads our file as we mean it).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package (a main dependency) is missing")
pytest.importorskip("transformers", reason="transformers (the reference) needs ninfer[dev]")

from checkpoints import load_reference, write_tiny_llama, write_tiny_qwen3  # noqa: E402
from text_fixtures import CORPUS, train_backend  # noqa: E402

from ninfer_core.bench.gguf_write import (  # noqa: E402
    add_hparams,
    add_vocab,
    add_weights,
    write_file,
)
from ninfer_core.bench.peer_gguf import (  # noqa: E402
    MOSTLY_F16,
    gguf_to_f16,
    hf_tensors,
    hf_to_gguf,
    hf_vocab_keys,
    quantize,
)
from ninfer_core.errors import NInferError  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
Q = gguf.GGMLQuantizationType
TOL = 1e-4
IDS = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()
TEMPLATE = "{% for m in messages %}{{ '<|im_start|>' + m['content'] }}{% endfor %}"
#: Every ggml type gguf_to_f16 turns into F16 here; all rows are multiples of 32.
QUANT_TYPES = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_0,
               "blk.0.attn_k.weight": Q.Q4_0, "blk.0.ffn_up.weight": Q.Q4_1,
               "blk.1.attn_v.weight": Q.Q4_1, "blk.1.ffn_down.weight": Q.Q4_0,
               "blk.2.attn_output.weight": Q.Q8_0}  # fmt: skip


def tiny_folder(path: Path, arch: str) -> Path:
    """A tiny random folder (fp16 weights) with a trained byte-level BPE tokenizer."""
    write = write_tiny_qwen3 if arch == "qwen3" else write_tiny_llama
    extra = {} if arch == "qwen3" else {"rope_scaling": None}
    write(path, dtype=torch.float16, **extra)
    train_backend(vocab_size=300).save(str(path / "tokenizer.json"))
    tok_config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                  "chat_template": TEMPLATE}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer")
    return {arch: tiny_folder(root / arch, arch) for arch in ("qwen3", "llama")}


@pytest.fixture(scope="module")
def f16_files(folders):
    return {arch: hf_to_gguf(f, f.parent / f"{arch}-f16.gguf") for arch, f in folders.items()}


def ninfer_load(path: Path):
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host

    return load_model(
        path, host=create_host(), device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype="fp32"),
    )  # fmt: skip


def ninfer_logits(path: Path) -> torch.Tensor:
    from ninfer_core.eval_ppl import sequence_logits

    return sequence_logits(ninfer_load(path), IDS)


def reference_logits(folder: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_reference(folder)(torch.tensor([IDS])).logits[0]


# --------------------------------------------------------------------------
# hf_to_gguf
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_hf_to_gguf_logits_match_transformers_on_the_folder(folders, f16_files, arch):
    path = f16_files[arch]
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == Q.F16 and types["token_embd.weight"] == Q.F16
    assert types["blk.0.attn_norm.weight"] == Q.F32
    assert ("blk.0.attn_q_norm.weight" in types) == (arch == "qwen3")
    assert ("output.weight" in types) == (arch == "llama")  # qwen3's head is tied
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields["general.file_type"].contents() == MOSTLY_F16
    got, want = ninfer_logits(path), reference_logits(folders[arch])
    assert (got - want).abs().max().item() <= TOL


def test_hf_to_gguf_writes_the_tokenizer_and_its_special_ids(folders, f16_files):
    from tokenizers import Tokenizer as HFTokenizer

    from ninfer_core.loading import open_artifact
    from ninfer_core.plugin_host import create_host
    from ninfer_core.text.tokenizer import Tokenizer

    ours = Tokenizer.from_artifact(open_artifact(create_host(), f16_files["qwen3"]))
    theirs = HFTokenizer.from_file(str(folders["qwen3"] / "tokenizer.json"))
    for text in CORPUS[:7]:
        assert ours.encode(text) == theirs.encode(text).ids, text
    fields = gguf.GGUFReader(str(f16_files["qwen3"])).fields
    assert fields["tokenizer.ggml.eos_token_id"].contents() == theirs.token_to_id("<|im_end|>")
    assert fields["tokenizer.ggml.padding_token_id"].contents() == (
        theirs.token_to_id("<|endoftext|>")
    )
    assert fields["tokenizer.ggml.add_bos_token"].contents() is False
    assert fields["tokenizer.ggml.pre"].contents() == "qwen2"
    assert fields["tokenizer.chat_template"].contents() == TEMPLATE
    tokens, kinds = (fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "token_type"))
    assert len(tokens) == 300  # the model's vocabulary; ids past the tokenizer's are padding
    assert kinds[tokens.index("<|im_end|>")] == 3
    assert all(k == 5 for t, k in zip(tokens, kinds, strict=True) if t.startswith("[PAD"))


def test_an_unsupported_model_type_names_the_supported_ones(folders, tmp_path):
    config = json.loads((folders["qwen3"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    with pytest.raises(NInferError, match=r"'gemma2'.*llama, mistral, qwen2, qwen3"):
        hf_to_gguf(tmp_path, tmp_path / "x.gguf")


# --------------------------------------------------------------------------
# gguf_to_f16
# --------------------------------------------------------------------------


def q4_0_blocks(raw: np.ndarray, cols: int) -> np.ndarray:
    """Q4_0 decoded from its bytes: per 32 weights an f16 scale d and 16 bytes, the low
    nibbles the first 16 weights and the high ones the last 16, each (q - 8) * d."""
    blocks = raw.reshape(-1, 18)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64)
    q = blocks[:, 2:]
    codes = np.concatenate([q & 0x0F, q >> 4], axis=1).astype(np.float64) - 8
    return (codes * d).reshape(-1, cols)


@pytest.fixture(scope="module")
def quantized(folders):
    """The tiny Qwen3 as a GGUF with QUANT_TYPES, written by the same helpers."""
    folder = folders["qwen3"]
    config = json.loads((folder / "config.json").read_text())
    path = folder.parent / "qwen3-quant.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    add_hparams(w, config)
    keys = hf_vocab_keys(folder, config, "qwen2")
    add_vocab(w, keys.pop("vocab"), **keys)
    w.add_file_type(3)
    add_weights(w, "qwen3", config, hf_tensors(folder), types=QUANT_TYPES)
    write_file(w)
    return path


def test_gguf_to_f16_stores_the_dequantized_values_and_keeps_the_rest(quantized, tmp_path):
    out = gguf_to_f16(quantized, tmp_path / "f16.gguf")
    src, dst = gguf.GGUFReader(str(quantized)), gguf.GGUFReader(str(out))
    theirs = {t.name: t for t in dst.tensors}
    assert [t.name for t in src.tensors] == list(theirs)
    for t in src.tensors:
        mine = theirs[t.name]
        assert list(mine.shape) == list(t.shape), t.name
        if t.tensor_type in (Q.F32, Q.F16):
            assert mine.tensor_type == t.tensor_type
            assert np.array_equal(mine.data, t.data), t.name
            continue
        assert mine.tensor_type == Q.F16, t.name
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16)
        assert np.array_equal(mine.data, want), t.name
        if t.tensor_type == Q.Q4_0:
            ours = q4_0_blocks(np.asarray(t.data), int(t.shape[0])).astype(np.float16)
            assert np.array_equal(mine.data, ours), t.name
    assert {t.tensor_type for t in src.tensors} >= {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F32}
    skip = {"general.file_type", "GGUF.tensor_count", "GGUF.kv_count"}
    for name, field in src.fields.items():
        if name not in skip:
            assert dst.fields[name].contents() == field.contents(), name
    assert dst.fields["general.file_type"].contents() == MOSTLY_F16


def test_ninfer_logits_on_the_f16_file_match_the_quantized_file(quantized, tmp_path):
    out = gguf_to_f16(quantized, tmp_path / "f16.gguf")
    want, got = ninfer_logits(quantized), ninfer_logits(out)
    # the only difference: the dequantized weights rounded to half (~5e-4 relative)
    assert (got - want).abs().max().item() <= 2e-3 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# --------------------------------------------------------------------------
# quantize: llama.cpp's quantizer, llama.cpp loading our files
# --------------------------------------------------------------------------

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python (an optional peer) is not installed",
)


def llama_cpp_logits(path: Path) -> torch.Tensor:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(IDS)
    out = torch.from_numpy(np.array(llm.scores[: len(IDS)], dtype=np.float32))
    llm.close()
    return out


@needs_llama_cpp
def test_quantize_makes_q4_0_matrices_that_llama_cpp_loads(f16_files, tmp_path):
    import llama_cpp

    out = quantize(f16_files["qwen3"], tmp_path / "q4_0.gguf", "q4_0", threads=1)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    blocks = {n: k for n, k in types.items() if n.startswith("blk.") and "norm" not in n}
    assert blocks and set(blocks.values()) == {Q.Q4_0}
    assert types["blk.0.attn_norm.weight"] == Q.F32
    llm = llama_cpp.Llama(str(out), n_ctx=64, n_threads=1, verbose=False)
    tokens = []
    for token in llm.generate(IDS[:8], top_k=1):
        tokens.append(token)
        if len(tokens) == 3:
            break
    assert len(tokens) == 3 and all(0 <= t < 300 for t in tokens)
    llm.close()


@needs_llama_cpp
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_llama_cpp_reads_the_f16_file_as_transformers_reads_the_folder(folders, f16_files, arch):
    got, want = llama_cpp_logits(f16_files[arch]), reference_logits(folders[arch])
    # llama.cpp rounds activations to half for F16 matrices: close, not exact
    assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_quantize_without_llama_cpp_says_how_to_install_it(f16_files, tmp_path, monkeypatch):
    monkeypatch.setattr("ninfer_core.bench.peers.llama_cpp_installed", lambda: False)
    with pytest.raises(NInferError, match="pip install llama-cpp-python") as err:
        quantize(f16_files["qwen3"], tmp_path / "x.gguf")
    assert "\n" not in str(err.value)
    with pytest.raises(NInferError, match="'q3_k'"):
        quantize(f16_files["qwen3"], tmp_path / "x.gguf", "q3_k")
