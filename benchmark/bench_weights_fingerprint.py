"""What a PD server's weights fingerprint costs at start and after each weight update
(`disaggregation/weights_fingerprint.py`): the demo model's load against its fingerprint, and the
fingerprint of N GiB of bfloat16 weights (64 tensors per GiB), at each thread count given; then an RL
refit's buckets of one tensor each (--buckets on the demo model, through its loader; --big-buckets on the
N GiB), each followed by the fingerprint in full (every tensor read, as before the cache) and cached (only
the tensors written since read again, as a PD server does after /update_weights_from_tensor).

`--baseline FILE`: another `weights_fingerprint.py` (an older commit's: `git show
<commit>:python/sglang/srt/disaggregation/weights_fingerprint.py > /tmp/old.py`) timed in the same run on
the same tensors, for the ratio. The fingerprint keys every element by its place in the checkpoint's full
tensor (any --tp-size / --ep-size compare); before 2aa7cb7 it keyed 8-byte words of each rank's shard.
The two modules are called in turn, each timing its best, so that a loaded machine's slow spells weigh
on both alike.

    .venv/bin/python benchmark/bench_weights_fingerprint.py [--gib 1] [--threads 1,2] [--device cpu]
        [--buckets 200] [--big-buckets 8] [--baseline /tmp/old.py] [--cpu-time]
"""

from __future__ import annotations

import argparse
import time

import torch

CLOCK = time.perf_counter  # (--cpu-time: time.process_time)


def best_of(*fns, repeats: int) -> list[float]:
    """Each function's best time over `repeats` calls, the functions called in turn (on a loaded machine
    a slow spell then weighs on all of them alike, not on one)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = CLOCK()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            best[i] = min(best[i], CLOCK() - start)
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
    p.add_argument("--buckets", type=int, default=200)
    p.add_argument("--big-buckets", type=int, default=8)
    p.add_argument("--baseline", default=None, help="another weights_fingerprint.py, timed alongside")
    p.add_argument(
        "--cpu-time", action="store_true",
        help="time the fingerprints in this process's CPU seconds (all threads), not wall time: steadier on "
        "a machine others load (on one thread the two agree on an idle machine)",
    )  # fmt: skip
    args = p.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    baseline = _module_from(args.baseline) if args.baseline else None

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
        demo_fns, big_fns = [lambda: weights_fingerprint(demo)], [lambda: weights_fingerprint(big)]
        if baseline is not None:  # (timed in turn with the current module)
            demo_fns.append(lambda: baseline.weights_fingerprint(demo))
            big_fns.append(lambda: baseline.weights_fingerprint(big))
        demo_s, big_s = best_of(*demo_fns, repeats=args.repeats * 3), best_of(*big_fns, repeats=args.repeats)
        d, b = demo_s[0], big_s[0]
        print(
            f"threads {threads}: demo {d * 1e3:.1f} ms ({d / load_s:.1%} of its load); "
            f"{big_gib:.2f} GiB bfloat16 {b * 1e3:.0f} ms ({big_gib / b:.2f} GiB/s)"
        )
        if baseline is not None:
            bd, bb = demo_s[1], big_s[1]
            print(
                f"  baseline {args.baseline}: demo {bd * 1e3:.1f} ms, {big_gib:.2f} GiB {bb * 1e3:.0f} ms "
                f"({big_gib / bb:.2f} GiB/s): now {d / bd:.2f}x and {b / bb:.2f}x its time "
                f"({'the same' if weights_fingerprint(big) == baseline.weights_fingerprint(big) else 'other'} "
                "fingerprint values)"
            )

    if args.buckets:
        refit("demo model", demo, args.buckets, _loader_write(demo))
    if args.big_buckets:
        refit(f"{big_gib:.2f} GiB", big, args.big_buckets, _direct_write(big))


def _module_from(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("weights_fingerprint_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loader_write(model):
    """One bucket: one of the model's own tensors written back through its loader (which notes it)."""
    named = [(n, t.detach().clone()) for n, t in model.named_parameters()]
    return lambda i: model.load_weights([named[i % len(named)]], update=True)


def _direct_write(model):
    """One bucket: one tensor rewritten in place, noted as the loader notes its targets."""
    from sglang.srt.models.weight_writes import note_written

    params = list(model.parameters())

    def write(i: int) -> None:
        p = params[i % len(params)]
        note_written([p])
        with torch.no_grad():
            p.copy_(p.detach().clone())

    return write


def refit(what: str, model, buckets: int, write) -> None:
    from sglang.srt.disaggregation.weights_fingerprint import weights_fingerprint

    spent = {}
    for cached in (False, True):
        weights_fingerprint(model)
        total = 0.0
        for i in range(buckets):
            write(i)
            start = CLOCK()
            digest = weights_fingerprint(model, cached=cached)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            total += CLOCK() - start
        assert digest == weights_fingerprint(model)
        spent[cached] = total
    print(
        f"{what}, {buckets} buckets of one tensor: fingerprints in full {spent[False] * 1e3:.0f} ms "
        f"({spent[False] / buckets * 1e3:.1f} ms each), cached {spent[True] * 1e3:.0f} ms "
        f"({spent[True] / buckets * 1e3:.2f} ms each): {spent[False] / spent[True]:.0f}x less"
    )


if __name__ == "__main__":
    main()
