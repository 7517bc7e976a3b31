"""The scheduler against the transformers oracle, per strategy: exact logprobs, and `cached_tokens`
equal to what the caching rules predict (derived below, not merely > 0), nothing held after a flush.

Axes: preset x strategy x overlap x page size (1, 16, 128) x chunked prefill (off, on). Every value of
each axis appears; not every combination does.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import ORACLE_TOL, SchedulerHarness, prompt_with_unique_token, token_ids

register_cpu_ci(est_time=120, suite="per-commit-cpu")

QWEN, NEMO, FALCON = "tiny-qwen3-next", "tiny-nemotron-h", "tiny-falcon-h1"
# (preset, strategy, overlap, page size, chunked prefill size or None)
CONFIGS = [
    (QWEN, "no_buffer", False, 1, None),
    (NEMO, "no_buffer", False, 1, 64),
    (QWEN, "extra_buffer", True, 1, 256),
    (NEMO, "extra_buffer", False, 16, None),
    (QWEN, "extra_buffer_lazy", True, 128, None),
    (NEMO, "extra_buffer_lazy", True, 128, 256),
    (QWEN, "extra_buffer_lazy", False, 16, 128),
    (NEMO, "extra_buffer", True, 1, None),
    # Falcon-H1: every layer both kinds (KV and state cached together), chunked prefill under overlap.
    (FALCON, "extra_buffer_lazy", True, 16, 128),
    # LFM2: short convs (the state is the conv window), no_buffer and extra_buffer.
    ("tiny-lfm2", "extra_buffer", True, 1, 128),
    ("tiny-lfm2", "no_buffer", False, 1, 64),
]
# On a GPU also the other architectures (their layers run the same kernels as the two above).
GPU_CONFIGS = CONFIGS + [
    ("tiny-qwen3.5-moe", "extra_buffer_lazy", True, 16, None),
    ("tiny-qwen3.5", "extra_buffer", True, 1, 256),
    ("tiny-granite-4.0-h", "extra_buffer_lazy", True, 1, 64),
]
L = 230  # shared prefix of the branching case: chunk sizes 32, 64 and 128 give different answers
P1 = 100  # turn-1 prompt of the decode-seeded cases


class Rules:
    """What each strategy caches, in the words of DESIGN section 5."""

    def __init__(self, h: SchedulerHarness):
        args = h.server_args
        self.no_buffer = args.mamba_scheduler_strategy == "no_buffer"
        self.overlap = not args.disable_overlap_schedule and not self.no_buffer
        self.page = args.page_size
        self.c = args.mamba_cache_chunk_size
        self.i = args.mamba_track_interval
        self.k = args.chunked_prefill_size if args.chunked_prefill_enabled else None

    def branching(self) -> list[int]:
        # Request 1 leaves a checkpoint at every chunk end (chunked prefill) and past the prefix.
        # Request 2 hits the deepest chunk end inside the prefix, matches KV to L, sets the branching
        # point and snapshots there (extra buffer only); request 3 hits the deepest of the two.
        chunk_hit = L // self.k * self.k if self.k else 0
        if self.no_buffer:
            return [0, chunk_hit, chunk_hit]
        return [0, chunk_hit, max(chunk_hit, L // self.c * self.c)]

    def turn2_hit(self, prompt_len: int, n: int, stopped: bool = False) -> int:
        """After turn 1 (prompt_len tokens, n outputs) finished, a continuation hits here: every
        strategy inserts the state after the last fed token where that KV ends on a page (no_buffer:
        page 1 always). A request that stopped on a token under overlap is released after the step
        already in flight, which feeds that token too. Else the extra-buffer modes keep the prefill
        snapshot and the last decode boundary at or before the last fed position."""
        fed = prompt_len + n - 1
        final = fed + 1 if stopped and self.overlap else fed
        if self.no_buffer or final % self.page == 0:
            return final
        boundary = fed // self.i * self.i
        return max(prompt_len // self.c * self.c, boundary if boundary > prompt_len else 0)

    def prompt_hit(self, prompt_len: int) -> int:
        """A continuation of a prompt whose request generated one token (its KV: the prompt)."""
        if self.no_buffer or prompt_len % self.page == 0:
            return prompt_len
        return prompt_len // self.c * self.c


def _harness(preset, strategy, overlap, page, chunk, **kwargs) -> SchedulerHarness:
    c = max(ServerArgs(model_path=preset).model_config.arch.kernel_state_chunk, page)
    return SchedulerHarness(
        preset,
        mamba_scheduler_strategy=strategy,
        disable_overlap_schedule=not overlap,
        page_size=page,
        chunked_prefill_size=chunk if chunk else -1,
        **{"mamba_track_interval": c, **kwargs},  # by default decode snapshots every chunk
    )


@pytest.mark.parametrize("preset,strategy,overlap,page,chunk", CONFIGS, ids=lambda v: str(v))
def test_workloads_match_oracle_and_cache_rules(preset, strategy, overlap, page, chunk, oracles):
    _run_workloads(_harness(preset, strategy, overlap, page, chunk), oracles[preset], ORACLE_TOL)


# Decode snapshots off the cache chunk's lattice (upstream's Qwen3-Next tests track every 2 tokens): a hit
# on one starts an extend at an unaligned position, which then snapshots on its own lattice.
SMALL_INTERVALS = [
    (QWEN, "extra_buffer", True, 1, None, 2),
    (NEMO, "extra_buffer_lazy", True, 1, 64, 6),
    (QWEN, "extra_buffer_lazy", False, 16, 128, 48),
]


@pytest.mark.parametrize("preset,strategy,overlap,page,chunk,interval", SMALL_INTERVALS, ids=lambda v: str(v))
def test_track_intervals_off_the_chunk_lattice(preset, strategy, overlap, page, chunk, interval, oracles):
    h = _harness(preset, strategy, overlap, page, chunk, mamba_track_interval=interval)
    _run_workloads(h, oracles[preset], ORACLE_TOL)


# On CUDA in float32 every dot is IEEE: the Triton attention's and decode kernels' by their own choice,
# flash-linear-attention's because a float32 model sets it so (layers/attention/fla_float32.py). Measured
# on an H200 (2026-11-27, benchmark/gpu/oracle_drift.py over these workloads, tiny-qwen3-next): 7.7e-6 at
# most, as the torch form on the GPU (8.8e-6); FLA's TF32 dots had erred by up to 0.235. 1e-3 leaves 100x
# for other summation orders and is still 100x below what a stale or misplaced state costs (O(0.1)).
GPU_ORACLE_TOL = 1e-3
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("preset,strategy,overlap,page,chunk", GPU_CONFIGS, ids=lambda v: str(v))
def test_gpu_workloads_match_oracle_and_cache_rules(preset, strategy, overlap, page, chunk, oracles):
    """The same workloads on CUDA: Triton attention, the Triton decode kernels, CUDA graphs (on by
    default), FLA's prefill where installed."""
    h = _harness(preset, strategy, overlap, page, chunk, device="cuda", dtype="float32")
    _run_workloads(h, oracles[preset], GPU_ORACLE_TOL)


