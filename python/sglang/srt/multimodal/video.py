"""Videos of a request (`video_data`), as Qwen3-VL / Qwen3.5's processor takes them: a video is either a
list of frames (each an `image_data`-style item, read by `media_io`) or a video file (mp4, webm, ...: its
bytes, as base64 or a data URI) decoded with PyAV.

A file is sampled as transformers' `Qwen3VLVideoProcessor.sample_frames` does (`fps` frames a second,
at least `min_frames`, at most `max_frames`), a list of frames is taken whole (transformers samples no
image list); each pair of frames (`temporal_patch_size`) becomes one grid of the vision tower, announced
in the prompt by its timestamp (`<1.5 seconds>`, the mean of its frames' times) as transformers'
`Qwen3VLProcessor` writes it. Frames are resized together (transformers' `smart_resize` over all
frames), rescaled, normalized and cut into patches in the Qwen2-VL layout.

Bounds, each a 400 naming `video_data`: `MAX_VIDEO_FRAMES` frames taken, `MAX_DECODED_PIXELS` pixels
decoded (a file's frames before sampling, so a long or large video is refused before it is decoded; a
list's frames, known from its first; a file's frames are also charged as they decode, and a frame of
another size than the stream declared is refused), the request's per-image bound a frame
(`media_io.PixelBudget.per_item`, checked before decoding), and the request's pixels over all its media
(a file's sampled frames count as images do; the frames decoded between them only against the
request's 2^31 decoded pixels: they cost a decode, ~10x less a pixel than an image's processing).
Each frame is resized as it is decoded, so the full-size frames are never all held. A file is read only
as one of the self-contained `CONTAINERS`, with no protocol: FFmpeg demuxers that name other files or
sockets (concat, SDP, HLS, DASH) are refused, with one message whatever they name. FFmpeg itself refuses
a frame over the per-frame bound (its `max_pixels` option) before allocating it, so a stream that changes
its frame size mid-way cannot make it decode a larger frame first. A request decodes at most
`media_io.MAX_DECODED_FRAMES_PER_REQUEST` frames (a frame costs ~12 us of overhead however small it is).
An mp4 / mov declaring more than `MAX_DECLARED_SAMPLES` samples is refused from its boxes before FFmpeg
opens (and indexes) it (`mp4_boxes`), and only the `DECODERS` of real videos are opened. A decode stops
between two packets once the request's client has left (`media_pool.check_cancelled`).
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sglang.srt.managers.request_error import RequestError
from sglang.srt.multimodal import media_io, media_pool, mp4_boxes
from sglang.srt.multimodal.media_pool import MediaCancelled

FIELD = "video_data"
# The most frames a video may give the model (after sampling): each pair is a grid of image tokens.
MAX_VIDEO_FRAMES = 256
# The most pixels (width x height x frames) decoded from one video: ~1,000 frames at 1080p, ~10 s of
# decoding on one core (x264 at 720p decoded at 213 Mpixel/s here, on a loaded machine).
MAX_DECODED_PIXELS = 1 << 31
# transformers' frame rate for frames given without one (Qwen3VLProcessor: "Defaulting to `fps=24`").
DEFAULT_FPS = 24.0
# The most samples an mp4 / mov file may declare in one kind of table over its tracks (video and audio):
# FFmpeg builds its index from those counts when it opens the file (~70 bytes a sample), and they need no
# bytes behind them (a 1,622-byte file claiming 60,000,000 took 7.6 s and 4 GB to open). 2^20 is 2.7 h
# of 60 fps video with compressed audio (uncompressed audio is not counted: `mp4_boxes`); a request
# decodes at most 65,536 frames anyway.
MAX_DECLARED_SAMPLES = 1 << 20
# Bytes a video file's decode may hold per pixel of its declared frame size, for the process's media
# memory budget (`media_pool.MediaMemory`): the decoder's reference frames (H.264 keeps up to 16, YUV
# 4:2:0, 1.5 bytes a pixel each), the frame being converted to RGB and its PIL copy. Measured: a 4096x4096
# H.264 file with 16 reference frames +860 MB peak RSS while decoding (51 bytes a pixel), with 1 +370 MB.
VIDEO_BYTES_PER_PIXEL = 56
# Bytes a video file's estimate (`video_bytes`, which opens it: FFmpeg decodes a frame to probe it) may
# hold a pixel of the per-frame bound, reserved for it in the process's media memory (`probe_bytes`):
# measured +155 MB for a 200 KB H.264 file of 8192x8192 frames (2.3 a pixel; four at once +634 MB, with
# nothing reserved before). A 4:4:4 10-bit frame (ProRes 4444) is 6 a pixel: under-reserved.
PROBE_BYTES_PER_PIXEL = 4
# Bytes per pixel of a video's frames after resizing (RGB, 3) and their patches (float32, stacked and
# permuted: 24); the resized frames together hold at most the video config's max_pixels.
RESIZED_BYTES_PER_PIXEL = 27


@dataclass(frozen=True)
class VideoConfig:
    """The checkpoint's video processor settings (`video_preprocessor_config.json`), with transformers'
    `Qwen3VLVideoProcessor` defaults for what it leaves out."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    fps: float
    min_frames: int
    max_frames: int

    @classmethod
    def load(cls, model_path: str) -> VideoConfig | None:
        """None when the checkpoint ships no video processor config."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as D

        path = os.path.join(model_path, "video_preprocessor_config.json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            c = json.load(f)
        size = c.get("size") or D.size
        return cls(
            patch_size=c.get("patch_size", D.patch_size),
            temporal_patch_size=c.get("temporal_patch_size", D.temporal_patch_size),
            merge_size=c.get("merge_size", D.merge_size),
            min_pixels=size["shortest_edge"],
            max_pixels=size["longest_edge"],
            mean=tuple(c.get("image_mean", D.image_mean)),
            std=tuple(c.get("image_std", D.image_std)),
            fps=float(c.get("fps") or D.fps),
            min_frames=c.get("min_frames", D.min_frames),
            max_frames=c.get("max_frames", D.max_frames),
        )


@dataclass
class Video:
    """A video's frames (RGB PIL images, resized to the size the processor gives the whole video) and
    each frame's index in the source at `fps`."""

    frames: list[Any]
    indices: list[int]
    fps: float

    def timestamps(self, temporal_patch_size: int) -> list[float]:
        """The time of each grid (pair of frames), as Qwen3VLProcessor computes it: the frames' indices
        padded with the last to a whole pair, over fps, averaged per pair."""
        idx = list(self.indices)
        idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
        t = [i / self.fps for i in idx]
        return [(t[i] + t[i + temporal_patch_size - 1]) / 2 for i in range(0, len(t), temporal_patch_size)]


