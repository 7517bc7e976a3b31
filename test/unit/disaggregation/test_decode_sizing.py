"""The decode server's pools on a GPU (issue 56, item 2): `HybridMambaDecodeReqToTokenPool` takes its
sizes from the memory planner (`mem_cache/pool_sizing.py`, the same code on CPU and CUDA, with the
device's free memory on CUDA), and on real checkpoints and GPUs the planned mamba slots already hold
every request row's slots, pre-allocation rows included: the pool is built at the planned size, never
raised past the plan (what could take memory the KV budget counted on)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from sglang.srt.disaggregation.decode_pool import default_decode_extra_slots
from sglang.srt.mem_cache.pool_sizing import plan_memory
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")

# ServerArgs as a GPU server makes them, and real checkpoints' configs (test/unit/mem_cache).
_PLANNING = runpy.run_path(str(Path(__file__).parents[1] / "mem_cache" / "test_memory_planning.py"))


@pytest.mark.parametrize(
    ("model", "device_memory"),
    [
        ("Qwen3-Next-80B-A3B-Instruct-FP8", _PLANNING["H200"]),
        ("NVIDIA-Nemotron-Nano-9B-v2", _PLANNING["H100"]),
    ],
)
@pytest.mark.parametrize(
    "flags", [{}, {"max_running_requests": 16}, {"disaggregation_decode_enable_radix_cache": True}]
)
def test_a_gpu_decode_servers_planned_slots_hold_every_row(tmp_path, model, device_memory, flags):
    args = _PLANNING["_server_args"](tmp_path, model, device_memory, disaggregation_mode="decode", **flags)
    sizes = plan_memory(args, device_memory).sizes
    pre_alloc = default_decode_extra_slots(sizes.max_running_requests)
    rows = sizes.max_running_requests + pre_alloc
    # HybridMambaDecodeReqToTokenPool raises the size to this when it is larger (upstream PR #22462).
    assert rows * args.mamba_strategy.max_slots_per_req <= sizes.max_mamba_cache_size
