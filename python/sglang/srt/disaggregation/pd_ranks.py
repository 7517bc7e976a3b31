"""Prefill/decode disaggregation under tensor parallelism (`--tp-size N` on both servers).

Every TP rank of a PD server runs the same PD queue and makes the same decisions, as every rank runs the
same scheduler (`managers/scheduler_components/tp_broadcast.py`), so that slots, rooms and requests stay
identical on every rank without further messages:

- only TP rank 0 has the PD channel (the bootstrap port on the prefill side, the answer socket on the
  decode side). Once per poll it hands every rank the messages it took (after those it deals with alone:
  a prefill server's answers to hellos, a decode server's checks of hello acknowledgements, which reach
  the other ranks as "proven" URLs) and its clock, so that every decision that depends on time (the
  bootstrap and waiting timeouts) reads rank 0's clock (`PdRanks.exchange`). An idle queue (no room
  open, no request in its queues) skips the poll's collective, on every rank alike: whether rank 0's
  channel holds messages rides with its clock on the scheduler's per-iteration broadcast (`Tick.disagg`);
- each rank moves its own shard: prefill rank i writes its KV heads and its recurrent heads' state into
  decode rank i's pools, registered with rank i's own transfer engine. The decode server's destination
  carries every rank's transfer-engine session and pool layout (`"ranks"`). A rank's heads are the same
  heads on both sides only at the same --tp-size; at another, each layout says which of the model's KV
  heads, conv channels and SSM heads its rank holds (`shard_map.ShardLayout`), and each prefill rank
  writes the parts of the decode ranks' rows it holds, each part by one prefill rank (upstream's
  scatter / gather between TP sizes; `check_targets` holds the layouts to the model's own);
- a transfer ends when every prefill rank's write has ended: each poll gathers which of its own ended and
  how (`exchange`'s `ended`), and a room ends, with the first failing rank's error, in the poll where every
  rank has it. A failure on one rank stops the room's transfer on the ranks still running it (in the poll
  that gathers it, on every rank at once), and the room ends with that first failure, not the others'
  "cancelled". Only rank 0 sends; the other ranks' sends are dropped.

On the staged path (`staging.py`) each rank's transfer thread moves its shard in the same chunks (the
same positions on every rank) through its own staging buffer into decode rank i's range, or at another
--tp-size its parts of every decode rank's block into that rank's range (`staged_route.py`; the
destination names each rank's range address); prefill rank 0 announces a chunk once
every rank has written it (`written_everywhere`), the decode ranks all unpack it before rank 0
acknowledges it, and every prefill rank's thread takes the acknowledgement.

At one rank (`SINGLE`) every collective is the identity, so the PD queues have one code path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

from sglang.srt.disaggregation.shard_map import ShardLayout, check_rows, layout_mismatch, shard_writes
from sglang.srt.disaggregation.transfer import Descriptor, PoolLayout, transfer_descriptors
from sglang.srt.disaggregation.weights_fingerprint import weights_mismatch

logger = logging.getLogger(__name__)

# A transfer's outcome on one rank: (error or None, bytes moved, seconds on the transfer engine, what
# else its write returned: the staged path's last chunk, the same on every rank).
Outcome = tuple[str | None, int, float, Any]


class PdRanks:
    """A PD server's TP ranks, as its PD queue sees them: this rank, their count, and a gloo group of
    the queue's own (its collectives never interleave with the scheduler's or the model's)."""

    def __init__(self, tp_size: int = 1, tp_rank: int = 0, group: Any = None):
        self.tp_size, self.tp_rank, self.group = tp_size, tp_rank, group

    @classmethod
    def of_server(cls, server_args: Any) -> PdRanks:
        """This process's place in its TP group (joined before the scheduler is built); at --tp-size 1
        the single rank. Every rank of the group must call this, in the same order (a new group)."""
        from sglang.srt.distributed import get_tp_group

        tp = get_tp_group()
        if tp.world_size == 1:
            return SINGLE
        import torch.distributed as dist

        from sglang.srt.managers.scheduler_components.tp_broadcast import DEFAULT_DIST_TIMEOUT_S

        timeout = timedelta(seconds=server_args.dist_timeout or DEFAULT_DIST_TIMEOUT_S)
        group = dist.new_group(tp.ranks, backend="gloo", timeout=timeout)
        return cls(tp.world_size, tp.rank_in_group, group)

    @property
    def is_first(self) -> bool:
        return self.tp_rank == 0

    def clock(self, now: float) -> float:
        """Now, as every rank sees it: this process's clock at one rank, else `now`, rank 0's clock as of
        the last `exchange` (every rank's own would differ)."""
        return time.monotonic() if self.tp_size == 1 else now

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        from sglang.srt.distributed.parallel_state import gather_objects

        return gather_objects(value, self.group, self.tp_size)

    def exchange(
        self, first: Any, ended: dict[str, Outcome]
    ) -> tuple[Any, dict[str, Outcome], dict[str, str]]:
        """Rank 0's `first` (None on the other ranks); the rooms whose transfer has ended on every rank, in
        rank 0's order, each with its outcome: the first failing rank's error (naming the rank above one
        rank), the bytes every rank moved, the longest rank's seconds and rank 0's extra; and the rooms
        whose transfer failed on some rank while another's still runs, each with that failure (the ranks
        still running stop it: `PrefillBootstrapQueue.poll`). Every rank gets the same three."""
        everyone = self.all_gather((first, ended))
        outcomes: dict[str, Outcome] = {}
        failing: dict[str, str] = {}
        for key in dict.fromkeys(k for _, e in everyone for k in e):  # (every rank's, in rank order)
            mine = [e.get(key) for _, e in everyone]
            failed = [(r, o[0]) for r, o in enumerate(mine) if o is not None and o[0]]
            error = None
            if failed:
                error = failed[0][1] if self.tp_size == 1 else f"{failed[0][1]} (on TP rank {failed[0][0]})"
            if None in mine:  # another rank's write still runs: a later poll ends it
                if error is not None:
                    failing[key] = error
                continue
            outcomes[key] = (error, sum(o[1] for o in mine), max(o[2] for o in mine), mine[0][3])
        return everyone[0][0], outcomes, failing

    def written_everywhere(self, written: dict[str, int]) -> dict[str, int]:
        """Staged path: per room, how many chunks every rank has written (the fewest any rank has)."""
        everyone = self.all_gather(written)
        return {key: min(w.get(key, 0) for w in everyone) for key in written}

    def barrier(self) -> None:
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)


