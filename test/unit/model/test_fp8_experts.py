"""Routed experts kept in block FP8 as published (issue 53: the experts at 1 byte a weight), loaded on the
CPU with the layout CUDA uses (SGLANG_FP8_EXPERTS=fp8) and run by the kernels' torch twin: the checkpoint's
bytes and scales in w13 / w2, gate and up requantized together where their blocks straddle, the logprobs
of the dequantized path, the memory planner's count equal to the loaded tensors, and weight updates that
quantize dense tensors or refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.environ import envs
from sglang.srt.layers.moe import fused_moe_fp8_triton
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.quantization import set_online_quantization
from sglang.srt.layers.quantization.fp8 import (
    FP8_DTYPE,
    Fp8Layout,
    dequantize_block_fp8,
    quantize_block_fp8,
)
from sglang.srt.mem_cache.weight_bytes import weight_bytes_from_config
from sglang.srt.models.registry import load_model
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import decode_steps, make_runner, max_abs, prefill, random_ids
from sglang.test.runner_driver import RunnerDriver
from sglang.tools.make_tiny_model import make_tiny_model

register_cpu_ci(est_time=15, suite="per-commit-cpu")

# e4m3 keeps 3 mantissa bits: a normal value rounds to within 2**-4 of itself; below the normal range the
# step is fixed, half of it 2**-10 of the block's scale.
E4M3_REL, E4M3_SUB = 2.0**-4, 2.0**-10


@pytest.fixture(scope="module")
def qwen_i128(tmp_path_factory) -> str:
    """The tiny Qwen3-Next with 128-wide experts: gate and up are whole 128-row blocks of w13, as in
    the published checkpoints (80B: 512), so w13 holds the checkpoint's bytes unchanged."""
    out = tmp_path_factory.mktemp("qwen3-next-i128-fp8")
    make_tiny_model("qwen3_next", out, overrides={"moe_intermediate_size": 128}, quantize="fp8-block")
    return str(out)


def _load(path: str, dtype: torch.dtype = torch.float32, fp8: Fp8Layout | None = None, online=False):
    cfg = load_hf_config(path)
    if online:
        set_online_quantization(cfg, "fp8")
    with envs.SGLANG_FP8_EXPERTS.override("fp8"):
        return load_model(cfg, path, dtype, "cpu", fp8)


def _experts(model: torch.nn.Module) -> dict[str, RoutedExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, RoutedExperts)}


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _published(path: str, name: str, ex: RoutedExperts, ckpt: dict) -> dict[str, torch.Tensor]:
    """w13, w2 and their scales as the checkpoint stores them (per expert, or Granite's stacked)."""
    if name.replace(".mlp.experts", ".block_sparse_moe.input_linear.weight") in ckpt:
        base = name.replace(".mlp.experts", ".block_sparse_moe.")
        mult = load_hf_config(path).residual_multiplier  # folded into w2 (Granite), here into its scales
        return {
            "w13": ckpt[base + "input_linear.weight"],
            "w13_weight_scale_inv": ckpt[base + "input_linear.weight_scale_inv"],
            "w2": ckpt[base + "output_linear.weight"],
            "w2_weight_scale_inv": ckpt[base + "output_linear.weight_scale_inv"] * mult,
        }
    shards = ("gate", "up") if ex.gated else ("up",)
    out = {}
    for key, names in (("w13", shards), ("w2", ("down",))):
        for suffix in ("weight", "weight_scale_inv"):
            per = [
                torch.cat([ckpt[f"{name}.{e}.{s}_proj.{suffix}"] for s in names])
                for e in range(ex.num_experts)
            ]
            out[key if suffix == "weight" else f"{key}_weight_scale_inv"] = torch.stack(per)
    return out


@pytest.mark.parametrize("preset", ["tiny-nemotron-h-fp8", "tiny-granite-4.0-h-fp8", "qwen_i128"])
def test_fp8_experts_hold_the_checkpoints_bytes_and_scales(preset, request):
    """Plain experts (Nemotron-H), stacked ones (Granite, its residual multiplier folded into w2's
    scales) and gated ones whose gate and up are whole blocks: the checkpoint's FP8 bytes and scales,
    unchanged, at one byte a weight plus a float32 scale per block (about half of bfloat16's bytes)."""
    path = request.getfixturevalue(preset) if preset == "qwen_i128" else resolve_model_path(preset)
    model, ckpt = _load(path), _checkpoint(path)
    experts = _experts(model)
    assert experts
    fp8_bytes = dense_equiv = 0
    for name, ex in experts.items():
        assert ex.fp8 and ex.w13.dtype == ex.w2.dtype == FP8_DTYPE
        for key, want in _published(path, name, ex, ckpt).items():
            got = getattr(ex, key).detach()
            assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want)), (name, key)
        tensors = (ex.w13, ex.w2, ex.w13_weight_scale_inv, ex.w2_weight_scale_inv)
        fp8_bytes += sum(t.numel() * t.element_size() for t in tensors)
        dense_equiv += 2 * (ex.w13.numel() + ex.w2.numel())
    # One scale per block of 128 x 128 (at most 128 x 64 here) is 4 bytes per >= 2,048 weights: < 0.2 %.
    assert fp8_bytes / dense_equiv < 0.502


