"""The accelerator path is device-clean, checked without an accelerator: the model, its pools and every
batch sit on torch's `meta` device standing in for CUDA, under `DeviceAudit` (sglang/test/device_audit.py).
Per forward: no op mixes host and device tensors, the host never reads a device value, the batch
reaches the device in ONE host-to-device copy (two when input logprobs are asked for), and the only
device-to-host copies are the results (sampled ids and their logprobs; input logprobs when asked for).
Both the torch kernels and the ones CUDA runs by default (Triton attention and linear-attention steps,
the packed extend, the CUDA-graph decode body, their launches recorded instead of run). On a GPU, one
test (marked `gpu`) counts the host syncs of real forwards with torch's own check."""

from __future__ import annotations

import importlib.util
import threading
import warnings
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.configs.presets import PRESETS as PRESET_ARCHS
from sglang.srt.environ import envs
from sglang.srt.model_executor.forward_worker import ForwardWorker, LaunchedBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.device_audit import CUDA_DEFAULT_ENV, DeviceAudit, RecordedLaunches
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=6, suite="per-commit-cpu")

PRESETS = ["tiny-qwen3-next", "tiny-nemotron-h"]
# Every preset's forward (every architecture), on the meta device.
ALL_ARCHS = list(PRESET_ARCHS)


class _RecordingStateCopy:
    """Stands in for the GPU state-copy kernel (tested on its own in test/unit/kernels): records where
    the ids it gets live. The torch reference filters rows with a boolean mask, a sync by design."""

    name = "recording"

    def __init__(self) -> None:
        self.devices: list[str] = []

    def copy(self, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor | None) -> None:
        self.devices += [t.device.type for t in (src, dst, mask) if t is not None]

    def clear(self, slots: torch.Tensor) -> None:
        self.devices.append(slots.device.type)


def _meta_runner(preset: str, audit: DeviceAudit, **flags) -> tuple[ModelRunner, _RecordingStateCopy]:
    args = ServerArgs(
        model_path=preset,
        page_size=16,
        max_total_tokens=4096,
        max_mamba_cache_size=24,
        max_running_requests=8,
        mamba_scheduler_strategy="extra_buffer",
        **flags,
    )
    args.device = "meta"  # after validation, which accepts only the devices users may name
    with envs.SGLANG_MAMBA_STATE_COPY_BACKEND.override("torch"):
        runner = ModelRunner(args)
    copier = _RecordingStateCopy()
    runner.mamba_pool.state_copier._impl = copier
    assert next(runner.model.parameters()).is_meta and runner.mamba_pool.conv_state.is_meta
    assert not audit.mixed and not audit.host_reads and not audit.d2h
    audit.reset()
    return runner, copier


def _runtime(events: list[str]) -> list[str]:
    """Events raised by the runtime itself (the test driver reads sampled ids back on purpose)."""
    return [e for e in events if e.startswith("srt/")]


def _check_forward(audit: DeviceAudit, d2h: int, h2d: int = 1) -> None:
    assert audit.mixed == [], audit.mixed
    assert _runtime(audit.host_reads) == [], audit.host_reads
    assert len(audit.h2d) == h2d, f"the batch should reach the device in {h2d} copies: {audit.h2d}"
    assert len(_runtime(audit.d2h)) == d2h, audit.d2h
    audit.reset()


