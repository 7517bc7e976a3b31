"""EAGLE / NEXTN under prefill/decode disaggregation (`--speculative-algorithm` alike on both servers):
what the decode server's first verify drafts from besides the prompt's KV.

The prefill server runs the MTP layer after its prefill as a single server does (`speculative/
mtp_draft.py`): the prompt positions' MTP KV lands in the KV pool's draft layer (id
`num_hidden_layers`), which moves with the other layers' KV (`PoolLayout.draft_kv_layers` says that
both servers have it); and the MTP output g at the prompt's last position, with the sampled first
token, is left in the request's row of the `DraftStash`. That row goes with the "done" answer (its raw
bytes, base64: exact in any dtype) and is written into the decode server's stash row of the request,
so that its first verify drafts exactly as a single server's would (upstream sends the draft's hidden
state with the first token, likewise: sgl-project/sglang PR #9976)."""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.environ import envs

if TYPE_CHECKING:
    from sglang.srt.disaggregation.scheduler_view import DisaggScheduler
    from sglang.srt.managers.schedule_batch import Req

FIELD = "draft_hidden"
# The row's dtype, with it: the byte count alone lets a float16 row into a bfloat16 stash, or a float32
# row of hidden size 4 into a bfloat16 one of 8 (the same bytes, another meaning).
DTYPE_FIELD = "draft_hidden_dtype"


def _stash(sched: DisaggScheduler) -> torch.Tensor | None:
    """The scheduler's MTP stash rows [rows, hidden], or None without EAGLE / NEXTN."""
    draft = getattr(getattr(sched, "spec", None), "draft", None)
    stash = getattr(draft, "stash", None)
    return None if stash is None else stash.hidden


def _needs_stream(stash: torch.Tensor) -> bool:
    """Whether the stash's rows are read and written as a task on the forward stream (device rows); host
    rows at once (no batch in flight uses a row that a request waiting for its transfer holds). A test
    hook: a test makes host rows take the forward stream's path."""
    return stash.device.type != "cpu"


def _on_stream(sched: DisaggScheduler, stash: torch.Tensor, fn):
    """`fn()` where the forward stream sees it (`_needs_stream`): on CUDA a blocking round trip through
    the forward stream, so each side makes one per poll for every row it moves then."""
    return sched.worker.call(fn) if _needs_stream(stash) else fn()


def draft_row_bytes(sched: DisaggScheduler) -> int:
    """The bytes of one stash row (0 without EAGLE / NEXTN): what a "done" answer carries beyond the rest."""
    stash = _stash(sched)
    return 0 if stash is None else stash[0].nbytes


def stash_row_messages(sched: DisaggScheduler, reqs: list[Req], encode: bool = True) -> list[dict[str, Any]]:
    """The prefill side: for each of `reqs` (the transfers that ended well in one poll), the "done"
    answer's field holding its stash row; all the rows read in one forward-stream call (one gather, one
    device-to-host copy). {} each without EAGLE / NEXTN, and on a TP rank that does not send the answers
    (`encode` False): the copy is no collective, so the other ranks skip it."""
    stash = _stash(sched)
    if stash is None or not encode or not reqs:
        return [{} for _ in reqs]
    idx = [req.req_pool_idx for req in reqs]
    rows = _on_stream(
        sched, stash, lambda: stash.index_select(0, torch.tensor(idx, device=stash.device)).to("cpu")
    )
    if envs.SGLANG_TEST_DISAGGREGATION_ZERO_DRAFT_STASH.get():
        rows.zero_()
    name = dtype_name(rows.dtype)
    return [{FIELD: encode_row(row), DTYPE_FIELD: name} for row in rows]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_row(row: torch.Tensor) -> str:
    return base64.b64encode(row.contiguous().view(torch.uint8).numpy().tobytes()).decode("ascii")


def decode_row(value: Any, dtype: Any, like: torch.Tensor) -> torch.Tensor | str:
    """The row an answer's field holds (`dtype`: the name it was sent with), in `like`'s dtype and shape;
    or why it cannot be one."""
    if not isinstance(value, str):
        return (
            "the prefill server sent no MTP draft state (start it with the same --speculative-algorithm "
            "as the decode server)"
        )
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return "the MTP draft state is not base64"
    if dtype != dtype_name(like.dtype):
        there = dtype if isinstance(dtype, str) else "no dtype named"
        return (
            f"the MTP draft state is {there[:40]}, {dtype_name(like.dtype)} here (start both servers with the "
            "same --dtype)"
        )
    if len(data) != like.nbytes:
        return (
            f"the MTP draft state has {len(data)} bytes, {like.nbytes} expected (another model: its hidden size "
            "differs)"
        )
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(like.dtype).view(like.shape)


def answered_stash_row(sched: DisaggScheduler, msg: dict[str, Any]) -> torch.Tensor | str | None:
    """The decode side: the stash row a "done" answer `msg` carries, on the host, fit for this server's
    stash (None without EAGLE / NEXTN); why not, in one sentence, where the answer lacks it or it does
    not fit. Nothing is written (`write_stash_rows`, once per poll)."""
    stash = _stash(sched)
    if stash is None:
        return None
    return decode_row(msg.get(FIELD), msg.get(DTYPE_FIELD), stash[0])


def write_stash_rows(sched: DisaggScheduler, rows: list[tuple[int, torch.Tensor]]) -> None:
    """The decode side: each `(req_pool_idx, row)` (rows from `answered_stash_row`) into that row of this
    server's stash, in one forward-stream call (one host-to-device copy, one index_copy)."""
    stash = _stash(sched)
    if stash is None or not rows:
        return
    idx = [i for i, _ in rows]
    host = torch.stack([row for _, row in rows])

    def write() -> None:
        stash.index_copy_(0, torch.tensor(idx, device=stash.device), host.to(stash.device))

    _on_stream(sched, stash, write)
