"""Reading a request's media items (`image_data`: an http(s) URL, a file path or `file://` URI, base64
bytes, or a `data:image/...;base64,` URI) into bytes and decoded images, each within this server's bounds.

Who may name what (`MediaPolicy`, from the media flags in `server_args_media.py`):
- the number of items is checked first, before any is read (--limit-mm-data-per-request);
- a file path is read for an in-process caller (`Engine.generate`: `trusted`) wherever it is; for an HTTP
  client only when it resolves (symlinks followed) inside --allowed-local-media-path, and the refusal of
  any other path says the same whether the file exists or not;
- a URL is fetched by `media_fetch` (off the event loop, in this reader's own fetch threads, so URLs that
  never answer cannot hold the threads that decode other requests' images), for every caller alike.

`MediaReader.read` turns every item into bytes before the image processor sees it; `load_image` then
reads each image's header before its pixels, so an image over the request's per-image bound
(`PixelBudget.per_item`: `DECODE_MARGIN` x the checkpoint's max_pixels, at least `PHOTO_PIXELS`) is
refused undecoded, or, a JPEG, decoded at a reduced scale (`Image.draft`) when that fits. Reads, decodes
and processing run in `media_pool` (its own threads, the requests in turn, dropped with their client).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import math
import os
import stat
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.managers.request_validation import RequestError
from sglang.srt.multimodal.media_fetch import ByteBudget, FetchPolicy, FetchScope, fetch_url, is_url
from sglang.srt.multimodal.media_pool import MediaJob
from sglang.srt.server_args_media import DEFAULT_MEDIA_LIMITS, MODALITY

FIELD = "image_data"
# The largest image decoded, in pixels (width x height), whatever the checkpoint: beyond it the decode
# alone takes seconds and gigabytes, whatever the processor then resizes it to.
MAX_IMAGE_PIXELS = 8192 * 8192
# An image decodes to at most this many times the pixels the checkpoint's processor resizes it to (its
# max_pixels): up to 2x its side, where a resize still averages real detail; beyond that the extra pixels
# only cost CPU and memory (a 1-bit 8192x8192 PNG is 11 KB and took 2.6 s to decode and process).
DECODE_MARGIN = 4
# ... but at least this many (4096x4096): a 12-16 megapixel phone picture (4032x3024, 4656x3496) is
# taken on any checkpoint, as it was before this bound, however small its max_pixels.
PHOTO_PIXELS = 1 << 24
# The largest image file read from a path (base64 items are bounded by the request body's limit).
MAX_IMAGE_FILE_BYTES = 64 << 20
# Longest string tried as a file path (Linux's PATH_MAX): a base64 image is not resolved as one.
MAX_PATH_CHARS = 4096
# URL fetches running at once, over all requests; a fetch holds its thread until its deadline at most.
FETCH_THREADS = 16
# URL fetches of one request running at once: a request of many never-answering URLs holds at most
# these of the FETCH_THREADS (several such requests at once still can hold them all: docs/multimodal.md).
FETCHES_PER_REQUEST = 4
# The most pixels decoded for one request, over all its prompts' images and video frames: 32 images
# of MAX_IMAGE_PIXELS, or one video's bound (video.MAX_DECODED_PIXELS).
MAX_DECODED_PIXELS_PER_REQUEST = 1 << 31
# The most video frames decoded for one request, over all its video files: a frame's decode costs ~12 us
# however small it is (a 4.6 MB mkv of 300,000 16x16 frames took 5.5 s of CPU within the pixel bound), so
# tiny frames are bounded by their count: 65,536 is 36 min at 30 fps; the pixel bound already stops any
# video of frames over 181x181 pixels sooner.
MAX_DECODED_FRAMES_PER_REQUEST = 1 << 16
# Bytes a decoded image may hold per pixel while it is decoded and processed (its mode's pixels, the RGB
# copy, the resized copy and the processor's arrays), for the process's media memory budget
# (`media_pool.MediaMemory`). Measured: 8.0 bytes a pixel peak RSS for a 4096x4096 RGB or RGBA PNG
# through the processor's `_image`; 9 leaves a margin.
IMAGE_BYTES_PER_PIXEL = 9
# How deep each field's lists nest for one prompt: a list of images; a list of videos, each a file or
# a list of frames. A batch adds one level (one entry per prompt).
DEPTH = {"image_data": 1, "video_data": 2}


class PixelBudget(ByteBudget):
    """The pixels one request's images and the video frames its model gets may still decode (`take(n)`
    False once over), the most one image (or video frame) may decode to (`per_item`), every pixel the
    request may decode (`decoded`: a video file's frames between those sampled too, which cost a decode
    but no processing) and the video frames it may decode (`frames`)."""

    def __init__(
        self,
        limit: int | None = None,
        per_item: int = MAX_IMAGE_PIXELS,
        decoded_limit: int = MAX_DECODED_PIXELS_PER_REQUEST,
        frames_limit: int = MAX_DECODED_FRAMES_PER_REQUEST,
    ):
        super().__init__(MAX_DECODED_PIXELS_PER_REQUEST if limit is None else limit)
        self.per_item = per_item
        self.decoded = ByteBudget(decoded_limit)
        self.frames = ByteBudget(frames_limit)

    @classmethod
    def for_model(cls, max_pixels: int | None, context_len: int, pixels_per_token: int) -> PixelBudget:
        """A request's budget on a checkpoint whose processor resizes images to at most `max_pixels`
        (None: unknown) and turns `pixels_per_token` of them into a token: an image decodes to at most
        `DECODE_MARGIN` x max_pixels (at least `PHOTO_PIXELS`); all of the request's images and frames to
        at most `DECODE_MARGIN` x the pixels its context holds as tokens (at least one image's bound)."""
        per_item = MAX_IMAGE_PIXELS
        if max_pixels:
            per_item = min(MAX_IMAGE_PIXELS, max(DECODE_MARGIN * max_pixels, PHOTO_PIXELS))
        total = max(per_item, DECODE_MARGIN * context_len * pixels_per_token)
        return cls(min(total, MAX_DECODED_PIXELS_PER_REQUEST), per_item)


class RequestReads:
    """What all of one request's reads share: its bytes, its URL fetches running at once (their number
    and their connections, cut when one of its reads fails)."""

    def __init__(self, job: MediaJob | None = None):
        self.budget = ByteBudget()
        self.job = job or MediaJob()  # the request's turn in the media pool
        self.fetches = asyncio.Semaphore(FETCHES_PER_REQUEST)
        self.scope = FetchScope()


@dataclass(frozen=True)
class MediaPolicy:
    """What a request's media items may make this server read (docs/multimodal.md)."""

    # HTTP clients may name files inside this directory (a realpath); None: no file.
    allowed_local_media_path: str | None = None
    # Most items per prompt of a request, by modality (--limit-mm-data-per-request).
    limit_per_request: dict[str, int] = field(
        default_factory=lambda: dict(DEFAULT_MEDIA_LIMITS)
    )
    # How URLs are fetched; None: they are refused (--disable-media-url-fetch).
    fetch: FetchPolicy | None = field(default_factory=FetchPolicy)

    @classmethod
    def from_server_args(cls, args: Any) -> MediaPolicy:
        fetch = None
        if not args.disable_media_url_fetch:
            mb = args.media_url_max_file_size_mb
            fetch = FetchPolicy(frozenset(args.allowed_media_domains or ()), mb << 20 if mb else None)
        return cls(args.allowed_local_media_path, dict(args.limit_mm_data_per_request), fetch)


class MediaReader:
    """Reads requests' media items into bytes under one `MediaPolicy`, off the event loop."""

    def __init__(self, policy: MediaPolicy):
        self.policy = policy
        self._fetch_threads = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="media-fetch")

    def close(self) -> None:
        self._fetch_threads.shutdown(wait=False, cancel_futures=True)

    async def read(
        self, data: Any, param: str, is_batch: bool, trusted: bool, shared: RequestReads | None = None
    ) -> Any:
        """`data` (one item, a list, or for a batch one entry per prompt) with every item as bytes.
        `shared`: the request's bytes and fetch slots, shared by the reads of its fields (default: this
        read's own). RequestError naming `param` for lists nested deeper than the field allows or too
        many items (before any is read) or a URL it may not fetch;
        a local item it may not read stays as its RequestError, raised where the processor reads it
        (`read_local`), so that the processor's checks of the prompt (its placeholders) come first."""
        self.check_count(data, param, is_batch)
        fetch = self.policy.fetch
        deadline = time.monotonic() + (fetch.timeout_s if fetch is not None else 0.0)
        shared = shared or RequestReads()
        budget = shared.budget
        loop = asyncio.get_running_loop()

        async def one(item: Any, where: str) -> Any:
            if isinstance(item, bytes) or item is None:
                return item
            if is_url(item):
                if fetch is None:
                    raise RequestError(
                        f"{where} is a URL, and this server fetches none (--disable-media-url-fetch): "
                        "send the image as base64 or a data URI.",
                        param,
                    )
                async with shared.fetches:
                    args = (item, where, param, fetch, deadline, budget, shared.scope)
                    return await loop.run_in_executor(self._fetch_threads, fetch_url, *args)
            # An HTTP client's files count against the request's bytes as its URLs do.
            files_budget = None if trusted else budget
            args = (item, where, param, self.policy, trusted, files_budget)
            return await shared.job.run(_read_or_error, *args)

        async def walk(node: Any, where: str, depth: int) -> Any:
            # check_count refused lists deeper than the field's shape: a batch's prompts, a prompt's
            # items, a video's frames.
            if isinstance(node, list):
                return list(await _gather(walk(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(node)))
            return await one(node, where)

        try:
            return await walk(data, param, 0)
        except BaseException:  # refused (or the client gone): its fetches still running end now
            shared.scope.cancel()
            raise

    def check_count(self, data: Any, param: str, is_batch: bool) -> None:
        """Refuse lists nested deeper than the field's shape, and a prompt with more items than
        --limit-mm-data-per-request allows (a video counts once, whether a file or a list of frames)."""
        modality = MODALITY.get(param, param)
        depth = DEPTH.get(param, 1)
        entries = data if is_batch and isinstance(data, list) else [data]
        for p, entry in enumerate(entries):
            which = f"{param}[{p}]" if is_batch else param
            if _nests_deeper(entry, depth):
                shape = "a list of items"
                if depth == 2:
                    shape = "a list of videos, each a file or a list of frames"
                raise RequestError(f"{which} nests lists deeper than {shape}.", param)
            n = len(entry) if isinstance(entry, list) else int(entry is not None)
            limit = self.policy.limit_per_request.get(modality)
            if limit is not None and n > limit:
                raise RequestError(
                    f"{which} has {n} {modality} items; this server takes at most {limit} per prompt "
                    "(--limit-mm-data-per-request).",
                    param,
                )


def _nests_deeper(node: Any, depth: int) -> bool:
    """Whether lists nest in `node` more than `depth` levels (looked at no deeper than that)."""
    if not isinstance(node, list):
        return False
    return depth == 0 or any(_nests_deeper(v, depth - 1) for v in node)


async def _gather(coros) -> list[Any]:
    """The results in order; the first failure cancels the rest (so queued fetches never start)."""
    tasks = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:  # noqa: F821 (a builtin since Python 3.11)
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


def _read_or_error(
    item: Any, where: str, param: str, policy: MediaPolicy, trusted: bool, budget: ByteBudget | None
) -> Any:
    try:
        return read_local(item, where, param, policy, trusted, budget)
    except RequestError as e:
        return e


def read_local(
    item: Any, where: str, param: str, policy: MediaPolicy, trusted: bool, budget: ByteBudget | None = None
) -> bytes:
    """The bytes of a file path, `file://` URI, base64 string or base64 data URI (not a URL); an item
    `MediaReader.read` could not read is its RequestError, raised here. A file read is charged to
    `budget` (the request's bytes) when one is given."""
    if isinstance(item, RequestError):
        raise item
    if not isinstance(item, str) or not item:
        raise RequestError(f"{where} must be a URL, a file path, base64 or a data URI string.", param)
    if item.startswith("data:"):
        header, _, payload = item.partition(",")
        if ";base64" not in header:
            raise RequestError(f"{where} is a data URI that is not base64.", param)
        return _b64(payload, where, param, "a data URI whose payload is not base64")
    if item.startswith("file://"):
        path = urllib.parse.unquote(urllib.parse.urlsplit(item).path)
        data = _allowed_file(path, where, param, policy, trusted, budget)
        if data is None:
            raise RequestError(_not_readable(where, policy, trusted), param)
        return data
    data = _allowed_file(item, where, param, policy, trusted, budget)
    if data is not None:
        return data
    return _b64(item, where, param, None, _not_readable(where, policy, trusted))


def _b64(text: str, where: str, param: str, what: str | None, message: str | None = None) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(message or f"{where} is {what}.", param) from None


def _not_readable(where: str, policy: MediaPolicy, trusted: bool) -> str:
    """The refusal of a string that is no readable item: the same whether a file of that name exists
    (for an HTTP client) or not, so that it cannot probe the server's files."""
    if trusted:
        return f"{where} is neither an existing file, base64, a data URI nor an http(s) URL."
    if policy.allowed_local_media_path is None:
        return (
            f"{where} is not base64, a data URI or an http(s) URL (HTTP requests may name no local file: "
            "this server sets no --allowed-local-media-path)."
        )
    return f"{where} is not base64, a data URI, an http(s) URL, nor a file inside --allowed-local-media-path."


def _allowed_file(
    path: str, where: str, param: str, policy: MediaPolicy, trusted: bool, budget: ByteBudget | None
) -> bytes | None:
    """The file's bytes if this caller may read `path` and it is a regular file; else None."""
    if len(path) > MAX_PATH_CHARS or "\0" in path:
        return None
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO must not block the open
    if not trusted:
        root = policy.allowed_local_media_path
        if root is None:
            return None
        path = os.path.realpath(path)
        if not _inside(path, root):
            return None
        flags |= getattr(os, "O_NOFOLLOW", 0)  # a link swapped in after the realpath is not followed
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        # O_NOFOLLOW guards the last component only: a directory above it swapped for a link after the
        # realpath would lead out of the root. The file opened is where its descriptor says it is.
        if not trusted and not _inside(_opened_path(fd, path), policy.allowed_local_media_path):
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a device or a pipe could never end
            return None
        if st.st_size > MAX_IMAGE_FILE_BYTES:
            raise RequestError(f"{where} is a file over {MAX_IMAGE_FILE_BYTES} bytes.", param)
        if budget is not None and not budget.take(st.st_size):
            raise RequestError(
                f"{where}: the request's files and URLs hold over {budget.limit} bytes.", param
            )
        data = f.read(MAX_IMAGE_FILE_BYTES + 1)
    if len(data) > MAX_IMAGE_FILE_BYTES:  # grew since the fstat
        raise RequestError(f"{where} is a file over {MAX_IMAGE_FILE_BYTES} bytes.", param)
    return data


def _opened_path(fd: int, path: str) -> str:
    """The real path of the file open as `fd` (Linux's /proc; elsewhere the path resolved again)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)


def _inside(path: str, root: str | None) -> bool:
    return root is not None and os.path.commonpath([path, root]) == root


def load_image(item: Any, where: str, pixels: PixelBudget | None = None, target: int | None = None):
    """A decoded RGB PIL image, or a RequestError naming `where`. `item` is bytes (`MediaReader.read`
    made it so) or a base64 / data-URI string; a path or URL is not read here. Its size is read from its
    header and held to `pixels.per_item`, and its pixels charged to `pixels` (the request's), before it is
    decoded. `target`: the most pixels the processor resizes it to (its max_pixels); a JPEG over the bound
    is then decoded at 1/2, 1/4 or 1/8 scale (never below `target`) when that fits."""
    from PIL import Image

    if is_url(item):  # `MediaReader.read` fetches URLs; one here came past it
        raise RequestError(f"{where} is a URL, which this reader does not fetch.", FIELD)
    data = item if isinstance(item, bytes) else read_local(item, where, FIELD, MediaPolicy(), trusted=False)
    bound = MAX_IMAGE_PIXELS if pixels is None else pixels.per_item
    # This server's bound replaces PIL's (whose error on opening hides the size): checked below.
    Image.MAX_IMAGE_PIXELS = None
    try:
        with Image.open(io.BytesIO(data)) as probe:  # reads the header only
            width, height = probe.size
            if width * height > bound and target and probe.format == "JPEG":
                scale = math.sqrt(target / (width * height))
                probe.draft("RGB", (math.ceil(width * scale), math.ceil(height * scale)))
                width, height = probe.size  # the DCT scale it decodes at (1, 1/2, 1/4 or 1/8)
            if width * height > bound:
                side = math.isqrt(bound)
                raise RequestError(
                    f"{where} is {width}x{height} pixels ({width * height}), over the {bound} this server "
                    f"decodes per image for this model (about {side}x{side}); send it smaller.",
                    FIELD,
                )
            charge(pixels, width * height, where, FIELD)
            return probe.convert("RGB")
    except RequestError:
        raise
    except Exception as e:  # PIL raises many types for corrupt or unknown data
        raise RequestError(f"{where} could not be decoded as an image ({type(e).__name__}).", FIELD) from None


def image_bytes(item: Any, pixels: PixelBudget | None = None) -> int:
    """The decoded bytes an image item may hold (`IMAGE_BYTES_PER_PIXEL` x its header's size, at most the
    per-image bound: a larger one is refused or decoded at a reduced scale), read from its header only;
    0 when it has none (it is refused undecoded). What it reserves in the process's media memory."""
    from PIL import Image

    bound = MAX_IMAGE_PIXELS if pixels is None else pixels.per_item
    try:
        data = item if isinstance(item, bytes) else read_local(item, "", FIELD, MediaPolicy(), trusted=False)
        Image.MAX_IMAGE_PIXELS = None
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
    except Exception:  # not an image: load_image refuses it without decoding
        return 0
    return min(width * height, bound) * IMAGE_BYTES_PER_PIXEL


def charge(pixels: PixelBudget | None, n: int, where: str, param: str, used: bool = True) -> None:
    """Take `n` decoded pixels from the request's budget (`used`: an image or a frame the model gets; else
    a video frame decoded to reach the next sampled one, charged to `decoded` only); RequestError naming
    `param` once it is spent."""
    if pixels is None:
        return
    if not pixels.decoded.take(n):
        raise RequestError(
            f"{where}: the request's images and video files decode to over {pixels.decoded.limit} pixels "
            "together (the frames between those sampled included).",
            param,
        )
    if used and not pixels.take(n):
        raise RequestError(
            f"{where}: the request's images and videos decode to over {pixels.limit} pixels together.", param
        )