@pytest.mark.parametrize("preset", ALL_ARCHS)
def test_forwards_are_device_clean(preset):
    with DeviceAudit() as audit:
        runner, copier = _meta_runner(preset, audit)
        driver = RunnerDriver(runner)
        a, b = driver.new_request(), driver.new_request(temperature=0.7, top_k=5, seed=3)
        # Extend: two requests, a clear of fresh slots, snapshots at the kernel chunk and at the end.
        chunk = runner.arch.kernel_state_chunk
        driver.extend([Extend(a, list(range(3, 3 + 2 * chunk + 5)), track_seqlen=chunk), Extend(b, [5] * 40)])
        # Input logprobs (the driver asks for them): their rows go in one more copy, their values
        # come back in one.
        _check_forward(audit, d2h=1, h2d=2)
        # A prefix hit: shared KV pages and a COW of a snapshot into the running slot.
        c = driver.new_request()
        driver.extend(
            [Extend(c, [7] * 9, prefix_from=(a, 2 * chunk), cow_src=a.track_slot)], return_logprob=False
        )
        _check_forward(audit, d2h=0)
        # Decode with a track copy, greedy and seeded sampling side by side, with and without logprobs.
        track = {a: driver.alloc_mamba_slots(1)[0]}
        driver.decode([a, b, c], track=track, return_logprob=False)
        _check_forward(audit, d2h=0)
        driver.decode([a, b, c], top_logprobs_num=2)
        # top logprobs are host lists by contract: one copy of the values and ids per request asking.
        assert audit.mixed == [] and _runtime(audit.host_reads) == [] and len(audit.h2d) == 1
    assert copier.devices and set(copier.devices) == {"meta"}, "state-copy ids must live on the device"


def _three_decoding_requests(audit: DeviceAudit) -> tuple[ModelRunner, RunnerDriver, list]:
    """A meta runner with three requests prefilled (greedy, seeded, greedy), the audit reset."""
    runner, _ = _meta_runner(PRESETS[0], audit)
    driver = RunnerDriver(runner)
    reqs = [driver.new_request(), driver.new_request(temperature=0.8, seed=1), driver.new_request()]
    driver.extend([Extend(r, [4] * 20) for r in reqs], return_logprob=False)
    audit.reset()
    return runner, driver, reqs


def test_logit_penalties_run_on_the_device():
    """A batch with every kind of penalty (counts with a fresh row, a ban, a bias): its penalty tensors
    travel in the batch's one copy, the counts live on the device, and nothing is read back."""
    from sglang.srt.sampling.penaltylib import PenaltyBatchInfo
    from sglang.srt.utils.host_tensors import host_float32, host_int64

    def info() -> PenaltyBatchInfo:
        ints, floats = host_int64, host_float32
        return PenaltyBatchInfo(
            rows=ints([0, 2]), slots=ints([0, 3]), frequency=floats([0.5, 0]), presence=floats([0, 1]),
            repetition=floats([1.2, 1]), count_rows=ints([0, 2]), count_slots=ints([0, 3]),
            clear_slots=ints([3]), init_slots=ints([3]), init_ids=ints([9]), ban_rows=ints([1, 1]),
            ban_ids=ints([2, 5]), bias_rows=ints([2]), bias_ids=ints([7]), bias_values=floats([3.0]),
            num_slots=4,
        )  # fmt: skip

    with DeviceAudit() as audit:
        runner, driver, reqs = _three_decoding_requests(audit)
        for _ in range(2):
            fb = driver.decode_batch(reqs, return_logprob=True)
            fb.penalties = info()
            runner.forward_batch_generation(fb)
            assert fb.penalties.ban_ids.is_meta and runner.penalizer.counts.is_meta
            _check_forward(audit, d2h=0)
        assert runner.penalizer.counts.shape[0] >= 4


