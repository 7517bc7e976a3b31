"""An image costs what the model can use, not what its header claims (the security review of
2026-11-29, failure 2: an 11 KB 1-bit 8192x8192 PNG took 2.6 s of CPU and ~200 MB; six clients that
posted six each and left held a 64x64 image of another client back 61-92 s):
- an image whose header is over the per-image bound (4 x the processor's max_pixels, at least a 16 MP
  photo) is refused naming `image_data`, from its header, before any pixel is decoded; a 12 MP phone
  photo is still decoded whole; a JPEG over the bound is decoded at a reduced DCT scale instead;
- a video file's frame size is held to the same bound before decoding;
- media work runs in its own pool, one item of a request at a time (requests take turns), and a request
  whose client left stops before its next item (the tokenizer manager ends it as ClientDisconnected);
- the processor gets each image already at the size it resizes to, and gives the same pixels.
Images are made here, at most 6000x4000 of one colour (milliseconds to encode), or are headers only."""

from __future__ import annotations

import asyncio
import io
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.request_error import RequestError
from sglang.srt.multimodal import media_pool, video
from sglang.srt.multimodal.media_io import PixelBudget, load_image
from sglang.srt.multimodal.media_pool import MediaCancelled, MediaJob
from sglang.srt.multimodal.processor import ImageInputProcessor, _presize_settings, attach_media
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

# The tiny-qwen3.5-vl preset's processor: max_pixels 16384 (128x128), patch 8 x merge 2 = 256 pixels a
# token, context 4,096 tokens.
TINY = dict(max_pixels=16384, context_len=4096, pixels_per_token=256)


