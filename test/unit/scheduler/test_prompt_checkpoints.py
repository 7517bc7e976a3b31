"""Where a prompt's recurrent state is checkpointed, and when the tree gets it.

Rules (extra-buffer strategies, cache chunk C): a prefill that completes a prompt of L tokens hands the
tree a checkpoint at ⌊L/C⌋·C (what a continuation of the conversation hits) and at ⌊(L−1)/C⌋·C (what
an exact repeat hits: it must recompute its last token); a branching point B is snapshotted by the
extend that covers it, however many chunks later. The tree gets them when the extend is scheduled, so a
second request hits while the first still decodes. Outputs are oracle-exact; `cached_tokens` is asserted
exactly.

Also here: a negative control that shows the deferred clear of a reused slot is load-bearing, and the
release of a match that is not admitted.
"""

from __future__ import annotations

import pytest

from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, prompt_with_unique_token, token_ids

register_cpu_ci(est_time=40, suite="per-commit-cpu")

QWEN, NEMO = "tiny-qwen3-next", "tiny-nemotron-h"
C = 64  # Qwen3-Next's cache chunk at page size 1
EXTRA = ["extra_buffer", "extra_buffer_lazy"]


def _harness(strategy: str, preset: str = QWEN, **kw) -> SchedulerHarness:
    kw.setdefault("mamba_track_interval", 64 if preset == QWEN else 32)
    return SchedulerHarness(preset, mamba_scheduler_strategy=strategy, **kw)


@pytest.mark.parametrize("strategy", EXTRA)
def test_exact_repeat_hits_the_last_chunk_before_the_last_token(strategy, oracles):
    h = _harness(strategy)
    oracle = oracles[QWEN]
    try:
        for k, length in enumerate([C, 2 * C, 2 * C + 1, 32 * C]):
            prompt = token_ids(length, seed=200 + k)
            first = h.generate(prompt, max_new_tokens=2)
            assert first.cached_tokens == 0
            repeat = h.generate(prompt, max_new_tokens=2)
            h.check_oracle(oracle, prompt, repeat)
            assert repeat.cached_tokens == (length - 1) // C * C, length
            # The continuation hits all of the first request's KV (the prompt and its first output
            # token): its final state. Leaving the first answer right after the prompt, it hits the
            # prompt's checkpoint (L is a multiple of C here but for 2C+1).
            turn2 = prompt + first.output_ids + [5, 6]
            out2 = h.generate(turn2, max_new_tokens=2)
            h.check_oracle(oracle, turn2, out2)
            assert out2.cached_tokens == length + 1, length
            branch = prompt + [7, 8]
            out3 = h.generate(branch, max_new_tokens=2)
            h.check_oracle(oracle, branch, out3)
            assert out3.cached_tokens == length // C * C, length
            h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("strategy", EXTRA)
