"""What other clients' images and videos do to one client's small image: each case has N clients post K
images (or videos) each and leave after a few seconds (their requests' timeout), then times one request
with a 64x64 image (the victim), and prints the clients' statuses, the victim's seconds and, with --pid,
the server process's peak and final RSS (sampled every 0.2 s from /proc) and the CPU seconds it spent in
the case, counted until it is idle again (a request whose client left may still run).

    python -m sglang.launch_server --model-path tiny-qwen3.5-vl --port 30000 &
    python benchmark/bench_media_bounds.py --url http://127.0.0.1:30000 --pid $!
    python benchmark/bench_media_bounds.py --url http://127.0.0.1:30000 --cases photo

The cases: the security review's repro (2026-11-29, failure 2: 6 clients x 6 1-bit 8192x8192 PNGs of
11 KB, leaving after 2 s), the same at 4096x4096 (within tiny-qwen3.5-vl's per-image bound; each
request's second image is over its per-request total), 6 clients x one 4096x4096 image leaving after 0.5 s,
and one 4032x3024 JPEG photo alone (the time of a real photo's request).

Video cases (security review S2, 2026-11-29; H.264 made here with PyAV, needs av and libx264):
- video_refs16: 6 clients x a video of 24 frames of 2048x2048 (4 sampled fill tiny-qwen3.5-vl's 2^24
  pixels a request), encoded with 16 reference frames (the decoder holds ~215 MB while it decodes one),
  leaving after 30 s;
- video_tiny_frames: one client sends an mkv of 45,000 frames of 16x16 (~0.7 MB; within the body limit).
--video-dir DIR (the server's --allowed-local-media-path) adds two cases read by path from files there:
video_tiny_frames_file (300,000 such frames, 4.6 MB) and video_leave_file (480 frames of 2048x2048 noise
moving a little, 33 MB, ~2.5 s of decoding; its client leaves after 0.5 s); video_leave_file_6: six such
clients at once.
SGLANG_MEDIA_MEMORY_MB on the server bounds the decoded bytes in flight (default 2048).
"""

from __future__ import annotations

import argparse
import base64
import functools
import io
import os
import threading
import time

