"""The memory planner at real size: the published config.json of Qwen3-Next-80B-A3B-Instruct (bf16 and
FP8), Qwen3.5-27B and NVIDIA-Nemotron-Nano-9B-v2 (`real_model_configs.py`), with no weights (the model is
built on the meta device: `mem_cache/weight_bytes.py`), on an H200 and an H100 as torch reports them,
with the defaults the server picks for that GPU (`--mem-fraction-static`, `--chunked-prefill-size`).

What it must say: the FP8 80B fits one H200 with at least 40 GB for the KV and state pools; the bf16
80B (~160 GB) is refused before loading, in one sentence naming --tp-size and FP8; the 27B and the 9B fit
(their plans are printed: `pytest -s`)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from unittest import mock

import pytest
import torch

from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.mem_cache.pool_sizing import plan_memory
from sglang.srt.mem_cache.weight_bytes import weight_bytes_from_config
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=12, suite="per-commit-cpu")

# The test data, beside this file (tests are not a package here).
_REAL = runpy.run_path(str(Path(__file__).with_name("real_model_configs.py")))

GiB = 2**30
# torch.cuda.mem_get_info()'s total: an H200 (141 GB on its label) reports about 139.8 GiB, an H100 SXM
# (80 GB) 79.2 GiB (85,031,714,816 bytes).
H200 = int(139.8 * GiB)
H100 = 85_031_714_816
CONFIGS = {
    "Qwen3-Next-80B-A3B-Instruct-FP8": _REAL["QWEN3_NEXT_80B_A3B_INSTRUCT_FP8"],
    "Qwen3-Next-80B-A3B-Instruct": _REAL["QWEN3_NEXT_80B_A3B_INSTRUCT"],
    "Qwen3.5-27B": _REAL["QWEN3_5_27B"],
    "NVIDIA-Nemotron-Nano-9B-v2": _REAL["NEMOTRON_NANO_9B_V2"],
}


def _server_args(tmp_path: Path, model: str, device_memory: int, **flags) -> ServerArgs:
    """ServerArgs for `model` on CUDA as the server makes them on a GPU of `device_memory` bytes (its
    defaults by the GPU's memory), on this machine without one."""
    folder = tmp_path / model
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIGS[model]))
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch("sglang.srt.server_args.gpu_memory_mib", return_value=device_memory // 2**20),
    ):
        return ServerArgs(
            model_path=str(folder), tokenizer_path=resolve_model_path("tiny-qwen3-next"), device="cuda", **flags
        )


def test_the_fp8_80b_fits_one_h200_with_40_gb_for_the_pools(tmp_path):
    args = _server_args(tmp_path, "Qwen3-Next-80B-A3B-Instruct-FP8", H200)
    plan = plan_memory(args, H200)
    print("Qwen3-Next-80B-A3B-Instruct-FP8 on an H200:", plan.describe())
    # 77.3 G expert weights + ~1.9 G other quantized linears at 1 byte, their scales, and ~0.6 G
    # parameters kept in bf16 (embeddings, lm_head, norms, gates, the GDN's small parts): ~80 GB.
    assert 78e9 < plan.weight_bytes < 83e9
    sizes = plan.sizes
    assert plan.cache_bytes >= 40e9
    assert sizes.kv_pool_bytes + sizes.mamba_pool_bytes >= 40e9
    # The pools take the planned cache bytes, less rounding (whole pages, whole slots).
    assert plan.cache_bytes - (sizes.kv_pool_bytes + sizes.mamba_pool_bytes) < sizes.mamba_bytes_per_slot * 2


@pytest.mark.parametrize("device_memory", [H200, H100], ids=["H200", "H100"])
def test_the_bf16_80b_is_refused_before_loading(tmp_path, device_memory):
    args = _server_args(tmp_path, "Qwen3-Next-80B-A3B-Instruct", device_memory)
    with pytest.raises(ServerArgsError) as err:
        plan_memory(args, device_memory)
    sentence = str(err.value)
    assert "--tp-size" in sentence and "FP8" in sentence and sentence.count(". ") == 0
    weights = weight_bytes_from_config(args.model_config.hf_config, torch.bfloat16).total
    assert 155e9 < weights < 165e9  # ~80B parameters at 2 bytes


def test_the_bf16_80b_plans_one_rank_at_tp_2_4_8(tmp_path):
    """Tensor parallel, each number is one rank's: the bf16 80B's weights split but for the few replicated
    parts (norms, the MoE routers and shared-expert gates, attention key/value heads beyond their 2), the
    state per slot by tp (16 key / 32 value heads split), the KV per token by min(tp, 2) (2 KV heads, then
    replicated). Refused on one H100, it fits from TP 4 (~40 GB a rank)."""
    one = plan_memory(_server_args(tmp_path, "Qwen3-Next-80B-A3B-Instruct", H200, tp_size=1), 10**13)
    for tp in (2, 4, 8):
        args = _server_args(tmp_path, "Qwen3-Next-80B-A3B-Instruct", H100, tp_size=tp)
        if tp == 2:
            with pytest.raises(ServerArgsError, match="one rank's part at --tp-size 2"):
                plan_memory(args, H100)
            continue
        plan = plan_memory(args, H100)
        print(f"Qwen3-Next-80B-A3B-Instruct, one rank of --tp-size {tp} on an H100:", plan.describe())
        # On every rank whole: the 48 routers (512 x 2048 bf16, 0.1 GB), the replicated KV heads and norms.
        assert one.weight_bytes / tp < plan.weight_bytes < one.weight_bytes / tp + 0.2e9
        assert plan.sizes.mamba_bytes_per_slot * tp == one.sizes.mamba_bytes_per_slot
        assert plan.sizes.kv_bytes_per_token * min(tp, 2) == one.sizes.kv_bytes_per_token
        assert plan.cache_bytes >= 20e9