def _run_workloads(h: SchedulerHarness, oracle, tol: float) -> None:
    rules = Rules(h)
    try:
        # 1. Branching: prefix of L tokens built from ids, three suffixes of 4 cache chunks.
        prefix = token_ids(L, seed=1)
        got = []
        for k in range(3):
            prompt = prefix + token_ids(4 * rules.c, seed=10 + k)
            out = h.generate(prompt, max_new_tokens=1)
            h.check_oracle(oracle, prompt, out, tol)
            got.append(out.cached_tokens)
        assert got == rules.branching()
        h.flush_and_check_empty()

        # 2. Decode-seeded hit: turn 2 = turn 1's prompt + its outputs + more.
        prompt = token_ids(P1, seed=2)
        out = h.generate(prompt, max_new_tokens=75)
        h.check_oracle(oracle, prompt, out, tol)
        turn2 = prompt + out.output_ids + token_ids(5, seed=3)
        out2 = h.generate(turn2, max_new_tokens=6)
        h.check_oracle(oracle, turn2, out2, tol)
        assert out2.cached_tokens == rules.turn2_hit(P1, 75)
        h.flush_and_check_empty()

        # 3. Finishing exactly on a track boundary (P1 + n - 1 = 128) and one token after it.
        for n in (29, 30):
            prompt = token_ids(P1, seed=4 + n)
            out = h.generate(prompt, max_new_tokens=n)
            h.check_oracle(oracle, prompt, out, tol)
            turn2 = prompt + out.output_ids + [7, 8, 9]
            out2 = h.generate(turn2, max_new_tokens=2)
            h.check_oracle(oracle, turn2, out2, tol)
            assert out2.cached_tokens == rules.turn2_hit(P1, n), n
            h.flush_and_check_empty()

        # Finishing by a stop token at position 127: under overlap the step already in flight is the
        # boundary step (128), which writes a snapshot and the stop token's KV and state; the request
        # is released when it has been processed.
        prompt, stop_at = prompt_with_unique_token(oracle, P1, 28)
        out = h.generate(prompt, max_new_tokens=40, stop_token_ids=[stop_at])
        assert len(out.output_ids) == 28 and out.finished_reason == {"type": "stop", "matched": stop_at}
        h.check_oracle(oracle, prompt, out, tol)
        turn2 = prompt + out.output_ids + [7, 8, 9]
        out2 = h.generate(turn2, max_new_tokens=2)
        h.check_oracle(oracle, turn2, out2, tol)
        assert out2.cached_tokens == rules.turn2_hit(P1, 28, stopped=True)
        h.flush_and_check_empty()

        # 4. Sixteen concurrent requests over four cached system prompts.
        systems = [token_ids(150, seed=40 + g) for g in range(4)]
        for s in systems:
            h.generate(s, max_new_tokens=1)
        prompts = [systems[k % 4] + token_ids(20 + 3 * k, seed=60 + k) for k in range(16)]
        rids = [h.submit(p, max_new_tokens=10) for p in prompts]
        h.run()
        sys_hit = rules.prompt_hit(150)
        for p, rid in zip(prompts, rids, strict=True):
            out = h.outputs[rid]
            h.check_oracle(oracle, p, out, tol)
            assert out.cached_tokens == sys_hit, (rid, out.cached_tokens)
        h.flush_and_check_empty()
    finally:
        h.shutdown()