def _as_video_error(e: RequestError) -> RequestError:
    return RequestError(e.message, FIELD)


def _item_bytes(item: Any, where: str) -> bytes:
    """A video file's bytes: bytes as they are (what `media_io.MediaReader` reads), base64 or a data URI
    by media_io's reader. A file path or URL is not read here: whether a request may name one is
    media_io's policy, applied where it reads the request's items."""
    if isinstance(item, bytes):
        return item
    try:
        return media_io.read_local(item, where, FIELD, media_io.MediaPolicy(), trusted=False)
    except RequestError as e:
        raise _as_video_error(e) from None


def load_video(
    item: Any, where: str, config: VideoConfig, pixels: media_io.PixelBudget | None = None
) -> Video:
    """A `video_data` item (a list of frames, or a video file) as frames; RequestError naming `where`.
    Each frame decoded is charged to `pixels` (the request's images and videos together; a file's
    frames that are not sampled to its `decoded` pixels only)."""
    from PIL import Image

    if isinstance(item, list):
        if not item:
            raise RequestError(f"{where} is an empty list of frames.", FIELD)
        if len(item) > MAX_VIDEO_FRAMES:
            raise RequestError(f"{where} has {len(item)} frames, over the {MAX_VIDEO_FRAMES} taken.", FIELD)
        try:
            first = media_io.load_image(item[0], f"{where}[0]", pixels)
            width, height = first.size
            if len(item) * width * height > MAX_DECODED_PIXELS:
                raise RequestError(
                    f"{where} has {len(item)} frames of {width}x{height}, over the {MAX_DECODED_PIXELS} "
                    "pixels this server takes in a video.",
                    FIELD,
                )
            size = _target_size(len(item), width, height, config, where)
            frames = [first.resize(size, Image.BICUBIC)]  # each frame resized as it comes: a bounded memory
            for i, f in enumerate(item[1:], 1):
                media_pool.check_cancelled()
                frame = media_io.load_image(f, f"{where}[{i}]", pixels)
                if frame.size != (width, height):
                    raise RequestError(f"{where}: the frames of a video must all have one size.", FIELD)
                frames.append(frame.resize(size, Image.BICUBIC))
        except RequestError as e:
            raise _as_video_error(e) from None
        return Video(frames, list(range(len(frames))), DEFAULT_FPS)
    return _decode(_item_bytes(item, where), where, config, pixels)


