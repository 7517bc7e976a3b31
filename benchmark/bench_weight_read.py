"""Seconds to read a multi-shard safetensors checkpoint into tensors, from a cold page cache: serially
(`loader.iter_checkpoint`, as the server did) and read ahead by threads (`checkpoint_reader.read_checkpoint`,
as it does now), each tensor copied into a tensor allocated beforehand as the loader copies into a
parameter. The checkpoint is random bfloat16, written to a folder under /tmp and deleted at the end:

    .venv/bin/python benchmark/bench_weight_read.py                    # 2 GB in 4 shards; 1, 2, 4, 8 threads
    .venv/bin/python benchmark/bench_weight_read.py --gb 4 --shards 8 --threads 1 8

Each run first drops the files from the page cache (posix_fadvise DONTNEED, no root needed), so the
numbers are disk reads; on a machine whose disk is a fast NVMe the gain is larger with more cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang.srt.models.checkpoint_reader import read_checkpoint
from sglang.srt.models.loader import checkpoint_files, iter_checkpoint

TENSOR_SHAPE = (4096, 4096)  # 32 MiB in bfloat16, a mid-size model's linear


def write_checkpoint(folder: Path, gb: float, shards: int) -> dict[str, torch.Size]:
    per_tensor = TENSOR_SHAPE[0] * TENSOR_SHAPE[1] * 2
    count = max(shards, round(gb * 2**30 / per_tensor))
    shapes = {}
    for s in range(shards):
        names = [f"layers.{i}.weight" for i in range(s, count, shards)]
        tensors = {n: torch.randn(TENSOR_SHAPE).to(torch.bfloat16) for n in names}
        save_file(tensors, folder / f"shard-{s}.safetensors")
        shapes.update({n: torch.Size(TENSOR_SHAPE) for n in names})
    return shapes


def drop_cache(folder: Path) -> None:
    for path in checkpoint_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_seconds(folder: Path, targets: dict[str, torch.Tensor], threads: int) -> float:
    drop_cache(folder)
    start = time.perf_counter()
    source = iter_checkpoint(folder) if threads == 1 else read_checkpoint(folder, threads=threads)
    for name, tensor in source:
        targets[name].copy_(tensor)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench_weight_read_"))
    try:
        shapes = write_checkpoint(folder, args.gb, args.shards)
        targets = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in shapes.items()}
        size = sum(t.numel() * t.element_size() for t in targets.values()) / 2**30
        print(f"{size:.2f} GiB in {args.shards} shards, {len(targets)} tensors; {os.cpu_count()} CPUs")
        results = {}
        for _ in range(args.reps):  # interleaved, so that a busy machine hurts every setting alike
            for threads in args.threads:
                results.setdefault(threads, []).append(load_seconds(folder, targets, threads))
        base = min(results[args.threads[0]])
        for threads, times in results.items():
            best = min(times)
            print(
                f"threads {threads}: best {best:.2f} s ({size / best:.2f} GiB/s), "
                f"{base / best:.2f}x of {args.threads[0]}; runs {' '.join(f'{t:.2f}' for t in times)}"
            )
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
