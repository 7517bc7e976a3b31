"""The launcher's warm children (`entrypoints/prestart.py`): spawned before the flags are checked, as many
of each kind as the command line's parallel flags say; each runs the entry it is given with the ready
pipe it got at its spawn; one that died is replaced by a fresh spawn; the unused ones are stopped. A
refused launch leaves none behind: test_launch_server.py."""

from __future__ import annotations

import pytest

from sglang.srt.entrypoints import prestart
from sglang.test import fake_scheduler
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")


@pytest.mark.parametrize(
    "argv, want",
    [
        ([], {"scheduler": 1, "other": 1}),
        (["--tp", "4"], {"scheduler": 4, "other": 1}),
        (["--tp-size", "2", "--dp-size", "2"], {"scheduler": 4, "other": 2}),  # (and the DP controller)
        (["--tp", "4", "--nnodes", "2", "--node-rank", "1"], {"scheduler": 2, "other": 0}),
        (["--tp", "x"], {"scheduler": 1, "other": 1}),  # (the real parser refuses it)
    ],
)
def test_the_warm_children_are_the_starts_children(argv, want):
    assert prestart.children_for(argv) == want


def test_a_warm_child_runs_what_it_is_given_and_the_rest_are_stopped():
    prestart.prestart(["--tp", "2"])
    try:
        assert sorted(w.kind for w in prestart._pool) == ["other", "scheduler", "scheduler"]
        warm = prestart.take("scheduler tp1")
        assert warm.kind == "scheduler"
        proc, reader = warm.assign(
            "scheduler tp1", fake_scheduler.run_failing_scheduler_process, (None, None)
        )
        assert proc.name == "sglang-scheduler tp1"
        # The entry ran in the warm child, its message on the ready pipe the child got at its spawn.
        assert reader.poll(120), "the warm child never ran its entry"
        assert reader.recv() == {"status": "error", "message": "the fake model cannot be loaded (test)."}
        proc.join(30)
        assert proc.exitcode == 0
        # A warm child that died before its turn: the launcher is told to spawn one (None), it is reaped.
        other = prestart.take("detokenizer")
        other.proc.kill()
        other.proc.join(10)
        assert other.assign("detokenizer", fake_scheduler.run_failing_scheduler_process, (None, None)) is None
        left = list(prestart._pool)
        assert [w.kind for w in left] == ["scheduler"]
        prestart.release()
        assert not prestart._pool and not any(w.proc.is_alive() for w in left)
        assert prestart.take("scheduler") is None  # (then the launcher spawns)
    finally:
        prestart.release()


def test_the_launcher_runs_its_children_in_the_warm_ones_and_spawns_for_a_dead_one():
    """`start_subprocesses` hands the detokenizer to its warm child (the same process) and, the
    scheduler's warm child having died, spawns a scheduler as before; the start serves, nothing is
    left in the pool."""
    import sglang

    prestart.prestart([])
    try:
        warm = {w.kind: w for w in prestart._pool}
        assert set(warm) == {"scheduler", "other"}
        warm["scheduler"].proc.kill()
        warm["scheduler"].proc.join(10)
        eng = sglang.Engine(
            scheduler_entry=fake_scheduler.run_scheduler_process, model_path="tiny-qwen3-next"
        )
        try:
            pids = {p.name: p.pid for p in eng._launched.processes}
            assert pids["sglang-detokenizer"] == warm["other"].proc.pid
            assert pids["sglang-scheduler"] not in (warm["scheduler"].proc.pid, warm["other"].proc.pid)
            out = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "temperature": 0})
            assert len(out["output_ids"]) == 3 and out["text"]  # (the warm detokenizer turned ids to text)
        finally:
            eng.shutdown()
        assert prestart._pool == []
    finally:
        prestart.release()


def test_help_and_the_switch_start_none(monkeypatch):
    prestart.prestart(["--help"])
    monkeypatch.setenv("SGLANG_PRESTART_CHILDREN", "0")
    prestart.prestart([])
    assert prestart._pool == []
