"""The scheduler's side of tensor parallelism, where the ranks' outcomes may differ (review findings 1-3,
8, 10 of issue 54's TP work):

- two gloo ranks agree on an outcome (`TpBroadcast.agree_outcome`: None where every rank succeeded, else
  the failing rank's reason naming it; a custom logit processor that loads on one rank only is refused
  on both), and --dist-timeout bounds the model groups' collectives (a rank
  left alone in an all-reduce fails after the timeout, not after torch's 30 minutes);
- with a stand-in for the other rank's vote: a tensor update copies nothing when another rank failed,
  a disk update keeps the old model, a memory release / resume is taken back on this rank;
- each rank reads its own payload (one per TP rank, as upstream), and another count is refused in one
  sentence;
- /get_weights_by_name finishes the batches in flight before its gather, refuses too many values before
  any collective, and gathers only the rows asked for where rows are not split;
- the ranks take one sampled token per row where a grammar acts (rank 0's differing from rank 1's
  would stop them in step), and the strict check (the test suite) names a row where they differ;
- nodes whose environments differ in a variable the ranks decide by (`environ.SAME_ON_EVERY_TP_RANK`)
  are refused at start, naming it (a secret without its values)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang.srt.managers.io_struct import (
    GetWeightsByNameReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
)
from sglang.srt.managers.scheduler_components.scheduler_update_weights_mixin import (
    SchedulerUpdateWeightsMixin,
)
from sglang.srt.managers.scheduler_components.weight_update import RankVote, payload_of_rank
from sglang.test.ci_register import register_cpu_ci
from sglang.test.multi_rank import run_ranks
from sglang.test.tp_runtime_checks import AWAY_S, GROUP_TIMEOUT_S, runtime_checks

register_cpu_ci(est_time=15, suite="per-commit-cpu")

OTHER_RANK = "The weights were not updated: out of memory (on TP rank 1; every rank keeps what it had)"


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(runtime_checks, 2)  # (one spawn of two ranks for the two tests below)


def test_two_ranks_agree_and_the_model_groups_time_out(ranks):
    r0, r1 = ranks
    for r in (r0, r1):
        assert r["none"] is None
        assert r["one"] == "disk full (on TP rank 1; every rank keeps what it had)"
        assert r["all"] == "bad name"  # (every rank failed alike: the reason as one rank gives it)
        # A custom logit processor that loads on rank 0 only is refused on both (rank 0 alone would run
        # the request rank 1 refused, and their batches would differ); one that loads on both runs.
        (loaded, error), (loaded_ok, no_error) = r["processor"]
        assert not loaded and error.startswith("custom_logit_processor must be the JSON")
        assert error.endswith("(on TP rank 1; the request is refused on every rank)")
        assert loaded_ok and no_error is None
    # gloo raises once the group's timeout has passed; rank 1 only comes back after AWAY_S.
    assert r0["failed_after_s"] is not None and GROUP_TIMEOUT_S * 0.5 < r0["failed_after_s"] < AWAY_S - 0.5


def test_the_ranks_agree_on_the_sampled_tokens(ranks):
    tokens = [r["tokens"] for r in ranks]
    assert [t["plain"] for t in tokens] == [[5, 7], [5, 8]]  # (no grammar: each rank's own, no collective)
    for t in tokens:
        assert t["grammar"] == [5, 7]
        assert t["strict"] == "The TP ranks sampled different tokens in row 1: 7 and 8."


def test_nodes_with_another_decision_variable_are_refused(ranks):
    same, budget, secret = ranks[0]["env"]
    assert same is None  # (the same environment, and --node-rank is each node's own)
    # Rank 1's per-step output check budget (0.1 s) would end other requests there than on rank 0 (0.2 s),
    # and the ranks' next all-reduce would hang: both ranks refuse, naming it and both values.
    assert budget == (
        "SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP is 0.1 on TP rank 1 but 0.2 on TP rank 0; start every node "
        "with the same value (the ranks decide by it alike)."
    )
    assert secret.startswith("SGLANG_LOGIT_PROCESSOR_SECRET differs between TP rank 1 and TP rank 0")
    assert "s3cret" not in secret
    assert ranks[1]["env"] == ranks[0]["env"]  # (every rank refuses alike)


class _Memory:
    def __init__(self):
        self.released: set[str] = set()

    def release(self, tags):
        self.released |= set(tags)

    def resume(self, tags):
        self.released -= set(tags)


class _Runner:
    def __init__(self):
        self.memory_occupation = _Memory()
        self.copied = None
        self.swapped = None

    def update_weights_from_tensor(self, named, load_format, before_copy):
        before_copy()
        self.copied = named
        return []

    def swap_model(self, model):
        self.swapped = model


class _Scheduler(SchedulerUpdateWeightsMixin):
    """Rank 0 of two, the other rank's outcome `other` (None: it succeeded)."""

    def __init__(self, other: str | None):
        self.tp = SimpleNamespace(
            rank=SimpleNamespace(tp_rank=0, tp_size=2), agree_outcome=lambda mine: mine or other
        )
        self.dp_rank = None
        self.in_flight, self.running, self.waiting_queue = [], [], []
        self.chunked_req, self.disagg = None, None
        self.server_args = SimpleNamespace(enable_memory_saver=True)
        self.generation_pause = SimpleNamespace(paused=False)
        self.model_runner = _Runner()
        self.tree_cache = SimpleNamespace(weights_changed=lambda: None)  # (no disk tier: `_weights_changed`)
        self.sent, self.emptied = [], 0

    def send_to_tokenizer(self, out):
        self.sent.append(out)

    def _empty_tree(self):
        self.emptied += 1


