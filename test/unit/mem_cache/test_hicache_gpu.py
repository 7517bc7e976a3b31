"""The host tier's CUDA path in the engine (marked `gpu`; benchmark/gpu/run_gpu_checks.sh's `hicache`
group runs it with test_hicache_copies.py): the overlap schedule, `write_back`, a conversation whose
checkpoint the device evicted (backed up to host then, through the copy stream and the pinned staging)
is loaded back on its next turn, and that turn's tokens and logprobs equal a cold run of the same prompt
on the same GPU (cache flushed) and the transformers oracle.

Tolerance: a float32 model (FLA's dots in IEEE, layers/attention/fla_float32.py). The host hit resumes
from a snapshot its first turn's chunks wrote, the cold run from its own chunks: the same values summed
in other orders. On an H200 the engine's float32 logprobs left the oracle by 7.7e-6 at most
(test_strategy_matrix's GPU_ORACLE_TOL note); 1e-3 leaves 100x for summation order and is 100x below
what a wrong or stale state costs (> 0.1; test_hicache's negative control: > 0.5 on CPU)."""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.hicache_checks import host_hit_and_cold_run

register_cpu_ci(est_time=1, suite="per-commit-cpu")  # (skips without a GPU)

GPU_TOL = 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_host_hit_under_overlap_and_write_back_equals_a_cold_run(oracles):
    r = host_hit_and_cold_run(oracles["tiny-qwen3-next"], "tiny-qwen3-next", GPU_TOL, device="cuda")
    assert r["loaded_states"] == 1 and r["backups"] > 0, r  # (write_back: backed up when evicted)
    assert r["cached_hit"] == r["first_turn_len"] - 1 and r["cached_cold"] == 0, r
    assert r["hit_tokens"] == r["cold_tokens"], r
    assert r["max_dlogprob_vs_cold"] <= GPU_TOL, r
