"""The `file` storage backend's disk tier (mem_cache/disk_tier.py, issue 58's review findings 2, 4, 5, 6) on a
small fake host pool: a failed write or read never raises and never leaves an index entry without its file;
corrupt or stray files at start are skipped; two servers on one folder write the same entry at once without
an error; the folder is private and a symlink or another user's folder is refused; the size budget deletes
the least recently used entries; the budget is capped at half the free space and writes stop at a
free-space floor; `deepest` finds the longest entry without hashing every prefix. The served cases (flush,
weight update, a file lost while serving) are nightly (test_hicache_nightly.py). The review of the
state-only entries: one name stored whole and state-only keeps one file; a base trimmed during its child's
read is no error; start refuses a state-only base; a killed rank's marker is reaped; an empty free-space
floor is none."""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.mem_cache import disk_budget, disk_tier
from sglang.srt.mem_cache.disk_tier import DiskTierConfig, DiskTierError, FileStorage, entry_name
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

ROWS = 4096


def fake_host(page: int = 1) -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(
        page_size=page,
        k_buffer=[torch.randn(ROWS, 2, 8, generator=g)],
        v_buffer=[torch.randn(ROWS, 2, 8, generator=g)],
        conv_state=torch.randn(2, 5, 16, generator=g),
        ssm_state=torch.randn(2, 5, 4, 4, generator=g),
        token_bytes=2 * 2 * 8 * 4,  # (`HostPools.token_bytes` and `slot_bytes`, float32)
        slot_bytes=(2 * 16 + 2 * 4 * 4) * 4,
    )


def storage(root, host=None, max_bytes: int = 1 << 30, min_free: int = 0) -> FileStorage:
    return FileStorage(DiskTierConfig(str(root), "fp", max_bytes, min_free), host or fake_host(), Counter())


def put(st: FileStorage, key: list[int], slot: int = 1) -> str:
    name = entry_name(key, None)
    assert st.wants(name, len(key))
    st.writing(name)
    st.write(name, len(key), list(range(1, len(key) + 1)), slot)
    return name


def test_an_entry_round_trips_and_stores_no_tokens(tmp_path):
    """What is staged is what was written (KV positions past `start`, the state); the folder holds one
    file per entry, named by the hash and the length: no token id anywhere on disk."""
    st = storage(tmp_path)
    key = list(range(1000, 1064))
    name = put(st, key, slot=2)
    assert st.index[name][0] == 64 and not st.pending
    (fname,) = os.listdir(st.dir)
    assert fname == f"{name}-64.pt"
    staged = st.stage(name, 10)
    assert torch.equal(staged["kv"][0], st.host.k_buffer[0][11:65])
    assert torch.equal(staged["ssm"], st.host.ssm_state[:, 2])
    assert st.deepest(key + [7, 8], None) == (64, name) and st.deepest(key[:63], None) == (0, None)


def test_a_failed_write_raises_nothing_and_leaves_no_entry(tmp_path, monkeypatch):
    """Disk full (torch.save raising OSError ENOSPC) and a folder removed by hand: counted, no index
    entry (before the fix the entry went in when the write was recorded: the next hit read a missing
    file on the forward stream and the scheduler exited), no temporary file left."""
    st = storage(tmp_path)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_tier.torch, "save", full)
    put(st, list(range(32)))
    monkeypatch.undo()
    assert not st.index and not st.pending and st.stats["disk_write_errors"] == 1
    assert os.listdir(st.dir) == []
    os.rmdir(st.dir)
    put(st, list(range(40)))
    assert not st.index and st.stats["disk_write_errors"] == 2


