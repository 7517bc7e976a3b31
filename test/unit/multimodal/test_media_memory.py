"""The decoded bytes media items hold at once are bounded for the process (`media_pool.MediaMemory`):
before, the media threads could hold MEDIA_THREADS x the largest item at once (a 200 KB H.264 file of
8192x8192 frames with 16 reference frames held ~2.9 GB while it decoded, on each thread).
- an item waits, without a thread, until its bytes fit beside the running items', first come first
  served; one over the whole budget runs alone; a waiter whose client leaves holds nothing;
- a running item gives its bytes back when it ends, also when its client left meanwhile;
- the processor reserves each video's and image's estimate (from its header) before decoding it, so
  videos of two requests with room for one decode one after the other, and both are answered."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang.srt.multimodal import media_pool, video
from sglang.srt.multimodal.media_pool import MediaCancelled, MediaJob, MediaMemory
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")


@pytest.fixture
def pool(monkeypatch):
    """Four media threads (more than one item could run at once) and a fresh budget per test."""
    threads = ThreadPoolExecutor(4, thread_name_prefix=media_pool.THREAD_PREFIX)
    monkeypatch.setattr(media_pool, "_pool", threads)

    def budget(limit: int) -> MediaMemory:
        memory = MediaMemory(limit)
        monkeypatch.setattr(media_pool, "_memory", memory)
        return memory

    yield budget
    threads.shutdown()


def test_waiters_are_admitted_in_order_and_an_oversized_one_alone():
    async def scenario():
        m, order = MediaMemory(100), []

        async def take(name: str, n: int, hold_s: float):
            await m.acquire(n)
            order.append((name, m.used))
            await asyncio.sleep(hold_s)
            m.release(n)

        a = asyncio.create_task(take("a", 60, 0.05))
        await asyncio.sleep(0.01)
        # b does not fit beside a; c would, but waits behind b (first come first served)
        b = asyncio.create_task(take("b", 60, 0.05))
        await asyncio.sleep(0.01)
        c = asyncio.create_task(take("c", 10, 0.0))
        await asyncio.sleep(0.01)
        big = asyncio.create_task(take("big", 500, 0.0))  # over the whole budget: alone
        await asyncio.gather(a, b, c, big)
        return order, m.used, m.peak

    order, used, peak = asyncio.run(scenario())
    # c fitted beside a but waited behind b; both are admitted when a leaves; big waits for them to end.
    assert order == [("a", 60), ("b", 70), ("c", 70), ("big", 500)], order
    assert used == 0 and peak == 500


def test_a_waiter_whose_client_leaves_holds_nothing(pool):
    memory = pool(100)

    class Client:
        gone = False

        async def is_disconnected(self) -> bool:
            return self.gone

    async def scenario():
        started = threading.Event()
        release = threading.Event()

        def long_item():
            started.set()
            release.wait(5)

        first = asyncio.create_task(MediaJob().run(long_item, reserve=80))
        while not started.is_set():
            await asyncio.sleep(0.005)
        client = Client()
        waiting = asyncio.create_task(MediaJob(client).run(lambda: None, reserve=80))
        await asyncio.sleep(0.05)
        assert memory.used == 80 and len(memory._waiters) == 1
        client.gone = True
        with pytest.raises(MediaCancelled):
            await waiting  # within POLL_S of the client leaving
        assert memory.used == 80 and not memory._waiters
        release.set()
        await first

    asyncio.run(scenario())
    assert memory.used == 0


def test_a_running_item_gives_its_bytes_back_when_it_ends_after_its_client_left(pool):
    memory = pool(100)

    class Client:
        gone = False

        async def is_disconnected(self) -> bool:
            return self.gone

    async def scenario():
        client, ended = Client(), threading.Event()

        def item():
            client.gone = True
            time.sleep(0.7)  # past the job's next poll: the job ends while this still runs
            ended.set()

        with pytest.raises(MediaCancelled):
            await MediaJob(client).run(item, reserve=70)
        assert memory.used == 70 and not ended.is_set()  # still held by the running item
        while not ended.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert memory.used == 0


def test_two_requests_videos_decode_one_after_the_other_with_room_for_one(pool):
    """Through the processor: each request's video reserves its estimate (video.video_bytes) before it
    decodes; with a budget of one video, the two requests' videos never decode at the same time (without
    the budget they did, on two of the four threads), and both are answered."""
    from types import SimpleNamespace

    from test.unit.multimodal.test_video_files import CONFIG, static_h264

    from sglang.srt.multimodal.media_io import PixelBudget
    from sglang.srt.multimodal.processor import ImageInputProcessor, attach_media

    clip = static_h264(64, 64, 24, "mp4")
    need = video.video_bytes(clip, CONFIG, PixelBudget())
    # its frame size's decode, and its 4 sampled frames resized (at most their full size: under max_pixels)
    assert need == 64 * 64 * (video.VIDEO_BYTES_PER_PIXEL + 4 * video.RESIZED_BYTES_PER_PIXEL)
    memory = pool(need)
    running, most = [0], [0]
    lock = threading.Lock()
    load = video.load_video

    def counted(*args, **kwargs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.1)
            return load(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    p = object.__new__(ImageInputProcessor)
    p.merge, p.vocab_size, p.max_pixels, p.pixels_per_token = 2, 100, 16384, 256
    p.video, p.video_token_id, p.frame_open, p.frame_close = CONFIG, 9, [5], [6]
    p.video_refusal, p.image_token_id = None, 7
    p.tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [3])
    limits = SimpleNamespace(context_len=100000, max_req_input_len=100000)

    async def both():
        reqs = [[SimpleNamespace(prompt=0, req=SimpleNamespace(input_ids=[1, 9, 2]))] for _ in range(2)]
        await asyncio.gather(*(attach_media(p, r, None, clip, limits, False) for r in reqs))
        return reqs

    video.load_video = counted
    try:
        reqs = asyncio.run(both())
    finally:
        video.load_video = load
    assert most[0] == 1 and memory.peak == need and memory.used == 0
    assert all(r[0].req.mm_inputs is not None for r in reqs)


def test_the_budget_comes_from_its_environment_variable_and_a_bad_value_stops_the_start(monkeypatch):
    from sglang.srt.environ import envs
    from sglang.srt.server_args import ServerArgs, ServerArgsError

    with envs.SGLANG_MEDIA_MEMORY_MB.override(512):
        assert media_pool.memory_limit() == 512 << 20
    assert media_pool.memory_limit() == 2048 << 20
    for bad in ("0", "-3", "two"):
        monkeypatch.setenv("SGLANG_MEDIA_MEMORY_MB", bad)
        with pytest.raises(ValueError, match="SGLANG_MEDIA_MEMORY_MB"):
            media_pool.memory_limit()
        with pytest.raises(ServerArgsError, match="^[^\n]*SGLANG_MEDIA_MEMORY_MB[^\n]*$"):
            ServerArgs(model_path="tiny-qwen3-next")


def test_a_waiter_on_a_closed_event_loop_is_skipped():
    """Bytes released in a media thread after a waiter's event loop closed (the process ending) skip it
    instead of raising in that thread (which would replace the item's result) and holding its bytes."""
    m = MediaMemory(100)
    m.used = 100
    closed = asyncio.new_event_loop()
    closed.close()
    m._waiters.append([50, None, closed, False])
    m.release(100)
    assert m.used == 0 and not m._waiters