import requests
from PIL import Image

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def png_1bit(side: int) -> str:
    buf = io.BytesIO()
    Image.new("1", (side, side), 0).save(buf, "PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode()


def photo_jpeg(width: int, height: int) -> str:
    """A smooth gradient (a photo-like JPEG: most of its bytes are not one colour)."""
    gradient = Image.linear_gradient("L").resize((width, height))
    image = Image.merge("RGB", (gradient, gradient.transpose(Image.Transpose.ROTATE_180), gradient))
    buf = io.BytesIO()
    image.convert("RGB").save(buf, "JPEG", quality=90)
    return base64.b64encode(buf.getvalue()).decode()


@functools.cache
def h264(side: int, frames: int, container: str = "mp4", refs: int = 1, rate: int = 24) -> bytes:
    """An H.264 video of `frames` frames of side x side, only a corner changing (P-frames of a few bytes)."""
    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        s = out.add_stream("libx264", rate=rate)
        s.width, s.height, s.pix_fmt = side, side, "yuv420p"
        s.options = {"preset": "ultrafast", "x264-params": f"ref={refs}:bframes=0"}
        base = np.zeros((side, side, 3), np.uint8)
        for i in range(frames):
            base[:8, :8] = i % 255
            for p in s.encode(av.VideoFrame.from_ndarray(base, format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def rolling_noise_file(video_dir: str) -> str:
    """480 frames of 2048x2048 blocky noise moving 3 pixels a frame, at 240 fps (2 s: 4 frames sampled,
    all decoded; ~2.5 s of one core), 33 MB."""
    import av
    import numpy as np

    path = os.path.join(video_dir, "rolling_noise_480.mp4")
    if os.path.exists(path):
        return path
    side = 2048
    noise = np.random.default_rng(0).integers(0, 256, (side // 8, side // 8, 3), dtype=np.uint8)
    noise = noise.repeat(8, 0).repeat(8, 1)
    with av.open(path, "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=240)
        s.width, s.height, s.pix_fmt = side, side, "yuv420p"
        s.options = {"preset": "ultrafast", "crf": "35"}
        for i in range(480):
            frame = av.VideoFrame.from_ndarray(np.roll(noise, 3 * i, axis=1), format="rgb24")
            for p in s.encode(frame):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return path


def tiny_frames_file(video_dir: str) -> str:
    path = os.path.join(video_dir, "tiny_frames_300000.mkv")
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(h264(16, 300000, "matroska"))
    return path


CASES = {  # name: (clients, items each, item maker, seconds before the clients leave, field)
    "review_8192": (6, 6, lambda: png_1bit(8192), 2.0, "image_data"),
    "within_4096": (6, 6, lambda: png_1bit(4096), 2.0, "image_data"),
    "within_4096_one": (6, 1, lambda: png_1bit(4096), 0.5, "image_data"),
    "photo": (1, 1, lambda: photo_jpeg(4032, 3024), 600.0, "image_data"),
    "video_refs16": (6, 1, lambda: b64(h264(2048, 24, refs=16)), 30.0, "video_data"),
    "video_tiny_frames": (1, 1, lambda: b64(h264(16, 45000, "matroska")), 600.0, "video_data"),
}
VIDEO_DIR_CASES = {
    "video_tiny_frames_file": (1, 1, tiny_frames_file, 600.0, "video_data"),
    "video_leave_file": (1, 1, rolling_noise_file, 0.5, "video_data"),
    "video_leave_file_6": (6, 1, rolling_noise_file, 0.5, "video_data"),
}
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"


def body(items: list[str], field: str = "image_data") -> dict:
    text = (PLACEHOLDER if field == "image_data" else VIDEO_PLACEHOLDER) * len(items) + "describe"
    return {"text": text, field: items, "sampling_params": {"max_new_tokens": 4}}


class Rss:
    """Peak VmRSS (MB) of `pid` while running, and its CPU seconds (`cpu`)."""

    def __init__(self, pid: int | None):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        if pid is not None:
            threading.Thread(target=self._run, daemon=True).start()

    def now(self) -> int:
        if self.pid is None:
            return 0
        with open(f"/proc/{self.pid}/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))

    def cpu(self) -> float:
        if self.pid is None:
            return 0.0
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def idle(self, quiet_s: float = 1.0, timeout_s: float = 120.0) -> None:
        """Wait until the process spends under 10% of a core for `quiet_s`."""
        end, last = time.time() + timeout_s, self.cpu()
        while time.time() < end:
            time.sleep(quiet_s)
            now = self.cpu()
            if now - last < 0.1 * quiet_s:
                return
            last = now

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()


def run_case(url: str, name: str, rss: Rss, video_dir: str | None = None) -> None:
    clients, each, make, leave_s, field = {**CASES, **VIDEO_DIR_CASES}[name]
    image = make(video_dir) if name in VIDEO_DIR_CASES else make()
    small = base64.b64encode(_png_rgb(64)).decode()
    rss.idle()
    rss.peak, cpu0 = rss.now(), rss.cpu()
    statuses: list = []
    lock = threading.Lock()

    def client() -> None:
        try:
            r = requests.post(url + "/generate", json=body([image] * each, field), timeout=leave_s)
            status = r.status_code if r.ok else f"{r.status_code}: {r.text[:100]}"
        except requests.RequestException:
            status = "left"
        with lock:
            statuses.append(status)

    start = time.time()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clients_s = time.time() - start
    start = time.time()
    r = requests.post(url + "/generate", json=body([small]), timeout=900)
    victim_s = time.time() - start
    rss.idle()
    kb = (os.path.getsize(image) if name in VIDEO_DIR_CASES else len(image) * 3 // 4) // 1024
    print(
        f"{name}: {clients} x {each} {field} items ({kb} KB each): {sorted(map(str, statuses))} "
        f"in {clients_s:.2f} s; "
        f"then a 64x64 image: {r.status_code} in {victim_s:.2f} s; "
        f"RSS peak {rss.peak} MB, now {rss.now()} MB; server CPU {rss.cpu() - cpu0:.1f} s",
        flush=True,
    )


def _png_rgb(side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (0, 255, 0)).save(buf, "PNG")
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--pid", type=int, default=None, help="the server process (its RSS is sampled)")
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--video-dir", default=None, help="the server's --allowed-local-media-path")
    args = parser.parse_args()
    if args.video_dir is not None and args.cases == list(CASES):
        args.cases += list(VIDEO_DIR_CASES)
    rss = Rss(args.pid)
    time.sleep(0.5)
    small = base64.b64encode(_png_rgb(64)).decode()
    start = time.time()
    r = requests.post(args.url + "/generate", json=body([small]), timeout=60)
    alone = time.time() - start
    print(f"a 64x64 image alone: {r.status_code} in {alone:.2f} s; RSS {rss.now()} MB", flush=True)
    for name in args.cases:
        run_case(args.url, name, rss, args.video_dir)
    rss.stop()


if __name__ == "__main__":
    main()
