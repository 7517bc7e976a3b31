"""Upstream's values of flags this server has (issue 60): `--dtype half|float` are float16 / float32;
upstream's other KV cache dtypes, attention backends and schedule policies are refused in one sentence
naming the flag (argparse's "invalid choice" stopped the start, exit 2); `--schedule-policy random|lof`
work as upstream's; `auto` parsers resolve to the model's."""

from __future__ import annotations

import random

import pytest

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgsError, prepare_server_args
from sglang.srt.server_args_checks import (
    UPSTREAM_ATTENTION_BACKENDS,
    UPSTREAM_KV_CACHE_DTYPES,
    UPSTREAM_SCHEDULE_POLICIES,
)
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


@pytest.mark.parametrize("value, dtype", [("half", "float16"), ("float", "float32"), ("float16", "float16")])
def test_upstreams_dtype_aliases(value, dtype):
    assert prepare_server_args(["--dtype", value]).dtype == dtype


REFUSED = (
    [("--kv-cache-dtype", v) for v in UPSTREAM_KV_CACHE_DTYPES]
    + [("--attention-backend", v) for v in UPSTREAM_ATTENTION_BACKENDS]
    + [("--schedule-policy", v) for v in UPSTREAM_SCHEDULE_POLICIES]
)


@pytest.mark.parametrize("flag, value", REFUSED, ids=[f"{f}={v}" for f, v in REFUSED])
def test_upstreams_other_values_are_refused_in_a_sentence(flag, value):
    with pytest.raises(ServerArgsError) as err:
        prepare_server_args([flag, value])
    text = str(err.value)
    assert text.startswith(f"{flag} {value} is not supported by this server: "), text
    assert text.count(". ") == 0 and text.endswith("."), "one sentence"
    assert " use " in text, "says what to use instead"


def test_every_upstream_value_parses():
    """Accepted, or refused by ServerArgs naming the flag and the value: never argparse's SystemExit.
    Upstream's choices of the three flags (sglang 0.5.23, and main's newer policies), as data."""
    upstream = {
        "--kv-cache-dtype": "auto fp8_e5m2 fp8_e4m3 mxfp8 bf16 bfloat16 nvfp4 fp4_mx_block16 fp4_e2m1",
        "--attention-backend": "triton torch_native flex_attention dsa nsa qsa dsv4 compressed cutlass_mla fa3 fa4 "
        "flashinfer flashmla trtllm_mla cutedsl_mla tokenspeed_mla trtllm_mha dual_chunk_flash_attn hpc_ops "
        "minicpm_flashattn minicpm_flashinfer aiter wave intel_amx ascend intel_xpu mlu",
        "--schedule-policy": "lpm random fcfs dfs-weight lof priority routing-key hrrn shortest-prefill-first",
    }
    for flag, values in upstream.items():
        for value in values.split():
            try:
                prepare_server_args([flag, value])
            except ServerArgsError as e:  # (triton is refused on a CPU: its own sentence)
                assert str(e).startswith(f"{flag} {value} "), e


def test_a_value_upstream_lacks_too_is_refused_by_name():
    with pytest.raises(ServerArgsError, match=r"^--attention-backend must be one of torch_native, triton, "):
        prepare_server_args(["--attention-backend", "flashinfr"])
    with pytest.raises(ServerArgsError, match=r"^--tool-call-parser must be one of auto, qwen, "):
        prepare_server_args(["--tool-call-parser", "llama3"])


def _reqs(max_new: list[int]) -> list[Req]:
    return [Req(f"r{i}", [5, 6], SamplingParams(max_new_tokens=m)) for i, m in enumerate(max_new)]


def test_lof_takes_the_longest_output_first_ties_in_arrival_order():
    assert prepare_server_args(["--schedule-policy", "lof"]).schedule_policy == "lof"
    queue = _reqs([4, 64, 16, 64, 1])
    order = SchedulePolicy("lof", tree_cache=None).calc_priority(queue)
    assert [r.rid for r in order] == ["r1", "r3", "r2", "r0", "r4"]
    assert [r.rid for r in queue] == ["r0", "r1", "r2", "r3", "r4"], "the queue itself stays in arrival order"


def test_random_shuffles_each_pass():
    assert prepare_server_args(["--schedule-policy", "random"]).schedule_policy == "random"
    queue = _reqs([8] * 6)
    policy = SchedulePolicy("random", tree_cache=None, seed=0)
    draws = [tuple(r.rid for r in policy.calc_priority(queue)) for _ in range(20)]
    assert all(sorted(o) == [r.rid for r in queue] for o in draws), "a permutation of the queue"
    # 20 draws of 720 orders: all alike would be a fixed order (chance ~1e-54 for a real shuffle).
    assert len(set(draws)) > 1
    # --random-seed decides the shuffles, whatever else draws from Python's global generator.
    again = SchedulePolicy("random", tree_cache=None, seed=0)
    random.seed(12345)
    assert [tuple(r.rid for r in again.calc_priority(queue)) for _ in range(20)] == draws


@pytest.mark.parametrize(
    "model, reasoning, tool",
    [
        ("tiny-qwen3-next", "qwen3", "qwen25"),
        ("tiny-qwen3.5", "qwen3", "qwen3_coder"),
        ("tiny-nemotron-h", "nemotron_3", None),
        ("tiny-granite-4.0-h", None, None),
    ],
)
def test_auto_parsers_are_the_models(model, reasoning, tool):
    for flag, name in (("--reasoning-parser", reasoning), ("--tool-call-parser", tool)):
        argv = ["--model-path", model, flag, "auto"]
        if name is None:
            with pytest.raises(
                ServerArgsError, match=rf"^{flag} auto knows no parser for \w+ here; give one of "
            ):
                prepare_server_args(argv)
            continue
        args = prepare_server_args(argv)
        assert getattr(args, flag[2:].replace("-", "_")) == name