def test_prompt_checkpoint_survives_a_decode_boundary(strategy, oracles):
    """A prompt one token short of a boundary (2C − 1) whose outputs cross it: the decode snapshot at
    2C does not replace the prompt's checkpoint at C; both reach the tree, and so does the final state
    at 2C + 6."""
    h = _harness(strategy)
    oracle = oracles[QWEN]
    try:
        prompt = token_ids(2 * C - 1, seed=210)
        first = h.generate(prompt, max_new_tokens=8)
        repeat = h.generate(prompt, max_new_tokens=2)
        h.check_oracle(oracle, prompt, repeat)
        assert repeat.cached_tokens == C
        # Leaving the first answer after 4 of its tokens (position 2C + 3): the decode snapshot.
        turn2 = prompt + first.output_ids[:4] + [5, 6]
        out2 = h.generate(turn2, max_new_tokens=2)
        h.check_oracle(oracle, turn2, out2)
        assert out2.cached_tokens == 2 * C
        turn2 = prompt + first.output_ids + [5, 6]
        out2 = h.generate(turn2, max_new_tokens=2)
        h.check_oracle(oracle, turn2, out2)
        assert out2.cached_tokens == 2 * C + 6
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("strategy", EXTRA)
def test_second_request_hits_while_the_first_decodes(strategy, oracles):
    h = _harness(strategy)
    oracle = oracles[QWEN]
    try:
        prompt = token_ids(200, seed=220)
        first = h.submit(prompt, max_new_tokens=40)
        for _ in range(3):
            h.sched.step()
        assert any(r.rid == first for r in h.sched.running) and h.sched.running[0].output_ids
        second_prompt = prompt + token_ids(30, seed=221)
        second = h.submit(second_prompt, max_new_tokens=4)
        h.sched.step()
        assert any(r.rid == second for r in h.sched.running), "the second request was admitted"
        assert any(r.rid == first and not r.finished for r in h.sched.running), "the first still decodes"
        h.run()
        h.check_oracle(oracle, prompt, h.outputs[first])
        h.check_oracle(oracle, second_prompt, h.outputs[second])
        assert h.outputs[second].cached_tokens == 192
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("strategy", EXTRA)
def test_extend_from_a_final_state_snapshots_on_its_lattice(strategy, chunk, oracles):
    """Turn 1 (100 + 11 tokens) leaves its final state at 110, off the cache chunk (C = 64). Turn 2
    extends from there to 261: its snapshots sit at 110 + k * C (174 is a chunk end when chunked, and
    238 the last one in the prompt); a request leaving turn 2 at 200 hits 174, either that chunk end
    or, unchunked, the branching point a first such request snapshots; one leaving at 250 hits 238."""
    h = _harness(strategy, chunked_prefill_size=chunk or -1)
    oracle = oracles[QWEN]
    try:
        prompt1 = token_ids(100, seed=240)
        out1 = h.generate(prompt1, max_new_tokens=11)
        turn2 = prompt1 + out1.output_ids + token_ids(150, seed=241)
        out2 = h.generate(turn2, max_new_tokens=2)
        h.check_oracle(oracle, turn2, out2)
        assert out2.cached_tokens == 110
        hits = []
        for k, leave_at in enumerate([200, 200, 250]):
            prompt = turn2[:leave_at] + token_ids(100, seed=242 + k)  # its own snapshot lies past 200
            out = h.generate(prompt, max_new_tokens=2)
            h.check_oracle(oracle, prompt, out)
            hits.append(out.cached_tokens)
        assert hits == ([174, 174, 238] if chunk else [110, 174, 238])
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("strategy", EXTRA)
def test_branching_point_in_a_later_chunk(strategy, oracles):
    """A prefix X of 460 tokens whose checkpoints were evicted (KV kept as a path): the next request
    matches KV to 460 but no state, so it prefills from 0 in 128-token chunks with a branching point at
    448, which only its fourth chunk covers. A third request then hits 448 (not the chunk end 384)."""
    h = _harness(strategy, chunked_prefill_size=128)
    oracle = oracles[QWEN]
    try:
        x = token_ids(460, seed=230)
        h.generate(x + token_ids(300, seed=231), max_new_tokens=1)
        tree = h.sched.tree_cache
        # Checkpoints at the chunk ends 128..640 and the prompt's 704: drop the four shallowest.
        assert tree.evict(mamba_num=4).num_mamba_evicted == 4
        second = x + token_ids(300, seed=232)
        out = h.generate(second, max_new_tokens=1)
        h.check_oracle(oracle, second, out)
        assert out.cached_tokens == 0
        third = x + token_ids(100, seed=233)
        out = h.generate(third, max_new_tokens=3)
        h.check_oracle(oracle, third, out)
        assert out.cached_tokens == 448
        h.flush_and_check_empty()
    finally:
        h.shutdown()


def test_page_size_unrelated_to_the_state_chunk_without_a_radix_cache(oracles):
    """No checkpoints are taken without a radix cache, so a page size that neither divides nor is a
    multiple of the model's state chunk (48 vs 64) is accepted and serves exactly."""
    args = ServerArgs(model_path=QWEN, disable_radix_cache=True, page_size=48)
    assert args.mamba_scheduler_strategy == "no_buffer"
    h = SchedulerHarness(QWEN, disable_radix_cache=True, page_size=48, chunked_prefill_size=96)
    try:
        prompt = token_ids(150, seed=240)
        out = h.generate(prompt, max_new_tokens=6)
        h.check_oracle(oracles[QWEN], prompt, out)
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("skip_clear", [False, True], ids=["clear", "negative-control"])
def test_reused_running_slot_is_cleared(skip_clear, oracles):
    """A request's running slot is freed at its finish and handed to the next request, which starts
    from zero state only because the forward stream clears it first."""
    h = _harness("no_buffer", disable_radix_cache=True)
    oracle = oracles[QWEN]
    try:
        first = h.submit(token_ids(150, seed=250), max_new_tokens=4)
        h.sched.step()
        used = h.sched.running[0].mamba_pool_idx
        h.run()
        assert h.outputs[first].finished_reason is not None
        prompt = token_ids(120, seed=251)
        rid = h.submit(prompt, max_new_tokens=4)
        with envs.SGLANG_TEST_SKIP_DEFERRED_CLEAR.override(skip_clear):
            h.sched.step()
            assert h.sched.running[0].mamba_pool_idx == used, "the slot is reused"
            h.run()
        err = h.check_oracle(oracle, prompt, h.outputs[rid], tol=10.0)
        if skip_clear:
            assert err > 1e-2, f"without the clear the stale state must show ({err:.1e})"
        else:
            assert err <= 1e-4
    finally:
        h.shutdown()