SINGLE = PdRanks()


def rank_targets(dst: dict[str, Any]) -> list[dict[str, Any]]:
    """Where each decode rank receives: its transfer-engine session, pool layout and (staged path) staging
    address; one entry (the destination itself) from a decode server at --tp-size 1."""
    return dst["ranks"] if "ranks" in dst else [dst]


# The shard layouts of this model's ranks at a TP size (`shard_map.rank_layouts` with the model's rule);
# ValueError where the model does not split over it.
ExpectedShards = Callable[[int], list[ShardLayout]]


def check_targets(
    layouts: list[PoolLayout], dst: dict[str, Any], expected: ExpectedShards | None = None
) -> str | None:
    """Why a destination cannot take the shards of a prefill server whose ranks' pools are `layouts`
    (every rank checks every pair, so that all decide alike), or None. At the same --tp-size rank i's KV
    and state heads are rank i's on both sides; at another, the ranks' shard layouts say where each
    decode rank's heads are, which must be this model's at that size (`expected`)."""
    targets = rank_targets(dst)
    theirs = [PoolLayout.from_dict(t["layout"]) for t in targets]
    if len(targets) == len(layouts):
        for r, (mine, other) in enumerate(zip(layouts, theirs, strict=True)):
            problem = mine.mismatch(other)
            if problem is not None:
                return problem if len(layouts) == 1 else f"{problem} (TP rank {r})"
    else:
        problem = _other_sizes_problem(layouts, theirs, expected)
        if problem is not None:
            return problem
    # (every rank's share of the values summed on each side: any --tp-size / --ep-size compares)
    return weights_mismatch(layouts, theirs)


def _other_sizes_problem(
    layouts: list[PoolLayout], theirs: list[PoolLayout], expected: ExpectedShards | None
) -> str | None:
    """Why servers of other --tp-size sizes cannot pair (`check_targets`), or None. A decode rank's shard
    layout comes from the network: it must be exactly this model's at the decode server's size (so what
    a transfer is built from is what a real pair of this model would send: as many copies, no more) and
    fill that rank's pools, or the pair is refused here, in a sentence, before anything is built."""
    sizes = f"the decode server runs --tp-size {len(theirs)} and this prefill server --tp-size {len(layouts)}"
    if any(layout.shards is None for layout in layouts + theirs):
        return f"{sizes}, and one of them does not say which heads its ranks hold: use the same --tp-size"
    for r, other in enumerate(theirs):
        problem = layouts[0].mismatch(other, same_shards=False)
        if problem is not None:
            return f"{problem} (the decode server's TP rank {r})"
    mine, shards = _shards(layouts), _shards(theirs)
    if expected is not None:
        try:
            want = expected(len(theirs))
        except ValueError as e:
            return f"{sizes}, which this model does not split over ({e})"
        if shards != want:
            return (
                f"{sizes}, and its ranks say they hold other heads than this model's ranks at that size do "
                "(another model, or another version of this server)"
            )
    problem = layout_mismatch(mine, shards)  # (another model: named first, as such)
    for side, pools, shard in (("prefill", layouts, mine), ("decode", theirs, shards)):
        for r, (pool, lay) in enumerate(zip(pools, shard, strict=True)):
            try:
                check_rows(pool, lay, side)
            except ValueError as e:
                problem = problem or f"{e} (TP rank {r})"
    return problem


