"""MambaRadixCache operations, one scenario each; every test ends with the accounting check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.inflight_batches import InflightBatches
from sglang.test.ci_register import register_cpu_ci
from sglang.test.mem_cache_sim import MemCacheSim, tag

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def _insert(
    sim: MemCacheSim,
    key: list[int],
    prev: int = 0,
    tree_values: list[int] | None = None,
    ns: str | None = None,
) -> tuple:
    """Insert `key` with fresh KV (tree-owned values for the first `prev` positions) and a fresh
    checkpoint tagged with `key`, in prefix-cache namespace `ns`; returns (InsertResult, checkpoint slot)."""
    fresh = sim.kv.alloc_extend(prev, len(key), (tree_values or [0])[-1] if prev else 0)
    for i, s in enumerate(fresh):
        sim.kv_tags[s] = tag(key[: prev + i + 1])
    slot = sim.pool.mamba_allocator.alloc(1)[0]
    sim.write_state(slot, key)
    res = sim.tree.insert(key, (tree_values or [])[:prev] + fresh, slot, prev, ns)
    if res.mamba_exist:
        sim.pool.mamba_allocator.free([slot])
    return res, slot


def _match_len(sim: MemCacheSim, key: list[int], ns: str | None = None) -> int:
    m = sim.tree.match_prefix(key, namespace=ns)
    sim.assert_match_tags(key, m.device_indices, m.last_device_node)
    return len(m.device_indices)


def test_upstream_scenario_insert_split_evict():
    sim = MemCacheSim(chunk=2, extra_buffer=False)
    _insert(sim, [1, 2, 3])
    _insert(sim, [1, 2, 3, 4, 5, 6, 7])
    _insert(sim, [10, 11, 12])
    _insert(sim, [1, 2, 3, 4, 5, 60, 70])
    sim.check()
    m = sim.tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert len(m.device_indices) == 7 and list(m.last_device_node.key) == [6, 7]
    split = m.last_device_node.parent
    assert list(split.key) == [4, 5] and split.mamba_value is None, "the split parent is a tombstone"
    assert _match_len(sim, [1, 2, 3, 4, 5, 99]) == 3, "KV through the tombstone, state only at [1,2,3]"
    sim.check()

    # LRU order is now [10,11,12] < [1,2,3] < [4,5] < [60,70] < [6,7] (the match refreshed its path).
    assert sim.tree.evict(num_tokens=1).num_tokens_evicted == 3
    assert _match_len(sim, [10, 11, 12]) == 0
    assert sim.tree.evict(num_tokens=1).num_tokens_evicted == 2  # [60,70]
    assert _match_len(sim, [1, 2, 3, 4, 5, 6, 7]) == 7
    # Mamba LRU: a([1,2,3]) is the least recent checkpoint and an inner node: it becomes a tombstone.
    assert sim.tree.evict(mamba_num=1).num_mamba_evicted == 1
    assert _match_len(sim, [1, 2, 3]) == 0
    assert _match_len(sim, [1, 2, 3, 4, 5, 6, 7]) == 7, "the deeper checkpoint still works through tombstones"
    assert sim.tree.evict(mamba_num=1).num_mamba_evicted == 1
    assert sim.tree.total_size() == 0, "the last leaf went, and every tombstone ancestor with it"
    sim.check()


def test_namespaces_share_no_prefix():
    """Upstream's `extra_key` / `cache_salt`: a sequence is matched only among those of its namespace
    (None: the shared one); splits stay inside a namespace, and eviction empties them all alike."""
    sim = MemCacheSim(chunk=2, extra_buffer=False)
    _insert(sim, [1, 2, 3, 4])
    _insert(sim, [1, 2, 3, 4, 5, 6], ns="a")
    _insert(sim, [1, 2, 9, 9], ns="a")  # splits a's node after [1, 2]
    _insert(sim, [1, 2, 3, 4], ns="b")
    sim.check()  # (child keys carry the namespace; a node's children are in its namespace)
    assert _match_len(sim, [1, 2, 3, 4, 5, 6]) == 4
    assert _match_len(sim, [1, 2, 3, 4, 5, 6], "a") == 6
    assert _match_len(sim, [1, 2, 9, 9], "a") == 4 and _match_len(sim, [1, 2, 9, 9]) == 0
    assert _match_len(sim, [1, 2, 3, 4, 5, 6], "b") == 4
    assert _match_len(sim, [1, 2, 3, 4], "c") == 0
    assert len(sim.tree.root.children) == 3  # one entry per namespace for the same first token
    while sim.tree.total_size():
        assert sim.tree.evict(num_tokens=1).num_tokens_evicted > 0
    sim.check()


def test_mamba_lru_refreshes_only_the_consumed_node():
    sim = MemCacheSim(chunk=2, extra_buffer=False)
    _, a = _insert(sim, [1, 2, 3, 4])
    _, b = _insert(sim, [1, 2, 3, 4, 5, 6, 7, 8])
    _, c = _insert(sim, [20, 21, 22, 23])
    assert _match_len(sim, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    sim.tree.evict_mamba(1)
    held = set(sim.tree.held_mamba_slots())
    assert held == {b, c}, "refreshing the whole chain would have evicted the other session's c"
    sim.check()


def _locked_head_tree(locked: int, free: int) -> tuple[MemCacheSim, list, list[int]]:
    """`locked` checkpoints held as by requests (the least recently used: where running requests'
    nodes gather), then `free` unlocked ones, some inner nodes and some leaves; returns the locked
    nodes and the free slots in LRU order."""
    sim = MemCacheSim(
        chunk=2, extra_buffer=False, mamba_slots=locked + free + 4, kv_tokens=8 * (locked + free)
    )
    held = []
    for i in range(locked):
        res, _ = _insert(sim, [100 + i, 1])
        sim.tree.inc_lock_ref(res.last_node)
        held.append(res.last_node)
    order = []
    for i in range(free):
        res, slot = _insert(sim, [200 + i, 1])
        order.append(slot)
        if i % 3 == 0:  # an inner node with a checkpoint: freeing it leaves a tombstone
            _, deeper = _insert(sim, [200 + i, 1, 5, 6], prev=2, tree_values=list(res.last_node.value))
            order.append(deeper)
    return sim, held, order


def _count_lru_visits(monkeypatch) -> list:
    """The nodes every LRU-list walk visits from now on, in a list that grows as they are walked."""
    from sglang.srt.mem_cache.mamba_tree import LRUList

    visits, walk = [], LRUList.__iter__

    def counted(lru):
        for node in walk(lru):
            visits.append(node)
            yield node

    monkeypatch.setattr(LRUList, "__iter__", counted)
    return visits


def test_evict_mamba_frees_in_lru_order_in_one_pass(monkeypatch):
    """Freeing 7 of 12 unlocked checkpoints frees the 7 least recent, as 7 single evictions do (LRU
    order past the locked nodes, inner nodes and leaves alike), and walks the LRU list once: 64 locked
    nodes ahead cost ~71 visits, where a scan from the list's start per checkpoint took ~7 x 64."""
    sim, held, order = _locked_head_tree(locked=64, free=9)
    one_by_one, _, _ = _locked_head_tree(locked=64, free=9)
    visits = _count_lru_visits(monkeypatch)
    assert len(order) == 12 and sim.tree.evict_mamba(7) == 7
    assert len(visits) <= 64 + 7 + 1
    for _ in range(7):
        assert one_by_one.tree.evict_mamba(1) == 1
    assert sorted(sim.tree.held_mamba_slots()) == sorted(one_by_one.tree.held_mamba_slots())
    assert set(order[7:]) <= set(sim.tree.held_mamba_slots()), "the 5 most recent unlocked ones stay"
    assert not set(order[:7]) & set(sim.tree.held_mamba_slots()), "the 7 least recent went"
    assert sim.tree.evict_mamba(100) == 5, "then the rest; locked checkpoints never"
    for node in held:
        sim.tree.dec_lock_ref(node)
    sim.check()


