"""The hierarchical cache's host tier (`--enable-hierarchical-cache`, mem_cache/hiradix_cache.py): a
conversation whose checkpoint the device tree evicted is loaded back from host on its next turn and
gives the oracle's logprobs; without the load's state copy it does not (negative control); a float8 KV
cache goes to host and back exactly; the flags' refusals. The all-strategies / all-policies sweep and the
random pressure workload are nightly (test_hicache_nightly.py)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.hiradix_cache import HiMambaRadixCache
from sglang.srt.mem_cache.host_pool import HostPools
from sglang.srt.server_args import ServerArgsError, prepare_server_args
from sglang.test.ci_register import register_cpu_ci
from sglang.test.hicache_checks import (
    aborted_chunk_snapshot_then_host_load,
    evicted_conversation_hits_host,
    exact_repeat_hits_lower_tiers,
    hicache_harness,
    snapshot_dropped_before_its_copy_ran,
)
from sglang.test.scheduler_harness import ORACLE_TOL, token_ids

register_cpu_ci(est_time=14, suite="per-commit-cpu")

PRESET = ["--model-path", "tiny-qwen3-next"]


def test_a_conversation_evicted_to_host_hits_it_and_matches_the_oracle(oracles):
    """Device pool of 6 slots, 8 other conversations in between: the first one's checkpoints leave the
    device; its next turn loads them from host (cached tokens = the whole first turn but its last
    token) and its logprobs equal the transformers oracle's within 1e-4 (float32; measured ~2e-6, the
    same as a cold prefill's own error)."""
    r = evicted_conversation_hits_host(oracles, "tiny-qwen3-next", "extra_buffer_lazy", "write_through")
    assert r["cached"] == r["first_turn_len"] - 1
    assert r["loaded_states"] == 1 and r["evicted_from_device"]
    assert r["residency_after_hit"] == "both", r  # loaded back to the device, still on host
    assert r["oracle_err"] <= ORACLE_TOL


def test_without_the_state_load_the_hit_is_wrong(oracles, monkeypatch):
    """Negative control: the load copies the KV but not the state snapshot; the hit then resumes from a
    stale slot and the logprobs leave the oracle by far more than the tolerance."""
    monkeypatch.setattr(HostPools, "load_states", lambda self, host_slots, device_slots: None)
    with pytest.raises(AssertionError, match="dlogprob"):
        evicted_conversation_hits_host(oracles, "tiny-qwen3-next", "extra_buffer_lazy", "write_through")


def test_a_pending_snapshot_copy_runs_in_order_with_a_host_load(oracles):
    """Review finding 1 (issue 58): a `no_buffer` snapshot copy (running slot R -> checkpoint S) pending
    when its chunked request is aborted, and a host load handed R in the same batch. The copy and the
    load run in recorded order (copy first), so S holds X's first chunk and Y, which hits S, matches the
    oracle within 1e-4 (measured ~2e-6). With the copy run after the host copies S held A's state:
    off by 5.15."""
    r = aborted_chunk_snapshot_then_host_load(oracles)
    assert r["loads"] == 1 and r["cached_y"] == 64, r
    assert r["err_a"] <= ORACLE_TOL and r["err_y"] <= ORACLE_TOL, r


def test_a_snapshot_dropped_with_its_copy_pending_is_backed_up(oracles):
    """Review item 5: `write_back` used to skip the backup of a `no_buffer` snapshot dropped before its
    state copy was sealed (`backups_skipped_unwritten`), though the copy sits in the same ordered list
    before the backup. Now it is backed up and Y, X's first chunk + new tokens, hits it from host (64
    cached) within 1e-4 of the oracle (measured 2.3e-6). Before: no backup, no load, 0 cached."""
    r = snapshot_dropped_before_its_copy_ran(oracles)
    assert r["state_copies"] == 1 and r["evicted"] >= 1, r
    assert r["backups"] == 1 and r["loads"] == 1 and r["cached_y"] == 64, r
    assert r["err_y"] <= ORACLE_TOL, r


