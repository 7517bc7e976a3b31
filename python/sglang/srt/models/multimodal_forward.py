"""The language model's forward with images and video frames: multimodal rotary positions (Qwen2-VL's mRoPE, interleaved
as Qwen3.5's) and the vision tower's tokens in place of the prompt's image pad values
(`multimodal/inputs.py`; a video is its frames, each placed as an image).

A prefill chunk of a request with images runs on [3, T] positions (`MultimodalInputs.positions`) and
embeds the chunk's share of its images' tokens (the tower runs once per request, at the first chunk
that reaches an image). After the prompt every position is the token's index plus the request's
`mrope_position_delta` on all three axes, so decodes and verifies stay on the one-dimensional rotary
path (its kernels, CUDA graphs): the model keeps each request row's delta in a table that every
extend sets (0 for a text request) and every other forward adds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.multimodal.inputs import pad_tokens, shown_ids


class MRotaryEmbedding(RotaryEmbedding):
    """Interleaved mRoPE: rotary frequency i turns by the height position when i % 3 == 1 and
    i < 3 * section[1], by the width when i % 3 == 2 and i < 3 * section[2], else by the temporal one.
    One-dimensional positions (text) are the plain rotary embedding."""

    def __init__(self, rope: RotaryEmbedding, mrope_section: list[int]):
        super().__init__(rope.head_dim, rope.rotary_dim, rope.base)
        axes = []
        for i in range(rope.rotary_dim // 2):
            h, w = i % 3 == 1 and i < 3 * mrope_section[1], i % 3 == 2 and i < 3 * mrope_section[2]
            axes.append(1 if h else 2 if w else 0)
        self.register_buffer("axes", torch.tensor(axes, dtype=torch.int64, device="cpu"), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.ndim == 1:
            return super().forward(positions, q, k, cache)
        key = ("mrope", self.rotary_dim, self.base)
        cos_sin = cache.get(key) if cache is not None else None
        if cos_sin is None:
            axes = self.axes.to(positions.device)
            chosen = positions.float().index_select(0, axes)  # [frequencies, T]: each its axis' position
            freqs = chosen.t() * self.inv_freq.to(positions.device).float()
            cos_sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
            if cache is not None:
                cache[key] = cos_sin
        cos, sin = cos_sin
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


class MultimodalForward:
    """Runs `backbone` (embed_tokens, layers, norm) with images; not a module, so the model's
    parameters stay where the checkpoint names them."""

    def __init__(self, backbone: nn.Module, visual: nn.Module, vocab_size: int):
        self.backbone = backbone
        self.visual = visual
        self.vocab_size = vocab_size
        self.deltas: torch.Tensor | None = None  # [request rows] mrope_position_delta per row

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: Any) -> torch.Tensor:
        mm = fb.mm_inputs
        if self.deltas is None:
            # Made at the first forward (a CUDA graph's warm-up included), one entry per request row.
            backend = getattr(fb.attn_backend, "full_attn_backend", fb.attn_backend)
            rows = backend.req_to_token.shape[0]
            self.deltas = torch.zeros(rows, dtype=torch.int64, device=input_ids.device)
        plain_extend = fb.forward_mode.is_extend() and not fb.forward_mode.is_target_verify()
        if fb.batch_size:
            if plain_extend:
                values = [
                    m.mrope_position_delta if m is not None else 0 for m in mm or [None] * fb.batch_size
                ]
                self.deltas[fb.req_pool_indices] = torch.tensor(values, dtype=torch.int64).to(
                    input_ids.device
                )
            else:
                deltas = self.deltas[fb.req_pool_indices]
                if not fb.forward_mode.is_decode():  # a verify: each request's drafted positions
                    widths = fb.verify_width or torch.tensor(fb.extend_seq_lens_cpu, device=deltas.device)
                    deltas = deltas.repeat_interleave(widths)
                positions = positions + deltas
                fb.positions = positions  # the fused CPU decode blocks read the batch's positions
        if not plain_extend or mm is None:
            return self.backbone(input_ids, positions, fb)
        hidden, positions = self._embed(input_ids, positions, fb, mm)
        residual = None
        for layer in self.backbone.layers:
            hidden, residual = layer(positions, hidden, fb, residual)
        return self.backbone.norm.add_and_norm(hidden, residual)[0]

    def _embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: Any, mm: list[Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        is_mm = input_ids >= self.vocab_size
        hidden = self.backbone.embed_tokens(input_ids.masked_fill(is_mm, 0))
        rows, items = [], []
        for i, m in enumerate(mm):
            start, p, n = fb.extend_start_loc_cpu[i], fb.extend_prefix_lens_cpu[i], fb.extend_seq_lens_cpu[i]
            if m is None:
                rows.append(positions[start : start + n].expand(3, -1))
                continue
            rows.append(m.positions(p, p + n).to(positions.device))
            first, last = m.tokens_before(p), m.tokens_before(p + n)
            if last > first:
                if m.embeddings is None:
                    grid = torch.tensor(m.grid_thw, dtype=torch.int64)
                    with torch.no_grad():
                        m.embeddings = self.visual(m.pixel_values, grid)
                items.append(m.embeddings[first:last])
        if items:
            hidden[is_mm] = torch.cat(items).to(hidden.dtype)
        # The logits processor scores input tokens by these ids: an image (video) position's is the
        # checkpoint's image (video) token, as the oracle sees it.
        tokens = pad_tokens(mm)
        fb.input_ids = shown_ids(input_ids, tokens)
        if fb.extend_logprob_next_ids_cpu is not None:
            fb.extend_logprob_next_ids_cpu = shown_ids(fb.extend_logprob_next_ids_cpu, tokens)
        return hidden, torch.cat(rows, dim=1)
