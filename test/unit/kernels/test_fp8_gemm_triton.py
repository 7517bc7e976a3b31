"""The block-FP8 kernels (layers/quantization/fp8_kernel.py): the activation quantization and the block
GEMM under `TRITON_INTERPRET=1` against their torch twins on tiny shapes with partial blocks, the twin
against a float64 dequantize-and-matmul, and every tile of the config table compiled for sm_90 without
spills."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.quantization import fp8_kernel as fk
from sglang.test.ci_register import register_cpu_ci
from sglang.test.sm90 import compile_sm90_in_registers

register_cpu_ci(est_time=20, suite="per-commit-cpu")

SHAPES = [(64, 64), (200, 200), (256, 128), (128, 256)]  # (N, K): whole and partial 128-blocks
# How far the kernel's sums may be from the twin's, as a fraction of the sum of the terms' magnitudes.
# Interpreted (numpy float32 dots): float32 rounding of sums of at most 384 terms in another order (per
# 128-block, scaled per block, where the twin scales first and sums once), under 2^-16. Compiled on
# Hopper: the FP8 tensor cores keep fewer bits while accumulating inside one dot (DeepSeek-V3 reports
# ~14 on the H800); the kernel promotes each 128-long block's dot to float32 (where it applies the
# scales), so the error stays near 2^-13 per block: 2^-10 leaves margin. A wrong block scale, row or
# masked edge is O(1) of it.
SUM_TOL = {"cpu": 2**-16, "cuda": 2**-10}


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as the checkpoints store it: fp8 values over e4m3's range, one positive scale per block."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(fk.FP8_DTYPE)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 1e-3 + 1e-4
    return w, scale


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Columns of very different magnitudes (as real activations have), so the groups' scales differ."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)


def _abs_product(a_deq: torch.Tensor, w_deq: torch.Tensor) -> torch.Tensor:
    return a_deq.abs().double() @ w_deq.abs().double().t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_equals_the_twin_bit_for_bit(kernel_device, dtype):
    """The same fp8 bits and scales as torch's cast (to nearest, ties to even): a partial last group, an
    all-zero group, rows strided in memory, and a group whose amax is 448 (scale 1) holding exact ties."""
    x = _activations(6, 200, seed=1)
    x[2, 128:] = 0
    # Scale 1: 1.0625 lies halfway between e4m3's 1.0 and 1.125 (to even: 1.0), 1.1875 between 1.125 and
    # 1.25 (to 1.25), 3.5 * 2^-9 between the subnormals 3 and 4 * 2^-9 (to 4 * 2^-9).
    x[3, :128] = 0.0
    x[3, :4] = torch.tensor([448.0, 1.0625, -1.1875, 3.5 * 2**-9])
    wide = torch.zeros(6, 256, dtype=dtype)
    wide[:, :200] = x.to(dtype)
    x = wide.to(kernel_device)[:, :200]  # a row stride of 256
    q, s = fk.per_token_group_quant_fp8(x)
    q_want, s_want = fk.per_token_group_quant_fp8_torch(x)
    assert q.dtype == fk.FP8_DTYPE and s.dtype == torch.float32 and s.shape == (6, 2)
    assert torch.equal(s, s_want)
    assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8))
    assert q[3, :4].float().tolist() == [448.0, 1.0, -1.25, 4 * 2**-9]
    # The published "dynamic" scheme: scale = amax / 448 per row and 128 columns (an all-zero group: 1e-10).
    amax = torch.nn.functional.pad(x.float().abs(), (0, 56)).view(6, 2, 128).amax(-1)
    # (divided by a 0-dim tensor: CUDA torch multiplies by the reciprocal of a Python-number divisor)
    torch.testing.assert_close(s, amax.clamp(min=1e-10) / amax.new_tensor(448.0), rtol=0, atol=0)
    assert q[2, 128:].float().abs().sum() == 0


def test_quant_fused_with_silu_and_mul(kernel_device):
    """`fuse_silu_and_mul`: silu(gate) * up of a [rows, 2 x 200] input quantized in one launch, against
    silu and mul in torch then the twin's quantization (float32: silu's exp may round an ulp apart from
    torch's, which moves a value across an e4m3 rounding boundary with odds of ~2^-20, so all bits equal
    here; the bound allows one e4m3 step, 2^-3 relative, for such a value on another platform)."""
    h = (torch.randn(7, 400, generator=torch.Generator().manual_seed(12)) * 3).to(kernel_device)
    q, s = fk.per_token_group_quant_fp8(h, fuse_silu_and_mul=True)
    q_want, s_want = fk.per_token_group_quant_fp8_torch(torch.nn.functional.silu(h[:, :200]) * h[:, 200:])
    assert q.shape == (7, 200) and s.shape == (7, 2)
    torch.testing.assert_close(s, s_want, rtol=1e-6, atol=0)
    deq, deq_want = fk.dequantize_block_fp8(q, s, (1, 128)), fk.dequantize_block_fp8(q_want, s_want, (1, 128))
    torch.testing.assert_close(deq, deq_want, rtol=2**-3, atol=s.max().item() * 2**-9)
    assert (q.view(torch.uint8) != q_want.view(torch.uint8)).float().mean() < 1e-3


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_gemm_equals_the_twin(kernel_device, m, n, k):
    """The kernel against the twin on the same activations (quantized by the kernel path and by the twin
    bit for bit, checked above), float32 output: the same products summed differently (`SUM_TOL`)."""
    a = _activations(m, k, seed=m + n).to(kernel_device)
    w, scale = (t.to(kernel_device) for t in _weight(n, k, seed=k))
    got = fk.w8a8_block_fp8_matmul(a, w, scale, output_dtype=torch.float32)
    want = fk.w8a8_block_fp8_matmul_torch(a, w, scale, output_dtype=torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    aq, a_s = fk.per_token_group_quant_fp8_torch(a)
    magnitude = _abs_product(fk.dequantize_block_fp8(aq, a_s, (1, 128)), fk.dequantize_block_fp8(w, scale))
    assert ((got.double() - want.double()).abs() <= SUM_TOL[kernel_device] * magnitude).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_from_prequantized_inputs_and_half_outputs(kernel_device, dtype):
    """Activations given in fp8 with their scales (what a fused producer hands over), leading batch dims,
    and bf16 / fp16 output: the twin's float32 result within one step of `dtype` (2^-7 / 2^-10 relative:
    compiled, the cast rounds to nearest, half a step; the interpreter truncates, up to a whole one) plus
    the summation difference (`SUM_TOL`)."""
    a = _activations(10, 200, seed=3).to(dtype).to(kernel_device)
    w, scale = (t.to(kernel_device) for t in _weight(192, 200, seed=4))
    aq, a_s = fk.per_token_group_quant_fp8(a)
    got = fk.w8a8_block_fp8_matmul(
        aq.view(2, 5, 200), w, scale, output_dtype=dtype, a_scale=a_s.view(2, 5, 2)
    )
    want = fk.w8a8_block_fp8_matmul_torch(a, w, scale, output_dtype=torch.float32)
    assert got.shape == (2, 5, 192) and got.dtype == dtype
    rel = 2**-7 if dtype == torch.bfloat16 else 2**-10
    err = (got.reshape(10, 192).double() - want.double()).abs()
    magnitude = _abs_product(fk.dequantize_block_fp8(aq, a_s, (1, 128)), fk.dequantize_block_fp8(w, scale))
    assert (err <= rel * want.double().abs() + SUM_TOL[kernel_device] * magnitude).all()


def test_every_table_config_masks_its_edges(interpret):
    """Each tile of the table on the same partial-block shape (M 33, N 200, K 200): equal results."""
    a = _activations(33, 200, seed=5)
    w, scale = _weight(200, 200, seed=6)
    aq, a_s = fk.per_token_group_quant_fp8(a)
    want = fk.w8a8_block_fp8_matmul_torch(aq, w, scale, output_dtype=torch.float32, a_scale=a_s)
    magnitude = _abs_product(fk.dequantize_block_fp8(aq, a_s, (1, 128)), fk.dequantize_block_fp8(w, scale))
    for _, cfg in fk.GEMM_CONFIGS:
        got = fk.w8a8_block_fp8_matmul(aq, w, scale, output_dtype=torch.float32, a_scale=a_s, config=cfg)
        assert ((got.double() - want.double()).abs() <= SUM_TOL["cpu"] * magnitude).all(), cfg


def test_grouped_program_order_covers_every_tile(interpret):
    """GROUP_M > 1 with more row tiles than a group and a last group cut short (M 150 in 16-row tiles:
    groups of 4, 4 and 2 tiles): every output tile written once, as the twin's."""
    a = _activations(150, 128, seed=13)
    w, scale = _weight(200, 128, seed=14)
    cfg = fk.GemmConfig(16, 64, 128, 4, 4, 2)
    got = fk.w8a8_block_fp8_matmul(a, w, scale, output_dtype=torch.float32, config=cfg)
    want = fk.w8a8_block_fp8_matmul_torch(a, w, scale, output_dtype=torch.float32)
    aq, a_s = fk.per_token_group_quant_fp8_torch(a)
    magnitude = _abs_product(fk.dequantize_block_fp8(aq, a_s, (1, 128)), fk.dequantize_block_fp8(w, scale))
    assert ((got.double() - want.double()).abs() <= SUM_TOL["cpu"] * magnitude).all()