def png_header(width: int, height: int) -> bytes:
    """A PNG that says width x height (1-bit grey) and holds a few bytes of pixel data: opening it reads
    the size; decoding it would fail (or take seconds, were the data whole)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


def jpeg(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 120, 200)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def decodes(monkeypatch):
    """The sizes of the images whose pixels were decoded (PIL's ImageFile.load), whatever the format."""
    from PIL import ImageFile

    loaded = set()
    load = ImageFile.ImageFile.load

    def counted(self):
        loaded.add(self.size)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    return loaded


def test_bounds_follow_the_checkpoint():
    tiny = PixelBudget.for_model(**TINY)
    assert (tiny.per_item, tiny.limit) == (1 << 24, 1 << 24)  # the photo floor; 4 x 4096 x 256 is less
    # Qwen3.5 / Qwen3-VL: max_pixels 4096x4096 (16,777,216), 32x32 pixels a token, 262,144 tokens.
    real = PixelBudget.for_model(1 << 24, 262144, 1024)
    assert (real.per_item, real.limit) == (1 << 26, 1 << 30)


def test_an_image_over_the_bound_is_refused_from_its_header(decodes):
    """Before: 8192x8192 was within the bound (2^26) whatever the model, and was decoded."""
    start = time.monotonic()
    with pytest.raises(RequestError) as e:
        load_image(png_header(8192, 8192), "image_data[2]", PixelBudget.for_model(**TINY), 16384)
    assert e.value.param == "image_data"
    assert "image_data[2] is 8192x8192 pixels (67108864), over the 16777216" in e.value.message
    assert not decodes
    assert time.monotonic() - start < 0.5  # a header read: milliseconds (0.5 s: a loaded CI machine)


def test_a_phone_photo_is_decoded_whole_and_a_larger_jpeg_at_a_reduced_scale(decodes):
    pixels = PixelBudget(1 << 30, PixelBudget.for_model(**TINY).per_item)
    # 12 MP: within the bound, decoded at full size for the processor to resize as before.
    assert load_image(jpeg(4032, 3024), "image_data[0]", pixels, 16384).size == (4032, 3024)
    # 24 MP: over the bound; decoded at 1/8 scale, still above the 128x128 the processor resizes to.
    assert load_image(jpeg(6000, 4000), "image_data[1]", pixels, 16384).size == (750, 500)
    assert pixels.limit - pixels.left == 4032 * 3024 + 750 * 500  # charged what was decoded
    # A PNG cannot be decoded at a lower scale: refused.
    with pytest.raises(RequestError, match="6000x4000 pixels"):
        load_image(png_header(6000, 4000), "image_data[2]", pixels, 16384)
    assert decodes == {(4032, 3024), (750, 500)}


def test_a_video_files_frame_size_is_held_to_the_bound_before_decoding():
    """Before: a video's frames were held to MAX_IMAGE_PIXELS (2^26) whatever the model."""
    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt, s.options = 64, 64, "yuv420p", {"preset": "ultrafast"}
        for _ in range(2):
            out.mux(s.encode(av.VideoFrame.from_ndarray(np.zeros((64, 64, 3), np.uint8), format="rgb24")))
        out.mux(s.encode())
    config = video.VideoConfig(16, 2, 2, 64, 1 << 20, (0.5,) * 3, (0.5,) * 3, 2.0, 4, 768)
    with pytest.raises(RequestError) as e:
        video.load_video(buf.getvalue(), "video_data[0]", config, PixelBudget(1 << 30, 64 * 63))
    assert e.value.param == "video_data" and "64x64 frames (4096 pixels), over the 4032" in e.value.message


def fake_processor(calls: list, on_call=None) -> ImageInputProcessor:
    """An ImageInputProcessor whose image processor records (thread name) and returns 4 patches."""

    def image_processor(images, return_tensors):
        calls.append(threading.current_thread().name)
        if on_call is not None:
            on_call()
        return {"pixel_values": torch.rand(4, 8), "image_grid_thw": torch.tensor([[1, 2, 2]])}

    p = object.__new__(ImageInputProcessor)
    p.image_processor, p.image_token_id, p.merge, p.vocab_size = image_processor, 7, 2, 100
    p.video, p.video_refusal, p.max_pixels, p.pixels_per_token = None, "no video", 16384, 256
    return p


def one_prompt(n: int) -> list:
    return [SimpleNamespace(prompt=0, req=SimpleNamespace(input_ids=[1] + [7] * n + [2]))]


PNG = jpeg(8, 8)


def images(n: int) -> list[bytes]:
    """n distinct items (one item object given twice is processed once)."""
    return [jpeg(8, 8) for _ in range(n)]
LIMITS = SimpleNamespace(context_len=1000, max_req_input_len=1000)


def test_media_runs_in_its_own_pool_and_stops_when_the_client_leaves():
    """Before: all of a request's items ran in one call on the loop's default executor (threads
    'asyncio_N'), to the end whether or not the client was still there."""

    class Client:
        gone = False

        async def is_disconnected(self) -> bool:
            return self.gone

    calls, client = [], Client()
    p = fake_processor(calls, on_call=lambda: setattr(client, "gone", True))  # leaves during item 0
    with pytest.raises(MediaCancelled):
        asyncio.run(attach_media(p, one_prompt(4), images(4), None, LIMITS, False, MediaJob(client)))
    assert len(calls) == 1, calls  # items 1-3 never started
    assert calls[0].startswith(media_pool.THREAD_PREFIX), calls


def test_requests_take_turns_in_the_pool(monkeypatch):
    """With one media thread, a 1-image request that arrives while an 8-image request runs waits for at
    most that request's running and next item, not all 8 (before: one executor call for all 8)."""
    monkeypatch.setattr(media_pool, "_pool", ThreadPoolExecutor(1, thread_name_prefix="media-decode"))
    calls: list = []
    big = fake_processor(calls, on_call=lambda: time.sleep(0.03))

    async def both():
        first = asyncio.create_task(attach_media(big, one_prompt(8), images(8), None, LIMITS, False))
        while not calls:
            await asyncio.sleep(0.005)
        small = fake_processor([])
        await attach_media(small, one_prompt(1), PNG, None, LIMITS, False)
        done_before = len(calls)
        await first
        return done_before

    try:
        done_before = asyncio.run(both())
        assert done_before <= 3 and len(calls) == 8, (done_before, calls)
    finally:
        media_pool._pool.shutdown()


def test_an_image_is_resized_before_the_processor_to_the_same_pixels():
    """The processor gets the image at the size it resizes to (PIL bicubic to smart_resize's size, as
    transformers' PIL Qwen2-VL processor does), and gives bit-for-bit what it gives for the full image
    (before: the processor copied the full-size image, 0.70 s of 0.85 s for a 4032x3024 photo)."""
    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    size = {"shortest_edge": 1024, "longest_edge": 16384}  # tiny-qwen3.5-vl's
    hf = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, size=size)
    seen = []

    def spy(images, return_tensors):
        seen.append(images[0].size)
        return hf(images=images, return_tensors=return_tensors)

    p = fake_processor([])
    p.image_processor, p.presize = spy, _presize_settings(hf)
    rng = np.random.default_rng(0)
    for (w, h), target in [((1000, 700), (144, 96)), ((130, 120), (128, 128)), ((20, 500), (16, 496))]:
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        buf = io.BytesIO()
        im.save(buf, "PNG")
        patches, grid = p._image(buf.getvalue(), "image_data[0]", None)
        assert seen[-1] == target
        full = hf(images=[im], return_tensors="pt")
        assert torch.equal(patches, full["pixel_values"]) and grid == full["image_grid_thw"][0].tolist()


