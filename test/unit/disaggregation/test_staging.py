"""The staged transfer path's packing (disaggregation/staging.py) on CPU tensors: the same code the CUDA
path runs (there with a copy stream and pinned buffers). A request's KV rows and state slot packed from
one server's pools and unpacked into another's land in the right rows, bit for bit, and touch nothing
else; the staging buffer's ranges never overlap."""

from __future__ import annotations

import random

import torch

from sglang.srt.disaggregation.staging import ByteRanges, StatePacker, host_buffer
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def pools(seed: int, fill: bool):
    g = torch.Generator().manual_seed(seed)
    kv = [torch.zeros(64, 2, 8, dtype=torch.bfloat16) for _ in range(4)]  # K, V of two layers
    states = [torch.zeros(6, 3, 5, dtype=torch.float32), torch.zeros(6, 2, 4, 4, dtype=torch.float16)]
    if fill:
        for b in kv + states:
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    return kv, states


def test_pack_then_unpack_moves_exactly_the_requests_rows():
    src_kv, src_states = pools(0, fill=True)
    dst_kv, dst_states = pools(1, fill=False)
    src_tokens = [5, 6, 7, 30, 2, 63]  # runs and jumps, out of order
    dst_tokens = [40, 41, 10, 11, 12, 0]
    packer = StatePacker(src_kv, src_states, "cpu")
    buf = host_buffer(packer.packed_bytes(len(src_tokens)) + 100, pin=False)
    n = packer.pack(src_tokens, 4, buf)
    assert n == len(src_tokens) * sum(b[0].nbytes for b in src_kv) + sum(b[0].nbytes for b in src_states)
    StatePacker(dst_kv, dst_states, "cpu").unpack(buf, dst_tokens, 1)
    for s, d in zip(src_kv, dst_kv, strict=True):
        assert torch.equal(d[dst_tokens], s[src_tokens])
        untouched = [t for t in range(64) if t not in dst_tokens]
        assert not d[untouched].any()
    for s, d in zip(src_states, dst_states, strict=True):
        assert torch.equal(d[1], s[4])
        assert not d[[0, 2, 3, 4, 5]].any()


def test_byte_ranges_never_overlap_and_reuse_freed_room():
    rng = random.Random(0)
    ranges = ByteRanges(1000)
    held: dict[int, int] = {}
    for _ in range(500):
        if held and rng.random() < 0.45:
            start = rng.choice(list(held))
            ranges.free(start)
            del held[start]
            continue
        n = rng.randint(1, 300)
        start = ranges.alloc(n)
        if start is None:
            # Refused only when no gap of n bytes exists.
            spans = sorted(held.items())
            gaps = [b - (a + m) for (a, m), (b, _) in zip(spans, spans[1:], strict=False)]
            gaps += [spans[0][0] if spans else 1000, 1000 - (spans[-1][0] + spans[-1][1]) if spans else 1000]
            assert max(gaps) < n
            continue
        assert 0 <= start and start + n <= 1000
        assert all(start + n <= a or a + m <= start for a, m in held.items())
        held[start] = n
