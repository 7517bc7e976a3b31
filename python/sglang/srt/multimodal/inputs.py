"""What a request with images or videos carries from the tokenizer manager to the model: the processed
pixels, where each image's (each video frame pair's) tokens sit in the prompt, and the prompt's
multimodal rotary positions.

Each item's tokens stand in the prompt as a pseudo token id derived from its content (`pad_value`,
upstream's name), not the checkpoint's `<|image_pad|>` / `<|video_pad|>` id: the prefix cache keys on the
ids, so a cached prefix is reused only by a request whose images and videos are the same, with every
strategy. Pad values lie above the vocabulary; the model embeds the items at those positions, and the
ids a reply shows, and those the logits processor scores, are the checkpoint's tokens again: one mapping
back (`pad_tokens`, `shown_ids`) serves the model and the result processor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

# Pad values are vocab_size + [0, 2**30): a collision between two different images is a 2**-30 event.
PAD_VALUE_RANGE = 1 << 30


def pad_value(pixels: torch.Tensor, grid_thw: list[int], vocab_size: int, token_id: int = 0) -> int:
    """The pseudo token id of an image or video frame: a hash of its processed pixels, grid and
    checkpoint token (an image and a video frame of the same pixels are different prompts)."""
    h = hashlib.sha256(pixels.contiguous().numpy().tobytes())
    h.update(repr((grid_thw, token_id)).encode())
    return vocab_size + int.from_bytes(h.digest()[:8], "little") % PAD_VALUE_RANGE


@dataclass
class MultimodalInputs:
    """One request's images and video frames ("items", in prompt order; a video is one item per
    temporal patch of frames, each item a (1, h, w) grid, as transformers' `get_rope_index` splits it).
    `pixel_values` [patches, C*T*P*P] of all its items in order, `grid_thw` [items][3];
    `offsets[i]` = (first prompt position of item i's tokens, their number); `token_ids[i]` the
    checkpoint's token for item i (`<|image_pad|>` or `<|video_pad|>`). `mrope_positions` [3, prompt
    length]: the prompt's (t, h, w) rotary positions; past the prompt, position j is
    j + `mrope_position_delta` on all three axes."""

    pixel_values: torch.Tensor
    grid_thw: list[list[int]]
    offsets: list[tuple[int, int]]
    pad_values: list[int]
    token_ids: list[int]
    mrope_positions: torch.Tensor
    mrope_position_delta: int
    # The vision tower's output for all the items [tokens, hidden], computed at the request's first
    # prefill chunk that reaches one and kept for its later chunks (set by the model).
    embeddings: torch.Tensor | None = field(default=None, repr=False)

    def positions(self, start: int, stop: int) -> torch.Tensor:
        """[3, stop - start] rotary positions of the request's tokens [start, stop)."""
        n = self.mrope_positions.shape[1]
        inside = self.mrope_positions[:, min(start, n) : min(stop, n)]
        past = torch.arange(max(start, n), max(stop, n), dtype=torch.int64) + self.mrope_position_delta
        return torch.cat([inside, past.expand(3, -1)], dim=1)

    def tokens_before(self, pos: int) -> int:
        """How many image and video tokens sit at prompt positions < pos."""
        return sum(min(max(pos - start, 0), n) for start, n in self.offsets)

    def shown_ids(self, ids: list[int]) -> list[int]:
        """`ids` (the request's) with each pad value replaced by its item's checkpoint token, as a client
        sees its prompt (and as transformers' processor writes it)."""
        return shown_ids(ids, pad_tokens([self]))


def pad_tokens(items: list[MultimodalInputs | None]) -> dict[int, int]:
    """Each pad value of `items` (a batch's requests' inputs; None for a request without images) -> its
    item's checkpoint token (`<|image_pad|>` or `<|video_pad|>`)."""
    return {p: t for m in items if m is not None for p, t in zip(m.pad_values, m.token_ids, strict=True)}


def shown_ids(
    ids: list[int | None] | torch.Tensor, tokens: dict[int, int]
) -> list[int | None] | torch.Tensor:
    """`ids` with each pad value of `tokens` (`pad_tokens`) replaced by its checkpoint token: a list (its
    Nones kept) or a tensor (a new one)."""
    if not isinstance(ids, torch.Tensor):
        return [tokens.get(t, t) for t in ids]
    out = ids.clone()
    for pad, token in tokens.items():
        out[ids == pad] = token
    return out


def mrope_positions(
    num_tokens: int, offsets: list[tuple[int, int]], grids: list[list[int]], merge: int
):
    """The prompt's [3, num_tokens] positions and the delta past it, as transformers' `get_rope_index`
    for Qwen3.5 images and video frame pairs (grids (1, h, w): transformers splits a video so): text
    advances one position per token on all axes; an item's tokens take (start, start + row,
    start + column) over its merged grid, and the text after it resumes at start + max(rows, columns)."""
    parts, pos, prev = [], 0, 0
    for (start, n), (t, h, w) in zip(offsets, grids, strict=True):
        text = start - prev
        parts.append((torch.arange(text, dtype=torch.int64) + pos).expand(3, -1))
        pos += text
        rows, cols = h // merge, w // merge
        assert t * rows * cols == n, (t, rows, cols, n)
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(cols), indexing="ij")
        parts.append(torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]).to(torch.int64) + pos)
        pos += max(rows, cols)
        prev = start + n
    parts.append((torch.arange(num_tokens - prev, dtype=torch.int64) + pos).expand(3, -1))
    positions = torch.cat(parts, dim=1).contiguous()
    return positions, int(positions.max()) + 1 - num_tokens if num_tokens else 0