def test_evict_mamba_steps_over_locked_checkpoints_once(monkeypatch):
    """The locked checkpoints a pass steps over (running requests' prefixes) move to the recent end: the
    next eviction starts at the unlocked ones instead of walking all 64 again, and still frees in the
    same order as before among the unlocked."""
    sim, held, order = _locked_head_tree(locked=64, free=9)
    visits = _count_lru_visits(monkeypatch)
    assert sim.tree.evict_mamba(1) == 1 and len(visits) == 65
    visits.clear()
    assert sim.tree.evict_mamba(1) == 1 and len(visits) == 1
    assert not set(order[:2]) & set(sim.tree.held_mamba_slots()), "the 2 least recent unlocked went"
    for node in held:
        sim.tree.dec_lock_ref(node)
    sim.check()


def _random_tree(seed: int) -> tuple[MemCacheSim, list]:
    """Keys over three tokens with shared prefixes (splits, tombstones, chains of checkpoints whose
    parents become leaves as they go), a third of them locked as by requests, then half of them matched
    again in random order, so that recency is not creation order."""
    import random

    rng = random.Random(seed)
    sim = MemCacheSim(chunk=2, extra_buffer=False, mamba_slots=200, kv_tokens=2000)
    held, keys = [], []
    for _ in range(60):
        key = [rng.randint(1, 3) for _ in range(rng.randint(2, 12))]
        keys.append(key)
        m = sim.tree.match_prefix(key)
        if len(m.device_indices) < len(key):
            prev = len(m.device_indices)
            res, _ = _insert(sim, key, prev=prev, tree_values=list(m.device_indices))
            node = res.last_node
        else:
            node = m.last_device_node
        if rng.random() < 0.3 and node.mamba_value is not None:
            sim.tree.inc_lock_ref(node)
            held.append(node)
    for key in rng.sample(keys, 30):  # matches refresh old paths: recency unlike creation order
        sim.tree.match_prefix(key)
    return sim, held