def test_split_k_by_shape():
    """Decode's automatic split from K 4,096 (32 blocks; below it the H200 measured the split slower),
    for ~2 programs per SM of the H200's 132: N 2,048 (32 tiles) in 8 parts of 512 columns, N 512
    (8 tiles) in 32 of one block, N 12,288 (192 tiles) in 2; K 2,048 (the 80B's other projections) and
    M above 16 are not split; an explicit split is whole blocks, at most one part a block."""
    cfg = fk.gemm_config(1)
    cpu = torch.device("cpu")
    assert [fk.split_k_for(cfg, 1, n, 4096, cpu) for n in (2048, 512, 12288)] == [512, 128, 2048]
    assert [fk.split_k_for(cfg, 1, n, 2048, cpu) for n in (2048, 512, 64, 12288)] == [0] * 4
    assert fk.split_k_for(cfg, 16, 2048, 4096, cpu) == 512
    assert fk.split_k_for(cfg._replace(split_k=8), 1, 2048, 2048, cpu) == 256
    assert fk.split_k_for(fk.gemm_config(17), 17, 2048, 2048, cpu) == 0
    assert fk.split_k_for(cfg._replace(split_k=1), 1, 2048, 2048, cpu) == 0
    assert fk.split_k_for(cfg._replace(split_k=64), 1, 64, 300, cpu) == 128  # (at most one part a block)


