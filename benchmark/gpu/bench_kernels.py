"""The project's GPU kernels against the torch path and FLA's public calls, one layer at the shapes of the
real models, all timed round-robin in one run (medians). `ms` is each case's device time, from its first
kernel's start to its last kernel's end, as a CUDA graph replays it (the host enqueues the call while the
GPU spins; `Timings`); `ms_with_launch` adds the host's launch cost, as an eager call pays it. Up to the
fifth GPU session the rows had the latter only: a batch-1 decode, ~1 us of traffic, measured ~0.12 ms.

    python benchmark/gpu/bench_kernels.py                   # on the GPU machine, ~1 min
    TRITON_INTERPRET=1 python benchmark/gpu/bench_kernels.py --device cpu --tiny   # a CPU check of the script

Rows (issue 13's and 12's):
- GDN prefill, Qwen3-Next-80B layer (16 key / 32 value heads, dims 128), 8 x 2,048 tokens: ours (FLA's four
  steps over the packed batch + the chunk-start states) vs FLA's public `chunk_gated_delta_rule` vs the
  torch chunked rule (one sequence at a time); target: ours within 1.2x of FLA's public call.
- GDN decode at batch 1 / 64 / 256: our Triton step in place on the pool (q/k prep and gates fused) vs the
  torch step (prep, gather, update, scatter) vs FLA's `fused_recurrent_gated_delta_rule` (gathered states,
  inputs prepared outside its timing); with the fraction of memory bandwidth ours reaches (each fp32 state
  read and written once; target >= 70 %).
- Mamba2 decode (Nemotron-H-8B layer: 128 heads x 64 dims, state 128) at batch 1 / 64 / 256: Triton vs torch.
- Full-attention decode at batch 64 x 2,048 keys (16 query / 2 KV heads, dim 256): our Triton paged decode
  vs gather + torch SDPA (the torch-native backend's form).
- MoE experts at Qwen3-Next-80B's shapes (512, top 10, hidden 2,048, width 512, bf16) at batch 1 / 8 / 64 /
  256 (issue 55): the fused Triton GEMMs (`SGLANG_GPU_MOE_BACKEND=triton_fused`) vs the grouped_mm path,
  with the floor (the touched experts' weights read once at peak bandwidth): `--moe` runs these rows only
  (not in the default set; `run_gpu_checks.sh moe`). As the server runs the layer: its shared expert (512
  wide, sigmoid gate) stacked as expert 512 of 513 that every token picks (top 11 GEMM picks, the tiles of
  the E=513 file), against the grouped_mm path with the shared MLP and gate beside it;
  `--moe-unstacked` times the routed experts alone (512, top 10, the E=512 file's tiles).

- Extend attention at Qwen3-Next-80B's heads (`--attention`, these rows only): 8,192 new tokens without
  and after 24,576 cached keys, our Triton kernel vs torch's FlashAttention-2 varlen kernel as
  `flash_extend.py` calls it, with TFLOP/s (the 80B slice's 8k prefill spent 36 % of its time in the
  Triton kernel on an H200, 2026-12-01).

`--sweep` adds, at batch 256, our GDN and Mamba2 decode steps at other (state tile, warps) pairs than
the defaults (`TILE_FLOATS`, `NUM_WARPS` of their modules), GDN's each with its output from the updated
and from the decayed tile (`FUSED_OUT`), with the bandwidth each reaches. The GDN prefill row also
times ours in the pool's [V, K] state layout (served: FLA's [K, V], the states transposed in and out),
ours with q / k expanded to the value heads beforehand (as the public call gets them) and the public
call with our arguments (key heads, `state_v_first`); `--kernels` prints each prefill case's kernels
by GPU time per call (torch.profiler): where ours and FLA's public call part ways.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

# HBM bandwidth by GPU name: H100 SXM (HBM3) 3.35 TB/s, H200 (HBM3e) 4.8 TB/s; others: no fraction.
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def peak_bandwidth(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


class Timings(NamedTuple):
    """Median seconds per case: `device`, the GPU's time from the call's first kernel to its last end (a
    CUDA graph's replay; decode runs so when served); `with_launch`, that plus the host's launch cost
    (an eager call, as prefill runs). On CPU both are the call's wall time. `host_bound`: the cases
    whose host time outlasted the GPU's sleep in most repetitions (their device time has host gaps)."""

    device: dict[str, float]
    with_launch: dict[str, float]
    host_bound: list[str]


def _sleep_cycles_per_second() -> float:
    """The rate of `torch.cuda._sleep`'s spin (SM clock cycles), measured once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up: the clock rises under load
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / (start.elapsed_time(end) / 1e3)


# The longest the GPU spins before a call (a case whose host time exceeds it is timed with host gaps).
MAX_SLEEP_S = 0.05


def _timer(device: str) -> Callable[[Callable], tuple[float, float, bool]]:
    """(device seconds, seconds with the launch, host-bound) of one call of a case.

    With one pair of events around a call, the host's work before the first kernel starts (Python, the
    Triton launcher, tensor allocations) is timed as if it were the GPU's: in the fifth GPU session
    a batch-1 GDN decode of 4 MB of states, ~1 us of traffic, measured 0.122 ms, and that cost sat in
    every row (batch 256: 0.401 ms). For the device time the GPU first spins (`torch.cuda._sleep`)
    for twice the host time of the case's last call with nothing in front (1 ms at first, at most
    MAX_SLEEP_S): the host enqueues the call's kernels meanwhile, and the start event fires right
    before them. For a call of many kernels it is still an upper bound on a CUDA graph's time (each
    eager launch leaves a gap on the GPU too). A call that blocks on the GPU (a sync, a full launch
    queue) outlasts its sleep: it is host-bound, and its time holds host gaps."""
    if device != "cuda":

        def wall(fn: Callable) -> tuple[float, float, bool]:
            t = time.perf_counter()
            fn()
            t = time.perf_counter() - t
            return t, t, False

        return wall
    rate = _sleep_cycles_per_second()
    host_seconds: dict[int, float] = {}

    def run(fn: Callable) -> tuple[float, float, bool]:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        sleep = min(MAX_SLEEP_S, max(1e-3, 2 * host_seconds.get(id(fn), 0.0)))
        torch.cuda._sleep(int(sleep * rate))
        events[0].record()
        t = time.perf_counter()
        fn()
        host = time.perf_counter() - t
        events[1].record()
        events[1].synchronize()
        events[2].record()
        t = time.perf_counter()
        fn()
        host_seconds[id(fn)] = time.perf_counter() - t  # (the GPU idle: only the host's own time)
        events[3].record()
        events[3].synchronize()
        device_s, launch_s = (events[i].elapsed_time(events[i + 1]) / 1e3 for i in (0, 2))
        return device_s, launch_s, host > sleep

    return run


def round_robin(cases: dict[str, Callable], device: str, reps: int) -> Timings:
    """Each case timed `reps` times, the cases interleaved (after one warm-up each), in a fresh order each
    repetition (seeded), so that no case always runs right after the same one. (On an H200 the case
    that always ran after the torch path's 40 ms measured 1.37 ms, where FLA's public call running the
    same kernels took 1.17 ms; whether the order was the cause is not established.)"""
    timer = _timer(device)
    for fn in cases.values():
        fn()
    order, shuffle = list(cases), random.Random(0).shuffle
    times: dict[str, list[tuple[float, float, bool]]] = {name: [] for name in cases}
    for _ in range(reps):
        shuffle(order)
        for name in order:
            times[name].append(timer(cases[name]))
    median = lambda i: {name: statistics.median(t[i] for t in ts) for name, ts in times.items()}  # noqa: E731
    host_bound = [name for name, ts in times.items() if 2 * sum(t[2] for t in ts) > len(ts)]
    return Timings(median(0), median(1), host_bound)


def _fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def gdn_prefill(device: str, tiny: bool, reps: int, kernels: bool = False) -> dict:
    from sglang.srt.layers.attention.fla_chunks import chunk_layout
    from sglang.srt.layers.attention.linear.gated_delta_rule import l2norm
    from sglang.srt.layers.attention.linear.gdn_varlen import chunk_gdn_varlen_fla, chunk_gdn_varlen_torch

    hk, hv, d, n, length = (2, 4, 16, 2, 70) if tiny else (16, 32, 128, 8, 2048)
    dtype = torch.float32 if tiny else torch.bfloat16
    t = n * length
    q = (l2norm(torch.randn(t, hk, d, device=device)) * d**-0.5).to(dtype)
    k = l2norm(torch.randn(t, hk, d, device=device)).to(dtype)
    v = torch.randn(t, hv, d, device=device, dtype=dtype)
    g = -torch.rand(t, hv, device=device) * 0.1
    beta = torch.rand(t, hv, device=device)
    h0 = torch.zeros(n, hv, d, d, device=device)
    cu_cpu = [i * length for i in range(n + 1)]
    cu = torch.tensor(cu_cpu, device=device)
    cases = {
        "torch chunked rule (per sequence)": lambda: chunk_gdn_varlen_torch(
            q, k, v, g, beta, h0, cu, cu_cpu, 64
        )
    }
    if device == "cuda" and _fla_available():
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        # FLA's chunk layout as serving has it: built on the host, moved with the batch (fla_chunks.py).
        indices, offsets = chunk_layout(cu_cpu, 64, torch.device(device))
        layout = dict(chunk_indices=indices, chunk_offsets=offsets)
        # As served: FLA's kernels in their own [K, V] state layout, the pool's states transposed in and out.
        cases["ours (FLA steps + chunk states)"] = lambda: chunk_gdn_varlen_fla(
            q, k, v, g, beta, h0, cu, cu_cpu, 64, **layout
        )
        cases["ours, the pool's [V, K] state layout"] = lambda: chunk_gdn_varlen_fla(
            q, k, v, g, beta, h0, cu, cu_cpu, 64, **layout, kernel_state_v_first=True
        )
        group = hv // hk
        qe, ke = q.repeat_interleave(group, 1)[None], k.repeat_interleave(group, 1)[None]
        cases["ours, q/k expanded to the value heads"] = lambda: chunk_gdn_varlen_fla(
            qe[0], ke[0], v, g, beta, h0, cu, cu_cpu, 64, **layout
        )
        cases["FLA public chunk_gated_delta_rule"] = lambda: chunk_gated_delta_rule(
            qe, ke, v[None], g[None], beta[None], scale=1.0, initial_state=h0, output_final_state=True,
            cu_seqlens=cu,
        )  # fmt: skip
        # The public call with our arguments (q/k on the key heads, the pool's [V, K] state layout): if
        # it is as slow as ours, the time is in FLA's kernels for these arguments, not in our glue.
        cases["FLA public, key heads + state_v_first"] = lambda: chunk_gated_delta_rule(
            q[None], k[None], v[None], g[None], beta[None], scale=1.0, initial_state=h0,
            output_final_state=True, cu_seqlens=cu, state_v_first=True,
        )  # fmt: skip
    row = _row(f"GDN prefill {n} x {length}, heads {hk}/{hv}, dim {d}", round_robin(cases, device, reps))
    if "FLA public chunk_gated_delta_rule" in cases:
        # FLA's public call may dispatch to FlashQLA (a fused TileLang kernel) where `flash_qla` is
        # installed (and the call qualifies: sm_90+, bf16, dims 128); to its four Triton steps, which
        # ours runs, otherwise. Whether the package is there, not which backend each call took.
        import importlib.util

        row["flash_qla_installed"] = importlib.util.find_spec("flash_qla") is not None
    if kernels and device == "cuda":
        row["kernels_per_call"] = {name: _kernels_of(fn) for name, fn in cases.items()}
    return row


def _kernels_of(fn: Callable, calls: int = 3) -> list[str]:
    """`fn`'s kernels by GPU time per call, from torch.profiler over `calls` calls."""
    from bench_decode_step import _top_kernels

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return _top_kernels(prof, per=calls, skip="")


