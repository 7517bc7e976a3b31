"""Upstream's /start_profile and /stop_profile on the scheduler (`scheduler_profiler.py`) and their
checked body (`profile_request.py`): a profile traces the batches it was asked for, on every thread
(the overlap schedule's forward thread too), into a Chrome trace named as upstream names it; it stops
itself after num_steps (and at SGLANG_PROFILE_MAX_STEPS); by stage it writes a prefill and a decode
trace; a body that asks for a folder outside SGLANG_TORCH_PROFILER_DIR, an unknown activity, a file name
with a separator, or too many steps is refused naming the field. The HTTP routes and the Engine:
test/registered/openai_server/test_profile_routes.py."""

from __future__ import annotations

import gzip
import json
import os
import threading

import pytest

from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import ProfileReq
from sglang.srt.managers.profile_request import parse_profile_request
from sglang.srt.managers.request_validation import RequestError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=8, suite="per-commit-cpu")


def _events(path: str) -> list[dict]:
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


def _ops(path: str) -> list[dict]:
    return [e for e in _events(path) if e.get("ph") == "X" and e.get("cat") == "cpu_op"]


@pytest.fixture(params=["inline", "forward-thread"])
def harness(request, monkeypatch):
    """The CPU's default (the forward on the scheduler thread) and the GPU's (on a forward thread)."""
    if request.param == "forward-thread":
        monkeypatch.setenv("SGLANG_CPU_FORWARD_THREAD", "1")
    h = SchedulerHarness()
    assert h.sched.worker.inline == (request.param == "inline")
    yield h
    h.shutdown()


def _start(h: SchedulerHarness, tmp_path, **body) -> ProfileReq:
    with envs.SGLANG_TORCH_PROFILER_DIR.override(str(tmp_path)):
        req = parse_profile_request(body, cuda=False, ranks=1)
    reply = h.control_reply(req)
    assert reply.success, reply.message
    return req


def test_a_profile_traces_the_steps_asked_and_writes_upstreams_file(harness, tmp_path):
    """num_steps 3 with_stack off: the trace holds the model's ops, on the thread that ran them (the
    forward thread too: a profiler traces its own thread only unless told), and is written when the
    fourth batch comes, without /stop_profile; a stop then says nothing runs."""
    h = harness
    req = _start(h, tmp_path, num_steps=3, with_stack=False, profile_prefix="run1", profile_id="abc")
    h.generate(token_ids(40, seed=1), max_new_tokens=8)
    path = tmp_path / "run1-abc-TP-0.trace.json.gz"
    assert path.exists(), os.listdir(tmp_path)
    model = {e["tid"] for e in _ops(str(path)) if e["name"].startswith("sgl_kernel::") or e["name"] == "aten::linear"}
    here = threading.get_native_id()
    assert model == {here} if h.sched.worker.inline else model and here not in model, (model, here)
    assert not h.sched.profiler.active and req.num_steps == 3
    stop = h.control_reply(ProfileReq(type="stop"))
    assert not stop.success and "not in progress" in stop.message


def test_stop_writes_what_ran_and_a_second_start_meanwhile_is_refused(harness, tmp_path):
    h = harness
    _start(h, tmp_path, profile_id="p", with_stack=False)
    again = h.control_reply(ProfileReq(output_dir=str(tmp_path), profile_id="q"))
    assert not again.success and "already in progress" in again.message
    h.generate(token_ids(24, seed=2), max_new_tokens=4)
    stop = h.control_reply(ProfileReq(type="stop"))
    assert stop.success and "p-TP-0.trace.json.gz" in stop.message, stop.message
    assert _ops(str(tmp_path / "p-TP-0.trace.json.gz"))
    assert not (tmp_path / "q-TP-0.trace.json.gz").exists()


