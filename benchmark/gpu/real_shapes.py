"""Real-shape slices of three published hybrid models, and the decode floor model the benchmark divides by.

A slice keeps every per-layer shape of the published config.json (the configs are kept as data in
`test/unit/mem_cache/real_model_configs.py`, with their sources) and cuts the layers to a few that keep
each layer kind, in the full model's proportions, so that the full model's numbers follow by layer count:

- `qwen3-next-80b` (Qwen/Qwen3-Next-80B-A3B-Instruct, 48 layers): 4 layers, Gated DeltaNet x 3 then full
  attention (`linear_attention` x 3, `full_attention`), one quarter-block of 12; x 12.
- `nemotron-h-8b` (nvidia/Nemotron-H-8B-Base-8K, 52 layers = 24 Mamba2, 4 attention, 24 MLP): 13 layers,
  pattern `M-M-M-M*-M-M-` (6 Mamba2, 1 attention, 6 MLP); x 4.
- `qwen3.5-35b-a3b` (Qwen/Qwen3.5-35B-A3B, 40 layers): 4 layers, as the 80B's; x 10. Served as its
  language model (`Qwen3_5MoeForCausalLM`), as the project serves the published multimodal checkpoint.

`make_slice` writes one with transformers' own class (random weights, fixed seed, bfloat16, safetensors,
the published tensor names), built directly on the given device in bfloat16: no float32 copy of the
weights is ever made. `tiny=True` shrinks hidden size, heads, experts and vocabulary (same layer
pattern) so the same path runs on a CPU in seconds.

The floor of a decode step (`decode_floor_bytes`): the bytes it must move, at the GPU's bandwidth. Every
weight but the embedding (only the batch's rows are read), the lm_head, and per MoE layer the experts the
batch touches: B tokens each routing top-k of E uniformly touch E * (1 - (1 - k/E)^B) distinct experts on
average; plus each request's recurrent state, read and written back (a step must do both), and its KV
over the context, read.
"""

from __future__ import annotations

import copy
import json
import re
import struct
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Bandwidth (bytes/s) and dense bfloat16 peak (FLOP/s) by device name: the vendors' spec sheets (SXM
# parts; the H100 PCIe's HBM is 2.0 TB/s and its bf16 peak 756 TFLOP/s). The bf16 peak is the dense one
# (the sheets' 1,979 TFLOP/s is with 2:4 sparsity).
DEVICES = [
    ("H100 PCIe", 2.0e12, 756e12),
    ("H200", 4.8e12, 989e12),
    ("H100", 3.35e12, 989e12),
]


def device_peaks(name: str) -> tuple[float, float] | None:
    """(bandwidth bytes/s, bf16 dense FLOP/s) for a CUDA device name, or None if unknown."""
    for key, bandwidth, flops in DEVICES:
        if key.lower() in name.lower():
            return bandwidth, flops
    return None


@dataclass(frozen=True)
class SliceSpec:
    name: str
    source: str  # the dict in real_model_configs.py
    full_layers: int
    slice_layers: int
    pattern: str  # the slice's layers, in words (printed with the results)


SLICES = {
    "qwen3-next-80b": SliceSpec("qwen3-next-80b", "QWEN3_NEXT_80B_A3B_INSTRUCT", 48, 4, "GDN x 3 + attention"),
    "nemotron-h-8b": SliceSpec("nemotron-h-8b", "NEMOTRON_H_8B_BASE_8K", 52, 13, "M-M-M-M*-M-M-"),
    "qwen3.5-35b-a3b": SliceSpec("qwen3.5-35b-a3b", "QWEN3_5_35B_A3B", 40, 4, "GDN x 3 + attention"),
}
NEMOTRON_SLICE_PATTERN = "M-M-M-M*-M-M-"
GDN_SLICE_LAYERS = ["linear_attention"] * 3 + ["full_attention"]

# The CPU smoke shapes: the same layer patterns, everything else small.
_TINY_QWEN = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=512,
)  # fmt: skip
_TINY = {
    "qwen3-next-80b": {**_TINY_QWEN, "intermediate_size": 128},
    "qwen3.5-35b-a3b": {
        **_TINY_QWEN,
        "rope_parameters": {
            "mrope_interleaved": True, "mrope_section": [1, 1, 0], "partial_rotary_factor": 0.25,
            "rope_theta": 10000000, "rope_type": "default",
        },
    },
    "nemotron-h-8b": dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
        vocab_size=512, chunk_size=32,
    ),
}  # fmt: skip


def published_config(name: str) -> dict:
    """The full model's published config.json fields (from the memory-planning tests' data)."""
    sys.path.insert(0, str(ROOT / "test" / "unit" / "mem_cache"))
    try:
        import real_model_configs
    finally:
        sys.path.pop(0)
    return copy.deepcopy(getattr(real_model_configs, SLICES[name].source))


