"""Qwen3.5 and Qwen3.5-MoE: Qwen3-Next's layers (Gated DeltaNet, gated full attention) with a dense MLP
in every layer (Qwen3.5) or a MoE in every layer (Qwen3.5-MoE).

The published checkpoints are multimodal (`Qwen3_5[Moe]ForConditionalGeneration`, the language model's
config under `text_config`); this runtime serves their language model, so text in and text out. The
text-only classes (`Qwen3_5[Moe]ForCausalLM`) are served too.
"""

from __future__ import annotations

from sglang.srt.configs.hybrid_arch import register_hybrid_arch
from sglang.srt.configs.qwen3_next import Qwen3NextArchConfig


@register_hybrid_arch
class Qwen3_5ArchConfig(Qwen3NextArchConfig):
    architectures = (
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
    )
    model_types = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
