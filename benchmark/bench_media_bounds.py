"""What other clients' images do to one client's small image: each case has N clients post K images each
and leave after a few seconds (their requests' timeout), then times one request with a 64x64 image (the
victim), and prints the clients' statuses, the victim's seconds and, with --pid, the server process's peak
and final RSS (sampled every 0.2 s from /proc).

    python -m sglang.launch_server --model-path tiny-qwen3.5-vl --port 30000 &
    python benchmark/bench_media_bounds.py --url http://127.0.0.1:30000 --pid $!
    python benchmark/bench_media_bounds.py --url http://127.0.0.1:30000 --cases photo

The cases: the security review's repro (2026-11-29, failure 2: 6 clients x 6 1-bit 8192x8192 PNGs of
11 KB, leaving after 2 s), the same at 4096x4096 (within tiny-qwen3.5-vl's per-image bound; each
request's second image is over its per-request total), 6 clients x one 4096x4096 image leaving after 0.5 s,
and one 4032x3024 JPEG photo alone (the time of a real photo's request).
"""

from __future__ import annotations

import argparse
import base64
import io
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


CASES = {  # name: (clients, images each, image maker, seconds before the clients leave)
    "review_8192": (6, 6, lambda: png_1bit(8192), 2.0),
    "within_4096": (6, 6, lambda: png_1bit(4096), 2.0),
    "within_4096_one": (6, 1, lambda: png_1bit(4096), 0.5),
    "photo": (1, 1, lambda: photo_jpeg(4032, 3024), 600.0),
}


def body(images: list[str]) -> dict:
    text = PLACEHOLDER * len(images) + "describe"
    return {"text": text, "image_data": images, "sampling_params": {"max_new_tokens": 4}}


class Rss:
    """Peak VmRSS (MB) of `pid` while running."""

    def __init__(self, pid: int | None):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        if pid is not None:
            threading.Thread(target=self._run, daemon=True).start()

    def now(self) -> int:
        if self.pid is None:
            return 0
        with open(f"/proc/{self.pid}/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()


def run_case(url: str, name: str, rss: Rss) -> None:
    clients, each, make, leave_s = CASES[name]
    image = make()
    small = base64.b64encode(_png_rgb(64)).decode()
    statuses: list = []
    lock = threading.Lock()

    def client() -> None:
        try:
            status = requests.post(url + "/generate", json=body([image] * each), timeout=leave_s).status_code
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
    kb = len(image) * 3 // 4 // 1024
    print(
        f"{name}: {clients} x {each} images ({kb} KB each): {sorted(map(str, statuses))} "
        f"in {clients_s:.2f} s; "
        f"then a 64x64 image: {r.status_code} in {victim_s:.2f} s; "
        f"RSS peak {rss.peak} MB, now {rss.now()} MB",
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
    args = parser.parse_args()
    rss = Rss(args.pid)
    time.sleep(0.5)
    small = base64.b64encode(_png_rgb(64)).decode()
    start = time.time()
    r = requests.post(args.url + "/generate", json=body([small]), timeout=60)
    alone = time.time() - start
    print(f"a 64x64 image alone: {r.status_code} in {alone:.2f} s; RSS {rss.now()} MB", flush=True)
    for name in args.cases:
        run_case(args.url, name, rss)
    rss.stop()


if __name__ == "__main__":
    main()
