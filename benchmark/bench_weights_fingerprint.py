"""What a PD server's weights fingerprint costs at start and after each weight update
(`disaggregation/weights_fingerprint.py`): the demo model's load against its fingerprint, and the
fingerprint of N GiB of bfloat16 weights (64 tensors per GiB), at each thread count given.

    .venv/bin/python benchmark/bench_weights_fingerprint.py [--gib 1] [--threads 1,2] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    from sglang.srt.configs.model_config import load_hf_config
    from sglang.srt.configs.presets import resolve_model_path
    from sglang.srt.disaggregation.weights_fingerprint import weights_fingerprint
    from sglang.srt.models.registry import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    path = resolve_model_path("tiny-qwen3-next-demo")
    start = time.perf_counter()
    demo = load_model(load_hf_config(path), path, torch.float32, args.device)
    load_s = time.perf_counter() - start
    demo_bytes = sum(t.numel() * t.element_size() for t in demo.state_dict().values())
    per_gib = 64
    rows = int(args.gib * 2**30 / 2 / per_gib / 2048)
    big = torch.nn.ModuleList(
        torch.nn.Linear(2048, rows, bias=False, dtype=torch.bfloat16, device=args.device) for _ in range(per_gib)
    )
    big_gib = sum(t.numel() * 2 for t in big.state_dict().values()) / 2**30
    print(f"demo model: {len(demo.state_dict())} tensors, {demo_bytes / 1e6:.1f} MB, loaded in {load_s * 1e3:.0f} ms")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        d = best_of(lambda: weights_fingerprint(demo), args.repeats * 3)
        b = best_of(lambda: weights_fingerprint(big), args.repeats)
        print(
            f"threads {threads}: demo {d * 1e3:.1f} ms ({d / load_s:.1%} of its load); "
            f"{big_gib:.2f} GiB bfloat16 {b * 1e3:.0f} ms ({big_gib / b:.2f} GiB/s)"
        )


if __name__ == "__main__":
    main()
