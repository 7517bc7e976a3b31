"""The decoded bytes media items hold at once are bounded for the process (`media_pool.MediaMemory`):
before, the media threads could hold MEDIA_THREADS x the largest item at once (a 200 KB H.264 file of
8192x8192 frames with 16 reference frames held ~2.9 GB while it decoded, on each thread).
- an item waits, without a thread, until its bytes fit beside the running items', first come first
  served among large items; small ones pass a large waiter within a reserved slice of the budget; one
  over the budget is charged the budget less that slice; a waiter whose client leaves holds nothing;
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

register_cpu_ci(est_time=8, suite="per-commit-cpu")


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


def test_large_waiters_are_admitted_in_order_and_small_ones_pass_them_within_the_reserved_slice():
    """Large items (over limit / 32) keep their order; a small one passes a large waiter, and runs beside
    an item over the budget (charged as limit - limit / 8): before, a bystander's 64x64 image waited
    5.6 s behind a 200 KB video of 8192x8192 frames that waited for the budget to empty and ran alone."""

    async def scenario():
        m, order = MediaMemory(100), []  # small: up to 3; reserved slice 12; an item charges at most 88

        async def take(name: str, n: int, hold_s: float):
            await m.acquire(n)
            order.append((name, m.used))
            await asyncio.sleep(hold_s)
            m.release(n)

        a = asyncio.create_task(take("a", 60, 0.05))
        await asyncio.sleep(0.01)
        b = asyncio.create_task(take("b", 60, 0.05))  # does not fit beside a: waits
        await asyncio.sleep(0.01)
        c = asyncio.create_task(take("c", 3, 0.0))  # small: passes b
        await asyncio.sleep(0.01)
        big = asyncio.create_task(take("big", 500, 0.1))  # over the budget: after b, charged 88
        await asyncio.sleep(0.01)
        d = asyncio.create_task(take("d", 20, 0.0))  # large, fits beside a but not past b and big
        while not any(name == "big" for name, _ in order):
            await asyncio.sleep(0.005)
        e = asyncio.create_task(take("e", 3, 0.0))  # small: runs beside big
        await asyncio.gather(a, b, c, big, d, e)
        return order, m.used, m.peak

    order, used, peak = asyncio.run(scenario())
    assert order == [("a", 60), ("c", 63), ("b", 60), ("big", 88), ("e", 91), ("d", 20)], order
    assert used == 0 and peak == 91


def test_small_items_pass_a_large_waiter_only_within_the_reserved_slice():
    """Small items past a large waiter take the reserved slice (limit / 8) and no more, so they cannot
    starve it: it is admitted as soon as the large item ahead leaves, before the small one that waited."""

    async def scenario():
        m = MediaMemory(3200)  # small: up to 100; the reserved slice: 400
        await m.acquire(2000)
        large = asyncio.create_task(m.acquire(2000))  # 4000 > 3200 - 400: waits
        await asyncio.sleep(0.01)
        for _ in range(4):
            await asyncio.wait_for(m.acquire(100), 1)  # past it, within the slice
        assert m.used == 2400 and not large.done()
        fifth = asyncio.create_task(m.acquire(100))  # the slice is full: waits too (room is left)
        await asyncio.sleep(0.01)
        assert not fifth.done() and m.used == 2400
        m.release(2000)
        await asyncio.wait_for(asyncio.gather(large, fifth), 1)
        return m.used

    assert asyncio.run(scenario()) == 2000 + 5 * 100


def test_a_waiter_granted_then_cancelled_gives_its_bytes_back():
    """Bytes released to a waiter (its grant scheduled on its loop) that is cancelled before the grant
    runs are given back (without: held forever)."""

    async def scenario():
        m = MediaMemory(100)
        await m.acquire(100)
        waiter = asyncio.create_task(m.acquire(50))
        await asyncio.sleep(0.01)
        assert len(m._waiters) == 1
        m.release(100)  # grants the waiter, counting its 50 as held
        waiter.cancel()  # ... cancelled before the grant runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return m.used, len(m._waiters)

    assert asyncio.run(scenario()) == (0, 0)


def test_a_cancelled_head_waiter_lets_the_next_one_in():
    """The head of the queue leaving admits the waiter behind it that fits (without: it waited for the
    running item to end)."""

    async def scenario():
        m = MediaMemory(100)
        await m.acquire(60)
        head = asyncio.create_task(m.acquire(60))  # does not fit beside 60
        await asyncio.sleep(0.01)
        behind = asyncio.create_task(m.acquire(20))  # fits, but waits behind head
        await asyncio.sleep(0.01)
        assert not behind.done()
        head.cancel()
        await asyncio.wait_for(behind, 0.2)
        return m.used, len(m._waiters)

    assert asyncio.run(scenario()) == (80, 0)


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
    # one video over the budget less its reserved slice: charged that
    assert most[0] == 1 and memory.peak == memory.charge(need) == need - need // 8 and memory.used == 0
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
    m._take(100)
    closed = asyncio.new_event_loop()
    closed.close()
    m._waiters.append([50, None, closed, False])
    m.release(100)
    assert m.used == 0 and not m._waiters


def test_a_cancelled_waiter_already_gone_from_the_queue_is_cancelled_cleanly():
    """A waiter skipped from the queue without a grant (its loop closing as the process ends) and then
    cancelled raises its cancellation, not ValueError from removing it again."""

    async def scenario():
        m = MediaMemory(100)
        await m.acquire(100)
        waiter = asyncio.create_task(m.acquire(50))
        await asyncio.sleep(0.01)
        m._waiters.clear()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return m.used

    assert asyncio.run(scenario()) == 88  # the first item's charge (100 less the reserved 12), still held


def test_a_video_files_estimate_reserves_its_probe_frame(pool):
    """A video file's estimate (video.video_bytes) opens it, and FFmpeg decodes a frame to probe it (+155
    MB for an 8192x8192 one): it runs with the per-frame bound's probe reserved (video.probe_bytes), not
    outside the budget (without: nothing held while it ran). A list of frames reads a header: nothing."""
    from types import SimpleNamespace

    from test.unit.multimodal.test_video_files import CONFIG, static_h264

    from sglang.srt.multimodal.media_io import PixelBudget
    from sglang.srt.multimodal.processor import ImageInputProcessor, attach_media

    memory = pool(1 << 34)
    held, estimate = [], video.video_bytes

    def watched(*args, **kwargs):
        held.append(memory.used)
        return estimate(*args, **kwargs)

    p = object.__new__(ImageInputProcessor)
    p.merge, p.vocab_size, p.max_pixels, p.pixels_per_token = 2, 100, 16384, 256
    p.video, p.video_token_id, p.frame_open, p.frame_close = CONFIG, 9, [5], [6]
    p.video_refusal, p.image_token_id = None, 7
    p.tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [3])
    p.pixel_budget = lambda context_len: PixelBudget(per_item=64 * 64)
    limits = SimpleNamespace(context_len=100000, max_req_input_len=100000)
    reqs = [SimpleNamespace(prompt=0, req=SimpleNamespace(input_ids=[1, 9, 2]))]
    video.video_bytes = watched
    try:
        asyncio.run(attach_media(p, reqs, None, static_h264(64, 64, 8, "mp4"), limits, False))
    finally:
        video.video_bytes = estimate
    assert video.probe_bytes([b"frame"], PixelBudget(per_item=64 * 64)) == 0
    assert held == [64 * 64 * video.PROBE_BYTES_PER_PIXEL] and memory.used == 0, held
