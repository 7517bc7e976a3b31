"""Falcon-H1 (`FalconH1ForCausalLM`): each layer is `x + mamba(n) + attention(n)` with `n = norm(x)` (the
two mixers side by side), then `x + mlp(norm(x))`; a Llama-style attention (rotary, GQA) and gated MLP.

Falcon-H1's muP multipliers are folded into the weights as they load, so the layers compute plain
projections: `ssm_in_multiplier` and the per-section `ssm_multipliers` (over [gate | x | B | C | dt])
into the Mamba `in_proj` rows, `ssm_out_multiplier` into its `out_proj`; `attention_in_multiplier` into
q/k/v, `key_multiplier` into k, `attention_out_multiplier` into `o_proj`; `mlp_multipliers` into
`gate_proj` and `down_proj`; `lm_head_multiplier` into the final norm's weight (the LM head may be tied
to the embedding). The embedding multiplier scales the lookup.

Tensor parallel: the Mamba2 mixer's and the attention's row-parallel outputs are summed before one
all-reduce (transformers adds them before the residual too).

The attention of layer i has pool id i, its Mamba2 mixer id `num_hidden_layers + i` (`configs/falcon_h1.py`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from sglang.srt.configs.falcon_h1 import FalconH1ArchConfig
from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.layers.decode_blocks import MLPBlock
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.llama_attention import LlamaStyleAttention
from sglang.srt.layers.mamba2_mixer import Mamba2Mixer
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.causal_lm import HybridCausalLM

_LAYER_PARAM = re.compile(r"^model\.layers\.\d+\.(?P<param>[\w.]+)$")


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, arch: FalconH1ArchConfig):
        super().__init__()
        eps = config.rms_norm_eps
        if not config.mamba_rms_norm:
            norm = "none"
        else:
            norm = "gate_after" if config.mamba_norm_before_gate else "gate_first"
        self.mamba = Mamba2Mixer(
            arch.linear_layer_ids[layer_id],
            config.hidden_size,
            **arch.mamba_mixer_args(),
            norm=norm,
            out_proj_bias=config.projectors_bias,
            reduce_results=False,
        )
        d = arch.head_dim
        self.self_attn = LlamaStyleAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, d, layer_id,
            rope_parameters=getattr(config, "rope_parameters", None) or {},
            bias=getattr(config, "attention_bias", False), reduce_results=False,
        )  # fmt: skip
        self.feed_forward = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            getattr(config, "mlp_bias", False),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.mlp_block: MLPBlock | None = None  # the MLP half as one C++ call (CPU; set at load)

    def process_weights_after_loading(self) -> None:
        self.mlp_block = MLPBlock.build(self.pre_ff_layernorm, self.feed_forward)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        # Tensor parallel: the two mixers' partial sums added first, then one all-reduce for both.
        mixed = self.mamba(x, fb) + self.self_attn(positions, x, fb)
        hidden = hidden + tensor_model_parallel_all_reduce(mixed)
        fused = self.mlp_block(hidden) if self.mlp_block is not None else None
        return fused if fused is not None else hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class FalconH1Model(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        arch = FalconH1ArchConfig(config)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            FalconH1DecoderLayer(config, i, arch) for i in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            hidden = layer(positions, hidden, fb)
        return self.final_layernorm(hidden)


class FalconH1ForCausalLM(HybridCausalLM):
    backbone_attr = "model"
    fp32_param_suffixes = ("A_log", "dt_bias", ".D")

    def __init__(self, config: Any):
        model = FalconH1Model(config)
        super().__init__(config, model, model.embed_tokens)
        self.scales = _folded_scales(config, FalconH1ArchConfig(config))
        self.lm_head_multiplier = float(config.lm_head_multiplier)

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name.endswith("mamba.mup_vector"):
            return []  # the multipliers it holds come from the config (`folded_scale`)
        return [(self.checkpoint_name(name), tensor)]

    def folded_scale(self, name: str) -> float | torch.Tensor | None:
        """The muP multipliers of the parameter (`in_proj` rows by section)."""
        if name == "model.final_layernorm.weight":
            return self.lm_head_multiplier
        match = _LAYER_PARAM.match(name)
        return self.scales.get(match["param"]) if match else None


def _folded_scales(config: Any, arch: FalconH1ArchConfig) -> dict[str, float | torch.Tensor]:
    """Per parameter of a layer (its path inside the layer): the factor it loads with. A multiplier on
    a projection's input scales its weight only; one on its output, its weight and bias."""
    c = config
    intermediate, gs = c.mamba_n_heads * arch.mamba_head_dim, c.mamba_n_groups * c.mamba_d_state
    sections = [intermediate, intermediate, gs, gs, c.mamba_n_heads]  # [gate | x | B | C | dt]
    mup = [float(s) for s in (c.ssm_multipliers or [1.0] * 5)]
    # Built on the host (the model is built under the meta device); `fold_scale` moves it to each tensor.
    rows = torch.cat([torch.full((n,), s, device="cpu") for n, s in zip(sections, mup, strict=True)])
    gate, down = (float(s) for s in (c.mlp_multipliers or (1.0, 1.0)))
    attn_in, key, attn_out = (
        float(c.attention_in_multiplier),
        float(c.key_multiplier),
        float(c.attention_out_multiplier),
    )
    ssm_out = float(c.ssm_out_multiplier)
    return {
        "mamba.in_proj.weight": rows * float(c.ssm_in_multiplier),
        "mamba.in_proj.bias": rows,
        "mamba.out_proj.weight": ssm_out,
        "mamba.out_proj.bias": ssm_out,
        "self_attn.q_proj.weight": attn_in,
        "self_attn.k_proj.weight": attn_in * key,
        "self_attn.k_proj.bias": key,
        "self_attn.v_proj.weight": attn_in,
        "self_attn.o_proj.weight": attn_out,
        "self_attn.o_proj.bias": attn_out,
        "feed_forward.gate_proj.weight": gate,
        "feed_forward.gate_proj.bias": gate,
        "feed_forward.down_proj.weight": down,
        "feed_forward.down_proj.bias": down,
    }
