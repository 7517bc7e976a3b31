"""Block-wise FP8 (e4m3) compute on CUDA, as the published FP8 checkpoints define it (`quant_method: fp8`,
`weight_block_size: [128, 128]`, `activation_scheme: dynamic`): a weight [N, K] in float8_e4m3fn with one
float32 `weight_scale_inv` per 128 x 128 block ([ceil(N/128), ceil(K/128)], the factor that dequantizes it:
w = w_fp8 * scale), and activations quantized at run time per token and per 128-column group with
scale = amax / 448 (448: e4m3fn's largest finite value).

- `per_token_group_quant_fp8(x)`: x [..., K] -> (x_fp8, scales [..., ceil(K/128)] float32). One launch,
  one program per (row, group). Values are rounded to e4m3 in float32 arithmetic before
  the cast, so the kernel equals torch's round-to-nearest-even cast bit for bit, compiled or interpreted
  (Triton's interpreter converts float32 to fp8 approximately: ~2 % of values one step off otherwise).
- `w8a8_block_fp8_matmul(a, weight, weight_scale_inv)`: a [..., K] in bf16/fp16/fp32 (quantized with the
  function above: one launch more) or already float8_e4m3fn with its `a_scale`; FP8 tensor-core dots
  (`tl.dot` on fp8 operands: mma on sm_89, wgmma on sm_90), float32 accumulate, each K-block's product
  scaled by its a group scale x b block scale in the main loop, output in `output_dtype`. Edges (M, N or
  K not multiples of the tile) are masked: out-of-range a columns and b rows load as zeros. Scaling each
  128-long dot's result before adding it to the float32 accumulator also promotes the partial sums out of
  the tensor cores every 128 products: Hopper's FP8 dots keep fewer bits while they accumulate (DeepSeek-V3
  reports ~14 on the H800 and promotes every 128 for that reason). At decode sizes (M <= 16, the table's
  first row) K is split over several programs per output tile, whose float32 partial tiles one sum adds
  (`_gemm_split_k_kernel`, `split_k_for`: the comment above `gemm_config` says why).

Activations are quantized by a separate launch, not inside the GEMM: inside, every N-tile program would
quantize the same a tile again (N / BLOCK_N times over) on the CUDA cores, whose throughput is ~1/30 of
the FP8 tensor cores'; the separate pass reads a once (2 bytes per element) and writes 1 byte, ~5 % of
a prefill GEMM at the 80B's widest projection, and lets the MoE quantize each token once for its top-k
experts (`fused_moe_fp8_triton.py`).

The `_torch` twins give the same semantics in torch (dequantize, then matmul in float32): the CPU path
and the tests' reference. On CPU tensors the kernels run only under `TRITON_INTERPRET=1` (tests);
elsewhere off CUDA the public functions take their twins.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, dequantize_block_fp8

# Upstream's floor on a group's amax: an all-zero group gets a tiny scale, not a division by zero.
AMAX_EPS = 1e-10
BLOCK = 128  # the checkpoints' weight_block_size, and the activations' group


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # K split over this many programs per output tile, their float32 partial sums added after
    # (`_gemm_split_k_kernel`); 1: no split; 0: as many as bring the grid to ~2 programs per SM
    # (`split_k_for`).
    split_k: int = 1


# Tiles by shape class, the first whose `max_m` holds M (autotune-free: a server must not time configs at
# its first request, nor a CUDA graph capture). BLOCK_K = 128 is the scale block, so each K step takes one
# a scale per row and one b scale per column block; GROUP_M orders the programs so that consecutive ones
# share a tiles in L2. Each config compiles for sm_90 without spilling (test_fp8_gemm_triton.py checks every
# row). Measured on an H200 (2026-11-30, `benchmark/gpu/bench_fp8_gemm.py --sweep`, the 80B's seven dense
# shapes and Nemotron's 4,096-wide one): decode (M <= 16) reads the weights once, 16-row tiles of 64
# columns; up to M = 256 the 64 x 64 tiles took 0.84x the time of 64 x 128 summed over the shapes (at
# M = 256: faster on 7 of 8); prefill the 64 x 128 tiles with 4 warps and 4 stages 0.97x that of
# 128 x 128 with 8 warps and 3 (`GEMM_SWEEP_ONLY`, still timed by the sweep).
GEMM_CONFIGS: tuple[tuple[int, GemmConfig], ...] = (
    (16, GemmConfig(16, 64, 128, 1, 4, 4, split_k=0)),
    (256, GemmConfig(64, 64, 128, 4, 4, 4)),
    (1 << 62, GemmConfig(64, 128, 128, 8, 4, 4)),
)
GEMM_SWEEP_ONLY: tuple[GemmConfig, ...] = (GemmConfig(128, 128, 128, 8, 8, 3),)


# Decode (M <= 16) splits K where K is at least SPLIT_K_MIN_K. Such a GEMM streams the weight once and is
# bound by HBM bandwidth, which a GPU reaches only with programs on most of its SMs; unsplit, the 16 x 64
# tiles give N / 64 programs: 32 at N = 2,048, 8 at 512 (k / v), 1 at 64, on the H200's 132 SMs. Split K
# ways, each program streams K / S of its columns and writes its float32 partial tile, and one sum adds the
# S partials (deterministic, unlike atomics): S * M * N * 4 bytes written and read again. Measured on an
# H200 (2026-11-30) at M 1 / 8 / 16: the split 1.15-1.18x faster at K 4,096 (N 2,048), but 1.1-1.5x slower
# at K 2,048 (N 64 to 12,288) and 1.8x at K 512: a program streams too little there for the partial sums'
# extra launch to pay.
SPLIT_K_MIN_K = 4096
SPLIT_K_PROGRAMS_PER_SM = 2
_SMS_OFF_CUDA = 132  # (the interpreter: an H200's count, so that the split chosen is the GPU's)


def gemm_config(m: int) -> GemmConfig:
    return next(cfg for max_m, cfg in GEMM_CONFIGS if m <= max_m)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _SMS_OFF_CUDA
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_splits(cfg: GemmConfig, m: int, n: int, device: torch.device) -> int:
    """The parts that bring the grid of `cfg`'s tiles over [m, n] to ~SPLIT_K_PROGRAMS_PER_SM per SM."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    return -(-SPLIT_K_PROGRAMS_PER_SM * _sm_count(device) // tiles)