def video_bytes(item: Any, config: VideoConfig, pixels: media_io.PixelBudget | None = None) -> int:
    """The decoded bytes a `video_data` item may hold while it is loaded and cut into patches, from its
    first frame's header or its container's declared frame size (capped at the per-frame bound, which a
    larger frame fails) and frame count, without decoding; what it reserves in the process's media
    memory. Its resized frames hold at most the config's max_pixels, and no more than the frames taken
    (all of a list; those sampled from a file: from its declared count, or from its packets, counted as
    `_decode` counts them, when it declares none) at their full size."""
    per_frame = media_io.MAX_IMAGE_PIXELS if pixels is None else pixels.per_item

    def resized(frames: int, frame_pixels: int) -> int:
        return min(config.max_pixels, frames * frame_pixels) * RESIZED_BYTES_PER_PIXEL

    if isinstance(item, list):
        first = media_io.image_bytes(item[0], pixels) if item else 0
        return first + resized(len(item), first // media_io.IMAGE_BYTES_PER_PIXEL)
    import av

    try:
        data = _item_bytes(item, "")
        _check_declared(data, "")
        with av.open(io.BytesIO(data), options=_open_options(per_frame)) as container:
            if not CONTAINERS & set(container.format.name.split(",")) or not container.streams.video:
                return 0
            stream = container.streams.video[0]
            c = stream.codec_context
            frame_pixels = min(max(c.width, 0) * max(c.height, 0), per_frame)
            fps = float(stream.average_rate or 0) or DEFAULT_FPS
            # a file that declares no count (mkv, webm, fragmented mp4): its packets, as _decode counts
            # them (a duration would be a claim: a 1 s clip declaring none reserved all 256 frames)
            limit = media_io.MAX_DECODED_FRAMES_PER_REQUEST if pixels is None else pixels.frames.left
            total = stream.frames if stream.frames > 0 else _count_frames(container, stream, limit)
            taken = len(_sample(total, fps, config)) if 0 < total <= limit else MAX_VIDEO_FRAMES
            return frame_pixels * VIDEO_BYTES_PER_PIXEL + resized(taken, frame_pixels)
    except Exception:  # not a video: _decode refuses it, undecoded
        return 0


def probe_bytes(item: Any, pixels: media_io.PixelBudget | None = None) -> int:
    """What a `video_data` item's estimate (`video_bytes`) reserves: a file's probe frame, at most the
    per-frame bound (PROBE_BYTES_PER_PIXEL a pixel); a list of frames reads its first frame's header
    only (nothing)."""
    if isinstance(item, list):
        return 0
    return (media_io.MAX_IMAGE_PIXELS if pixels is None else pixels.per_item) * PROBE_BYTES_PER_PIXEL


def _target_size(frames: int, width: int, height: int, config: VideoConfig, where: str) -> tuple[int, int]:
    """The (width, height) every frame is resized to: transformers' smart_resize over the frames given
    (before the last is repeated to a whole pair, as transformers resizes), within the config's pixels."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    p, tp, m = config.patch_size, config.temporal_patch_size, config.merge_size
    try:
        h, w = smart_resize(frames, height, width, tp, p * m, config.min_pixels, config.max_pixels)
    except ValueError as e:  # too few frames, or an aspect ratio the processor cannot resize
        raise RequestError(f"{where}: the video processor refused it ({e}).", FIELD) from None
    return w, h


# The containers a video file may be (FFmpeg's demuxer names): self-contained formats. Others FFmpeg
# probes would read more than the bytes given: the concat demuxer opens local files, SDP / HLS / DASH
# open files and sockets (also refused by the empty protocol whitelist below).
CONTAINERS = frozenset({"mov", "mp4", "matroska", "webm", "avi"})
# The decoders a video file's frames may need (FFmpeg's names; AV1 and VP8 / VP9 also through dav1d and
# libvpx): the codecs of real videos in the containers above (DNxHD / DNxHR and DV: editing and camera
# intra-frame codecs, one frame a packet, bounded by the per-frame and frame-count bounds as the others).
# FFmpeg has some 250 other video decoders (image formats, screen and game codecs, ...), each a parser of
# untrusted bytes this server need not expose; a file in another codec is refused in one sentence naming
# it, and FFmpeg opens no other decoder, not even for the frame it decodes to probe the file when it
# opens it (its codec_whitelist).
DECODERS = frozenset(
    {
        "h264", "hevc", "vp8", "libvpx", "vp9", "libvpx-vp9", "av1", "libdav1d",
        "mpeg4", "mpeg1video", "mpeg2video", "h263", "mjpeg", "prores", "theora", "dnxhd", "dvvideo",
    }
)  # fmt: skip
# Every refusal of bytes that do not decode says this, whatever FFmpeg raised: an exception's type
# could tell whether a file the bytes name exists.
_UNDECODABLE = "could not be decoded as a video (an mp4, mov, mkv, webm or avi file)"


def _check_declared(data: bytes, where: str) -> None:
    """Refuse an mp4 / mov file whose tables declare more samples than MAX_DECLARED_SAMPLES, or whose
    boxes cannot be counted (`mp4_boxes`), before FFmpeg opens it."""
    try:
        samples = mp4_boxes.declared_samples(data)
    except mp4_boxes.Unreadable as e:
        raise RequestError(f"{where} has {e}, which this server does not open.", FIELD) from None
    if samples > MAX_DECLARED_SAMPLES:
        raise RequestError(
            f"{where} declares {samples} samples, over the {MAX_DECLARED_SAMPLES} this server opens in a "
            "file.",
            FIELD,
        )


def _open_options(per_frame: int) -> dict[str, str]:
    """FFmpeg's options for opening a video file: no protocol (a demuxer that would open a file or a
    socket named in the bytes fails instead), no frame over `per_frame` pixels and no decoder but
    `DECODERS`, also in the frames FFmpeg decodes to probe the streams when it opens the file (a 200 KB
    mp4 of 8192x8192 frames took 0.26 s and 157 MB to open, refused after; 0.03 s and 25 MB with the
    bound). Audio streams are left undecoded (their decoders are not listed)."""
    return {
        "protocol_whitelist": "none",
        "max_pixels": str(per_frame),
        "codec_whitelist": ",".join(sorted(DECODERS)),
    }


def _decode(data: bytes, where: str, config: VideoConfig, pixels: media_io.PixelBudget | None) -> Video:
    import av
    from PIL import Image

    per_frame = media_io.MAX_IMAGE_PIXELS if pixels is None else pixels.per_item
    _check_declared(data, where)
    try:
        with av.open(io.BytesIO(data), options=_open_options(per_frame)) as container:
            if not CONTAINERS & set(container.format.name.split(",")):
                raise RequestError(f"{where} {_UNDECODABLE}.", FIELD)
            if not container.streams.video:
                raise RequestError(f"{where} has no video stream.", FIELD)
            stream = container.streams.video[0]
            if stream.codec_context.name not in DECODERS:
                raise RequestError(
                    f"{where} is encoded with {stream.codec_context.name}, which this server does not decode "
                    "(it decodes H.264, H.265, VP8, VP9, AV1, MPEG-1/2/4, H.263, Motion JPEG, ProRes, "
                    "Theora, DNxHD / DNxHR and DV).",
                    FIELD,
                )
            stream.codec_context.thread_count = 1  # one core a video: a request cannot take them all
            width, height = stream.codec_context.width, stream.codec_context.height
            if width < 1 or height < 1:
                raise RequestError(f"{where} declares no frame size.", FIELD)
            if width * height > per_frame:
                raise RequestError(
                    f"{where} has {width}x{height} frames ({width * height} pixels), over the {per_frame} "
                    "this server decodes per frame for this model.",
                    FIELD,
                )
            # FFmpeg refuses a larger frame (a size change mid-stream) before it allocates or decodes it.
            options = _open_options(per_frame)  # the decoder's own, as at the probe
            stream.codec_context.options = {k: options[k] for k in ("max_pixels", "codec_whitelist")}
            frames_left = media_io.MAX_DECODED_FRAMES_PER_REQUEST if pixels is None else pixels.frames.left
            total = stream.frames or _count_frames(container, stream, frames_left)
            if total > frames_left:
                raise RequestError(
                    f"{where} has over {frames_left} frames, more than this server decodes for a request "
                    f"(at most {pixels.frames.limit if pixels else frames_left} over its videos).",
                    FIELD,
                )
            if total * width * height > MAX_DECODED_PIXELS:
                raise RequestError(
                    f"{where} has {total} frames of {width}x{height}, over the {MAX_DECODED_PIXELS} pixels "
                    "this server decodes from a video.",
                    FIELD,
                )
            fps = float(stream.average_rate or 0) or DEFAULT_FPS
            if total < 1:
                raise RequestError(f"{where} holds no frame.", FIELD)
            indices = _sample(total, fps, config)
            size = _target_size(len(indices), width, height, config, where)
            wanted, frames, decoded = set(indices), [], 0
            container.seek(0)
            for i, frame in enumerate(_frames(container, stream, frames_left, where)):
                if i > indices[-1]:
                    break
                # The bounds above used the declared size: a stream may change it mid-way (H.264 can),
                # so each frame is held to it and charged as decoded.
                if (frame.width, frame.height) != (width, height):
                    raise RequestError(
                        f"{where} changes its frame size mid-stream ({width}x{height} to "
                        f"{frame.width}x{frame.height}); this server takes videos of one frame size.",
                        FIELD,
                    )
                decoded += width * height
                if pixels is not None and not pixels.frames.take(1):
                    raise RequestError(
                        f"{where}: the request's video files decode over the "
                        f"{pixels.frames.limit} frames this server decodes for a request.",
                        FIELD,
                    )
                if decoded > MAX_DECODED_PIXELS:
                    raise RequestError(
                        f"{where} decodes to over the {MAX_DECODED_PIXELS} pixels this server decodes from "
                        "a video.",
                        FIELD,
                    )
                media_io.charge(pixels, width * height, where, FIELD, used=i in wanted)
                if i in wanted:  # resized as it comes: the full-size frames are never all held
                    frames.append(
                        Image.fromarray(frame.to_ndarray(format="rgb24")).resize(size, Image.BICUBIC)
                    )
    except (RequestError, MediaCancelled):
        raise
    except Exception:  # PyAV raises its own errors (and ValueError) for data it cannot decode
        raise RequestError(f"{where} {_UNDECODABLE}.", FIELD) from None
    if len(frames) != len(indices):  # the stream declared more frames than it holds (sized for those)
        indices = indices[: len(frames)]
    if not frames:
        raise RequestError(f"{where} holds no decodable frame.", FIELD)
    return Video(frames, indices, fps)


def _count_frames(container: Any, stream: Any, limit: int) -> int:
    """The frames of a stream whose container declares no count (mkv, webm), from its packets, stopping
    past `limit` (the caller refuses it then)."""
    n = 0
    for i, packet in enumerate(container.demux(stream)):
        if i % 256 == 0:
            media_pool.check_cancelled()
        n += 1 if packet.size else 0
        if i > limit:  # packets, not only frames: empty packets cost a read too
            return limit + 1
    return n


def _frames(container: Any, stream: Any, limit: int, where: str):
    """The stream's decoded frames, packet by packet: whether the request's client is still there is
    asked before each packet (a decode stops there once it left), and more than `limit` + 64 packets are
    refused (frames are charged to the request as they come; packets that give no frame are bounded
    here)."""
    for i, packet in enumerate(container.demux(stream)):
        media_pool.check_cancelled()
        if i > limit + 64:
            raise RequestError(f"{where} has over {limit} packets, more than this server decodes.", FIELD)
        yield from packet.decode()


def _sample(total: int, fps: float, config: VideoConfig) -> list[int]:
    """Qwen3VLVideoProcessor.sample_frames: `config.fps` frames a second, within [min_frames,
    max_frames] and the frames there are (and this server's MAX_VIDEO_FRAMES)."""
    n = int(total / fps * config.fps)
    n = min(max(n, config.min_frames), config.max_frames, total, MAX_VIDEO_FRAMES)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def video_patches(video: Video, config: VideoConfig) -> tuple[torch.Tensor, list[int]]:
    """The video's patches [t * h * w, C * T * P * P] (grid after grid, each in merge-block order) and its
    grid [t, h, w], as Qwen3VLVideoProcessor makes them from its resized frames."""
    p, tp, m = config.patch_size, config.temporal_patch_size, config.merge_size
    w, h = video.frames[0].size
    frames = video.frames + [video.frames[-1]] * (-len(video.frames) % tp)
    # One float32 array, normalized in place, and one copy into the patch layout: 24 bytes a pixel at
    # the peak (RESIZED_BYTES_PER_PIXEL with the frames' 3); temporaries made it ~36 before.
    pixels = np.empty((len(frames), h, w, 3), np.float32)  # [frames, H, W, C]
    for i, f in enumerate(frames):
        pixels[i] = np.asarray(f)
    pixels /= 255.0
    pixels -= np.array(config.mean, np.float32)
    pixels /= np.array(config.std, np.float32)
    gt, gh, gw, c = len(frames) // tp, h // p, w // p, pixels.shape[3]
    x = torch.from_numpy(pixels).view(gt, tp, gh // m, m, p, gw // m, m, p, c)
    # -> [t, h blocks, w blocks, h in block, w in block, C, T, P, P]
    x = x.permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return x.reshape(gt * gh * gw, c * tp * p * p).contiguous(), [gt, gh, gw]
