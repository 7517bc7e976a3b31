"""The checks of a prefill server on a destination that a decode server sent (`prefill.py`): its fields'
types, and the lengths that `transfer_descriptors` and `Staging.send` rely on, so that building a
transfer from a destination that passes never raises (`malformed_dst`); then whether it fits this
prompt and this server (`unfit_dst`). Each check reads the message alone (a pure
function of it): under TP every rank gets rank 0's message and so refuses, or accepts, alike."""

from __future__ import annotations

from typing import Any

from sglang.srt.disaggregation.pd_ranks import ExpectedShards, check_targets, rank_targets
from sglang.srt.disaggregation.shard_map import ShardLayout
from sglang.srt.disaggregation.transfer import PoolLayout


def malformed_dst(msg: dict[str, Any], context_len: int) -> str | None:
    """What is wrong with a destination from the network, or None."""

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63  # (an address or a slot id)

    if not isinstance(msg.get("notify"), str) or not isinstance(msg.get("session"), str):
        return "notify and session must be strings"
    if not is_int(msg.get("slot")) or not isinstance(msg.get("kv"), list) or not all(map(is_int, msg["kv"])):
        return "slot and kv must be slot ids"
    if not all(is_int(msg.get(k, 0)) for k in ("prefix", "staging", "staging_bytes")):
        return "prefix must be a token count, staging an address and staging_bytes a size"
    if len(msg["kv"]) > context_len:
        return f"kv names {len(msg['kv'])} token slots, more than the context length {context_len}"
    ranks = msg.get("ranks", [msg])  # (a decode server above one TP rank: each rank's session and layout)
    if not isinstance(ranks, list) or not 0 < len(ranks) <= MAX_TP_RANKS:
        return f"ranks must list between 1 and {MAX_TP_RANKS} decode ranks"
    # Staged (the destination names a range): every rank's entry names its range, else none does.
    staged = "staging" in msg
    if staged and not msg.get("staging_bytes"):
        return "staging_bytes must be a size above 0"
    for target in ranks:
        if not isinstance(target, dict) or not isinstance(target.get("session"), str):
            return "each rank's session must be a string"
        if staged and not (is_int(target.get("staging")) and is_int(target.get("staging_bytes"))
                           and target["staging_bytes"] > 0):  # fmt: skip
            return "each rank's staging must be an address and staging_bytes a size above 0"
        if not staged and ("staging" in target or "staging_bytes" in target):
            return "a rank names a staging range in a destination without one"
        problem = malformed_layout(target.get("layout"), is_int)
        if problem is not None:
            return problem
    return None


# The most TP ranks a destination may name (a bound on what it makes this server hold and check).
MAX_TP_RANKS = 64


def malformed_layout(layout: Any, is_int) -> str | None:
    try:
        PoolLayout.from_dict(layout)
    except TypeError:
        return "layout is not a pool layout"
    lists = [layout[k] for k in ("kv_ptrs", "kv_nbytes", "state_ptrs", "state_nbytes", "state_slot_bytes")]
    if not all(isinstance(v, list) and all(map(is_int, v)) for v in lists) or not is_int(
        layout["kv_bytes_per_token"]
    ):
        return "layout holds something other than addresses and sizes"
    names = ("kv_dtype", "state_dtypes", "weights", "weights_digest", "weights_source")
    if not all(isinstance(layout.get(k, ""), str) for k in names):
        return "layout's kv_dtype, state_dtypes, weights, weights_digest and weights_source must be strings"
    if not is_int(layout.get("draft_kv_layers", 0)):
        return "layout's draft_kv_layers must be a layer count"
    for name in ("weights_share", "weights_held"):  # (sums modulo 2**64: `weights_fingerprint`)
        share = layout.get(name, 0)
        if not (isinstance(share, int) and not isinstance(share, bool) and 0 <= share < 2**64):
            return f"layout's {name} must be an integer in [0, 2**64)"
    if not (is_int(layout.get("ep_size", 1)) and 0 < layout.get("ep_size", 1) <= MAX_TP_RANKS):
        return f"layout's ep_size must be an integer in [1, {MAX_TP_RANKS}]"
    if layout.get("shards") is not None:  # (which heads the rank holds: `shard_map`, read at another --tp-size)
        try:
            ShardLayout.from_dict(layout["shards"])
        except ValueError as e:
            return f"layout's shards: {e}"
    # (`transfer_descriptors` and `PoolLayout.regions` zip them strictly)
    if len(lists[0]) != len(lists[1]):
        return "layout's kv_ptrs and kv_nbytes differ in length"
    if not len(lists[2]) == len(lists[3]) == len(lists[4]):
        return "layout's state_ptrs, state_nbytes and state_slot_bytes differ in length"
    return None


def _blocks(dst: dict[str, Any]) -> str:
    """How the decode server packs a staged block (its rank 0's layout says; "" from an older build)."""
    return str(rank_targets(dst)[0]["layout"].get("staged_blocks", ""))


def unfit_dst(
    layouts: list[PoolLayout],
    dst: dict[str, Any],
    prompt_len: int,
    staged: bool,
    decode_tp: int | None = None,
    expected: ExpectedShards | None = None,
) -> str | None:
    """Why a well-formed destination cannot take a `prompt_len`-token prompt's transfer from a prefill
    server whose ranks' pools are `layouts` (`staged`: this server stages through host memory; `decode_tp`:
    the decode servers' --tp-size it was told, --disaggregation-decode-tp; `expected`: this model's shard
    layouts at a TP size, `check_targets`), or None."""
    n, prefix = prompt_len, dst.get("prefix", 0)
    ranks = len(rank_targets(dst))
    if decode_tp is not None and ranks != decode_tp:
        return (
            f"the decode server runs --tp-size {ranks}, not the --disaggregation-decode-tp {decode_tp} this "
            "prefill server was started with: give the decode servers' size, or leave the flag out (the "
            "destination says it)"
        )
    problem = check_targets(layouts, dst, expected)
    if problem is None and not prefix < n:
        problem = f"the decode server holds {prefix} tokens of a {n}-token prompt (at most {n - 1})"
    elif problem is None and ("staging" in dst) != staged:
        problem = (
            "one server stages KV and state through host memory and the other does not (both need "
            "the same SGLANG_DISAGGREGATION_STAGING, and CUDA pools with a host-only engine stage)"
        )
    elif problem is None and staged and _blocks(dst) != layouts[0].staged_blocks:
        problem = (
            f"the decode server packs staged blocks as {_blocks(dst) or 'an older build did (KV token-major)'}, "
            f"this one as {layouts[0].staged_blocks}: run the same build of the server on both"
        )
    elif problem is None and len(dst["kv"]) != n - prefix:
        problem = (
            f"the decode server reserved {len(dst['kv'])} KV slots for the {n - prefix} tokens of a "
            f"{n}-token prompt past its {prefix} cached ones"
        )
    return problem
