"""The host tier's state eviction (mem_cache/host_tree.py) and write_through's backups of one batch
(`HiMambaRadixCache.take_host_copies`), on a model-free tree with synthetic states (mem_cache_sim): the
host keeps each conversation's deepest checkpoint where plain LRU loses the oldest conversations; interior
checkpoints go first, branch points after the chains' interior ones; a batch's shallower snapshots on one
path are not backed up unless paths branch there or one is just above a deeper backup; a host eviction
makes the disk tier's kept TP answers be agreed again."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch

from sglang.srt.mem_cache.common import evict_from_tree_cache
from sglang.srt.mem_cache.disk_tier import DiskTierConfig, entry_name
from sglang.srt.mem_cache.hiradix_cache import HiMambaRadixCache
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.test.ci_register import register_cpu_ci
from sglang.test.mem_cache_sim import MemCacheSim, tag

register_cpu_ci(est_time=2, suite="per-commit-cpu")  # measured 1.5 s (the tests 0.6 s)

STEP = 8  # tokens between two checkpoints of a conversation


def _sim(
    device_slots: int, ratio: float, kv_tokens: int = 512, storage: DiskTierConfig | None = None
) -> MemCacheSim:
    """A MemCacheSim whose tree is the hierarchical cache (write_through), host slots = ratio x device."""
    sim = MemCacheSim(mamba_slots=device_slots, kv_tokens=kv_tokens)
    kv_pool = MHATokenToKVPool(sim.kv.size, 1, torch.float32, 1, 1, [0])
    sim.tree = HiMambaRadixCache(sim.pool, sim.kv, 1, kv_pool, "write_through", ratio, storage=storage)
    sim.kv_pool = kv_pool
    return sim


def _conversation(c: int, depth: int) -> list[int]:
    return [1000 * (c + 1) + i for i in range(depth)]


def _checkpoint(sim: MemCacheSim, key: list[int]) -> None:
    """Insert `key` into the device tree, extending what it holds of it, with a checkpoint tagged `key`."""
    tree = sim.tree
    m = tree.match_prefix(key)
    path = [] if m.last_device_node is tree.root else m.last_device_node.path_value()
    prev = len(path)
    fresh = sim.kv.alloc_extend(prev, len(key), path[-1] if prev else 0)
    for i, s in enumerate(fresh):
        sim.kv_tags[s] = sim.kv_pool.k_buffer[0][s] = tag(key[: prev + i + 1])
    slot = tree.alloc_mamba_slot()
    assert slot is not None
    sim.write_state(slot, key)
    assert not tree.insert(key, path + fresh, slot, prev).mamba_exist


def _batch(sim: MemCacheSim) -> None:
    """One batch: seal the due backups and run them (the forward stream's part)."""
    sim.tree.run_host_copies(sim.tree.take_host_copies())


def _on_host(sim: MemCacheSim, key: list[int]) -> bool:
    """The host holds a checkpoint at the end of `key`, and it holds the state and the KV of `key`."""
    tree = sim.tree
    end = tree._host_end(key, None)
    if end is None:
        return False
    host = tree.host
    assert torch.all(host.conv_state[:, end.mamba_value] == tag(key))
    kv = host.k_buffer[0][end.path_value()].flatten().tolist()
    assert kv == [tag(key[: i + 1]) for i in range(len(key))]
    return True


def _cyclic_workload(sim: MemCacheSim, conversations: int, checkpoints: int) -> list[bool]:
    """Each conversation's checkpoints one batch each (every one backed up), conversation after
    conversation; returns, per conversation, whether its deepest checkpoint is still on host."""
    for c in range(conversations):
        for j in range(1, checkpoints + 1):
            _checkpoint(sim, _conversation(c, j * STEP))
            _batch(sim)
    sim.check()
    return [_on_host(sim, _conversation(c, checkpoints * STEP)) for c in range(conversations)]


@pytest.mark.parametrize("conversations", [6, 8])
def test_the_host_keeps_every_conversations_deepest_checkpoint(conversations):
    """6 (then 8) conversations of 4 checkpoints each, backed up one by one into 8 host state slots
    (device 4, ratio 2): every conversation's deepest checkpoint stays on host, beside 2 (then 0)
    interior ones, the newest conversation's. With 8, every slot holds a leaf when a conversation's next
    checkpoint arrives: its own previous one goes (the backup puts a deeper one below it), not another
    conversation's. Plain LRU (negative control) keeps the last 8 backed up: the last 2 conversations
    alone, the others lost whole."""
    sim = _sim(device_slots=4, ratio=2)
    assert sim.tree.host.slot_allocator.size == 8
    assert _cyclic_workload(sim, conversations, 4) == [True] * conversations
    host_tree = sim.tree.host_tree
    interior = [n for n in host_tree.nodes() if n.mamba_value is not None and n.children]
    assert host_tree.mamba_total_size() == 8 and len(interior) == 8 - conversations
    assert all(n.path_key()[0] == _conversation(conversations - 1, 1)[0] for n in interior)

    sim = _sim(device_slots=4, ratio=2)
    sim.tree.host_tree.evict_mamba = partial(MambaRadixCache.evict_mamba, sim.tree.host_tree)
    assert _cyclic_workload(sim, conversations, 4) == [False] * (conversations - 2) + [True] * 2


def test_branch_points_go_after_the_chains_interior_checkpoints():
    """A branch point (a shared prefix's checkpoint with two conversations below it) older than every
    other checkpoint outlives the interior checkpoints of single paths, LRU among those; once no such
    one is left, it goes before any leaf."""
    sim = _sim(device_slots=4, ratio=2)
    prefix = [7] * STEP
    for key in (prefix, prefix + [1] * STEP, prefix + [2] * STEP):
        _checkpoint(sim, key)
        _batch(sim)
    for c in range(3):  # 3 chains of 2 checkpoints: 3 fork/leaves + 6 = 9 > 8 slots
        for j in (1, 2):
            _checkpoint(sim, _conversation(c, j * STEP))
            _batch(sim)
    assert _on_host(sim, prefix), "the branch point outlived the chains' interior checkpoints"
    assert not _on_host(sim, _conversation(0, STEP)), "the oldest chain's interior checkpoint went first"
    assert _on_host(sim, _conversation(1, STEP))
    for c in range(3, 5):  # 2 more chains, each backup dropping a chain's interior checkpoint
        for j in (1, 2):
            _checkpoint(sim, _conversation(c, j * STEP))
            _batch(sim)
    assert _on_host(sim, prefix)
    _checkpoint(sim, _conversation(5, STEP))  # no chain's interior checkpoint is left: the branch point goes
    _batch(sim)
    sim.check()
    assert not _on_host(sim, prefix)
    deepest = [prefix + [1] * STEP, prefix + [2] * STEP] + [_conversation(c, 2 * STEP) for c in range(5)]
    assert all(_on_host(sim, k) for k in deepest + [_conversation(5, STEP)]), "a leaf went before it"


def test_one_batch_backs_up_a_paths_deepest_snapshot_and_its_branch_points():
    """A conversation's 4 snapshots due in one batch: the deepest is backed up (with the whole path's
    KV) and the one just above it (its state only: what an exact repeat of the deepest one's path
    resumes from, `backups_repeat_point`), the 2 others skipped and counted; a checkpoint where two
    paths due in the same batch branch is backed up too."""
    sim = _sim(device_slots=8, ratio=2)
    for j in range(1, 5):
        _checkpoint(sim, _conversation(0, j * STEP))
    _batch(sim)
    stats = sim.tree.controller.stats
    assert stats["backup_states"] == 2 and stats["backups_skipped_covered"] == 2
    assert stats["backups_repeat_point"] == 1 and stats["backup_tokens"] == 4 * STEP
    assert _on_host(sim, _conversation(0, 4 * STEP)) and _on_host(sim, _conversation(0, 3 * STEP))
    assert not _on_host(sim, _conversation(0, STEP)) and not _on_host(sim, _conversation(0, 2 * STEP))
    prefix = [7] * STEP
    for key in (prefix, prefix + [1] * STEP, prefix + [2] * STEP):
        _checkpoint(sim, key)
    _batch(sim)
    assert stats["backup_states"] == 5 and stats["backups_skipped_covered"] == 2
    assert all(_on_host(sim, k) for k in (prefix, prefix + [1] * STEP, prefix + [2] * STEP))
    sim.check()


def test_a_skipped_snapshot_is_backed_up_where_the_deeper_one_finds_no_room():
    """Host KV of 512 tokens, 400 of them held by a checkpoint being loaded (locked, unevictable): a
    conversation's snapshots at 64 and 192 tokens are due in one batch. The deeper backup finds no room
    (192 > 112 free); the shallower one, skipped while the deeper was to be backed up, is backed up
    instead (64 fit), with its path's KV. Before: neither reached the host."""
    sim = _sim(device_slots=8, ratio=1)
    tree = sim.tree
    assert tree.host.token_allocator.num_pages == 512
    held = _conversation(0, 400)
    _checkpoint(sim, held)
    _batch(sim)
    end = tree._host_end(held, None)
    tree.host_tree.inc_lock_ref(end)  # (as a load of it does)
    tree.evict(num_tokens=400)  # (the device's copy goes: room for the next conversation)
    for depth in (64, 192):
        _checkpoint(sim, _conversation(1, depth))
    _batch(sim)
    stats = tree.controller.stats
    assert stats["backups_no_room"] == 1 and stats["backups_covered_retried"] == 1, stats
    assert stats["backups_skipped_covered"] == 0, stats
    assert _on_host(sim, _conversation(1, 64)) and not _on_host(sim, _conversation(1, 192))
    tree.host_tree.dec_lock_ref(end)
    sim.check()


def _scan_choice(host_tree, num: int) -> tuple[list, list]:
    """The choice of the pass over the LRU that `HostRadixTree.evict_mamba` made before its class index
    (the reference): (the checkpoints it frees, in order; the pinned ones it steps over)."""
    chains, forks, leaves, passed = [], [], [], []
    if num <= 0:
        return [], []
    for node in host_tree.mamba_lru:
        if node.mamba_lock_ref:
            passed.append(node)
            continue
        children = len(node.children) + (node is host_tree._extending)
        (chains if children == 1 else forks if children else leaves).append(node)
        if len(chains) >= num:
            break
    return (chains + forks + leaves)[:num], passed


@pytest.mark.parametrize("seed", range(3))
def test_the_class_index_chooses_what_the_lru_pass_chose(seed):
    """A random workload on a small host tier (8 state slots, 512 KV tokens): conversations branching
    off shared prefixes, checkpoints backed up batch by batch, host checkpoints pinned and unpinned (as
    loads do) and refreshed, and host state evictions of 2-4 checkpoints at once (before the push numbers
    one could take a checkpoint twice: a TypeError freeing its slot again). At every host state eviction
    the checkpoints freed are the reference pass's, in its order, and afterwards the LRU order is the
    pass's (the pinned ones it stepped over moved to the most recent end, in order); the tree's integrity
    (the index in step with the LRU, the children and the pins: `HostRadixTree.sanity_check`) holds after
    every batch."""
    rng = random.Random(seed)
    sim = _sim(device_slots=8, ratio=1)
    tree, host_tree = sim.tree, sim.tree.host_tree
    evict = host_tree.evict_mamba
    seen = {"calls": 0, "several": 0, "passed": 0, "leaves": 0, "interior": 0, "kv_evictions": 0}

    def checked(num: int) -> int:
        chosen, passed = _scan_choice(host_tree, num)
        interior = any(n.children or n is host_tree._extending for n in chosen)
        before = list(host_tree.mamba_lru)
        freed = evict(num)
        gone = [n for n in before if n.mamba_value is None]
        assert freed == len(chosen) and gone == sorted(chosen, key=before.index), (num, chosen, gone)
        stay = [n for n in before if n.mamba_value is not None and n not in passed]
        assert list(host_tree.mamba_lru) == stay + passed
        seen["calls"] += num > 0
        seen["several"] += freed >= 2
        seen["passed"] += bool(passed)
        seen["leaves"] += any(not n.children for n in chosen)
        seen["interior"] += interior
        return freed

    host_tree.evict_mamba = checked
    evict_full = host_tree.evict_full

    def counted_full(num_tokens: int) -> int:
        seen["kv_evictions"] += 1
        return evict_full(num_tokens)

    host_tree.evict_full = counted_full
    pinned: list = []
    prefixes = [[], [7] * STEP, [7] * STEP + [8] * STEP]
    for _ in range(300):
        op = rng.random()
        if op < 0.5:
            depth = rng.randrange(1, 4) * rng.choice([STEP, 5 * STEP])  # (long ones: host KV pressure)
            key = rng.choice(prefixes) + _conversation(rng.randrange(6), depth)
            m = tree.match_prefix(key)
            have = 0 if m.last_device_node is tree.root else m.last_device_node.path_len()
            if have < len(key):
                evict_from_tree_cache(tree, sim.kv, len(key) - have)
                _checkpoint(sim, key)
        elif op < 0.75:
            _batch(sim)
            host_tree.sanity_check()  # (the whole integrity check wants no host lock: at the end)
        elif op < 0.85 and len(pinned) < 2 and len(host_tree.mamba_lru):
            node = rng.choice(list(host_tree.mamba_lru))
            host_tree.inc_lock_ref(node)
            pinned.append(node)
        elif op < 0.92 and pinned:
            host_tree.dec_lock_ref(pinned.pop(rng.randrange(len(pinned))))
        elif op < 0.96 and len(host_tree.mamba_lru):
            host_tree.mamba_lru.touch(rng.choice(list(host_tree.mamba_lru)))
        elif op >= 0.96:  # (more than one at once: an eviction must not take a checkpoint twice)
            host_tree.evict_mamba(rng.randrange(2, 5))
    for node in pinned:
        host_tree.dec_lock_ref(node)
    sim.check()
    # (every case met: measured 60-78 calls a seed, 10-12 of them freeing several)
    assert seen["calls"] >= 20 and all(seen.values()), seen


def test_the_class_index_stays_as_small_as_the_tree_under_churn():
    """A checkpoint never refreshed (a shared prefix's) whose children come and go: 60 conversations off
    it, each backed up (136 tokens each, host KV of 256: each backup evicts the previous one's leaf). Each
    change of its class pushes an entry at its one unchanged stamp; only the latest push may be valid.
    Before: every earlier push at the same stamp and class became valid again, none was ever dropped, and
    the heaps grew by 5 entries a cycle (300 after 60 cycles with 2 checkpoints held; 6,000 + 2,999 +
    3,002 after 3,000 with 296-token children). Now they hold at most 2 x checkpoints + 64 entries after
    every cycle and exactly one valid entry per checkpoint (`sanity_check`)."""
    sim = _sim(device_slots=8, ratio=1, kv_tokens=256)
    tree, host_tree = sim.tree, sim.tree.host_tree
    assert tree.host.token_allocator.num_pages == 256
    prefix = [7] * STEP
    _checkpoint(sim, prefix)
    _batch(sim)
    shared = tree._host_end(prefix, None)
    stamp = host_tree._cls[shared.id][0]
    sizes = []
    for i in range(1, 61):
        key = prefix + _conversation(i, 136)
        evict_from_tree_cache(tree, sim.kv, len(key))
        _checkpoint(sim, key)
        _batch(sim)
        assert tree._host_end(key, None) is not None
        sizes.append((sum(map(len, host_tree._heaps)), len(host_tree._cls)))
    assert host_tree._cls[shared.id][0] == stamp and shared.mamba_value is not None  # (never refreshed)
    assert tree.controller.stats["backup_states"] == 61
    assert all(total <= 2 * live + 64 for total, live in sizes), sizes
    host_tree.sanity_check()
    sim.check()


def test_a_host_eviction_forgets_the_agreed_disk_answers(tmp_path):
    """Under TP a prompt's disk lookup is agreed once and reused (`FileStorage.deepest`) until an event
    every rank takes alike. A's prompt is looked up before its 64-token checkpoint's disk write ran (no
    hit: the answer kept), then the host backs the checkpoint up and writes it to disk, then evicts it
    (5 other conversations into 4 host slots). A's prompt comes back: the host eviction forgot the kept
    answer (`HiMambaRadixCache._host_room`), so the disk entry is found and read into the host (its KV
    and state checked against the tags). Without that hook the kept "no hit" is reused: nothing loaded."""
    sim = _sim(device_slots=4, ratio=1, storage=DiskTierConfig(str(tmp_path), "fp", 1 << 30))
    tree, storage = sim.tree, sim.tree.storage
    storage.gather = lambda value: [value]  # (one rank's all-gather: the agreement and its reuse on)
    a = _conversation(0, 64)
    prompt = a + [5] * STEP
    _checkpoint(sim, a)
    tree._load_from_host(prompt, None)  # (admission: the lookup, before the batch that writes A)
    _batch(sim)
    assert entry_name(a, None) in storage.index and _on_host(sim, a)
    for c in range(1, 6):
        _checkpoint(sim, _conversation(c, STEP))
        _batch(sim)
    assert not _on_host(sim, a)
    tree.evict(num_tokens=512)  # (nor on the device: only the disk holds A)
    tree._load_from_host(prompt, None)
    _batch(sim)
    assert storage.stats["disk_reads"] == 1 and _on_host(sim, a), storage.stats
    sim.check()
