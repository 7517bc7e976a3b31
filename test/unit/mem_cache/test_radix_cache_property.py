"""Property tests: random sequences of cache operations keep every invariant.

Operations: admit (match with COW), extend with snapshots, decode (extra_buffer_lazy: its snapshot handed
to the tree at once, or left borrowed), cache_unfinished (hand a snapshot to the tree), finish (insert or not), match-and-release, direct lock/unlock of a cached prefix, evict_full,
evict_mamba, grouped admission. After every step: the accounting identity for KV pages, mamba slots and
request rows, tree sanity, every live request's KV tagged with its own prefix. Every match is checked
against a reference set of checkpointed prefixes (the match must reach exactly the deepest one) and
its KV and checkpoint must carry the matched prefix's tag. At the end everything is released and the
pools are full again.
"""

from __future__ import annotations

import os
from array import array

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.mamba_tree import common_prefix_len
from sglang.test.ci_register import register_cpu_ci
from sglang.test.mem_cache_sim import MemCacheSim

register_cpu_ci(est_time=40, suite="per-commit-cpu")

# 200 examples of up to 70 steps: ~12,000 operations per run (asserted below); SGLANG_TEST_PROPERTY_SCALE
# multiplies it.
SCALE = int(os.environ.get("SGLANG_TEST_PROPERTY_SCALE", "1"))
EXAMPLES, STEPS = 200 * SCALE, 70

# Three tokens make prefixes collide often: splits, tombstones, duplicate inserts and revivals.
tokens = st.lists(st.integers(1, 3), min_size=2, max_size=24)


