"""Pools: state moves over all layers, request slots (lazy borrowed snapshots, free), decode-side sizing,
KV layer mapping and pool sizing."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang.srt.disaggregation.decode import HybridMambaDecodeReqToTokenPool
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.mamba_strategy import MambaStrategy
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MambaPool, MHATokenToKVPool
from sglang.srt.mem_cache.pool_sizing import compute_pool_sizes
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.mem_cache_sim import SYNTHETIC_PARAMS

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def _strategy(name: str, overlap: bool = True) -> MambaStrategy:
    return MambaStrategy.resolve(name, radix_cache=True, overlap=overlap, cache_chunk_size=4)


def _pool(strategy: str = "no_buffer", overlap: bool = True, **kw) -> HybridReqToTokenPool:
    args = dict(size=4, mamba_size=12, max_context_len=64, cache_params=SYNTHETIC_PARAMS)
    args.update(kw)
    return HybridReqToTokenPool(strategy=_strategy(strategy, overlap), **args)


def test_mamba_pool_layout_clear_and_copy_over_all_layers():
    pool = MambaPool(8, SYNTHETIC_PARAMS)
    assert pool.conv_state.shape == (2, 9, 3, 3) and pool.ssm_state.shape == (2, 9, 2, 2, 2)
    for s in range(1, 9):
        pool.conv_state[:, s] = s
        pool.ssm_state[:, s] = 10 * s
    pool.copy_from([1, 2, 3], [6, 7, 8])
    for dst, src in [(6, 1), (7, 2), (8, 3)]:
        assert torch.all(pool.conv_state[:, dst] == src) and torch.all(pool.ssm_state[:, dst] == 10 * src)
    pool.clear_slots(torch.tensor([2, 7]))
    assert torch.all(pool.conv_state[:, [2, 7]] == 0) and torch.all(pool.ssm_state[:, [2, 7]] == 0)
    assert torch.all(pool.ssm_state[:, 1] == 10) and torch.all(pool.ssm_state[:, 0] == 0)
    conv, ssm = pool.layer_cache(1)
    assert conv.data_ptr() == pool.conv_state[1].data_ptr() and ssm.shape == (9, 2, 2, 2)
    # One slot of one layer is one contiguous block (what transfer engines move).
    ptr, total, item = pool.get_contiguous_buf_infos()[0]
    assert item * 9 == total and item == 3 * 3 * 4


def test_alloc_and_free_accounting():
    pool = _pool("no_buffer")
    reqs = [Req(f"r{i}", [1, 2, 3]) for i in range(3)]
    assert pool.alloc(reqs) is not None
    assert pool.available_size() == 1 and pool.mamba_allocator.available_size() == 9
    assert all(r.mamba_needs_clear and r.mamba_ping_pong_track_buffer is None for r in reqs)
    for r in reqs[:2]:
        pool.free_mamba_cache(r)
        pool.free(r)
    # Freeing the row without the mamba cache leaks exactly one slot.
    pool.free(reqs[2])
    assert pool.available_size() == 4 and pool.mamba_allocator.available_size() == 11


def test_alloc_is_all_or_nothing():
    pool = _pool("extra_buffer", size=2, mamba_size=5)
    reqs = [Req("a", [1]), Req("b", [1])]
    assert pool.alloc(reqs) is None, "2 requests x 3 slots > 5"
    assert all(r.req_pool_idx is None and r.mamba_pool_idx is None for r in reqs)
    assert pool.available_size() == 2 and pool.mamba_allocator.available_size() == 5
    assert pool.alloc(reqs[:1]) is not None and pool.mamba_allocator.available_size() == 2
    assert pool.strategy.resident_slots_per_req == 3


def test_lazy_holds_the_running_slot_and_borrowed_snapshots_only():
    pool = _pool("extra_buffer_lazy")
    r = Req("a", [1, 2])
    pool.alloc([r])
    assert r.mamba_ping_pong_track_buffer is None and pool.mamba_slots_of(r) == [r.mamba_pool_idx]
    assert pool.mamba_allocator.available_size() == 11 and pool.strategy.resident_slots_per_req == 1
    # A snapshot borrows a slot until the tree takes it (by position).
    a, b = pool.mamba_allocator.alloc(2)
    pool.add_extra_snapshot(r, a, 64)
    pool.add_extra_snapshot(r, b, 128)
    assert pool.extra_snapshot_at(r, 128) == b and pool.extra_snapshot_at(r, 96) is None
    assert sorted(pool.mamba_slots_of(r)) == sorted([r.mamba_pool_idx, a, b])
    assert pool.pop_extra_snapshot(r, 64) == a and pool.pop_extra_snapshot(r, 64) is None
    assert pool.mamba_slots_of(r) == [r.mamba_pool_idx, b]
    pool.free_mamba_cache(r)  # the running slot and the snapshot still borrowed
    assert pool.mamba_allocator.available_size() == 12 - 1, "the handed-over slot is the caller's now"
    assert r.mamba_pool_idx is None and not r.mamba_extra_snapshots


def test_normal_extra_buffer_keep_index_and_free_with_keep():
    pool = _pool("extra_buffer")
    r = Req("a", [1, 2])
    pool.alloc([r])
    buf = list(r.mamba_ping_pong_track_buffer)
    assert -1 not in buf and pool.mamba_allocator.available_size() == 9
    r.mamba_next_track_idx = 1  # a snapshot went to entry 0, the next goes to entry 1
    assert pool.get_mamba_ping_pong_keep_idx(r) == 0
    pool.free_mamba_cache(r, mamba_ping_pong_track_buffer_to_keep=0)
    assert pool.mamba_allocator.available_size() == 11 and buf[0] not in pool.mamba_allocator._free
    no_overlap = _pool("extra_buffer", overlap=False)
    assert no_overlap.strategy.track_entries == 1 and no_overlap.get_mamba_ping_pong_other_idx(0) == 0


@pytest.mark.parametrize("extra_buffer", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("given", [None, 5, 1000])
def test_decode_side_sizing(extra_buffer, overlap, given, caplog):
    size, pre = 8, 4
    with caplog.at_level(logging.WARNING):
        strategy = _strategy("extra_buffer_lazy" if extra_buffer else "no_buffer", overlap)
        pool = HybridMambaDecodeReqToTokenPool(size, pre, given, 64, SYNTHETIC_PARAMS, strategy)
    per_req = 2 if extra_buffer else 1  # lazy: the running slot and a borrowed snapshot slot
    need = (size + pre) * per_req
    assert pool.slots_per_req == per_req and pool.max_slots_needed == need
    assert pool.mamba_allocator.size == (need if given is None else max(given, need))
    assert pool.size == size + pre and pool.req_to_token.shape[0] == size + pre + 1
    assert pool.mamba_spec_state_size == size + pre
    raised = given is not None and given < need
    assert (f"raises --max-mamba-cache-size from 5 to {need}" in caplog.text) == raised
    # Every pre-allocated row can hold its full set of slots at once.
    reqs = [Req(str(i), [1]) for i in range(size + pre)]
    assert pool.alloc(reqs) is not None


def test_kv_pool_maps_full_attention_layers_only():
    kv = MHATokenToKVPool(16, 4, torch.float32, 2, 8, layer_ids=[3, 7])
    assert kv.k_buffer[0].shape == (20, 2, 8) and kv.bytes_per_token() == 2 * 2 * 2 * 8 * 4
    kv.set_kv_buffer(7, torch.tensor([4, 5]), torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0))
    k, v = kv.get_kv_buffer(7)
    assert torch.all(k[4:6] == 1) and torch.all(v[4:6] == 2) and torch.all(kv.k_buffer[0] == 0)
    with pytest.raises(ValueError, match="Layer 2 is not a full-attention layer"):
        kv.get_kv_buffer(2)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_pool_saturates_keys_and_values_past_its_range(dtype):
    """K / V past the pool's range (e4m3's +-448: a checkpoint without its kv scales) are stored as its
    largest value. The pool clamps before converting: torch's CUDA conversion to e4m3 (c10's scalar one)
    makes NaN of them, where the CPU's saturates, and its e5m2 conversion makes inf anywhere; a NaN or inf
    key poisons every later token's attention (seen on an H200: the unscaled run of
    test_kv_cache_scales.py ended in a device-side assert). So the conversion must only ever see values
    in range; a TorchFunctionMode records what each float8 conversion is handed."""
    from torch.overrides import TorchFunctionMode

    seen: list[float] = []

    class RecordFloat8Casts(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to and dtype in (*args[1:], kwargs.get("dtype")):
                seen.append(args[0].abs().max().item())
            return func(*args, **kwargs)

    top = torch.finfo(dtype).max
    kv = MHATokenToKVPool(16, 4, dtype, 2, 8, layer_ids=[0])
    big = torch.tensor([1e6, -600.0, 3.0, float("inf")]).repeat(2, 2, 2)[:, :, :8].reshape(2, 2, 8)
    with RecordFloat8Casts():
        kv.set_kv_buffer(0, torch.tensor([1, 2]), big, -big, k_scale=0.5, v_scale=1.0)
    assert len(seen) == 2 and max(seen) <= top, seen
    k, v = (b[1:3].float() for b in kv.get_kv_buffer(0))
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    assert torch.equal(k, (big / 0.5).clamp(-top, top).to(dtype).float())
    assert torch.equal(v, (-big).clamp(-top, top).to(dtype).float())


def test_pool_sizing_from_flags_and_from_a_budget():
    args = ServerArgs(max_mamba_cache_size=40, max_total_tokens=1000)
    arch = args.model_config.arch
    sizes = compute_pool_sizes(args, arch, weight_bytes=0)
    assert (sizes.max_mamba_cache_size, sizes.max_total_tokens) == (40, 1000)
    # extra_buffer_lazy: 1 resident slot and 2 of tree headroom per running request (upstream's ratio 3).
    assert sizes.resident_slots_per_req == 1 and sizes.max_running_requests == 13
    assert sizes.mamba_bytes_per_slot == arch.mamba_cache_per_req()

    budget = ServerArgs(mamba_full_memory_ratio=1.0, mem_fraction_static=0.5)
    sized = compute_pool_sizes(budget, arch, weight_bytes=1000, device_memory=2 * 10**7 + 2000)
    rest = 10**7
    assert sized.max_mamba_cache_size == (rest // 2) // sized.mamba_bytes_per_slot
    used = (
        sized.max_mamba_cache_size * sized.mamba_bytes_per_slot
        + sized.max_total_tokens * sized.kv_bytes_per_token
    )
    assert rest - sized.kv_bytes_per_token < used <= rest, "the budget is spent, not exceeded"
    assert ServerArgs(mamba_scheduler_strategy="extra_buffer").mamba_strategy.resident_slots_per_req == 3
    assert ServerArgs(mamba_scheduler_strategy="no_buffer").mamba_strategy.resident_slots_per_req == 1


@pytest.mark.parametrize(
    "flags, running",
    [
        ({"mamba_scheduler_strategy": "no_buffer"}, 40 // 3),
        ({"mamba_scheduler_strategy": "extra_buffer"}, 40 // 5),
        ({"mamba_scheduler_strategy": "extra_buffer", "disable_overlap_schedule": True}, 40 // 4),
        ({"mamba_scheduler_strategy": "no_buffer", "disable_radix_cache": True}, 40),
        ({"max_running_requests": 30}, 30),
    ],
)
def test_the_derived_running_cap_leaves_the_tree_headroom(flags, running):
    """Upstream's mamba ratio: the running slots plus 2 per request for the tree's checkpoints, none
    without a radix cache; a cap given by flag stands."""
    args = ServerArgs(max_mamba_cache_size=40, max_total_tokens=1000, **flags)
    assert compute_pool_sizes(args, args.model_config.arch, weight_bytes=0).max_running_requests == running


def test_pool_sizing_refuses_too_small_pools():
    args = ServerArgs(max_mamba_cache_size=2, max_total_tokens=100, mamba_scheduler_strategy="extra_buffer")
    with pytest.raises(ServerArgsError, match="--max-mamba-cache-size 2 is smaller than the 3 slot"):
        compute_pool_sizes(args, args.model_config.arch, 0)
    lazy = ServerArgs(max_mamba_cache_size=1, max_total_tokens=100)  # one slot runs a request
    assert compute_pool_sizes(lazy, lazy.model_config.arch, 0).max_running_requests == 1
    with pytest.raises(ServerArgsError, match="--max-total-tokens 1 is smaller"):
        compute_pool_sizes(
            ServerArgs(max_mamba_cache_size=10, max_total_tokens=1), ServerArgs().model_config.arch, 0
        )
    with pytest.raises(ServerArgsError, match="--mem-fraction-static"):
        compute_pool_sizes(ServerArgs(mem_fraction_static=0.1), ServerArgs().model_config.arch, 10**9, 10**9)


def test_cuda_budget_is_measured_after_the_weights(monkeypatch):
    """On CUDA, --mem-fraction-static is SGLang's: weights + caches <= fraction x total memory. The
    weights are already resident when the pools are sized, so they are not subtracted a second time."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (60 * gib, 80 * gib))  # 20 GiB in use
    args = ServerArgs(mem_fraction_static=0.9, mamba_full_memory_ratio=1.0)
    args.device = "cuda"  # after validation, which needs a real GPU for it
    sized = compute_pool_sizes(args, args.model_config.arch, weight_bytes=16 * gib)
    rest = 60 * gib - 8 * gib  # free minus the 10% of 80 GiB kept for activations
    used = (
        sized.max_mamba_cache_size * sized.mamba_bytes_per_slot
        + sized.max_total_tokens * sized.kv_bytes_per_token
    )
    assert rest - sized.kv_bytes_per_token - sized.mamba_bytes_per_slot < used <= rest
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (7 * gib, 80 * gib))
    with pytest.raises(ServerArgsError, match="--mem-fraction-static 0.9 leaves no memory"):
        compute_pool_sizes(args, args.model_config.arch, weight_bytes=16 * gib)