def _shards(layouts: list[PoolLayout]) -> list[ShardLayout]:
    # (a destination's were checked by `malformed_dst`; a prefill server's own are its ranks')
    return [ShardLayout.from_dict(layout.shards) for layout in layouts]


# Positions whose copies are built (and held) at once between servers of other --tp-size sizes: at
# Qwen3-Next-80B's shapes from TP 1 to 16 ~197,000 descriptors (~30 MB of Python tuples); all of a
# 131,072-token prompt's at once were ~50 million (R2: ~6 GiB).
WINDOW_POSITIONS = 512


def rank_writes(
    layouts: list[PoolLayout], dst: dict[str, Any], tp_rank: int, src_tokens: list[int], src_slot: int
) -> Iterable[tuple[str, list[Descriptor]]]:
    """Prefill rank `tp_rank`'s writes of one request, [(decode rank's session, copies)], its pools among
    `layouts` (every prefill rank's): at the same --tp-size its own KV heads' rows of `src_tokens` and
    its own recurrent heads' state of `src_slot` into the decode rank of the same index; at another, the
    parts of every decode rank's rows it holds and is to write (`shard_map.shard_writes`: each decode
    unit by one prefill rank). Into `dst["kv"]` and `dst["slot"]`, the same slot ids on every decode
    rank, which decide alike. At another size they are built as they are iterated, `WINDOW_POSITIONS`
    positions at a time (the state's rows with the last window)."""
    targets = rank_targets(dst)
    if len(targets) == len(layouts):
        target = targets[tp_rank]
        theirs = PoolLayout.from_dict(target["layout"])
        descriptors = transfer_descriptors(layouts[tp_rank], theirs, src_tokens, dst["kv"], src_slot, dst["slot"])
        return [(target["session"], descriptors)]
    src = list(zip(layouts, _shards(layouts), strict=True))
    theirs = [PoolLayout.from_dict(t["layout"]) for t in targets]
    into = list(zip(theirs, _shards(theirs), strict=True))
    _warn_direct_between_sizes(len(layouts), len(theirs))

    def windows() -> Iterator[tuple[str, list[Descriptor]]]:
        # (built window by window as they are written: a large decode --tp-size makes millions of copies
        # for a long prompt, which held at once took GiBs; the state with the last window)
        n, w = len(src_tokens), WINDOW_POSITIONS
        for a in range(0, max(n, 1), w):
            slot = src_slot if a + w >= n else None
            writes = shard_writes(tp_rank, src, into, src_tokens[a : a + w], dst["kv"][a : a + w], slot, dst["slot"])
            yield from ((targets[d]["session"], descriptors) for d, descriptors in writes)

    return windows()


_warned_sizes: set[tuple[int, int]] = set()


def _warn_direct_between_sizes(prefill_tp: int, decode_tp: int) -> None:
    """Say once per pair of sizes that the direct path between them is slow, and what is not."""
    if (prefill_tp, decode_tp) in _warned_sizes:
        return
    _warned_sizes.add((prefill_tp, decode_tp))
    logger.warning(
        "Disaggregation: a decode server of --tp-size %d and this one of %d: pools registered as they are "
        "take one copy per prompt position, KV buffer and run of heads between them (through Mooncake TCP "
        "~100x the time of the same size: benchmark/bench_pd_staging.py --direct); with "
        "SGLANG_DISAGGREGATION_STAGING=1 on both servers a chunk takes one copy per KV buffer.",
        decode_tp, prefill_tp,
    )  # fmt: skip


def destination_ranks(
    targets: list[dict[str, Any]], staged: tuple[int, int] | None = None
) -> dict[str, Any]:
    """What a decode server at --tp-size above 1 adds to a destination: every rank's session and pool
    layout (`targets`, gathered at start), rank i's at index i, and on the staged path (`staged`: the
    range's start and bytes, the same on every rank) each rank's range address from its buffer's
    ("staging" in `targets`); nothing at one rank (the destination's own fields are rank 0's)."""
    if len(targets) <= 1:
        return {}
    ranks = [{"session": t["session"], "layout": t["layout"]} for t in targets]
    if staged is not None:
        for entry, t in zip(ranks, targets, strict=True):
            entry["staging"], entry["staging_bytes"] = t["staging"] + staged[0], staged[1]
    return {"ranks": ranks}
