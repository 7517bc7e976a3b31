"""Tensor parallelism on the scheduler's side: every rank runs the same scheduler and makes the same
decisions, so that radix trees, slot allocators and batches stay identical without further messages.

Only TP rank 0 talks to the tokenizer and the detokenizer. Each loop iteration it takes the new messages
and every decision that depends on time rather than on messages (grammars whose compile has ended,
requests past their deadlines, a weight load that has finished) and broadcasts them as one `Tick` over a
gloo group of its own (the model's collectives run on other groups, on the forward stream, so the two
never interleave); every rank then applies the same tick in the same order. Rank 0's sends are the only
ones; the other ranks' are dropped.

A rank that dies makes the next broadcast fail on the others; each rank also writes a heartbeat key into
torch.distributed's store, so the rank that notices names the one that stopped (`RankWatch`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

logger = logging.getLogger("sglang.srt.managers.scheduler")

# Start-up wait for the other ranks when --dist-timeout is not given (a model load on the slowest rank).
DEFAULT_DIST_TIMEOUT_S = 300
HEARTBEAT_S = 1.0
# A rank whose heartbeat key is older than this is named as gone.
STALE_S = 5.0


class ParallelGroupError(RuntimeError):
    """The ranks could not meet, or one of them is gone; the message says which, in one sentence."""


@dataclass(frozen=True)
class ParallelRank:
    """Where one scheduler process sits: its TP rank among `tp_size`, its data-parallel replica (None
    without --dp-size), and how the ranks of its replica meet."""

    tp_rank: int
    tp_size: int
    ep_size: int
    dp_rank: int | None
    init_method: str
    backend: str
    timeout_s: int
    gpu_id: int = 0
    # CPU: this rank's share of the cores (the node's ranks split them); None on a GPU.
    torch_threads: int | None = None

    @property
    def is_first(self) -> bool:
        return self.tp_rank == 0

    def place(self) -> None:
        """Put this process on its share of the node: its GPU (NCCL), or its share of the cores (CPU).
        ParallelGroupError when the node shows fewer GPUs than it runs ranks."""
        import torch

        if self.torch_threads is not None:
            torch.set_num_threads(self.torch_threads)
        if self.backend == "nccl":
            count = torch.cuda.device_count()
            if self.gpu_id >= count:
                raise ParallelGroupError(
                    f"{self.describe()} needs GPU {self.gpu_id} of this node, which shows {count} "
                    "(CUDA_VISIBLE_DEVICES); each node runs --tp-size / --nnodes x --dp-size ranks, one GPU each."
                )
            torch.cuda.set_device(self.gpu_id)

    def describe(self) -> str:
        dp = f"DP rank {self.dp_rank}, " if self.dp_rank is not None else ""
        return f"{dp}TP rank {self.tp_rank}"


@dataclass
class Tick:
    """What rank 0 decided this iteration; every rank applies it in field order, `disagg` first."""

    grammars: list[tuple[str, bool]] = field(default_factory=list)  # (rid, timed out)
    deadline_aborts: list[tuple[list[str], str, int]] = field(default_factory=list)  # (rids, message, status)
    weights_loaded: bool = False
    messages: list[Any] = field(default_factory=list)
    # A PD server: whether rank 0 has something for its PD queue (`has_news`: the queue's poll then runs
    # its collective even with nothing open; idle, every rank skips it alike) and rank 0's clock (set
    # before the other fields apply: what they end is stamped with this iteration's clock).
    disagg: tuple[bool, float] | None = None


def join_parallel_group(rank: ParallelRank, server_args: Any) -> TpBroadcast:
    """Join the TP (and EP) groups before the model is built (its layers read them), and form the
    scheduler's own broadcast group. ParallelGroupError, naming the address, when the ranks cannot meet
    within the timeout, or naming the flag (environment variable), when another node was started with
    other flags (another value of one the ranks decide by: `environ.SAME_ON_EVERY_TP_RANK`). Every rank
    takes rank 0's --random-seed (a node that was given none drew its own), so that all sample alike."""
    import torch.distributed as dist

    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel

    timeout = timedelta(seconds=rank.timeout_s)
    world = rank.tp_size
    try:
        init_distributed_environment(rank.backend, world, rank.tp_rank, rank.init_method, timeout)
        initialize_model_parallel(rank.tp_size, rank.ep_size, timeout=timeout)
        group = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a rendezvous failure, told as one sentence
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ParallelGroupError(
            f"{rank.describe()} could not meet the other {world - 1} rank(s) at --dist-init-addr "
            f"{rank.init_method.removeprefix('tcp://')} within --dist-timeout {rank.timeout_s} s ({reason})."
        ) from None
    watch = RankWatch(dist.distributed_c10d._get_default_store(), rank.tp_rank, world)
    tp = TpBroadcast(rank, group, watch)
    server_args.random_seed = tp.from_first(server_args.random_seed)
    tp.check_same_flags(server_args)
    return tp


# Flags that may differ between the nodes of one server (each node's own, or taken from rank 0).
NODE_LOCAL_FLAGS = {"node_rank", "host", "port", "random_seed", "log_level", "log_requests"}