def _stop_while_another_decodes(prompt_a: list[int], stop: int, total_tokens: int | None):
    """A stops on its 9th token (under overlap the next step, already launched, feeds it that token, so
    its release waits for that step); B decodes on. Returns the harness, A's and B's outputs and the KV
    in use when A's release was deferred."""
    kw = {} if total_tokens is None else {"max_total_tokens": total_tokens}
    h = _harness("extra_buffer", **kw)
    prompt_b = token_ids(64, seed=271)
    rb = h.submit(prompt_b, max_new_tokens=60)
    ra = h.submit(prompt_a, max_new_tokens=40, stop_token_ids=[stop])
    sched, used = h.sched, None
    a = sched.reqs_by_rid[ra]
    while sched.step():
        if a.release_deferred and used is None:
            used = sched.token_allocator.size - sched.token_allocator.available_size()
    h.collect()
    return h, h.outputs[ra], h.outputs[rb], prompt_b, used


def test_a_deferred_release_does_not_cost_a_running_request(oracles):
    """With the KV pool exactly as full as it is while A's release waits, B's next decode step finds no
    page: it must wait for that step's processing to return A's pages, not be aborted (B alone) or
    retracted."""
    oracle = oracles[QWEN]
    prompt_a, stop = prompt_with_unique_token(oracle, 64, 9)
    h, _, _, _, used = _stop_while_another_decodes(prompt_a, stop, None)
    h.shutdown()
    assert used is not None, "A's release was not deferred"
    h, out_a, out_b, prompt_b, _ = _stop_while_another_decodes(prompt_a, stop, used)
    try:
        assert out_a.finished_reason == {"type": "stop", "matched": stop}
        assert out_b.finished_reason == {"type": "length", "length": 60}, out_b.finished_reason
        h.check_oracle(oracle, prompt_b, out_b)
        h.flush_and_check_empty()
    finally:
        h.shutdown()


def test_matched_request_not_admitted_holds_nothing(oracles):
    """extra_buffer (one track slot without overlap) with 5 slots: prompt A's checkpoint is cached and
    two short requests hold two slots each; a hit on A must wait for room. While it waits it holds no
    slot and no lock (its failed admission did not evict A either: that could not have made enough
    room), and the accounting is exact."""
    h = _harness("extra_buffer", max_mamba_cache_size=5, disable_overlap_schedule=True)
    try:
        a = token_ids(130, seed=260)
        h.generate(a, max_new_tokens=1)
        # Shorter than a chunk and than the first decode boundary: they take no snapshot.
        running = h.submit(token_ids(50, seed=261), max_new_tokens=10)
        other = h.submit(token_ids(40, seed=262), max_new_tokens=10)
        h.sched.step()
        assert len(h.sched.running) == 2
        # A left checkpoints at 128 (its prefill snapshot) and 130 (its final state); the second short
        # request's admission evicted the older one.
        node = h.sched.tree_cache.match_prefix(a).last_device_node
        assert node.mamba_value is not None and node.path_len() == 130
        assert len(h.sched.tree_cache.held_mamba_slots()) == 1
        prompt = a + token_ids(20, seed=263)
        rid = h.submit(prompt, max_new_tokens=3)
        h.sched.step()
        waiting = next(r for r in h.sched.waiting_queue if r.rid == rid)
        assert waiting.mamba_pool_idx is None and waiting.mamba_ping_pong_track_buffer is None
        assert waiting.last_node is None and waiting.mamba_cow_src_index is None
        assert node.mamba_lock_ref == 0
        h.sched.check_integrity()
        h.run()
        assert h.outputs[running].finished_reason is not None
        assert h.outputs[other].finished_reason is not None
        out = h.outputs[rid]
        h.check_oracle(oracles[QWEN], prompt, out)
        assert out.cached_tokens == 130
        h.flush_and_check_empty()
    finally:
        h.shutdown()