class CacheMachine(RuleBasedStateMachine):
    operations = 0

    @initialize(
        mode=st.sampled_from(["no_buffer", "extra_buffer", "extra_buffer_lazy"]),
        page=st.sampled_from([1, 2]),
        chunk=st.sampled_from([2, 4]),
        overlap=st.booleans(),
        mamba_slots=st.integers(4, 14),
        kv_tokens=st.integers(40, 120),
    )
    def setup(self, mode, page, chunk, overlap, mamba_slots, kv_tokens):
        extra = mode != "no_buffer"
        page = page if extra else 1
        chunk = max(chunk, page)
        self.sim = MemCacheSim(
            page_size=page,
            kv_tokens=kv_tokens,
            mamba_slots=mamba_slots,
            rows=4,
            extra_buffer=extra,
            lazy=mode == "extra_buffer_lazy",
            overlap=overlap,
            chunk=chunk,
        )
        self.running: list[Req] = []
        self.lockers: list[Req] = []
        # The reference model: prefixes that hold a checkpoint, maintained from the tree's own
        # checkpoint events (an eviction of a locked checkpoint fails inside the tree).
        self.ckpts: set[tuple[int, ...]] = set()
        tree = self.sim.tree
        set_ckpt, drop_ckpt = tree._set_checkpoint, tree._drop_checkpoint

        def on_set(node, slot):
            set_ckpt(node, slot)
            self.ckpts.add(tuple(node.path_key()))

        def on_drop(node):
            self.ckpts.discard(tuple(node.path_key()))
            drop_ckpt(node)

        tree._set_checkpoint, tree._drop_checkpoint = on_set, on_drop

    # ---- helpers -----------------------------------------------------------------------------------

    def _expected_match(self, key: list[int]) -> int:
        key = key[: len(key) - len(key) % self.sim.kv.page_size]
        return max(
            (len(p) for p in self.ckpts if len(p) <= len(key) and tuple(key[: len(p)]) == p), default=0
        )

    def _check_match(self, key: list[int], m) -> None:
        assert len(m.device_indices) == self._expected_match(key), "the match missed the deepest checkpoint"
        self.sim.assert_match_tags(key, m.device_indices, m.last_device_node)

    def _aligned_track(self, req: Req, end: int) -> int | None:
        c = self.sim.tree.cache_chunk_size
        pos = end // c * c
        return pos if pos > req.cache_protected_len else None

    # ---- rules -------------------------------------------------------------------------------------

    @rule(ids=tokens, cow=st.booleans())
    def admit(self, ids, cow):
        req = self.sim.new_req(ids)
        key = req.all_ids[: req.seqlen - 1]
        expected = self._expected_match(key) if cow else None
        if self.sim.admit(req, cow=cow):
            if cow and req.cache_protected_len:
                assert req.cache_protected_len == expected
            self.running.append(req)

    @rule(data=st.data(), n=st.integers(1, 12))
    @precondition(lambda self: self.running)
    def extend(self, data, n):
        req = data.draw(st.sampled_from(self.running))
        end = min(len(req.kv_indices) + n, req.seqlen)
        track = self._aligned_track(req, end) if data.draw(st.booleans()) else None
        if not self.sim.extend(req, n, track_at=track):
            self._finish(req, insert=False)

    @rule(data=st.data(), token=st.integers(1, 3), commit=st.booleans())
    @precondition(lambda self: self.running)
    def decode(self, data, token, commit):
        req = data.draw(st.sampled_from(self.running))
        if len(req.kv_indices) < req.seqlen:
            return
        req.output_ids.append(token)
        if not self.sim.extend(req, 1):
            self._finish(req, insert=False)
            return
        pos = len(req.kv_indices)
        if self.sim.pool.strategy.extra_buffer and pos % self.sim.tree.cache_chunk_size == 0:
            self.sim.track(req, pos, commit=commit)

    @rule(data=st.data())
    @precondition(lambda self: self.running)
    def cache_unfinished(self, data):
        self.sim.cache_unfinished(data.draw(st.sampled_from(self.running)))

    @rule(data=st.data(), insert=st.booleans())
    @precondition(lambda self: self.running)
    def finish(self, data, insert):
        self._finish(data.draw(st.sampled_from(self.running)), insert)

    def _finish(self, req: Req, insert: bool) -> None:
        self.running.remove(req)
        self.sim.finish(req, is_insert=insert)

    @rule(ids=tokens)
    def match_and_release(self, ids):
        req = self.sim.new_req(ids)
        tree = self.sim.tree
        # A COW match needs a running slot: a free one, or one freed by evicting an unlocked checkpoint
        # other than the one matched. Without it the match degrades to no hit (nothing is held).
        deepest = self._expected_match(ids)
        slot_possible = self.sim.pool.mamba_allocator.available_size() > 0 or any(
            n.mamba_value is not None and n.mamba_lock_ref == 0 and n.path_key() != ids[:deepest]
            for n in tree.nodes()
        )
        m = tree.match_prefix(ids, cow_mamba=True, req=req)
        if deepest and not slot_possible:
            assert not m.device_indices and req.mamba_pool_idx is None and req.last_node is None
            tree.release_match(req)
            return
        self._check_match(ids, m)
        if req.mamba_cow_src_index is not None:
            assert req.mamba_cow_src_index == m.last_device_node.mamba_value
        self.sim.tree.release_match(req)

    @rule(ids=tokens)
    def lock_prefix(self, ids):
        m = self.sim.tree.match_prefix(ids)
        if m.last_device_node is self.sim.tree.root:
            return
        holder = self.sim.new_req(ids)
        holder.last_node = m.last_device_node
        holder.kv_indices = list(m.device_indices)
        holder.cache_protected_len = len(m.device_indices)
        self.sim.tree.inc_lock_ref(holder.last_node)
        self.sim.reqs.append(holder)
        self.lockers.append(holder)

    @rule(data=st.data())
    @precondition(lambda self: self.lockers)
    def unlock_prefix(self, data):
        holder = data.draw(st.sampled_from(self.lockers))
        self.lockers.remove(holder)
        self.sim.reqs.remove(holder)
        self.sim.tree.dec_lock_ref(holder.last_node)

    @rule(n=st.integers(1, 30))
    def evict_full(self, n):
        self.sim.tree.evict_full(n)

    @rule(n=st.integers(1, 3))
    def evict_mamba(self, n):
        self.sim.tree.evict_mamba(n)

    @rule(batch=st.lists(tokens, min_size=1, max_size=3))
    def grouped_admission(self, batch):
        alloc = self.sim.pool.mamba_allocator
        rows_left = self.sim.pool.available_size()
        with alloc.alloc_group(min(len(batch), rows_left)):
            for ids in batch:
                req = self.sim.new_req(ids)
                if self.sim.admit(req):
                    self.running.append(req)
                self.sim.check()

    # ---- invariants --------------------------------------------------------------------------------

    @invariant()
    def accounting_holds(self):
        CacheMachine.operations += 1
        if hasattr(self, "sim"):
            self.sim.check()
            actual = {tuple(n.path_key()) for n in self.sim.tree.nodes() if n.mamba_value is not None}
            assert actual == self.ckpts

    def teardown(self):
        if not hasattr(self, "sim"):
            return
        for holder in self.lockers:
            self.sim.tree.dec_lock_ref(holder.last_node)
            self.sim.reqs.remove(holder)
        for req in list(self.running):
            self._finish(req, insert=True)
        self.sim.check()
        self.sim.tree.evict(num_tokens=10**6, mamba_num=10**6)
        self.sim.check()
        assert self.sim.tree.total_size() == 0 and not self.sim.tree.held_mamba_slots()
        assert self.sim.kv.free_pages() == self.sim.kv.num_pages
        assert self.sim.pool.mamba_allocator.available_size() == self.sim.pool.mamba_allocator.size