def test_straddling_gate_and_up_are_requantized_together():
    """The tiny Qwen3-Next's experts are 32 wide: gate and up share w13's one row of blocks, so they are
    dequantized and requantized together (the module's rule): within one more e4m3 rounding of the
    checkpoint's values; w2 (one checkpoint tensor per expert) keeps its bytes."""
    path = resolve_model_path("tiny-qwen3-next-fp8")
    model, ckpt = _load(path), _checkpoint(path)
    for name, ex in _experts(model).items():
        for e in range(ex.num_experts):
            deq = [
                dequantize_block_fp8(ckpt[f"{name}.{e}.{s}_proj.weight"], ckpt[f"{name}.{e}.{s}_proj.weight_scale_inv"])
                for s in ("gate", "up")
            ]  # fmt: skip
            want = torch.cat(deq)
            got = dequantize_block_fp8(ex.w13[e], ex.w13_weight_scale_inv[e])
            step = E4M3_REL * want.abs() + E4M3_SUB * ex.w13_weight_scale_inv[e].max()
            assert ((got - want).abs() <= step).all()
            assert torch.equal(_bits(ex.w2[e]), _bits(ckpt[f"{name}.{e}.down_proj.weight"]))


def _logprobs(path: str, mode: str, linears: str = "auto", check=None) -> list[float]:
    with envs.SGLANG_FP8_EXPERTS.override(mode), envs.SGLANG_FP8_LINEARS.override(linears):
        runner = make_runner(path, page_size=16)
    if check is not None:
        check(runner.model)
    driver = RunnerDriver(runner)
    req = driver.new_request()
    return prefill(driver, req, random_ids(80, seed=1), cuts=[40]) + decode_steps(driver, [req], 6)[0]


