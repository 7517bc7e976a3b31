"""`DataParallelController` (upstream's name): --dp-size replicas of the model behind one tokenizer.

Its own process, between the TokenizerManager and the replicas' schedulers (each replica a TP group
whose rank 0 it talks to):

    TokenizerManager --ZMQ--> controller --ZMQ--> replica d's scheduler --+--> DetokenizerManager
            ^                    ^                                        |
            +---- replies -------+------ control replies, heartbeats -----+

A generate request goes to one replica (--load-balance-method: round_robin, or shortest_queue: the
replica holding the fewest unfinished requests, from the `ReplicaLoad` each reports when its count
changes, plus what was sent since), or to the one it names (`routed_dp_rank`: a session's turns go to
the replica whose prefix cache holds the earlier turns). An abort goes to every replica (the one that does not hold the rid
ignores it). Any other message is a control call: every replica gets it, and their replies become one
(`merge_replies`: success only if every replica succeeded; internal state per replica). Outputs go
from each replica to the detokenizer directly.

What a replica sends the controller comes as `FromReplica`, naming the replica: a reply is matched to
its call by type and by its place among that replica's replies of the type (a replica answers one kind
of call in order), so a reply that comes after the tokenizer gave up on its call (a replica slower than
CONTROL_TIMEOUT_S) is dropped, never merged into the next call's. A heartbeat goes on to the tokenizer
once every replica has sent one since the last it forwarded, so one stalled replica is noticed
(backend_health) even while the others beat.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.io_struct import (
    BatchTokenizedGenerateReqInput,
    GetInternalStateReqOutput,
    PortArgs,
    SchedulerHeartbeat,
    TokenizedGenerateReqInput,
)

logger = logging.getLogger(__name__)


@dataclass
class FromReplica:
    """A message of replica `dp_rank`'s scheduler to the controller (a reply, a heartbeat, its load)."""

    dp_rank: int
    obj: Any


def reply_type_name(call: Any) -> str:
    """The name of the reply type a control call is answered with (io_struct's names: FlushCacheReqInput
    -> FlushCacheReqOutput, GetInternalStateReq -> GetInternalStateReqOutput)."""
    return type(call).__name__.removesuffix("Input") + "Output"


@dataclass
class ReplicaLoad:
    """A replica's scheduler to the controller: how many requests it holds now."""

    dp_rank: int
    num_reqs: int


class LoadBalancer:
    """Which replica takes the next request."""

    def __init__(self, dp_size: int, method: str):
        self.dp_size = dp_size
        self.method = "round_robin" if method == "auto" else method
        self.next = 0
        self.load = [0] * dp_size  # the replica's last report plus what was sent to it since

    def pick(self, routed: int | None = None) -> int:
        """`routed`: the replica the request must run on (a session's), taken whatever the method."""
        if routed is not None:
            d = routed % self.dp_size  # (the others' turn order stays as it was)
        else:
            if self.method == "shortest_queue":
                d = min(range(self.dp_size), key=lambda i: (self.load[i], (i - self.next) % self.dp_size))
            else:
                d = self.next
            self.next = (d + 1) % self.dp_size
        self.load[d] += 1
        return d

    def report(self, load: ReplicaLoad) -> None:
        self.load[load.dp_rank] = load.num_reqs


def merge_replies(replies: list[Any]) -> Any:
    """One reply from every replica's reply to the same control call."""
    first = replies[0]
    if isinstance(first, GetInternalStateReqOutput):
        state = dict(first.internal_state)
        states = [r.internal_state for r in replies]
        for key in ("num_running_reqs", "num_waiting_reqs", "num_waiting_tokens", "num_grammar_queue_reqs"):
            state[key] = sum(s.get(key, 0) for s in states)
        counters = first.internal_state.get("counters", {})
        state["counters"] = {k: sum(s["counters"].get(k, 0) for s in states) for k in counters}
        state["memory_bytes_by_rank"] = [m for s in states for m in s.get("memory_bytes_by_rank", [])]
        state["data_parallel_states"] = states
        return GetInternalStateReqOutput(state)
    if dataclasses.is_dataclass(first) and hasattr(first, "success"):
        failed = [r for r in replies if not r.success]
        if failed:
            return failed[0]
    return first


