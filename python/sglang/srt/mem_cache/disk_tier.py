"""`FileStorage`: the `file` storage backend of the hierarchical cache (`--hicache-storage-backend file`),
a third tier on disk under `$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR` (upstream's variable; default
/tmp/hicache), in a folder per fingerprint (`tree_cache_factory.disk_fingerprint`: the model's weight
files, the pools' real dtypes and shapes, quantization, device, page size, rank), so a server never reads
entries of other weights or another layout.

Write-through from host: every checkpoint backed up to host is also written to disk, one file per
checkpoint, `<name>-<length>.pt` (the whole path's KV of every full-attention layer and the state), name
being a SHA-256 of the namespace and the tokens (no token is stored). A checkpoint backed up with a
deeper one whose entry holds its KV (the repeat point: `HiMambaRadixCache.take_host_copies`) is a
state-only entry, `<name>-<length>+<base>.pt`: its state, and its KV read from the first `length`
positions of the base entry's file (a prompt served in one batch wrote 1.76x its entry's bytes as two
whole entries). A base entry deleted takes its state-only entries with it; at start one whose base file
is gone (or is not a longer whole entry) is skipped and deleted; one whose base is not on disk when it is
written is written whole (`disk_writes_base_missing`). A name stored both whole and state-only (two
servers on one folder) keeps the whole file, the other deleted (`_add`). A file is written under a unique
temporary name, synced and renamed: an entry exists once its file does. The index (name -> length, bytes,
base, in LRU order) gains an entry only after its file is renamed into place, and is rebuilt from the
file names at start (the tier survives a restart); files that are not entries are skipped with a warning,
and a crash's temporary files and `disk_budget` markers an hour old deleted. The folder holds at most the
budget (`DiskTierConfig.max_bytes`: `$SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE`, upstream's, or
`$SGLANG_HICACHE_FILE_BACKEND_MAX_GB`, default 16 GiB): a write that would pass it first deletes least
recently used entries until the tier holds `eviction_ratio` of it with the write
(`$SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO`, upstream's, default 0.9).

Free space (the default folder is under /tmp, which the whole host shares and which may be memory): at
start the budget is capped at half of this rank's share of what the folder's filesystem has free (with
what the tier holds already; the ranks that share the filesystem split it: `disk_budget.py`), leaving
`min_free_bytes` free (`$SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE`, upstream's name and sizes:
`parse_size`; default 1 GiB here, no floor upstream unless set), and the budget chosen is logged in one
line. A write that would leave less than that free first deletes least recently used entries, and is
skipped (counted: `disk_writes_low_space`), deleting none, where deleting all of them would not do.

Never a crash from disk: a write that fails (disk full, folder gone) is skipped; a read that fails or
finds a file of the wrong layout drops the entry and the hit is not taken; both counted (`disk_*_errors`)
and logged. Reads run on the scheduler thread at admission (`stage`), so a failed read is known before
the host tree takes the entry; the staged tensors go into the host pools on the forward stream in order
with the host copies (`apply`). Writes read the host pools, so they run on the forward stream too
(`HiCacheController.record`), after the host copy they read.

Tensor parallelism: each rank stores its own shard (the fingerprint names the rank and --tp-size, so a
rank never reads another's files), and the ranks' indexes may differ (a write that failed on one rank, a
write still running, an entry trimmed or dropped on one). A hit changes the host and device trees, which
must stay the same on every rank: so the ranks agree on it (`gather`, an all-gather of host ints over a
gloo group of the tree cache's own): the deepest entry is the deepest length every rank holds, and a read
is taken only where it succeeded on every rank.

Safety: the folders are created 0700; one that is a symlink or owned by another user is refused at
start; files are opened without following symlinks and loaded with `weights_only=True`.

After an in-place weight update the tier is off until restart (`weights_changed`): its entries belong to
the weights on disk, and entries of the updated weights would poison the folder for the next server.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import stat
import threading
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.mem_cache import disk_budget
from sglang.srt.mem_cache.disk_budget import MIN_FREE_BYTES, free_bytes, parse_size, start_budget
from sglang.srt.mem_cache.host_pool import HostPools

logger = logging.getLogger(__name__)

ENTRY = re.compile(r"^([0-9a-f]{64})-([0-9]+)(?:\+([0-9a-f]{64}))?\.pt$")
DIR_VAR = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
STALE_TMP_S = 3600
AGREED_KEYS = 64  # agreed `deepest` answers kept under TP (the oldest dropped first)
__all__ = ["DiskTierConfig", "DiskTierError", "FileStorage", "entry_name", "parse_size", "safe_dir"]


class DiskTierError(ValueError):
    """The disk tier's folder cannot be used safely (a startup error)."""