def test_the_config_table_covers_every_m():
    assert fk.gemm_config(1).block_m == 16 and fk.gemm_config(8192).block_n == 128
    rows = [cfg for _, cfg in fk.GEMM_CONFIGS]
    assert [fk.gemm_config(m) for m in (16, 17, 64, 65, 256, 257)] == [rows[i] for i in (0, 1, 1, 1, 1, 2)]


@pytest.mark.parametrize("n,k", [(200, 200), (256, 384)])
def test_the_twin_against_a_float64_reference(n, k):
    """The twin (activations quantized, weights dequantized, float32 matmul) against float64 of the
    unquantized activations times the dequantized weight: e4m3 keeps 3 mantissa bits, so rounding a
    value moves it by at most 2^-4 of itself (normal range) or half its group's subnormal step
    (2^-10 x scale); the bound is that, summed over each output's terms, plus float32's rounding."""
    a = _activations(9, k, seed=7)
    w, scale = _weight(n, k, seed=8)
    w_deq = fk.dequantize_block_fp8(w, scale).double()
    got = fk.w8a8_block_fp8_matmul_torch(a, w, scale, output_dtype=torch.float32).double()
    ref = a.double() @ w_deq.t()
    _, a_s = fk.per_token_group_quant_fp8_torch(a)
    subnormal_step = (a_s.double() * 2**-10).repeat_interleave(128, -1)[:, :k]
    bound = (2**-4 * a.double().abs() + subnormal_step) @ w_deq.abs().t() + 2**-20 * _abs_product(a, w_deq)
    err = (got - ref).abs()
    assert (err <= bound).all()
    # And the bound is not vacuous: the quantization's error is of its order, not far below it.
    assert err.max() > 0.05 * bound.max()