@pytest.mark.parametrize("strategy, page, prompt_len", [("extra_buffer_lazy", 16, 192), ("extra_buffer", 1, 200)])
def test_an_exact_repeat_hits_host_and_disk_as_deep_as_the_device(strategy, page, prompt_len, tmp_path):
    """Security review 11, finding 13: a prompt served with one new token, then repeated (the device
    hits its snapshot above the prompt's end: 128 of 192, 192 of 200), then repeated once the device
    lost it (host) and once a flush emptied device and host (disk): both hit as deep as the device and
    give the reference's greedy tokens, logprobs within 1e-5 (float32 summation order of a resumed
    against a cold prefill; measured ~1.4e-6; a wrong state errs by > 0.5). Before: the backup of that
    snapshot was skipped as covered by the prompt end's, which no exact repeat can resume from: 0 cached
    from host and disk. The repeat point's disk entry is state-only (review: it was a second whole-path
    entry, 1.76x the disk bytes of a prompt served in one batch)."""
    r = exact_repeat_hits_lower_tiers("tiny-qwen3-next", strategy, str(tmp_path), prompt_len, page_size=page)
    depth = (prompt_len - 1) // 64 * 64  # (the cache chunk: GDN's 64, both page sizes)
    assert r["device"][0] == r["host"][0] == r["disk"][0] == depth, r
    # On disk the repeat point is state-only (its KV read from the prompt end's entry): its file is the
    # prompt end's less that entry's KV, within 4 KiB of pickle framing (its own KV would be depth x
    # token_bytes = 32-48 KiB more; measured 18,725 vs 68,253 bytes, was ~51,700: 1.76x the disk bytes).
    (end, end_bytes, end_state_only), (up, up_bytes, up_state_only) = r["entries"]
    assert (end, up, end_state_only, up_state_only) == (prompt_len // page * page, depth, False, True), r
    assert up_bytes < end_bytes - end * r["token_bytes"] + 4096, r
    assert r["loads"] == 1 and r["reads"] == 1, r
    ref = r["ref"]
    for tier in ("device", "host", "disk"):
        assert r[tier][1] == ref[1], tier
        assert max(abs(x - y) for x, y in zip(r[tier][2], ref[2], strict=True)) < 1e-5, tier


def test_without_the_repeat_point_backup_an_exact_repeat_misses(tmp_path, monkeypatch):
    """Negative control: with the snapshot above a backed-up prompt end skipped as covered again, the
    repeat finds nothing on host or disk."""
    monkeypatch.setattr(HiMambaRadixCache, "_checkpoint_above", lambda self, node: None)
    r = exact_repeat_hits_lower_tiers("tiny-qwen3-next", "extra_buffer_lazy", str(tmp_path), 192, page_size=16)
    assert r["device"][0] == 128 and r["host"][0] == r["disk"][0] == 0, r


def test_a_float8_kv_cache_is_backed_up_and_loaded_back_exactly():
    """Review finding 3: with `--kv-cache-dtype fp8_e4m3` the first backup raised NotImplementedError (torch
    has no float8 `index_copy_`). A conversation pushed off the device (160 KV tokens, 2 other prompts)
    hits its turn from host: the loaded float8 KV and state give what a cold prefill of the same prompt
    gives, within float32 summation order (1e-5; measured ~2e-6; KV read wrong errs by the float8 error,
    ~1e-2, or far more)."""
    h = hicache_harness("tiny-qwen3-next", "extra_buffer_lazy", "write_through", kv_cache_dtype="fp8_e4m3",
                        max_total_tokens=160)  # fmt: skip
    try:
        tree = h.sched.tree_cache
        assert tree.controller.host.k_buffer[0].dtype == torch.float8_e4m3fn
        a = token_ids(64, seed=1)
        turn1 = a + h.generate(a, max_new_tokens=2).output_ids
        for i in range(2):
            h.generate(token_ids(100, seed=10 + i), max_new_tokens=1)
        prompt = turn1 + token_ids(8, seed=99)
        hit = h.generate(prompt, max_new_tokens=4)
        h.sched.check_integrity()
        assert tree.controller.stats["load_states"] == 1 and hit.cached_tokens == len(turn1) - 1
        assert tree.controller.stats["load_tokens"] == len(turn1) - 1
        h.flush_and_check_empty()
        cold = h.generate(prompt, max_new_tokens=4)
    finally:
        h.shutdown()
    assert cold.cached_tokens == 0 and hit.output_ids == cold.output_ids
    assert max(abs(x - y) for x, y in zip(hit.logprobs, cold.logprobs, strict=True)) < 1e-5


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--enable-hierarchical-cache", "--disable-radix-cache"],
            "^--enable-hierarchical-cache needs the radix",
        ),
        (
            ["--hicache-storage-backend", "file"],
            "^--hicache-storage-backend needs --enable-hierarchical-cache",
        ),
        (["--hicache-storage-backend", "mooncake"], "^--hicache-storage-backend mooncake is not supported"),
        (["--hicache-write-policy", "write_around"], "^--hicache-write-policy must be one of"),
        (["--hicache-io-backend", "mmap"], "^--hicache-io-backend must be one of"),
        (["--hicache-ratio", "0.5"], "^--hicache-ratio must be at least 1"),
        (["--hicache-size", "-1"], "^--hicache-size must be"),
    ],
)
def test_bad_flags_are_refused_in_one_sentence(argv, words):
    with pytest.raises(ServerArgsError, match=words):
        prepare_server_args(argv + PRESET)


