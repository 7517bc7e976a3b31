"""A PD pair's answers and transfers checked from outside, through HTTP: shared by the PD router tests
(test/registered/disaggregation/)."""

from __future__ import annotations

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
        assert after["bytes"] - before["bytes"] == tokens * after["kv_bytes_per_token"] + after["state_bytes"]
        moved.append(tokens)
        ids = ids + r.json()["output_ids"]
    return moved
