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
import torch

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


@pytest.fixture(autouse=True)
def profiler_root(tmp_path, monkeypatch):
    """Every test's SGLANG_TORCH_PROFILER_DIR (read by the request's check and again at write time)."""
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path))


def _start(h: SchedulerHarness, tmp_path, **body) -> ProfileReq:
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

        # By stage, 3 of each: three short requests one after the other (prefill, 3 decodes each), so
        # each stage's trace spans the other stage's batches, which do not count (they cut it before).
        written = []
        write = h.sched.profiler._write
        h.sched.profiler._write = lambda: (written.append((h.sched.profiler.stage, h.sched.profiler.steps)), write())[1]
        _start(h, tmp_path, profile_id="st", profile_by_stage=True, num_steps=3, with_stack=False)
        for seed in (5, 6, 7):
            h.generate(token_ids(16, seed=seed), max_new_tokens=4)
        assert written == [("EXTEND", 3), ("DECODE", 3)] and not h.sched.profiler.active, written
        names = sorted(os.listdir(tmp_path))
        assert "st-TP-0-EXTEND.trace.json.gz" in names and "st-TP-0-DECODE.trace.json.gz" in names, names
    finally:
        h.shutdown()


def test_a_profile_nobody_stops_ends_at_the_step_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_PROFILE_MAX_STEPS", "2")
    h = SchedulerHarness(disable_overlap_schedule=True)
    try:
        h.sched.profiler = None
        _start(h, tmp_path, profile_id="bound", with_stack=False)
        written = []
        write = h.sched.profiler._write
        h.sched.profiler._write = lambda: (written.append(h.sched.profiler.steps), write())[1]
        h.generate(token_ids(16, seed=7), max_new_tokens=6)
        assert written == [2] and (tmp_path / "bound-TP-0.trace.json.gz").exists() and not h.sched.profiler.active
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
        ({"profile_by_stage": True, "num_steps": 2, "profile_stages": [["decode"]]}, "profile_stages"),
        ({"merge_profiles": True, "__ranks": 2}, "merge_profiles"),
        ({"num_step": 3}, "num_step"),
    ],
)
def test_a_bad_body_is_refused_naming_its_field(body, field):
    ranks = body.pop("__ranks", 1)
    with pytest.raises(RequestError) as e:
        parse_profile_request(body, cuda=False, ranks=ranks)
    assert e.value.param == field, e.value.message


def test_the_defaults_and_a_folder_inside_the_root(tmp_path):
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


def _linear_ops(path) -> int:
    return sum(e["name"] == "aten::linear" for e in _ops(str(path)))


def test_num_steps_traces_whole_batches_on_the_forward_thread_and_an_idle_server_writes_it(tmp_path, monkeypatch):
    """num_steps 2: the trace holds two whole batches whichever thread runs them (the stop waits for
    the batch in flight: on the forward thread it was cut, 18-22 linear ops where inline has 36); and
    a profile whose last batch ran is written when the server goes idle, not at the next batch."""
    counts = {}
    for mode in ("inline", "forward-thread"):
        if mode == "forward-thread":
            monkeypatch.setenv("SGLANG_CPU_FORWARD_THREAD", "1")
        h = SchedulerHarness()
        try:
            _start(h, tmp_path, profile_id=mode, num_steps=2, with_stack=False)
            h.generate(token_ids(16, seed=8), max_new_tokens=6)
            counts[mode] = _linear_ops(tmp_path / f"{mode}-TP-0.trace.json.gz")
            _start(h, tmp_path, profile_id=f"{mode}-idle", num_steps=3, with_stack=False)
            h.generate(token_ids(16, seed=9), max_new_tokens=3)  # (3 batches, then idle)
            assert (tmp_path / f"{mode}-idle-TP-0.trace.json.gz").exists() and not h.sched.profiler.active
        finally:
            h.shutdown()
    assert counts["inline"] > 0 and counts["forward-thread"] == counts["inline"], counts


def test_a_failed_write_stops_the_profiler_and_the_next_profile_works(tmp_path):
    """An output_dir that names a file: the stop says why nothing was written, torch's profiler is
    off (it is stopped before anything is written, so no failure after leaves it tracing), and the
    next profile works."""
    import torch

    h = SchedulerHarness(disable_overlap_schedule=True)
    try:
        (tmp_path / "afile").write_text("x")
        _start(h, tmp_path, output_dir="afile", profile_id="f", with_stack=False)
        h.generate(token_ids(16, seed=10), max_new_tokens=2)
        stop = h.control_reply(ProfileReq(type="stop"))
        assert not stop.success and "not written" in stop.message and not torch._C._autograd._profiler_enabled()
        _start(h, tmp_path, profile_id="g", with_stack=False)
        h.generate(token_ids(16, seed=11), max_new_tokens=2)
        assert h.control_reply(ProfileReq(type="stop")).success and (tmp_path / "g-TP-0.trace.json.gz").exists()
    finally:
        h.shutdown()


