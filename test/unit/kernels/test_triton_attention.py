"""The Triton paged attention kernels (`--attention-backend triton`) against a torch twin, under
TRITON_INTERPRET=1 on tiny shapes; compiled for sm_90 at Qwen3-Next-80B's shapes; and through the
engine against the torch-native backend."""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.sm90 import compile_sm90_in_registers

register_cpu_ci(est_time=25, suite="per-commit-cpu")

NUM_SLOTS = 600
ROW_LEN = 256



def _pool(hk, d, dtype, seed, kv_dtype=None, num_slots=NUM_SLOTS) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V buffers in `kv_dtype` (a `--kv-cache-dtype` pool), else `dtype`."""
    dtype = kv_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_slots, hk, d, generator=g).to(dtype),
        torch.randn(num_slots, hk, d, generator=g).to(dtype),
    )


def _req_to_token(rows: list[int], lens: list[int], seed: int, num_slots: int = NUM_SLOTS) -> torch.Tensor:
    """Rows of scattered slot ids (no two requests share one), as any page size leaves them."""
    assert sum(lens) <= num_slots, f"{sum(lens)} keys do not fit a pool of {num_slots} slots"
    perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed)).int()
    r2t = torch.zeros(max(rows) + 2, ROW_LEN, dtype=torch.int32)
    off = 0
    for row, n in zip(rows, lens, strict=True):
        r2t[row, :n] = perm[off : off + n]
        off += n
    return r2t


def _reference(q, k_buf, v_buf, slots, q_pos, scale):
    """q [E, Hq, D] at positions q_pos [E] against keys slots[0..], causal, in float64."""
    group = q.shape[1] // k_buf.shape[1]
    k = k_buf[slots].double().repeat_interleave(group, 1)
    v = v_buf[slots].double().repeat_interleave(group, 1)
    s = torch.einsum("ehd,thd->eht", q.double(), k) * scale
    s = s.masked_fill(
        torch.arange(len(slots), device=q.device)[None, None, :] > q_pos[:, None, None], float("-inf")
    )
    return torch.einsum("eht,thd->ehd", s.softmax(-1), v)


# float32: the same sums in another order, ~1e-7; bfloat16 inputs: the kernel rounds the softmax
# weights to bfloat16 before the value product (as flash attention does), 2^-8 relative on outputs of
# magnitude ~1.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


# --kv-cache-dtype pools under float32 and bfloat16 queries: the kernels read the stored values and
# convert them exactly, so the tolerance is the query dtype's.
KV_POOLS = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2),
]


@pytest.mark.parametrize(
    "hq,hk,d,dtype,splits,kv_dtype",
    [
        (4, 2, 16, torch.float32, 1, None),  # one split: stage 2 is a copy
        (4, 2, 24, torch.float32, 3, None),  # head dim not a power of two; a GQA group of 2
        (6, 1, 16, torch.float32, 8, None),  # more splits than the shortest request has keys
        (4, 4, 16, torch.bfloat16, 4, None),  # a bfloat16 pool, no grouping
        *[(4, 2, 16, q, 2, kv) for q, kv in KV_POOLS],
    ],
)
def test_decode_matches_the_torch_twin(interpret, hq, hk, d, dtype, splits, kv_dtype):
    from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd

    rows, lens = [3, 0, 1, 5], [1, 5, 70, 130]  # row 0 with length 1: a padded CUDA-graph row
    r2t = _req_to_token(rows, lens, seed=d)
    k_buf, v_buf = _pool(hk, d, dtype, seed=hq, kv_dtype=kv_dtype)
    q = torch.randn(len(rows), hq, d, generator=torch.Generator().manual_seed(7)).to(dtype)
    out = torch.full_like(q, float("nan"))
    decode_attention_fwd(q, k_buf, v_buf, out, r2t, torch.tensor(rows), torch.tensor(lens), 0.3, splits)
    for i, (row, n) in enumerate(zip(rows, lens, strict=True)):
        want = _reference(q[i : i + 1], k_buf, v_buf, r2t[row, :n].long(), torch.tensor([n - 1]), 0.3)
        torch.testing.assert_close(out[i].double(), want[0], **TOL[dtype])


@pytest.mark.parametrize(
    "hq,hk,d,dtype,kv_dtype",
    [
        (4, 2, 24, torch.float32, None),
        (2, 1, 160, torch.float32, None),  # a head over 128 dims: the smaller tiles of `block_sizes`
        (4, 2, 16, torch.bfloat16, None),
        *[(4, 2, 16, q, kv) for q, kv in KV_POOLS],
    ],
)
def test_extend_with_prefix_matches_the_torch_twin(interpret, hq, hk, d, dtype, kv_dtype):
    from sglang.srt.layers.attention.triton_ops.extend_attention import block_sizes, extend_attention_fwd

    # No prefix; a prefix with an extend over more than one query block; a long prefix, one block.
    prefix, ext, rows = [0, 10, 70], [5, 70, 3], [2, 0, 4]
    lens = [p + e for p, e in zip(prefix, ext, strict=True)]
    assert max(ext) > block_sizes(d, f32=True)[0]  # the interpreter's dots are float32
    r2t = _req_to_token(rows, lens, seed=d + 1)
    k_buf, v_buf = _pool(hk, d, dtype, seed=hq + 1, kv_dtype=kv_dtype)
    q = torch.randn(sum(ext), hq, d, generator=torch.Generator().manual_seed(8)).to(dtype)
    starts = [0, ext[0], ext[0] + ext[1]]
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(
        q, k_buf, v_buf, out, r2t, torch.tensor(rows), torch.tensor(lens), torch.tensor(ext),
        torch.tensor(starts), max(ext), 0.3,
    )  # fmt: skip
    for i in range(3):
        qs = slice(starts[i], starts[i] + ext[i])
        pos = prefix[i] + torch.arange(ext[i])
        want = _reference(q[qs], k_buf, v_buf, r2t[rows[i], : lens[i]].long(), pos, 0.3)
        torch.testing.assert_close(out[qs].double(), want, **TOL[dtype])


@pytest.mark.parametrize(
    "dtype,kv,d",
    [
        ("bf16", "bf16", 256),
        ("fp32", "fp32", 256),
        ("bf16", "fp8e4nv", 256),
        ("bf16", "fp8e5", 256),
        ("fp16", "bf16", 256),
        ("fp16", "fp16", 256),  # --dtype float16: float16 tensor-core dots
        ("fp16", "fp8e4nv", 256),
        ("bf16", "bf16", 128),  # Nemotron-H's head size: other tiles
    ],
)
def test_kernels_compile_for_sm90(dtype, kv, d):
    """Qwen3-Next-80B's full attention: 16 query heads, 2 KV heads, 256 dims (`d`: 128 for Nemotron-H);
    `kv`: the pool's dtype (float8 for --kv-cache-dtype fp8_e4m3 / fp8_e5m2, whose tensor-core dots
    take the query's dtype). Each fits sm_90's shared memory per block and keeps its values in registers
    at its launch configuration (`compile_sm90_in_registers`)."""
    from sglang.srt.layers.attention.triton_ops import decode_attention as dec
    from sglang.srt.layers.attention.triton_ops import extend_attention as ext

    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    names |= {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
    ieee = dec.f32_dot(names[dtype], names[kv])
    assert ieee == (dtype == "fp32" or kv == "bf16" != dtype)
    strides = lambda *names: {n: "i32" for n in names}  # noqa: E731
    stage1 = {
        "q_ptr": f"*{dtype}", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}",
        "req_to_token_ptr": "*i32", "rows_ptr": "*i64", "seq_lens_ptr": "*i64",
        "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "sm_scale": "fp32",
        **strides("stride_qb", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_r2t"),
        **{n: "constexpr" for n in ("NUM_Q_HEADS", "GROUP", "D", "BLOCK_D", "BLOCK_H", "BLOCK_N", "NUM_SPLITS", "F32_DOT")},
    }  # fmt: skip
    compile_sm90_in_registers(
        dec._decode_stage1_kernel,
        stage1,
        dict(NUM_Q_HEADS=16, GROUP=8, D=d, BLOCK_D=d, BLOCK_H=16, BLOCK_N=dec.stage1_block_n(d, ieee), NUM_SPLITS=8,
             F32_DOT=ieee),
        num_warps=dec.STAGE1_WARPS,
    )  # fmt: skip
    stage2 = {
        "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "o_ptr": f"*{dtype}", **strides("stride_ob", "stride_oh"),
        **{n: "constexpr" for n in ("NUM_Q_HEADS", "D", "BLOCK_D", "NUM_SPLITS", "BLOCK_S")},
    }  # fmt: skip
    compile_sm90_in_registers(
        dec._decode_stage2_kernel, stage2, dict(NUM_Q_HEADS=16, D=d, BLOCK_D=d, NUM_SPLITS=8, BLOCK_S=8)
    )
    block_m, block_n = ext.block_sizes(d, ieee)
    extend = {
        "q_ptr": f"*{dtype}", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}", "o_ptr": f"*{dtype}",
        "req_to_token_ptr": "*i32", "rows_ptr": "*i64", "seq_lens_ptr": "*i64", "extend_lens_ptr": "*i64",
        "extend_starts_ptr": "*i64", "sm_scale": "fp32",
        **strides("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot",
                  "stride_oh", "stride_r2t"),
        **{n: "constexpr" for n in ("GROUP", "D", "BLOCK_D", "BLOCK_M", "BLOCK_N", "F32_DOT")},
    }  # fmt: skip
    compile_sm90_in_registers(
        ext._extend_kernel,
        extend,
        dict(GROUP=8, D=d, BLOCK_D=d, BLOCK_M=block_m, BLOCK_N=block_n, F32_DOT=ieee),
        num_warps=ext.NUM_WARPS,
    )


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_serves_through_the_kernels_as_through_torch_sdpa(interpret, preset, page_size):
    """Prefill (one prompt in two chunks, so the second extend reads a cached prefix), then 5 greedy
    decode steps of 3 requests, with --attention-backend triton (interpreted) and torch_native."""
    from sglang.test.model_checks import make_runner, prefill, random_ids
    from sglang.test.runner_driver import RunnerDriver

    runs = []
    for backend in ("triton", "torch_native"):
        runner = make_runner(preset, page_size=page_size, attention_backend=backend)
        assert type(runner.attn_backend.full_attn_backend).__name__ == (
            "TritonAttnBackend" if backend == "triton" else "TorchNativeAttnBackend"
        )
        driver = RunnerDriver(runner)
        reqs = [driver.new_request() for _ in range(3)]
        logprobs = []
        for i, req in enumerate(reqs):
            logprobs += prefill(driver, req, random_ids(20 + 9 * i, seed=i), cuts=[16] if i == 2 else [])
        tokens = []
        for _ in range(5):
            res = driver.decode(reqs)
            tokens.append(res.next_token_ids.tolist())
            logprobs += res.next_token_logprobs.tolist()
        runs.append((tokens, logprobs))
    (tok_a, lp_a), (tok_b, lp_b) = runs
    assert tok_a == tok_b
    # Two float32 attention kernels summing in another order (~1e-7 per layer); a wrong mask or a
    # missed key moves logprobs by O(0.1) or more.
    torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), rtol=1e-4, atol=1e-4)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "dtype,kv_dtype", [(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, torch.float8_e4m3fn)]
)
def test_gpu_kernels_match_the_torch_twin_at_80b_shapes(dtype, kv_dtype):
    """Compiled on the GPU: Qwen3-Next-80B's heads (16 / 2 / 256), 24 decode rows up to 200 keys and
    an extend over cached prefixes; and a float8 pool (--kv-cache-dtype fp8_e4m3) under bfloat16."""
    from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd
    from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd

    hq, hk, d, dev, slots = 16, 2, 256, "cuda", 4096  # the 24 rows hold 2,236 keys
    rows = list(range(1, 25))
    lens = [1 + (37 * i) % 200 for i in range(24)]
    r2t = _req_to_token(rows, lens, seed=3, num_slots=slots).to(dev)
    k_buf, v_buf = (t.to(dev) for t in _pool(hk, d, dtype, seed=4, kv_dtype=kv_dtype, num_slots=slots))
    q = torch.randn(24, hq, d, device=dev).to(dtype)
    out = torch.empty_like(q)
    idx, seq = torch.tensor(rows, device=dev), torch.tensor(lens, device=dev)
    decode_attention_fwd(q, k_buf, v_buf, out, r2t, idx, seq, d**-0.5)
    for i, (row, n) in enumerate(zip(rows, lens, strict=True)):
        want = _reference(
            q[i : i + 1], k_buf, v_buf, r2t[row, :n].long(), torch.tensor([n - 1], device=dev), d**-0.5
        )
        torch.testing.assert_close(out[i].double(), want[0], **TOL[dtype])
    prefix, ext = [0, 17, 130], [90, 40, 3]
    lens = [p + e for p, e in zip(prefix, ext, strict=True)]
    rows = [2, 5, 9]
    r2t = _req_to_token(rows, lens, seed=5, num_slots=slots).to(dev)
    q = torch.randn(sum(ext), hq, d, device=dev).to(dtype)
    out = torch.empty_like(q)
    starts = [0, ext[0], ext[0] + ext[1]]
    as_dev = lambda v: torch.tensor(v, device=dev)  # noqa: E731
    extend_attention_fwd(
        q, k_buf, v_buf, out, r2t, as_dev(rows), as_dev(lens), as_dev(ext), as_dev(starts), max(ext), d**-0.5
    )
    for i in range(3):
        qs = slice(starts[i], starts[i] + ext[i])
        pos = prefix[i] + torch.arange(ext[i], device=dev)
        want = _reference(q[qs], k_buf, v_buf, r2t[rows[i], : lens[i]].long(), pos, d**-0.5)
        torch.testing.assert_close(out[qs].double(), want, **TOL[dtype])