def test_a_tensor_update_copies_nothing_where_another_rank_failed():
    sched = _Scheduler(OTHER_RANK)
    named = [("w", torch.ones(2))]
    assert sched.write_weights(named, "direct", True, RankVote(sched._agree)) == (False, OTHER_RANK)
    assert sched.model_runner.copied is None and sched.emptied == 0
    ok = _Scheduler(None)
    assert ok.write_weights(named, "direct", True, RankVote(ok._agree))[0]
    assert ok.model_runner.copied == named and ok.emptied == 1
    # A write that copied nothing (no tensor for this rank's model) still votes, once: no rank waits alone.
    quiet = _Scheduler(OTHER_RANK)
    quiet.model_runner.update_weights_from_tensor = lambda named, load_format, before_copy: []
    assert quiet.write_weights(named, "direct", True, RankVote(quiet._agree)) == (False, OTHER_RANK)
    assert quiet.emptied == 0


def test_a_disk_update_keeps_the_old_model_where_another_rank_failed():
    sched = _Scheduler("The weights at /x cannot be served: no such file.")
    req = UpdateWeightFromDiskReqInput(model_path="/x")
    sched.weight_update = SimpleNamespace(poll=lambda: (req, "new model", ""))
    sched.finish_weight_update()
    assert sched.model_runner.swapped is None and sched.emptied == 0
    assert not sched.sent[0].success and "no such file" in sched.sent[0].message


def test_memory_release_and_resume_are_taken_back_where_another_rank_failed():
    sched = _Scheduler("Releasing stopped: no host memory (released now: nothing).")
    sched.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=["weights"]))
    assert sched.model_runner.memory_occupation.released == set()  # (as on the rank that failed)
    assert not sched.sent[-1].success
    sched = _Scheduler("Not resumed: out of memory")
    sched.model_runner.memory_occupation.released = {"weights", "kv_cache"}
    sched.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=["weights"]))
    assert sched.model_runner.memory_occupation.released == {"weights", "kv_cache"}
    assert not sched.sent[-1].success


def test_each_rank_reads_its_own_payload():
    assert payload_of_rank(["a", "b"], 1, 2, None, True) == "b"
    assert payload_of_rank(["a", "b", "c", "d"], 1, 2, 1, True) == "d"  # (replica 1's rank 1)
    assert payload_of_rank(["a"], 1, 2, None, False) == "a"  # (plain bytes from HTTP: any rank reads them)
    with pytest.raises(ValueError, match=r"has 1 payload\(s\); with --tp-size 2 give one per TP rank"):
        payload_of_rank(["a"], 1, 2, None, True)  # (handles open once: rank 0's would be spent)


def test_get_weights_by_name_finishes_the_batches_in_flight_first():
    sched = _Scheduler(None)
    sched.in_flight = [1, 2]
    sched.process_oldest = lambda: sched.in_flight.pop(0)

    def get(name, truncate_size):
        assert not sched.in_flight, "gathered with a forward in flight"
        return [[1.0]]

    sched.model_runner.get_weights_by_name = get
    sched.get_weights_by_name(GetWeightsByNameReqInput(name="w", truncate_size=1))
    assert sched.sent[-1].parameter == [[1.0]]


def test_get_weights_by_name_checks_the_size_before_the_gather(monkeypatch):
    from sglang.srt.model_executor import model_runner as mr

    gathered = []
    monkeypatch.setattr(mr, "gather_weight", lambda param, local: gathered.append(local.shape) or local)
    model = nn.Linear(8, 6)
    runner = SimpleNamespace(model=model, memory_occupation=_Memory())
    runner.served_parameters = lambda: dict(model.named_parameters())  # (no draft layer)
    assert len(mr.ModelRunner.get_weights_by_name(runner, "weight", 2)) == 2
    assert gathered == [torch.Size([2, 8])]  # (rows not split: only those asked for)
    monkeypatch.setattr(mr, "MAX_WEIGHT_VALUES", 10)
    with pytest.raises(ValueError, match="at most 10 per call"):
        mr.ModelRunner.get_weights_by_name(runner, "weight", 2)
    assert len(gathered) == 1  # (refused before any collective, as on every rank)