def gdn_decode(device: str, tiny: bool, reps: int) -> list[dict]:

    hv, d = (4, 16) if tiny else (32, 128)
    return [_gdn_decode_row(device, bs, hv, d, reps) for bs in ((1, 8) if tiny else (1, 64, 256))]


def _gdn_decode_row(device: str, bs: int, hv: int, d: int, reps: int, ours_only: bool = False) -> dict:
    from types import SimpleNamespace

    from sglang.srt.layers.attention.linear.gated_delta_rule import recurrent_gated_delta_rule_step
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend, gdn_gates
    from sglang.srt.layers.attention.linear.gdn_decode_triton import gdn_decode_inplace

    hk = hv // 2  # Qwen3-Next: two value heads per key head
    layer = SimpleNamespace(
        num_k_heads=hk, num_v_heads=hv, head_k_dim=d, head_v_dim=d, cpu_ops=None,
        A_log=torch.randn(hv, device=device), dt_bias=torch.randn(hv, device=device),
    )  # fmt: skip
    pool = torch.randn(bs + 1, hv, d, d, device=device) * 0.1
    slots = torch.arange(1, bs + 1, device=device)
    x = torch.randn(bs, (2 * hk + hv) * d, device=device)
    a, b = torch.randn(bs, hv, device=device), torch.randn(bs, hv, device=device)
    q, k, v = GDNAttnBackend._split_heads(layer, x)  # FLA's inputs, made once outside its timing
    g, beta = gdn_gates(layer, a, b)

    def torch_step():  # the torch path as served: the q/k prep and the gates, then the step
        q, k, v = GDNAttnBackend._split_heads(layer, x)
        g, beta = gdn_gates(layer, a, b)
        out, state = recurrent_gated_delta_rule_step(q, k, v, g, beta, pool.index_select(0, slots))
        pool.index_copy_(0, slots, state)

    ours = lambda: gdn_decode_inplace(x, a, b, layer.A_log, layer.dt_bias, pool, slots, hk, d)  # noqa: E731
    cases = {"ours (Triton, in place)": ours, "torch step (gather/scatter)": torch_step}
    if ours_only:
        del cases["torch step (gather/scatter)"]
    elif device == "cuda" and _fla_available():
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        def fla_step():
            h = pool.index_select(0, slots)
            _, h = fused_recurrent_gated_delta_rule(
                q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=1.0,
                initial_state=h, output_final_state=True, state_v_first=True,
            )  # fmt: skip
            pool.index_copy_(0, slots, h)

        cases["FLA fused recurrent (gather/scatter)"] = fla_step
    times = round_robin(cases, device, reps)
    row = _row(f"GDN decode bs {bs}, {hv} heads, dim {d}", times)
    _bandwidth(row, device, 2 * bs * hv * d * d * 4, times.device["ours (Triton, in place)"])
    return row


