"""Upstream's expert distribution recorder (`--expert-distribution-recorder-mode stat`,
`model_executor/expert_distribution.py`): while recording, each forward adds a [layers, experts] count of
its routers' picks; a dump writes upstream's `{"rank", "logical_count": [steps, layers, experts]}` file
and clears the record. Checked against the routing the same requests return (return_routed_experts,
itself checked against transformers' routers in test_routed_experts.py): the dump's counts are those
rows' histogram, layer by layer, with a dense layer's 0s; the buffer keeps its last steps oldest first;
-1 sums them; stop stops; a server without the flag or with a mode not built refuses in one sentence."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from sglang.srt.managers.io_struct import ExpertDistributionReq
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=6, suite="per-commit-cpu")


def decode(out, layers: int, top_k: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(out.routed_experts), dtype="<i4").reshape(-1, layers, top_k)


def _dump(h: SchedulerHarness) -> dict:
    out = h.control_reply(ExpertDistributionReq("dump"))
    assert out.success, out.message
    return torch.load(out.message, weights_only=True)


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-lfm2-moe"])
def test_the_counts_are_the_routing_the_requests_return(preset, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path))
    h = SchedulerHarness(preset, enable_return_routed_experts=True, expert_distribution_recorder_mode="stat",
                         disable_overlap_schedule=True)  # fmt: skip
    hf = h.server_args.model_config.arch.hf_config
    layers, k = hf.num_hidden_layers, hf.num_experts_per_tok
    try:
        h.generate(token_ids(30, seed=1), 3, return_routed_experts=True)  # (before the start: not counted)
        assert h.control_reply(ExpertDistributionReq("start")).success
        outs = [h.generate(token_ids(20 + 9 * i, seed=2 + i), 5, return_routed_experts=True) for i in range(2)]
        record = _dump(h)
        count = record["logical_count"]
        steps = 2 * (1 + 4)  # (each request: a prefill and 4 decode forwards, run one after the other)
        assert record["rank"] == 0 and count.dtype == torch.int32 and count.shape[:2] == (steps, layers)
        rows = np.concatenate([decode(o, layers, k) for o in outs])
        routed = [i for i in range(layers) if rows[:, i].any()]
        for i in range(layers):
            want = np.bincount(rows[:, i].ravel(), minlength=count.shape[2]) if i in routed else 0
            assert (count[:, i].sum(0).numpy() == want).all(), i
        assert (count.sum(2)[:, routed] == torch.tensor([20 * k] + [k] * 4 + [29 * k] + [k] * 4)[:, None]).all()
        assert _dump(h)["logical_count"].shape[0] == 0  # (the dump cleared it)
        assert h.control_reply(ExpertDistributionReq("stop")).success
        h.generate(token_ids(12, seed=9), 2)
        assert _dump(h)["logical_count"].shape[0] == 0  # (stopped: nothing counted)
    finally:
        h.shutdown()


@pytest.mark.parametrize("size", [2, -1])
def test_the_buffer_keeps_its_last_steps_oldest_first_and_minus_one_sums_them(size, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path))
    h = SchedulerHarness(expert_distribution_recorder_mode="stat_approx", expert_distribution_recorder_buffer_size=size,
                         disable_overlap_schedule=True)  # fmt: skip
    k = h.server_args.model_config.arch.hf_config.num_experts_per_tok
    try:
        h.control_reply(ExpertDistributionReq("start"))
        for n in (40, 30, 20):  # (one forward each: a prefill of n tokens, its one output token)
            h.generate(token_ids(n, seed=n), 1)
        count = _dump(h)["logical_count"]
        per_step = count.sum(2).max(1).values  # (the tokens x top-k of a routed layer, each step)
        assert per_step.tolist() == ([30 * k, 20 * k] if size == 2 else [90 * k])
    finally:
        h.shutdown()


def test_without_the_flag_the_calls_are_refused_and_bad_flags_at_start():
    h = SchedulerHarness(max_running_requests=4)
    try:
        out = h.control_reply(ExpertDistributionReq("start"))
        assert not out.success and "--expert-distribution-recorder-mode stat" in out.message
    finally:
        h.shutdown()
    for flags, words in (({"expert_distribution_recorder_mode": "per_token"}, "return_routed_experts"),
                         ({"expert_distribution_recorder_mode": "bogus"}, "must be one of"),
                         ({"expert_distribution_recorder_buffer_size": 0}, "-1 or at least 1")):  # fmt: skip
        with pytest.raises(ServerArgsError, match=words):
            ServerArgs(**flags)
    with pytest.raises(ServerArgsError, match="--expert-distribution-recorder-mode needs a mixture-of-experts"):
        SchedulerHarness("tiny-bamba", expert_distribution_recorder_mode="stat")


def test_a_failed_dump_keeps_the_record_and_the_server(tmp_path, monkeypatch):
    """A folder that cannot be made (a file on its way): the dump says so and keeps what was recorded
    (the scheduler died on torch.save's RuntimeError before, and the record was cleared first); the next
    dump, to a folder that works, has every step. A buffer past 1 GiB is refused at start."""
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path / "afile" / "sub"))
    h = SchedulerHarness(expert_distribution_recorder_mode="stat", disable_overlap_schedule=True)
    try:
        h.control_reply(ExpertDistributionReq("start"))
        h.generate(token_ids(16, seed=4), 3)
        failed = h.control_reply(ExpertDistributionReq("dump"))
        assert not failed.success and "not written" in failed.message
        monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path / "ok"))
        assert _dump(h)["logical_count"].shape[0] == 3 and [p.name for p in (tmp_path / "ok").iterdir()][0].endswith(".pt")
    finally:
        h.shutdown()
    with pytest.raises(ServerArgsError, match="GiB of counts on the device"):
        SchedulerHarness(expert_distribution_recorder_mode="stat", expert_distribution_recorder_buffer_size=10_000_000)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_counts_from_cuda_graph_replays_are_the_returned_routing(tmp_path, monkeypatch):
    """On CUDA the decode steps replay graphs, which write the routing into the capture's fixed rows (a
    batch of 3 padded to 4): the counts are the histogram of the routing the requests return, padding
    left out."""
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path))
    h = SchedulerHarness(device="cuda", dtype="float32", enable_return_routed_experts=True,
                         expert_distribution_recorder_mode="stat", cuda_graph_bs=[1, 2, 4])  # fmt: skip
    assert h.sched.model_runner.graph_runner is not None
    hf = h.server_args.model_config.arch.hf_config
    layers, k = hf.num_hidden_layers, hf.num_experts_per_tok
    try:
        h.control_reply(ExpertDistributionReq("start"))
        rids = [h.submit(token_ids(30 + 7 * i, seed=30 + i), 10, return_routed_experts=True) for i in range(3)]
        h.run()
        count = _dump(h)["logical_count"].sum(0)
        rows = np.concatenate([decode(h.outputs[r], layers, k) for r in rids])
        for i in range(layers):
            assert (count[i].numpy() == np.bincount(rows[:, i].ravel(), minlength=count.shape[1])).all(), i
    finally:
        h.shutdown()
