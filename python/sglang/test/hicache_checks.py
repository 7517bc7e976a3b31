"""Checks of the hierarchical cache's host tier, shared by test_hicache.py (per commit) and
test_hicache_nightly.py: a conversation evicted from the device and hit again from host, and a random
workload under device and host pressure with the integrity check after every step."""

from __future__ import annotations

import os
import random
from collections import Counter
from typing import Any

from sglang.test.scheduler_harness import SchedulerHarness, token_ids


def hicache_harness(preset: str, strategy: str, policy: str, **kw: Any) -> SchedulerHarness:
    args = dict(
        mamba_scheduler_strategy=strategy,
        max_mamba_cache_size=6,
        max_total_tokens=2048,
        max_running_requests=2,
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
        hicache_ratio=8,
    )
    args.update(kw)
    return SchedulerHarness(preset, **args)


def evicted_conversation_hits_host(
    oracles, preset: str, strategy: str, policy: str, selective_hits: int = 1, **kw: Any
) -> dict:
    """Turn 1 of conversation A; (write_through_selective: A's prefix is hit `selective_hits` times, once
    being its policy's threshold, the insert counting as the first hit); 8 other conversations push A's checkpoints off the device (6 slots); turn 2 of A
    (turn 1 + its answer + 20 new tokens) must hit from host. Checks the oracle (raises on a mismatch)
    and the integrity after every request; returns what the caller asserts."""
    h = hicache_harness(preset, strategy, policy, **kw)
    try:
        tree = h.sched.tree_cache
        a = token_ids(200, seed=1)
        first = h.generate(a, max_new_tokens=4)
        turn1 = a + first.output_ids
        node = tree.match_prefix(turn1).last_device_node
        residency_turn1 = None if node is tree.root else tree.residency(node)
        if policy == "write_through_selective":
            for i in range(selective_hits):
                h.generate(turn1 + token_ids(8, seed=50 + i), max_new_tokens=1)
        for i in range(8):
            h.generate(token_ids(300, seed=10 + i), max_new_tokens=4)
            h.sched.check_integrity()
        device_len = tree.match_prefix(turn1).last_device_node
        evicted = device_len is tree.root or device_len.path_len() < len(turn1) - 1
        prompt = turn1 + token_ids(20, seed=99)
        before = dict(tree.controller.stats)
        second = h.generate(prompt, max_new_tokens=6)
        h.sched.check_integrity()
        err = h.check_oracle(oracles[preset], prompt, second)
        loaded = tree.controller.stats["load_states"] - before.get("load_states", 0)
        node = tree.match_prefix(turn1).last_device_node  # the checkpoint loaded back, or a deeper one
        residency = None if node is tree.root else tree.residency(node)
        h.flush_and_check_empty()
        return {
            "cached": second.cached_tokens,
            "first_turn_len": len(turn1),
            "loaded_states": loaded,
            "evicted_from_device": evicted,
            "residency_after_hit": residency,
            "residency_after_turn1": residency_turn1,
            "oracle_err": err,
        }
    finally:
        h.shutdown()


def random_pressure_workload(
    oracles,
    preset: str,
    strategy: str,
    policy: str,
    seed: int,
    requests: int = 24,
    **kw: Any,
) -> dict:
    """Requests drawn from 6 conversations (continuations, repeats, new ones) on pools far smaller than
    the workload, the host tier only twice the device: device and host evictions both run. After every
    scheduler step: the host tier's identity and tree invariants, and whenever nothing is in flight (every
    step without overlap) the full walk of both tiers (`check_integrity`). Every request
    matches the oracle."""
    rng = random.Random(seed)
    kw.setdefault("hicache_ratio", 2)
    h = hicache_harness(preset, strategy, policy, **kw)
    sched, tree = h.sched, h.sched.tree_cache
    try:
        convs: list[list[int]] = [token_ids(rng.randint(60, 260), seed=1000 + i) for i in range(6)]
        jobs = []
        for _ in range(requests):
            c = rng.randrange(len(convs))
            prompt = convs[c] + token_ids(rng.randint(1, 40), seed=rng.randrange(10**6))
            jobs.append((h.submit(prompt, max_new_tokens=rng.randint(1, 12)), prompt, c))
            for _ in range(rng.randint(1, 4)):
                sched.step()
                _check_step(sched, tree)
            h.collect()
            for rid, p, ci in jobs:
                out = h.outputs[rid]
                if out.finished_reason is not None and len(p + out.output_ids) > len(convs[ci]):
                    convs[ci] = p + out.output_ids  # the conversation goes on from its latest turn
        while sched.step():
            _check_step(sched, tree)
        h.collect()
        sched.check_integrity()
        for rid, prompt, _ in jobs:
            h.check_oracle(oracles[preset], prompt, h.outputs[rid])
        stats = dict(tree.controller.stats)
        stats["cached_tokens"] = sum(h.outputs[rid].cached_tokens for rid, _, _ in jobs)
        h.flush_and_check_empty()
        return stats
    finally:
        h.shutdown()


