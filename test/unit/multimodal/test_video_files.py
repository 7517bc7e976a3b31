"""A video file of a request (multimodal/video.py) is decoded only as a self-contained container, and its
decoded pixels are bounded by the frames it really holds, not by what its header declares:
- FFmpeg's concat demuxer (text naming local files) and SDP (text naming a socket) are refused at once,
  with one message whether the named file exists or not (without the fix: the server's file decoded,
  the refusal naming FileNotFoundError where it is missing, the SDP socket waited on ~20 s);
- an H.264 stream that changes its frame size mid-stream is refused (without the fix: accepted, its
  large frames decoded past the bound computed from the first frame's size);
- one request's images and video frames share one decoded-pixel budget.
Test videos are made here with PyAV, a few frames of at most 64x64."""

from __future__ import annotations

import base64
import fractions
import io
import time

import numpy as np
import pytest

from sglang.srt.managers.request_error import RequestError
from sglang.srt.multimodal import video
from sglang.srt.multimodal.media_io import PixelBudget, load_image
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=7, suite="per-commit-cpu")

CONFIG = video.VideoConfig(16, 2, 2, 64, 1 << 20, (0.5,) * 3, (0.5,) * 3, 2.0, 4, 768)
# A refusal that opens nothing is milliseconds; 2 s leaves a loaded 2-core CI machine room and is far
# under the SDP socket's ~20 s wait the fix removes.
FAST_S = 2.0


