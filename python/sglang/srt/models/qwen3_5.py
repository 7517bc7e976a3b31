"""Qwen3.5 and Qwen3.5-MoE: Qwen3-Next's network (`qwen3_next.py`), a dense MLP in every layer or a MoE
in every layer, whose checkpoints store the Gated DeltaNet's input projections split by piece over all
heads (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`). They load as row blocks of Qwen3-Next's
fused projections, which are then already in the grouped layout its forward slices (nothing to regroup).

The published checkpoints are multimodal (`Qwen3_5[Moe]ForConditionalGeneration`): the language model's
weights under `model.language_model.`, the vision tower's under `model.visual.` (`qwen3_5_vision.py`;
the serving side of images: `multimodal_forward.py`). Text positions are the same on mRoPE's three
axes, where mRoPE is the plain rotary embedding.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from sglang.srt.layers.linear import DimShard, column_shard
from sglang.srt.models.multimodal_forward import MRotaryEmbedding, MultimodalForward
from sglang.srt.models.qwen3_5_vision import Qwen3_5VisionModel
from sglang.srt.models.qwen3_next import Qwen3NextForCausalLM, Qwen3NextGatedDeltaNet

_SPLIT_PROJECTION = re.compile(
    r"^(?P<layer>model\.layers\.\d+\.linear_attn)\.in_proj_(?P<piece>qkv|z|b|a)\.weight$"
)
_LANGUAGE_MODEL = "model.language_model."


class Qwen3_5GatedDeltaNet(Qwen3NextGatedDeltaNet):
    checkpoint_per_key_head = False

    def __init__(self, config: Any, layer_id: int):
        super().__init__(config, layer_id)
        self.projections_grouped = True  # loaded piece by piece over all heads: [q | k | v | z], [b | a]

    def piece_rows(self) -> dict[str, tuple[str, int, DimShard]]:
        """Checkpoint projection piece -> (fused projection, its first row in this rank's, the piece's
        split: q | k | v each by heads, z / b / a by value heads)."""
        kd, vd, hv = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim, self.num_v_heads
        full_kd, full_vd, full_hv = self.qkvz_sizes()[1:3] + self.ba_sizes()[:1]
        return {
            "qkv": ("in_proj_qkvz", 0, column_shard(0, [full_kd, full_kd, full_vd])),
            "z": ("in_proj_qkvz", 2 * kd + vd, column_shard(0, [full_vd])),
            "b": ("in_proj_ba", 0, column_shard(0, [full_hv])),
            "a": ("in_proj_ba", hv, column_shard(0, [full_hv])),
        }


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 and Qwen3.5-MoE (the config says which MLP each layer has)."""

    gdn_cls = Qwen3_5GatedDeltaNet

    def checkpoint_rows(self, name: str) -> tuple[str, int, DimShard] | None:
        match = _SPLIT_PROJECTION.match(name)
        try:
            layer = self.get_submodule(match["layer"]) if match else None
        except AttributeError:  # not a linear layer here: the loader names the tensor as unused
            layer = None
        if layer is None:
            return None
        fused, start, shard = layer.piece_rows()[match["piece"]]
        return f"{match['layer']}.{fused}.weight", start, shard


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The multimodal checkpoint: the language model, and the vision tower whose image tokens replace
    the prompt's image placeholders (`MultimodalForward`). The tower is replicated on every rank
    under tensor parallelism."""

    def __init__(self, config: Any):
        # Whether the LM head is the embedding is the multimodal config's to say, as transformers reads
        # it (it does not copy the flag into `text_config`, where it may say otherwise).
        text = config.get_text_config()
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
        super().__init__(text)
        self.visual = Qwen3_5VisionModel(config.vision_config)
        section = (getattr(text, "rope_parameters", None) or {}).get("mrope_section")
        for module in self.modules():
            if section and hasattr(module, "rotary_emb"):
                module.rotary_emb = MRotaryEmbedding(module.rotary_emb, section)
        self.mm = MultimodalForward(self.model, self.visual, text.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: Any) -> torch.Tensor:
        return self.mm(input_ids, positions, fb)

    def checkpoint_name(self, name: str) -> str:
        if name.startswith(_LANGUAGE_MODEL):
            name = "model." + name.removeprefix(_LANGUAGE_MODEL)
        elif name.startswith("model.visual."):
            name = name.removeprefix("model.")
        return super().checkpoint_name(name)