def retraction_with_host_hits(oracles, preset: str, strategy: str) -> dict:
    """Six conversations served one by one (their checkpoints go to host), then their next turns all at
    once with long outputs on a KV pool of 700 tokens: decode retracts requests that hit from host, and
    they prefill again (hitting again). Host integrity after every step, the full walk at the end, and
    every request matches the oracle."""
    h = hicache_harness(preset, strategy, "write_through", max_total_tokens=700, max_running_requests=6,
                        max_mamba_cache_size=16)  # fmt: skip
    sched, tree = h.sched, h.sched.tree_cache
    try:
        convs = []
        for c in range(6):
            a = token_ids(150, seed=300 + c)
            convs.append(a + h.generate(a, max_new_tokens=1).output_ids)
        jobs = []
        for c, conv in enumerate(convs):
            prompt = conv + token_ids(10, seed=400 + c)
            jobs.append((h.submit(prompt, max_new_tokens=60), prompt))
        while sched.step():
            _check_step(sched, tree)
        h.collect()
        sched.check_integrity()
        for rid, prompt in jobs:
            h.check_oracle(oracles[preset], prompt, h.outputs[rid])
        out = {
            "retractions": sched.counters["num_retractions_total"],
            "loads": tree.controller.stats["load_states"],
            "cached": sum(h.outputs[rid].cached_tokens for rid, _ in jobs),
        }
        h.flush_and_check_empty()
        return out
    finally:
        h.shutdown()


def _check_step(sched, tree) -> None:
    tree.check_host_integrity()
    if not sched.in_flight:
        sched.check_integrity()


def disk_tier_survives_restart(oracles, preset: str, storage_dir: str) -> dict:
    """`--hicache-storage-backend file`: server 1 serves turn 1 of a conversation (its checkpoints go to
    host and disk), then one more request (whose batch runs the disk writes recorded with turn 1) and
    stops. Server 2, started on the same folder with empty device and host tiers, serves turn 2: the
    hit comes from disk. Checks the oracle (raises on a mismatch); returns what the caller asserts."""
    from sglang.srt.environ import envs

    with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(storage_dir):
        h = hicache_harness(preset, "extra_buffer_lazy", "write_through", hicache_storage_backend="file")
        try:
            a = token_ids(200, seed=1)
            turn1 = a + h.generate(a, max_new_tokens=4).output_ids
            h.generate(token_ids(30, seed=5), max_new_tokens=1)
            writes = h.sched.tree_cache.controller.stats["disk_writes"]
        finally:
            h.shutdown()
        h = hicache_harness(preset, "extra_buffer_lazy", "write_through", hicache_storage_backend="file")
        try:
            prompt = turn1 + token_ids(20, seed=99)
            out = h.generate(prompt, max_new_tokens=6)
            h.sched.check_integrity()
            err = h.check_oracle(oracles[preset], prompt, out)
            stats = dict(h.sched.tree_cache.controller.stats)
            h.flush_and_check_empty()
        finally:
            h.shutdown()
    return {"writes": writes, "reads": stats.get("disk_reads", 0), "cached": out.cached_tokens,
            "first_turn_len": len(turn1), "oracle_err": err}  # fmt: skip


