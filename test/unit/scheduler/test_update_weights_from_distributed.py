"""The scheduler's side of upstream's weight-update groups (`WeightsUpdateGroups`): it joins a trainer's
gloo group on a thread (the trainer, rank 0, in a process of its own), receives the broadcast weights
on a thread while the loop goes on, and writes them in place between two steps; outputs then match the
new checkpoint's oracle and the prefix cache is emptied. Operations that cannot work are refused with
why, and leaving the group frees its name."""

from __future__ import annotations

from datetime import timedelta

from sglang.srt.managers.io_struct import (
    DestroyWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightsFromDistributedReqInput,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import noisy_checkpoint, served_tensors
from sglang.test.reference import ReferenceModel
from sglang.test.scheduler_harness import SchedulerHarness, token_ids
from sglang.test.test_utils import find_free_port
from sglang.test.weight_broadcaster import Broadcaster

register_cpu_ci(est_time=15, suite="per-commit-cpu")

QWEN = "tiny-qwen3-next"


def test_weights_broadcast_by_a_trainer_are_served(oracles, preset_paths, tmp_path):
    path_b = noisy_checkpoint(preset_paths[QWEN], tmp_path / "b")
    tensors = served_tensors(path_b)  # (not the MTP layer's, which a server without NEXTN does not load)
    names = sorted(tensors)
    h = SchedulerHarness(QWEN)
    prompt = token_ids(80, seed=3)
    h.check_oracle(oracles[QWEN], prompt, h.generate(prompt, 6))

    port = find_free_port()
    init = InitWeightsUpdateGroupReqInput("127.0.0.1", port, 1, 2, backend="nccl")
    assert "backend gloo" in h.control_reply(init).message  # no GPU here
    trainer = Broadcaster(port)
    try:
        init.backend = "gloo"
        reply = h.control_reply(init)
        assert reply.success, reply.message
        assert trainer.wait() == "joined"
        assert "exists already" in h.control_reply(init).message
        unknown = UpdateWeightsFromDistributedReqInput(["model.norm.weight"], ["float32"], [[16]], "x")
        assert "no weight-update group 'x'" in h.control_reply(unknown).message

        # Two updates (buckets), each while the trainer broadcasts; the loop runs meanwhile.
        for part in (names[::2], names[1::2]):
            named = [(n, tensors[n]) for n in part]
            trainer.broadcast(named)
            dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
            req = UpdateWeightsFromDistributedReqInput(part, dtypes, [list(t.shape) for _, t in named])
            reply = h.control_reply(req)
            message = f"Succeeded to update {len(part)} weight tensor(s) in place."
            assert (reply.success, reply.message) == (True, message)
            assert trainer.wait() == "sent"
        out = h.generate(prompt, 6)
        assert out.cached_tokens == 0
        h.check_oracle(ReferenceModel(path_b), prompt, out)

        # A tensor that does not fit: received (the trainer is not left hanging), then refused whole.
        trainer.broadcast([("model.norm.weight", tensors["model.layers.0.input_layernorm.weight"][:3])])
        bad = UpdateWeightsFromDistributedReqInput(["model.norm.weight"], ["float32"], [[3]])
        reply = h.control_reply(bad)
        assert not reply.success and "has shape (3,)" in reply.message
        assert trainer.wait() == "sent"
        h.check_oracle(ReferenceModel(path_b), prompt, h.generate(prompt, 6))

        leave = DestroyWeightsUpdateGroupReqInput()
        assert h.control_reply(leave).success
        assert "no weight-update group" in h.control_reply(leave).message
    finally:
        trainer.close()
        for group in list(h.sched.weights_groups.groups):
            h.sched.weights_groups.destroy(group)
    h.shutdown()


def test_a_trainer_that_never_comes_fails_the_join():
    """The rendezvous waits for the trainer up to the group's timeout, then the join fails with why,
    and the name stays free."""
    h = SchedulerHarness(QWEN)
    groups = h.sched.weights_groups
    groups.timeout = timedelta(seconds=2)
    reply = h.control_reply(InitWeightsUpdateGroupReqInput("127.0.0.1", find_free_port(), 1, 2, backend="gloo"))
    assert not reply.success and reply.message.startswith("The weight-update group was not joined:")
    assert groups.groups == {} and groups.pending is None
    h.shutdown()


def test_a_group_layout_the_ranks_cannot_join_is_refused_alike_on_every_rank():
    """Review finding 3 of issue 54: every TP rank joins as rank_offset + its TP rank, so world_size must
    be at least rank_offset + --tp-size; before, at world size 2 and TP 2 rank 1's join failed at once
    while rank 0 and the trainer formed the group (the trainer's next broadcast then waited for ever).
    The check reads only the request and the flags: each rank refuses in the same words and starts
    nothing. With --dp-size 2 every replica's ranks would take the same ranks: refused, as upstream does
    (without DP attention)."""
    from sglang.srt.managers.scheduler_components.weights_update_group import WeightsUpdateGroups

    def refusals(req, tp_size, dp_size=1):
        out = []
        for tp_rank in range(tp_size):
            groups = WeightsUpdateGroups("cpu")
            out.append(groups.start_init(req, tp_rank, tp_size, dp_size))
            assert groups.pending is None  # (no join started on any rank)
        return out

    small = refusals(InitWeightsUpdateGroupReqInput("127.0.0.1", 1, 1, 2, backend="gloo"), tp_size=2)
    assert small == [small[0]] * 2 and small[0].startswith("world_size 2 is too small")
    assert "at least rank_offset + --tp-size (3)" in small[0]
    offset = refusals(InitWeightsUpdateGroupReqInput("127.0.0.1", 1, 2, 4, backend="gloo"), tp_size=4)
    assert offset == [offset[0]] * 4 and "rank_offset (2) to 5" in offset[0]
    dp = refusals(InitWeightsUpdateGroupReqInput("127.0.0.1", 1, 1, 5, backend="gloo"), 2, dp_size=2)
    assert dp == [dp[0]] * 2 and dp[0].startswith("A weight-update group needs --dp-size 1")
