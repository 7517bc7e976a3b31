"""Reading a request's media items (`image_data`: a file path, base64 bytes, or a
`data:image/...;base64,` URI) into bytes and decoded images, each within this server's bounds.

Each image's header is read before its pixels, so an image over `MAX_IMAGE_PIXELS` is refused without
being decoded; remote URLs are refused (this server fetches nothing).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any

from sglang.srt.managers.request_validation import RequestError

FIELD = "image_data"
# The largest image decoded, in pixels (width x height): beyond it the decode alone takes seconds and
# gigabytes, whatever the processor then resizes it to.
MAX_IMAGE_PIXELS = 8192 * 8192
# The largest image file read from a path (base64 items are bounded by the request body's limit).
MAX_IMAGE_FILE_BYTES = 64 << 20


def _image_bytes(item: Any, where: str) -> bytes:
    if isinstance(item, bytes):
        return item
    if not isinstance(item, str) or not item:
        raise RequestError(f"{where} must be a file path, base64 or a data URI string.", FIELD)
    if item.startswith(("http://", "https://")):
        raise RequestError(
            f"{where} is a URL; this server does not fetch remote images: send the image as base64 or a data URI.",
            FIELD,
        )
    if item.startswith("data:"):
        header, _, item = item.partition(",")
        if ";base64" not in header:
            raise RequestError(f"{where} is a data URI that is not base64.", FIELD)
    elif os.path.isfile(item):  # a regular file: not a device or a pipe that never ends
        if os.path.getsize(item) > MAX_IMAGE_FILE_BYTES:
            raise RequestError(f"{where} is a file over {MAX_IMAGE_FILE_BYTES} bytes.", FIELD)
        with open(item, "rb") as f:
            return f.read(MAX_IMAGE_FILE_BYTES + 1)
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where} is neither an existing file, base64 nor a data URI.", FIELD) from None


def load_image(item: Any, where: str):
    """A decoded RGB PIL image, or a RequestError naming `where`."""
    from PIL import Image

    data = _image_bytes(item, where)
    # This server's bound replaces PIL's (whose error on opening hides the size): checked below.
    Image.MAX_IMAGE_PIXELS = None
    try:
        with Image.open(io.BytesIO(data)) as probe:  # reads the header only
            width, height = probe.size
            if width * height > MAX_IMAGE_PIXELS:
                raise RequestError(
                    f"{where} is {width}x{height} pixels, over the {MAX_IMAGE_PIXELS} this server decodes.",
                    FIELD,
                )
            return probe.convert("RGB")
    except RequestError:
        raise
    except Exception as e:  # PIL raises many types for corrupt or unknown data
        raise RequestError(f"{where} could not be decoded as an image ({type(e).__name__}).", FIELD) from None