def aborted_chunk_snapshot_then_host_load(oracles, preset: str = "tiny-qwen3-next") -> dict:
    """`no_buffer`, chunks of 64: request X's first chunk runs, its snapshot's state copy (running slot
    R -> checkpoint slot S) is recorded for the next batch; X is aborted (R freed); the next round a
    host hit of conversation A gets R as its load slot, so the next batch both loads into R and copies
    R -> S. Then Y (X's first chunk + new tokens) hits S. Y and A's turn 2 must match the oracle: the copy
    R -> S must run before the load into R (in recorded order). Returns what the caller asserts."""
    h = hicache_harness(preset, "no_buffer", "write_through", chunked_prefill_size=64)
    sched, tree = h.sched, h.sched.tree_cache
    try:
        a = token_ids(200, seed=1)
        turn1 = a + h.generate(a, max_new_tokens=4).output_ids
        for i in range(8):
            h.generate(token_ids(300, seed=10 + i), max_new_tokens=4)
        x = token_ids(300, seed=77)
        rx = h.submit(x, max_new_tokens=4)
        sched.step()  # X's first chunk; its snapshot's state copy waits for the next batch
        sched.abort_request(rx)
        h.collect()
        prompt = turn1 + token_ids(20, seed=99)
        loads = tree.controller.stats["load_states"]
        second = h.generate(prompt, max_new_tokens=4)
        loads = tree.controller.stats["load_states"] - loads
        err_a = h.check_oracle(oracles[preset], prompt, second)
        y = x[:64] + token_ids(30, seed=5)
        out = h.generate(y, max_new_tokens=6)
        sched.check_integrity()
        err_y = h.check_oracle(oracles[preset], y, out)
        h.flush_and_check_empty()
        return {"loads": loads, "cached_y": out.cached_tokens, "err_a": err_a, "err_y": err_y}
    finally:
        h.shutdown()


def disk_tier_after_flush_and_lost_files(oracles, preset: str, storage_dir: str) -> dict:
    """`file` backend, each turn continuing the conversation: turn 1, then at once /flush_cache, which
    drops turn 1's disk writes (recorded, not yet run): turn 2 finds no entry; one more request runs
    turn 2's writes, a flush, turn 3 hits from disk; every file of the folder deleted by hand and a
    flush: turn 4's read fails and the hit is not taken. No step raises; every turn matches the oracle.
    Returns each turn's (cached tokens, disk reads, disk read errors, oracle error)."""
    from sglang.srt.environ import envs

    with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(storage_dir):
        h = hicache_harness(preset, "extra_buffer_lazy", "write_through", hicache_storage_backend="file")
        try:
            tree, conv, turns = h.sched.tree_cache, token_ids(200, seed=1), []
            for turn in range(4):
                if turn == 3:
                    for name in os.listdir(tree.storage.dir):
                        os.unlink(os.path.join(tree.storage.dir, name))
                if turn > 0:
                    assert h.sched.flush_cache()[0]
                before = dict(tree.controller.stats)
                out = h.generate(conv, max_new_tokens=4)
                err = h.check_oracle(oracles[preset], conv, out)
                st = tree.controller.stats
                turns.append((out.cached_tokens, st["disk_reads"] - before.get("disk_reads", 0),
                              st["disk_read_errors"] - before.get("disk_read_errors", 0), err))  # fmt: skip
                if turn >= 1:
                    h.generate(token_ids(30, seed=5 + turn), max_new_tokens=1)  # runs this turn's writes
                conv = conv + out.output_ids + token_ids(10, seed=90 + turn)
            h.sched.check_integrity()
            h.flush_and_check_empty()
        finally:
            h.shutdown()
    return {"turns": turns}


def disk_tier_after_a_weight_update(preset: str, storage_dir: str, new_weights: str) -> dict:
    """`file` backend: turn 1 written to disk; /update_weights_from_tensor to the checkpoint `new_weights`
    with flush_cache; turn 2 must not be served from the old weights' entries: it matches the new
    weights' oracle."""
    from sglang.srt.environ import envs
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.test.model_checks import served_tensors
    from sglang.test.reference import ReferenceModel

    tensors, oracle = served_tensors(new_weights), ReferenceModel(new_weights)
    with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(storage_dir):
        h = hicache_harness(preset, "extra_buffer_lazy", "write_through", hicache_storage_backend="file")
        try:
            tree = h.sched.tree_cache
            a = token_ids(200, seed=1)
            turn1 = a + h.generate(a, max_new_tokens=4).output_ids
            h.generate(token_ids(30, seed=5), max_new_tokens=1)  # its batch runs turn 1's disk writes
            entries = len(tree.storage.index)
            payload = [MultiprocessingSerializer.serialize(list(tensors.items()))]
            rep = h.control_reply(UpdateWeightsFromTensorReqInput(payload, flush_cache=True))
            assert rep.success, rep.message
            prompt = turn1 + token_ids(20, seed=99)
            out = h.generate(prompt, max_new_tokens=6)
            err = h.check_oracle(oracle, prompt, out)
            stats = dict(tree.controller.stats)
            h.flush_and_check_empty()
        finally:
            h.shutdown()
    return {"entries_before": entries, "cached": out.cached_tokens, "reads": stats.get("disk_reads", 0),
            "oracle_err": err}  # fmt: skip


