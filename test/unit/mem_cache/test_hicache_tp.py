"""The host tier under tensor parallelism and PD (issue 58 item 4), the parts that run without a second
process: the ranks' disk tiers agree on a hit (the deepest entry every rank holds; a read taken only where
it succeeded on every rank), each rank's host tier is sized from the smallest values over the ranks, and
the flags are accepted with --tp-size and --disaggregation-mode (--dp-size still refused). Two ranks are
two threads here, exchanging through a barrier as an all-gather does. The served cases (two gloo ranks,
a PD pair) are nightly: test_hicache_tp_nightly.py."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang.srt.mem_cache import host_pool
from sglang.srt.mem_cache.disk_tier import DiskTierConfig, FileStorage, entry_name
from sglang.srt.mem_cache.host_pool import HostPools, HostPoolSizeError
from sglang.srt.server_args import ServerArgsError, prepare_server_args
from sglang.test.ci_register import register_cpu_ci
from sglang.test.hicache_checks import disk_lookups_while_waiting
from sglang.test.scheduler_harness import ORACLE_TOL

register_cpu_ci(est_time=7, suite="per-commit-cpu")  # measured 4.5 s (the waiting request: 3.0 s)

PRESET = ["--model-path", "tiny-qwen3-next"]


class Gather:
    """An all-gather between threads: `for_rank(r)(value)` returns every rank's value, in rank order."""

    def __init__(self, n: int):
        self.barrier, self.values = threading.Barrier(n, timeout=10), [None] * n

    def for_rank(self, r: int) -> Callable[[Any], list[Any]]:
        def gather(value: Any) -> list[Any]:
            self.values[r] = value
            self.barrier.wait()
            out = list(self.values)
            self.barrier.wait()
            return out

        return gather