@pytest.mark.parametrize("damage", ["deleted", "truncated", "foreign layout"])
def test_a_failed_read_drops_the_entry_and_skips_the_hit(tmp_path, damage):
    """A file lost (tmpfiles, cleared by hand, another server's LRU), truncated, or of another layout:
    `stage` returns None (no hit), the entry leaves the index, the error is counted."""
    st = storage(tmp_path)
    key = list(range(48))
    name = put(st, key)
    path = os.path.join(st.dir, f"{name}-48.pt")
    if damage == "deleted":
        os.unlink(path)
    elif damage == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        st.host.k_buffer = [torch.zeros(ROWS, 2, 8, dtype=torch.float16)]
    assert st.stage(name, 0) is None
    assert name not in st.index and st.deepest(key, None) == (0, None)
    assert st.stats["disk_read_errors"] == 1


def test_corrupt_and_stray_files_at_start_are_skipped(tmp_path):
    """A zero-length entry (a rename before the data reached the disk), a stray .json, a name that is not
    an entry: the server starts with the valid entries only."""
    st = storage(tmp_path)
    good = put(st, list(range(16)))
    bad = "ab" * 32
    open(os.path.join(st.dir, f"{bad}-16.pt"), "wb").close()
    with open(os.path.join(st.dir, "abc.json"), "w") as f:
        f.write('{"tokens": [1, 2')
    open(os.path.join(st.dir, "notes.txt"), "w").close()
    old, fresh = os.path.join(st.dir, f".{bad}.1.aa.tmp"), os.path.join(st.dir, f".{bad}.2.bb.tmp")
    open(old, "wb").close()
    open(fresh, "wb").close()
    os.utime(old, (0, 0))  # left by a crash long ago: removed; a fresh one may be another server's write
    again = storage(tmp_path)
    assert list(again.index) == [good]
    assert not os.path.exists(old) and os.path.exists(fresh)


def test_two_servers_write_one_entry_at_once(tmp_path):
    """Two storages on one folder (two servers, same fingerprint) write the same entry 30 times each
    from two threads: unique temporary names, so no write fails (before: a shared `<name>.pt.tmp`, one
    rename took the other's file: FileNotFoundError)."""
    a, b = storage(tmp_path), storage(tmp_path)
    name = entry_name(list(range(512)), None)

    def writes(st):
        for _ in range(30):
            st.write(name, 512, list(range(1, 513)), 1)

    threads = [threading.Thread(target=writes, args=(s,)) for s in (a, b)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert a.stats["disk_write_errors"] == 0 and b.stats["disk_write_errors"] == 0
    assert os.listdir(a.dir) == [f"{name}-512.pt"]
    assert a.stage(name, 0) is not None


def test_the_folder_is_private_and_a_symlink_is_refused(tmp_path):
    """Folders 0700 (an existing 0755 one is tightened), files 0600; a symlinked folder is refused in
    one sentence naming the variable."""
    root = tmp_path / "hc"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    st = storage(root)
    put(st, list(range(8)))
    assert os.stat(root).st_mode & 0o777 == 0o700 and os.stat(st.dir).st_mode & 0o777 == 0o700
    (fname,) = os.listdir(st.dir)
    assert os.stat(os.path.join(st.dir, fname)).st_mode & 0o777 == 0o600
    os.symlink(root, tmp_path / "link")
    with pytest.raises(DiskTierError, match="^SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR folder .* a symlink"):
        storage(tmp_path / "link")


def test_another_users_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier.os, "geteuid", lambda: os.getuid() + 1)
    with pytest.raises(DiskTierError, match="is owned by another user; set it to a folder of yours"):
        storage(tmp_path)


def test_the_budget_deletes_the_least_recently_used(tmp_path):
    """A budget of about three entries: the fourth write deletes the least recently used one (the
    first, unless it was read since: then the second); the total stays within the budget. An entry
    larger than the budget by itself is not written."""
    st = storage(tmp_path)
    n1 = put(st, list(range(100)))
    size = st.index[n1][1]
    st = storage(tmp_path, max_bytes=int(size * 3.5))
    n2, n3 = put(st, list(range(200, 300))), put(st, list(range(300, 400)))
    assert st.stage(n1, 0) is not None  # n1 is now the most recently used
    n4 = put(st, list(range(400, 500)))
    assert list(st.index) == [n3, n1, n4] and n2 not in st.index
    assert sorted(os.listdir(st.dir)) == sorted(f"{n}-100.pt" for n in (n1, n3, n4))
    assert st.total <= st.max_bytes and st.stats["disk_evictions"] == 1
    assert not st.wants(entry_name(list(range(2000)), None), 2000)


