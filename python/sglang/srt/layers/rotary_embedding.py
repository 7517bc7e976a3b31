"""Rotary position embedding, neox style (halves rotated, as transformers' `rotate_half`), applied to
the first `rotary_dim` channels of each head (partial rotary); the rest pass through. On CPU, float32 q
and k take one sgl-kernel C++ call (`sgl-kernel/csrc/rope_cpu.cpp`, the same float32 arithmetic;
`SGLANG_CPU_ROPE_BACKEND=torch` forces the torch ops); on CUDA one Triton launch (`rotary_triton.py`;
`SGLANG_GPU_ROPE_BACKEND=torch` forces the torch ops). Both are chosen when the model is loaded."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.srt.environ import envs
from sglang.srt.layers.cpu_ops import cpu_rope_ops
from sglang.srt.layers.gpu_ops import triton_chosen
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.stacked_linears import hooked


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, base: float):
        super().__init__()
        assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = base
        # Computed on the host in float32 whatever device or dtype the model is built in (the loader
        # builds on the meta device and copies buffers as they are).
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
        self.register_buffer("inv_freq", 1.0 / (base**exponents), persistent=False)
        self.cpu_ops = None
        self.triton = False

    def process_weights_after_loading(self) -> None:
        # rotary_dim 0 (every channel passes through) stays on the torch form; the ops rotate something.
        self.cpu_ops = cpu_rope_ops(self.inv_freq.device) if self.rotary_dim > 0 else None
        self.triton = self.rotary_dim > 0 and triton_chosen(
            envs.SGLANG_GPU_ROPE_BACKEND, self.inv_freq.device, "sglang.srt.layers.rotary_triton"
        )

    def forward_with_norms(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: nn.Module,
        k_norm: nn.Module,
        cache: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`self(positions, q_norm(q), k_norm(k), cache)` (Qwen3-Next's per-head q / k norms): one Triton
        launch where the rotation and both norms run their Triton kernels (plain RMSNorms over the head,
        one offset rule and weight dtype, no hooks) on one-dimensional positions (mRoPE's [3, T] ones take
        their subclass's `forward`), else the three calls."""
        d = q.shape[-1]
        fused = (
            self.triton and q.dtype == k.dtype and positions.dim() == 1
            and type(q_norm) is RMSNorm and type(k_norm) is RMSNorm and q_norm.triton and k_norm.triton
            and q_norm.offset_one == k_norm.offset_one and q_norm.weight.shape == k_norm.weight.shape == (d,)
            and q_norm.weight.dtype == k_norm.weight.dtype and not hooked(q_norm, k_norm)
        )  # fmt: skip
        if not fused:
            return self(positions, q_norm(q), k_norm(k), cache)
        from sglang.srt.layers.rotary_triton import rotary_triton  # here: a CPU install may lack triton

        norms = ((q_norm.weight, q_norm.eps), (k_norm.weight, k_norm.eps), q_norm.offset_one)
        return rotary_triton(positions, q, k, self.inv_freq, self.rotary_dim, norms=norms)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] at absolute `positions` [T]. `cache` (the batch's `rope_cache`)
        keeps cos/sin for the batch's other attention layers: computed once per batch, not per layer."""
        if self.triton and q.dtype == k.dtype:
            from sglang.srt.layers.rotary_triton import rotary_triton  # here: a CPU install may lack triton

            return rotary_triton(positions, q, k, self.inv_freq, self.rotary_dim)
        if self.cpu_ops is not None and q.dtype == k.dtype == torch.float32 and q.device.type == "cpu":
            return self.cpu_ops.rotary_embedding(positions, q, k, self.inv_freq, self.rotary_dim)
        key = (self.rotary_dim, self.base)
        cos_sin = cache.get(key) if cache is not None else None
        if cos_sin is None:
            freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
            cos_sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
            if cache is not None:
                cache[key] = cos_sin
        cos, sin = cos_sin
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.rotary_dim // 2
        xf = x.float()
        x1, x2, rest = xf[..., :half], xf[..., half : self.rotary_dim], xf[..., self.rotary_dim :]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
        return out.to(x.dtype)


def get_rope(
    head_dim: int, rope_parameters: dict[str, Any] | None, default_theta: float = 10000.0
) -> RotaryEmbedding:
    """The rotary embedding an HF `rope_parameters` dict (transformers 5) describes; only the default
    (unscaled) rope type is supported."""
    params = dict(rope_parameters or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported yet; only the default rope is.")
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return RotaryEmbedding(head_dim, rotary_dim, float(params.get("rope_theta", default_theta)))