def test_the_tokenizer_manager_ends_a_request_whose_client_left_during_its_images():
    """normalize gives the HTTP request to the media job and ends it as ClientDisconnected (a 499 with
    nothing sent) when the client leaves during its images; the items after that one never start."""
    import base64

    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.request_limits import RequestLimits
    from sglang.srt.managers.tokenizer_manager import ClientDisconnected, TokenizerManager
    from sglang.srt.multimodal.media_io import MediaPolicy, MediaReader

    class Client:
        gone = False

        async def is_disconnected(self) -> bool:
            return self.gone

    calls, client = [], Client()
    tm = object.__new__(TokenizerManager)
    tm.max_samples_per_request, tm.encoder = 4, None
    tm.limits = RequestLimits(1000, 1000, vocab_size=100, without_tokenizer=True)
    tm.image_processor = fake_processor(calls, on_call=lambda: setattr(client, "gone", True))
    tm.media = MediaReader(MediaPolicy(fetch=None))
    items = [base64.b64encode(im).decode() for im in images(3)]
    obj = GenerateReqInput(input_ids=[1, 7, 7, 7, 2], image_data=items, sampling_params={})
    try:
        with pytest.raises(ClientDisconnected):
            asyncio.run(tm.normalize(obj, False, client))
    finally:
        tm.media.close()
    assert len(calls) == 1, calls


def test_a_video_files_unsampled_frames_count_only_against_the_decoded_pixels():
    """The request's pixel total (4 x its context's image pixels) counts the frames the model gets; a
    video file's frames decoded between them cost a decode only, and count against the request's 2^31
    decoded pixels (with every decoded frame against the total, a 1080p video file of 9 frames would be
    refused on tiny-qwen3.5-vl, whose total is 2^24, whatever was sampled)."""
    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt, s.options = 32, 32, "yuv420p", {"preset": "ultrafast"}
        for i in range(24):  # 1 s at 24 fps: 4 frames sampled (min_frames), all 24 decoded
            a = np.full((32, 32, 3), i * 10, np.uint8)
            out.mux(s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")))
        out.mux(s.encode())
    config = video.VideoConfig(16, 2, 2, 64, 1 << 20, (0.5,) * 3, (0.5,) * 3, 2.0, 4, 768)
    pixels = PixelBudget(4 * 32 * 32)
    assert len(video.load_video(buf.getvalue(), "video_data[0]", config, pixels).frames) == 4
    assert pixels.left == 0 and pixels.decoded.limit - pixels.decoded.left == 24 * 32 * 32
    small = PixelBudget(4 * 32 * 32, decoded_limit=10240)
    with pytest.raises(RequestError, match="decode to over 10240 pixels together") as e:
        video.load_video(buf.getvalue(), "video_data[0]", config, small)
    assert e.value.param == "video_data"


def test_an_image_whose_client_left_while_it_decoded_is_not_processed(monkeypatch):
    """The client leaves while the image decodes (the job cancelled then): the item stops before the
    resize and the image processor (MediaCancelled). Before, it ran through the processor."""
    from sglang.srt.multimodal import processor as processor_module

    calls: list = []
    p = fake_processor(calls)
    job = MediaJob()
    load = processor_module.load_image

    def decoding(*args, **kwargs):
        image = load(*args, **kwargs)
        job.cancelled.set()  # what the job's poll does when the client is gone
        return image

    monkeypatch.setattr(processor_module, "load_image", decoding)
    with pytest.raises(MediaCancelled):
        asyncio.run(job.run(p._image, PNG, "image_data[0]", None))
    assert calls == []