def test_deepest_hashes_only_at_the_entries_lengths(tmp_path, monkeypatch):
    """A 32k-token key against entries of two lengths: the longest present is found with 2 digests, not
    one per page-aligned prefix (the review measured 58 ms per match at 32k tokens)."""
    st = storage(tmp_path)
    key = list(range(32768))
    put(st, key[:64])
    n2 = put(st, key[:128])
    digests = []
    real = disk_tier.hashlib.sha256

    class Counting:
        def __init__(self, data):
            self.h = real(data)

        def update(self, data):
            self.h.update(data)

        def hexdigest(self):
            digests.append(1)
            return self.h.hexdigest()

    monkeypatch.setattr(disk_tier.hashlib, "sha256", Counting)
    assert st.deepest(key, None) == (128, n2) and len(digests) == 2
    assert st.deepest(key, "other namespace") == (0, None)


def test_the_fingerprint_follows_the_weights_and_the_pools(tmp_path):
    """Review finding 3: a weight file rewritten (size or mtime) or a pool of another real dtype (bf16 on
    a GPU vs float32 on CPU, both `--dtype auto`) gives another folder."""
    from sglang.srt.managers.scheduler_components.tree_cache_factory import disk_fingerprint

    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    args = SimpleNamespace(model_config=SimpleNamespace(path=str(tmp_path)), quantization=None,
                           device="cpu", page_size=1, tp_size=1)  # fmt: skip

    def runner(dtype):
        kv = SimpleNamespace(k_buffer=[torch.zeros(4, 2, 8, dtype=dtype)], v_buffer=[])
        mp = SimpleNamespace(conv_state=torch.zeros(2, 5, 16, dtype=dtype), ssm_state=torch.zeros(2, 5, 4))
        return SimpleNamespace(token_to_kv_pool=kv, req_to_token_pool=SimpleNamespace(mamba_pool=mp))

    first = disk_fingerprint(args, runner(torch.float32))
    assert disk_fingerprint(args, runner(torch.float32)) == first
    assert disk_fingerprint(args, runner(torch.bfloat16)) != first
    # Rank 0 of TP 2 holds another shard than TP 1's one rank, even where the pools' shapes are alike.
    assert disk_fingerprint(SimpleNamespace(**{**vars(args), "tp_size": 2}), runner(torch.float32)) != first
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)
    assert disk_fingerprint(args, runner(torch.float32)) != first


def fake_disk(monkeypatch, st_dir_holder: list, free0: int) -> None:
    """`shutil.disk_usage` of a filesystem with `free0` bytes free before the tier's files: the files the
    folder holds (st_dir_holder[0], once known) take from it, so deleting one gives its bytes back."""

    def usage(path):
        held = sum(e.stat().st_size for e in os.scandir(st_dir_holder[0])) if st_dir_holder else 0
        return SimpleNamespace(total=1 << 40, used=held, free=free0 - held)

    monkeypatch.setattr(disk_budget.shutil, "disk_usage", usage)


