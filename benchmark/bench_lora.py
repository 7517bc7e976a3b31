"""What serving LoRA adapters costs a target linear (`lora/lora_layers.py`): the base projection alone,
against the base plus the slots' delta `((x A^T) * mask) B^T`, at Qwen3-Next-80B-A3B's real per-layer
shapes (hidden 2048; attention q_proj 2048 -> 8192 (query and gate), o_proj 4096 -> 2048; Gated DeltaNet
in_proj_qkvz 2048 -> 12288, out_proj 4096 -> 2048), for token counts of a decode step (1, 8, 64, 256)
and a prefill chunk (4096), with --max-loras-per-batch slots of --max-lora-rank. The two are timed in
turn (best of --repeats) so that a loaded machine's slow spells weigh on both alike; the ratio is the
delta's share. A batch on the base model alone skips the delta outside CUDA graphs (not timed here).
--used U: the batch's adapters sit in U slots (0: every slot, as inside a CUDA graph, which is captured
for any batch); outside graphs the delta reads only the slots [lo, hi) that hold them (one adapter: one
slot's columns).

    .venv/bin/python benchmark/bench_lora.py [--slots 8] [--rank 16] [--dtype bfloat16] [--device cpu]
                                             [--used 0]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from sglang.srt.lora.lora_layers import LoRABatch, LoRAModule

SHAPES = {
    "q_proj": (2048, 8192),
    "o_proj": (4096, 2048),
    "in_proj_qkvz": (2048, 12288),
    "out_proj": (4096, 2048),
}


def best(fn, repeats: int, device: str) -> float:
    out = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out = min(out, time.perf_counter() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default="1,8,64,256,4096")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--used", type=int, default=0)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    used = args.used or args.slots
    print(f"device {args.device}, {args.dtype}, {args.slots} slots of rank {args.rank}, {used} in use")
    print(f"{'module':<14}{'tokens':>8}{'base ms':>10}{'+LoRA ms':>10}{'ratio':>8}")
    for name, (n_in, n_out) in SHAPES.items():
        linear = nn.Linear(n_in, n_out, bias=False).to(args.device, dtype)
        batch = LoRABatch(args.slots, args.rank)
        plain = nn.Linear(n_in, n_out, bias=False).to(args.device, dtype)
        plain.weight.data.copy_(linear.weight.data)
        lora = LoRAModule(name, linear, batch, dtype)
        for s in range(args.slots):
            lora.write(s, torch.randn(args.rank, n_in, dtype=dtype), torch.randn(n_out, args.rank, dtype=dtype) * 0.01)
        for t in (int(x) for x in args.tokens.split(",")):
            x = torch.randn(t, n_in, device=args.device, dtype=dtype)
            slots = torch.arange(t, device=args.device) % (used + 1) - 1  # the slots in use, and the base
            batch.lo, batch.hi = (0, args.slots) if not args.used else (0, used)
            slot_ids = torch.arange(batch.lo, batch.hi, device=args.device)
            batch.mask = (slots[:, None] == slot_ids[None]).to(dtype)
            with torch.inference_mode():
                base_s = plus_s = float("inf")
                for _ in range(3):  # (in turn: see the module docstring)
                    base_s = min(base_s, best(lambda m=plain, x=x: m(x), args.repeats, args.device))
                    plus_s = min(plus_s, best(lambda m=linear, x=x: m(x), args.repeats, args.device))
            print(f"{name:<14}{t:>8}{base_s * 1e3:>10.3f}{plus_s * 1e3:>10.3f}{plus_s / base_s:>8.2f}")


if __name__ == "__main__":
    main()