def split_k_for(cfg: GemmConfig, m: int, n: int, k: int, device: torch.device, scale_k: int = BLOCK) -> int:
    """The K columns each program of a split GEMM takes (whole `scale_k` blocks), or 0: no split (the
    config's `split_k` is 1, or the split leaves one part)."""
    k_blocks = -(-k // scale_k)
    splits = cfg.split_k
    if splits == 0 and k < SPLIT_K_MIN_K:
        return 0
    if splits == 0:
        splits = auto_splits(cfg, m, n, device)
    per_split = -(-k_blocks // max(1, min(splits, k_blocks)))
    return per_split * scale_k if per_split < k_blocks else 0


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_serves(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors on `t`'s device: CUDA, or CPU under the interpreter."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and _interpreting())


# --------------------------------------------------------------------------------------------- torch twins


def per_token_group_quant_fp8_torch(
    x: torch.Tensor, group_size: int = BLOCK, fuse_silu_and_mul: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of `per_token_group_quant_fp8` (the same bits; with `fuse_silu_and_mul`, up to the
    GPU's exp, which may round silu one ulp apart from torch's)."""
    if fuse_silu_and_mul:
        gate, up = x.chunk(2, -1)
        x = torch.nn.functional.silu(gate) * up
    k = x.shape[-1]
    groups = -(-k // group_size)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group_size - k)).unflatten(-1, (groups, group_size))
    amax = xf.abs().amax(-1).clamp(min=AMAX_EPS)
    # Divided by a 0-dim tensor, not a Python number: CUDA torch multiplies by the reciprocal of a CPU
    # scalar divisor (one ulp from the division at times), where the kernel's tl.div_rn and CPU torch
    # divide exactly (measured on an H200, 2026-11-29: the twin's scales differed from the kernel's).
    scale = amax / amax.new_tensor(FP8_MAX)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2)[..., :k].contiguous(), scale


def w8a8_block_fp8_matmul_torch(
    a: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size=(BLOCK, BLOCK),
    output_dtype: torch.dtype = torch.bfloat16,
    a_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch twin of `w8a8_block_fp8_matmul`: a quantized as the kernel quantizes it (or given in fp8
    with `a_scale`), both operands dequantized, one float32 matmul."""
    if a.dtype != FP8_DTYPE:
        a, a_scale = per_token_group_quant_fp8_torch(a, block_size[1])
    a_deq = dequantize_block_fp8(a, a_scale, (1, block_size[1]))
    w_deq = dequantize_block_fp8(weight, weight_scale_inv, block_size)
    return (a_deq @ w_deq.t()).to(output_dtype)


# --------------------------------------------------------------------------------------------- kernels

# Imported after the twins so that a CPU install without triton still has them.
try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from sglang.srt.utils.triton_jit import jit_for_env, maximum

    _MAX, _EPS = tl.constexpr(FP8_MAX), tl.constexpr(AMAX_EPS)
except ImportError:  # pragma: no cover - the twins serve
    triton = None


# e4m3 rounding in float32 (the quantization kernel's last step): adding 1.5 * 2^(e + 20) to |y| (e its
# float32 exponent, at least -6, where e4m3's subnormals begin) puts its e4m3 step, 2^(e - 3), at float32's
# last bit, so the add rounds there, to nearest with ties to even; the cast to fp8 after it is exact.
def _quant_kernel(
    x_ptr, q_ptr, s_ptr, K, x_stride, q_stride, GROUPS, GROUP: tl.constexpr, SILU_MUL: tl.constexpr
):  # fmt: skip
    """One (row, group): x's K columns quantized, or with SILU_MUL silu(x[:K]) * x[K:2K], rounded to x's
    dtype after the silu and after the product as torch rounds them (elementwise_triton.silu_mul's
    arithmetic)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = cols < K
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        act = x_ptr.dtype.element_ty
        up = tl.load(x_ptr + row * x_stride + K + cols, mask=mask, other=0.0).to(tl.float32)
        x = ((x / (1.0 + tl.exp(-x))).to(act).to(tl.float32) * up).to(act).to(tl.float32)
    amax = tl.maximum(tl.reduce(tl.abs(x), 0, maximum), _EPS)
    scale = tl.div_rn(amax, _MAX)
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -_MAX), _MAX)
    e = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6) + 20
    magic = (e << 23).to(tl.float32, bitcast=True) * 1.5
    r = (tl.abs(y) + magic) - magic
    r = tl.where(y < 0, -r, r)
    tl.store(q_ptr + row * q_stride + cols, r.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * GROUPS + g, scale)


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int = BLOCK, fuse_silu_and_mul: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (bf16 / fp16 / fp32) -> (x_fp8 [..., K] float8_e4m3fn, scales [..., ceil(K/group_size)]
    float32): per row and per `group_size` columns, scale = max(amax, 1e-10) / 448 and
    x_fp8 = round(x / scale) (nearest, ties to even; upstream's dynamic activation scheme).
    `fuse_silu_and_mul` (upstream's flag): x [..., 2K] holds gate | up, and silu(gate) * up is quantized,
    in the same launch (the gated experts' activation, without its [..., K] intermediate in memory)."""
    if triton is None or not triton_serves(x):
        return per_token_group_quant_fp8_torch(x, group_size, fuse_silu_and_mul)
    assert group_size & (group_size - 1) == 0, "group_size must be a power of two"
    k = x.shape[-1] // 2 if fuse_silu_and_mul else x.shape[-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    groups = triton.cdiv(k, group_size)
    q = torch.empty(rows.shape[0], k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(rows.shape[0], groups, dtype=torch.float32, device=x.device)
    if rows.numel():
        jit_for_env(_quant_kernel)[(rows.shape[0], groups)](
            rows, q, s, k, rows.stride(0), q.stride(0), groups, GROUP=group_size, SILU_MUL=fuse_silu_and_mul
        )
    return q.view(*x.shape[:-1], k), s.view(*x.shape[:-1], groups)


def _block_scaled_dot(
    acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, mm, mn, K, SCALE_K: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """The block-FP8 GEMMs' main loop (the dense and the grouped MoE kernel's): acc [BLOCK_M, BLOCK_N]
    float32 plus, for each BLOCK_K step of K, the fp8 dot of the a tile (rows masked by mm, at a_ptrs:
    [BLOCK_M, BLOCK_K]) and the b tile (columns masked by mn, at b_ptrs: [BLOCK_K, BLOCK_N]) scaled by the
    step's a row scales (as_ptrs + k0 // SCALE_K) and b column scales (bs_ptrs + k0 // SCALE_K), before
    it is added: each K-block's product in float32 (the module docstring says why). Columns of K past its
    end load as zeros."""
    rk = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        mk = rk < K - k0
        a = tl.load(a_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mk[:, None] & mn[None, :], other=0.0)
        a_s = tl.load(as_ptrs + k0 // SCALE_K, mask=mm, other=0.0)
        b_s = tl.load(bs_ptrs + k0 // SCALE_K, mask=mn, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


# Jitted at import, as a kernel's callee must be (jit_for_env hands kernels run by the interpreter its
# interpreted form).
block_scaled_dot = JITFunction(_block_scaled_dot) if triton is not None else None


def _gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr,
    M, N, K, a_stride, c_stride, AS_COLS, BS_COLS,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """c[M, N] = (a * as) @ (b * bs)^T: a [M, K] fp8 with as [M, AS_COLS]; b [N, K] fp8 with
    bs [ceil(N / SCALE_N), BS_COLS]; the K step's scales come from column k0 // SCALE_K."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = (M + BLOCK_M - 1) // BLOCK_M, (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm, mn = rm < M, rn < N
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    a_ptrs = a_ptr + rm64[:, None] * a_stride + rk[None, :]
    b_ptrs = b_ptr + rn64[None, :] * K + rk[:, None]
    as_ptrs = as_ptr + rm64 * AS_COLS
    bs_ptrs = bs_ptr + (rn // SCALE_N) * BS_COLS
    acc = (rm[:, None] * 0 + rn[None, :] * 0).to(tl.float32)  # zeros (triton_jit says why not tl.zeros)
    acc = block_scaled_dot(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, mm, mn, K, SCALE_K, BLOCK_K)
    c_ptrs = c_ptr + rm64[:, None] * c_stride + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def _gemm_split_k_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, p_ptr,
    M, N, K, K_SPLIT, a_stride, AS_COLS, BS_COLS,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """`_gemm_kernel`'s product over K columns [s * K_SPLIT, (s + 1) * K_SPLIT) for program s of axis 2,
    its float32 partial tile written to p[s] ([S, M, N]); K_SPLIT is whole SCALE_K blocks, so each
    split starts at a scale column."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_start = split * K_SPLIT
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = k_start + tl.arange(0, BLOCK_K)
    mm, mn = rm < M, rn < N
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    a_ptrs = a_ptr + rm64[:, None] * a_stride + rk[None, :]
    b_ptrs = b_ptr + rn64[None, :] * K + rk[:, None]
    as_ptrs = as_ptr + rm64 * AS_COLS + k_start // SCALE_K
    bs_ptrs = bs_ptr + (rn // SCALE_N) * BS_COLS + k_start // SCALE_K
    acc = (rm[:, None] * 0 + rn[None, :] * 0).to(tl.float32)
    k_len = tl.minimum(K_SPLIT, K - k_start)
    acc = block_scaled_dot(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, mm, mn, k_len, SCALE_K, BLOCK_K)
    p_ptrs = p_ptr + split.to(tl.int64) * M * N + rm64[:, None] * N + rn[None, :]
    tl.store(p_ptrs, acc, mask=mm[:, None] & mn[None, :])


def check_block_operands(weight: torch.Tensor, scale: torch.Tensor, block_size) -> None:
    """The weight and its block scales fit each other (a wrong scale grid would read out of bounds)."""
    bn, bk = block_size
    n, k = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-n // bn), -(-k // bk))
    assert weight.dtype == FP8_DTYPE, f"weight must be float8_e4m3fn, got {weight.dtype}"
    assert tuple(scale.shape) == want, f"weight_scale_inv has shape {tuple(scale.shape)}, expected {want}"
    assert scale.dtype == torch.float32 and scale.is_contiguous() and weight.is_contiguous()


def w8a8_block_fp8_matmul(
    a: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size=(BLOCK, BLOCK),
    output_dtype: torch.dtype = torch.bfloat16,
    a_scale: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """a [..., K] (bf16 / fp16 / fp32, quantized per token and per block_size[1] columns here; or
    float8_e4m3fn with `a_scale` [..., ceil(K / block_size[1])]) times weight [N, K] float8_e4m3fn with
    `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] float32 -> [..., N] in `output_dtype`. `config`: the tile
    (default: `gemm_config(M)`; the benchmark's sweep passes others)."""
    bn, bk = block_size
    check_block_operands(weight, weight_scale_inv, block_size)
    if triton is None or not triton_serves(a):
        return w8a8_block_fp8_matmul_torch(a, weight, weight_scale_inv, block_size, output_dtype, a_scale)
    n, k = weight.shape
    assert a.shape[-1] == k, f"a has {a.shape[-1]} columns, the weight {k}"
    if a.dtype != FP8_DTYPE:
        a, a_scale = per_token_group_quant_fp8(a, bk)
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k)
    if a2.stride(-1) != 1:
        a2 = a2.contiguous()
    a_s = a_scale.reshape(-1, a_scale.shape[-1]).float().contiguous()
    assert a_s.shape == (a2.shape[0], -(-k // bk)), f"a_scale has shape {tuple(a_scale.shape)}"
    m = a2.shape[0]
    cfg = config or gemm_config(m)
    assert bk % cfg.block_k == 0 and (cfg.block_n <= bn or cfg.block_n % bn == 0)
    out = torch.empty(m, n, dtype=output_dtype, device=a.device)
    k_split = split_k_for(cfg, m, n, k, a.device, bk) if m else 0
    if k_split:
        splits = -(-k // k_split)
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), splits)
        jit_for_env(_gemm_split_k_kernel)[grid](
            a2, a_s, weight, weight_scale_inv, partial, m, n, k, k_split, a2.stride(0),
            a_s.shape[1], weight_scale_inv.shape[1], SCALE_N=bn, SCALE_K=bk,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        out.copy_(partial.sum(0))
    elif m:
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        jit_for_env(_gemm_kernel)[grid](
            a2, a_s, weight, weight_scale_inv, out, m, n, k, a2.stride(0), out.stride(0),
            a_s.shape[1], weight_scale_inv.shape[1], SCALE_N=bn, SCALE_K=bk,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out.view(*lead, n)
