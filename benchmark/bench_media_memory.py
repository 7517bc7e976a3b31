"""Peak memory of N requests' videos decoding at once in one process, without and with the process's
media memory budget (`media_pool.MediaMemory`, SGLANG_MEDIA_MEMORY_MB): each run is a fresh process that
sends N requests of one H.264 video each through the processor (`attach_media`) at once, on a media pool
of --threads threads (a server has min(4, cores)), with Qwen3.5's bounds (per frame 4 x its 4096^2
max_pixels, 2^30 pixels a request) and transformers' Qwen3-VL video defaults, and prints the peak RSS
over the process's RSS before (sampled every 10 ms) and the wall time.

    python benchmark/bench_media_memory.py                       # 4 x 4096^2, 16 reference frames
    python benchmark/bench_media_memory.py --side 8192 --clients 2

The video: 24 frames of side x side at 24 fps (4 sampled), only a corner changing, encoded with 16
reference frames (the most H.264 allows; the decoder keeps them all: ~51 bytes a pixel at its peak).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time


def make_video(path: str, side: int, frames: int, refs: int) -> None:
    import av
    import numpy as np

    with av.open(path, "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = side, side, "yuv420p"
        s.options = {"preset": "ultrafast", "x264-params": f"ref={refs}:bframes=0"}
        base = np.zeros((side, side, 3), np.uint8)
        for i in range(frames):
            base[:16, :16] = i * 10 % 255
            for p in s.encode(av.VideoFrame.from_ndarray(base, format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def one_run(path: str, clients: int, threads: int, budget_mb: int) -> None:
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as D

    from sglang.srt.multimodal import media_pool
    from sglang.srt.multimodal.media_io import PixelBudget
    from sglang.srt.multimodal.processor import ImageInputProcessor, attach_media
    from sglang.srt.multimodal.video import VideoConfig

    media_pool._pool = ThreadPoolExecutor(threads, thread_name_prefix=media_pool.THREAD_PREFIX)
    media_pool._memory = media_pool.MediaMemory((budget_mb << 20) if budget_mb else 1 << 62)
    config = VideoConfig(
        D.patch_size, D.temporal_patch_size, D.merge_size, D.size["shortest_edge"], D.size["longest_edge"],
        tuple(D.image_mean), tuple(D.image_std), D.fps, D.min_frames, D.max_frames,
    )
    p = object.__new__(ImageInputProcessor)
    p.merge, p.vocab_size, p.max_pixels, p.pixels_per_token = 2, 1000, 1 << 24, 1024  # Qwen3.5's
    p.video, p.video_token_id, p.frame_open, p.frame_close = config, 9, [5], [6]
    p.video_refusal, p.image_token_id = None, 7
    p.tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [3])
    p.pixel_budget = lambda context_len: PixelBudget.for_model(1 << 24, 262144, 1024)
    limits = SimpleNamespace(context_len=262144, max_req_input_len=262144)
    with open(path, "rb") as f:
        data = f.read()
    base, peak, stop = rss(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.01)

    async def all_clients() -> None:
        reqs = [[SimpleNamespace(prompt=0, req=SimpleNamespace(input_ids=[1, 9, 2]))] for _ in range(clients)]
        # one bytes object per request, as each request's body holds its own
        await asyncio.gather(*(attach_media(p, r, None, bytes(data), limits, False) for r in reqs))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.time()
    asyncio.run(all_clients())
    wall = time.time() - start
    stop.set()
    sampler.join()
    label = f"budget {budget_mb} MiB" if budget_mb else "no budget"
    print(
        f"{clients} requests x 1 video, {threads} media threads, {label}: "
        f"peak RSS +{(peak[0] - base) >> 20} MB "
        f"over {base >> 20} MB, {wall:.2f} s (media memory peak reserved "
        f"{media_pool._memory.peak >> 20} MB)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--side", type=int, default=4096)
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--refs", type=int, default=16)
    parser.add_argument("--memory-mb", type=int, default=2048, help="the budget of the second run")
    parser.add_argument("--one", nargs=2, metavar=("VIDEO", "BUDGET_MB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_run(args.one[0], args.clients, args.threads, int(args.one[1]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "video.mp4")
        make_video(path, args.side, args.frames, args.refs)
        size = os.path.getsize(path)
        print(f"video: {args.frames} frames of {args.side}x{args.side}, {size} bytes", flush=True)
        for budget in (0, args.memory_mb):
            cmd = [sys.executable, __file__, "--clients", str(args.clients), "--threads", str(args.threads)]
            subprocess.run(cmd + ["--one", path, str(budget)], check=True)


if __name__ == "__main__":
    main()