def test_the_budget_is_capped_at_half_the_free_space(tmp_path, monkeypatch, caplog):
    """Security review 11, finding 12: a budget of 1 GiB on a filesystem with 100 KB free becomes 50 KB
    (half the free space), said in one warning line naming the variable; with 4 GiB free the 1 GiB budget
    stands (an info line). Entries the tier holds count as its space: after writing ~40 KB, a restart
    with the same free space left caps at half of free + held, not of free alone."""
    dirs: list = []
    fake_disk(monkeypatch, dirs, 100_000)
    with caplog.at_level("INFO", logger=disk_budget.logger.name):
        st = storage(tmp_path, max_bytes=1 << 30, min_free=0)
    assert st.max_bytes == 50_000
    (line,) = [r for r in caplog.records if "budget" in r.getMessage()]
    assert line.levelname == "WARNING" and "SGLANG_HICACHE_FILE_BACKEND_MAX_GB 1.00" in line.getMessage()
    dirs.append(st.dir)
    for i in range(4):
        put(st, list(range(100 * i, 100 * i + 64)))
    held = st.total
    assert 30_000 < held <= st.max_bytes
    again = storage(tmp_path, max_bytes=1 << 30, min_free=0)  # (100 KB - held free now)
    assert again.max_bytes == 50_000 and len(again.index) == 4
    caplog.clear()
    dirs.clear()
    fake_disk(monkeypatch, dirs, 4 << 30)
    with caplog.at_level("INFO", logger=disk_budget.logger.name):
        assert storage(tmp_path / "big", max_bytes=1 << 30, min_free=0).max_bytes == 1 << 30
    (line,) = [r for r in caplog.records if "budget" in r.getMessage()]
    assert line.levelname == "INFO"


def test_writes_stop_at_the_free_space_floor(tmp_path, monkeypatch):
    """A floor of 1 MB on a filesystem with 1.05 MB free before the tier's files (the budget is not what
    binds: 10 MB): each entry is ~8.5 KB; once a write would take free space below the floor, it first
    deletes least recently used entries (counted), so the floor holds after every write; when the free
    space is taken by someone else (the floor passed even with every entry deleted), writes are skipped,
    counted, without raising and without a file or an index entry, and no entry is deleted for them."""
    dirs: list = []
    fake_disk(monkeypatch, dirs, 1_050_000)
    st = storage(tmp_path, max_bytes=10_000_000, min_free=1_000_000)
    st.max_bytes = 10_000_000  # (the start cap is the other test's: here only the floor binds)
    dirs.append(st.dir)
    names = [put(st, list(range(100 * i, 100 * i + 64))) for i in range(12)]
    free = disk_budget.shutil.disk_usage(st.dir).free
    assert free >= 1_000_000 and st.stats["disk_evictions_low_space"] >= 6, (free, dict(st.stats))
    assert names[0] not in st.index and names[-1] in st.index
    assert st.stats["disk_writes_low_space"] == 0
    kept, files, evicted = list(st.index), sorted(os.listdir(st.dir)), st.stats["disk_evictions_low_space"]
    assert kept and len(files) == len(kept)
    fake_disk(monkeypatch, dirs, 900_000)  # another program filled the disk
    name = put(st, list(range(5000, 5064)))
    assert name not in st.index and not st.pending
    assert st.stats["disk_writes_low_space"] == 1
    # (deleting every entry would not reach the floor: none is deleted, and they are still read)
    assert list(st.index) == kept and sorted(os.listdir(st.dir)) == files
    assert st.stats["disk_evictions_low_space"] == evicted
    assert st.deepest(list(range(1100, 1164)), None) == (64, names[-1]) and st.stage(names[-1], 0) is not None


def test_the_floor_reads_upstreams_variable_and_sizes(monkeypatch):
    """SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE (upstream's name) reaches the tier's config in upstream's
    sizes (its `human_readable_int`: SI k/M/G/T decimal, IEC Ki/Mi/Gi/Ti binary and whole, case-sensitive,
    a byte count; default 1 GiB); a value that is not a size (10g, 1K, 1.5Gi) is a startup error naming
    the variable. Before, 1G read as 2**30 (upstream: 10**9) and 10g was taken."""
    from sglang.srt.environ import envs
    from sglang.srt.managers.scheduler_components import tree_cache_factory
    from sglang.srt.server_args import ServerArgsError

    assert [disk_tier.parse_size(s) for s in ("10G", "1G", "1Gi", "512Mi", "2.5k", "1.5T", "4096", "0")] == [
        10**10, 10**9, 1 << 30, 512 << 20, 2500, 15 * 10**11, 4096, 0]  # fmt: skip
    for bad in ("10g", "1K", "1.5Gi", "1.5", "-1", "lots"):
        with pytest.raises(ValueError):
            disk_tier.parse_size(bad)
    monkeypatch.setattr(tree_cache_factory, "disk_fingerprint", lambda args, runner: "fp")
    args = SimpleNamespace(hicache_storage_backend="file")
    assert tree_cache_factory._file_storage(args, None).min_free_bytes == 1 << 30
    with envs.SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE.override("20G"):
        assert tree_cache_factory._file_storage(args, None).min_free_bytes == 2 * 10**10
    with envs.SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE.override("lots"):
        with pytest.raises(ServerArgsError, match="^SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE must be a size"):
            tree_cache_factory._file_storage(args, None)