def test_the_fp8_80b_splits_its_blocks_at_tp_4_and_is_refused_at_tp_8(tmp_path):
    """The CUDA FP8 layout splits weights and 128 x 128 scales together, which needs whole blocks on every
    rank: at TP 4 every split piece is (20.4 GB a rank, fitting an H100); at TP 8 the shared experts'
    512-wide intermediate dimension leaves 64 rows a rank and the model is refused, naming --tp-size."""
    plan = plan_memory(_server_args(tmp_path, "Qwen3-Next-80B-A3B-Instruct-FP8", H100, tp_size=4), H100)
    print("Qwen3-Next-80B-A3B-Instruct-FP8, one rank of --tp-size 4 on an H100:", plan.describe())
    assert 19.5e9 < plan.weight_bytes < 21.5e9
    args = _server_args(tmp_path, "Qwen3-Next-80B-A3B-Instruct-FP8", H100, tp_size=8)
    with pytest.raises(ValueError, match=r"shared_expert.* \(64 of 512\) .* --tp-size 8"):
        plan_memory(args, H100)


def test_the_fp8_80b_is_refused_on_one_h100(tmp_path):
    """~80 GB of FP8 weights exceed what an H100's default fraction (~0.87 of 79.2 GiB) holds."""
    args = _server_args(tmp_path, "Qwen3-Next-80B-A3B-Instruct-FP8", H100)
    with pytest.raises(ServerArgsError, match="--tp-size"):
        plan_memory(args, H100)


@pytest.mark.parametrize("model", ["Qwen3.5-27B", "NVIDIA-Nemotron-Nano-9B-v2"])
@pytest.mark.parametrize("device_memory", [H200, H100], ids=["H200", "H100"])
def test_the_27b_and_9b_fit(tmp_path, model, device_memory):
    args = _server_args(tmp_path, model, device_memory)
    plan = plan_memory(args, device_memory)
    print(f"{model} on {device_memory / GiB:.1f} GiB:", plan.describe())
    # bf16 weights: 27B text parameters (the vision tower is not served) and 8.9B parameters.
    low, high = (52e9, 56e9) if model == "Qwen3.5-27B" else (17e9, 19e9)
    assert low < plan.weight_bytes < high
    # Room to serve: at least 10 GB of pools (the smallest, the 27B on an H100, has 16.8 GB), which
    # the KV and state pools take whole, and a dozen requests with 128k tokens between them.
    sizes = plan.sizes
    assert plan.cache_bytes >= 10e9
    assert plan.cache_bytes - (sizes.kv_pool_bytes + sizes.mamba_pool_bytes) < sizes.mamba_bytes_per_slot * 2
    assert sizes.max_running_requests >= 12 and sizes.max_total_tokens >= 128 * 1024


def test_the_server_refuses_before_loading_any_weight(tmp_path):
    """ModelRunner on CUDA plans the weights from the config first: the bf16 80B stops there, and no
    weight loads (on the previous code the load started, and the device ran out of memory)."""
    from sglang.srt.model_executor import model_runner

    args = _server_args(tmp_path, "Qwen3-Next-80B-A3B-Instruct", H200)
    with (
        mock.patch.object(torch.cuda, "mem_get_info", return_value=(H200, H200)),
        mock.patch.object(model_runner, "load_model", side_effect=AssertionError("weights loaded")) as load,
        pytest.raises(ServerArgsError, match="--tp-size"),
    ):
        model_runner.ModelRunner(args)
    assert not load.called


def test_the_pool_sizes_are_in_the_server_info():
    """/get_server_info (the scheduler's internal state) has the weights', KV pool's and state pool's
    bytes, those the start log prints."""
    from sglang.test.scheduler_harness import SchedulerHarness

    h = SchedulerHarness("tiny-qwen3-next")
    try:
        memory = h.sched.get_internal_state()["memory_bytes"]
        runner = h.sched.model_runner
    finally:
        h.shutdown()
    sizes = runner.pool_sizes
    assert memory["kv_pool"] + memory["state_pool"] == memory["kv_cache"]
    # The pools' tensors: the planned bytes plus the dummy page and slot 0.
    page = runner.server_args.page_size
    assert memory["kv_pool"] == sizes.kv_pool_bytes + page * sizes.kv_bytes_per_token
    assert memory["state_pool"] == sizes.mamba_pool_bytes + sizes.mamba_bytes_per_slot
    assert memory["weights"] == sum(p.numel() * p.element_size() for p in runner.model.parameters())