# (values in a program's float32 state tile, warps): the decode steps' configurations `--sweep` times.
SWEEP = [(1024, 2), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 8)]


def decode_sweep(device: str, tiny: bool, reps: int) -> list[dict]:
    """Our GDN and Mamba2 decode steps at batch 256 (8 tiny) with each SWEEP configuration; GDN's also
    with its output from the decayed tile (`FUSED_OUT`)."""
    from sglang.srt.layers.attention.linear import gdn_decode_triton
    from sglang.srt.layers.attention.mamba import decode_triton

    rows = []
    for module, row_of in ((gdn_decode_triton, _gdn_decode_row), (decode_triton, _mamba2_decode_row)):
        default = (module.TILE_FLOATS, module.NUM_WARPS)
        fused_default = getattr(module, "FUSED_OUT", None)
        forms = (False, True) if fused_default is not None else (None,)
        try:
            for (tile, warps), fused in itertools.product(SWEEP, forms):
                module.TILE_FLOATS, module.NUM_WARPS = tile, warps
                config = {"tile_floats": tile, "num_warps": warps}
                if fused is not None:
                    module.FUSED_OUT = config["fused_out"] = fused
                if row_of is _gdn_decode_row:
                    row = row_of(
                        device,
                        8 if tiny else 256,
                        4 if tiny else 32,
                        16 if tiny else 128,
                        reps,
                        ours_only=True,
                    )
                else:
                    args = (4, 8, 16, 2) if tiny else (128, 64, 128, 8)
                    row = row_of(device, 8 if tiny else 256, *args, reps, ours_only=True)
                config["default"] = (tile, warps) == default and fused == fused_default
                row["config"] = config
                rows.append(row)
        finally:
            module.TILE_FLOATS, module.NUM_WARPS = default
            if fused_default is not None:
                module.FUSED_OUT = fused_default
    return rows


