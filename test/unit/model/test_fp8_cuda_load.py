"""The CUDA layout of an FP8 checkpoint (issue 53, review item 1), built on the CPU (`load_model`'s `fp8`
layout argument): its FP8 linears hold the checkpoint's FP8 bytes and block scales as published, not a
requantization of the dequantized weight; under tensor parallelism each rank holds its part of both, a
fused projection's pieces each split with their scales; a model's split of a fused checkpoint tensor
keeps the bytes where the split falls on the block grid. Also (item 3): `load_model` fills the model the
memory planner counted, built on the meta device once."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.distributed import parallel_state as ps
from sglang.srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from sglang.srt.layers.quantization.fp8 import (
    FP8_DTYPE,
    SCALE_SUFFIX,
    Fp8BlockLinear,
    Fp8Config,
    Fp8Layout,
    Fp8Weight,
    dequantize_block_fp8,
    quantize_block_fp8,
    row_block_of,
    swap_fp8_linears,
)
from sglang.srt.layers.quantization.fp8_kernel import (
    per_token_group_quant_fp8_torch,
    w8a8_block_fp8_matmul_torch,
)
from sglang.srt.mem_cache.weight_bytes import planned_parallel, weight_bytes_of
from sglang.srt.models.loader import WeightLoader
from sglang.srt.models.registry import build_meta_model, load_model, materialize
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

CUDA_LAYOUT = Fp8Layout(linears=True, experts=True)


def _checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.fixture(scope="module")
def narrow_scales(tmp_path_factory) -> str:
    """tiny-qwen3-next-fp8 with every block's values at 3/4 of e4m3's range (scales 4/3 larger): a
    valid checkpoint whose bytes change under dequantize-and-requantize (which puts each block's largest
    value at 448), so only a load that copies them keeps them."""
    src = Path(resolve_model_path("tiny-qwen3-next-fp8"))
    out = tmp_path_factory.mktemp("qwen3-next-fp8-narrow")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = _checkpoint(src)
    for name in [n for n in tensors if n.endswith(SCALE_SUFFIX)]:
        base = name.removesuffix(SCALE_SUFFIX)
        tensors[base] = (tensors[base].float() * 0.75).to(FP8_DTYPE)
        tensors[name] = tensors[name] / 0.75
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize("which", ["published", "narrow_scales"])
def test_fp8_linears_hold_the_checkpoints_bytes_and_scales(which, request):
    path = (
        resolve_model_path("tiny-qwen3-next-fp8") if which == "published" else request.getfixturevalue(which)
    )
    ckpt, cfg = _checkpoint(path), load_hf_config(path)
    # Built on the meta device once (review item 3): the planner counts the model the loader then fills.
    meta = build_meta_model(cfg, "cpu", CUDA_LAYOUT)
    planned = weight_bytes_of(meta, torch.float32).total
    model = load_model(cfg, path, torch.float32, "cpu", meta=meta)
    assert model is meta and planned == sum(p.numel() * p.element_size() for p in model.parameters())
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Fp8BlockLinear)}
    assert len(linears) >= 8, sorted(linears)  # attention q/k/v/o, out_proj, shared experts, ...
    changed = 0
    for name, m in linears.items():
        weight, scale = ckpt[f"{name}.weight"], ckpt[f"{name}.weight{SCALE_SUFFIX}"]
        assert torch.equal(_bits(m.weight), _bits(weight)), name
        assert torch.equal(m.weight_scale_inv, scale), name
        # What the old path (dequantize, requantize) would hold: it differs in the narrow checkpoint.
        q, _ = quantize_block_fp8(dequantize_block_fp8(weight, scale))
        changed += not torch.equal(_bits(q), _bits(weight))
    assert changed == (0 if which == "published" else len(linears))

    # The forward through the torch twin of the block GEMM (activations quantized per token and
    # 128-column group) against float64 of the unquantized activations times the checkpoint's
    # dequantized weight: each activation moves by at most 2^-4 of itself (e4m3's 3 mantissa bits) or
    # half its group's subnormal step (2^-10 of its scale); the bound sums that over each output's
    # terms, plus float32's rounding (test_fp8_gemm_triton's twin bound).
    g = torch.Generator().manual_seed(0)
    for name, m in linears.items():
        x = torch.randn(5, m.in_features, generator=g)
        got = w8a8_block_fp8_matmul_torch(x, m.weight, m.weight_scale_inv, m.block, torch.float32).double()
        w = dequantize_block_fp8(ckpt[f"{name}.weight"], ckpt[f"{name}.weight{SCALE_SUFFIX}"]).double()
        _, x_s = per_token_group_quant_fp8_torch(x)
        step = (x_s.double() * 2**-10).repeat_interleave(128, -1)[:, : m.in_features]
        bound = (2**-4 * x.double().abs() + step) @ w.abs().t() + 2**-20 * (x.double().abs() @ w.abs().t())
        assert ((got - x.double() @ w.t()).abs() <= bound).all(), name
        assert torch.equal(m(x), F.linear(x, m.dequantized_weight(torch.float32)))  # (CPU: the torch path)


class _Block(nn.Module):
    """A fused column-parallel projection of three 256-row pieces and a row-parallel one."""

    def __init__(self):
        super().__init__()
        self.qkv = MergedColumnParallelLinear(384, [256, 256, 256])
        self.out = RowParallelLinear(256, 200)


def _pair(rows: int, cols: int, seed: int) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_block_fp8(torch.randn(rows, cols, generator=g) * 0.5)
    return Fp8Weight(q, s * 1.5)  # (narrow scales: requantizing would change the bytes)


@contextmanager
def _tp_rank(rank: int, size: int = 2):
    """This process as TP rank `rank` of `size` (a stand-in group: shapes and shards only, no collective)."""
    with planned_parallel(size):
        ps._TP = ps.GroupCoordinator(list(range(size)), rank)
        yield


@pytest.mark.parametrize("rank", [0, 1])
def test_under_tp_each_rank_holds_its_part_of_the_bytes_and_scales(rank):
    """TP 2: each of qkv's three pieces gives rank r its rows [128 r, 128 r + 128) and their scale block
    row; out gives its columns [128 r, 128 r + 128) and their scale column."""
    qkv, out = _pair(768, 384, 1), _pair(200, 256, 2)
    with _tp_rank(rank):
        with torch.device("meta"):
            block = _Block()
            swap_fp8_linears(block, Fp8Config())
        materialize(block, torch.float32, torch.device("cpu"))
        loader = WeightLoader(block)
        loader.load("qkv.weight", qkv)
        loader.load("out.weight", out)
        loader.finish()
    rows = torch.cat([torch.arange(p * 256 + rank * 128, p * 256 + rank * 128 + 128) for p in range(3)])
    assert torch.equal(_bits(block.qkv.weight), _bits(qkv.weight[rows]))
    assert torch.equal(block.qkv.weight_scale_inv, qkv.scale_inv[[rank, 2 + rank, 4 + rank]])
    assert torch.equal(_bits(block.out.weight), _bits(out.weight[:, rank * 128 : rank * 128 + 128]))
    assert torch.equal(block.out.weight_scale_inv, out.scale_inv[:, rank : rank + 1])
    assert block.out.reduce_results


def test_a_rank_part_that_is_not_whole_blocks_is_refused():
    """The documented rule (upstream's): 3 pieces of 128 rows at TP 2 give each rank 64 rows of a block."""
    with planned_parallel(2), torch.device("meta"):
        block = nn.Module()
        block.qkv = MergedColumnParallelLinear(384, [128, 128, 128])
        with pytest.raises(ValueError, match="--tp-size 2"):
            swap_fp8_linears(block, Fp8Config())


def test_a_models_split_keeps_fp8_on_the_block_grid_only():
    """Granite's [gate | up] split (`checkpoint_tensors`: chunk(2)): 256 rows per half keep their bytes
    with their scale rows; 200-row halves start off the grid (None: loaded dequantized)."""
    pair = _pair(512, 128, 3)
    gate, up = pair.weight.chunk(2)
    assert torch.equal(_bits(row_block_of(pair, up, (128, 128)).weight), _bits(pair.weight[256:]))
    assert torch.equal(row_block_of(pair, up, (128, 128)).scale_inv, pair.scale_inv[2:])
    assert torch.equal(row_block_of(pair, gate, (128, 128)).scale_inv, pair.scale_inv[:2])
    odd = _pair(400, 128, 4)
    assert row_block_of(odd, odd.weight.chunk(2)[1], (128, 128)) is None
    assert row_block_of(pair, up.clone(), (128, 128)) is None  # not a view of the weight


@pytest.mark.parametrize("rank", [0, 1])
def test_one_scale_per_tensor_splits_off_the_block_grid(rank):
    """ModelOpt FP8 (one scale per checkpoint tensor): a rank's part that cuts the 128-blocks, refused for
    block scales above, loads: three 128-row pieces at TP 2 give each rank 64 rows of each (its bytes),
    and the rank's own scale grid holds the tensor's scale in every block; a row-parallel split of 200
    columns likewise. A tensor whose grid holds two values is refused (not one scale per tensor)."""
    modelopt = Fp8Config(method="modelopt")
    g = torch.Generator().manual_seed(5)
    qkv = Fp8Weight((torch.randn(384, 384, generator=g) * 100).to(FP8_DTYPE), torch.full((3, 3), 0.25))
    out = Fp8Weight((torch.randn(200, 200, generator=g) * 100).to(FP8_DTYPE), torch.full((2, 2), 0.5))
    with _tp_rank(rank):
        with torch.device("meta"):
            block = nn.Module()
            block.qkv = MergedColumnParallelLinear(384, [128, 128, 128])
            block.out = RowParallelLinear(200, 200)
            swap_fp8_linears(block, modelopt)
        materialize(block, torch.float32, torch.device("cpu"))
        loader = WeightLoader(block)
        loader.load("qkv.weight", qkv)
        loader.load("out.weight", out)
        loader.finish()
        assert block.qkv.uniform_scale and block.out.uniform_scale
        rows = torch.cat([torch.arange(p * 128 + rank * 64, p * 128 + rank * 64 + 64) for p in range(3)])
        assert torch.equal(_bits(block.qkv.weight), _bits(qkv.weight[rows]))
        assert block.qkv.weight_scale_inv.shape == (2, 3) and (block.qkv.weight_scale_inv == 0.25).all()
        assert torch.equal(_bits(block.out.weight), _bits(out.weight[:, rank * 100 : rank * 100 + 100]))
        assert block.out.weight_scale_inv.shape == (2, 1) and (block.out.weight_scale_inv == 0.5).all()
        mixed = Fp8Weight(qkv.weight, torch.tensor([[0.25] * 3, [0.25] * 3, [0.5] * 3]))
        with pytest.raises(ValueError, match="qkv.weight has more than one scale"):
            WeightLoader(block).load("qkv.weight", mixed)


@pytest.mark.parametrize("rank", [0, 1])
def test_one_scale_per_expert_weight_splits_off_the_block_grid(rank):
    """The same for FP8 experts (Nemotron's, not gated): intermediate 192 at TP 2 is 96 rows a rank, which
    block scales refuse; with one scale per expert weight each rank holds its rows' bytes and its own
    grid filled with that expert's scale."""
    from sglang.srt.layers.moe.experts import RoutedExperts
    from sglang.srt.layers.quantization.fp8_experts import make_fp8_experts

    g = torch.Generator().manual_seed(6)
    up = [(torch.randn(192, 128, generator=g) * 100).to(FP8_DTYPE) for _ in range(2)]
    down = [(torch.randn(128, 192, generator=g) * 100).to(FP8_DTYPE) for _ in range(2)]
    with _tp_rank(rank):
        with torch.device("meta"):
            holder, holder.mlp = nn.Module(), nn.Module()
            holder.mlp.experts = RoutedExperts(2, 128, 192, "relu2", False)
            with pytest.raises(ValueError, match="--tp-size 2"):
                make_fp8_experts(holder.mlp.experts, (128, 128))
            make_fp8_experts(holder.mlp.experts, (128, 128), per_tensor=True)
        materialize(holder, torch.float32, torch.device("cpu"))
        loader = WeightLoader(holder)
        for e in range(2):
            loader.load(f"mlp.experts.{e}.up_proj.weight", Fp8Weight(up[e], torch.full((2, 1), 0.5 + e)))
            loader.load(f"mlp.experts.{e}.down_proj.weight", Fp8Weight(down[e], torch.full((1, 2), 2.0 + e)))
        loader.finish()
    ex, part = holder.mlp.experts, slice(rank * 96, rank * 96 + 96)
    assert (
        ex.uniform_scale
        and ex.w13_weight_scale_inv.shape == (2, 1, 1)
        and ex.w2_weight_scale_inv.shape == (2, 1, 1)
    )
    for e in range(2):
        assert (
            torch.equal(_bits(ex.w13[e]), _bits(up[e][part])) and ex.w13_weight_scale_inv[e].item() == 0.5 + e
        )
        assert (
            torch.equal(_bits(ex.w2[e]), _bits(down[e][:, part]))
            and ex.w2_weight_scale_inv[e].item() == 2.0 + e
        )