def test_flags_take_upstream_names_and_defaults():
    args = prepare_server_args(PRESET)
    assert (args.enable_hierarchical_cache, args.hicache_ratio, args.hicache_size) == (False, 2.0, 0)
    assert (args.hicache_write_policy, args.hicache_io_backend, args.hicache_storage_backend) == (
        "write_through",
        "kernel",
        None,
    )
    args = prepare_server_args(PRESET + ["--enable-hicache", "--hicache-write-policy", "write_back"])
    assert args.enable_hierarchical_cache and args.hicache_write_policy == "write_back"


def test_a_host_tier_smaller_than_the_device_is_a_startup_error():
    """--hicache-size too small for the device pools: one sentence naming the flag (upstream's rule: the
    host tier holds at least what the device does)."""

    class Pool:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    kv = Pool(size=1 << 20, page_size=1, k_buffer=[torch.zeros(1 << 20, 64, 64, device="meta")], v_buffer=[])
    mp = Pool(
        size=64,
        conv_state=torch.zeros(1, 65, 4, device="meta"),
        ssm_state=torch.zeros(1, 65, 4, device="meta"),
    )
    with pytest.raises(ValueError, match="^--hicache-size 1 gives a host tier of"):
        HostPools(kv, mp, ratio=2.0, size_gb=1)


def test_a_host_tier_larger_than_the_available_memory_is_a_startup_error(monkeypatch):
    """Review finding 6: a host tier over /proc/meminfo's MemAvailable is refused in one sentence naming
    both flags, before any allocation (here 2 x a 16 GiB device KV pool against 8 GiB available)."""
    from sglang.srt.mem_cache import host_pool

    class Pool:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    kv = Pool(size=1 << 20, page_size=1, k_buffer=[torch.zeros(1 << 20, 64, 64, device="meta")], v_buffer=[])
    mp = Pool(
        size=64,
        conv_state=torch.zeros(1, 65, 4, device="meta"),
        ssm_state=torch.zeros(1, 65, 4, device="meta"),
    )
    monkeypatch.setattr(host_pool, "available_host_bytes", lambda: 8 << 30)
    with pytest.raises(ValueError, match=r"^--hicache-ratio 2 gives a host tier of 32\.0 GB but only 8\.0 GB .* "
                       r"lower --hicache-ratio or --hicache-size\.$"):  # fmt: skip
        HostPools(kv, mp, ratio=2.0, size_gb=0)