def _exact_activations(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantization made exact (values as they are, scale 1): what is left to compare is
    where the weights come from."""
    return x.float().contiguous(), torch.ones(*x.shape[:-1], -(-x.shape[-1] // group))


@pytest.mark.parametrize("preset", ["tiny-nemotron-h-fp8", "tiny-nemotron-h-fp8-modelopt", "qwen_i128"])
def test_logprobs_through_the_twin_equal_the_dequantized_paths(preset, request, monkeypatch):
    """The FP8 experts through `fused_experts_fp8_torch` against the experts dequantized at load. The twin
    also quantizes the activations per token and 128 columns, as the CUDA kernels do (that alone moves
    these tiny models' logprobs by ~0.2-0.4: their head gain amplifies e4m3's 2**-4); with that step
    made exact here, what is left is where the weights come from, and the two agree within float32
    summation order (1e-4, the oracle bound; a misplaced expert or scale moves them by > 0.1)."""
    path = request.getfixturevalue(preset) if preset == "qwen_i128" else resolve_model_path(preset)
    calls = []
    twin = fused_moe_fp8_triton.fused_experts_fp8_torch
    monkeypatch.setattr(fused_moe_fp8_triton, "per_token_group_quant_fp8_torch", _exact_activations)
    monkeypatch.setattr(
        fused_moe_fp8_triton, "fused_experts_fp8_torch", lambda *a: calls.append(1) or twin(*a)
    )
    fp8 = _logprobs(path, "fp8")
    assert calls, "the FP8 experts did not run"
    calls.clear()
    dense = _logprobs(path, "dequantize")
    assert not calls
    assert max_abs(fp8, dense) < 1e-4


def test_cudas_fp8_layout_with_its_stacks_serves_the_dequantized_paths_logprobs(tmp_path, monkeypatch):
    """CUDA's FP8 layout through the engine on the CPU (SGLANG_FP8_LINEARS / SGLANG_FP8_EXPERTS=fp8),
    with 128-wide experts and shared expert (whole scale blocks, as published): q / k / v as one FP8
    stack, each layer's shared expert as expert E of its FP8 experts (the twin runs the stacks), against
    every weight dequantized at load: with the twin's activation quantization made exact, the two agree
    within float32 summation order (1e-4, the oracle bound; a misplaced scale block or a wrong shared
    pick moves them by > 0.1)."""
    from sglang.srt.layers.moe.fp8_fused_experts import Fp8FusedExperts
    from sglang.srt.layers.stacked_linears import Fp8Stack

    make_tiny_model(
        "qwen3_next", tmp_path, quantize="fp8-block",
        overrides={"moe_intermediate_size": 128, "shared_expert_intermediate_size": 128},
    )  # fmt: skip
    monkeypatch.setattr(fused_moe_fp8_triton, "per_token_group_quant_fp8_torch", _exact_activations)
    seen = []

    def layout(model: torch.nn.Module) -> None:
        for m in model.modules():
            if getattr(m, "qkv_stack", None) is not None:
                seen.append(type(m.qkv_stack))
            gemms = getattr(m, "fused_gemms", None)
            if gemms is not None:
                seen.append((type(gemms), gemms.shared is not None))

    fp8 = _logprobs(str(tmp_path), "fp8", linears="fp8", check=layout)
    layers = load_hf_config(str(tmp_path)).num_hidden_layers
    assert seen.count(Fp8Stack) >= 1 and seen.count((Fp8FusedExperts, True)) == layers, seen
    dense = _logprobs(str(tmp_path), "dequantize", linears="dequantize")
    assert max_abs(fp8, dense) < 1e-4


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("preset", ["tiny-qwen3-next-fp8", "tiny-granite-4.0-h-fp8"])
def test_the_planner_counts_the_loaded_tensors(preset):
    """weight_bytes_from_config against the bytes of the model loaded in bfloat16: the CPU with FP8
    experts (linears dequantized), and CUDA's layout loaded on the CPU (FP8 linears too, except those a
    model keeps dense: Qwen3-Next's in_proj_qkvz, which the planner used to count as FP8)."""
    path = resolve_model_path(preset)
    cfg = load_hf_config(path)
    with envs.SGLANG_FP8_EXPERTS.override("fp8"):
        planned_cpu = weight_bytes_from_config(cfg, torch.bfloat16, "cpu")
    cpu = _load(path, torch.bfloat16)
    assert planned_cpu.total == _param_bytes(cpu)
    assert planned_cpu.fp8_params == sum(ex.w13.numel() + ex.w2.numel() for ex in _experts(cpu).values())
    planned_cuda = weight_bytes_from_config(cfg, torch.bfloat16, "cuda")
    assert planned_cuda.total == _param_bytes(
        _load(path, torch.bfloat16, Fp8Layout(linears=True, experts=True))
    )
    assert planned_cuda.total < planned_cpu.total


def test_online_fp8_experts_equal_the_fp8_checkpoints():
    """`--quantization fp8` with FP8 experts quantizes each expert's weights as the published-format
    preset was written, then lays them out alike: the same bytes and scales."""
    online = _experts(_load(resolve_model_path("tiny-qwen3-next"), online=True))
    offline = _experts(_load(resolve_model_path("tiny-qwen3-next-fp8")))
    for name, ex in offline.items():
        for key in ("w13", "w2", "w13_weight_scale_inv", "w2_weight_scale_inv"):
            assert torch.equal(_bits(getattr(online[name], key)), _bits(getattr(ex, key))), (name, key)


def test_updates_quantize_dense_expert_tensors_or_refuse(qwen_i128):
    """Checkpoint-named updates of FP8 experts: a dense tensor is quantized as it loads (the bytes
    quantize_block_fp8 gives it), an FP8 one with its scales is written as it is; half of a straddling
    gate / up pair, and load_format "direct" (which would cast values into float8 without their scales),
    are refused in one sentence with nothing written."""
    model = _load(qwen_i128)
    ex = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(128, 64, generator=g)
    model.load_weights([("model.layers.0.mlp.experts.3.up_proj.weight", dense)], update=True)
    q, s = quantize_block_fp8(dense)
    assert torch.equal(_bits(ex.w13[3, 128:]), _bits(q)) and torch.equal(ex.w13_weight_scale_inv[3, 1:], s)
    q, s = quantize_block_fp8(torch.randn(64, 128, generator=g))  # an expert's down_proj, [H, I]
    down = "model.layers.0.mlp.experts.5.down_proj.weight"
    model.load_weights([(down + "_scale_inv", s), (down, q)], update=True)
    assert torch.equal(_bits(ex.w2[5]), _bits(q)) and torch.equal(ex.w2_weight_scale_inv[5], s)

    straddling = _load(resolve_model_path("tiny-qwen3-next-fp8"))
    before = straddling.model.layers[0].mlp.experts.w13.detach().clone()
    with pytest.raises(ValueError, match=r"got gate_proj alone: .* an update must carry both\.$"):
        straddling.load_weights(
            [("model.layers.0.mlp.experts.1.gate_proj.weight", torch.ones(32, 64))], update=True
        )
    assert torch.equal(_bits(straddling.model.layers[0].mlp.experts.w13), _bits(before))

    with envs.SGLANG_FP8_EXPERTS.override("fp8"):
        runner = make_runner("tiny-qwen3-next-fp8")
    w13 = runner.model.model.layers[0].mlp.experts.w13
    before = w13.detach().clone()
    with pytest.raises(ValueError, match='holds block-FP8 weights .* load_format "direct" cannot write'):
        runner.update_weights_from_tensor(
            [("model.layers.0.mlp.experts.w13", torch.ones(w13.shape))], "direct"
        )
    assert torch.equal(_bits(w13), _bits(before))