class TestCacheMachine(CacheMachine.TestCase):
    def runTest(self):
        CacheMachine.operations = 0
        super().runTest()
        # The invariant runs after setup and after every rule: this counts the operations.
        assert CacheMachine.operations >= 10_000 * SCALE, CacheMachine.operations


TestCacheMachine.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class _Draws:
    """Stands in for `st.data()` when a rule is replayed: hands out the recorded draws in order; a
    request is named by its rid and drawn from the machine's running list."""

    def __init__(self, machine: CacheMachine, *values):
        self.machine, self.values = machine, list(values)

    def draw(self, strategy):
        value = self.values.pop(0)
        if isinstance(value, str):
            return next(r for r in self.machine.running if r.rid == value)
        return value


def _replay(steps) -> None:
    """Run the machine's rules in the order hypothesis did, with the invariant after each and the
    teardown at the end."""
    machine = CacheMachine()
    machine.setup(**steps[0])
    machine.accounting_holds()
    for name, kwargs, draws in steps[1:]:
        if draws is not None:
            kwargs = dict(kwargs, data=_Draws(machine, *draws))
        getattr(machine, name)(**kwargs)
        machine.accounting_holds()
    machine.teardown()


_LAZY = dict(mode="extra_buffer_lazy", page=1, chunk=2, overlap=False, mamba_slots=4, kv_tokens=40)


# The three sequences CI found (shortest forms): a prefill snapshot left borrowed (at 2, or at 2 and 4)
# while a decode one deeper (4, or 6) goes to the tree; `cache_unfinished` then handed the shallower
# ones over too, which moved the request's lock back and left the tree's KV past it counted as the
# request's own: "KV page held twice", or at the finish "the caller passed tree-owned KV as its own".
def test_lazy_borrowed_snapshot_behind_a_committed_one():
    _replay(
        [
            _LAZY,
            ("admit", dict(cow=False, ids=[1, 1, 1]), None),
            ("admit", dict(cow=False, ids=[1, 1]), None),
            ("extend", dict(n=3), ["r1", True]),
            ("decode", dict(commit=True, token=1), ["r1"]),
            ("cache_unfinished", {}, ["r1"]),
        ]
    )


def test_lazy_borrowed_snapshot_behind_an_evicted_one():
    # The committed checkpoint is evicted first: the request's lock holds a tombstone leaf, which the
    # lock's move deleted, KV and all, under the request.
    _replay(
        [
            _LAZY,
            ("admit", dict(cow=False, ids=[1, 1, 1]), None),
            ("admit", dict(cow=False, ids=[1, 1]), None),
            ("extend", dict(n=2), ["r1", False]),
            ("extend", dict(n=1), ["r1", True]),
            ("grouped_admission", dict(batch=[[1, 1]]), None),
            ("finish", dict(insert=False), ["r2"]),
            ("lock_prefix", dict(ids=[1, 1]), None),
            ("decode", dict(commit=True, token=1), ["r1"]),
            ("evict_mamba", dict(n=1), None),
            ("cache_unfinished", {}, ["r1"]),
        ]
    )


def test_lazy_two_borrowed_snapshots_behind_a_committed_one():
    _replay(
        [
            _LAZY,
            ("lock_prefix", dict(ids=[1, 1]), None),
            ("evict_mamba", dict(n=1), None),
            ("grouped_admission", dict(batch=[[1, 1], [1, 1, 1, 1, 1]]), None),
            ("extend", dict(n=3), ["r2", True]),
            ("finish", dict(insert=False), ["r1"]),
            ("extend", dict(n=2), ["r2", True]),
            ("decode", dict(commit=True, token=1), ["r2"]),
            ("cache_unfinished", {}, ["r2"]),
        ]
    )


def _common_prefix_by_element(a: list[int], b: list[int], start: int, limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[start + n]:
        n += 1
    return n


# Two-token alphabets and lengths past the 64-token first block: matches end anywhere, inside blocks
# that grew to 128 or 256 and in the halving that finds the difference.
long_keys = st.lists(st.integers(0, 1), max_size=600)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(a=long_keys, shared=st.integers(0, 600), tail=long_keys, start=st.integers(0, 3))
def test_common_prefix_len_is_the_elementwise_match(a, shared, tail, start):
    b = [7] * start + a[:shared] + tail
    limit = min(len(a), len(b) - start)
    expected = _common_prefix_by_element(a, b, start, limit)
    assert common_prefix_len(a, b, start, limit) == expected
    # As the tree walks: int64 arrays on both sides (the block compares are memcmps).
    assert common_prefix_len(array("q", a), array("q", b), start, limit) == expected
    # Slices of different types never compare equal: still the right answer, element by element.
    assert common_prefix_len(array("q", a), b, start, limit) == expected
    assert common_prefix_len(tuple(a), b, start, limit) == expected
