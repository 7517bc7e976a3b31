"""Decode attention on CPU: torch's fused SDPA (flash kernel, `enable_gqa`) against two matmuls over each
KV head's whole query group, on gathered KV padded to the longest request, one thread, round-robin medians:

    .venv/bin/python benchmark/bench_decode_attention_cpu.py

Why: the torch-native backend takes the matmuls for float32 decodes where (query heads per KV head) x
(head dim) >= 512 (`GROUPED_DECODE_MIN_WORK`): the flash kernel re-reads every key once per query head.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

# (batch, keys, query heads, KV heads, head dim): the tiny presets, then Qwen3-Next-80B's attention.
SHAPES = [
    (16, 1300, 4, 2, 16),
    (64, 256, 4, 2, 16),
    (16, 1300, 8, 2, 64),
    (16, 1300, 16, 2, 64),
    (16, 1300, 8, 2, 128),
    (16, 1300, 8, 2, 256),
    (64, 512, 16, 2, 256),
    (4, 4000, 16, 2, 256),
]


def row(bs: int, length: int, hq: int, hk: int, d: int) -> str:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(bs, hq, 1, d, generator=g)
    k, v = torch.randn(bs, hk, length, d, generator=g), torch.randn(bs, hk, length, d, generator=g)
    mask = torch.arange(length)[None, :] < torch.randint(length // 2, length + 1, (bs,), generator=g)[:, None]
    group = hq // hk

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], enable_gqa=True)

    def grouped():
        s = torch.matmul(q.view(bs, hk, group, d), k.transpose(-1, -2)) * d**-0.5
        return torch.matmul(s.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1), v)

    assert torch.allclose(sdpa(), grouped().view(bs, hq, 1, d), atol=1e-4)
    times: dict[str, list[float]] = {"sdpa": [], "grouped": []}
    for _ in range(15):
        for name, fn in (("sdpa", sdpa), ("grouped", grouped)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    a, b = (statistics.median(times[n]) * 1e3 for n in ("sdpa", "grouped"))
    return f"| {bs} x {length} | {hq}/{hk}, {d} | {a:.2f} | {b:.2f} | {a / b:.2f} |"


def main() -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    print(
        "| batch x keys | heads q/kv, dim | SDPA ms | grouped matmuls ms | SDPA / matmuls |\n|---|---|---|---|---|"
    )
    for shape in SHAPES:
        print(row(*shape), flush=True)


if __name__ == "__main__":
    main()
