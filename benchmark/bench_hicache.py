"""The hierarchical cache's host tier (issue 58), CPU, in-process scheduler: a multi-turn workload of
--conversations conversations, --factor times more than the device state pool holds
(--max-mamba-cache-size = conversations / factor, and a KV pool of about as many conversations), served
turn by turn, round-robin (turn t of every conversation, then turn t + 1), so between two turns of one
conversation all the others pass through the device pools. Both servers (with and without the host tier)
run side by side, each request sent to one and then to the other, so the machine's load weighs on both
alike. Each turn is the conversation so far, its
previous answer and --turn-tokens new tokens; each request generates --new-tokens tokens. One request at
a time, so TTFT is the time from its submission to its first token, without queueing.

Reports, with the host tier (--enable-hierarchical-cache) and without:
- hit rate: cached tokens over prompt tokens, for turns 2 and later (turn 1 has nothing to hit);
- TTFT p50 (and p90), turns 2 and later, in ms;
- the host tier's copies (KV tokens and states backed up and loaded) and its evictions (KV tokens and
  states the host tier dropped to make room: backed up minus held at the end);
- bytes written: to host (`host_bytes_written`: the backups' KV tokens and states at the host pools'
  bytes per token and per state) and, with --disk (the `file` storage backend in a temporary folder),
  to disk (`disk_bytes_written`: the entries' file bytes; `disk_entries`, of which state-only).
The default --hicache-ratio 16 holds about two checkpoints per conversation out of the ~6 that
write_through backs up: the host tier evicts, the case a host tier is sized for; it drops interior
checkpoints before any conversation's deepest one (mem_cache/host_tree.py), so every conversation still
resumes from host. --hicache-ratio 64 holds them all (no host eviction).

    python benchmark/bench_hicache.py [--conversations 64] [--factor 8] [--turns 3] [--first-turn 512]
                                      [--turn-tokens 64] [--new-tokens 8]
                                      [--strategy extra_buffer_lazy] [--policy write_through]
                                      [--hicache-ratio 16] [--disk]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from sglang.test.scheduler_harness import SchedulerHarness, token_ids


def _harness(args: argparse.Namespace, hicache: bool) -> SchedulerHarness:
    slots = max(2, args.conversations // args.factor)
    per_conv = args.first_turn + args.turns * (args.turn_tokens + args.new_tokens)
    return SchedulerHarness(
        "tiny-qwen3-next",
        mamba_scheduler_strategy=args.strategy,
        max_mamba_cache_size=slots,
        max_total_tokens=(slots + 2) * per_conv,
        max_running_requests=1,
        enable_hierarchical_cache=hicache,
        hicache_write_policy=args.policy,
        hicache_ratio=args.hicache_ratio,
        hicache_storage_backend="file" if hicache and args.disk else None,
    )


def _serve(h: SchedulerHarness, prompt: list[int], new_tokens: int) -> tuple[float, list[int], int]:
    """One request alone: (TTFT in s, its output, its cached tokens)."""
    t0 = time.perf_counter()
    rid = h.submit(prompt, max_new_tokens=new_tokens, return_logprob=False)
    out, first = h.outputs[rid], None
    while h.sched.step():
        h.collect()
        if first is None and out.output_ids:
            first = time.perf_counter() - t0
    h.collect()
    return (first if first is not None else time.perf_counter() - t0), out.output_ids, out.cached_tokens


def _bytes_written(h: SchedulerHarness) -> dict:
    """Host and disk bytes the tier wrote (host: from the backups' counts; disk: the folder's files, the
    budget large enough that none was deleted, where the tier does not count them)."""
    tree = h.sched.tree_cache
    stats, host = tree.controller.stats, tree.host
    host_bytes = stats["backup_tokens"] * host.token_bytes + stats["backup_states"] * host.slot_bytes
    out = {"host_bytes_written": host_bytes}
    if tree.storage is not None:
        files = [e for e in os.scandir(tree.storage.dir) if e.name.endswith(".pt")]
        out["disk_bytes_written"] = stats.get("disk_bytes_written") or sum(e.stat().st_size for e in files)
        out["disk_entries"] = len(files)
        out["disk_entries_state_only"] = sum("+" in e.name for e in files)
        assert not stats["disk_evictions"] and not stats["disk_evictions_low_space"], "raise the disk budget"
    return out


def run(args: argparse.Namespace) -> list[dict]:
    """Both servers side by side, each request sent to one and then the other, so the machine's load
    weighs on both alike."""
    servers = {False: _harness(args, False), True: _harness(args, True)}
    convs = {
        k: [token_ids(args.first_turn, seed=10_000 + c) for c in range(args.conversations)] for k in servers
    }
    ttft = {k: [] for k in servers}
    prompt_tokens, cached = dict.fromkeys(servers, 0), dict.fromkeys(servers, 0)
    for turn in range(args.turns):
        for c in range(args.conversations):
            for k, h in servers.items():
                new = [] if turn == 0 else token_ids(args.turn_tokens, seed=c * 100 + turn)
                prompt = convs[k][c] + new
                first, output, hit = _serve(h, prompt, args.new_tokens)
                convs[k][c] = prompt + output
                if turn > 0:
                    ttft[k].append(first * 1000)
                    prompt_tokens[k] += len(prompt)
                    cached[k] += hit
    out = []
    for k, h in servers.items():
        t = sorted(ttft[k])
        stats = dict(h.sched.tree_cache.controller.stats) if k else {}
        if k:  # (every backup inserts its KV tokens and one state into the host tree; no disk tier here)
            host_tree = h.sched.tree_cache.host_tree
            stats["host_evicted_tokens"] = stats.get("backup_tokens", 0) - host_tree.total_size()
            stats["host_evicted_states"] = stats.get("backup_states", 0) - host_tree.mamba_total_size()
            stats.update(_bytes_written(h))
        out.append(
            {
                "hicache": k,
                "device_state_slots": h.server_args.max_mamba_cache_size,
                "device_kv_tokens": h.server_args.max_total_tokens,
                "hit_rate": round(cached[k] / max(1, prompt_tokens[k]), 3),
                "ttft_p50_ms": round(statistics.median(t), 1),
                "ttft_p90_ms": round(t[int(0.9 * (len(t) - 1))], 1),
                "host_copies": stats,
            }
        )
        h.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--factor", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--first-turn", type=int, default=512)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--strategy", default="extra_buffer_lazy")
    p.add_argument("--policy", default="write_through")
    p.add_argument("--disk", action="store_true", help="Add the file storage backend's disk tier (a temporary folder).")
    p.add_argument(
        "--hicache-ratio",
        type=float,
        default=16,
        help="Host tier over device pools; the default evicts from host (interior checkpoints first: see "
        "above), 64 holds every checkpoint write_through backs up.",
    )
    args = p.parse_args()
    if args.disk:
        folder = tempfile.TemporaryDirectory(prefix="bench_hicache_")
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = folder.name
        if "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE" not in os.environ:  # (with it, MAX_GB is refused)
            os.environ.setdefault("SGLANG_HICACHE_FILE_BACKEND_MAX_GB", "64")
    results = run(args)
    for r in results:
        print(json.dumps(r))
    off, on = results
    print(
        f"hit rate {off['hit_rate']} -> {on['hit_rate']}; TTFT p50 {off['ttft_p50_ms']} -> "
        f"{on['ttft_p50_ms']} ms ({off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x lower); host evictions "
        f"{on['host_copies'].get('host_evicted_states', 0)} states, {on['host_copies'].get('host_evicted_tokens', 0)} "
        f"KV tokens; written {on['host_copies']['host_bytes_written']:,} bytes to host, "
        f"{on['host_copies'].get('disk_bytes_written', 0):,} to disk"
    )


if __name__ == "__main__":
    main()
