"""Qwen3.5's vision tower as published (`model.visual.*`): a Conv3d patch embedding over
`temporal_patch_size` frames of `patch_size`-pixel squares, a learned position grid resampled to each
image's patch grid, pre-norm transformer blocks with 2D (height, width) rotary attention, and a merger
that concatenates each `spatial_merge_size`² block of patches into one token of the language model's width.

The input is what transformers' Qwen2-VL image processor gives: `pixel_values` [patches, C*T*P*P] with
the patches of all images back to back, in merge-block order, and `grid_thw` [images, 3]. All images
go through one forward (the patch embedding, MLPs and merger batched over them); attention is per
image, through SDPA. The tower is small beside the language model and runs replicated on every rank
under tensor parallelism.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Qwen3_5VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [N, H, D]
        # The rotation in float32, as the checkpoint was trained with.
        q, k = ((t.float() * cos + _rotate_half(t.float()) * sin).to(v.dtype) for t in (q, k))
        out = torch.empty_like(q)
        for start, stop in itertools.pairwise(bounds):  # each image (frame) attends within itself
            span = [t[start:stop].transpose(0, 1) for t in (q, k, v)]
            out[start:stop] = F.scaled_dot_product_attention(*span).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class Qwen3_5VisionBlock(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        dim = config.hidden_size
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Qwen3_5VisionAttention(dim, config.num_heads)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(dim, config.intermediate_size)
        self.mlp.linear_fc2 = nn.Linear(config.intermediate_size, dim)
        assert config.hidden_act == "gelu_pytorch_tanh", config.hidden_act

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        h = F.gelu(self.mlp.linear_fc1(self.norm2(x)), approximate="tanh")
        return x + self.mlp.linear_fc2(h)


class Qwen3_5VisionPatchMerger(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3_5VisionModel(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_embed = nn.Module()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.patch_embed.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(Qwen3_5VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen3_5VisionPatchMerger(config)
        head_dim = config.hidden_size // config.num_heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        # Half the head's frequencies rotate by the patch's row, half by its column.
        half = head_dim // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Image tokens [sum over images of t*h*w / merge², out_hidden_size], images in order."""
        grid_thw = grid_thw.to("cpu", torch.long)
        device, dtype = self.pos_embed.weight.device, self.pos_embed.weight.dtype
        proj = self.patch_embed.proj
        patches = pixel_values.to(device, dtype).view(-1, proj.in_channels, *proj.kernel_size)
        x = proj(patches).view(patches.shape[0], -1)
        # The learned position grid, bilinearly resampled (corners aligned) to each image's patch grid.
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, self.num_grid_per_side, "bilinear", True, self.spatial_merge_size
        )
        x = x + (self.pos_embed(indices.to(device)) * weights.to(device, dtype)[:, :, None]).sum(1)
        rows_cols = get_vision_position_ids(grid_thw, self.spatial_merge_size).to(device)  # [N, 2]
        freqs = (rows_cols[:, :, None].float() * self.inv_freq.to(device)).flatten(1)  # [N, head_dim/2]
        freqs = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = freqs.cos(), freqs.sin()
        bounds = get_vision_cu_seqlens(grid_thw).tolist()
        for block in self.blocks:
            x = block(x, cos, sin, bounds)
        return self.merger(x)