@pytest.mark.parametrize("seed", range(6))
def test_evict_full_frees_the_leaves_single_evictions_would(seed, monkeypatch):
    """Evicting N tokens frees the same KV, checkpoints and nodes as single-leaf evictions repeated until
    N are free (least recent unlocked leaf first, a parent once its last child goes), on random trees."""
    for target in (1, 7, 30, 60, 10_000):
        sim, held = _random_tree(seed)
        ref, ref_held = _random_tree(seed)
        freed = sim.tree.evict_full(target)
        ref_freed = 0
        while ref_freed < target:
            n = ref.tree.evict_full(1)
            if n == 0:
                break
            ref_freed += n
        assert freed == ref_freed
        assert sorted(sim.tree.held_kv_slots()) == sorted(ref.tree.held_kv_slots())
        assert sorted(sim.tree.held_mamba_slots()) == sorted(ref.tree.held_mamba_slots())
        for tree_sim, locked in ((sim, held), (ref, ref_held)):
            for node in locked:
                tree_sim.tree.dec_lock_ref(node)
            tree_sim.check()


def test_evict_full_walks_the_lru_a_bounded_number_of_times(monkeypatch):
    """Evicting many leaves behind many locked nodes walks the LRU list at most three times (scans from
    its start until they have walked its length, then one ranking pass), where a scan per leaf walked
    the locked nodes once per leaf."""
    sim, held, order = _locked_head_tree(locked=64, free=9)
    visits = _count_lru_visits(monkeypatch)
    size = len(sim.tree.full_lru)
    assert sim.tree.evict_full(10_000) > 0 and not set(order) & set(sim.tree.held_mamba_slots())
    assert len(visits) <= 3 * size
    for node in held:
        sim.tree.dec_lock_ref(node)
    sim.check()


def test_insert_frees_duplicates_only_past_prev_prefix_len():
    sim = MemCacheSim(chunk=2, extra_buffer=False)
    key = list(range(1, 11))
    _insert(sim, key[:6])
    tree_values = sim.tree.match_prefix(key[:6]).device_indices
    free0 = sim.kv.available_size()
    res, _ = _insert(sim, key, prev=6, tree_values=tree_values)
    assert res.prefix_len == 6 and not res.mamba_exist
    assert sim.kv.available_size() == free0 - 4, "positions 6..9 are new; nothing freed"
    free1 = sim.kv.available_size()
    res, _ = _insert(sim, key, prev=3, tree_values=tree_values)
    assert res.mamba_exist and res.prefix_len == 10
    assert sim.kv.available_size() == free1, "7 fresh slots allocated, 7 duplicates (positions 3..9) freed"
    sim.check()