def test_start_step_waits_for_its_batch_and_by_stage_writes_a_trace_per_stage(tmp_path):
    h = SchedulerHarness(disable_overlap_schedule=True)
    try:
        first = h.sched.num_batches
        _start(h, tmp_path, profile_id="later", start_step=first + 3, num_steps=2, with_stack=False)
        h.generate(token_ids(16, seed=3), max_new_tokens=1)  # (one batch: before the start)
        assert h.sched.profiler.active and not h.sched.profiler.started
        h.generate(token_ids(16, seed=4), max_new_tokens=8)
        assert (tmp_path / "later-TP-0.trace.json.gz").exists() and not h.sched.profiler.active

        _start(h, tmp_path, profile_id="st", profile_by_stage=True, num_steps=2, with_stack=False)
        h.generate(token_ids(16, seed=5), max_new_tokens=6)
        h.generate(token_ids(16, seed=6), max_new_tokens=1)  # (a prefill after: the profile finishes)
        names = sorted(os.listdir(tmp_path))
        assert "st-TP-0-EXTEND.trace.json.gz" in names and "st-TP-0-DECODE.trace.json.gz" in names, names
        assert not h.sched.profiler.active
    finally:
        h.shutdown()


def test_a_profile_nobody_stops_ends_at_the_step_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_PROFILE_MAX_STEPS", "2")
    h = SchedulerHarness(disable_overlap_schedule=True)
    try:
        h.sched.profiler = None
        _start(h, tmp_path, profile_id="bound", with_stack=False)
        h.generate(token_ids(16, seed=7), max_new_tokens=6)
        assert (tmp_path / "bound-TP-0.trace.json.gz").exists() and not h.sched.profiler.active
    finally:
        h.shutdown()


@pytest.mark.parametrize(
    "body, field",
    [
        ({"output_dir": "/etc"}, "output_dir"),
        ({"output_dir": "../escape"}, "output_dir"),
        ({"output_dir": 5}, "output_dir"),
        ({"profile_prefix": "a/b"}, "profile_prefix"),
        ({"profile_id": ".."}, "profile_id"),
        ({"num_steps": 0}, "num_steps"),
        ({"num_steps": 2_001}, "num_steps"),
        ({"num_steps": True}, "num_steps"),
        ({"start_step": -1}, "start_step"),
        ({"activities": ["CPU", "RPD"]}, "activities"),
        ({"activities": ["MEM"]}, "activities"),
        ({"activities": []}, "activities"),
        ({"with_stack": "yes"}, "with_stack"),
        ({"profile_by_stage": True}, "num_steps"),
        ({"profile_stages": ["decode"]}, "profile_stages"),
        ({"merge_profiles": True, "__ranks": 2}, "merge_profiles"),
        ({"num_step": 3}, "num_step"),
    ],
)
def test_a_bad_body_is_refused_naming_its_field(tmp_path, monkeypatch, body, field):
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path))
    ranks = body.pop("__ranks", 1)
    with pytest.raises(RequestError) as e:
        parse_profile_request(body, cuda=False, ranks=ranks)
    assert e.value.param == field, e.value.message


def test_the_defaults_and_a_folder_inside_the_root(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path))
    req = parse_profile_request(None, cuda=False, ranks=1)
    assert req.output_dir == os.path.realpath(tmp_path) and req.activities == ("CPU", "GPU")
    assert req.with_stack and not req.record_shapes and req.num_steps is None and req.profile_id
    inside = parse_profile_request({"output_dir": "runs/a", "merge_profiles": True}, cuda=False, ranks=1)
    assert inside.output_dir == os.path.join(os.path.realpath(tmp_path), "runs", "a")
    staged = parse_profile_request({"profile_by_stage": True, "num_steps": 2, "profile_stages": ["decode"]},
                                   cuda=False, ranks=1)  # fmt: skip
    assert staged.stages == ("DECODE",)
    assert parse_profile_request({"activities": ["MEM", "CUDA_PROFILER"]}, cuda=True, ranks=1).activities == (
        "MEM", "CUDA_PROFILER",
    )  # fmt: skip