def put_state_only(st: FileStorage, key: list[int], base: str | None, slot: int = 3) -> str:
    name = entry_name(key, None)
    assert st.wants(name, len(key), state_only=True)
    st.writing(name)
    st.write(name, len(key), list(range(1, len(key) + 1)), slot, base)
    return name


def test_a_state_only_entry_reads_its_kv_from_its_base(tmp_path):
    """The repeat point's entry (review: a second whole-path entry, 1.76x the disk bytes): its file holds
    its state only, under `<name>-<length>+<base>.pt`; staged, its KV is the base file's first positions
    and its state its own. One whose base is itself state-only refers to that one's base. Deleting the
    base (LRU) deletes it too; at a restart both come back, and one whose base file is gone is skipped
    and deleted. Without a base on disk it is written whole (counted)."""
    st = storage(tmp_path)
    key = list(range(1000, 1128))
    full = put(st, key, slot=1)
    up = put_state_only(st, key[:64], full, slot=2)
    assert st.index[up][2] == full and st.index[up][1] < st.index[full][1] - 128 * st.host.token_bytes + 4096
    assert f"{up}-64+{full}.pt" in os.listdir(st.dir) and st.stats["disk_writes_state_only"] == 1
    staged = st.stage(up, 10)
    assert torch.equal(staged["kv"][0], st.host.k_buffer[0][11:65])  # (the base's host_kv: 1..128)
    assert torch.equal(staged["kv"][1], st.host.v_buffer[0][11:65])
    assert torch.equal(staged["ssm"], st.host.ssm_state[:, 2])
    assert torch.equal(staged["conv"], st.host.conv_state[:, 2])
    chained = put_state_only(st, key[:32], up)
    assert st.index[chained][2] == full and st.stage(chained, 0) is not None
    again = storage(tmp_path)  # (a restart)
    assert set(again.index) == {full, up, chained} and again.dependents[full] == {up, chained}
    assert again.total == st.total
    st._delete(full, "disk_evictions")
    assert not st.index and not os.listdir(st.dir) and st.stats["disk_evictions"] == 3
    full, up = put(st, key), put_state_only(st, key[:64], full)
    os.unlink(st._path(full, 128))  # (another server sharing the folder deleted it)
    assert not storage(tmp_path).index and not os.listdir(st.dir)
    st = storage(tmp_path)
    alone = put_state_only(st, key[:64], full)
    assert st.index[alone][2] is None and st.stats["disk_writes_base_missing"] == 1
    assert torch.equal(st.stage(alone, 0)["kv"][0], st.host.k_buffer[0][1:65])


def test_a_failed_base_read_drops_its_state_only_entries(tmp_path):
    """A state-only entry whose base file is damaged: the read fails, the hit is not taken, and the base
    and every entry referring to it leave the index and the folder."""
    st = storage(tmp_path)
    key = list(range(1000, 1128))
    full = put(st, key)
    up = put_state_only(st, key[:64], full)
    with open(st._path(full, 128), "r+b") as f:
        f.truncate(100)
    assert st.stage(up, 0) is None and st.stats["disk_read_errors"] == 1
    assert not st.index and not os.listdir(st.dir) and st.deepest(key, None) == (0, None)