def host_hit_and_cold_run(oracle, preset: str, tol: float, **kw: Any) -> dict:
    """The overlap schedule and `write_back` (kw: the device, e.g. device="cuda"): turn 1 of A; 8 other
    conversations push A off the device (backed up to host as evicted); turn 2 of A hits host. Then the
    cache is flushed and turn 2's prompt runs cold. Both checked against the oracle within `tol` (float32);
    returns what the caller asserts."""
    args = dict(disable_overlap_schedule=False, dtype="float32")
    args.update(kw)
    h = hicache_harness(preset, "extra_buffer", "write_back", **args)
    try:
        tree = h.sched.tree_cache
        a = token_ids(200, seed=1)
        turn1 = a + h.generate(a, max_new_tokens=4).output_ids
        for i in range(8):
            h.generate(token_ids(300, seed=10 + i), max_new_tokens=4)
            h.sched.check_integrity()
        prompt = turn1 + token_ids(20, seed=99)
        before = dict(tree.controller.stats)
        hit = h.generate(prompt, max_new_tokens=6)
        h.sched.check_integrity()
        h.check_oracle(oracle, prompt, hit, tol)
        stats = tree.controller.stats
        loaded = stats["load_states"] - before.get("load_states", 0)
        backups = stats["backup_states"]
        h.flush_and_check_empty()
        cold = h.generate(prompt, max_new_tokens=6)
        h.check_oracle(oracle, prompt, cold, tol)
        dlp = max((abs(x - y) for x, y in zip(hit.logprobs, cold.logprobs, strict=True)), default=0.0)
        h.flush_and_check_empty()
        return {
            "first_turn_len": len(turn1),
            "cached_hit": hit.cached_tokens,
            "cached_cold": cold.cached_tokens,
            "loaded_states": loaded,
            "backups": backups,
            "hit_tokens": hit.output_ids,
            "cold_tokens": cold.output_ids,
            "max_dlogprob_vs_cold": dlp,
        }
    finally:
        h.shutdown()


def snapshot_dropped_before_its_copy_ran(oracles, preset: str = "tiny-qwen3-next") -> dict:
    """`no_buffer`, `write_back`, chunks of 64: request X's first chunk runs and its snapshot's state copy
    (running slot -> checkpoint S) is recorded, not yet run; X is aborted and every device checkpoint is
    evicted before the next batch, so S is dropped (write_back: backed up) with its copy still pending.
    The backup is recorded after the copy in the one ordered list, so it reads S written. Then Y (X's
    first chunk + new tokens) must hit S from host and match the oracle. Returns what the caller asserts."""
    h = hicache_harness(preset, "no_buffer", "write_back", chunked_prefill_size=64)
    sched, tree = h.sched, h.sched.tree_cache
    try:
        x = token_ids(300, seed=77)
        rx = h.submit(x, max_new_tokens=4)
        sched.step()  # X's first chunk; its snapshot's state copy is recorded for the next batch
        sched.abort_request(rx)
        h.collect()
        pending = tree.controller.stats["state_copies"]
        evicted = tree.evict_mamba(1 << 20)
        backups = tree.controller.stats["backup_states"]
        y = x[:64] + token_ids(30, seed=5)
        loads = tree.controller.stats["load_states"]
        out = h.generate(y, max_new_tokens=6)
        sched.check_integrity()
        err = h.check_oracle(oracles[preset], y, out)
        h.flush_and_check_empty()
        return {
            "state_copies": pending,
            "evicted": evicted,
            "backups": backups,
            "loads": tree.controller.stats["load_states"] - loads,
            "cached_y": out.cached_tokens,
            "err_y": err,
        }
    finally:
        h.shutdown()