def test_off_cuda_without_the_interpreter_the_twins_serve(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a = _activations(3, 128, seed=9)
    w, scale = _weight(64, 128, seed=10)
    got = fk.w8a8_block_fp8_matmul(a, w, scale, output_dtype=torch.float32)
    assert torch.equal(got, fk.w8a8_block_fp8_matmul_torch(a, w, scale, output_dtype=torch.float32))


def test_a_wrong_scale_grid_is_refused():
    w, scale = _weight(200, 200, seed=11)
    with pytest.raises(AssertionError, match="weight_scale_inv has shape"):
        fk.w8a8_block_fp8_matmul(torch.randn(2, 200), w, scale[:1])


GEMM_SIGNATURE = {
    "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*bf16",
    **{name: "i32" for name in ("M", "N", "K", "a_stride", "c_stride", "AS_COLS", "BS_COLS")},
    **{name: "constexpr" for name in ("SCALE_N", "SCALE_K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")},
}  # fmt: skip


@pytest.mark.parametrize(
    "cfg", [cfg for _, cfg in fk.GEMM_CONFIGS] + list(fk.GEMM_SWEEP_ONLY), ids=lambda c: f"{c.block_m}x{c.block_n}"
)
def test_gemm_compiles_for_sm90(cfg):
    """Every tile of the table compiles for an H100/H200 (FP8 dots), fits its shared memory and keeps
    its values in registers, with the launch's warps and stages; N, K and the row strides as at the 80B's
    shapes, multiples of 16 (Triton specialises them so at launch)."""
    constexprs = dict(SCALE_N=128, SCALE_K=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m)  # fmt: skip
    compiled = compile_sm90_in_registers(
        fk._gemm_kernel, GEMM_SIGNATURE, constexprs, ("N", "K", "a_stride", "c_stride"),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    # Pipelined: num_stages - 1 tiles of both fp8 operands in flight in shared memory (one without the
    # alignment: the loads then go element by element through registers, and spill).
    assert compiled.metadata.shared >= (cfg.num_stages - 1) * (cfg.block_m + cfg.block_n) * cfg.block_k
    ptx = compiled.asm["ptx"]
    assert "e4m3" in ptx  # the dots run on fp8 operands (mma / wgmma .e4m3), not on upcast copies
    # Hopper's warp-group MMA from shared memory where the tile has the rows for it (64 per warp group).
    assert ("wgmma" in ptx) == (cfg.block_m >= 64)


def test_quant_compiles_for_sm90():
    signature = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                 **{name: "i32" for name in ("K", "x_stride", "q_stride", "GROUPS")},
                 "GROUP": "constexpr", "SILU_MUL": "constexpr"}  # fmt: skip
    for silu_mul in (False, True):
        compile_sm90_in_registers(fk._quant_kernel, signature, dict(GROUP=128, SILU_MUL=silu_mul))



# Qwen3-Next-80B's dense projections (N, K): GDN in_proj_qkvz and in_proj_ba, GDN / attention out_proj,
# attention q (gated) and k / v, the shared expert; Nemotron-H-8B's 4,096-wide layers.
REAL_SHAPES = [(12288, 2048), (64, 2048), (2048, 4096), (8192, 2048), (512, 2048), (1024, 2048), (4096, 4096)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", REAL_SHAPES)
@pytest.mark.parametrize("m", [1, 64, 256, 8192])
def test_gpu_gemm_at_real_shapes(m, n, k):
    """Compiled on the GPU, bfloat16 in and out, against the twin's float32 result: one bf16 rounding of
    the output (half a step, 2^-9 relative) plus the summation difference on Hopper (`SUM_TOL`); the
    quantization is the twin's value for value (IEEE division and rounding; a zero's sign aside)."""
    torch.manual_seed(m + n + k)
    a = (torch.randn(m, k, device="cuda") * torch.logspace(-2, 1, k, device="cuda")).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(fk.FP8_DTYPE)
    scale = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-3 + 1e-4
    got = fk.w8a8_block_fp8_matmul(a, w, scale, output_dtype=torch.bfloat16)
    q, s = fk.per_token_group_quant_fp8(a)
    q_want, s_want = fk.per_token_group_quant_fp8_torch(a)
    # Equal as numbers: on an H200 (2026-11-30) the only differences in 14 of these shapes (1 to 101 of
    # 0.26M-34M values) were zeros' signs, a tiny negative x rounded to +0 where torch keeps -0. A zero
    # adds nothing to the dot products whatever its sign, so the GEMM below is the same.
    same = torch.equal(s, s_want) and torch.equal(q.float(), q_want.float())
    assert same, _explain(a, q, s, q_want, s_want)
    want = fk.w8a8_block_fp8_matmul_torch(a, w, scale, output_dtype=torch.float32).double()
    magnitude = _abs_product(fk.dequantize_block_fp8(q, s, (1, 128)), fk.dequantize_block_fp8(w, scale))
    assert ((got.double() - want).abs() <= 2**-9 * want.abs() + SUM_TOL["cuda"] * magnitude).all()


def _explain(a: torch.Tensor, q, s, q_want, s_want) -> str:
    """Which elements differ and what each side computed, beside the CPU twin's answer (CPU torch divides
    and rounds exactly): a GPU run's log then says whether the kernel or CUDA torch is off, and where (an
    e4m3 tie, a subnormal, a scale one ulp apart)."""
    q_cpu, s_cpu = fk.per_token_group_quant_fp8_torch(a.cpu())
    bad_s = (s != s_want).cpu()
    bad_q = (q.float() != q_want.float()).cpu()  # (-0 == +0)
    lines = [f"{int(bad_s.sum())} of {bad_s.numel()} scales and {int(bad_q.sum())} of {bad_q.numel()} fp8 values differ"]
    for row, group in bad_s.nonzero()[:4].tolist():
        lines.append(
            f"scale [{row}, {group}]: kernel {s[row, group].item()!r} twin {s_want[row, group].item()!r} "
            f"cpu {s_cpu[row, group].item()!r}"
        )
    for row, col in bad_q.nonzero()[:8].tolist():
        group = col // 128
        x = a[row, col].float().item()
        lines.append(
            f"q [{row}, {col}]: x {x!r}, kernel {q[row, col].float().item()!r} twin "
            f"{q_want[row, col].float().item()!r} cpu {q_cpu[row, col].float().item()!r}; scales kernel "
            f"{s[row, group].item()!r} cpu {s_cpu[row, group].item()!r}; x / scale in float64 "
            f"{x / s_cpu[row, group].item()!r}"
        )
    return "\n".join(lines)


def test_the_benchmark_script_runs_its_cpu_check(interpret, capsys):
    """benchmark/gpu/bench_fp8_gemm.py (run on a GPU only when one is lent) keeps working: its CPU check
    (run in this process: a fresh interpreter would cost seconds of imports) prints the dense and MoE
    rows, each case timed, the sweep's tiles among them."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmark" / "gpu" / "bench_fp8_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_fp8_gemm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--device", "cpu", "--reps", "1", "--sweep"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["kernel"] for r in rows] == ["dense tiny", "dense tiny", "moe experts"]
    assert all(ms > 0 for r in rows for ms in r["ms"].values())
    assert {"fp8", "fp8+quant", "bf16", "fp8 split-k", "fp8 unsplit"} <= set(rows[0]["ms"])
    tiles = len(fk.GEMM_CONFIGS) + len(fk.GEMM_SWEEP_ONLY)
    assert len(rows[0]["ms"]) == 5 + tiles and rows[0]["split_k_over_unsplit"] > 0
    assert {"fp8", "bf16"} <= set(rows[2]["ms"]) and len(rows[2]["ms"]) > 2