def test_upstreams_size_and_eviction_variables_are_honoured(monkeypatch):
    """Upstream's file backend reads SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE (a size; 0: no cap) and
    _EVICTION_RATIO (in (0, 1], default 0.9), and accepts _ENABLE_METADATA_CACHE / _METADATA_TTL: each
    reaches the tier's config in upstream's units (the two lookup-cache ones have nothing to change: the
    index is in memory), and a value that is not valid, or MAX_SIZE with our MAX_GB, is a startup error
    naming the variable. Before, all four were ignored (a 200G MAX_SIZE kept the 16 GB default)."""
    from sglang.srt.environ import envs
    from sglang.srt.managers.scheduler_components import tree_cache_factory
    from sglang.srt.server_args import ServerArgsError

    monkeypatch.setattr(tree_cache_factory, "disk_fingerprint", lambda args, runner: "fp")
    args = SimpleNamespace(hicache_storage_backend="file")
    config = tree_cache_factory._file_storage(args, None)
    assert (config.max_bytes, config.eviction_ratio) == (16 << 30, 0.9)
    with envs.SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE.override("200G"):
        config = tree_cache_factory._file_storage(args, None)
        assert config.max_bytes == 200 * 10**9
        assert config.max_bytes_from == "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"
    for no_cap in ("0", ""):
        with envs.SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE.override(no_cap):
            assert tree_cache_factory._file_storage(args, None).max_bytes == disk_budget.NO_CAP
    with envs.SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO.override(0.5):
        assert tree_cache_factory._file_storage(args, None).eviction_ratio == 0.5
    with envs.SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE.override(True):
        with envs.SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL.override(-1.0):
            assert tree_cache_factory._file_storage(args, None) is not None
    refused = [
        (envs.SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE, "lots"),
        (envs.SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO, "1.5"),
        (envs.SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO, "most"),
        (envs.SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE, "maybe"),
        (envs.SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL, "soon"),
    ]
    for var, raw in refused:
        monkeypatch.setenv(var.name, raw)
        with pytest.raises(ServerArgsError, match=f"^{var.name} must be .*{raw}"):
            tree_cache_factory._file_storage(args, None)
        monkeypatch.delenv(var.name)
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", "200G")
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MAX_GB", "16")
    with pytest.raises(ServerArgsError, match="^Set one of SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE .* not both"):
        tree_cache_factory._file_storage(args, None)


def test_past_the_budget_entries_go_down_to_the_eviction_ratio(tmp_path):
    """Upstream's eviction watermark: a budget of 4.5 entries and ratio 0.5; the fifth write deletes the
    least recently used entries until the tier holds at most half the budget with it (the 3 oldest: 2
    left), where deleting one would have done (ratio 1)."""
    probe = storage(tmp_path / "probe")
    size = probe.index[put(probe, list(range(100)))][1]
    for ratio, kept in ((0.5, 2), (1.0, 4)):
        config = DiskTierConfig(str(tmp_path / str(ratio)), "fp", int(size * 4.5), 0, ratio)
        st = FileStorage(config, fake_host(), Counter())
        names = [put(st, list(range(1000 * i, 1000 * i + 100))) for i in range(5)]
        assert list(st.index) == names[-kept:] and st.stats["disk_evictions"] == 5 - kept, ratio
        assert st.total <= st.max_bytes * ratio


def test_a_state_only_write_without_its_base_over_the_budget_is_skipped(tmp_path):
    """A repeat point whose base was not written (over the budget by itself): written whole it would be
    over the budget too; it is skipped and counted, and the entries already held stay (before, making
    room for it deleted them all and the write then left the tier over its budget)."""
    st = storage(tmp_path)
    kept = put(st, list(range(10)))
    st.max_bytes = st.index[kept][1] + 64 * st.host.token_bytes  # (a state fits; 128 positions do not)
    up = put_state_only(st, list(range(1000, 1128)), entry_name(list(range(1000, 1200)), None))
    assert up not in st.index and list(st.index) == [kept] and st.stats["disk_writes_over_budget"] == 1
    assert len(os.listdir(st.dir)) == 1 and not st.pending