def disk_lookups_while_waiting(oracles, preset: str, storage_dir: str) -> dict:
    """The disk tier's agreement while a request waits (TP's all-gather stood in for by one rank's
    `storage.gather`, counted): server 1 writes conversation A's turn 1 to disk; server 2 (same folder,
    512 KV tokens) runs B (300 tokens, 40 decode steps) and A's turn 2, queued behind it, finds no room
    for its 224 tokens until B finishes: it is tried at every step. Checks the oracle (raises on a
    mismatch); returns the counts the caller asserts."""
    from sglang.srt.environ import envs

    with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(storage_dir):
        h = hicache_harness(preset, "extra_buffer_lazy", "write_through", hicache_storage_backend="file")
        try:
            a = token_ids(200, seed=1)
            turn1 = a + h.generate(a, max_new_tokens=4).output_ids
            h.generate(token_ids(30, seed=5), max_new_tokens=1)  # (its batch runs turn 1's disk writes)
        finally:
            h.shutdown()
        h = hicache_harness(preset, "extra_buffer_lazy", "write_through", hicache_storage_backend="file",
                            max_total_tokens=512)  # fmt: skip
        try:
            storage = h.sched.tree_cache.storage
            prompt = turn1 + token_ids(20, seed=99)
            asked: list[bool] = []  # per `deepest`: whether it was for A's turn 2
            gathers: list[str] = []  # A's turn 2's all-gathers: "lookup" (`deepest`) or "read" (`stage`)
            deepest = storage.deepest

            def counted_deepest(key, namespace):
                asked.append(list(key[:200]) == a)
                return deepest(key, namespace)

            def gather(value):
                if asked[-1]:
                    gathers.append("read" if isinstance(value, bool) else "lookup")
                return [value]

            storage.deepest, storage.gather = counted_deepest, gather
            h.submit(token_ids(300, seed=2), max_new_tokens=40)
            rid = h.submit(prompt, max_new_tokens=6)
            h.run()
            out = h.outputs[rid]
            h.sched.check_integrity()
            err = h.check_oracle(oracles[preset], prompt, out)
            h.flush_and_check_empty()
        finally:
            h.shutdown()
    return {"asked": sum(asked), "gathers": Counter(gathers), "cached": out.cached_tokens,
            "first_turn_len": len(turn1), "oracle_err": err,
            "reused": storage.stats["disk_lookups_reused"]}  # fmt: skip



def exact_repeat_hits_lower_tiers(preset: str, strategy: str, storage_dir: str, prompt_len: int,
                                  max_new_tokens: int = 4, **kw: Any) -> dict:  # fmt: skip
    """`file` backend, write_through (security review 11, finding 13): prompt V with one new token, so
    its prefill snapshot and its final state reach the tree, due for backup, in one batch; V again (a
    device hit: a match leaves the last token to recompute, so it resumes from the deepest checkpoint
    above V's end); one more request (its batch runs the disk writes); every device checkpoint and KV
    page evicted (the host holds them): V again, from host; a flush (device and host emptied, the disk
    keeps its entries): V again, from disk. The reference: V cold in a namespace of its own. Returns, per
    run ("ref", "device", "host", "disk"), its cached tokens, output ids and logprobs, the host loads
    and disk reads the last two took, and V's disk entries once written (length, bytes, state-only),
    deepest first."""
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.disk_tier import entry_name

    with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(storage_dir):
        h = hicache_harness(preset, strategy, "write_through", hicache_storage_backend="file", **kw)
        try:
            tree, v, runs = h.sched.tree_cache, token_ids(prompt_len, seed=3), {}
            runs["ref"] = h.generate(v, max_new_tokens, extra_key="reference")
            assert h.generate(v, max_new_tokens=1).cached_tokens == 0
            runs["device"] = h.generate(v, max_new_tokens)
            h.generate(token_ids(20, seed=5), max_new_tokens=1)
            index = tree.storage.index  # (V's entries: (length, bytes, state-only), deepest first)
            named = {entry_name(v[:n], None): n for n in range(1, prompt_len + 1)}
            entries = sorted(((e[0], e[1], e[2] is not None) for k, e in index.items() if k in named),
                             reverse=True)  # fmt: skip
            tree.evict(1 << 30, 1 << 30)
            assert not tree.match_prefix(v).device_indices, "V is still on the device"
            stats = tree.controller.stats
            loads = stats["load_states"]
            runs["host"] = h.generate(v, max_new_tokens)
            loads = stats["load_states"] - loads
            h.sched.check_integrity()
            assert h.sched.flush_cache()[0]
            reads = stats["disk_reads"]
            runs["disk"] = h.generate(v, max_new_tokens)
            reads = stats["disk_reads"] - reads
            h.sched.check_integrity()
            h.flush_and_check_empty()
        finally:
            h.shutdown()
    out = {k: (r.cached_tokens, r.output_ids, r.logprobs) for k, r in runs.items()}
    return {**out, "loads": loads, "reads": reads, "entries": entries, "token_bytes": tree.host.token_bytes}
