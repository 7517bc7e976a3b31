"""`HybridDecoderLayer`: the pre-norm layer Granite-4.0-H, Bamba and LFM2 share, `x + mixer(norm(x))`
with a linear mixer (Mamba2's, LFM2's short conv) or a Llama-style attention, then `x + mlp(norm(x))`
with a gated MLP or a MoE. Parameter names inside it are generic (`mixer`, `mlp`, `input_layernorm`,
`post_attention_layernorm`); a model maps its checkpoint's names onto them (`checkpoint_renames`)."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers.decode_blocks import AttentionBlock, Mamba2Block, MLPBlock, MoEBlock
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.llama_attention import LlamaStyleAttention
from sglang.srt.layers.mamba2_mixer import Mamba2Mixer
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class HybridDecoderLayer(nn.Module):
    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float):
        """`mixer`: a `LlamaStyleAttention`, or a linear mixer taking (hidden, batch). `mlp`: a GatedMLP,
        or a MoE module with `fused_block(norm)` (its CPU decode block)."""
        super().__init__()
        self.is_linear = not isinstance(mixer, LlamaStyleAttention)
        self.mixer = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=eps)
        # Each half of the layer as one C++ call where its parts all run C++ ops (CPU; set at load).
        self.mixer_block: Mamba2Block | AttentionBlock | None = None
        self.mlp_block: MoEBlock | MLPBlock | None = None

    def process_weights_after_loading(self) -> None:
        norm, post = self.input_layernorm, self.post_attention_layernorm
        if isinstance(self.mixer, Mamba2Mixer):
            self.mixer_block = Mamba2Block.build(norm, self.mixer)
        elif not self.is_linear:
            m = self.mixer
            qk_norms = (m.q_norm, m.k_norm) if m.q_norm is not None else None
            self.mixer_block = AttentionBlock.build(norm, m, qk_norms, m.rotary_emb)
        fused_block = getattr(self.mlp, "fused_block", None)
        self.mlp_block = fused_block(post) if fused_block is not None else MLPBlock.build(post, self.mlp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        fb: ForwardBatch,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As Qwen3-Next's layer: returns (out, residual), whose sum is the layer's output; the fused CPU
        blocks take and give whole hidden states."""
        if self.mixer_block is not None or self.mlp_block is not None:
            hidden = hidden if residual is None else hidden + residual
            fused = self.mixer_block(hidden, fb) if self.mixer_block is not None else None
            if fused is None:
                fused = hidden + self._mixer(positions, self.input_layernorm(hidden), fb)
            hidden = fused
            fused = self.mlp_block(hidden) if self.mlp_block is not None else None
            return (
                fused if fused is not None else hidden + self.mlp(self.post_attention_layernorm(hidden))
            ), None
        x, residual = self.input_layernorm.add_and_norm(hidden, residual)
        x, residual = self.post_attention_layernorm.add_and_norm(self._mixer(positions, x, fb), residual)
        return self.mlp(x), residual

    def _mixer(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.mixer(x, fb) if self.is_linear else self.mixer(positions, x, fb)


class HybridStack(nn.Module):
    """Embedding (times a multiplier), the layers, the final norm: Granite-4.0-H's and Bamba's model."""

    def __init__(self, vocab_size: int, layers: list[HybridDecoderLayer], hidden_size: int, eps: float,
                 embedding_multiplier: float = 1.0):  # fmt: skip
        super().__init__()
        self.embedding_multiplier = embedding_multiplier
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps=eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, fb, residual)
        return self.norm.add_and_norm(hidden, residual)[0]