def on_disk(st: FileStorage) -> int:
    return sum(e.stat().st_size for e in os.scandir(st.dir))


def test_one_name_stored_whole_and_state_only_keeps_one_file(tmp_path):
    """Review F1: two servers on one folder (a documented setup) store one name twice, A whole and B
    state-only (B started before A wrote it); a restart kept the state-only one and the whole file stayed,
    never counted nor deleted (10,653 bytes here, after every entry was deleted too). Now the whole one is
    kept and the other deleted: the index counts every byte on disk. The same in one storage, either
    order (a flush between a write's record and its run writes the name again), and one name state-only
    under two bases (the newer kept)."""
    key = list(range(1000, 1128))
    a = storage(tmp_path)
    full = put(a, key)
    b = storage(tmp_path)  # (sees `full`, not what A writes next)
    x = put(a, key[:64])
    assert put_state_only(b, key[:64], full) == x and b.index[x][2] == full
    again = storage(tmp_path)  # (a restart)
    assert again.index[x][2] is None and again.dependents == {}
    assert sorted(os.listdir(again.dir)) == sorted([f"{full}-128.pt", f"{x}-64.pt"])
    assert again.total == on_disk(again)
    for n in list(again.index):
        again._delete(n, "disk_evictions")
    assert os.listdir(again.dir) == []

    for first_whole in (True, False):
        st = storage(tmp_path / str(first_whole))
        full = put(st, key)
        for base in (None, full) if first_whole else (full, None):
            st.writing(x)  # (the second is a write sealed before a flush, run after the first)
            st.write(x, 64, list(range(1, 65)), 3, base)
        assert st.index[x][2] is None and st.total == on_disk(st) and len(os.listdir(st.dir)) == 2
        assert st.stage(x, 0) is not None
    st = storage(tmp_path / "two bases")
    full, other = put(st, key), put(st, key[:64] + list(range(5000, 5064)))
    for base in (full, other):
        st.writing(x)
        st.write(x, 64, list(range(1, 65)), 3, base)
    assert st.index[x][2] == other and st.dependents == {other: {x}}
    assert st.total == on_disk(st) and len(os.listdir(st.dir)) == 3


@pytest.mark.parametrize("rewritten", [False, True])
def test_a_base_trimmed_during_its_childs_read_is_no_read_error(tmp_path, caplog, rewritten):
    """Review F2: a write's trim (the forward stream) deletes a state-only entry's base, with the entry,
    while `stage` (the scheduler thread) reads them; the base's open fails. Not an error: nothing counted
    or logged, and a base written again meanwhile stays (before: 'read of <base> failed' and the new
    base deleted with its file)."""
    st = storage(tmp_path)
    key = list(range(1000, 1128))
    full = put(st, key)
    up = put_state_only(st, key[:64], full)
    real = st._read

    def trimmed_meanwhile(name, entry):
        if name != full:
            return real(name, entry)
        with st.lock:
            st._delete(full, "disk_evictions")
        try:
            return real(name, entry)
        finally:
            if rewritten:
                put(st, key)

    st._read = trimmed_meanwhile
    with caplog.at_level("WARNING", logger=disk_tier.logger.name):
        assert st.stage(up, 0) is None
    assert st.stats["disk_read_errors"] == 0 and not caplog.records
    assert list(st.index) == ([full] if rewritten else [])
    assert os.listdir(st.dir) == ([f"{full}-128.pt"] if rewritten else [])


