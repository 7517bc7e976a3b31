"""The decode batches' per-request constants (`DecodeRowsCache`): reused while the same requests decode
in the same order and no request's row or running slot changed, rebuilt when one arrives, leaves, is
reordered, or has its row or running slot replaced; and through the scheduler, every decode batch's rows
equal the ones read fresh from its requests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.decode_rows import DecodeRows, DecodeRowsCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=8, suite="per-commit-cpu")


class _Pool(ReqToTokenPool):
    """Rows from a real request pool; running slots set by hand through the epoch, as the hybrid pool
    sets them."""

    def __init__(self):
        super().__init__(8, 16)

    def set_slot(self, req: Req, slot: int) -> None:
        req.mamba_pool_idx = slot
        self.slot_epoch += 1


def _req(pool: _Pool, i: int, **params) -> Req:
    req = Req(str(i), [1, 2, 3], SamplingParams(**params), return_logprob=i % 2 == 1, top_logprobs_num=i)
    pool.alloc([req])
    pool.set_slot(req, 10 + i)
    return req


def test_reused_for_the_same_requests_and_rebuilt_when_they_or_their_slots_change():
    pool = _Pool()
    cache = DecodeRowsCache(pool)
    a, b = _req(pool, 0, temperature=0.5, top_k=4), _req(pool, 1, temperature=0.0, sampling_seed=7)
    first = cache.get([a, b])
    assert cache.get([a, b]) is first
    assert first.req_pool_indices == [a.req_pool_idx, b.req_pool_idx]
    assert first.mamba_pool_indices == [10, 11]
    assert first.host_tensors["mamba_pool_indices"].tolist() == [10, 11]
    assert first.sampling_info.temperatures.tolist() == [
        0.5,
        0.0,
    ] and first.sampling_info.top_ks.tolist() == [4, -1]
    assert first.return_logprob_mask == [False, True] and first.top_logprobs_nums == [0, 1]

    c = _req(pool, 2, temperature=0.75, top_p=0.5)
    assert cache.get([a, b, c]).sampling_info.temperatures.tolist() == [0.5, 0.0, 0.75]
    swapped = cache.get([b, a])
    assert swapped.mamba_pool_indices == [11, 10] and swapped.sampling_info.has_seed.tolist() == [True, False]

    # Same requests, same order, but one running slot replaced (a COW or a fresh slot): rebuilt.
    before = cache.get([b, a])
    pool.set_slot(a, 42)
    after = cache.get([b, a])
    assert after is not before and after.mamba_pool_indices == [11, 42]
    assert after.host_tensors["mamba_pool_indices"].tolist() == [11, 42]
    # A row given back and taken again (a retraction and readmission): rebuilt.
    pool.free(b)
    pool.alloc([b])
    assert cache.get([b, a]) is not after


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_every_decode_batch_carries_its_requests_current_rows(strategy):
    """Through admissions, finishes, retractions (a pool too small for everyone) and snapshots, each
    decode batch's rows equal those read fresh from its requests."""
    h = SchedulerHarness(
        "tiny-nemotron-h",
        mamba_scheduler_strategy=strategy,
        max_running_requests=6,
        max_total_tokens=400,
        mamba_track_interval=32,
    )
    checked = 0
    cached_get = h.sched.rows_cache.get

    def checked_get(reqs):
        nonlocal checked
        rows = cached_get(reqs)
        fresh = DecodeRows.of(reqs)
        assert rows.req_pool_indices == fresh.req_pool_indices
        assert rows.mamba_pool_indices == fresh.mamba_pool_indices
        for name, tensor in rows.host_tensors.items():
            assert torch.equal(tensor, fresh.host_tensors[name]), name
        for f in dataclasses.fields(fresh.sampling_info):
            mine, theirs = getattr(rows.sampling_info, f.name), getattr(fresh.sampling_info, f.name)
            assert torch.equal(mine, theirs) if isinstance(mine, torch.Tensor) else mine == theirs, f.name
        checked += 1
        return rows

    h.sched.rows_cache.get = checked_get
    try:
        shared = token_ids(30, seed=1)
        for k in range(10):
            h.submit(shared + token_ids(5 + 3 * k, seed=2 + k), max_new_tokens=40 + 8 * k, temperature=0.0)
        h.sched.run_until_idle()
        assert h.sched.counters["num_retractions_total"] > 0  # the pool was too small for everyone
        assert checked > 20
        assert h.sched.rows_cache._reqs == []  # nothing decodes any more: the requests are let go
    finally:
        h.shutdown()