def on_ranks(fns: list[Callable[[], Any]]) -> list[Any]:
    out = [None] * len(fns)

    def run(i):
        out[i] = fns[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def rank_storage(root, rank: int, gather) -> FileStorage:
    g = torch.Generator().manual_seed(rank)
    host = SimpleNamespace(
        page_size=1,
        k_buffer=[torch.randn(512, 2, 8, generator=g)],
        v_buffer=[torch.randn(512, 2, 8, generator=g)],
        conv_state=torch.randn(2, 5, 16, generator=g),
        ssm_state=torch.randn(2, 5, 4, 4, generator=g),
        token_bytes=2 * 2 * 8 * 4,  # (`HostPools.token_bytes` and `slot_bytes`, float32)
        slot_bytes=(2 * 16 + 2 * 4 * 4) * 4,
    )
    st = FileStorage(DiskTierConfig(str(root), f"fp rank {rank}", 1 << 30), host, Counter())
    st.gather = gather
    return st


def put(st: FileStorage, key: list[int]) -> str:
    name = entry_name(key, None)
    assert st.wants(name, len(key))
    st.writing(name)
    st.write(name, len(key), list(range(1, len(key) + 1)), 1)
    return name


@pytest.mark.parametrize("agree", [True, False])
def test_the_ranks_disk_tiers_agree_on_a_hit(tmp_path, agree):
    """Rank 0 wrote entries at 64 and 128 tokens, rank 1's write at 128 failed: both take 64 (without the
    agreement rank 0 would load 128 tokens and rank 1 64: their trees, slots and batches would part).
    Entries at different lengths only (rank 0 at 96, rank 1 at 64 after 128 is trimmed): no hit on
    either. A read that fails on rank 1 (its file truncated): no rank takes the hit."""
    gather = Gather(2)
    ranks = [rank_storage(tmp_path, r, gather.for_rank(r) if agree else None) for r in range(2)]
    key = list(range(1000, 1200))
    for st in ranks:
        put(st, key[:64])
    n128 = put(ranks[0], key[:128])
    got = on_ranks([lambda st=st: st.deepest(key, None) for st in ranks])
    if not agree:  # (the negative control: each rank alone)
        assert got == [(128, n128), (64, entry_name(key[:64], None))]
        return
    assert got == [(64, entry_name(key[:64], None))] * 2
    put(ranks[0], key[:96])
    ranks[0]._remove(entry_name(key[:64], None))
    for st in ranks:
        st.forget_agreed()  # (the agreed answers are kept until an event every rank takes alike)
    assert on_ranks([lambda st=st: st.deepest(key, None) for st in ranks]) == [(0, None)] * 2
    name = put(ranks[0], key[:64])
    with open(ranks[1]._path(name, 64), "r+b") as f:
        f.truncate(10)
    staged = on_ranks([lambda st=st: st.stage(name, 0) for st in ranks])
    assert staged == [None, None]
    assert ranks[0].stats["disk_reads_failed_elsewhere"] == 1 and ranks[1].stats["disk_read_errors"] == 1
    assert name in ranks[0].index  # (rank 0's file is fine: kept; rank 1 dropped its own)
    assert on_ranks([lambda st=st: st.deepest(key, None) for st in ranks]) == [(0, None)] * 2


def test_an_agreed_lookup_is_reused_until_every_rank_forgets_it(tmp_path):
    """The same key asked 5 times (a request waiting at the head of the queue): one all-gather, the same
    agreed answer on both ranks. An entry both ranks gain meanwhile is not seen until `forget_agreed` (the
    tree cache calls it at events every rank takes alike: a host eviction, a failed read, a flush); then
    one more all-gather finds it. Without the reuse: 5 all-gathers."""
    gather = Gather(2)
    ranks = [rank_storage(tmp_path, r, gather.for_rank(r)) for r in range(2)]
    key = list(range(1000, 1200))
    for st in ranks:
        put(st, key[:64])
    calls = [0, 0]

    def counted(r: int):
        def g(value):
            calls[r] += 1
            return gather.for_rank(r)(value)

        return g

    for r, st in enumerate(ranks):
        st.gather = counted(r)
    first = entry_name(key[:64], None)
    for _ in range(5):
        assert on_ranks([lambda st=st: st.deepest(key, None) for st in ranks]) == [(64, first)] * 2
    assert calls == [1, 1] and [st.stats["disk_lookups_reused"] for st in ranks] == [4, 4]
    deeper = [put(st, key[:128]) for st in ranks][0]
    assert on_ranks([lambda st=st: st.deepest(key, None) for st in ranks]) == [(64, first)] * 2
    for st in ranks:
        st.forget_agreed()
    assert on_ranks([lambda st=st: st.deepest(key, None) for st in ranks]) == [(128, deeper)] * 2
    assert calls == [2, 2]


def test_a_read_that_failed_on_a_rank_forgets_the_agreed_answer(tmp_path):
    """Both ranks hold entries at 64 and 128 tokens: the agreed hit is 128 (kept: the answers are keyed by
    the prompt's 64-character digest, not its tokens). Rank 1's 128 file is truncated: the read fails
    there, so no rank takes it, and rank 1 drops the entry. The next lookup is agreed afresh: 64 on both
    ranks. Without `stage`'s forget the kept answer (128, an entry rank 1 lost) came back at every
    attempt, and the hit at 64 was never taken."""
    gather = Gather(2)
    ranks = [rank_storage(tmp_path, r, gather.for_rank(r)) for r in range(2)]
    key = list(range(1000, 1200))
    n64 = [put(st, key[:64]) for st in ranks][0]
    n128 = [put(st, key[:128]) for st in ranks][0]
    assert on_ranks([lambda st=st: st.deepest(key, None) for st in ranks]) == [(128, n128)] * 2
    assert all(list(st.agreed) == [entry_name(key, None)] for st in ranks)
    with open(ranks[1]._path(n128, 128), "r+b") as f:
        f.truncate(10)
    assert on_ranks([lambda st=st: st.stage(n128, 0) for st in ranks]) == [None, None]
    assert n128 in ranks[0].index and n128 not in ranks[1].index
    assert on_ranks([lambda st=st: st.deepest(key, None) for st in ranks]) == [(64, n64)] * 2


def test_a_request_waiting_for_room_agrees_on_its_disk_hit_once(oracles, tmp_path):
    """A's turn 2 (a disk hit of its 204-token turn 1) waits behind B for KV room and is tried at every
    step: its disk lookup is agreed once (one all-gather, measured 2.3 ms on this VM at TP 2) and its read
    once, not once per attempt; its hit is then taken and matches the oracle within 1e-4 (float32).
    Measured: 42 attempts, 1 lookup all-gather; without the reuse 42."""
    r = disk_lookups_while_waiting(oracles, "tiny-qwen3-next", str(tmp_path))
    assert r["asked"] >= 10, r  # (it did wait: tried at many steps)
    assert r["gathers"] == {"lookup": 1, "read": 1}, r
    assert r["reused"] == r["asked"] - 1, r
    assert r["cached"] >= r["first_turn_len"] - 8 and r["oracle_err"] <= ORACLE_TOL, r


def _pools(tokens: int = 1 << 10):
    kv = SimpleNamespace(size=tokens, page_size=1, k_buffer=[torch.zeros(tokens, 64, 64, device="meta")],
                         v_buffer=[])  # fmt: skip
    mp = SimpleNamespace(size=8, conv_state=torch.zeros(1, 9, 4, device="meta"),
                         ssm_state=torch.zeros(1, 9, 4, device="meta"))  # fmt: skip
    return kv, mp


@pytest.mark.parametrize(
    "roots, other_nodes, sharing",
    [
        ("AAAA", False, 4),  # one folder on one node
        ("AAAA", True, 4),  # one folder of a network filesystem, each rank on another node (the markers)
        ("AABB", False, 4),  # two folders of one filesystem on one node (its device)
        ("AABB", True, 2),  # two folders, each shared by two nodes
    ],
)
def test_ranks_sharing_a_filesystem_split_its_free_space(tmp_path, monkeypatch, roots, other_nodes, sharing):
    """Review: each rank capped its disk budget at half the free space at start, so 8 ranks on one
    shared folder claimed 4x it. Four ranks, 100 MB free: the ranks that see each other's marker under
    their root, or whose roots are on one node and device, split it (each rank's budget half of its
    share: 100 MB / 4 / 2 where all four share; before, 50 MB each); the markers are gone after."""
    from sglang.srt.mem_cache import disk_budget

    monkeypatch.setattr(disk_budget.shutil, "disk_usage", lambda path: SimpleNamespace(free=100_000_000))
    if other_nodes:
        monkeypatch.setattr(disk_budget, "filesystem_id", lambda path: (threading.get_ident(), 0))
    gather = Gather(4)
    dirs = [tmp_path / c for c in roots]
    for d in dirs:
        d.mkdir(exist_ok=True)
    share = [lambda r=r: disk_budget.ranks_sharing(str(dirs[r]), gather.for_rank(r)) for r in range(4)]
    got = on_ranks(share)
    assert got == [sharing] * 4
    assert not [f for d in dirs for f in os.listdir(d)]
    config = DiskTierConfig(str(dirs[0]), "fp", 1 << 40, 0, ranks=sharing)
    host = rank_storage(tmp_path / "x", 0, None).host
    assert FileStorage(config, host, Counter()).max_bytes == 100_000_000 // sharing // 2


def test_the_host_tier_is_sized_alike_on_every_rank(monkeypatch):
    """Each rank's host tier is sized from the smallest over the ranks (here a stand-in for the other rank
    with less memory available), and two ranks on one node need twice one tier: 2 x 32 MiB fits 80 MiB
    found free on this rank but not the 48 MiB the other rank found, so both refuse in one sentence
    naming the flag and the ranks on the node."""
    kv, mp = _pools()
    monkeypatch.setattr(host_pool, "available_host_bytes", lambda: 80 << 20)
    one = HostPools(kv, mp, ratio=2.0, size_gb=0, smallest=lambda v: v, ranks_per_node=2)
    assert one.num_tokens == 2048
    with pytest.raises(HostPoolSizeError, match=r"^--hicache-ratio 2 gives a host tier of 0\.0 GB x 2 ranks on "
                       r"this node but only 0\.0 GB .*MemAvailable"):  # fmt: skip
        HostPools(kv, mp, ratio=2.0, size_gb=0, smallest=lambda v: min(v, 48 << 20), ranks_per_node=2)


@pytest.mark.parametrize(
    "argv",
    [
        ["--tp-size", "2"],
        ["--disaggregation-mode", "prefill"],
        ["--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache"],
    ],
)
def test_the_host_tier_is_accepted_with_tp_and_pd(argv):
    args = prepare_server_args(PRESET + ["--enable-hierarchical-cache"] + argv)
    assert args.enable_hierarchical_cache


def test_dp_is_still_refused_in_one_sentence():
    with pytest.raises(ServerArgsError, match="^--enable-hierarchical-cache is not supported with --dp-size"):
        prepare_server_args(PRESET + ["--enable-hierarchical-cache", "--dp-size", "2"])


def test_a_start_error_on_one_rank_is_every_rank_s():
    """Rank 1's disk folder is refused (another user's, a symlink): rank 0 refuses too, naming rank 1,
    instead of serving alone until its first agreement waits for rank 1 forever."""
    from sglang.srt.managers.scheduler_components.tree_cache_factory import _refuse_on_every_rank

    gather = Gather(2)
    why = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR folder /x is a symlink or not a folder; set it to a folder of yours."

    def rank(r: int) -> str | None:
        try:
            _refuse_on_every_rank(SimpleNamespace(gather=gather.for_rank(r)), why if r == 1 else None)
        except ServerArgsError as e:
            return str(e)
        return None

    assert on_ranks([lambda: rank(0), lambda: rank(1)]) == [f"TP rank 1: {why}", why]


@pytest.mark.parametrize("where", ["storage", "host tier"])
def test_any_failure_on_one_rank_is_every_rank_s_refusal(monkeypatch, where):
    """Not only the refusals of our own (ServerArgsError, HostPoolSizeError, DiskTierError): an OSError
    on rank 1 (its disk folder unreadable while the storage config is built, or its host tier's listing
    of that folder) makes both ranks refuse in one sentence naming it, through `create_tree_cache`
    itself; before, the OSError left rank 1 alone and rank 0 waited at the next agreement."""
    from sglang.srt.managers.scheduler_components import tree_cache_factory as factory
    from sglang.srt.mem_cache import hiradix_cache

    gather, local = Gather(2), threading.local()
    monkeypatch.setattr(factory.TpAgreement, "create", classmethod(lambda cls, args: local.tp))
    oserror = OSError(13, "Permission denied", "/x")

    def storage(args, model_runner):
        if where == "storage" and local.rank == 1:
            raise oserror

    def cache(*args, **kwargs):
        if where == "host tier" and local.rank == 1:
            raise oserror
        return "cache"

    monkeypatch.setattr(factory, "_file_storage", storage)
    monkeypatch.setattr(hiradix_cache, "HiMambaRadixCache", cache)
    args = SimpleNamespace(disable_radix_cache=False, enable_hierarchical_cache=True, page_size=1,
                           hicache_write_policy="write_through", hicache_ratio=2.0, hicache_size=0)  # fmt: skip
    runner = SimpleNamespace(token_to_kv_pool=None)

    def rank(r: int) -> str:
        local.rank, local.tp = r, SimpleNamespace(gather=gather.for_rank(r))
        try:
            return factory.create_tree_cache(args, runner, SimpleNamespace(), None)
        except ServerArgsError as e:
            return str(e)

    why = "the host tier failed to start: PermissionError: [Errno 13] Permission denied: '/x'"
    assert on_ranks([lambda: rank(0), lambda: rank(1)]) == [f"TP rank 1: {why}", why]
