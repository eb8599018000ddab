"""A test-only model family whose layers alternate a toy recurrent layer and attention.

The recurrent layer keeps a state per sequence (`SequenceState`), updated every token:

    s_t = a * s_(t-1) + W_in rmsnorm(x_t),   y_t = x_t + W_out tanh(s_t),   a = sigmoid(d)

and the attention layer keeps paged K/V (`PagedKV`), with RoPE and grouped KV heads. So the
per-sequence path of the engine (state slots, admission, chunked prefill, cancel) runs end
to end before a real hybrid family uses it. `reference_logits` computes the same model over
a whole sequence in float64 with no cache at all: the independent check.

Config: a Qwen3-shaped `config.json` with `architectures: ["ToyRecurrentForCausalLM"]`,
`toy_layer_kinds` (a list of "recurrent" / "attention") and `toy_state_size`.
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import torch
from safetensors.torch import save_file
from text_fixtures import write_model_dir
from torch import nn

from ninfer_core import hookimpl
from ninfer_core.model.caches import ModelCaches, PagedKV, SequenceState, StateTensor
from ninfer_core.model.config import ModelConfig
from ninfer_core.model.layers import RMSNorm, empty_param
from ninfer_core.model.rope import RotaryEmbedding
from ninfer_core.support import Support

ARCH = "ToyRecurrentForCausalLM"
KINDS = ("recurrent", "attention", "recurrent", "attention")


class RecurrentLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, size: int, ops, dtype) -> None:
        super().__init__()
        h, dev = config.hidden_size, ops.device
        self.ops, self.layer = ops, layer
        self.norm = RMSNorm(h, config.rms_norm_eps, ops, dtype)
        self.w_in = empty_param(size, h, dtype=dtype, device=dev)
        self.w_out = empty_param(h, size, dtype=dtype, device=dev)
        self.decay = empty_param(size, dtype=torch.float32, device=dev)

    def forward(self, x, cos, sin, kv_store, meta, states) -> torch.Tensor:
        u = self.ops.linear(self.norm(x), self.w_in).float()  # [T, S]
        a = torch.sigmoid(self.decay)
        (s0,) = states.read(self.layer)  # [B, S] fp32
        if meta.is_decode:  # one token per sequence: the whole batch at once
            s_final = a * s0 + u
            out = s_final
        else:
            out, finals = torch.empty_like(u), []
            for b, (start, n) in enumerate(_spans(meta)):
                s = s0[b]
                for t in range(start, start + n):
                    s = a * s + u[t]
                    out[t] = s
                finals.append(s)
            s_final = torch.stack(finals)
        states.write(self.layer, (s_final,))
        return x + self.ops.linear(torch.tanh(out).to(x.dtype), self.w_out)


class AttentionLayer(nn.Module):
    def __init__(self, config: ModelConfig, kv_index: int, ops, dtype) -> None:
        super().__init__()
        h, dev = config.hidden_size, ops.device
        self.ops, self.kv_index = ops, kv_index
        self.heads, self.kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, config.head_dim
        )  # fmt: skip
        self.norm = RMSNorm(h, config.rms_norm_eps, ops, dtype)
        self.q = empty_param(config.q_size, h, dtype=dtype, device=dev)
        self.k = empty_param(config.kv_size, h, dtype=dtype, device=dev)
        self.v = empty_param(config.kv_size, h, dtype=dtype, device=dev)
        self.o = empty_param(h, config.q_size, dtype=dtype, device=dev)

    def forward(self, x, cos, sin, kv_store, meta, states) -> torch.Tensor:
        t, y = x.shape[0], self.norm(x)
        q = self.ops.linear(y, self.q).view(t, self.heads, self.head_dim)
        k = self.ops.linear(y, self.k).view(t, self.kv_heads, self.head_dim)
        v = self.ops.linear(y, self.v).view(t, self.kv_heads, self.head_dim)
        q, k = self.ops.apply_rope(q, k, cos, sin)
        out = self.ops.paged_attention(q, k, v, kv_store, self.kv_index, meta, self.head_dim**-0.5)
        return x + self.ops.linear(out.reshape(t, -1), self.o)


def _spans(meta) -> list[tuple[int, int]]:
    starts = [0]
    for n in meta.query_lens:
        starts.append(starts[-1] + n)
    return list(zip(starts, meta.query_lens, strict=False))


class ToyRecurrentLM(nn.Module):
    #: Every step runs `forward` (no capturable decode step).
    decode_graph = None
    verify_graph = None
    mtp_layer = None  # no MTP layer of its own

    def __init__(self, config: ModelConfig, ops, dtype, kinds, size) -> None:
        super().__init__()
        self.config, self.ops, self.dtype = config, ops, dtype
        self.embed = empty_param(
            config.vocab_size, config.hidden_size, dtype=dtype, device=ops.device
        )
        kv_index = 0
        layers = []
        for i, kind in enumerate(kinds):
            if kind == "recurrent":
                layers.append(RecurrentLayer(config, i, size, ops, dtype))
            else:
                layers.append(AttentionLayer(config, kv_index, ops, dtype))
                kv_index += 1
        self.layers = nn.ModuleList(layers)
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        self.rotary = RotaryEmbedding(config, None, ops.device)

    def forward(self, input_ids, positions, meta, kv_store, states=None) -> torch.Tensor:
        self.ops.prepare(meta)
        cos, sin = self.rotary(positions, self.dtype)
        x = self.embed[input_ids]
        for layer in self.layers:
            x = layer(x, cos, sin, kv_store, meta, states)
        return self.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.embed).float()

    def pack_weights(self) -> None:
        """Dense weights in the compute dtype: nothing to pack."""

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


class ToyRecurrentFamily:
    name = "toy-recurrent"
    description = "test-only: toy recurrent layers (a state per sequence) between attention"
    architectures = (ARCH,)
    check_artifact = None
    weight_slots = None  # it holds every tensor of the artifact, as stored
    mtp_layer = None

    def supports(self, device) -> Support:
        return Support.yes()

    def parse_config(self, raw) -> ModelConfig:
        return ModelConfig.from_hf(raw, qk_norm=False)

    def layer_caches(self, config: ModelConfig) -> ModelCaches:
        size = int(config.raw["toy_state_size"])
        state = SequenceState((StateTensor("s", (size,), torch.float32),))
        kv = PagedKV(config.num_kv_heads, config.head_dim)
        return ModelCaches(
            tuple(state if kind == "recurrent" else kv for kind in config.raw["toy_layer_kinds"])
        )

    def build(self, config: ModelConfig, ops, dtype) -> ToyRecurrentLM:
        kinds, size = config.raw["toy_layer_kinds"], int(config.raw["toy_state_size"])
        return ToyRecurrentLM(config, ops, dtype, kinds, size)

    def load_weights(self, model: ToyRecurrentLM, artifact) -> None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(artifact.load_tensor(name).to(param.dtype))


@hookimpl
def register_model_families():
    return [ToyRecurrentFamily()]


PLUGIN = types.SimpleNamespace(register_model_families=register_model_families)


def config_dict(*, state_size: int = 24, kinds=KINDS, vocab_size: int = 400) -> dict:
    return {
        "architectures": [ARCH],
        "model_type": "toy_recurrent",
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "num_hidden_layers": len(kinds),
        "vocab_size": vocab_size,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "toy_layer_kinds": list(kinds),
        "toy_state_size": state_size,
    }


def write_toy_model(path: Path, *, seed: int = 0, **config) -> Path:
    """A folder with config.json, random weights (model.safetensors) and a tokenizer."""
    cfg = config_dict(**config)
    g = torch.Generator().manual_seed(seed)
    h, s = cfg["hidden_size"], cfg["toy_state_size"]
    q, kv = (
        cfg["num_attention_heads"] * cfg["head_dim"],
        cfg["num_key_value_heads"] * cfg["head_dim"],
    )

    def rand(*shape, scale=None):
        scale = scale if scale is not None else 1 / math.sqrt(shape[-1])
        return torch.randn(*shape, generator=g) * scale

    tensors = {
        "embed": rand(cfg["vocab_size"], h, scale=1.0),
        "final_norm.weight": 1 + 0.1 * rand(h, scale=1),
    }
    for i, kind in enumerate(cfg["toy_layer_kinds"]):
        p = f"layers.{i}."
        tensors[p + "norm.weight"] = 1 + 0.1 * rand(h, scale=1)
        if kind == "recurrent":
            tensors[p + "w_in"] = rand(s, h)
            tensors[p + "w_out"] = rand(h, s)
            tensors[p + "decay"] = rand(s, scale=2.0)
        else:
            for name, rows in (("q", q), ("k", kv), ("v", kv)):
                tensors[p + name] = rand(rows, h)
            tensors[p + "o"] = rand(h, q)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    write_model_dir(path)
    return path


def reference_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """The toy model over the whole of `ids` in float64, no cache: logits [len(ids), vocab]."""
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(path / "model.safetensors")).items()}
    eps, d = cfg["rms_norm_eps"], cfg["head_dim"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    n = len(ids)
    x = w["embed"][torch.tensor(ids)]
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(t):  # t: [n, heads, d]
        half = torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1)
        return t * cos[:, None] + half * sin[:, None]

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i, kind in enumerate(cfg["toy_layer_kinds"]):
        p = f"layers.{i}."
        y = rms(x, w[p + "norm.weight"])
        if kind == "recurrent":
            u, a = y @ w[p + "w_in"].T, torch.sigmoid(w[p + "decay"])
            s, out = torch.zeros(cfg["toy_state_size"], dtype=torch.float64), []
            for t in range(n):
                s = a * s + u[t]
                out.append(torch.tanh(s))
            x = x + torch.stack(out) @ w[p + "w_out"].T
        else:
            q = rope((y @ w[p + "q"].T).view(n, heads, d))
            k = rope((y @ w[p + "k"].T).view(n, kv_heads, d))
            v = (y @ w[p + "v"].T).view(n, kv_heads, d)
            k = k.repeat_interleave(heads // kv_heads, 1)
            v = v.repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
            scores = scores.masked_fill(~causal, float("-inf"))
            out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
            x = x + out.reshape(n, -1) @ w[p + "o"].T
    return rms(x, w["final_norm.weight"]) @ w["embed"].T