def test_cow_on_hit_copies_the_checkpoint_on_the_forward_stream():
    sim = MemCacheSim(chunk=4)
    ids = list(range(1, 30))
    a = sim.new_req(ids)
    assert sim.admit(a)
    sim.extend(a, 28, track_at=24)
    a.output_ids = [7]
    sim.finish(a)  # checkpoints at the track position 24 and at a's final 28
    b = sim.new_req(ids + [40, 41])
    m = sim.match(b)
    assert len(m.device_indices) == 28 and b.mamba_cow_src_index == m.last_device_node.mamba_value
    assert b.mamba_pool_idx is not None and b.mamba_pool_idx != b.mamba_cow_src_index
    assert not b.mamba_needs_clear
    sim.mp.conv_state[:, b.mamba_pool_idx] = -1.0  # stale content a skipped copy would leave
    sim.mp.ssm_state[:, b.mamba_pool_idx] = -1.0
    sim.tree.release_match(b)
    assert sim.admit(b)
    assert sim.state_tag(b.mamba_pool_idx) == tag(ids[:28]), "the running slot holds the checkpoint"
    assert b.cache_protected_len == 28 and b.last_node.mamba_lock_ref == 1
    sim.check()


def test_matched_but_not_admitted_releases_cow_slot_and_lock():
    sim = MemCacheSim(chunk=4, rows=1)
    ids = list(range(1, 20))
    a = sim.new_req(ids)
    sim.admit(a)
    sim.extend(a, 18, track_at=16)
    sim.cache_unfinished(a)  # a keeps running, holding the only row
    free = sim.pool.mamba_allocator.available_size()
    b = sim.new_req(ids + [3])
    assert not sim.admit(b), "no request row left"
    assert b.mamba_pool_idx is None and b.mamba_cow_src_index is None and not b.mamba_needs_clear
    assert b.last_node is None and sim.pool.mamba_allocator.available_size() == free
    sim.check()


def _decoded_to_38(sim: MemCacheSim) -> tuple[list[int], Req]:
    """A request of 39 prompt tokens that ran 38 positions with a track snapshot at 36, two outputs."""
    ids = list(range(1, 40))
    r = sim.new_req(ids)
    sim.admit(r)
    sim.extend(r, 38, track_at=36)
    r.output_ids = [5, 6]
    return ids, r


def test_cache_finished_req_extra_buffer_inserts_the_track_snapshot_and_the_final_state():
    sim = MemCacheSim(chunk=4)
    ids, r = _decoded_to_38(sim)
    running = r.mamba_pool_idx
    sim.finish(r)
    assert sim.tree.total_size() == 38, "all of the request's KV, up to its final state"
    assert sim.state_tag(sim.tree.match_prefix(ids).last_device_node.mamba_value) == tag(ids[:38])
    assert running in sim.tree.held_mamba_slots(), "the running slot was donated, not copied"
    node36 = sim.tree.match_prefix(ids[:37]).last_device_node
    assert sim.state_tag(node36.mamba_value) == tag(ids[:36]), "the track snapshot stays a checkpoint"
    assert sim.pool.mamba_allocator.available_size() == 30, "the other track slot freed, two donated"
    sim.check()


def test_cache_finished_req_extra_buffer_inserts_up_to_the_track_position_while_a_batch_is_in_flight():
    """A batch in flight still advances the running state (the request finished on the token that
    batch feeds it): only the track snapshot goes in, and the KV past it is freed."""
    sim = MemCacheSim(chunk=4)
    ids, r = _decoded_to_38(sim)
    r.inflight = InflightBatches(8)
    r.inflight.add(SimpleNamespace(reqs=[r], batch_size=1, sample_rows=[True]))
    assert r.num_inflight == 1
    kv_before = sim.kv.available_size()
    sim.finish(r)
    assert sim.tree.total_size() == 36, "KV past the last snapshot is freed"
    assert sim.kv.available_size() == kv_before + 2
    node = sim.tree.match_prefix(ids).last_device_node
    assert sim.state_tag(node.mamba_value) == tag(ids[:36])
    assert sim.pool.mamba_allocator.available_size() == 31, "running + other track slot freed, keep donated"
    sim.check()


def test_cache_finished_req_final_state_only_on_a_page_boundary():
    """A checkpoint ends a page-aligned key: with KV ending inside a page, the final state is not
    inserted (the track snapshot is)."""
    sim = MemCacheSim(chunk=4, page_size=4)
    ids, r = _decoded_to_38(sim)
    sim.finish(r)
    assert sim.tree.total_size() == 36
    sim.check()