def test_start_refuses_a_state_only_entry_on_a_state_only_or_shorter_base(tmp_path):
    """The runtime refers a state-only entry to the whole entry holding its KV, longer than it. At start
    a file naming a state-only base (its file holds no KV) or a base no longer than itself is skipped and
    deleted, whatever the order the files are found in."""
    st = storage(tmp_path)
    key = list(range(1000, 1128))
    full = put(st, key)
    up = put_state_only(st, key[:64], full)
    state = open(st._path(up, 64, full), "rb").read()
    planted = [f"{entry_name(key[:32], None)}-32+{up}.pt", f"{entry_name(key + [1], None)}-129+{full}.pt",
               f"{entry_name(key[:96] + [1] * 32, None)}-128+{full}.pt"]  # fmt: skip
    for fname in planted:
        path = os.path.join(st.dir, fname)
        with open(path, "wb") as f:
            f.write(state)
        os.utime(path, (2**31, 2**31))  # (found after `up`)
    again = storage(tmp_path)
    assert set(again.index) == {full, up} and again.total == on_disk(again)
    assert not set(planted) & set(os.listdir(st.dir))


def test_a_state_only_write_whose_base_went_meanwhile_leaves_no_file(tmp_path, monkeypatch):
    """A state-only entry's base deleted (LRU, another thread) while the entry's file is written: the
    entry would have no KV, so its file is deleted and it is not indexed."""
    st = storage(tmp_path)
    key = list(range(1000, 1128))
    full = put(st, key)
    save = disk_tier.torch.save

    def base_trimmed_meanwhile(data, f):
        if "k" not in data:
            with st.lock:
                st._delete(full, "disk_evictions")
        save(data, f)

    monkeypatch.setattr(disk_tier.torch, "save", base_trimmed_meanwhile)
    up = entry_name(key[:64], None)
    st.writing(up)
    st.write(up, 64, list(range(1, 65)), 3, full)
    assert not st.index and not st.dependents and st.total == 0 and os.listdir(st.dir) == []


def test_a_killed_ranks_share_marker_is_reaped_at_start(tmp_path):
    """A rank killed between writing its `.rank-<hex>.share` marker and deleting it (`ranks_sharing`) left
    it under the storage root for good; one an hour old or more goes at start, as a crash's .tmp files
    do; a fresh one (a rank starting now) and other files stay."""
    old, fresh = tmp_path / ".rank-0123456789abcdef.share", tmp_path / ".rank-fedcba9876543210.share"
    other = tmp_path / ".rank-notes.share"
    for path in (old, fresh, other):
        path.touch()
        os.utime(path, (0, 0) if path != fresh else None)
    storage(tmp_path)
    assert not old.exists() and fresh.exists() and other.exists()


def test_an_empty_free_space_floor_is_no_floor(monkeypatch, tmp_path, caplog):
    """SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE='' was refused at start; upstream reads it as 0 (and
    our MAX_SIZE='' is no cap): no floor. The budget line says GiB, what it divides by."""
    from sglang.srt.environ import envs
    from sglang.srt.managers.scheduler_components import tree_cache_factory

    monkeypatch.setattr(tree_cache_factory, "disk_fingerprint", lambda args, runner: "fp")
    with envs.SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE.override(""):
        config = tree_cache_factory._file_storage(SimpleNamespace(hicache_storage_backend="file"), None)
    assert config.min_free_bytes == 0
    with caplog.at_level("INFO", logger=disk_budget.logger.name):
        storage(tmp_path, max_bytes=1 << 30)
    (line,) = [r.getMessage() for r in caplog.records if "budget" in r.getMessage()]
    assert re.findall(r"[0-9?] (\w+)", line) == ["GiB", "GiB", "GiB", "GiB", "rank", "GiB"], line


def test_a_state_only_write_whose_base_its_own_trim_deleted_is_written_whole(tmp_path):
    """Room for a state-only entry deletes its base (the budget holds little more than the base): the
    entry is written whole (counted as a missing base), not state-only on a deleted base (then dropped)."""
    st = storage(tmp_path)
    key = list(range(1000, 1128))
    full = put(st, key)
    st.max_bytes = st.index[full][1] + 100
    up = put_state_only(st, key[:64], full)
    assert list(st.index) == [up] and st.index[up][2] is None and st.stats["disk_writes_base_missing"] == 1
    assert torch.equal(st.stage(up, 0)["kv"][0], st.host.k_buffer[0][1:65])