class RankWatch:
    """Heartbeat keys in the process group's store: each rank writes its own every HEARTBEAT_S, so that
    a rank that sees the group fail can say which rank stopped."""

    def __init__(self, store: Any, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world
        self._beat()
        threading.Thread(target=self._run, name="sglang-rank-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        self.store.set(f"sglang/alive/{self.rank}", repr(time.time()))

    def _run(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store's host (rank 0) is gone: nothing left to tell
                return

    def gone(self) -> list[int]:
        """The ranks whose heartbeat is stale or missing (waits one staleness period to be sure)."""
        time.sleep(STALE_S)
        now, out = time.time(), []
        for r in range(self.world):
            try:
                last = float(self.store.get(f"sglang/alive/{r}").decode())
            except Exception:  # noqa: BLE001 - the store itself is gone with rank 0
                return [0] if self.rank != 0 else []
            if now - last > STALE_S:
                out.append(r)
        return out


class TpBroadcast:
    def __init__(self, rank: ParallelRank, group: Any, watch: RankWatch):
        self.rank = rank
        self.group = group
        self.watch = watch

    @property
    def is_first(self) -> bool:
        return self.rank.is_first

    def exchange(self, tick: Tick | None) -> Tick:
        """Rank 0 gives its tick; every rank gets it. ParallelGroupError naming the rank gone."""
        import torch.distributed as dist

        box = [tick]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except Exception as e:  # noqa: BLE001 - a peer is gone: find which, then end this rank
            raise ParallelGroupError(self.gone_message(e) or self._sentence("a TP rank", e)) from None
        return box[0]

    def from_first(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank."""
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def check_same_flags(self, server_args: Any) -> None:
        """Every node must run the same flags (but its own NODE_LOCAL_FLAGS) and the same values of the
        environment variables the ranks decide by (`environ.SAME_ON_EVERY_TP_RANK`): ParallelGroupError
        naming the first that differs from rank 0's (a secret without its values)."""
        from sglang.srt.distributed.parallel_state import gather_objects
        from sglang.srt.environ import SECRET_ENV_NAMES, tp_env_values

        flags = {k: v for k, v in server_args.public_dict().items() if k not in NODE_LOCAL_FLAGS}
        everyone = gather_objects((flags, tp_env_values()), self.group, self.rank.tp_size)
        first_flags, first_env = everyone[0]
        for r, (flags, env) in enumerate(everyone):
            for name, value in flags.items():
                if value != first_flags.get(name):
                    raise ParallelGroupError(
                        f"--{name.replace('_', '-')} is {value!r} on TP rank {r} but {first_flags.get(name)!r} "
                        "on TP rank 0; start every node with the same flags."
                    )
            for name, value in env.items():
                if value == first_env.get(name):
                    continue
                if name in SECRET_ENV_NAMES:
                    raise ParallelGroupError(
                        f"{name} differs between TP rank {r} and TP rank 0 (values not shown); start every "
                        "node with the same value."
                    )
                raise ParallelGroupError(
                    f"{name} is {value!r} on TP rank {r} but {first_env.get(name)!r} on TP rank 0; start "
                    "every node with the same value (the ranks decide by it alike)."
                )

    def gone_message(self, error: Exception) -> str | None:
        """After a collective failed with `error`: the sentence naming the ranks whose heartbeat
        stopped, or None if every rank still beats (the failure is not a lost rank)."""
        gone = [r for r in self.watch.gone() if r != self.rank.tp_rank]
        return self._sentence(f"TP rank {', '.join(map(str, gone))}", error) if gone else None

    def _sentence(self, who: str, error: Exception) -> str:
        dp = f" of DP rank {self.rank.dp_rank}" if self.rank.dp_rank is not None else ""
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"{who}{dp} stopped answering ({reason}); {self.rank.describe()} ends the server."

    def agree(self, value: Any, what: str, hint: str = "") -> None:
        """Every rank must have the same `value` (pool sizes; with the strict idle check, the scheduler's
        counts): ParallelGroupError otherwise."""
        from sglang.srt.distributed.parallel_state import gather_objects

        values = gather_objects(value, self.group, self.rank.tp_size)
        if any(v != values[0] for v in values):
            raise ParallelGroupError(f"The TP ranks have different {what} ({values}){hint}.")

    def agree_outcome(self, error: str | None, then: str = "every rank keeps what it had") -> str | None:
        """The outcome every rank takes of a call that may fail on some ranks only (a weight load from
        disk, a tensor update, a memory release, a request's custom logit processor): None where every
        rank succeeded, else why not (the first failing rank's reason, naming it and saying `then` unless
        every rank failed alike), so that all ranks apply or roll back together and their states stay
        the same."""
        from sglang.srt.distributed.parallel_state import gather_objects

        errors = gather_objects(error, self.group, self.rank.tp_size)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if not failed:
            return None
        if len(failed) == len(errors) and all(e == failed[0][1] for _, e in failed):
            return failed[0][1]
        r, why = failed[0]
        return f"{why} (on TP rank {r}; {then})"

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (an operation that ended on each rank at its own time)."""
        from sglang.srt.distributed.parallel_state import gather_objects

        return all(gather_objects(bool(flag), self.group, self.rank.tp_size))

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value`, on rank 0 (None elsewhere)."""
        import torch.distributed as dist

        values: list[Any] | None = [None] * self.rank.tp_size if self.is_first else None
        dist.gather_object(value, values, dst=0, group=self.group)
        return values
