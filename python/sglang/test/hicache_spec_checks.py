"""Checks of speculative decoding (NGRAM, NEXTN) with the hierarchical cache's host tier
(`test/unit/mem_cache/test_hicache_spec*.py`): conversations whose checkpoints leave the device for host
and are hit again from there, decoding with verifies; every output is compared with plain decoding's and
with the same speculative server's without the host tier.

The tiny presets' random text gives drafts that are rarely accepted, so the drafts are the plain run's
own continuation (teacher drafts, one chain in three spoiled at its last draft: verifies accept 0..k),
which exercises the accepted positions' states, KV, MTP KV and track boundaries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sglang.srt.speculative.ngram_worker import NgramWorker
from sglang.test.hicache_checks import hicache_harness
from sglang.test.mtp_checks import teacher_drafts
from sglang.test.scheduler_harness import token_ids

NGRAM = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)
NEXTN = dict(speculative_algorithm="NEXTN")
# Beside `hicache_checks.hicache_harness`'s pools: verifies with the synchronous loop, prefill in chunks of
# 128 and a track boundary every 64 tokens (inside the scripts' decodes).
SPEC_HARNESS = dict(disable_overlap_schedule=True, chunked_prefill_size=128, mamba_track_interval=64)
Script = Callable[[Callable[[list[int], int], list[int]]], None]


def ngram_teacher_drafts(monkeypatch, truth: dict[tuple[int, ...], list[int]]) -> None:
    """NGRAM's drafts = the plain run's continuation of each request (by prompt, up to its budget), every
    third chain with its last draft spoiled."""
    calls = [0]

    def drafts(self, req) -> list[int]:
        seq = truth.get(tuple(req.origin_input_ids))
        if seq is None:
            return []
        done = len(req.origin_input_ids) + len(req.output_ids)
        budget = min(self.width - 1, req.sampling_params.max_new_tokens - len(req.output_ids) - 1)
        chain = seq[done : done + max(0, budget)]
        calls[0] += 1
        if chain and calls[0] % 3 == 0:
            chain[-1] = (chain[-1] + 1) % 500 + 3
        return chain

    monkeypatch.setattr(NgramWorker, "_draft", drafts)


def conversation_through_host(generate) -> None:
    """Turn 1 of conversation A (200 tokens, 70 out: a track boundary at 256 inside its decode); 8 other
    conversations push A's checkpoints off the device (6 state slots); turn 2 of A: turn 1, its answer
    and 20 new tokens (with the host tier: a host hit)."""
    a = token_ids(200, seed=1)
    turn1 = a + generate(a, 70)
    for i in range(8):
        generate(token_ids(300, seed=10 + i), 4)
    generate(turn1 + token_ids(20, seed=99), 40)


def evicted_while_verifying(generate, scale: int = 2) -> None:
    """Turn 1 of A (240 tokens in the tree at scale 2); B's decode (verifies) fills the 512-token KV pool
    (256 x scale) and evicts A's path while allocating a verify's KV: under write_back A is backed up to
    host then, from pages the verify is handed; turn 2 of A hits host."""
    a = token_ids(100 * scale, seed=1)
    turn1 = a + generate(a, 20 * scale)
    generate(token_ids(100 * scale, seed=2), 55 * scale)
    generate(turn1 + token_ids(20, seed=99), 15 * scale)


def small_evicted_while_verifying(generate) -> None:
    """`evicted_while_verifying` on a 256-token KV pool, with fewer decode steps (the per-commit case):
    B's prompt of 120 tokens leaves its decode 35 steps to evict A (120 tokens in the tree) in a
    verify's allocation. Without the verify's sealed copies A's turn 2 diverges here too (checked)."""
    a = token_ids(100, seed=1)
    turn1 = a + generate(a, 20)
    generate(token_ids(120, seed=2), 35)
    generate(turn1 + token_ids(20, seed=99), 15)


def demo_evicted_while_verifying(generate) -> None:
    """`evicted_while_verifying` on the demo model's held-out Python (its MTP layer was trained: drafts
    are accepted where its KV is right), sized for a 400-token KV pool."""
    from sglang.test.mtp_checks import held_out_prompts

    a, b, tail = held_out_prompts(3, 150)
    turn1 = a + generate(a, 40)
    generate(b, 100)
    generate(turn1 + tail[:20], 40)


