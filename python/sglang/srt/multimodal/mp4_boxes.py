"""The sample counts an ISO base media file (mp4, mov) declares, read from its boxes before FFmpeg opens
it (security review S2): FFmpeg's mov demuxer builds its index of a track's samples when it opens the
file, from counts that need no bytes behind them (a constant size in `stsz`, a count per entry in `stts`,
default sizes in a fragment's `trun`), so a 1,622-byte mp4 that claims 60,000,000 samples took 7.6 s
and 4 GB to open. `declared_samples` reads those counts without building anything, so a file that claims
more than a video can have is refused first.

Boxes: a 32-bit size (1: a 64-bit size follows the type; 0: to the end) and a 4-character type. The walk
descends the boxes that hold the sample tables and fragments, reads the counts, and stops at the first box
whose size does not fit (FFmpeg stops there too). A `cmov` box (QuickTime's zlib-compressed movie header,
which FFmpeg inflates before parsing) is refused: its counts cannot be read without inflating it; so is a
file of more boxes than its samples need (`MAX_BOXES`, `BOXES_PER_SAMPLE`, `MAX_FRAGMENT_BOXES`).
"""

from __future__ import annotations

import struct

# Boxes whose children the walk reads (the path to the sample tables and fragments, the movie header's
# compressed form).
CONTAINERS = frozenset({b"moov", b"trak", b"mdia", b"minf", b"stbl", b"moof", b"traf", b"edts", b"mvex"})
# Boxes whose entries each carry a count of samples (summed): their entries' size in bytes.
SUMMED = {b"stts": 8, b"ctts": 8, b"sbgp": 8}


# The most boxes walked whatever the file declares: a real file has a few per fragment (a 2-hour video
# cut in 1 s fragments, ~10 boxes each: 72,000). Past it, a file may have up to BOXES_PER_SAMPLE boxes a
# sample it has declared so far (a recorder's file fragmented at every frame has ~8 a sample, video and
# audio: 5 minutes at 30 fps are ~185,000), up to MAX_FRAGMENT_BOXES (~18 minutes of such a file at
# 60 fps: the 65,536 frames a request decodes). The walk is Python, ~2.5 us a box; FFmpeg's is C.
MAX_BOXES = 1 << 17
BOXES_PER_SAMPLE = 16
MAX_FRAGMENT_BOXES = 1 << 20


class Unreadable(ValueError):
    """The file's boxes cannot be counted: a compressed movie header (`cmov`), or too many boxes."""


