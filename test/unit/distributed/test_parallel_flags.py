"""The parallelism flags (issue 54) at upstream's names, their one-sentence refusals, the layout of
scheduler processes they ask for, and the data-parallel controller's balancing and reply merging. All
in process (no rank is started here: test_tp_server.py runs them)."""

from __future__ import annotations

import os

import pytest

from sglang.srt.entrypoints.parallel_layout import plan_schedulers
from sglang.srt.managers.data_parallel_controller import (
    DataParallelController,
    LoadBalancer,
    ReplicaLoad,
    merge_replies,
)
from sglang.srt.managers.io_struct import (
    BatchTokenizedGenerateReqInput,
    FlushCacheReqOutput,
    GetInternalStateReqOutput,
    PortArgs,
    TokenizedGenerateReqInput,
)
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, ServerArgsError, prepare_server_args
from sglang.srt.utils.process import available_cores
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

PRESET = ["--model-path", "tiny-qwen3-next"]


def test_upstream_spellings_set_the_fields():
    args = prepare_server_args(
        ["--tp", "4", "--ep", "2", "--nnodes", "2", "--node-rank", "1", "--nccl-init-addr", "10.0.0.1:5000",
         "--dist-timeout", "60", "--load-balance-method", "shortest_queue", *PRESET]
    )  # fmt: skip
    assert (args.tp_size, args.ep_size, args.nnodes, args.node_rank) == (4, 2, 2, 1)
    assert (args.dist_init_addr, args.dist_timeout, args.tp_size_per_node) == ("10.0.0.1:5000", 60, 2)
    assert args.load_balance_method == "shortest_queue"
    args = prepare_server_args(
        ["--tensor-parallel-size", "2", "--expert-parallel-size", "2", "--dp", "3", *PRESET]
    )
    assert (args.tp_size, args.ep_size, args.dp_size) == (2, 2, 3)
    defaults = ServerArgs(model_path="tiny-qwen3-next")
    assert (defaults.tp_size, defaults.ep_size, defaults.dp_size, defaults.nnodes, defaults.node_rank) == (
        1, 1, 1, 1, 0,
    )  # fmt: skip
    assert (defaults.load_balance_method, defaults.dist_init_addr, defaults.dist_timeout) == (
        "round_robin", None, None,
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv, sentence",
    [
        (["--tp-size", "0"], "--tp-size must be a positive integer, got 0."),
        (["--dp-size", "0"], "--dp-size must be a positive integer, got 0."),
        (["--tp-size", "2", "--ep-size", "4"], "--ep-size 4 must divide --tp-size 2."),
        (["--nnodes", "2", "--tp-size", "2"], "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        (["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "h:1"], "--tp-size 3 must be a multiple of --nnodes 2"),
        (["--nnodes", "2", "--node-rank", "2", "--tp-size", "2", "--dist-init-addr", "h:1"],
         "--node-rank 2 must be between 0 and --nnodes - 1 (1)."),
        (["--dist-init-addr", "nohost"], "--dist-init-addr 'nohost' must be HOST:PORT"),
        (["--dist-init-addr", "h:70000"], "--dist-init-addr 'h:70000' must be HOST:PORT"),
        (["--dist-timeout", "0"], "--dist-timeout must be a positive integer, got 0."),
        (["--enable-dp-attention"], "--enable-dp-attention is not supported by this server: data-parallel attention is not built"),
        (["--load-balance-method", "minimum_tokens"], "--load-balance-method minimum_tokens is not supported by this server"),
        (["--load-balance-method", "nope"], "--load-balance-method must be one of round_robin, shortest_queue, auto"),
        (["--dp-size", "2", "--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "h:1"], "--dp-size with --nnodes"),
        (["--dp-size", "2", "--disaggregation-mode", "prefill"], "--dp-size 2 with --disaggregation-mode prefill"),
    ],
)  # fmt: skip
def test_a_bad_combination_is_one_sentence_naming_the_flag(argv, sentence):
    with pytest.raises(ServerArgsError) as e:
        prepare_server_args(argv + PRESET)
    message = str(e.value)
    assert message.startswith(sentence), message
    assert message.endswith(".") and ". " not in message.replace("e.g. ", ""), message


def _ports() -> PortArgs:
    return PortArgs.init_new()


def test_one_rank_is_the_plain_scheduler():
    specs, controller = plan_schedulers(ServerArgs(model_path="tiny-qwen3-next"), _ports())
    assert [(s.name, s.rank) for s in specs] == [("scheduler", None)] and controller is None


def test_node_one_of_two_runs_the_second_half_of_the_ranks():
    args = ServerArgs(
        model_path="tiny-qwen3-next", tp_size=4, nnodes=2, node_rank=1, dist_init_addr="[::1]:6000"
    )
    specs, controller = plan_schedulers(args, _ports())
    assert controller is None
    assert [s.rank.tp_rank for s in specs] == [2, 3] and [s.rank.gpu_id for s in specs] == [0, 1]
    assert {s.rank.init_method for s in specs} == {"tcp://[::1]:6000"}
    assert [s.name for s in specs] == ["scheduler (TP rank 2)", "scheduler (TP rank 3)"]
    assert all(s.rank.backend == "gloo" and s.rank.timeout_s == 300 for s in specs)
    # The node's two ranks share its cores, one core left to the tokenizer and detokenizer.
    assert {s.rank.torch_threads for s in specs} == {max(1, (available_cores() - 1) // 2)}


def test_data_parallel_replicas_each_form_their_own_group_behind_the_controller():
    ports = _ports()
    args = ServerArgs(model_path="tiny-qwen3-next", tp_size=2, dp_size=2, dist_timeout=9)
    specs, controller = plan_schedulers(args, ports)
    assert [(s.rank.dp_rank, s.rank.tp_rank, s.rank.gpu_id) for s in specs] == [
        (0, 0, 0),
        (0, 1, 1),
        (1, 0, 2),
        (1, 1, 3),
    ]
    assert specs[0].rank.init_method == specs[1].rank.init_method != specs[2].rank.init_method
    # Each replica reads its own socket and replies to the controller; outputs go to the one detokenizer.
    assert [s.port_args.scheduler_input_ipc_name for s in specs[::2]] == controller.replica_inputs
    assert {s.port_args.tokenizer_ipc_name for s in specs} == {controller.reply_ipc}
    assert {s.port_args.detokenizer_ipc_name for s in specs} == {ports.detokenizer_ipc_name}
    # The controller's sockets sit in the server's IPC folder, removed with it at shutdown.
    assert {os.path.dirname(n.removeprefix("ipc://")) for n in controller.replica_inputs} == {ports.ipc_dir}
    assert specs[3].name == "scheduler (DP rank 1, TP rank 1)" and specs[0].rank.timeout_s == 9


def test_round_robin_and_shortest_queue():
    rr = LoadBalancer(3, "auto")
    assert [rr.pick() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    sq = LoadBalancer(3, "shortest_queue")
    sq.report(ReplicaLoad(0, 5))
    sq.report(ReplicaLoad(1, 1))
    sq.report(ReplicaLoad(2, 2))
    # Replica 1 (1 request) takes one, then ties with 2 (2 each) and they alternate; 0 waits.
    assert [sq.pick() for _ in range(5)] == [1, 2, 1, 2, 1]
    sq.report(ReplicaLoad(0, 0))
    assert sq.pick() == 0
    # A request that names its replica (a session's turn) goes there whatever the method, and counts
    # there; round robin's order for the others stays as it was.
    assert [rr.pick(), rr.pick(routed=2), rr.pick(routed=2), rr.pick()] == [1, 2, 2, 2]
    assert sq.pick(routed=0) == 0 and sq.load[0] == 2


def test_the_controller_sends_a_request_to_the_replica_it_names():
    controller = DataParallelController.__new__(DataParallelController)  # (its sockets only: no process)
    sent: list[list[str]] = [[], []]
    controller.to_replicas = [
        type("Sock", (), {"send_pyobj": lambda _, r, d=d: sent[d].append(r.rid)})() for d in (0, 1)
    ]
    controller.balancer = LoadBalancer(2, "round_robin")
    reqs = [TokenizedGenerateReqInput(rid, None, [1], SamplingParams(), routed_dp_rank=d)
            for rid, d in [("a", 1), ("b", None), ("c", 1), ("d", None)]]  # fmt: skip
    controller.dispatch(BatchTokenizedGenerateReqInput(reqs))
    assert sent == [["b"], ["a", "c", "d"]]


def test_control_replies_merge_into_one():
    ok, bad = FlushCacheReqOutput(True, ""), FlushCacheReqOutput(False, "busy")
    assert merge_replies([ok, ok]) is ok and merge_replies([ok, bad]) is bad
    states = [
        {"num_running_reqs": 1, "num_waiting_reqs": 2, "counters": {"num_requests_total": 3}, "memory_bytes_by_rank": [{"weights": 1}]},
        {"num_running_reqs": 4, "num_waiting_reqs": 0, "counters": {"num_requests_total": 5}, "memory_bytes_by_rank": [{"weights": 2}]},
    ]  # fmt: skip
    merged = merge_replies([GetInternalStateReqOutput(s) for s in states]).internal_state
    assert (merged["num_running_reqs"], merged["num_waiting_reqs"]) == (5, 2)
    assert merged["counters"] == {"num_requests_total": 8}
    assert merged["memory_bytes_by_rank"] == [{"weights": 1}, {"weights": 2}]
    assert merged["data_parallel_states"] == states


def test_an_engine_on_another_node_is_refused():
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.entrypoints.process_launcher import ServerStartupError

    with pytest.raises(ServerStartupError, match=r"^--node-rank 1: an Engine runs on node 0"):
        Engine(model_path="tiny-qwen3-next", tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")


def test_a_node_with_fewer_gpus_than_ranks_is_refused_naming_the_rank(monkeypatch):
    import torch

    from sglang.srt.managers.scheduler_components.tp_broadcast import ParallelGroupError, ParallelRank

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rank = ParallelRank(
        tp_rank=1, tp_size=2, ep_size=1, dp_rank=None, init_method="", backend="nccl", timeout_s=1, gpu_id=1
    )
    with pytest.raises(
        ParallelGroupError, match=r"^TP rank 1 needs GPU 1 of this node, which shows 1 \(CUDA_VISIBLE"
    ):
        rank.place()
