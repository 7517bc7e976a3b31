"""The shape warm-up (CUDA): the prompt lengths it prefills reach every tile class of the FP8 GEMM and
the FP8 experts and both sides of Triton's multiple-of-16 specialization, stay within the prompt limit
and the pool, and run after the warm-up request, one at a time, then several at once, before the cache
is flushed. No server: a stand-in TokenizerManager records what the warm-up sends."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from sglang.srt.entrypoints.server_warmup import (
    CHUNK_TAIL,
    CONCURRENT_PROMPT_LEN,
    CONCURRENT_PROMPTS,
    needs_shape_warmup,
    run_server_warmup,
    warmup_prompt_lengths,
)
from sglang.srt.layers.moe.fused_moe_fp8_triton import MOE_GEMM_CONFIGS, MoeGemmConfig
from sglang.srt.layers.moe.moe_configs import FALLBACK_CONFIGS, pick_configs
from sglang.srt.layers.quantization.fp8_kernel import GEMM_CONFIGS
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_checks import ServerArgsError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def _class_of(bounds: list[float], value: float) -> int:
    return next(i for i, bound in enumerate(bounds) if value <= bound)


def _assert_covered(select, lengths: list[int], top: int) -> None:
    """Every choice `select(m)` makes for an extend of m = 1..top tokens is made for some warm-up length
    (with CUDA graphs or without: the capture's batch sizes are not counted here)."""
    met = {select(m) for m in lengths}
    missed = {select(m) for m in range(1, top + 1)} - met
    assert not missed, missed


def test_the_lengths_reach_every_tile_choice_and_both_specializations():
    # The H200's server defaults for the 80B: chunks of 8192 (an extend is at most that), a prompt limit
    # of the context (262k).
    lengths = warmup_prompt_lengths(8192, 16384, 262143, 1_000_000)
    assert lengths[:7] == [1, 2, 3, 4, 5, 8, 9] and lengths[-2:] == [8192, 8192 + CHUNK_TAIL]
    # The FP8 GEMM's tiles by M (the extend's tokens), each as a multiple of 16 and as another number.
    gemm_bounds = [bound for bound, _ in GEMM_CONFIGS]
    _assert_covered(lambda m: (_class_of(gemm_bounds, m), m % 16 == 0), lengths, 8192)
    # The FP8 experts' tiles and the bf16 fused experts' fallback tiles by mean rows per expert, and the
    # bf16 ones with a tuned table (batch sizes 1-256, as tune_fused_moe.py tunes; its nearest entry up to
    # twice its largest, the fallback above), at the 80B's 512 experts top 10 and smaller MoEs.
    tuned = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    table = {b: (MoeGemmConfig(16, 16 * i, 128, 4, 3),) * 2 for i, b in enumerate(tuned)}  # each distinct
    for e, k in ((512, 10), (64, 8), (16, 2)):
        for configs in (MOE_GEMM_CONFIGS, FALLBACK_CONFIGS):
            bounds = [bound for bound, _ in configs]
            _assert_covered(lambda m, b=bounds, e=e, k=k: _class_of(b, m * k / e), lengths, 8192)
        _assert_covered(lambda m, e=e, k=k: pick_configs(table, m, m * k, e), lengths, 8192)


@pytest.mark.parametrize(
    ("chunk", "max_prefill", "max_input", "pool", "top", "longest"),
    [
        (8192, 16384, 262143, 1_000_000, 8192, 8192 + CHUNK_TAIL),  # a chunk and a second one on it
        (-1, 16384, 262143, 1_000_000, 16384, 16384),  # no chunking: the largest prefill, no tail
        (8192, 16384, 1000, 1_000_000, 1000, 1000),  # the prompt limit
        (8192, 16384, 262143, 3000, 2999, 2999),  # the pool, with room for one new token
        (4096, 16384, 4100, 1_000_000, 4096, 4100),  # a tail cut to the prompt limit
    ],
)
def test_the_lengths_stay_within_the_limits(chunk, max_prefill, max_input, pool, top, longest):
    lengths = warmup_prompt_lengths(chunk, max_prefill, max_input, pool)
    assert lengths == sorted(set(lengths)) and lengths[-1] == longest
    assert top in lengths and all(n <= top for n in lengths[:-1])


def test_a_tiny_pool_gets_no_lengths_below_one():
    assert warmup_prompt_lengths(8192, 16384, 262143, 1) == []
    assert warmup_prompt_lengths(8192, 16384, 262143, 12) == [1, 2, 3, 4, 5, 8, 9, 11]


def test_cuda_warms_shapes_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("SGLANG_SHAPE_WARMUP", raising=False)
    assert needs_shape_warmup(SimpleNamespace(device="cuda"))
    assert needs_shape_warmup(SimpleNamespace(device="cuda:1"))
    assert not needs_shape_warmup(SimpleNamespace(device="cpu"))
    monkeypatch.setenv("SGLANG_SHAPE_WARMUP", "on")
    assert needs_shape_warmup(SimpleNamespace(device="cpu"))
    monkeypatch.setenv("SGLANG_SHAPE_WARMUP", "off")
    assert not needs_shape_warmup(SimpleNamespace(device="cuda"))
    monkeypatch.setenv("SGLANG_SHAPE_WARMUP", "yes")
    refusal = r"^SGLANG_SHAPE_WARMUP must be one of auto, on, off, got 'yes'\.$"
    with pytest.raises(ServerArgsError, match=refusal):
        ServerArgs(model_path="tiny-qwen3-next")


class _StandInTokenizerManager:
    tokenizer = None
    limits = SimpleNamespace(vocab_size=1000)

    def __init__(self):
        self.sent: list[tuple[list[int], int]] = []  # (ids, max_new_tokens)
        self.in_flight = self.most_in_flight = 0
        self.flushed_after: int | None = None
        self.namespaces: set[str] = set()

    async def generate_request(self, obj, warmup=False):
        self.sent.append((obj.input_ids, obj.sampling_params["max_new_tokens"]))
        assert obj.log_metrics is False and self.flushed_after is None
        assert warmup is True  # (the scheduler keeps its namespace off the host and disk tiers)
        self.namespaces.add(obj.extra_key)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        yield {"output_ids": [0] * obj.sampling_params["max_new_tokens"]}

    async def flush_cache(self, end_of_warmup=False):
        assert end_of_warmup is True  # (the scheduler's counts restart from zero)
        self.flushed_after = len(self.sent)
        return SimpleNamespace(success=True)


def test_the_shape_warmup_runs_each_length_alone_then_several_at_once_then_flushes():
    tm = _StandInTokenizerManager()
    lengths = [16, 17, 32, 33, 40]
    assert asyncio.run(run_server_warmup(tm, 4096, lengths, vocab_size=50)) is None
    first, *shapes = tm.sent
    assert len(first[0]) == 6  # the warm-up request (ids, as with --skip-tokenizer-init)
    assert [len(ids) for ids, _ in shapes[: len(lengths)]] == lengths
    assert [len(ids) for ids, _ in shapes[len(lengths) :]] == [CONCURRENT_PROMPT_LEN] * CONCURRENT_PROMPTS
    assert tm.most_in_flight == CONCURRENT_PROMPTS
    assert all(0 <= i < 25 for ids, _ in shapes for i in ids)  # the vocabulary's lower half
    assert len({tuple(ids[:16]) for ids, _ in shapes}) == len(shapes)  # no prompt another's prefix
    assert tm.flushed_after == len(tm.sent)


def test_without_shapes_only_the_warmup_request_runs():
    tm = _StandInTokenizerManager()
    assert asyncio.run(run_server_warmup(tm, 4096)) is None
    assert len(tm.sent) == 1 and tm.most_in_flight == 1 and tm.flushed_after == 1


def test_each_start_warms_up_in_a_namespace_of_its_own():
    # With a disk tier, a fixed namespace let a restart's warm-up hit the previous start's prompts (and
    # so compile none of the long shapes): every request of one warm-up shares one namespace, new at
    # each start, never the shared one (None).
    runs = []
    for _ in range(2):
        tm = _StandInTokenizerManager()
        assert asyncio.run(run_server_warmup(tm, 4096, [16, 17], vocab_size=50)) is None
        assert len(tm.namespaces) == 1 and None not in tm.namespaces
        runs.append(tm.namespaces.pop())
    assert runs[0] != runs[1]


def test_the_start_log_says_where_the_start_went(caplog):
    from sglang.srt.entrypoints.http_server import log_startup

    args = SimpleNamespace(model_path="m", mamba_scheduler_strategy="no_buffer", mamba_strategy_reason=None)
    args.max_running_requests = 4
    info = {"max_total_num_tokens": 100, "max_running_requests": 4, "context_len": 64}
    times = {"load_weight": 1.234, "kv_cache_allocation": 0.5, "cuda_graph": 2.0, "scheduler_e2e": 4.75}
    with caplog.at_level("INFO", logger="sglang.srt.entrypoints.http_server"):
        log_startup(args, info, {"startup_times": times})
    assert (
        "Scheduler start: weights loaded 1.23 s, pools allocated 0.50 s, CUDA graphs captured 2.00 s, "
        "in all 4.75 s." in caplog.text
    )
    # The metric reads the same table (one owner): upstream's phases, the graphs in a family of their own.
    from sglang.srt.metrics.scheduler_collector import SchedulerStateCollector

    families = {f.name: f for f in SchedulerStateCollector("m")._startup_and_memory({"startup_times": times})}
    phases = {s.labels["phase"]: s.value for s in families["sglang:startup_time_seconds"].samples}
    assert phases == {"load_weight": 1.234, "kv_cache_allocation": 0.5, "scheduler_e2e": 4.75}
    assert families["sglang:startup_cuda_graph_time_seconds"].samples[0].value == 2.0


class _RoundRobinReplicas(_StandInTokenizerManager):
    """The stand-in behind --dp-size 2's controller: requests go to the replicas in turn (round robin, or
    shortest queue with every queue empty, whose tie-break is the same turn)."""

    def __init__(self, dp_size: int):
        super().__init__()
        self.dp_size = dp_size
        self.by_replica: list[list[int]] = [[] for _ in range(dp_size)]  # prompt lengths each one got
        self.busy = [0] * dp_size
        self.most_busy = [0] * dp_size

    async def generate_request(self, obj, warmup=False):
        d = len(self.sent) % self.dp_size
        self.by_replica[d].append(len(obj.input_ids))
        self.busy[d] += 1
        self.most_busy[d] = max(self.most_busy[d], self.busy[d])
        async for out in super().generate_request(obj, warmup):
            self.busy[d] -= 1
            yield out


def test_with_data_parallel_replicas_every_replica_warms_up_every_shape():
    # Each request once sent alternating lengths to the two replicas: each warmed up half the shapes.
    tm = _RoundRobinReplicas(dp_size=2)
    lengths = [16, 17, 32, 33, 40]
    assert asyncio.run(run_server_warmup(tm, 4096, lengths, vocab_size=50, replicas=2)) is None
    expected = [6, *lengths] + [CONCURRENT_PROMPT_LEN] * CONCURRENT_PROMPTS  # (the request's 6 ids first)
    assert tm.by_replica == [expected, expected]
    assert tm.most_busy == [CONCURRENT_PROMPTS] * 2
    assert tm.flushed_after == len(tm.sent)