def test_every_write_to_a_row_or_running_slot_moves_the_epoch():
    """The cache's validity rests on this: the pool is the one writer of `req_pool_idx` and
    `mamba_pool_idx`, and each of its writes changes `slot_epoch`."""
    h = SchedulerHarness("tiny-qwen3-next", mamba_scheduler_strategy="extra_buffer_lazy")
    pool = h.sched.req_to_token_pool
    req = Req("r", [1, 2, 3], SamplingParams())

    def moves(write) -> bool:
        before = pool.slot_epoch
        write()
        return pool.slot_epoch != before

    try:
        assert moves(lambda: pool.alloc([req])) and req.mamba_pool_idx is not None
        assert moves(lambda: pool.free_running_slot(req)) and req.mamba_pool_idx is None
        slot = pool.mamba_allocator.alloc(1)[0]
        assert moves(lambda: pool.set_running_slot(req, slot, needs_clear=True))
        assert moves(lambda: pool.mamba_allocator.free([pool.donate_running_slot(req)]))
        assert moves(lambda: pool.set_running_slot(req, pool.mamba_allocator.alloc(1)[0], needs_clear=True))
        assert moves(lambda: pool.free_mamba_cache(req)) and req.mamba_pool_idx is None
        assert moves(lambda: pool.free(req)) and req.req_pool_idx is None
    finally:
        h.shutdown()


def test_a_device_move_leaves_the_shared_sampling_info_alone():
    """Decode batches of the same requests share one `SamplingBatchInfo`; moving a batch to a device
    gives it a moved copy, so a batch still in flight (or the next one) keeps reading host tensors."""
    pool = _Pool()
    cache = DecodeRowsCache(pool)
    reqs = [_req(pool, 0, temperature=0.5), _req(pool, 1, temperature=0.0)]
    rows = cache.get(reqs)
    batches = [
        ForwardBatch.create(
            ForwardMode.DECODE,
            input_ids=[5, 6],
            req_pool_indices=rows.req_pool_indices,
            seq_lens=[4, 4],
            out_cache_loc=[7, 8],
            mamba_pool_indices=rows.mamba_pool_indices,
            sampling_info=rows.sampling_info,
            host_tensors=rows.host_tensors,
        )
        for _ in range(2)
    ]
    batches[0].to_device("meta")  # stands in for CUDA on this machine
    moved, kept = batches[0].sampling_info, batches[1].sampling_info
    assert kept is rows.sampling_info and moved is not kept
    assert moved.temperatures.is_meta and moved.top_ks.is_meta
    assert kept.temperatures.device.type == "cpu" and kept.temperatures.tolist() == [0.5, 0.0]
    assert batches[1].req_pool_indices.device.type == "cpu"  # the shared row tensors too


_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=[pytest.mark.gpu, _GPU])])
def test_a_sampling_info_already_on_the_device_is_not_moved_again(device):
    """The MTP draft steps of a verify share one sampling info, moved to the device once
    (`MtpDraftRunner.draft_steps`); each step's batch moves its other tensors and leaves it as it is
    (before, every step packed and uploaded it again). On CUDA the runner names the device "cuda", its
    tensors' read cuda:0: still the same device."""
    from sglang.srt.model_executor.forward_batch_info import SamplingBatchInfo

    info = SamplingBatchInfo.create([0.5, 0.0], top_ks=[3, -1]).map_tensors(lambda t: t.to(device))
    fb = ForwardBatch.create(ForwardMode.DECODE, input_ids=[5, 6], req_pool_indices=[0, 1], seq_lens=[4, 4],
                             out_cache_loc=[7, 8], mamba_pool_indices=[0, 1], sampling_info=info)  # fmt: skip
    fb.to_device(device)
    assert fb.input_ids.device.type == device  # (the batch's own tensors moved)
    for name in SamplingBatchInfo.TENSOR_FIELDS:
        assert getattr(fb.sampling_info, name) is getattr(info, name), name


def test_requests_that_sample_alike_share_one_sampling_info():
    """A batch whose requests all sample alike reuses the sampling info of an earlier batch of the same
    size and settings; one request with other settings makes the batch build its own, row by row."""
    pool, infos = _Pool(), {}
    a, b, c = (_req(pool, i, temperature=0.7, top_k=5) for i in range(3))
    # _req asks logprobs of odd requests: make the three alike in that too.
    for r in (a, b, c):
        r.return_logprob, r.top_logprobs_num, r.sampling_row = False, 0, None
    first = DecodeRows.of([a, b], infos)
    assert DecodeRows.of([b, c], infos).sampling_info is first.sampling_info
    assert torch.allclose(first.sampling_info.temperatures, torch.tensor([0.7, 0.7]))
    assert first.sampling_info.top_ks.tolist() == [5, 5] and first.return_logprob_mask == [False, False]
    assert DecodeRows.of([a, b, c], infos).sampling_info is not first.sampling_info  # another size

    d = _req(pool, 3, temperature=0.0, sampling_seed=9)
    mixed = DecodeRows.of([a, d, b], infos).sampling_info
    assert torch.allclose(mixed.temperatures, torch.tensor([0.7, 0.0, 0.7]))
    assert mixed.top_ks.tolist() == [5, -1, 5] and mixed.has_seed.tolist() == [False, True, False]
    for k in range(40):  # settings never seen again do not pile up
        other = Req(f"o{k}", [1], SamplingParams(temperature=0.1 + k / 100))
        other.req_pool_idx, other.mamba_pool_idx = a.req_pool_idx, 12
        DecodeRows.of([other], infos)
    assert len(infos) <= 16
