"""The media flags (docs/multimodal.md, "Limits and errors"): which local files and remote URLs a request's
`image_data` / `video_data` may make the server read, and how many items a prompt may carry. Their
command line and their checks, each refusal one sentence naming the flag; the rules themselves are
`multimodal/media_io.py` and `multimodal/media_fetch.py`.

Names: upstream SGLang's `--allowed-media-domains`, `--media-url-max-file-size-mb` and
`--limit-mm-data-per-request` (its JSON format); vLLM's `--allowed-local-media-path` (upstream SGLang has
no flag for local files); `--disable-media-url-fetch` is this server's (neither has one).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from typing import TYPE_CHECKING, Any

from sglang.srt.server_args_checks import ServerArgsError

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

# The modality of each media field, as upstream's --limit-mm-data-per-request keys name them (this
# server serves images and videos; an `audio` limit is taken and has nothing to limit).
MODALITY = {"image_data": "image", "video_data": "video", "audio_data": "audio"}
MODALITIES = tuple(MODALITY.values())
# Items one prompt may carry when --limit-mm-data-per-request does not say (upstream: no limit). Each
# item is read, header-checked and decoded before the prompt's length is known, so the bound is on
# that work, not on the context. Images: 32 covers multi-image prompts as the published Qwen3.5 chat
# examples write them (a few images) with room to spare (each up to MAX_IMAGE_PIXELS, 192 MiB as RGB).
# Videos: 2 - the examples send one; two allow a comparison; each may decode up to 2^31 pixels (~10 s
# of one core), and all of a request's items share one such budget (media_io).
DEFAULT_MEDIA_LIMITS = {"image": 32, "video": 2}


def add_media_cli_args(parser: argparse.ArgumentParser, default: Any) -> None:
    g = parser.add_argument_group(
        "media",
        "What image_data and video_data may make the server read (docs/multimodal.md, 'Limits and errors').",
    )
    g.add_argument(
        "--allowed-local-media-path",
        default=default("allowed_local_media_path"),
        metavar="DIR",
        help="HTTP requests may name image and video files inside this directory (after following symlinks). "
        "Default: none (HTTP requests may not name local files; Engine.generate may name any).",
    )
    g.add_argument(
        "--limit-mm-data-per-request",
        type=_json_object,
        default=default("limit_mm_data_per_request"),
        metavar="JSON",
        help="Most media items per prompt, by modality, e.g. '{\"image\": 8, \"video\": 1}'; refused "
        f"before any is read. Default: {json.dumps(DEFAULT_MEDIA_LIMITS)} (a key given replaces its "
        "default).",
    )
    g.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=default("allowed_media_domains"),
        metavar="HOST",
        help="Fetch http(s) media URLs only from these exact host names (redirects too); a host named "
        "here may resolve to a private address. Default: any host with only public addresses.",
    )
    g.add_argument(
        "--media-url-max-file-size-mb",
        type=int,
        default=default("media_url_max_file_size_mb"),
        help="Most MiB one media URL may send (checked while streaming); 0: no limit.",
    )
    g.add_argument(
        "--disable-media-url-fetch",
        action="store_true",
        help="Refuse http(s) media URLs (a 400): the server fetches nothing.",
    )


def _json_object(raw: str) -> dict:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not JSON: {raw!r}") from None
    return value


def check_media_flags(args: ServerArgs) -> None:
    """Resolve and check the media flags (each refusal one sentence naming its flag)."""
    if args.allowed_local_media_path is not None:
        path = os.path.realpath(args.allowed_local_media_path)
        if not os.path.isdir(path):
            raise ServerArgsError(
                f"--allowed-local-media-path {args.allowed_local_media_path} is not an existing directory."
            )
        args.allowed_local_media_path = path
    limits = args.limit_mm_data_per_request
    if limits is None:
        limits = {}
    if not isinstance(limits, dict) or any(k not in MODALITIES for k in limits):
        raise ServerArgsError(
            "--limit-mm-data-per-request must be a JSON object with keys among "
            f"{', '.join(MODALITIES)}, e.g. '{{\"image\": 8}}'."
        )
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in limits.values()):
        raise ServerArgsError("--limit-mm-data-per-request values must be integers >= 0.")
    args.limit_mm_data_per_request = {**DEFAULT_MEDIA_LIMITS, **limits}
    if args.media_url_max_file_size_mb < 0:
        raise ServerArgsError("--media-url-max-file-size-mb must be >= 0 (0: no limit).")
    if args.allowed_media_domains:
        args.allowed_media_domains = sorted(
            {normalize_host(d, "--allowed-media-domains") for d in args.allowed_media_domains}
        )


def normalize_host(host: str, flag: str | None = None) -> str:
    """`host` as compared against --allowed-media-domains: lower case, IDNA, no trailing dot; an IP
    address in its canonical form. With `flag`, a value that is not a bare host name is a ServerArgsError."""
    name = host.strip().rstrip(".").lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    bad = not name or any(c in name for c in "/?#@:\\ ")
    try:
        name = name.encode("idna").decode("ascii")
    except UnicodeError:
        bad = True
    if bad and flag is not None:
        raise ServerArgsError(
            f"{flag} {host!r} is not a host name (give names only: no scheme, port or path)."
        )
    return name