def test_a_symlink_never_takes_a_trace_outside_the_root(tmp_path):
    """A trace's name that is a symlink to a file outside is replaced, not written through; a folder
    swapped for a symlink to outside after the start is refused at the write."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (outside / "victim.txt").write_text("keep")
    (root / "x-TP-0.trace.json.gz").symlink_to(outside / "victim.txt")
    os.environ["SGLANG_TORCH_PROFILER_DIR"] = str(root)  # (monkeypatch restores it after the test)
    h = SchedulerHarness(disable_overlap_schedule=True)
    try:
        _start(h, root, profile_id="x", with_stack=False)
        h.generate(token_ids(16, seed=12), max_new_tokens=2)
        assert h.control_reply(ProfileReq(type="stop")).success
        trace = root / "x-TP-0.trace.json.gz"
        assert (outside / "victim.txt").read_text() == "keep" and not trace.is_symlink() and _ops(str(trace))
        (root / "run").mkdir()
        _start(h, root, output_dir="run", profile_id="y", with_stack=False)
        (root / "run").rmdir()
        (root / "run").symlink_to(outside)
        h.generate(token_ids(16, seed=13), max_new_tokens=2)
        stop = h.control_reply(ProfileReq(type="stop"))
        assert not stop.success and "outside" in stop.message and sorted(os.listdir(outside)) == ["victim.txt"]
    finally:
        h.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_trace_has_the_kernels_and_the_memory_snapshot(tmp_path):
    """On CUDA: activities CPU, GPU, MEM and CUDA_PROFILER over decode steps that replay CUDA graphs: the
    trace holds the GPU's kernels (CUPTI sees a graph's too), MEM writes its snapshot beside it, and the
    CUDA profiler range opens and closes without error."""
    h = SchedulerHarness(device="cuda")
    assert h.sched.model_runner.graph_runner is not None
    try:
        req = parse_profile_request(
            {"num_steps": 4, "with_stack": False, "profile_id": "gpu", "activities": ["CPU", "GPU", "MEM", "CUDA_PROFILER"]},
            cuda=True, ranks=1,
        )  # fmt: skip
        assert h.control_reply(req).success
        h.generate(token_ids(24, seed=14), max_new_tokens=8)
        events = _events(str(tmp_path / "gpu-TP-0.trace.json.gz"))
        assert any(e.get("cat") == "kernel" for e in events), {e.get("cat") for e in events}
        assert (tmp_path / "gpu-TP-0-memory.pickle").stat().st_size > 0 and not h.sched.profiler.active
    finally:
        h.shutdown()


def test_each_stage_trace_has_its_own_bound_and_files_get_the_usual_mode(tmp_path, monkeypatch):
    """By stage at SGLANG_PROFILE_MAX_STEPS 6, num_steps 2: the EXTEND trace spans two prompts' prefills
    and the decodes between (6 batches), and the DECODE trace then still runs its 2 decode batches (the
    bound had counted the EXTEND trace's batches too: DECODE was written after 1). Traces have the mode a
    plain open gives (they were renamed into place from mkstemp's 0600)."""
    monkeypatch.setenv("SGLANG_PROFILE_MAX_STEPS", "6")
    h = SchedulerHarness(disable_overlap_schedule=True)
    try:
        h.sched.profiler = None
        _start(h, tmp_path, profile_id="b", profile_by_stage=True, num_steps=2, with_stack=False)
        written = []
        write = h.sched.profiler._write
        h.sched.profiler._write = lambda: (written.append((h.sched.profiler.stage, h.sched.profiler.steps)), write())[1]
        for seed in (20, 21):
            h.generate(token_ids(16, seed=seed), max_new_tokens=5)
        assert written == [("EXTEND", 2), ("DECODE", 2)], written
        umask = os.umask(0o022)
        os.umask(umask)
        assert (tmp_path / "b-TP-0-DECODE.trace.json.gz").stat().st_mode & 0o777 == 0o666 & ~umask
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".partial-")]
    finally:
        h.shutdown()
