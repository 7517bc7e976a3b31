"""What planning one request's PD copies costs between servers of different --tp-size
(`disaggregation/shard_map.shard_writes`), at Qwen3-Next-80B's shapes (2 KV heads of 256, 12
full-attention and 36 Gated DeltaNet layers): per prefill rank, the descriptors of a prompt of
`--tokens` consecutive slots and the time to make them (the pair's plan cached, as after the first
request). No transfer engine: the addresses are made up, nothing is copied. Medians of `--repeat` runs.

    python benchmark/bench_shard_writes.py
    python benchmark/bench_shard_writes.py --tokens 32768
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from transformers import Qwen3NextConfig

from sglang.srt.configs.hybrid_arch import hybrid_arch_config
from sglang.srt.disaggregation.shard_map import rank_layout, shard_writes
from sglang.srt.disaggregation.transfer import PoolLayout

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from real_shapes import published_config  # noqa: E402 - (benchmark/gpu/: the real-shape slices' configs)

PAIRS = ((1, 1), (2, 2), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4))


def ranks(arch, tp: int, base: int) -> list:
    """Every rank's (PoolLayout, ShardLayout) at `tp`: bfloat16 KV and conv state, float32 SSM state."""
    out = []
    kv_buffers, linear = 2 * len(arch.full_attention_layer_ids), len(arch.linear_layer_ids)
    shape = arch.state_shape
    for r in range(tp):
        shard = rank_layout(
            arch, tp, r, arch.head_dim * 2, shape.conv[1] * 2, shape.temporal[1] * shape.temporal[2] * 4
        )
        pool = PoolLayout(
            kv_ptrs=[base + (r * 1000 + i) * 2**32 for i in range(kv_buffers)],
            kv_nbytes=[2**31] * kv_buffers,
            kv_bytes_per_token=shard.kv.row_bytes,
            state_ptrs=[base + (r * 1000 + 500 + i) * 2**32 for i in range(2 * linear)],
            state_nbytes=[2**31] * (2 * linear),
            state_slot_bytes=[shard.conv.row_bytes] * linear + [shard.ssm.row_bytes] * linear,
        )
        out.append((replace(pool, shards=shard.to_dict()), shard))
    return out


def destination_checks(arch, tokens: int, repeat: int) -> None:
    """The scheduler thread's cost of one destination from a decode server of each size (its checks:
    `malformed_dst` and `unfit_dst`, the model's rule included), and its message's size."""
    from functools import partial

    from sglang.srt.disaggregation.destination import malformed_dst, unfit_dst
    from sglang.srt.disaggregation.pd_ranks import destination_ranks
    from sglang.srt.disaggregation.shard_map import rank_layouts

    print(f"destination checks ({tokens} KV slots; prefill TP 2): decode TP, message bytes, median ms")
    prefill = [pool for pool, _ in ranks(arch, 2, 2**44)]
    rule = partial(rank_layouts, arch, units=ranks(arch, 1, 0)[0][1])
    for tp in (1, 2, 4, 8, 16):
        decode = [pool for pool, _ in ranks(arch, tp, 2**45)]
        targets = [{"session": f"10.0.0.{r}:1234", "layout": p.to_dict()} for r, p in enumerate(decode)]
        dst = {"notify": "tcp://10.0.0.1:1", "session": "10.0.0.0:1234", "layout": targets[0]["layout"],
               "kv": list(range(100, 100 + tokens)), "slot": 3, **destination_ranks(targets)}  # fmt: skip
        runs = []
        for _ in range(repeat):
            t = time.perf_counter()
            assert malformed_dst(dst, 1 << 20) is None
            assert unfit_dst(prefill, dst, tokens, False, None, rule) is None
            runs.append(time.perf_counter() - t)
        print(f"TP {tp}: {len(json.dumps(dst))} / {statistics.median(runs) * 1e3:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    config = Qwen3NextConfig(**published_config("qwen3-next-80b"))  # (the published config.json's fields)
    arch = hybrid_arch_config(config)
    src_tokens = list(range(1, args.tokens + 1))
    dst_tokens = list(range(100, args.tokens + 100))
    print(f"{args.tokens} tokens; per prefill rank: descriptors, median ms")
    for a, b in PAIRS:
        src, dst = ranks(arch, a, 2**44), ranks(arch, b, 2**45)
        shard_writes(0, src, dst, src_tokens, dst_tokens, 3, 5)  # (plans the pair)
        counts, times = [], []
        for p in range(a):
            runs = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                writes = shard_writes(p, src, dst, src_tokens, dst_tokens, 3, 5)
                runs.append(time.perf_counter() - t)
            counts.append(sum(len(d) for _, d in writes))
            times.append(statistics.median(runs) * 1e3)
        print(f"TP {a} -> {b}: " + ", ".join(f"{n} / {ms:.1f}" for n, ms in zip(counts, times, strict=True)))
    destination_checks(arch, args.tokens, args.repeat)


if __name__ == "__main__":
    main()
