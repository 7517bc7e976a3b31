"""A PD pair's answers and transfers checked from outside, through HTTP: shared by the PD router tests
(test/registered/disaggregation/)."""

from __future__ import annotations

import time

import requests

from sglang.test.test_utils import ServerProcess

# Greedy tokens equal; logprobs within 1e-4: the two paths run the same kernels on the same weights,
# but the decode side reads its prompt KV from another page layout (summation order in attention may
# differ by float32 rounding, ~1e-6), far below the 1e-4 the issue sets.
LOGPROB_TOL = 1e-4


def internal_state(server: ServerProcess) -> dict:
    return requests.get(server.base_url + "/get_server_info", timeout=10).json()["internal_states"][0]


def post(url: str, body: dict, timeout: float = 60) -> requests.Response:
    return requests.post(url, json=body, timeout=timeout)


def generate_body(ids: list[int], max_new_tokens: int = 12, **extra) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
        **extra,
    }


def assert_same_generation(got: dict, want: dict) -> None:
    assert got["output_ids"] == want["output_ids"]
    g, w = got["meta_info"], want["meta_info"]
    assert [t for _, t, _ in g["output_token_logprobs"]] == want["output_ids"]
    for (lg, _, _), (lw, _, _) in zip(g["output_token_logprobs"], w["output_token_logprobs"], strict=True):
        assert abs(lg - lw) <= LOGPROB_TOL
    # The router merges the prefill's input logprobs with the decode's (none).
    gi, wi = g["input_token_logprobs"], w["input_token_logprobs"]
    assert [t for _, t, _ in gi] == [t for _, t, _ in wi]
    for (lg, _, _), (lw, _, _) in zip(gi, wi, strict=True):
        assert (lg is None and lw is None) or abs(lg - lw) <= LOGPROB_TOL
    assert g["prompt_tokens"] == w["prompt_tokens"] and g["completion_tokens"] == w["completion_tokens"]


def conversation_turns(
    pd: dict, first: list[int], new: list[list[int]], max_new_tokens: int = 8
) -> list[int]:
    """Run a conversation through the router, each turn's prompt the previous prompt, its answer and the
    turn's new tokens; every answer equals the single server's. Returns the KV tokens each turn's
    transfer moved, checking its bytes: that KV and one request's state, nothing more."""
    moved = []
    ids = first
    for turn in [[], *new]:
        ids = ids + turn
        want = post(pd["prefill"].base_url + "/generate", generate_body(ids, max_new_tokens)).json()
        before = internal_state(pd["prefill"])["disaggregation"]
        r = post(pd["router"].base_url + "/generate", generate_body(ids, max_new_tokens))
        assert r.status_code == 200, r.text
        assert_same_generation(r.json(), want)
        after = internal_state(pd["prefill"])["disaggregation"]
        tokens = after["kv_tokens"] - before["kv_tokens"]
        assert after["transfers"] - before["transfers"] == 1
        # Every decode rank's shard once: the decode ranks' sizes together (the prefill ranks' too at one
        # --tp-size; at another, a head or group replicated on several decode ranks is written to each).
        sizes = internal_state(pd["decode"])["disaggregation"]
        assert after["bytes"] - before["bytes"] == tokens * sizes["kv_bytes_per_token"] + sizes["state_bytes"]
        moved.append(tokens)
        ids = ids + r.json()["output_ids"]
    return moved


# Disaggregation state keys that count what requests hold.
QUEUE_KEYS = (
    "rooms", "waiting_for_destination", "transferring", "prealloc_queue", "transfer_queue", "ready",
    "aborted_holding",
    "staging_ranges",  # the staged pair's ranges of the decode staging buffer, freed with their requests
)  # fmt: skip


def assert_quiescent(server: ServerProcess, name: str, timeout: float = 15) -> None:
    """No request runs, waits or holds a KV slot or a mamba slot; the PD queues are empty."""
    deadline = time.monotonic() + timeout
    while True:
        state = internal_state(server)
        queues = {k: v for k, v in (state["disaggregation"] or {}).items() if k in QUEUE_KEYS}
        held = (
            state["num_running_reqs"], state["num_waiting_reqs"],
            state["token_usage"]["held_by_requests"], state["mamba_usage"]["held_by_requests"],
        )  # fmt: skip
        if held == (0, 0, 0, 0) and not any(queues.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} server still holds something: {held}, {queues}")
        time.sleep(0.2)


def prompts(n: int, base: int = 0) -> list[list[int]]:
    """`n` prompts of lengths across page, chunk and kernel-chunk boundaries (16, 64, 128): 5 .. 300."""
    lengths = [5, 16, 17, 63, 64, 65, 129, 300]
    return [[(7 * i + 3 * j + base) % 500 + 3 for j in range(lengths[i % len(lengths)])] for i in range(n)]