def h264(width: int, height: int, frames: int, container: str = "h264") -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        s = out.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.options = {"preset": "ultrafast", "tune": "zerolatency"}
        for i in range(frames):
            a = np.full((height, width, 3), i * 40 % 255, np.uint8)
            out.mux(s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")))
        out.mux(s.encode())
    return buf.getvalue()


def png_bytes() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def refused(data: bytes) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(RequestError) as e:
        video.load_video(data, "video_data[0]", CONFIG)
    return e.value.message, time.monotonic() - start


def test_a_plain_mp4_and_mkv_decode():
    for container in ("mp4", "matroska"):
        v = video.load_video(h264(32, 32, 6, container), "video_data[0]", CONFIG)
        assert len(v.frames) == 4 and v.frames[0].size == (32, 32), container


def test_containers_naming_files_or_sockets_are_refused_alike_and_fast(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.mp4").write_bytes(h264(32, 32, 6, "mp4"))
    (tmp_path / "dir").mkdir()
    messages = set()
    for name in ("secret.mp4", "missing.mp4", "dir"):
        text = f"ffconcat version 1.0\nfile {name}\n".encode()
        for item in (text, "data:video/mp4;base64," + base64.b64encode(text).decode()):
            message, took = refused(item)
            assert took < FAST_S, (name, took)
            messages.add(message)
    # One message whether the file exists, is missing or is a directory: no probe of the server's files.
    assert len(messages) == 1, messages
    assert "could not be decoded as a video" in messages.pop()
    sdp = b"v=0\no=- 0 0 IN IP4 127.0.0.1\ns=x\nc=IN IP4 127.0.0.1\nt=0 0\nm=video 45678 RTP/AVP 96\n"
    sdp += b"a=rtpmap:96 H264/90000\n"
    message, took = refused(sdp)
    assert took < FAST_S and "could not be decoded as a video" in message, (message, took)


def test_a_frame_size_change_mid_stream_is_refused():
    import av

    raw = h264(16, 16, 4) + h264(64, 64, 4)  # two H.264 streams back to back: the size changes at frame 4
    src = av.open(io.BytesIO(raw))
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:  # mkv: no frame count in the header
        dst = out.add_stream_from_template(src.streams.video[0])
        for i, p in enumerate(q for q in src.demux(video=0) if q.size):
            p.stream, p.pts, p.dts, p.time_base = dst, i, i, fractions.Fraction(1, 24)
            out.mux(p)
    message, _ = refused(buf.getvalue())
    assert "changes its frame size mid-stream (16x16 to 64x64)" in message, message


def test_a_requests_pixels_are_bounded_over_its_images_and_videos():
    """One budget for a request's images and video frames (each video alone had its own bound)."""
    png = png_bytes()
    pixels = PixelBudget(8 * 8 * 5)  # five 8x8 frames
    load_image(png, "image_data[0]", pixels)
    load_image(png, "image_data[1]", pixels)
    video.load_video([png] * 3, "video_data[0]", CONFIG, pixels)
    with pytest.raises(RequestError, match="decode to over 320 pixels together"):
        load_image(png, "image_data[2]", pixels)
    # A file's frames are charged as they decode: 6 frames of 32x32 (4 sampled) against room for 3.
    with pytest.raises(RequestError, match="decode to over 3072 pixels together"):
        video.load_video(h264(32, 32, 6, "mp4"), "video_data[0]", CONFIG, PixelBudget(32 * 32 * 3))


def test_images_are_processed_one_at_a_time_and_a_shared_item_once():
    """The processor decodes, processes and drops one image at a time (all of a prompt's 32 images
    decoded at once held ~6 GiB); a batch's single shared item is processed once, not per prompt."""
    import asyncio
    from types import SimpleNamespace

    import torch

    from sglang.srt.multimodal.processor import ImageInputProcessor, attach_media

    calls = []

    def image_processor(images, return_tensors):
        calls.append(len(images))
        n = len(images)
        return {"pixel_values": torch.rand(4 * n, 8), "image_grid_thw": torch.tensor([[1, 2, 2]] * n)}

    p = object.__new__(ImageInputProcessor)
    p.image_processor, p.image_token_id, p.merge, p.vocab_size = image_processor, 7, 2, 100
    p.video, p.video_refusal, p.max_pixels, p.pixels_per_token = None, "no video", 16384, 256
    limits = SimpleNamespace(context_len=1000, max_req_input_len=1000)
    items = [SimpleNamespace(prompt=i, req=SimpleNamespace(input_ids=[1, 7, 2])) for i in range(3)]
    png = png_bytes()
    asyncio.run(attach_media(p, items, png, None, limits, is_batch=True))
    assert calls == [1]  # one item for the 3 prompts
    assert all(len(it.req.input_ids) == 3 and it.req.mm_inputs is not None for it in items)
    calls.clear()
    one = [SimpleNamespace(prompt=0, req=SimpleNamespace(input_ids=[1, 7, 7, 7, 2]))]
    asyncio.run(attach_media(p, one, [png_bytes(), png_bytes(), png_bytes()], None, limits, is_batch=False))
    assert calls == [1, 1, 1]


def static_h264(width: int, height: int, frames: int, container: str) -> bytes:
    """`frames` identical frames: each after the first is a skipped P-frame of ~15 bytes (a 4.6 MB mkv
    holds 300,000 of 16x16)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        s = out.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.options = {"preset": "ultrafast", "tune": "zerolatency"}
        frame = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
        for _ in range(frames):
            out.mux(s.encode(frame))
        out.mux(s.encode())
    return buf.getvalue()


def test_a_requests_video_frames_are_bounded_by_their_count():
    """A frame costs ~12 us to decode however small: 300,000 frames of 16x16 (a 4.6 MB mkv, 5.5 s of
    CPU) were within the 2^31 decoded pixels. The count is bounded per request (65,536 by default, here
    lowered to 100): refused from the count an mp4 declares or an mkv's packets (counted up to the bound)
    before decoding, and a second video of the request past what the first left."""
    assert PixelBudget().frames.limit == 1 << 16
    for container in ("mp4", "matroska"):
        pixels = PixelBudget(frames_limit=100)
        start = time.monotonic()
        with pytest.raises(RequestError, match=r"video_data\[0\] has over 100 frames") as e:
            video.load_video(static_h264(16, 16, 300, container), "video_data[0]", CONFIG, pixels)
        assert e.value.param == "video_data" and pixels.frames.left == 100, container  # none decoded
        assert time.monotonic() - start < FAST_S
    pixels = PixelBudget(frames_limit=100)
    clip = static_h264(16, 16, 60, "mp4")
    assert len(video.load_video(clip, "video_data[0]", CONFIG, pixels).frames) == 5  # 2.5 s at 2 fps
    assert pixels.frames.left == 40
    with pytest.raises(RequestError, match=r"video_data\[1\] has over 40 frames.*at most 100 over"):
        video.load_video(clip, "video_data[1]", CONFIG, pixels)


def test_a_frame_over_the_bound_is_refused_by_the_decoder_before_it_is_decoded():
    """A stream that declares 16x16 and switches to 128x128 frames: FFmpeg's max_pixels (the per-frame
    bound, here 64x64) refuses the large frame before allocating it. Without it the frame was decoded
    (any size the codec allows, up to ~16384x16384) and refused after, as a size change."""
    import av

    raw = h264(16, 16, 4) + h264(128, 128, 2)
    src = av.open(io.BytesIO(raw))
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        dst = out.add_stream_from_template(src.streams.video[0])
        for i, p in enumerate(q for q in src.demux(video=0) if q.size):
            p.stream, p.pts, p.dts, p.time_base = dst, i, i, fractions.Fraction(1, 24)
            out.mux(p)
    pixels = PixelBudget(per_item=64 * 64)
    with pytest.raises(RequestError) as e:
        video.load_video(buf.getvalue(), "video_data[0]", CONFIG, pixels)
    assert "could not be decoded as a video" in e.value.message, e.value.message
    assert pixels.decoded.limit - pixels.decoded.left == 4 * 16 * 16  # the 16x16 frames only


def test_a_video_stops_decoding_when_its_client_leaves():
    """The client leaves (its job cancelled) while frame 5 of 48 decodes: the decode stops before the
    next packet (MediaCancelled). Before, an item already decoding ran to its end."""
    import asyncio

    from sglang.srt.multimodal import media_io
    from sglang.srt.multimodal.media_pool import MediaCancelled, MediaJob

    clip = static_h264(32, 32, 48, "mp4")
    job, seen = MediaJob(), []
    charge = media_io.charge

    def charging(pixels, n, *args, **kwargs):
        seen.append(n)
        if len(seen) == 5:
            job.cancelled.set()  # what the job's poll does when the client is gone
        return charge(pixels, n, *args, **kwargs)

    media_io.charge = charging
    try:
        with pytest.raises(MediaCancelled):
            asyncio.run(job.run(video.load_video, clip, "video_data[0]", CONFIG, PixelBudget()))
    finally:
        media_io.charge = charge
    assert len(seen) == 5, len(seen)


def test_the_probe_when_a_file_opens_is_held_to_the_frame_bound_too():
    """FFmpeg decodes a frame to probe the streams when it opens a file, before the declared size can be
    checked: that probe gets the per-frame bound too (a 200 KB mp4 of 8192x8192 frames took 157 MB and
    0.26 s to open before its refusal; 25 MB, 0.03 s with it). Seen here in FFmpeg's log: its refusal of
    the 64x64 picture over a 32x32 bound (without the bound the probe decodes it silently)."""
    import av.logging

    level = av.logging.get_level()
    av.logging.set_level(av.logging.ERROR)
    try:
        with av.logging.Capture() as logs:
            with pytest.raises(RequestError, match="has 64x64 frames"):
                clip, small = h264(64, 64, 2, "mp4"), PixelBudget(per_item=32 * 32)
                video.load_video(clip, "video_data[0]", CONFIG, small)
    finally:
        av.logging.set_level(level)
    assert any("exceeds specified max pixel count 1024" in line for _, _, line in logs), logs


def claiming(samples: int) -> bytes:
    """A 4-frame mp4 whose tables claim `samples` samples of one constant size (stts, stsz, stsc patched):
    a few hundred bytes that FFmpeg would index sample by sample when it opens the file."""
    import struct

    data = bytearray(h264(16, 16, 4, "mp4"))
    stts = data.find(b"stts")
    data[stts + 12 : stts + 16] = struct.pack(">I", samples)  # the one entry's count
    stsz = data.find(b"stsz")
    data[stsz + 8 : stsz + 16] = struct.pack(">II", 600, samples)  # constant size, count
    stsc = data.find(b"stsc")
    data[stsc + 16 : stsc + 20] = struct.pack(">I", samples)  # samples per chunk
    return bytes(data)


def test_an_mp4_claiming_millions_of_samples_is_refused_before_ffmpeg_indexes_them():
    """A 1,622-byte mp4 whose tables claim 60,000,000 samples (a constant size needs no table) took FFmpeg
    7.6 s and 4 GB to open (10,000,000: 0.6 s, 700 MB), before any check of ours. Its boxes are read
    first (mp4_boxes): over 2^20 samples it is refused unopened. Without it: opened, indexed, then refused
    by the frame count."""
    from sglang.srt.multimodal import mp4_boxes

    for container in ("mp4", "mov"):
        assert mp4_boxes.declared_samples(h264(16, 16, 37, container)) == 37, container
    assert mp4_boxes.declared_samples(h264(16, 16, 37, "matroska")) == 0
    assert mp4_boxes.declared_samples(claiming(3_000_000)) == 3_000_000
    message, took = refused(claiming(3_000_000))
    assert "declares 3000000 samples, over the 1048576" in message, message
    assert took < FAST_S
    # A compressed movie header cannot be counted unopened: refused.
    box = lambda kind, body: len(body + b"12345678").to_bytes(4, "big") + kind + body  # noqa: E731
    cmov = box(b"ftyp", b"isom\0\0\0\0") + box(b"moov", box(b"cmov", box(b"dcom", b"zlib")))
    assert "compressed movie header" in refused(cmov)[0]
    assert "over 131072 boxes" in refused(box(b"free", b"") * 140000)[0]


def test_a_video_in_a_codec_outside_the_decoders_is_refused_naming_it():
    """FFmpeg has some 250 video decoders; a file's frames may need only those of real videos
    (video.DECODERS). A mov of PNG frames is refused naming its codec (before: decoded), and FFmpeg's
    probe when it opens the file runs no other decoder either: its log says the decoder is not allowed.
    An mp4 with an AAC audio track still decodes (the audio is never decoded)."""
    import av
    import av.logging

    buf = io.BytesIO()
    with av.open(buf, "w", format="mov") as out:
        s = out.add_stream("png", rate=24)
        s.width, s.height, s.pix_fmt = 32, 32, "rgb24"
        for i in range(4):
            out.mux(s.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), i, np.uint8), format="rgb24")))
        out.mux(s.encode())
    level = av.logging.get_level()
    av.logging.set_level(av.logging.ERROR)
    try:
        with av.logging.Capture() as logs:
            message, _ = refused(buf.getvalue())
    finally:
        av.logging.set_level(level)
    assert "is encoded with png, which this server does not decode" in message, message
    assert any("not on whitelist" in line or "not allowed" in line for _, _, line in logs), logs
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        v = out.add_stream("libx264", rate=24)
        v.width, v.height, v.pix_fmt = 32, 32, "yuv420p"
        a = out.add_stream("aac", rate=48000)
        for i in range(12):
            frame = np.full((32, 32, 3), i * 9, np.uint8)
            out.mux(v.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        for i in range(10):
            f = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            f.sample_rate, f.pts = 48000, i * 1024
            out.mux(a.encode(f))
        out.mux(v.encode())
        out.mux(a.encode())
    assert len(video.load_video(buf.getvalue(), "video_data[0]", CONFIG).frames) == 4


def test_uncompressed_audio_counts_its_chunks_not_its_samples():
    """A mov's PCM audio track declares one sample per audio sample (172,800,000 in an hour at 48 kHz)
    with one stts entry of duration 1: FFmpeg indexes its chunks, so it is not counted (50,000,000 so
    opened in 0.01 s) and such a video decodes. With a duration of 2 FFmpeg indexes each sample
    (20,000,000: 0.18 s, 245 MB): counted. Its chunks are counted as FFmpeg indexes them: a chunk's
    samples (`stsc`) in packets of at least 160, so its 4 chunks (3 of 800 samples, one of 5,600) are 50
    entries, and 4 chunks claiming 60,000,000 samples each (bytes nobody sends) are 1,500,000, refused
    unopened (without it they were left out: a 43 KB mov of 300 chunks of 100,000,000 took 3.7 s and
    +670 MB to open)."""
    import struct

    import av

    from sglang.srt.multimodal import mp4_boxes

    def with_pcm(samples: int, duration: int, per_chunk: int = 0) -> bytes:
        buf = io.BytesIO()
        with av.open(buf, "w", format="mov") as out:
            v = out.add_stream("libx264", rate=24)
            v.width, v.height, v.pix_fmt = 16, 16, "yuv420p"
            a = out.add_stream("pcm_s16le", rate=8000)
            for i in range(8):
                frame = np.full((16, 16, 3), i * 20, np.uint8)
                out.mux(v.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            out.mux(v.encode())
            for i in range(10):
                f = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
                f.sample_rate, f.pts = 8000, i * 800
                out.mux(a.encode(f))
            out.mux(a.encode())
        data = bytearray(buf.getvalue())
        stts = data.find(b"stts", data.find(b"stts") + 4)  # the audio track's (the second)
        struct.pack_into(">II", data, stts + 12, samples, duration)
        stsz = data.find(b"stsz", data.find(b"stsz") + 4)
        struct.pack_into(">I", data, stsz + 12, samples)
        if per_chunk:
            stsc = data.find(b"stsc", data.find(b"stsc") + 4)
            for run in range(struct.unpack_from(">I", data, stsc + 8)[0]):  # every run: every chunk
                struct.pack_into(">I", data, stsc + 16 + 12 * run, per_chunk)
        return bytes(data)

    pcm = with_pcm(50_000_000, 1)
    assert mp4_boxes.declared_samples(pcm) == 8 + 3 * 5 + 35  # the video's 8, the audio's 4 chunks
    big = with_pcm(50_000_000, 1, per_chunk=60_000_000)
    assert mp4_boxes.declared_samples(big) == 8 + 4 * 375_000
    message, took = refused(big)
    assert "declares 1500008 samples, over the 1048576" in message and took < FAST_S, message
    # runs: chunks 1-3 of 1,600 samples (10 entries each), 4-9 of 100 (1 each), 10 on of 161 (2 each)
    runs = struct.pack(">II", 0, 3) + struct.pack(">9I", 1, 1600, 1, 4, 100, 1, 10, 161, 1)
    table = bytes(8) + runs
    assert mp4_boxes._chunk_entries(table, (8, len(table)), 12) == 3 * 10 + 6 * 1 + 3 * 2
    # runs out of order: each chunk at the largest run's packets (FFmpeg may stay on any run)
    backwards = bytes(8) + struct.pack(">II", 0, 2) + struct.pack(">6I", 5, 1600, 1, 2, 100, 1)
    assert mp4_boxes._chunk_entries(backwards, (8, len(backwards)), 12) == 12 * 10
    assert len(video.load_video(pcm, "video_data[0]", CONFIG).frames) == 4
    assert mp4_boxes.declared_samples(with_pcm(20_000_000, 2)) == 20_000_008  # with the video track's 8
    assert "declares 20000008 samples" in refused(with_pcm(20_000_000, 2))[0]


def test_a_file_declaring_no_frame_count_reserves_for_the_frames_it_holds():
    """An mkv / webm / fragmented mp4 declares no frame count: its estimate (`video_bytes`, what it
    reserves in the process's media memory) samples from its packets, as its decode does, so a 1 s clip
    reserves what its mp4 does (before: all 256 frames at the config's max_pixels, a 1 s 320x240 webm
    510 MB for ~8 MB of frames under Qwen3-VL's config). One that holds more than a request decodes
    keeps the whole reservation (it is refused when decoded)."""
    mp4 = video.video_bytes(static_h264(64, 64, 24, "mp4"), CONFIG)
    assert mp4 == 64 * 64 * (video.VIDEO_BYTES_PER_PIXEL + 4 * video.RESIZED_BYTES_PER_PIXEL)
    assert video.video_bytes(static_h264(64, 64, 24, "matroska"), CONFIG) == mp4
    budget = PixelBudget()
    budget.frames.take(budget.frames.limit - 10)  # 10 frames left to this request
    whole = 64 * 64 * video.VIDEO_BYTES_PER_PIXEL + CONFIG.max_pixels * video.RESIZED_BYTES_PER_PIXEL
    assert video.video_bytes(static_h264(64, 64, 24, "matroska"), CONFIG, budget) == whole


def test_video_patches_are_transformers_patchify():
    """video_patches normalizes in place and copies once into the patch layout (test_video_patch_memory:
    its peak bytes): bit for bit transformers' `Qwen3VLVideoProcessor.patchify` of the same frames."""
    import torch
    from PIL import Image
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    rng = np.random.default_rng(0)
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    config = video.VideoConfig(16, 2, 2, 64, 1 << 20, mean, std, 2.0, 4, 768)
    frames = [Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)) for _ in range(4)]
    ours, grid = video.video_patches(video.Video(frames, [0, 1, 2, 3], 2.0), config)
    x = np.stack([np.asarray(f, np.float32) / 255.0 for f in frames])
    x = (x - np.array(mean, np.float32)) / np.array(std, np.float32)
    clip = torch.from_numpy(x).permute(0, 3, 1, 2)[None]  # [1, frames, C, H, W]
    theirs, t, gh, gw = Qwen3VLVideoProcessor.patchify(None, clip, 16, 2, 2)
    assert grid == [t, gh, gw] == [2, 4, 6] and ours.is_contiguous()
    assert ours.dtype == theirs.dtype and bool((ours == theirs[0]).all())



def test_a_file_fragmented_at_every_frame_has_boxes_for_its_samples(monkeypatch):
    """A recorder's mp4 fragmented at every frame has ~8 boxes a sample: past MAX_BOXES it is opened while
    it has at most BOXES_PER_SAMPLE boxes a sample declared so far (before: any file over 131,072 boxes
    was refused, a 4-minute one of them), up to MAX_FRAGMENT_BOXES; boxes declaring nothing are not.
    (The bounds are lowered here: a file past the real ones takes thousands of frames to make.)"""
    import av

    from sglang.srt.multimodal import mp4_boxes

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4", options={"movflags": "frag_every_frame+empty_moov"}) as out:
        s = out.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = 16, 16, "yuv420p"
        s.options = {"preset": "ultrafast", "tune": "zerolatency"}
        for i in range(40):
            out.mux(s.encode(av.VideoFrame.from_ndarray(np.full((16, 16, 3), i, np.uint8), format="rgb24")))
        out.mux(s.encode())
    fragmented = buf.getvalue()
    assert fragmented.count(b"moof") >= 40
    monkeypatch.setattr(mp4_boxes, "MAX_BOXES", 64)
    assert mp4_boxes.declared_samples(fragmented) == 40
    assert len(video.load_video(fragmented, "video_data[0]", CONFIG).frames) == 4
    box = lambda kind, body: len(body + b"12345678").to_bytes(4, "big") + kind + body  # noqa: E731
    assert "over 64 boxes" in refused(box(b"free", b"") * 100)[0]
    monkeypatch.setattr(mp4_boxes, "MAX_FRAGMENT_BOXES", 128)
    assert "over 128 boxes" in refused(fragmented)[0]


def test_dnxhd_and_dv_videos_decode():
    """DNxHR (an editing codec) and DV (a camera codec) movs decode (video.DECODERS; before: refused as
    outside the decoders), held to the same bounds as the others (a DV frame is 720x576: one pixel over
    the per-frame bound and FFmpeg refuses it while it probes the file)."""
    import av

    def mov(codec: str, width: int, height: int, pix_fmt: str, options: dict) -> bytes:
        buf = io.BytesIO()
        with av.open(buf, "w", format="mov") as out:
            s = out.add_stream(codec, rate=25)
            s.width, s.height, s.pix_fmt, s.options = width, height, pix_fmt, options
            for i in range(4):
                a = np.full((height, width, 3), i * 30, np.uint8)
                out.mux(s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")))
            out.mux(s.encode())
        return buf.getvalue()

    dnxhr = mov("dnxhd", 256, 144, "yuv422p", {"profile": "dnxhr_lb"})
    assert len(video.load_video(dnxhr, "video_data[0]", CONFIG).frames) == 4
    dv = mov("dvvideo", 720, 576, "yuv420p", {})
    assert len(video.load_video(dv, "video_data[0]", CONFIG).frames) == 4
    budget = PixelBudget()
    budget.per_item = 720 * 576 - 1
    with pytest.raises(RequestError, match="declares no frame size|720x576 frames"):  # refused at the probe
        video.load_video(dv, "video_data[0]", CONFIG, budget)
