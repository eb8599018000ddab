"""The engines `ninfer bench decode` compares NInfer against: llama.cpp on the same GGUF
(through `llama-cpp-python`, an optional peer that NInfer never installs) and transformers
`generate` on the same folder (or a GGUF, dequantized). `choose_peer` decides which runs.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from ninfer_core.bench.decode import DTYPES, WARMUP_TOKENS, CpuShare, EngineRun, best_of
from ninfer_core.errors import NInferError

#: The llama-cpp-python release the figures in bench/README.md were measured with.
LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_INSTALL = (
    f"pip install llama-cpp-python=={LLAMA_CPP_VERSION} (builds llama.cpp from source, "
    "~5 min on 2 cores; an optional peer, not a dependency of NInfer)"
)


def run_transformers(
    path: Path, dtype: str, prompt: list[int], new: int, repeats: int
) -> EngineRun:
    from ninfer_core.extras import require

    require("transformers", "bench", needed_by="ninfer bench decode's transformers baseline")
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the loading bar would interleave with the table

    class Clock(LogitsProcessor):
        """Called once per new token, right after its forward: the token timestamps."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    if is_gguf(path):  # transformers dequantizes the blocks to `dtype` as it loads
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=DTYPES[dtype]
        ).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype]).eval()
    ids = torch.tensor([prompt])
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    def generate(n: int) -> EngineRun:
        clock = Clock()
        start = time.perf_counter()
        with CpuShare() as cpu:
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([clock]),
            )
        first, last = clock.times[0], clock.times[-1]
        decode = (len(clock.times) - 1) / (last - first) if last > first else 0.0
        new_ids = out[0, len(prompt) :].tolist()
        return EngineRun(len(prompt) / (first - start), decode, new_ids, cpu.share)

    with torch.inference_mode():
        generate(WARMUP_TOKENS)
        return best_of([generate(new) for _ in range(repeats)])


def llama_cpp_installed() -> bool:
    """Whether `llama_cpp` (llama-cpp-python) can be imported; nothing is imported."""
    return importlib.util.find_spec("llama_cpp") is not None


def run_llama_cpp(path: Path, prompt: list[int], new: int, repeats: int, threads: int) -> EngineRun:
    """llama.cpp's figures on the same file: `Llama.generate` greedy (top-k 1), timed per
    token as NInfer's (the first token comes after the prompt's evaluation). The model's
    state is reset before each generation, so every run evaluates the whole prompt (left
    alone, `generate` would reuse the previous run's KV for the common prefix)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=len(prompt) + new + 16,
        n_batch=len(prompt),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def generate(n: int) -> EngineRun:
        times, ids = [], []
        llm.reset()
        start = time.perf_counter()
        with CpuShare() as cpu:
            for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
                times.append(time.perf_counter())
                ids.append(int(token))
                if len(ids) == n:
                    break
        first, last = times[0], times[-1]
        decode = (len(times) - 1) / (last - first) if last > first else 0.0
        return EngineRun(len(prompt) / (first - start), decode, ids, cpu.share)

    try:
        generate(WARMUP_TOKENS)
        runs = [generate(new) for _ in range(repeats)]
    finally:
        close = getattr(llm, "close", None)  # 0.3: frees the model and context now
        if close is not None:
            close()
    return best_of(runs)


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors as stored (ggml blocks included) that a decode token
    reads: every tensor, but the embedding table when the file has a separate head (the
    lookup reads one row of it); a tied head is the embedding table, read in full."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return sum(sizes.values())


def choose_peer(asked: str, path: Path) -> tuple[str | None, str]:
    """(the peer to run, or None; why, or what it is). An explicit `asked` that cannot run
    here is a one-line `NInferError`; `auto` falls back quietly and says why."""
    gguf = is_gguf(path)
    folder = path.is_dir()
    if asked == "none":
        return None, "not run (--peer none)"
    if asked == "llama.cpp":
        if not gguf:
            raise NInferError(f"--peer llama.cpp runs .gguf files only; {path} is not one")
        if not llama_cpp_installed():
            raise NInferError(f"--peer llama.cpp: llama-cpp-python is not installed: "
                              f"{LLAMA_CPP_INSTALL}")  # fmt: skip
        return "llama.cpp", "the same file"
    if asked == "transformers":
        if not (folder or gguf):
            raise NInferError(
                f"--peer transformers: transformers loads Hugging Face folders and .gguf "
                f"files, not {path}; use --peer none"
            )
        from ninfer_core.extras import require

        require("transformers", "bench", needed_by="ninfer bench decode's transformers peer")
        if gguf and importlib.util.find_spec("accelerate") is None:
            raise NInferError("--peer transformers: transformers loads a GGUF only with "
                              "accelerate installed: pip install accelerate")  # fmt: skip
        return "transformers", "dequantized to the compute dtype" if gguf else "the same folder"
    if asked != "auto":
        raise NInferError(f"--peer {asked}: expected auto, transformers, llama.cpp or none")
    missing_llama = f"llama.cpp not installed: {LLAMA_CPP_INSTALL}"
    if gguf and llama_cpp_installed():
        return "llama.cpp", "the same file"
    have_tf = importlib.util.find_spec("transformers") is not None
    if have_tf and (folder or (gguf and importlib.util.find_spec("accelerate") is not None)):
        return "transformers", (
            f"dequantized to the compute dtype ({missing_llama})" if gguf else "the same folder"
        )
    if gguf:
        return None, f"not run: {missing_llama}"
    if not folder:
        return None, "not run: transformers loads Hugging Face folders and .gguf files only"
    return None, "not run: transformers is not installed: pip install 'ninfer[bench]'"


def peer_version(peer: str | None) -> str | None:
    import sys

    module = {"llama.cpp": "llama_cpp", "transformers": "transformers"}.get(peer or "")
    mod = sys.modules.get(module) if module else None
    return getattr(mod, "__version__", None) if mod else None
