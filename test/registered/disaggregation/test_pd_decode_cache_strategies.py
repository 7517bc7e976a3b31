"""The decode server's radix cache (--disaggregation-decode-enable-radix-cache) under every mamba strategy:
a PD pair behind the router per case, a three-turn conversation whose answers equal a single server's
(the prefill server asked without bootstrap fields) and whose next turns move only the KV the decode
tree lacks plus one state (bytes checked by `conversation_turns`). The per-commit suite covers no_buffer
on Nemotron-H (test_pd_router.py); this file adds the extra-buffer strategies, a decode page size of 16,
no_buffer on Qwen3-Next, and turns that end off a page (extra_buffer, page 16). Nightly (one PD pair
per case, ~15 s each to start):

    .venv/bin/python -m pytest -q test/registered/disaggregation/test_pd_decode_cache_strategies.py
"""

from __future__ import annotations

import pytest
import requests

from sglang.test.ci_register import register_cpu_ci
from sglang.test.pd_conversation import conversation_turns, internal_state
from sglang.test.router_process import start_pd, stop_all

register_cpu_ci(est_time=130, suite="nightly-cpu")

SECRET = "pd-decode-cache-test-secret"
# (preset, prefill args, decode strategy, decode page size)
CASES = [
    ("tiny-nemotron-h", [], "extra_buffer", 1),
    ("tiny-qwen3-next", ["--page-size", "16"], "extra_buffer_lazy", 16),
    ("tiny-qwen3-next", [], "no_buffer", 1),
]


@pytest.mark.parametrize(("preset", "prefill_args", "strategy", "page"), CASES)
def test_next_turns_move_only_what_the_decode_tree_lacks(preset, prefill_args, strategy, page, preset_paths):
    decode_args = [
        "--disaggregation-decode-enable-radix-cache",
        "--mamba-scheduler-strategy", strategy,
        "--page-size", str(page),
    ]  # fmt: skip
    env = {"SGLANG_DISAGGREGATION_SECRET": SECRET}
    prefill, decode, router, _ = start_pd(preset_paths[preset], prefill_args, decode_args, env, env)
    try:
        pd = {"prefill": prefill, "decode": decode, "router": router}
        # 8 tokens answered per turn: a turn's KV on the decode side ends at its prompt + 7 (the last
        # answer token's KV is never computed), 48, 64 and 80 tokens here, each a whole number of pages,
        # so every finished turn leaves its final state in the decode tree (a checkpoint ends a page).
        first = [(5 * j + 1) % 400 + 3 for j in range(41)]
        new = [[(3 * j + 7 + 50 * t) % 400 + 3 for j in range(8)] for t in range(2)]
        moved = conversation_turns(pd, first, new)
        # The next turn moves the KV of the previous answer's last token and of its 8 new tokens.
        assert moved == [41, 1 + 8, 1 + 8]
        state = internal_state(decode)
        assert state["disaggregation"]["decode_radix_cache"] is True
        assert state["mamba_scheduler_strategy"] == strategy
        assert state["token_usage"]["held_by_tree"] >= 80
        assert state["mamba_usage"]["held_by_tree"] >= 1
    finally:
        stop_all(prefill, decode, router)


def test_turns_that_end_off_a_page_keep_their_last_page_boundary(preset_paths):
    """Decode page size 16 under extra_buffer, turns whose KV does not end on a page: the decode server
    snapshots at every page it decodes across (its default --mamba-track-interval there is the page
    size), so a finished turn leaves its KV up to its last page boundary, with the state there, in the
    tree, and the next turn moves only the rest. With the usual interval (256) no state of these turns
    sits on a page the tree can key, and every turn moved its whole prompt (45, 77, 106: measured)."""
    decode_args = [
        "--disaggregation-decode-enable-radix-cache",
        "--mamba-scheduler-strategy", "extra_buffer",
        "--page-size", "16",
    ]  # fmt: skip
    env = {"SGLANG_DISAGGREGATION_SECRET": SECRET}
    prefill, decode, router, _ = start_pd(preset_paths["tiny-qwen3-next"], [], decode_args, env, env)
    try:
        pd = {"prefill": prefill, "decode": decode, "router": router}
        first = [(5 * j + 1) % 400 + 3 for j in range(45)]
        new = [[(3 * j + 7 + 50 * t) % 400 + 3 for j in range(n)] for t, n in enumerate((8, 5))]
        # 24 tokens answered: turn 1's KV ends at 45 + 23 = 68 (its last page boundary 64), turn 2's
        # prompt is 77 tokens and its KV ends at 100 (96), turn 3's prompt is 106 tokens.
        moved = conversation_turns(pd, first, new, max_new_tokens=24)
        assert moved == [45, 77 - 64, 106 - 96]
        assert requests.get(decode.base_url + "/get_server_info", timeout=10).json()["mamba_track_interval"] == 16
        # Turn 3's KV ends at 129: the tree holds up to its last page boundary, 128.
        assert internal_state(decode)["token_usage"]["held_by_tree"] >= 128
    finally:
        stop_all(prefill, decode, router)