def run_script(preset: str, strategy: str, hicache: bool, spec: dict, script: Script,
               truth: dict | None = None, **kw: Any) -> dict:  # fmt: skip
    """`script` on a small device pool (6 state slots, 2048 KV tokens unless `kw` says otherwise; the host
    tier, when on, 8 times the device), integrity checked after every request. With `truth` (prompt ->
    prompt + plain outputs) the drafts are teacher drafts. Returns the requests (prompt, outputs, cached
    tokens), the host tier's and the speculative worker's totals."""
    args = {**SPEC_HARNESS, "enable_hierarchical_cache": hicache, **kw, **spec}
    h = hicache_harness(preset, strategy, args.pop("hicache_write_policy", "write_through"), **args)
    requests = []

    def generate(prompt: list[int], new: int) -> list[int]:
        tree, worker = h.sched.tree_cache, h.sched.spec
        before = (dict(worker.stats) if worker else {}), (tree.controller.stats["load_states"] if hicache else 0)
        out = h.generate(prompt, max_new_tokens=new, return_logprob=False)
        h.sched.check_integrity()
        spec_stats = {k: v - before[0][k] for k, v in worker.stats.items()} if worker else {}
        loads = (tree.controller.stats["load_states"] if hicache else 0) - before[1]
        requests.append((prompt, out.output_ids, out.cached_tokens, spec_stats, loads))
        return out.output_ids

    try:
        with pytest.MonkeyPatch.context() as mp:
            if truth is not None and spec.get("speculative_algorithm") == "NGRAM":
                ngram_teacher_drafts(mp, truth)
            elif truth is not None and spec:
                teacher_drafts(mp, h, truth).__enter__()
            script(generate)
        tree, worker = h.sched.tree_cache, h.sched.spec
        out = {
            "requests": requests,
            "host": dict(tree.controller.stats) if hicache else {},
            "spec": dict(worker.stats) if worker is not None else {},
        }
        h.flush_and_check_empty()
        return out
    finally:
        h.shutdown()


def plain_spec_and_hicache(preset: str, strategy: str, spec: dict, script: Script, **kw: Any) -> dict:
    """`script` on three servers: plain decoding without the host tier, `spec` without it and `spec` with
    it (teacher drafts from the plain run's outputs)."""
    plain = run_script(preset, strategy, False, {}, script, **kw)
    truth = {tuple(r[0]): r[0] + r[1] for r in plain["requests"]}
    out = {"plain": plain}
    for name, hicache in (("spec", False), ("spec_hicache", True)):
        out[name] = run_script(preset, strategy, hicache, spec, script, truth=truth, **kw)
    return out


def host_copy_of_an_evicted_path(spec: dict, strategy: str) -> dict:
    """Turn 1 of A (200 + 40 tokens); B's decode (verifies, 110 tokens) on a 512-token KV pool evicts A
    under write_back, backing it up to host. Returns A's path length, how much of it the device still
    holds after B, and the positions whose host copy differs from the KV the device held after turn 1,
    in any layer (the MTP layer's among them: the last one of the pool)."""
    import torch

    h = hicache_harness("tiny-qwen3-next", strategy, "write_back", max_total_tokens=512, **SPEC_HARNESS, **spec)
    try:
        tree = h.sched.tree_cache
        pool = tree.host.kv_pool
        a = token_ids(200, seed=1)
        turn1 = a + h.generate(a, max_new_tokens=40, return_logprob=False).output_ids
        node = tree.match_prefix(turn1).last_device_node
        key, ns = node.path_key(), node.namespace
        dev = torch.tensor(node.path_value())
        before = [t[dev].clone() for t in (*pool.k_buffer, *pool.v_buffer)]
        h.generate(token_ids(200, seed=2), max_new_tokens=110, return_logprob=False)
        h.sched.check_integrity()
        tree.controller.wait()
        on_device = tree.match_prefix(turn1).last_device_node.path_len()
        host_node = tree._host_end(key, ns)
        assert host_node is not None, "A was not backed up"
        hidx = torch.tensor(host_node.path_value())
        host = (*tree.host.k_buffer, *tree.host.v_buffer)
        differs = set()
        for b, t in zip(before, host, strict=True):
            differs.update((t[hidx] != b).flatten(1).any(1).nonzero().flatten().tolist())
        out = {"path": len(key), "on_device_after": on_device, "differs": len(differs)}
        h.flush_and_check_empty()
        return out
    finally:
        h.shutdown()