def test_cache_finished_req_no_buffer_donates_the_running_slot():
    sim = MemCacheSim(extra_buffer=False)
    ids = list(range(1, 12))
    r = sim.new_req(ids)
    sim.admit(r)
    sim.extend(r, 10)
    r.output_ids = [50]
    running = r.mamba_pool_idx
    sim.finish(r)
    assert sim.tree.held_mamba_slots() == [running] and sim.tree.total_size() == 10
    assert _match_len(sim, ids + [50]) == 10
    # The same prompt again: its last token is recomputed, so it needs the state after 10 tokens.
    again = sim.new_req(ids)
    assert sim.admit(again) and again.cache_protected_len == 10
    sim.check()


def test_duplicate_finish_keeps_the_tree_slot_and_frees_the_request_slot():
    sim = MemCacheSim(chunk=4)
    ids = list(range(1, 21))
    for _ in range(2):
        r = sim.new_req(ids)
        sim.admit(r)  # no hit: the prompt's last token is recomputed, and no checkpoint sits before it
        sim.extend(r, 20, track_at=20)
        r.output_ids = [1]
        sim.finish(r)
        assert len(sim.tree.held_mamba_slots()) == 1
    assert sim.pool.mamba_allocator.available_size() == 31
    sim.check()


def test_cache_unfinished_req_hands_the_snapshot_over_and_keeps_running():
    sim = MemCacheSim(chunk=4)
    ids = list(range(1, 60))
    r = sim.new_req(ids)
    sim.admit(r)
    sim.extend(r, 24, track_at=24)
    held_before = sim.pool.mamba_slots_of(r)
    sim.cache_unfinished(r)
    assert r.cache_protected_len == 24 and r.mamba_last_track_seqlen is None
    assert len(sim.pool.mamba_slots_of(r)) == len(held_before), "a fresh slot took the snapshot's place"
    node = sim.tree.match_prefix(ids[:24]).last_device_node
    assert node is r.last_node and sim.state_tag(node.mamba_value) == tag(ids[:24])
    sim.extend(r, 24, track_at=48)
    sim.cache_unfinished(r)
    assert r.cache_protected_len == 48
    sim.check()


def test_cache_unfinished_req_skips_the_checkpoint_when_no_slot_can_be_had():
    sim = MemCacheSim(chunk=4, mamba_slots=3)  # running + 2 track slots: nothing spare, nothing evictable
    r = sim.new_req(list(range(1, 40)))
    sim.admit(r)
    sim.extend(r, 24, track_at=24)
    sim.cache_unfinished(r)
    assert sim.tree.total_size() == 0 and r.cache_protected_len == 0
    assert r.mamba_last_track_seqlen == 24, "the snapshot stays with the request"
    sim.check()


def test_no_buffer_chunked_caching_queues_a_copy_to_the_forward_stream():
    sim = MemCacheSim(extra_buffer=False)
    ids = list(range(1, 40))
    r = sim.new_req(ids)
    sim.admit(r)
    sim.extend(r, 16)
    sim.tree.cache_unfinished_req(r, chunked=True)
    copies = sim.tree.take_pending_state_copies()
    assert len(copies) == 1 and copies[0][0] == r.mamba_pool_idx
    sim.mp.copy_from([copies[0][0]], [copies[0][1]])
    node = sim.tree.match_prefix(ids[:16]).last_device_node
    assert node.mamba_value == copies[0][1] and sim.state_tag(node.mamba_value) == tag(ids[:16])
    sim.check()


def test_branching_point_is_chunk_aligned():
    sim = MemCacheSim(chunk=8)
    ids = list(range(1, 40))
    r = sim.new_req(ids)
    sim.admit(r)
    sim.extend(r, 38, track_at=32)
    sim.cache_unfinished(r)
    sim.extend(r, 1)
    r.output_ids = [9]
    sim.finish(r)
    # A prompt sharing 20 tokens: KV matches 20 (a split), no checkpoint there; branching at 16.
    b = sim.new_req(ids[:20] + [100, 101, 102])
    m = sim.match(b)
    assert m.kv_match_len == 20 and len(m.device_indices) == 0 and b.mamba_branching_seqlen == 16
    sim.tree.release_match(b)
    sim.check()