def mamba2_decode(device: str, tiny: bool, reps: int) -> list[dict]:

    h, p, n, groups = (4, 8, 16, 2) if tiny else (128, 64, 128, 8)
    return [
        _mamba2_decode_row(device, bs, h, p, n, groups, reps) for bs in ((1, 8) if tiny else (1, 64, 256))
    ]


def _mamba2_decode_row(
    device: str, bs: int, h: int, p: int, n: int, groups: int, reps: int, ours_only: bool = False
) -> dict:
    from sglang.srt.layers.attention.mamba.decode_triton import mamba2_decode_inplace
    from sglang.srt.layers.attention.mamba.ssd import selective_state_update

    pool = torch.randn(bs + 1, h, p, n, device=device) * 0.1
    slots = torch.arange(1, bs + 1, device=device)
    xbc = torch.randn(bs, h * p + 2 * groups * n, device=device)
    dt = torch.rand(bs, h, device=device)
    a, dd = -torch.rand(h, device=device), torch.randn(h, device=device)

    def torch_step():
        x, b, c = xbc.split([h * p, groups * n, groups * n], dim=-1)
        b = b.view(bs, groups, n).repeat_interleave(h // groups, 1)
        c = c.view(bs, groups, n).repeat_interleave(h // groups, 1)
        _, state = selective_state_update(pool.index_select(0, slots), x.view(bs, h, p), dt, a, b, c, dd)
        pool.index_copy_(0, slots, state)

    cases = {
        "ours (Triton, in place)": lambda: mamba2_decode_inplace(
            xbc, dt, a, dd, pool, slots, h, p, groups, n
        ),
        "torch step (gather/scatter)": torch_step,
    }
    if ours_only:
        del cases["torch step (gather/scatter)"]
    times = round_robin(cases, device, reps)
    row = _row(f"Mamba2 decode bs {bs}, {h} heads x {p}, state {n}", times)
    _bandwidth(row, device, 2 * bs * h * p * n * 4, times.device["ours (Triton, in place)"])
    return row


def attention_decode(device: str, tiny: bool, reps: int) -> dict:
    import torch.nn.functional as F

    from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd

    hq, hk, d, bs, ctx = (4, 2, 16, 4, 50) if tiny else (16, 2, 256, 64, 2048)
    dtype = torch.float32 if tiny else torch.bfloat16
    k_buf = torch.randn(bs * ctx + 1, hk, d, device=device, dtype=dtype)
    v_buf = torch.randn_like(k_buf)
    r2t = torch.arange(1, bs * ctx + 1, device=device, dtype=torch.int32).view(bs, ctx)
    rows, lens = torch.arange(bs, device=device), torch.full((bs,), ctx, device=device)
    q = torch.randn(bs, hq, d, device=device, dtype=dtype)
    out = torch.empty_like(q)

    def sdpa():
        idx = r2t.long().reshape(-1)
        k = k_buf.index_select(0, idx).view(bs, ctx, hk, d).transpose(1, 2)
        v = v_buf.index_select(0, idx).view(bs, ctx, hk, d).transpose(1, 2)
        F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)

    cases = {"ours (Triton paged, 8 splits)": lambda: decode_attention_fwd(q, k_buf, v_buf, out, r2t, rows, lens, d**-0.5),
             "gather + torch SDPA": sdpa}  # fmt: skip
    times = round_robin(cases, device, reps)
    row = _row(f"attention decode bs {bs} x {ctx} keys, heads {hq}/{hk}, dim {d}", times)
    nbytes = 2 * bs * ctx * hk * d * k_buf.element_size()
    _bandwidth(row, device, nbytes, times.device["ours (Triton paged, 8 splits)"])
    return row


def attention_extend(device: str, tiny: bool, reps: int) -> list[dict]:
    """Extend (prefill) attention at Qwen3-Next-80B's heads (16 / 2 of 256, bf16): 8,192 new tokens
    without a prefix (a prompt's first chunk) and 8,192 after 24,576 cached keys (the last chunk of a
    32k prompt): our Triton paged kernel against torch's FlashAttention-2 varlen kernel as the backend
    calls it (`flash_extend.py`: the prefix gathered, the new K / V as they are), with TFLOP/s."""
    heads = (4, 2, 16) if tiny else (16, 2, 256)
    dtype = torch.float32 if tiny else torch.bfloat16
    shapes = ((0, 64), (64, 32)) if tiny else ((0, 8192), (24576, 8192))
    return [_extend_row(device, *heads, dtype, prefix, ext, reps) for prefix, ext in shapes]


def _extend_row(device: str, hq: int, hk: int, d: int, dtype, prefix: int, ext: int, reps: int) -> dict:
    from sglang.srt.layers.attention import flash_extend as fe
    from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd

    n = prefix + ext
    k_buf = torch.randn(n + 1, hk, d, device=device, dtype=dtype)
    v_buf = torch.randn_like(k_buf)
    r2t = torch.arange(1, n + 1, device=device, dtype=torch.int32).view(1, n)
    q = torch.randn(ext, hq, d, device=device, dtype=dtype)
    out = torch.empty_like(q)
    dev = lambda v: torch.tensor(v, device=device)  # noqa: E731
    args = (q, k_buf, v_buf, out, r2t, dev([0]), dev([n]), dev([ext]), dev([0]), ext, d**-0.5)
    cases = {"ours (Triton paged)": lambda: extend_attention_fwd(*args)}
    if device == "cuda" and fe.available(torch.device(device)):
        meta = fe.build_meta(r2t, [0], [prefix], [ext], dev([ext]), dev([n]), 2 * hk * d * k_buf.element_size())
        k_new, v_new = k_buf[1 + prefix :], v_buf[1 + prefix :]
        cases["torch FlashAttention-2 varlen (flash_extend)"] = lambda: fe.extend_attention(
            q, k_new, v_new, k_buf, v_buf, meta, d**-0.5
        )
    times = round_robin(cases, device, reps)
    row = _row(f"attention extend {ext} tokens after {prefix}, heads {hq}/{hk}, dim {d}", times)
    flop = 4 * hq * d * ext * (prefix + (ext + 1) / 2)  # QK^T and PV over the causal keys
    row["tflops"] = {name: round(flop / t / 1e12, 1) for name, t in times.device.items()}
    return row


def moe_experts(device: str, tiny: bool, reps: int, stacked: bool = True) -> list[dict]:
    """Qwen3-Next-80B's MoE layer (512 routed experts, top 10, hidden 2,048, width 512, bf16) at batch 1 /
    8 / 64 / 256 on uniform random routing: the fused Triton GEMMs (SGLANG_GPU_MOE_BACKEND=triton_fused,
    the tuned tiles where configs/ has them) vs the grouped_mm path as served (`forward_device`: the
    Triton bookkeeping, x gathered, two `torch._grouped_mm`, the activation apart). `stacked` (the
    server's form): the shared expert and its sigmoid gate too, stacked as expert E in ours
    (`FusedExperts.fuse_shared`: E + 1 experts, top-k + 1 picks), beside the routed experts in theirs.
    The floor: the touched experts' weights (the shared one's included) read once at the peak bandwidth
    (`floor_ms`, each case's `fraction_of_floor`)."""
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.layers.mlp import GatedMLP
    from sglang.srt.layers.moe.experts import RoutedExperts
    from sglang.srt.layers.moe.fused_moe_triton import FusedExperts, fused_experts

    e, hidden, inter, top_k = (8, 64, 32, 2) if tiny else (512, 2048, 512, 10)
    dtype = torch.float16 if tiny else torch.bfloat16  # the interpreter's bf16 dot is wrong
    layer = RoutedExperts(e, hidden, inter, "silu", gated=True)
    for p in (layer.w13, layer.w2):
        p.data = (torch.randn(p.shape, device=device) / p.shape[2] ** 0.5).to(dtype)
    from sglang.srt.environ import envs

    with envs.SGLANG_CPU_MOE_BACKEND.override("torch"):  # (CPU: the C++ op would store them transposed)
        layer.process_weights_after_loading()  # the Triton bookkeeping on CUDA, as served
    fused = FusedExperts(layer)
    shared = (None, None)
    if stacked:
        shared = (
            GatedMLP(hidden, inter, "silu", reduce_results=False),
            ReplicatedLinear(hidden, 1, bias=False),
        )
        for p in (*shared[0].parameters(), *shared[1].parameters()):
            p.data = (torch.randn(p.shape, device=device) / p.shape[1] ** 0.5).to(dtype)
        fused.fuse_shared(layer, *shared)
        assert fused.stack is not None
    table = fused.stack_table if stacked else fused.table
    per_expert = (layer.w13[0].numel() + layer.w2[0].numel()) * layer.w13.element_size()
    peak = peak_bandwidth(device)
    rows = []

    def ours(x, w, i):
        if stacked:
            return fused.forward(layer, x, w, i, *shared)
        return fused_experts(x, layer.w13, layer.w2, w, i, layer._activate, True, table)

    def theirs(x, w, i):
        return layer._add_shared(layer.forward_device(x, w, i), x, *shared)

    def ours_apart(x, w, i):
        """Ours with the bookkeeping's launches apart (align, offsets, tile maps: 3), as a captured CUDA
        graph runs it, where an eager call's decode batches take one (`dispatch_triton.moe_align_tiles`)."""
        from sglang.srt.layers.moe import dispatch_triton as dt

        saved, dt.MERGED_MAX_ASSIGNMENTS = dt.MERGED_MAX_ASSIGNMENTS, 0
        try:
            return ours(x, w, i)
        finally:
            dt.MERGED_MAX_ASSIGNMENTS = saved

    for bs in (1, 4) if tiny else (1, 8, 64, 256):
        # Each call on the next of 8 routings: the same one again would find a batch-1 call's experts
        # (60 MB) largely in the H200's 50 MB L2, where a decode step's layer reads them from HBM.
        inputs = []
        for _ in range(8):
            ids = torch.rand(bs, e, device=device).topk(top_k, dim=1).indices
            x = torch.randn(bs, hidden, device=device).to(dtype)
            inputs.append((x, torch.rand(bs, top_k, device=device), ids))
        cases = {
            "ours (fused Triton GEMMs)": lambda c=itertools.cycle(inputs): ours(*next(c)),
            "grouped_mm path (forward_device)": lambda c=itertools.cycle(inputs): theirs(*next(c)),
            "ours, bookkeeping in 3 launches (as graphs run it)": lambda c=itertools.cycle(inputs): ours_apart(
                *next(c)
            ),
        }
        times = round_robin(cases, device, reps)
        got, want = ours(*inputs[0]).float(), theirs(*inputs[0]).float()
        shared_name = " + the shared expert" if stacked else ""
        shape = f"{e} experts top {top_k}{shared_name}, hidden {hidden}, width {inter}"
        row = _row(f"MoE experts bs {bs}, {shape}", times)
        row["tuned_tiles"] = bool(table)
        row["shared_expert"] = "stacked as expert E" if stacked else "none"
        row["max_abs_diff_over_max"] = round(((got - want).abs().max() / want.abs().max()).item(), 5)
        nbytes = (sum(i.unique().numel() for _, _, i in inputs) / len(inputs) + stacked) * per_expert
        _bandwidth(row, device, nbytes, times.device["ours (fused Triton GEMMs)"])
        if peak is not None:
            row["floor_ms"] = round(nbytes / peak * 1e3, 4)
            row["fraction_of_floor"] = {name: round(nbytes / peak / t, 3) for name, t in times.device.items()}
        rows.append(row)
    return rows


def _ms(times: dict[str, float]) -> dict[str, float]:
    return {name: round(t * 1e3, 4) for name, t in times.items()}


def _row(kernel: str, times: Timings) -> dict:
    """A row: `ms`, each case's device time; `ms_with_launch`, with the host's launch cost (`Timings`)."""
    row = {"kernel": kernel, "ms": _ms(times.device), "ms_with_launch": _ms(times.with_launch)}
    if times.host_bound:
        row["host_bound"] = times.host_bound
    return row


def _bandwidth(row: dict, device: str, nbytes: int, seconds: float) -> None:
    row["ours_GB_per_s"] = round(nbytes / seconds / 1e9, 1)
    peak = peak_bandwidth(device)
    if peak is not None:
        row["ours_fraction_of_peak"] = round(nbytes / seconds / peak, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes (a CPU run under TRITON_INTERPRET=1)"
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--kernels", action="store_true", help="the GDN prefill cases' kernels (CUDA)")
    parser.add_argument("--sweep", action="store_true", help="the decode steps' tile / warps pairs")
    parser.add_argument("--out", help="also write the rows as JSON here")
    parser.add_argument(
        "--moe", action="store_true", help="the MoE experts' rows only (not in the default set)"
    )
    parser.add_argument(
        "--moe-unstacked", action="store_true", help="--moe without the shared expert (routed experts only)"
    )
    parser.add_argument(
        "--attention", action="store_true", help="the extend attention rows only (not in the default set)"
    )
    args = parser.parse_args()
    rows = []
    if args.attention:
        rows += attention_extend(args.device, args.tiny, args.reps)
    elif args.moe:
        rows += moe_experts(args.device, args.tiny, args.reps, stacked=not args.moe_unstacked)
    else:
        rows.append(gdn_prefill(args.device, args.tiny, args.reps, args.kernels))
        rows += gdn_decode(args.device, args.tiny, args.reps)
        rows += mamba2_decode(args.device, args.tiny, args.reps)
        rows.append(attention_decode(args.device, args.tiny, args.reps))
    if args.sweep and not (args.moe or args.attention):
        rows += decode_sweep(args.device, args.tiny, args.reps)
    for row in rows:
        listed = row.pop("kernels_per_call", {})
        print(json.dumps(row), flush=True)
        for name, lines in listed.items():
            print(f"  {name}:\n" + "".join(f"    {line}\n" for line in lines), end="", flush=True)
        if listed:
            row["kernels_per_call"] = listed
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
