"""Test support for the state-copy ops (`mem_cache/state_copy`): pools of random states, a row-by-row
oracle written from the documented semantics, NaN poisoning and bitwise comparison."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

# (layers, conv row, SSM row): the tiny presets' per-layer shapes are of this size; "odd" makes rows
# whose byte lengths are not multiples of 16 (fp16 conv of 5 x 3 = 30 bytes); "large" has 256 KB SSM
# rows (fp32), so 18 of its slots make a launch big enough for the C++ op's streaming stores, and
# unaligned conv rows beside them (fp16: 6006 bytes).
SMALL_SHAPES = {
    "tiny": (3, (24, 3), (4, 8, 8)),
    "odd": (2, (5, 3), (3, 1, 5)),
    "large": (2, (1001, 3), (16, 64, 64)),
}
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def make_states(
    num_slots: int,
    shape: str = "tiny",
    dtypes: tuple[torch.dtype, torch.dtype] = (torch.bfloat16, torch.float32),
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> list[torch.Tensor]:
    """Random conv and SSM state tensors `[layers, num_slots, *row]` (slot 0 included)."""
    layers, conv, ssm = SMALL_SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(layers, num_slots, *row, generator=g).to(dtype=dt, device=device)
        for row, dt in zip((conv, ssm), dtypes, strict=True)
    ]


def poison(tensors: Sequence[torch.Tensor], slots: Sequence[int]) -> None:
    """NaN-fill the given slots, so a row a copy misses stays visibly wrong."""
    for t in tensors:
        for s in slots:
            if 0 <= s < t.shape[1]:
                t[:, s] = float("nan")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: exact comparison, NaN included."""
    return t.contiguous().view(_BITS[t.element_size()]).cpu()


def assert_same(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        diff = (bits(a) != bits(b)).reshape(a.shape[0], a.shape[1], -1).any(-1).any(0)
        bad = diff.nonzero().flatten().tolist()
        assert not bad, f"tensor {k}: slots {bad[:10]} differ"


def _kept(s: int, d: int) -> bool:
    return s >= 0 and d > 0 and s != d


def expected_copy(
    tensors: Sequence[torch.Tensor],
    src: Sequence[int],
    dst: Sequence[int],
    mask: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """The documented semantics, one row at a time, on clones."""
    out = [t.clone() for t in tensors]
    mask = [True] * len(dst) if mask is None else list(mask)
    for s, d, m in zip(src, dst, mask, strict=True):
        if m and _kept(s, d):
            for o, t in zip(out, tensors, strict=True):
                o[:, d] = t[:, s]
    return out


def expected_clear(tensors: Sequence[torch.Tensor], slots: Sequence[int]) -> list[torch.Tensor]:
    out = [t.clone() for t in tensors]
    for s in slots:
        if s > 0:
            for o in out:
                o[:, s] = 0
    return out


def disjoint_rows(n: int, num_slots: int, seed: int, skips: bool = True) -> tuple[list[int], list[int]]:
    """n copy rows with distinct destinations disjoint from the sources (the legal case), slot ids in
    [1, num_slots); with skips, some rows have src -1, dst -1, dst 0 or src == dst (all no-ops)."""
    rng = random.Random(seed)
    ids = rng.sample(range(1, num_slots), 2 * n)
    src, dst = ids[:n], ids[n:]
    if skips and n >= 4:
        for i in rng.sample(range(n), max(1, n // 4)):
            kind = rng.randrange(4)
            if kind == 0:
                src[i] = -1
            elif kind == 1:
                dst[i] = -1
            elif kind == 2:
                dst[i] = 0
            else:
                dst[i] = src[i]
    return src, dst
