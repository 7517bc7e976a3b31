"""How much disk the `file` backend's tier (`disk_tier.py`) may take: sizes as upstream writes them, the
budget at start against the filesystem's free space, and how many TP ranks share that free space.

The free space of the folder's filesystem is everyone's: at start each rank's budget is capped at
`FREE_SHARE` of its share of it (the filesystem's free space over the ranks that draw on it, plus the
entries the rank's own folder holds), and never leaves `min_free_bytes` free. Ranks draw on one
filesystem when they see each other's folder (a marker file each writes under the storage root: one
folder shared by every rank, on one node or on a network filesystem mounted by several) or when they run
on one node with their roots on one device (`st_dev`). Without that split, 8 ranks on one shared folder
each took half the free space: 4x it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

logger = logging.getLogger(__name__)

FREE_SHARE = 0.5  # the most of a rank's share of the free space (with its own entries) its budget takes
MIN_FREE_BYTES = 1 << 30  # the free space a write never takes the filesystem below, by default
SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
IEC = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
MARKER = ".rank-{}.share"
MARKER_NAME = re.compile(r"^\.rank-[0-9a-f]{16}\.share$")
NO_CAP = 1 << 62  # SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE=0 (upstream: no cap; here the free space caps it)


def parse_size(raw: str) -> int:
    """Bytes of a size as upstream's file backend reads its variables (its `human_readable_int`): a byte
    count, or a number with an SI suffix (k, M, G, T: 10G is 10**10) or an IEC one (Ki, Mi, Gi, Ti: 1Gi
    is 2**30, whole numbers only); suffixes are case-sensitive (10g, 1K are not sizes)."""
    m = SIZE.match(raw.strip())
    if m is None or (m[2] is None and "." in m[1]) or (m[2] in IEC and "." in m[1]):
        raise ValueError(f"{raw!r} is not a size")
    number, suffix = m.groups()
    if suffix is None:
        return int(number)
    if suffix in IEC:
        return int(number) * IEC[suffix]
    return int(Decimal(number) * SI[suffix])


def free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None  # (unknown: a write's own failure is caught)


def filesystem_id(path: str) -> tuple[str, int] | None:
    """(this node, the device `path` is on): equal for two folders on one filesystem of one node."""
    try:
        return socket.gethostname(), os.stat(path).st_dev
    except OSError:
        return None


def ranks_sharing(root: str | None, gather: Callable[[Any], list[Any]]) -> int:
    """How many TP ranks, this one included, draw on the free space of `root`'s filesystem (None: a
    folder refused on this rank, which refuses to start anyway). Every rank calls this at once (two
    all-gathers) and none raises: each writes a marker under `root`, then counts the ranks whose marker
    it sees or whose root is on its own node and device; the markers go once every rank looked."""
    token, marker, fs = secrets.token_hex(8), None, None
    if root is not None:
        marker, fs = os.path.join(root, MARKER.format(token)), filesystem_id(root)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            os.close(os.open(marker, flags, 0o600))
        except OSError:
            marker = None  # (then only the node and device tell)
    everyone = gather((token, fs))
    def shares(tok: str, other: tuple[str, int] | None) -> bool:
        return (fs is not None and other == fs) or os.path.exists(os.path.join(root, MARKER.format(tok)))

    n = 0 if root is None else sum(shares(tok, other) for tok, other in everyone)
    gather(None)  # (no marker goes before every rank looked)
    if marker is not None:
        try:
            os.unlink(marker)
        except OSError:
            pass
    return max(1, n)


def reap_stale_markers(root: str, age_s: float) -> None:
    """Delete the markers under `root` older than `age_s` (left by a rank killed between writing its own
    and deleting it: `ranks_sharing` deletes it within its start; a fresh one may be a rank's starting)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for fname in filter(MARKER_NAME.match, names):
        path = os.path.join(root, fname)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime > age_s:
                os.unlink(path)
        except OSError:
            pass


def start_budget(folder: str, asked: int, asked_by: str, held: int, min_free: int, ranks: int) -> int:
    """The budget at start: at most `asked`, `FREE_SHARE` of this rank's share of the free space (its own
    entries, `held`, counted as its space) and what keeps `min_free` free over the `ranks` sharing it;
    logged in one line naming the variable that asked (a warning when capped)."""
    free = free_bytes(folder)
    budget = asked
    if free is not None:
        usable = free // ranks + held
        budget = max(0, min(asked, int(usable * FREE_SHARE), usable - min_free // ranks))
    gib = 1 << 30
    log = logger.warning if budget < asked else logger.info
    log("HiCache disk tier %s: budget %.2f GiB (%s %s, %s GiB free, %.2f GiB held, %d rank(s) sharing "
        "the free space; at most half a rank's share, never below %.2f GiB free)", folder, budget / gib,
        asked_by, "no cap" if asked >= NO_CAP else f"{asked / gib:.2f} GiB", "?" if free is None else
        f"{free / gib:.2f}", held / gib, ranks, min_free / gib)  # fmt: skip
    return budget