class ReplyMatcher:
    """What goes on to the tokenizer from the replicas' replies and heartbeats (see the module's
    docstring): `sent` counts a control call, `received` takes a replica's message and returns what to
    forward, if anything."""

    def __init__(self, dp_size: int):
        self.dp_size = dp_size
        # Control calls sent, by the name of their reply type; each replica's replies seen, by that name;
        # the replies of one call ((name, the call's index among that name's)), until every replica's.
        self.calls: dict[str, int] = defaultdict(int)
        self.answered: dict[str, list[int]] = defaultdict(lambda: [0] * dp_size)
        self.replies: dict[tuple[str, int], dict[int, Any]] = defaultdict(dict)
        self.beaten: set[int] = set()  # replicas that sent a heartbeat since the last one forwarded

    def sent(self, call: Any) -> None:
        self.calls[reply_type_name(call)] += 1

    def received(self, msg: FromReplica) -> Any:
        d, obj, n = msg.dp_rank, msg.obj, self.dp_size
        if isinstance(obj, SchedulerHeartbeat):
            self.beaten.add(d)
            if len(self.beaten) < n:
                return None
            self.beaten.clear()
            return obj
        name = type(obj).__name__
        index = self.answered[name][d]
        self.answered[name][d] += 1
        replies = self.replies[(name, index)]
        replies[d] = obj
        if len(replies) < n:
            return None
        for key in [k for k in self.replies if k[0] == name and k[1] <= index]:
            del self.replies[key]  # (this call's, and older ones some replica never answered)
        if index != self.calls[name] - 1:  # (the tokenizer gave up on it and sent a newer one of its kind)
            logger.warning("Dropped the replicas' late replies to an earlier %s call.", name)
            return None
        return merge_replies([replies[r] for r in range(n)])


class DataParallelController:
    def __init__(self, server_args: Any, port_args: PortArgs, replica_inputs: list[str], reply_ipc: str):
        import zmq

        self.ctx = zmq.Context(2)
        self.from_tokenizer = self._socket(zmq.PULL, bind=port_args.scheduler_input_ipc_name)
        self.from_replicas = self._socket(zmq.PULL, bind=reply_ipc)
        self.to_tokenizer = self._socket(zmq.PUSH, connect=port_args.tokenizer_ipc_name)
        self.to_replicas = [self._socket(zmq.PUSH, connect=name) for name in replica_inputs]
        self.balancer = LoadBalancer(len(replica_inputs), server_args.load_balance_method)
        self.matcher = ReplyMatcher(len(replica_inputs))
        self.poller = zmq.Poller()
        self.poller.register(self.from_tokenizer, zmq.POLLIN)
        self.poller.register(self.from_replicas, zmq.POLLIN)

    def _socket(self, kind: int, bind: str | None = None, connect: str | None = None) -> Any:
        import zmq

        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if bind is not None:
            sock.bind(bind)
        else:
            sock.connect(connect)
        return sock

    def dispatch(self, obj: Any) -> None:
        if isinstance(obj, TokenizedGenerateReqInput):
            self.to_replicas[self.balancer.pick(obj.routed_dp_rank)].send_pyobj(obj)
        elif isinstance(obj, BatchTokenizedGenerateReqInput):
            for item in obj.batch:
                self.dispatch(item)
        else:  # aborts and control calls: every replica
            self.matcher.sent(obj)
            for sock in self.to_replicas:
                sock.send_pyobj(obj)

    def collect(self, msg: FromReplica) -> None:
        if isinstance(msg.obj, ReplicaLoad):
            self.balancer.report(msg.obj)
            return
        out = self.matcher.received(msg)
        if out is not None:
            self.to_tokenizer.send_pyobj(out)

    def event_loop(self) -> None:
        while True:
            ready = dict(self.poller.poll())
            if self.from_tokenizer in ready:
                self.dispatch(self.from_tokenizer.recv_pyobj())
            if self.from_replicas in ready:
                self.collect(self.from_replicas.recv_pyobj())


def run_data_parallel_controller_process(
    server_args: Any, port_args: PortArgs, pipe_writer: Any, replica_inputs: list[str], reply_ipc: str
) -> None:
    from sglang.srt.utils.process import configure_logging

    configure_logging(server_args.log_level, "data-parallel controller")
    controller = DataParallelController(server_args, port_args, replica_inputs, reply_ipc)
    pipe_writer.send({"status": "ready"})
    logger.info(
        "Dispatching to %d replicas (--load-balance-method %s).",
        len(replica_inputs),
        controller.balancer.method,
    )
    controller.event_loop()