def test_grammar_masks_run_on_the_device():
    """A batch with grammar masks (constrained decoding): the bits travel in the batch's one copy, are
    unpacked and applied on the device, and nothing is read back."""
    from sglang.srt.constrained.vocab_mask import VocabMaskInfo
    from sglang.srt.utils.host_tensors import host_int64

    with DeviceAudit() as audit:
        runner, driver, reqs = _three_decoding_requests(audit)
        words = -(-runner.arch.vocab_size // 32)
        fb = driver.decode_batch(reqs, return_logprob=True)
        fb.vocab_mask = VocabMaskInfo(host_int64([2, 0]), torch.full((2, words), 5, dtype=torch.int32))
        runner.forward_batch_generation(fb)
        assert fb.vocab_mask.bitmask.is_meta and fb.vocab_mask.rows.is_meta
        _check_forward(audit, d2h=0)


@pytest.mark.parametrize("preset", PRESETS)
def test_overlap_placeholders_resolve_on_the_device(preset):
    """The forward worker's future-token map lives on the device: the batch that samples into future
    slots writes it there and the next batch's placeholders read it there, with the one batch copy
    each; the results are the only copy back (the bug this guards: a host map indexed by device ids
    crashed every overlapped decode on CUDA)."""
    with DeviceAudit() as audit:
        runner, _ = _meta_runner(preset, audit)
        driver = RunnerDriver(runner)
        worker = ForwardWorker(runner, future_size=16)
        try:
            assert worker.token_lookup.is_meta
            reqs = [driver.new_request(), driver.new_request()]
            driver.extend([Extend(r, [4] * 20) for r in reqs], return_logprob=False)
            audit.reset()
            for step in range(2):
                fb = driver.decode_batch(reqs, input_ids=[-1, -2] if step else [9, 9])
                pending = worker._run_batch(
                    LaunchedBatch(fb, future_slots=[0, 1], has_placeholders=bool(step), batch_id=step)
                )
                assert fb.future_slots is not None and fb.future_slots.is_meta
                _check_forward(audit, d2h=1)  # the sampled ids, nothing else
                assert len(pending.wait().next_token_ids) == 2
        finally:
            worker.shutdown()


def test_placeholders_resolve_in_one_gather():
    """`token_lookup` maps a token id to itself and a placeholder -(k + 1) to future slot k's token, in
    one gather (a `where` over the two took six kernels), up to the largest id sampling can pick."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    vocab, rows = 50, 64  # an lm_head with more rows than the vocabulary: it bounds the ids
    seen: list[torch.Tensor] = []

    class Runner:
        device = "cpu"
        server_args = SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab))
        model = SimpleNamespace(lm_head=torch.nn.Linear(4, rows, bias=False))

        def move_batch(self, fb):
            pass

        def forward_batch_generation(self, fb):
            seen.append(fb.input_ids)
            ids = torch.tensor(sampled[: fb.batch_size])
            return SimpleNamespace(next_token_ids=ids, next_token_logprobs=None, next_token_top_logprobs=None,
                                   input_token_logprobs=None, input_top_logprobs=None,
                                   next_token_ids_logprobs=None, input_token_ids_logprobs=None,
                                   hidden_states=None)  # fmt: skip

    class Ops(TorchDispatchMode):
        names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def batch(ids):
        rows = range(len(ids))
        return ForwardBatch.create(
            ForwardMode.DECODE, input_ids=ids, req_pool_indices=rows, seq_lens=[5] * len(ids),
            out_cache_loc=rows, mamba_pool_indices=rows,
        )  # fmt: skip

    worker = ForwardWorker(Runner(), future_size=8, inline=True)
    assert worker.token_lookup.shape == (rows + 8,)
    sampled = [63, 0, 41]
    worker._run_batch(LaunchedBatch(batch([1, 2, 3]), future_slots=[3, 5, 7]))
    sampled = [9]
    with Ops() as ops:
        worker._run_batch(LaunchedBatch(batch([-4, 63, -6, -8, 0]), future_slots=[0], has_placeholders=True))
    assert seen[-1].tolist() == [63, 63, 0, 41, 0]
    assert ops.names.count("index") == 1 and "where" not in ops.names
    worker._run_batch(LaunchedBatch(batch([-1, 49]), has_placeholders=True))
    assert seen[-1].tolist() == [9, 49]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: the fused GEMMs' MoE path
@pytest.mark.parametrize("preset", PRESETS)
def test_the_cuda_default_kernels_are_device_clean(preset, dtype, monkeypatch):
    """What CUDA runs by default where the test above runs torch: Triton attention, the Triton decode
    steps and conv extend in place on the pool, the packed (varlen) extend, and the CUDA-graph runner's
    decode body (captured graphs replay exactly that body)."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    launches = RecordedLaunches()
    for module, name, value in launches.patches():
        monkeypatch.setattr(module, name, value)
    for var, value in CUDA_DEFAULT_ENV.items():
        monkeypatch.setenv(var, value)
    with DeviceAudit() as audit:
        runner, copier = _meta_runner(preset, audit, attention_backend="triton", dtype=dtype)
        linear = runner.attn_backend.linear_attn_backend
        assert linear.decode_in_place and linear.varlen_impl is not None
        driver = RunnerDriver(runner)
        a, b = driver.new_request(), driver.new_request()
        chunk = runner.arch.kernel_state_chunk
        driver.extend(
            [Extend(a, list(range(3, 3 + 2 * chunk + 5)), track_seqlen=chunk), Extend(b, [5] * 40)],
            return_logprob=False,
        )
        # The conv kernel's and the packed extend's index tensors are built on the host before the
        # batch moves and go in its one copy (`prepare_host_metadata`).
        _check_forward(audit, d2h=0)
        # The same through the forward worker, which moves the batch itself (the serving path).
        worker = ForwardWorker(runner, future_size=16)
        try:

            def through_worker(fb):
                host = worker._run_batch(LaunchedBatch(fb, batch_id=1)).wait()
                return SimpleNamespace(next_token_ids=torch.tensor(host.next_token_ids))

            c = driver.new_request()
            driver.extend(
                [Extend(c, list(range(5, 5 + chunk + 9)), track_seqlen=chunk)],
                return_logprob=False,
                forward=through_worker,
            )
            _check_forward(audit, d2h=1)  # the sampled ids come back
        finally:
            worker.shutdown()
        runner.graph_runner = CudaGraphRunner(runner, [1, 2, 4], use_graphs=False)
        _check_forward(audit, d2h=0, h2d=0)  # capturing the body copies nothing
        track = {a: driver.alloc_mamba_slots(1)[0]}
        driver.decode([a, b], track=track, return_logprob=False)
        _check_forward(audit, d2h=0)
    decode_step = "_gdn_decode_kernel" if "qwen" in preset else "_mamba2_decode_kernel"
    kernels = {name for name, _ in launches.calls}
    expected = {"_extend_kernel", "_decode_stage1_kernel", "_conv_extend_kernel", "_rmsnorm_kernel", decode_step}
    if dtype == "bfloat16":  # the MoE as a GPU runs it at these sizes eagerly: sorted with its tile maps in
        # one launch (decode batches), the fused GEMMs, combined
        expected |= {"_align_tiles_kernel", "_moe_gemm_kernel", "_combine_kernel"}
    expected.add("_store_kv_kernel")  # K and V into the 16-bit pool, one launch
    if "qwen" in preset:  # Nemotron-H's attention has no rotary embedding nor output gate
        expected |= {"_rope_kernel", "_softmax_topk_kernel", "_sigmoid_gate_mul_kernel"}
    else:  # its routing grouped
        expected.add("_grouped_sigmoid_topk_kernel")
    if dtype == "bfloat16" and "qwen" in preset:
        # Gated experts: silu(gate) * up in the GEMM's epilogue; the gated shared expert is one more
        # expert of the same launches (the grouped path's separate kernels for both stay unused).
        assert not kernels & {"_silu_mul_kernel", "_add_sigmoid_mul_kernel"}, kernels
    assert expected <= kernels, kernels
    assert all(devices == {"meta"} for _, devices in launches.calls), launches.calls
    assert copier.devices and set(copier.devices) == {"meta"}


@pytest.mark.parametrize("cuda_kernels", [False, True])
@pytest.mark.parametrize("preset", PRESETS)
def test_a_speculative_verify_is_device_clean(preset, cuda_kernels, monkeypatch):
    """A verify batch (drafts of different counts, seeded sampling beside greedy, logprobs): its step
    index tensors travel in the batch's one copy, every position's state goes to the verify rows on the
    device, and nothing is read back; with the kernels CUDA runs by default, the decode steps are the
    Triton ones in place on the verify rows."""
    launches = RecordedLaunches()
    flags = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    if cuda_kernels:
        for module, name, value in launches.patches():
            monkeypatch.setattr(module, name, value)
        for var, value in CUDA_DEFAULT_ENV.items():
            monkeypatch.setenv(var, value)
        flags["attention_backend"] = "triton"
    with DeviceAudit() as audit:
        runner, _ = _meta_runner(preset, audit, **flags)
        driver = RunnerDriver(runner)
        reqs = [driver.new_request(), driver.new_request(temperature=0.7, seed=5), driver.new_request()]
        driver.extend([Extend(r, [4] * (20 + i)) for i, r in enumerate(reqs)], return_logprob=False)
        audit.reset()
        for r in reqs:
            r.next_token = 7  # (the meta device samples no real token)
        driver.verify(reqs, [[5, 6, 7], [8], []])
        _check_forward(audit, d2h=0)
        if cuda_kernels:
            # A verify a CUDA graph serves (4 positions each; 3 requests, padded to the bucket of 4): the
            # capture reads no host value and copies in only the steps' constant indices (before the
            # graph is recorded, at warm-up); a replay moves the batch in its one copy.
            from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

            graphs = CudaGraphRunner(runner, [1, 2, 4], use_graphs=False, verify_width=4)
            runner.graph_runner = graphs
            assert graphs.verify_max_bs() == 4
            audit.reset()
            for r in reqs:
                r.next_token = 7
            replayed, replay = [], graphs.replay
            graphs.replay = lambda fb: replayed.append(fb.forward_mode.name) or replay(fb)
            driver.verify(reqs, [[5, 6, 7], [8, 9, 10], [1, 2, 3]], return_logprob=False, graph_shaped=True)
            _check_forward(audit, d2h=0)
            assert replayed == ["TARGET_VERIFY"]
    if cuda_kernels:
        step = "_gdn_decode_kernel" if "qwen" in preset else "_mamba2_decode_kernel"
        assert {step, "_extend_kernel"} <= {name for name, _ in launches.calls}
        assert all(devices == {"meta"} for _, devices in launches.calls), launches.calls


def test_the_fla_extend_takes_its_chunk_layout_from_the_batch(monkeypatch):
    """tiny-qwen3-next's extend through the FLA glue, as CUDA runs it (FLA's wrappers stood in for on
    the meta device, `sglang/test/fake_fla.py`): FLA's chunk layout travels in the batch's one copy
    and every layer's kernels get it, so no layer builds its own (in FLA, a blocking copy: a host sync
    per Gated DeltaNet layer of every extend)."""
    from sglang.test.fake_fla import fake_fla

    launches = RecordedLaunches()
    for module, name, value in launches.patches():
        monkeypatch.setattr(module, name, value)
    for var, value in CUDA_DEFAULT_ENV.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv(envs.SGLANG_GDN_EXTEND_BACKEND.name, "fla")
    with fake_fla() as fla, DeviceAudit() as audit:
        runner, _ = _meta_runner("tiny-qwen3-next", audit, attention_backend="triton")
        linear = runner.attn_backend.linear_attn_backend
        assert linear.varlen_impl.__name__ == "chunk_gdn_varlen_fla"
        driver = RunnerDriver(runner)
        lengths = [2 * linear.varlen_chunk + 5, 40]
        reqs = [driver.new_request() for _ in lengths]
        driver.extend([Extend(r, [5] * n) for r, n in zip(reqs, lengths, strict=True)], return_logprob=False)
        _check_forward(audit, d2h=0)
    calls = fla.called("chunk_gated_delta_rule_fwd_h")
    assert len(calls) == len(runner.arch.linear_layer_ids) > 0
    assert fla.called("prepare_chunk_indices") == []
    chunks = sum(-(-n // linear.varlen_chunk) for n in lengths)
    for call in calls:
        assert call["chunk_indices"].is_meta and call["chunk_indices"].shape == (chunks, 2)
        assert call["chunk_offsets"].is_meta and call["chunk_offsets"].shape == (len(lengths) + 1,)
    assert all(c["chunk_indices"] is calls[0]["chunk_indices"] for c in calls), "one layout per batch"


_NO_LISTS = dict(next_token_top_logprobs=None, input_token_logprobs=None, input_top_logprobs=None)


def test_a_result_copy_that_never_completes_trips_the_watchdog():
    """On a device the worker returns at launch, so the scheduler's watchdog must also bound the wait
    for the result copy (`PendingResult.wait(timeout)` waits on the copy's future)."""
    from sglang.srt.model_executor.forward_worker import PendingResult

    packed = torch.tensor([[5.0, 7.0], [-0.5, -1.25]], dtype=torch.float64)
    done: Future = Future()
    done.set_result(None)
    with pytest.raises(TimeoutError):
        PendingResult(packed=packed, has_logprobs=True, **_NO_LISTS, copied=Future()).wait(timeout=0.02)
    host = PendingResult(packed=packed, has_logprobs=True, **_NO_LISTS, copied=done).wait(timeout=0.02)
    assert host.next_token_ids == [5, 7] and all(type(t) is int for t in host.next_token_ids)
    assert host.next_token_logprobs == [-0.5, -1.25]


def test_the_copy_waiter_waits_for_the_copies_in_order_and_nobody_polls():
    """`CopyWaiter` waits for each result copy's event on its own thread (`synchronize`, which waits in
    C without the GIL; never `query`: a scheduler polling it took the GIL from the forward thread at
    every poll), in the order they were recorded, and hands a failed wait's error to the scheduler."""
    from sglang.srt.model_executor.forward_worker import CopyWaiter, PendingResult

    class Event:
        def __init__(self, error: str | None = None):
            self.error, self.on_device = error, threading.Event()

        def synchronize(self) -> None:
            assert self.on_device.wait(5)
            if self.error:
                raise RuntimeError(self.error)

        def query(self) -> bool:
            raise AssertionError("a result copy's event was polled")

    packed = torch.tensor([[3, 4]])
    waiter = CopyWaiter()
    try:
        first, second, failed = Event(), Event(), Event(error="device error")
        copies = [waiter.watch(e) for e in (first, second, failed)]
        results = [PendingResult(packed=packed, has_logprobs=False, **_NO_LISTS, copied=c) for c in copies]
        second.on_device.set()  # done on the device, but the first is waited for first
        with pytest.raises(TimeoutError):
            results[0].wait(timeout=0.05)
        assert not copies[1].done()
        first.on_device.set()
        assert results[0].wait(timeout=5).next_token_ids == [3, 4]
        assert results[1].wait(timeout=5).next_token_ids == [3, 4]
        failed.on_device.set()
        with pytest.raises(RuntimeError, match="device error"):
            results[2].wait(timeout=5)
    finally:
        waiter.shutdown()
    assert not waiter._thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        waiter.watch(Event())


def test_a_copy_waiter_that_cannot_take_its_device_fails_every_wait():
    """If the waiter's thread cannot make its device current, each copy's wait fails with that error
    at once (not a hang the watchdog would report as a stuck forward)."""
    from sglang.srt.model_executor.forward_worker import CopyWaiter

    class WaitedWithoutItsDevice(Exception):
        pass

    class Event:
        def synchronize(self) -> None:
            raise WaitedWithoutItsDevice

    if torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("the machine has a GPU 7")
    waiter = CopyWaiter(torch.device("cuda", 7))  # no such device here, with or without CUDA
    try:
        copies = [waiter.watch(Event()) for _ in range(2)]
        for copy in copies:
            with pytest.raises(Exception) as e:
                copy.result(timeout=5)
            assert not isinstance(e.value, (WaitedWithoutItsDevice, TimeoutError))
    finally:
        waiter.shutdown()


def test_result_copy_without_logprobs_runs_no_kernel_before_it():
    """The step's one result copy: without logprobs the ids go as they are (int64, exact beyond 2**53;
    no cast or stack launched first), with logprobs stacked as float64; `PendingResult.wait` gives
    ints and floats either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sglang.srt.model_executor.forward_worker import PendingResult, results_to_host

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    ids = torch.tensor([3, 2**53 + 1, 7])
    with Ops() as ops:
        packed, event = results_to_host(ids, None)
    # (On CPU `.cpu()` is the tensor itself; on CUDA the copy into pinned memory follows.)
    assert set(ops.names) <= {"view.default"}, ops.names
    assert packed.dtype == torch.int64 and event is None
    fields = dict(next_token_top_logprobs=None, input_token_logprobs=None, input_top_logprobs=None)
    host = PendingResult(packed=packed, has_logprobs=False, **fields).wait()
    assert host.next_token_ids == [3, 2**53 + 1, 7] and all(type(t) is int for t in host.next_token_ids)
    assert host.next_token_logprobs is None
    lp = torch.tensor([-0.5, -1.25, -3.0])
    packed, _ = results_to_host(ids[[0, 2]], lp[[0, 2]])
    host = PendingResult(packed=packed, has_logprobs=True, **fields).wait()
    assert host.next_token_ids == [3, 7] and host.next_token_logprobs == [-0.5, -3.0]


gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
    reason="needs a CUDA GPU and flash-linear-attention (fla-core)",
)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_forwards_wait_for_the_device_nowhere(preset):
    """On CUDA with the default kernels (bfloat16, Triton attention, FLA's packed extend, CUDA graphs):
    an extend with snapshots, a prefix hit with a COW and decode steps with a track copy, greedy and
    seeded, make no host sync at all (torch's sync check warns at each): the forward leaves its results
    on the device, and the one result copy is the forward worker's. Counted on the second of two
    identical rounds (the first compiles and autotunes, which synchronizes)."""
    from sglang.test.model_checks import make_runner

    runner = make_runner(preset, page_size=16, device="cuda", dtype="bfloat16", attention_backend="triton")
    driver = RunnerDriver(runner)
    chunk = runner.arch.kernel_state_chunk
    syncs: list[str] = []

    def counted(fb):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = runner.forward_batch_generation(fb)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.extend(f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message))
        return result

    def one_round():
        a, b = driver.new_request(), driver.new_request(temperature=0.7, top_k=5, seed=3)
        # The default strategy (extra_buffer_lazy) keeps no track slot: snapshots go into a slot
        # borrowed from the pool, as the scheduler's tracker takes one.
        [snap] = driver.alloc_mamba_slots(1)
        driver.extend(
            [Extend(a, list(range(3, 3 + 2 * chunk + 5)), track_seqlen=chunk, track_slot=snap),
             Extend(b, [5] * 40)],
            return_logprob=False, forward=counted,
        )  # fmt: skip
        c = driver.new_request()
        driver.extend(
            [Extend(c, [7] * 9, prefix_from=(a, 2 * chunk), cow_src=snap)],
            return_logprob=False, forward=counted,
        )  # fmt: skip
        track = {a: driver.alloc_mamba_slots(1)[0]}
        for step in range(3):
            reqs = [a, b, c]
            fb = driver.decode_batch(reqs, track=track if step == 1 else None, return_logprob=False)
            for req, token in zip(reqs, counted(fb).next_token_ids.tolist(), strict=True):
                req.next_token = token
        for req in (a, b, c):
            driver.free(req)

    one_round()
    syncs.clear()
    one_round()
    assert syncs == [], "host syncs in the forwards:\n" + "\n".join(syncs)
