"""Decode attention on CPU, the torch-native backend's three ways, one thread, round-robin medians:

    .venv/bin/python benchmark/bench_decode_attention_cpu.py

- `sdpa`: gather each request's KV (padded to the longest) with `index_select`, then torch's fused SDPA
  (flash kernel, `enable_gqa`), which re-reads every key once per query head;
- `grouped`: the same gather, then two matmuls over each KV head's whole query group (what the backend
  takes for float32 decodes where (query heads per KV head) x (head dim) >= `GROUPED_DECODE_MIN_WORK`);
- `cpp`: sgl-kernel's `decode_attention`, which reads the KV pool in place through `req_to_token` (the
  default where the CPU extension is built; `SGLANG_CPU_ATTN_BACKEND`).

A second table times the C++ op over batches whose requests share their first keys (a system prompt):
each request over all of its keys, against the shared-prefix (cascade) pass first, and which of the two
the op's default threshold takes. A third times the C++ op over pools of each `--kv-cache-dtype` (and
float16) at the shapes of the first table, against the float32 pool. A fourth times the C++ op over
keys in consecutive slots (a prefill's, or pages of 64+) against keys in scattered slots (what a decode
with --page-size 1 leaves: one step's slots go to all requests in turn), min of 21 runs.

Each runs through `TorchNativeAttnBackend` over real pools (the new token's KV store included), with each
request's slots contiguous as the allocator hands them out; request lengths vary between half and all
of `keys`.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.attention import torch_native_backend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.cpu_ops import cpu_attention_ops
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

# (batch, keys, query heads, KV heads, head dim): the tiny presets, the demo model (heads of 32), then
# Qwen3-Next-80B's attention.
SHAPES = [
    (16, 1300, 4, 2, 16),
    (64, 256, 4, 2, 16),
    (256, 330, 4, 2, 32),
    (16, 1300, 8, 2, 64),
    (16, 1300, 16, 2, 64),
    (16, 1300, 8, 2, 128),
    (16, 1300, 8, 2, 256),
    (64, 512, 16, 2, 256),
    (4, 4000, 16, 2, 256),
]


def _backend(kind: str, req_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool) -> TorchNativeAttnBackend:
    with envs.SGLANG_CPU_ATTN_BACKEND.override("cpp" if kind == "cpp" else "torch"):
        return TorchNativeAttnBackend(req_pool, kv_pool)


def row(bs: int, length: int, hq: int, hk: int, d: int) -> str:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(length // 2, length + 1, (bs,), generator=g).tolist()
    req_pool = ReqToTokenPool(bs + 1, length + 1)
    kv_pool = MHATokenToKVPool(sum(lens) + 1, 1, torch.float32, hk, d, layer_ids=[0])
    k_buf, v_buf = kv_pool.get_kv_buffer(0)
    k_buf.normal_(generator=g)
    v_buf.normal_(generator=g)
    start = 1
    for r, n in enumerate(lens):
        req_pool.write(r + 1, 0, torch.arange(start, start + n))
        start += n
    fb = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        req_pool_indices=torch.arange(1, bs + 1),
        req_pool_indices_cpu=list(range(1, bs + 1)),
        seq_lens=torch.tensor(lens),
        seq_lens_cpu=lens,
        out_cache_loc=torch.tensor([1 + sum(lens[: r + 1]) - 1 for r in range(bs)]),
    )
    layer = SimpleNamespace(
        tp_q_head_num=hq, tp_k_head_num=hk, head_dim=d, scaling=d**-0.5, layer_id=0, kv_scales=(1.0, 1.0)
    )
    q = torch.randn(bs, hq * d, generator=g)
    k_new = k_buf[fb.out_cache_loc].view(bs, hk * d).clone()
    v_new = v_buf[fb.out_cache_loc].view(bs, hk * d).clone()
    backends = {kind: _backend(kind, req_pool, kv_pool) for kind in ("sdpa", "grouped", "cpp")}
    limit = torch_native_backend.GROUPED_DECODE_MIN_WORK

    def run(kind: str) -> torch.Tensor:
        # The backend picks SDPA or the matmuls by this threshold: set it for the way being timed.
        torch_native_backend.GROUPED_DECODE_MIN_WORK = 0 if kind == "grouped" else 1 << 30
        backend = backends[kind]
        backend.init_forward_metadata(fb)
        return backend.forward(q, k_new, v_new, layer, fb)

    try:
        want = run("sdpa")
        for kind in ("grouped", "cpp"):
            assert torch.allclose(run(kind), want, atol=1e-4), kind
        times: dict[str, list[float]] = {kind: [] for kind in backends}
        for _ in range(15):
            for kind in backends:
                t = time.perf_counter()
                run(kind)
                times[kind].append(time.perf_counter() - t)
    finally:
        torch_native_backend.GROUPED_DECODE_MIN_WORK = limit
    a, b, c = (statistics.median(times[kind]) * 1e3 for kind in ("sdpa", "grouped", "cpp"))
    return f"| {bs} x {length} | {hq}/{hk}, {d} | {a:.2f} | {b:.2f} | {c:.2f} | {min(a, b) / c:.2f} |"


# (batch, shared prefix keys, own keys, query heads, KV heads, head dim, KV dtype): requests whose first keys
# are the same slots (a shared system prompt), each with its own tail.
SHARED_SHAPES = [
    (16, 1024, 276, 4, 2, 16, torch.float32),
    (16, 1024, 276, 8, 2, 64, torch.float32),
    (32, 128, 64, 16, 2, 128, torch.float32),
    (16, 1024, 276, 16, 2, 256, torch.float32),
    (16, 1024, 276, 16, 2, 256, torch.bfloat16),
    (4, 4000, 64, 16, 2, 256, torch.bfloat16),
    (64, 1024, 64, 16, 2, 256, torch.bfloat16),
    (256, 1024, 16, 4, 2, 16, torch.float32),  # small heads: the search for shared prefixes shows
]


def shared_row(bs: int, prefix: int, own: int, hq: int, hk: int, d: int, dtype: torch.dtype) -> str:
    """The C++ op over a batch sharing its first `prefix` slots, the shared-prefix pass forced on and off
    (`shared_prefix_min_macs` 0 / never), and the prefix work the op's default threshold (2^23 multiply-adds:
    query rows x prefix keys x head dim) compares."""
    ops = cpu_attention_ops("cpu")
    assert ops is not None, "the sgl-kernel CPU extension is not built"
    g = torch.Generator().manual_seed(0)
    lens = [prefix + own - (b * 7) % max(own // 2, 1) for b in range(bs)]
    table = torch.zeros(bs + 1, max(lens), dtype=torch.int32)
    start = prefix + 1
    for b, n in enumerate(lens):
        own_slots = torch.arange(start, start + n - prefix)
        table[b + 1, :n] = torch.cat([torch.arange(1, prefix + 1), own_slots]).to(torch.int32)
        start += n - prefix
    k_buf = torch.randn(start, hk, d, generator=g).to(dtype)
    v_buf = torch.randn(start, hk, d, generator=g).to(dtype)
    q = torch.randn(bs, hq, d, generator=g)
    args = (q, k_buf, v_buf, table, torch.arange(1, bs + 1), torch.tensor(lens), d**-0.5)
    ways = {"alone": (1 << 62,), "shared": (0,)}
    assert torch.allclose(ops.decode_attention(*args, 0), ops.decode_attention(*args, 1 << 62), atol=1e-5)
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(15):
        for way, extra in ways.items():
            t = time.perf_counter()
            ops.decode_attention(*args, *extra)
            times[way].append(time.perf_counter() - t)
    a, s = (statistics.median(times[way]) * 1e3 for way in ways)
    work = bs * hq * prefix * d / 2**20
    name = str(dtype).removeprefix("torch.")
    return f"| {bs} x ({prefix} + {own}) | {hq}/{hk}, {d}, {name} | {a:.2f} | {s:.2f} | {a / s:.2f} | {work:.0f} M |"


KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def kv_dtype_row(bs: int, length: int, hq: int, hk: int, d: int) -> str:
    """The C++ op over the same keys and values stored in each KV dtype (round-robin medians)."""
    ops = cpu_attention_ops("cpu")
    assert ops is not None, "the sgl-kernel CPU extension is not built"
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(length // 2, length + 1, (bs,), generator=g)
    table = torch.zeros(bs, length, dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        table[b, :n] = torch.arange(1 + b * length, 1 + b * length + n, dtype=torch.int32)
    k, v = torch.randn(bs * length + 1, hk, d, generator=g), torch.randn(bs * length + 1, hk, d, generator=g)
    q = torch.randn(bs, hq, d, generator=g)
    pools = {dtype: (k.to(dtype), v.to(dtype)) for dtype in KV_DTYPES}
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in KV_DTYPES}
    for _ in range(15):
        for dtype, (kb, vb) in pools.items():
            t = time.perf_counter()
            ops.decode_attention(q, kb, vb, table, torch.arange(bs), lens, d**-0.5)
            times[dtype].append(time.perf_counter() - t)
    ms = [statistics.median(times[dtype]) * 1e3 for dtype in KV_DTYPES]
    cells = " | ".join(f"{m:.2f} ({ms[0] / m:.2f}x)" for m in ms[1:])
    return f"| {bs} x {length} | {hq}/{hk}, {d} | {ms[0]:.2f} | {cells} |"


def scattered_row(bs: int, length: int, hq: int, hk: int, d: int) -> str:
    """The C++ op, float32, every request at `length` keys, in consecutive slots and in a random
    permutation of them (each key row a cache miss the hardware cannot predict)."""
    ops = cpu_attention_ops("cpu")
    assert ops is not None, "the sgl-kernel CPU extension is not built"
    g = torch.Generator().manual_seed(0)
    n = bs * length
    k, v = torch.randn(n + 1, hk, d, generator=g), torch.randn(n + 1, hk, d, generator=g)
    q = torch.randn(bs, hq, d, generator=g)
    lens = torch.full((bs,), length)
    tables = {
        "consecutive": torch.arange(1, n + 1, dtype=torch.int32).view(bs, length),
        "scattered": (torch.randperm(n, generator=g) + 1).to(torch.int32).view(bs, length),
    }
    times: dict[str, list[float]] = {way: [] for way in tables}
    for _ in range(21):
        for way, table in tables.items():
            t = time.perf_counter()
            ops.decode_attention(q, k, v, table, torch.arange(bs), lens, d**-0.5)
            times[way].append(time.perf_counter() - t)
    c, s = (min(times[way]) * 1e3 for way in tables)
    return f"| {bs} x {length} | {hq}/{hk}, {d} | {c:.2f} | {s:.2f} | {s / c:.2f} |"


# (header, the row function, its shapes): the four tables in order.
TABLES = [
    (
        "| batch x keys | heads q/kv, dim | gather + SDPA ms | gather + matmuls ms | C++ in place ms | "
        "best torch / C++ |\n|---|---|---|---|---|---|",
        row,
        SHAPES,
    ),
    (
        "| batch x (shared + own keys) | heads q/kv, dim, KV | each alone ms | shared prefix first ms | "
        "alone / shared | prefix work (default shares >= 8 M) |\n|---|---|---|---|---|---|",
        shared_row,
        SHARED_SHAPES,
    ),
    (
        "| batch x keys | heads q/kv, dim | float32 KV ms | bfloat16 ms (vs float32) | float16 ms | "
        "float8 e4m3fn ms | float8 e5m2 ms |\n|---|---|---|---|---|---|---|",
        kv_dtype_row,
        SHAPES,
    ),
    (
        "| batch x keys | heads q/kv, dim | consecutive slots ms | scattered slots ms | scattered / "
        "consecutive |\n|---|---|---|---|---|",
        scattered_row,
        SHAPES,
    ),
]


def main() -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    for i, (header, make_row, shapes) in enumerate(TABLES):
        print(("\n" if i else "") + header)
        for shape in shapes:
            print(make_row(*shape), flush=True)


if __name__ == "__main__":
    main()
