"""Write a header-only model folder of the deployment guide's 27B hybrid's shape.

The guide (docs/memory.md, "The guide's command") serves a Qwen3.5-27B-shaped hybrid on one
24 GiB RTX 3090: 64 layers, 3 Gated DeltaNet layers to 1 gated-attention layer, hidden 5120,
vocabulary 248,320, one MTP layer. Planning it needs every tensor's name and shape, never a
weight, so this writes:

- `config.json`: a `Qwen3_5ForCausalLM` text config of that shape (`mtp_num_hidden_layers` 1);
- `model.safetensors`: a real safetensors header naming every tensor transformers' own
  `Qwen3_5ForCausalLM` builds for that config (on the meta device: no memory, seconds), plus
  the MTP layer's tensors under `mtp.` as the Hub's checkpoints name them, in bf16; the data
  region is a sparse hole (a truncate), so the folder takes a few KiB of disk.

    python tools/guide_model.py OUT_DIR
    ninfer plan OUT_DIR --device-spec rtx3090 --max-context 184320 --kv-capacity 184320 \\
        --max-concurrency 2 --prefill-chunk 1024 --kv-dtype rk8v4 --spec mtp --draft-tokens 3 \\
        --lm-head-draft

Needs transformers (the development extras).
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

#: Qwen3.5-27B's text shapes.
GUIDE_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
    },
    "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 1,
    "torch_dtype": "bfloat16",
}


def guide_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of the checkpoint: transformers' model, then `mtp.`."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    text = Qwen3_5TextConfig(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(text)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    # The MTP layer: fc over [embedding | hidden], its two pre-fc norms, one decoder layer of
    # the full-attention kind (the shapes of the model's first such layer) and a final norm.
    hidden = config["hidden_size"]
    full = next(i for i, kind in enumerate(text.layer_types) if kind == "full_attention")
    layer = f"model.layers.{full}."
    shapes["mtp.fc.weight"] = (hidden, 2 * hidden)
    shapes["mtp.pre_fc_norm_embedding.weight"] = (hidden,)
    shapes["mtp.pre_fc_norm_hidden.weight"] = (hidden,)
    for name, shape in list(shapes.items()):
        if name.startswith(layer):
            shapes["mtp.layers.0." + name[len(layer) :]] = shape
    shapes["mtp.norm.weight"] = (hidden,)
    return shapes


def write_header_only(path: Path, config: dict, shapes: dict[str, tuple[int, ...]]) -> int:
    """`config.json` and a bf16 `model.safetensors` whose data region is a hole; returns
    the parameter count."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    header, offset, params = {}, 0, 0
    for name, shape in shapes.items():
        count = 1
        for dim in shape:
            count *= dim
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + 2 * count],
        }
        offset += 2 * count
        params += count
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)
    return params


def write_guide_model(path: Path) -> int:
    """The guide's 27B shape at `path`; returns its parameter count (MTP layer included)."""
    return write_header_only(path, GUIDE_CONFIG, guide_tensors(GUIDE_CONFIG))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write")
    args = parser.parse_args()
    params = write_guide_model(args.out)
    print(f"wrote {args.out}: {params / 1e9:.2f}B parameters, header only")


if __name__ == "__main__":
    main()