def slice_config(name: str, tiny: bool = False):
    """The transformers config of the slice: the published fields, the layers cut (and, `tiny`, shrunk)."""
    spec = SLICES[name]
    cfg = published_config(name)
    if name == "nemotron-h-8b":
        from transformers import NemotronHConfig

        fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
        fields.update(hybrid_override_pattern=NEMOTRON_SLICE_PATTERN, num_hidden_layers=spec.slice_layers)
        fields["head_dim"] = fields["attention_head_dim"]
        fields.update(_TINY[name] if tiny else {})
        return NemotronHConfig(**fields)
    if name == "qwen3.5-35b-a3b":
        from transformers import Qwen3_5MoeTextConfig as cls

        fields = cfg["text_config"]
    else:
        from transformers import Qwen3NextConfig as cls

        fields = cfg
    drop = ("architectures", "model_type", "quantization_config", "dtype", "full_attention_interval")
    fields = {k: v for k, v in fields.items() if k not in drop}
    fields.update(num_hidden_layers=spec.slice_layers, layer_types=list(GDN_SLICE_LAYERS))
    fields.update(_TINY[name] if tiny else {})
    return cls(**fields)


def make_slice(name: str, out: str | Path, device: str = "cpu", tiny: bool = False, seed: int = 0) -> Path:
    """Write the slice's checkpoint to `out` (bfloat16 safetensors, transformers' tensor names) with the
    project's tiny tokenizer (its ids lie inside every vocabulary). The weights are created in bfloat16
    on `device` (a GPU initializes 14 GB in a second) and written from there."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang.tools.make_tiny_model import build_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = slice_config(name, tiny)
    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the runner sizes its pools from the free memory
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    if "layer_types" in cfg:  # transformers writes only layer_types; SGLang-style loaders read the interval
        cfg["full_attention_interval"] = 4
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    build_tokenizer().save_pretrained(out)
    return out


def ensure_slice(name: str, ckpt_dir: str | Path, device: str = "cpu", tiny: bool = False) -> Path:
    """The slice's folder under `ckpt_dir`, written unless a finished one is there (it is written under a
    `.partial` name first, so a run stopped while writing leaves none to reuse)."""
    import shutil

    path = Path(ckpt_dir) / (name + ("-tiny" if tiny else ""))
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    make_slice(name, partial, device=device, tiny=tiny)
    partial.rename(path)
    return path


# --- What a step reads -------------------------------------------------------------------------------

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass
class WeightBytes:
    """A checkpoint's weights by role, in the serving dtype's bytes."""

    embed: int = 0
    lm_head: int = 0
    other: int = 0  # final norm and the like, outside the layers
    dense_layers: dict[int, int] = field(default_factory=dict)  # layer -> its non-expert bytes
    expert_layers: dict[int, int] = field(default_factory=dict)  # layer -> all its routed experts' bytes

    def total(self) -> int:
        return self.embed + self.lm_head + self.other + sum(self.dense_layers.values()) + sum(
            self.expert_layers.values()
        )


def weight_bytes(numels: dict[str, int], itemsize: int) -> WeightBytes:
    """Sort tensors (name -> element count) into roles: the routed experts (`.experts.` in the name:
    per-expert or fused, not the shared expert), per layer; the embedding; the lm_head; the rest."""
    w = WeightBytes()
    for name, numel in numels.items():
        nbytes = numel * itemsize
        layer = _LAYER.search(name)
        if name.endswith("lm_head.weight"):
            w.lm_head += nbytes
        elif name.endswith(("embed_tokens.weight", "embeddings.weight")):
            w.embed += nbytes
        elif layer is None:
            w.other += nbytes
        elif ".experts." in name or name.endswith(".experts"):
            i = int(layer.group(1))
            w.expert_layers[i] = w.expert_layers.get(i, 0) + nbytes
        else:
            i = int(layer.group(1))
            w.dense_layers[i] = w.dense_layers.get(i, 0) + nbytes
    return w


def checkpoint_numels(folder: str | Path) -> dict[str, int]:
    """Element counts by tensor name from the safetensors headers (no tensor is read)."""
    numels = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for d in info["shape"]:
                    count *= d
                numels[name] = count
    return numels


def experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts B tokens touch, each choosing top-k of E uniformly: per expert, the
    chance that no token picks it is (1 - k/E)^B."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclass(frozen=True)
class StepModel:
    """What one decode step reads, by part (bytes), for one model (or slice)."""

    dense: int  # every non-expert weight in the layers, plus the final norm
    lm_head: int
    expert_bytes: int  # one routed expert of one layer
    moe_layers: int
    num_experts: int
    top_k: int
    state_per_req: int  # every linear layer's recurrent state (conv + SSM) of one request
    kv_per_token: int  # K and V of one token over the attention layers
    layers: int

    def scaled_to(self, layers: int) -> StepModel:
        """The same model with `layers` layers in the same proportions (lm_head once)."""
        f = layers / self.layers
        return replace(
            self,
            dense=round(self.dense * f),
            moe_layers=round(self.moe_layers * f),
            state_per_req=round(self.state_per_req * f),
            kv_per_token=round(self.kv_per_token * f),
            layers=layers,
        )


def decode_floor_bytes(m: StepModel, batch: int, context: int) -> dict[str, float]:
    """Bytes a decode step of `batch` requests at `context` tokens each must move, by part."""
    touched = experts_touched(m.num_experts, m.top_k, batch) if m.moe_layers else 0.0
    parts = {
        "weights": float(m.dense + m.lm_head),
        "experts": touched * m.expert_bytes * m.moe_layers,
        "state": 2.0 * m.state_per_req * batch,  # read and written back
        "kv": float(m.kv_per_token * context * batch),
    }
    parts["total"] = sum(parts.values())
    parts["experts_touched_per_layer"] = touched
    return parts


def prefill_flops_per_token(m: dict, tokens: int) -> float:
    """FLOPs per prompt token of a prefill of `tokens` tokens (one sequence): 2 per weight a token meets
    (the dense layers' weights, k of E experts; no embedding, no lm_head: one token in a prompt uses it),
    attention's QK^T and PV over the causal mean context (tokens + 1) / 2, and the linear layers'
    recurrence in its chunked form (chunk C): per head 4 * dk * dv (the state into the output and the
    state's update) + 2 * C * (dk + dv) (within the chunk). `m`: dense_params, expert_params (one
    expert), top_k, moe_layers, attn_layers, q_heads, head_dim, linear_layers, linear_heads, dk, dv,
    chunk."""
    matmul = 2.0 * (m["dense_params"] + m["moe_layers"] * m["top_k"] * m["expert_params"])
    attn = m["attn_layers"] * 4.0 * m["q_heads"] * m["head_dim"] * (tokens + 1) / 2
    lin = m["linear_layers"] * m["linear_heads"] * (
        4.0 * m["dk"] * m["dv"] + 2.0 * m["chunk"] * (m["dk"] + m["dv"])
    )
    return matmul + attn + lin


def step_model(config, numels: dict[str, int], itemsize: int = 2) -> tuple[StepModel, dict]:
    """The decode step model (bytes in the serving dtype) and the prefill FLOP fields of a checkpoint
    (tensor name -> element count) with its transformers config. The state and KV sizes are the
    project's own (`HybridArchConfig`: what the pools hold per request and per token)."""
    import torch

    from sglang.srt.configs.hybrid_arch import hybrid_arch_config

    dtype = {2: torch.bfloat16, 4: torch.float32}[itemsize]
    arch = hybrid_arch_config(config)
    w = weight_bytes(numels, itemsize)
    num_experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", 0) or 0
    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    moe_layers = len(w.expert_layers)
    num_experts = num_experts if moe_layers else 0  # Nemotron-H's class default names 8 it has none of
    expert_total = sum(w.expert_layers.values())
    expert_bytes = expert_total // (moe_layers * num_experts) if moe_layers else 0
    layers = arch.num_hidden_layers
    model = StepModel(
        dense=sum(w.dense_layers.values()) + w.other,
        lm_head=w.lm_head,
        expert_bytes=expert_bytes,
        moe_layers=moe_layers,
        num_experts=num_experts,
        top_k=top_k,
        state_per_req=arch.mamba_cache_per_req(dtype),
        kv_per_token=arch.kv_bytes_per_token(dtype),
        layers=layers,
    )
    nemotron = hasattr(config, "mamba_num_heads")
    flops = {
        "dense_params": model.dense // itemsize,
        "expert_params": expert_bytes // itemsize,
        "top_k": top_k,
        "moe_layers": moe_layers,
        "attn_layers": len(arch.full_attention_layer_ids),
        "q_heads": config.num_attention_heads,
        "head_dim": getattr(config, "head_dim", None) or config.attention_head_dim,
        "linear_layers": len(arch.linear_layer_ids),
        "linear_heads": config.mamba_num_heads if nemotron else config.linear_num_value_heads,
        "dk": config.ssm_state_size if nemotron else config.linear_key_head_dim,
        "dv": config.mamba_head_dim if nemotron else config.linear_value_head_dim,
        "chunk": getattr(config, "chunk_size", 64) if nemotron else 64,
    }
    return model, flops


def meta_numels(config) -> dict[str, int]:
    """Element counts by parameter name of the slice, built on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return {name: p.numel() for name, p in model.named_parameters()}