@dataclass
class DiskTierConfig:
    root: str
    fingerprint: str
    max_bytes: int
    min_free_bytes: int = MIN_FREE_BYTES
    eviction_ratio: float = 0.9  # (upstream's default)
    max_bytes_from: str = "SGLANG_HICACHE_FILE_BACKEND_MAX_GB"
    ranks: int = 1  # the TP ranks drawing on the free space of the folder's filesystem (`ranks_sharing`)


def safe_dir(path: str) -> None:
    """Create `path` 0700 if needed; refuse a symlink, a non-folder or another user's folder."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        problem = f"cannot be created ({e.strerror})"
    else:
        problem = (
            "is a symlink or not a folder"
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode)
            else "is owned by another user" if st.st_uid != os.geteuid() else None
        )
    if problem is not None:
        raise DiskTierError(f"{DIR_VAR} folder {path} {problem}; set it to a folder of yours.")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def entry_name(key, namespace: str | None) -> str:
    key = key if isinstance(key, array) else array("q", key)
    return hashlib.sha256(repr(namespace).encode() + key.tobytes()).hexdigest()


class FileStorage:
    def __init__(self, config: DiskTierConfig, host: HostPools, stats: Counter):
        self.host, self.page, self.stats = host, host.page_size, stats
        self.max_bytes, self.min_free = config.max_bytes, config.min_free_bytes
        self.ratio = config.eviction_ratio
        self.ranks = config.ranks
        safe_dir(config.root)
        disk_budget.reap_stale_markers(config.root, STALE_TMP_S)  # (as a crash's .tmp files below)
        self.dir = os.path.join(config.root, hashlib.sha256(config.fingerprint.encode()).hexdigest()[:16])
        safe_dir(self.dir)
        self.enabled = True
        self.lock = threading.Lock()  # the index changes on the forward stream (writes) and here
        # name -> (length, bytes, base: the entry holding its KV, or None), LRU first
        self.index: OrderedDict[str, tuple[int, int, str | None]] = OrderedDict()
        self.dependents: dict[str, set[str]] = {}  # base -> its state-only entries
        self.lengths: Counter = Counter()  # entry lengths present
        self.total = 0
        self.pending: set[str] = set()  # writes recorded, not yet run
        # Tensor parallelism: every rank's value of what it is given, on every rank (None at one rank).
        self.gather: Callable[[Any], list[Any]] | None = None
        # Under TP, the agreed answers of `deepest` by the key's digest (`entry_name` of the namespace and
        # the whole key: 64 characters where the key's bytes are 1 MiB at 128k tokens), reused until
        # `forget_agreed`.
        self.agreed: dict[str, tuple[int, str | None]] = {}
        found, skipped = [], 0
        for fname in os.listdir(self.dir):
            m = ENTRY.match(fname)
            try:
                st = os.lstat(os.path.join(self.dir, fname))
            except OSError:
                continue
            if fname.endswith(".tmp"):
                # A write in progress (the folder may be shared), or left by a crash an hour ago or more.
                if time.time() - st.st_mtime > STALE_TMP_S:
                    self._unlink(os.path.join(self.dir, fname))
                continue
            if m is None or not stat.S_ISREG(st.st_mode) or st.st_size == 0 or int(m[2]) % self.page:
                skipped += 1
                continue
            found.append((m[3] is not None, st.st_mtime_ns, m[1], int(m[2]), st.st_size, m[3]))
        with self.lock:
            for state_only, _, name, length, size, base in sorted(found):  # (bases first)
                if state_only and (base not in self.index or self.index[base][2] is not None
                                   or self.index[base][0] <= length):  # fmt: skip
                    skipped += 1  # (its base is gone: its KV with it)
                    self._unlink(self._path(name, length, base))
                    continue
                self._add(name, length, size, base)
            self.max_bytes = start_budget(self.dir, self.max_bytes, config.max_bytes_from, self.total,
                                          self.min_free, config.ranks)  # fmt: skip
            self._trim()
        if skipped:
            logger.warning("HiCache disk tier %s: %d file(s) that are not entries skipped", self.dir, skipped)

    # ---- index (under the lock) ------------------------------------------------------------------

    def _add(self, name: str, length: int, size: int, base: str | None = None) -> bool:
        """The entry into the index; False (its file deleted) where the name is held whole and this file
        is state-only. One name stored twice, whole and state-only or state-only under two bases (two
        servers on one folder, a flush between a write's record and its run), keeps one file: the whole
        one (it may be a base; a state-only one never is), else the newer; the other is deleted."""
        old = self.index.get(name)
        if old is not None and old[2] != base:
            if old[2] is None:
                self._unlink(self._path(name, length, base))
                return False
            self._unlink(self._path(name, old[0], old[2]))
        if old is not None:
            self._remove(name)
        self.index[name] = (length, size, base)
        if base is not None:
            self.dependents.setdefault(base, set()).add(name)
        self.lengths[length] += 1
        self.total += size
        return True

    def _remove(self, name: str) -> tuple[int, int, str | None] | None:
        entry = self.index.pop(name, None)
        if entry is not None:
            self.lengths[entry[0]] -= 1
            if not self.lengths[entry[0]]:
                del self.lengths[entry[0]]
            self.total -= entry[1]
            if entry[2] is not None:
                self.dependents[entry[2]].discard(name)
                if not self.dependents[entry[2]]:
                    del self.dependents[entry[2]]
        return entry

    def _delete(self, name: str, stat_name: str | None) -> int:
        """The entry out of the index and its file deleted, with its state-only entries (their KV was in
        its file); each counted under `stat_name`. Returns the bytes freed."""
        freed = 0
        for dep in list(self.dependents.get(name, ())):
            freed += self._delete(dep, stat_name)
        entry = self._remove(name)
        if entry is None:
            return freed
        self._unlink(self._path(name, entry[0], entry[2]))
        if stat_name is not None:
            self.stats[stat_name] += 1
        return freed + entry[1]

    def _trim(self, size: int = 0) -> None:
        """Room for `size` more bytes within the budget: past it, least recently used entries go until
        the tier holds `ratio` of the budget with them (upstream's eviction watermark)."""
        if self.total + size <= self.max_bytes:
            return
        target = int(self.max_bytes * self.ratio) - size
        while self.total > target and self.index:
            self._delete(next(iter(self.index)), "disk_evictions")

    def _room_on_disk(self, size: int) -> bool:
        """Whether `size` more bytes leave the floor free, once least recently used entries went to make
        it so (counted); False, deleting nothing, if even deleting all of them would not (another program
        filled the disk: the entries stay for reads)."""
        free = free_bytes(self.dir)
        if free is None or free - size >= self.min_free:
            return True
        if free + self.total - size < self.min_free:
            return False
        while free - size < self.min_free and self.index:
            free += self._delete(next(iter(self.index)), "disk_evictions_low_space")
        free = free_bytes(self.dir)  # (again: the deletes, and other writers, changed it)
        return free is None or free - size >= self.min_free

    def _path(self, name: str, length: int, base: str | None = None) -> str:
        return os.path.join(self.dir, f"{name}-{length}.pt" if base is None else f"{name}-{length}+{base}.pt")

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def _failed(self, what: str, name: str, e: BaseException) -> None:
        self.stats[f"disk_{what}_errors"] += 1
        n = self.stats[f"disk_{what}_errors"]
        if n == 1 or n % 100 == 0:
            logger.warning("HiCache disk tier: %s of %s failed (%d so far), skipped: %r", what, name, n, e)

    # ---- scheduler thread ------------------------------------------------------------------------

    def deepest(self, key, namespace: str | None) -> tuple[int, str | None]:
        """The longest prefix of `key` with an entry (under TP: one every rank holds): (length, name), or
        (0, None). One SHA-256 pass over the key, a digest only at the lengths some entry has.

        Under TP the answer is agreed (an all-gather) once per key and reused (`agreed`: a request
        waiting at the head of the queue asks at every admission attempt) until `forget_agreed`, which
        the tree cache calls at events every rank takes alike: the host tree evicting (a checkpoint the
        host held, as deep as its disk entry, is gone: that entry may now be the deepest hit), a read
        that failed on some rank (`stage`), a flush, a weight update. Entries a rank gains or loses
        meanwhile are not seen: a lost one is caught by `stage`'s own agreement (the hit is not taken);
        a gained one is a write recorded at a backup, whose checkpoint the host holds (as deep a hit)
        until it evicts it, unless the host evicted it while the write was still to run."""
        key = key if isinstance(key, array) else array("q", key)
        if self.gather is None:
            return self._best(self._hits(key, namespace))
        memo = entry_name(key, namespace)
        if memo in self.agreed:
            self.stats["disk_lookups_reused"] += 1
            return self.agreed[memo]
        hits = self._hits(key, namespace)
        common = set(hits)  # (every rank calls this for the same keys: the trees are the same)
        for lengths in self.gather(sorted(hits)):
            common &= set(lengths)
        if len(self.agreed) >= AGREED_KEYS:
            del self.agreed[next(iter(self.agreed))]
        self.agreed[memo] = self._best({n: hits[n] for n in common})
        return self.agreed[memo]

    def forget_agreed(self) -> None:
        self.agreed.clear()

    @staticmethod
    def _best(hits: dict[int, str]) -> tuple[int, str | None]:
        if not hits:
            return 0, None
        best = max(hits)
        return best, hits[best]

    def _hits(self, key, namespace: str | None) -> dict[int, str]:
        """length -> name of every prefix of `key` with an entry on this rank."""
        if not self.enabled or not self.index:
            return {}
        key = key if isinstance(key, array) else array("q", key)
        ends = sorted(n for n in list(self.lengths) if n <= len(key))
        h, done, hits = hashlib.sha256(repr(namespace).encode()), 0, {}
        for end in ends:
            h.update(key[done:end].tobytes())
            done = end
            name = h.hexdigest()
            if name in self.index:
                hits[end] = name
        return hits

    def wants(self, name: str, length: int, state_only: bool = False) -> bool:
        """Whether to record a write of this entry: the tier is on, the entry is neither on disk nor being
        written, and it fits the budget by itself (estimated from the host pools' bytes)."""
        if not self.enabled or name in self.index or name in self.pending:
            return False
        if (0 if state_only else length * self.host.token_bytes) + self.host.slot_bytes > self.max_bytes:
            self.stats["disk_writes_over_budget"] += 1
            return False
        return True

    def writing(self, name: str) -> None:
        self.pending.add(name)

    def reset(self) -> None:
        """A flush: the writes recorded and not run are dropped with the controller's list."""
        self.pending.clear()
        self.forget_agreed()

    def weights_changed(self) -> None:
        """An in-place weight update: entries no longer match the weights; the tier is off until restart."""
        if self.enabled:
            logger.warning("HiCache disk tier off until restart: the weights were updated in place.")
        self.enabled = False
        self.forget_agreed()
        with self.lock:
            self.index.clear()
            self.dependents.clear()
            self.lengths.clear()
            self.total = 0
        self.pending.clear()

    def stage(self, name: str, start: int) -> dict | None:
        """Positions [start, length) of the entry's KV and its state, read and checked against the host
        pools' layout now; None (the entry dropped, the error counted) if that fails, and under TP
        None on every rank where it failed on any (`disk_reads_failed_elsewhere` counts those)."""
        staged = self._stage(name, start)
        if self.gather is not None and not all(self.gather(staged is not None)):
            if staged is not None:
                self.stats["disk_reads_failed_elsewhere"] += 1
            self.forget_agreed()  # (the agreed answers may name the entry some rank lost)
            return None
        return staged

    def _read(self, name: str, entry: tuple[int, int, str | None]) -> dict:
        fd = os.open(self._path(name, entry[0], entry[2]), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)

    def _stage(self, name: str, start: int) -> dict | None:
        with self.lock:  # (a write on the forward stream may delete entries meanwhile)
            entry = self.index.get(name)
            held = None if entry is None or entry[2] is None else self.index.get(entry[2])
        if entry is None:
            return None
        length, _, base = entry
        h, reading = self.host, name
        try:
            data = self._read(name, entry)
            for key, dst in (("conv", h.conv_state), ("ssm", h.ssm_state)):
                src = data[key]
                if src.dtype != dst.dtype or tuple(src.shape) != (dst.shape[0], *dst.shape[2:]):
                    raise ValueError(f"{key} {src.dtype} {tuple(src.shape)} does not fit the host pool")
            rows = length
            if base is not None:  # (a state-only entry: its KV is the first `length` positions of the base's)
                reading = base
                if held is None:
                    raise FileNotFoundError(f"its base entry {base} is gone")
                data, rows = {**self._read(base, held), "conv": data["conv"], "ssm": data["ssm"]}, held[0]
            pairs = [*zip(data["k"], h.k_buffer, strict=True), *zip(data["v"], h.v_buffer, strict=True)]
            for src, dst in pairs:
                if src.dtype != dst.dtype or tuple(src.shape) != (rows, *dst.shape[1:]):
                    raise ValueError(f"KV {src.dtype} {tuple(src.shape)} does not fit the host pool")
        except Exception as e:  # noqa: BLE001 - any unreadable or foreign file: the hit is not taken
            with self.lock:
                # A file a write's trim deleted meanwhile (and maybe wrote again since): not an error.
                moved = self.index.get(name) is not entry or (base and self.index.get(base) is not held)
                if not (moved and isinstance(e, FileNotFoundError)):
                    self._failed("read", reading, e)
                    self._delete(reading, None)  # (a base with its state-only entries)
                    self._delete(name, None)
            return None
        with self.lock:
            for n in (base, name):
                if n in self.index:
                    self.index.move_to_end(n)
        return {
            "kv": [src[start:length] for src, _ in pairs],
            "conv": data["conv"],
            "ssm": data["ssm"],
        }

    # ---- forward stream ----------------------------------------------------------------------------

    def apply(self, staged: dict, host_kv: list[int], slot: int) -> None:
        """A staged entry into the host pools (its layout checked by `stage`)."""
        h, kv = self.host, torch.tensor(host_kv, dtype=torch.int64)
        for dst, src in zip([*h.k_buffer, *h.v_buffer], staged["kv"], strict=True):
            dst[kv] = src
        h.conv_state[:, slot] = staged["conv"]
        h.ssm_state[:, slot] = staged["ssm"]

    def write(self, name: str, length: int, host_kv: list[int], slot: int, base: str | None = None) -> None:
        """The entry from the host pools; never raises (a failure is counted and the entry skipped). With
        `base` (an entry whose path extends this one's) a state-only entry referring to the base's KV, or
        a whole one where the base is not on disk (`disk_writes_base_missing`)."""
        tmp = os.path.join(self.dir, f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        h = self.host
        try:
            if not self.enabled:
                return
            with self.lock:
                base = self._kv_holder(base)
                size = (0 if base is not None else length * h.token_bytes) + h.slot_bytes
                if size > self.max_bytes:  # (written whole, its base missing, it is over the budget alone)
                    self.stats["disk_writes_over_budget"] += 1
                    return
                self._trim(size)
                room = self._room_on_disk(size)
                base = self._kv_holder(base)  # (making room may have deleted it: then written whole)
            if not room:
                self.stats["disk_writes_low_space"] += 1
                n = self.stats["disk_writes_low_space"]
                if n == 1 or n % 100 == 0:
                    logger.warning("HiCache disk tier %s: under %.2f GiB free, %d write(s) skipped so far",
                                   self.dir, self.min_free / (1 << 30), n)  # fmt: skip
                return
            data = {"conv": h.conv_state[:, slot].clone(), "ssm": h.ssm_state[:, slot].clone()}
            if base is None:
                kv = torch.tensor(host_kv, dtype=torch.int64)
                data.update(k=[b[kv].clone() for b in h.k_buffer], v=[b[kv].clone() for b in h.v_buffer])
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "wb") as f:
                torch.save(data, f)
                f.flush()
                os.fsync(f.fileno())
            path = self._path(name, length, base)
            os.replace(tmp, path)
            size = os.path.getsize(path)
        except Exception as e:  # noqa: BLE001 - disk full, folder removed, ...: the entry is skipped
            self._failed("write", name, e)
            self._unlink(tmp)
            return
        finally:
            self.pending.discard(name)
        with self.lock:
            if not self.enabled:
                return
            if base is not None and base not in self.index:  # (deleted meanwhile: the entry has no KV)
                self._unlink(path)
                return
            kept = self._add(name, length, size, base)
            self.stats["disk_bytes_written"] += size
            self.stats["disk_writes_state_only"] += int(kept and base is not None)
            self._trim()

    def _kv_holder(self, base: str | None) -> str | None:
        """The whole entry holding `base`'s KV (itself, or its own base), moved to the LRU's end (a new
        entry refers to it); None if `base` is None or not on disk (counted)."""
        if base is None:
            return None
        if base not in self.index:
            self.stats["disk_writes_base_missing"] += 1
            return None
        holder = self.index[base][2] or base
        self.index.move_to_end(holder)
        return holder