@pytest.mark.parametrize("page", [4, 16])
def test_page_aligned_matches_and_inserts(page):
    sim = MemCacheSim(page_size=page, chunk=page, kv_tokens=1024)
    ids = list(range(1, 3 * page + 3))
    r = sim.new_req(ids)
    sim.admit(r)
    sim.extend(r, len(ids) - 1, track_at=3 * page)
    r.output_ids = [1]
    sim.finish(r)
    assert sim.tree.total_size() == 3 * page
    b = sim.new_req(ids[: 2 * page + 1] + [999])
    m = sim.match(b)
    assert len(m.device_indices) == 0 and m.kv_match_len == 2 * page and b.mamba_branching_seqlen == 2 * page
    sim.tree.release_match(b)
    sim.check()


def test_slot_allocation_inside_a_group_draws_from_it_before_evicting():
    sim = MemCacheSim(chunk=4, mamba_slots=6)
    ids = list(range(1, 30))
    r = sim.new_req(ids)
    sim.admit(r)
    sim.extend(r, 28, track_at=28)
    r.output_ids = [1]
    sim.finish(r)  # one checkpoint: the final state is the track snapshot's position
    with sim.pool.mamba_allocator.alloc_group(10) as reserved:
        assert reserved == 5 and sim.pool.mamba_allocator.free_list_size() == 0
        assert sim.tree.alloc_mamba_slot() is not None and len(sim.tree.held_mamba_slots()) == 1
        taken = sim.pool.mamba_allocator.alloc(4)
        assert taken is not None
        slot = sim.tree.alloc_mamba_slot()  # pool dry: evicts the one checkpoint and retries
        assert slot is not None and sim.tree.held_mamba_slots() == []
    sim.pool.mamba_allocator.free(taken + [slot])


def test_cow_degrades_to_no_hit_when_no_slot_can_be_had():
    sim = MemCacheSim(chunk=4, mamba_slots=4)
    ids = list(range(1, 30))
    a = sim.new_req(ids)
    sim.admit(a)
    sim.extend(a, 28, track_at=24)
    sim.cache_unfinished(a)  # the checkpoint is locked by a, which holds 3 slots
    b = sim.new_req(ids)
    m = sim.match(b)
    assert len(m.device_indices) == 0 and b.mamba_pool_idx is None and b.mamba_cow_src_index is None
    sim.tree.release_match(b)
    sim.check()


def test_lazy_snapshot_goes_to_the_tree_and_its_checkpoint_stays_evictable():
    """extra_buffer_lazy: a decode snapshot borrowed at a boundary goes to the tree at once; the request
    then protects its KV up to there without pinning the checkpoint (a KV-only lock), so the pool can
    take that slot back while the request runs: the node becomes a tombstone leaf that the lock keeps,
    and the request's release deletes it (its KV, never matched by state, is freed)."""
    sim = MemCacheSim(chunk=4, lazy=True)
    ids = list(range(1, 30))
    r = sim.new_req(ids)
    sim.admit(r)
    sim.extend(r, 29)
    r.output_ids += [40, 41, 42]
    sim.extend(r, 3)
    assert sim.pool.mamba_slots_of(r) == [r.mamba_pool_idx], "a lazy request holds its running slot only"
    assert sim.track(r, 32, commit=True)
    node = r.last_node
    assert (
        r.cache_protected_len == 32
        and node.path_len() == 32
        and sim.pool.mamba_slots_of(r) == [r.mamba_pool_idx]
    )
    assert node.mamba_lock_ref == 0 and not sim.tree.pins_checkpoint(r) and node.full_lock_ref == 1
    assert sim.state_tag(sim.tree.match_prefix(ids + [40, 41, 42, 7]).last_device_node.mamba_value) == tag(
        (ids + [40, 41, 42])[:32]
    )
    sim.check()
    assert sim.tree.mamba_evictable_size() == 1 and sim.tree.evict_mamba(1) == 1
    assert node.mamba_value is None and node.is_leaf and r.last_node is node, "a tombstone the lock keeps"
    assert sim.tree.total_size() == 32, "its KV stays protected"
    sim.check()
    sim.finish(r, is_insert=False)
    assert sim.tree.total_size() == 0 and sim.kv.free_pages() == sim.kv.num_pages
    assert sim.pool.mamba_allocator.available_size() == sim.pool.mamba_allocator.size
    sim.check()