def declared_samples(data: bytes) -> int:
    """The most samples `data` declares by one kind of table over all its tracks and fragments (sizes in
    `stsz`, durations in `stts`, fragment runs in `trun`, ...: FFmpeg indexes every track and fragment); 0
    for data that is not a box structure (a Matroska or AVI file). An audio track whose one `stts` entry
    has a duration of 1 (uncompressed audio: a sample per audio sample) is left out: FFmpeg indexes its
    chunks, not its samples (50,000,000 declared so opened in 0.01 s; with a duration of 2, 20,000,000
    took 0.18 s and 245 MB): what it adds is the entries FFmpeg makes from its chunks (`_chunk_entries`;
    a 43 KB mov of 300 chunks of 100,000,000 samples each made 290,000,000, 3.7 s and +670 MB, while it
    was left out). Unreadable for a `cmov` box, more than MAX_BOXES boxes and BOXES_PER_SAMPLE a sample
    declared before them, or more than MAX_FRAGMENT_BOXES."""
    totals: dict[bytes, int] = {}
    boxes = seen = 0  # boxes walked, samples declared so far (all tables)

    def add(into: dict[bytes, int], kind: bytes, n: int) -> None:
        into[kind] = into.get(kind, 0) + n

    def walk(start: int, end: int, depth: int, track: dict | None) -> None:
        nonlocal boxes, seen
        at = start
        while at + 8 <= end:
            boxes += 1
            if boxes > MAX_BOXES and (boxes > BOXES_PER_SAMPLE * seen or boxes > MAX_FRAGMENT_BOXES):
                limit = MAX_FRAGMENT_BOXES if boxes > MAX_FRAGMENT_BOXES else MAX_BOXES
                raise Unreadable(f"over {limit} boxes for the samples it declares")
            size, kind = struct.unpack_from(">I4s", data, at)
            head = 8
            if size == 1:
                if at + 16 > end:
                    return
                size, head = struct.unpack_from(">Q", data, at + 8)[0], 16
            elif size == 0:
                size = end - at
            if size < head or at + size > end:
                return
            body, stop = at + head, at + size
            if kind == b"cmov":
                raise Unreadable("a compressed movie header (cmov)")
            if kind == b"trak" and depth < 16:
                own = {"counts": {}, "handler": b"", "chunked": False, "stsc": None, "chunks": 0}
                walk(body, stop, depth + 1, own)
                if own["handler"] == b"soun" and own["chunked"]:
                    # FFmpeg indexes this track by chunk: it adds to the index beside the video's samples
                    add(totals, b"stsz", _chunk_entries(data, own["stsc"], own["chunks"]))
                else:
                    for k, n in own["counts"].items():
                        add(totals, k, n)
            elif kind in CONTAINERS and depth < 16:
                walk(body, stop, depth + 1, track)
            elif kind == b"hdlr" and track is not None and stop - body >= 12:
                # version/flags, pre-defined (QuickTime: the component type), handler type; QuickTime's
                # data handler (dhlr, in minf) is not the track's
                if data[body + 4 : body + 8] in (b"\0\0\0\0", b"mhlr"):
                    track["handler"] = data[body + 8 : body + 12]
            else:
                n = _counts(data, kind, body, stop)
                seen += n
                add(track["counts"] if track is not None else totals, kind, n)
                if kind == b"stts" and track is not None and stop - body >= 16:
                    entries, _, delta = struct.unpack_from(">III", data, body + 4)
                    track["chunked"] = entries == 1 and delta == 1
                elif kind == b"stsc" and track is not None:
                    track["stsc"] = (body, stop)
                elif kind in (b"stco", b"co64") and track is not None and stop - body >= 8:
                    # the chunks FFmpeg reads: the declared count, as far as the box holds them
                    width = 4 if kind == b"stco" else 8
                    declared = struct.unpack_from(">I", data, body + 4)[0]
                    track["chunks"] = min(declared, (stop - body - 8) // width)
            at = stop

    walk(0, len(data), 0, None)
    return max(totals.values(), default=0)


def _chunk_entries(data: bytes, stsc: tuple[int, int] | None, chunks: int) -> int:
    """The index entries FFmpeg makes for a track it indexes by chunk (uncompressed audio): for each chunk
    (`stco` / `co64`), its samples (from the `stsc` run it falls in) in packets of at least 160 samples
    (FFmpeg's packets are 1,024 samples, or the sample description's samples per frame when that is 160
    or more: a field of the file, so the smallest is assumed). At least one entry a chunk."""
    import numpy as np

    if not chunks:
        return 0
    if stsc is None or stsc[1] - stsc[0] < 8:
        return chunks
    body, stop = stsc
    entries = min(struct.unpack_from(">I", data, body + 4)[0], (stop - body - 8) // 12)
    if entries == 0:
        return chunks
    table = np.frombuffer(data, dtype=">u4", count=3 * entries, offset=body + 8).astype(np.int64)
    first, per_chunk = table[0::3], np.maximum(-(-table[1::3] // 160), 1)
    if np.any(np.diff(first) <= 0) or first[0] != 1:
        # FFmpeg walks the runs in order as the chunks reach them: with runs out of order a run may
        # cover every chunk left, so each chunk is counted at the largest run's packets
        return int(chunks * per_chunk.max())
    ends = np.minimum(np.append(first[1:], chunks + 1), chunks + 1)
    runs = np.maximum(ends - np.minimum(first, chunks + 1), 0)
    return int((runs * per_chunk).sum())


def _counts(data: bytes, kind: bytes, body: int, stop: int) -> int:
    """The samples one box declares (0 for a box that declares none)."""
    import numpy as np

    if stop - body < 12:
        return 0
    if kind in (b"stsz", b"stz2"):  # version/flags, sample size (stz2: reserved, field size), count
        return struct.unpack_from(">I", data, body + 8)[0]
    if kind in (b"trun", b"senc"):  # version/flags, count
        return struct.unpack_from(">I", data, body + 4)[0]
    if kind == b"saiz":  # version/flags, [aux info type, parameter], default size (1 byte), count
        at = body + 4 + (8 if struct.unpack_from(">I", data, body)[0] & 1 else 0) + 1
        return struct.unpack_from(">I", data, at)[0] if at + 4 <= stop else 0
    if kind in SUMMED:  # version/flags, [sbgp: grouping type, v1: its parameter], entry count, entries
        at = body + 8
        if kind == b"sbgp":
            at += 4 + (4 if data[body] == 1 else 0)
        if at > stop:
            return 0
        entries = min(struct.unpack_from(">I", data, at - 4)[0], (stop - at) // SUMMED[kind])
        table = np.frombuffer(data, dtype=">u4", count=2 * entries, offset=at)
        return int(table[0::2].sum(dtype=np.uint64))  # each entry's first field: its sample count
    return 0
