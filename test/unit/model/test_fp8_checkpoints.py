"""Block-wise FP8 checkpoints (issue 53, items 1, 3 and 4): the format's arithmetic (partial blocks,
round trip within e4m3's error), the configs served and refused, the FP8 presets as the published
checkpoints are written, every architecture's FP8 form loading as its dequantized weights, the served
logprobs against the transformers oracle on those weights, a cache hit against a cold run, a short
strategy run, and `--quantization fp8` on an unquantized checkpoint."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.configs.presets import FP8_PRESETS, PRESETS, resolve_model_path
from sglang.srt.layers.quantization import (
    Fp8Config,
    Fp8ConfigError,
    check_quantization_flag,
    checkpoint_quant_config,
)
from sglang.srt.layers.quantization.fp8 import (
    FP8_DTYPE,
    Fp8BlockLinear,
    dequantize_block_fp8,
    fp8_checkpoint_stream,
    quantize_block_fp8,
    swap_fp8_linears,
)
from sglang.srt.models.registry import load_model
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import decode_steps, make_runner, max_abs, prefill, random_ids
from sglang.test.reference import dequantized_checkpoint
from sglang.test.runner_driver import RunnerDriver
from sglang.test.scheduler_harness import ORACLE_TOL, SchedulerHarness, token_ids

register_cpu_ci(est_time=30, suite="per-commit-cpu")

# e4m3 keeps 3 mantissa bits: a normal value rounds to within half a step, 2**-4 of itself; below the
# normal range (2**-6 of the block's scale) the step is fixed, 2**-9 of the scale, half of it 2**-10.
E4M3_REL, E4M3_SUB = 2.0**-4, 2.0**-10
# As the published Qwen3-Next-80B-A3B-Instruct-FP8 config writes it (its list names every module kept).
QWEN_FP8_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.embed_tokens", "model.layers.0.linear_attn.in_proj_ba"],
}


def _within_e4m3(approx: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> bool:
    return bool(((approx - exact).abs() <= E4M3_REL * exact.abs() + E4M3_SUB * scale + 1e-12).all())


# ---- the format's arithmetic -------------------------------------------------------------------------


def test_partial_blocks_take_the_scale_of_the_block_they_start_in():
    """200 x 72 with 128-blocks: scales [2, 1]; rows 128..199 are the partial second block row."""
    q = torch.full((200, 72), 2.0).to(FP8_DTYPE)
    scale = torch.tensor([[0.5], [3.0]])
    w = dequantize_block_fp8(q, scale)
    assert w.shape == (200, 72)
    assert (w[:128] == 1.0).all() and (w[128:] == 6.0).all()
    with pytest.raises(ValueError, match=r"scales of shape \(1, 1\).*need \(2, 1\)"):
        dequantize_block_fp8(q, scale[:1])


def test_quantize_then_dequantize_is_within_e4m3s_error():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g) * torch.logspace(-3, 1, 260)  # columns of many magnitudes
    w[:128, :128] = 0.0  # an all-zero block stays zero (scale 1, not 0/0)
    q, scale = quantize_block_fp8(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (3, 3)
    back = dequantize_block_fp8(q, scale)
    per_elem = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260]
    assert _within_e4m3(back, w, per_elem)
    assert (back[:128, :128] == 0).all()
    # Each block's largest magnitude maps to e4m3's largest value, 448, exactly.
    assert q.float().abs().amax().item() == 448.0
    # Stacked experts: each expert's blocks are its own.
    experts = torch.stack([w[200:264, 100:164], 100 * w[200:264, 100:164]])
    q3, s3 = quantize_block_fp8(experts)
    assert s3.shape == (2, 1, 1) and torch.allclose(s3[1], 100 * s3[0])
    assert torch.equal(dequantize_block_fp8(q3, s3)[0], dequantize_block_fp8(q3[0], s3[0]))


def test_the_stream_pairs_weights_with_scales_in_any_order():
    w = torch.randn(40, 70)
    q, s = quantize_block_fp8(w)
    want = dequantize_block_fp8(q, s)
    cfg = Fp8Config()
    for order in ([("a.weight", q), ("a.weight_scale_inv", s)], [("a.weight_scale_inv", s), ("a.weight", q)]):
        got = dict(fp8_checkpoint_stream([*order, ("n.weight", torch.ones(3))], cfg))
        assert torch.equal(got["a.weight"], want) and torch.equal(got["n.weight"], torch.ones(3))
    with pytest.raises(ValueError, match="a.weight has no matching scale"):
        list(fp8_checkpoint_stream([("a.weight", q)], cfg))
    # The seam for layers that keep FP8 themselves: their pairs pass as they are.
    pairs = [("a.weight_scale_inv", s), ("a.weight", q)]
    kept = list(fp8_checkpoint_stream(pairs, cfg, lambda n: n == "a.weight"))
    assert [n for n, _ in kept] == ["a.weight"] and kept[0][1].weight is q and kept[0][1].scale_inv is s


def test_fp8_linear_forward_is_the_dequantized_weight_times_the_input():
    dense = torch.nn.Linear(200, 130, bias=True)
    fp8 = Fp8BlockLinear.from_linear(dense)
    fp8.process_weights_after_loading()  # CPU: no kernel, the torch path
    x = torch.randn(5, 200)
    want = x @ fp8.dequantized_weight(torch.float32).t() + dense.bias
    assert torch.allclose(fp8(x), want, atol=1e-5)
    assert fp8.weight_scale_inv.shape == (2, 2)


# ---- configs served and refused ------------------------------------------------------------------------


def test_the_published_config_is_read_and_other_formats_are_refused():
    cfg = Fp8Config.from_quantization_config(QWEN_FP8_CONFIG)
    assert cfg.weight_block_size == (128, 128) and cfg.is_checkpoint_fp8_serialized
    assert cfg.ignored_layers == tuple(QWEN_FP8_CONFIG["modules_to_not_convert"])
    assert Fp8Config.from_quantization_config({**QWEN_FP8_CONFIG, "modules_to_not_convert": None,
                                               "ignored_layers": ["lm_head"]}).ignored_layers == ("lm_head",)  # fmt: skip
    refusals = {
        "awq": ({"quant_method": "awq", "bits": 4}, "quantized with 'awq'"),
        "modelopt-nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "ModelOpt's NVFP4 algorithm"),
        "per-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "one scale per tensor"),
        "static": ({**QWEN_FP8_CONFIG, "activation_scheme": "static"}, "static activation scales"),
        "e5m2": ({**QWEN_FP8_CONFIG, "fmt": "e5m2"}, "format is 'e5m2'"),
    }
    for quant, words in refusals.values():
        with pytest.raises(Fp8ConfigError, match=words):
            checkpoint_quant_config(quant)  # (ModelOpt FP8 is served: test_modelopt_fp8)


def test_a_refused_checkpoint_stops_the_start_in_one_sentence(tmp_path):
    dst = tmp_path / "awq"
    dst.mkdir()
    cfg = json.loads((Path(resolve_model_path("tiny-qwen3-next")) / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ServerArgsError, match=r"cannot be served: its weights are quantized with 'awq'; "):
        ServerArgs(model_path=str(dst))


def test_quantization_flag_takes_fp8_and_refuses_other_methods():
    assert check_quantization_flag(None) is None and check_quantization_flag("fp8") is None
    for method in ("awq", "gptq", "w8a8_fp8", "modelopt_fp4"):
        with pytest.raises(ServerArgsError, match=f"^--quantization {method} is not supported by this server: "
                           "it implements fp8 "):  # fmt: skip
            ServerArgs(model_path="tiny-qwen3-next", quantization=method)


# ---- the FP8 presets ---------------------------------------------------------------------------------


def test_fp8_presets_are_written_as_the_published_checkpoints():
    path = Path(resolve_model_path("tiny-qwen3-next-fp8"))
    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    assert {k: quant[k] for k in ("activation_scheme", "fmt", "quant_method", "weight_block_size")} == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]
    }  # fmt: skip
    kept = set(quant["modules_to_not_convert"])
    assert {"lm_head", "model.embed_tokens", "model.layers.0.linear_attn.in_proj_ba", "model.layers.0.mlp.gate",
            "model.layers.0.mlp.shared_expert_gate", "model.layers.3.self_attn.q_norm"} <= kept  # fmt: skip
    base = Path(resolve_model_path("tiny-qwen3-next"))
    with (
        safe_open(str(path / "model.safetensors"), "pt") as f,
        safe_open(str(base / "model.safetensors"), "pt") as b,
    ):
        names = set(f.keys())
        for name in ("model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
                     "model.layers.3.self_attn.o_proj.weight", "model.layers.0.mlp.shared_expert.down_proj.weight"):  # fmt: skip
            w, s = f.get_tensor(name), f.get_tensor(name + "_scale_inv")
            assert w.dtype == FP8_DTYPE and s.dtype == torch.float32
            # hidden 64 and the like are under one block: one partial block per dimension under 128.
            assert s.shape == tuple(math.ceil(n / 128) for n in w.shape)
            assert _within_e4m3(dequantize_block_fp8(w, s), b.get_tensor(name), s.max())
        for name in (
            "model.layers.0.linear_attn.in_proj_ba.weight",
            "model.embed_tokens.weight",
            "lm_head.weight",
        ):
            assert name + "_scale_inv" not in names and torch.equal(f.get_tensor(name), b.get_tensor(name))
        # Every other tensor of the bf16 preset is there, and no more, but the MTP layer's fused 3-D experts:
        # written per expert, as the releases store them (the MTP layer's form: test_mtp_fp8.py).
        fused = {n for n in b.keys() if n.startswith("mtp.") and ".experts." in n}
        assert fused == {"mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"}
        experts = {n for n in names if n.startswith("mtp.layers.0.mlp.experts.") and n.endswith("proj.weight")}
        assert len(experts) == 3 * b.get_slice("mtp.layers.0.mlp.experts.down_proj").get_shape()[0]
        assert names - {n for n in names if n.endswith("_scale_inv")} == (set(b.keys()) - fused) | experts


@pytest.mark.parametrize("preset", sorted(FP8_PRESETS))
def test_modules_kept_unquantized_hold_no_fp8_weight(preset):
    """modules_to_not_convert names exactly the modules left as they are: a quantized linear with a bias
    was listed too (its bias is kept), so on CUDA it stayed a dense nn.Linear (tiny-lfm2-fp8's convs)."""
    path = Path(resolve_model_path(preset))
    kept = set(
        json.loads((path / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    )
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        fp8 = {n.removesuffix(".weight") for n in f.keys() if f.get_slice(n).get_dtype() == "F8_E4M3"}
    assert fp8 and not kept & fp8, sorted(kept & fp8)


def test_a_module_listed_as_a_parent_keeps_its_children_dense(tmp_path):
    """A checkpoint that keeps a whole block unquantized (modules_to_not_convert names the block): every
    linear under it stays dense (it was matched by exact name only, so its children became FP8 and their
    bf16 tensors were quantized at load), and the experts under a kept MoE block stay dense too."""
    from sglang.srt.layers.moe.experts import RoutedExperts
    from sglang.srt.layers.quantization.fp8 import Fp8BlockLinear, Fp8Layout
    from sglang.srt.models.registry import build_meta_model
    from sglang.test.fp8_partial import keep_dense

    blocks = ["model.layers.3.self_attn", "model.layers.0.mlp"]
    path = keep_dense(resolve_model_path("tiny-qwen3-next-fp8"), tmp_path / "kept",
                      [b + ".*" for b in blocks], listed=blocks)  # fmt: skip
    model = build_meta_model(load_hf_config(path), "cpu", Fp8Layout(True, True))
    layer3, layer0 = model.model.layers[3], model.model.layers[0]
    assert not any(isinstance(m, Fp8BlockLinear) for m in layer3.self_attn.modules())
    assert not any(isinstance(m, Fp8BlockLinear) for m in layer0.mlp.modules())
    experts = [m for m in layer0.mlp.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(e.w13.dtype != FP8_DTYPE for e in experts)
    # (and the rest as the checkpoint has it: another layer's attention and experts are FP8)
    assert any(isinstance(m, Fp8BlockLinear) for m in model.model.layers[1].modules())


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_architecture_serves_its_fp8_form_as_its_dequantized_weights(preset):
    """The served model of the FP8 preset holds exactly the dequantized checkpoint's values (CPU:
    dequantized at load), for every architecture's name mapping, folded multipliers, stacked experts and
    split projections."""
    fp8_path = resolve_model_path(f"{preset}-fp8")
    fp8 = load_model(load_hf_config(fp8_path), fp8_path, torch.float32, "cpu")
    ref_path = dequantized_checkpoint(fp8_path)
    ref = load_model(load_hf_config(ref_path), ref_path, torch.float32, "cpu")
    got, want = _params(fp8), _params(ref)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got), [
        k for k in got if not torch.equal(got[k], want[k])
    ]
    assert f"{preset}-fp8" in FP8_PRESETS


# ---- served outputs ----------------------------------------------------------------------------------


# The served weights are the dequantized checkpoint's, in float32 as the oracle's (CPU quantizes no
# activations): the two differ by summation order only, so the float32 oracle bound holds (1e-4). FP8
# rounding of the weights, which this does not see, moves the tiny presets' logprobs by up to ~1 against
# the unquantized preset (their head gain amplifies it).
@pytest.mark.parametrize("preset", ["tiny-qwen3-next-fp8", "tiny-nemotron-h-fp8", "tiny-nemotron-h-fp8-modelopt"])
def test_fp8_logprobs_match_the_oracle_on_the_dequantized_weights(preset, oracles):
    driver = RunnerDriver(make_runner(preset, page_size=16))
    req = driver.new_request()
    prompt = random_ids(150, seed=1)
    lps = prefill(driver, req, prompt, cuts=[70]) + decode_steps(driver, [req], 16)[0]
    ref = oracles[preset].token_logprobs(req.token_ids + [req.next_token], start=1).tolist()
    assert max_abs(lps, ref) < ORACLE_TOL


def test_fp8_cache_hit_equals_a_cold_run():
    """A prefix hit reads state the first request stored from FP8 weights: the same outputs as a cold run
    of the prompt, within float32 summation order (1e-5; another request's state would differ by > 0.1)."""
    prompt, tail = token_ids(120, seed=3), token_ids(20, seed=4)
    h = SchedulerHarness("tiny-qwen3-next-fp8", page_size=16)
    try:
        h.generate(prompt, max_new_tokens=4)
        hit = h.generate(prompt + tail, max_new_tokens=6)
        h.flush_and_check_empty()
        cold = h.generate(prompt + tail, max_new_tokens=6)
    finally:
        h.shutdown()
    assert hit.cached_tokens >= 64 and cold.cached_tokens == 0
    assert hit.output_ids == cold.output_ids
    assert max(abs(a - b) for a, b in zip(hit.logprobs, cold.logprobs, strict=True)) < 1e-5


def _strategy_matrix():
    path = Path(__file__).parents[1] / "scheduler" / "test_strategy_matrix.py"
    spec = importlib.util.spec_from_file_location("_strategy_matrix_for_fp8", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_strategy_matrix_on_an_fp8_preset(oracles):
    """The strategy matrix's workloads (branching, decode-seeded hits, track boundaries, a stop token,
    16 concurrent requests) on the FP8 Qwen3-Next under extra_buffer_lazy with overlap, page 16,
    chunked prefill 128: the oracle's logprobs and the caching rules' cached_tokens."""
    matrix = _strategy_matrix()
    preset = "tiny-qwen3-next-fp8"
    matrix._run_workloads(
        matrix._harness(preset, "extra_buffer_lazy", True, 16, 128), oracles[preset], ORACLE_TOL
    )


# ---- --quantization fp8 ------------------------------------------------------------------------------


def test_online_fp8_serves_what_the_fp8_checkpoint_of_it_serves():
    """`--quantization fp8` on the unquantized preset quantizes at load exactly as the published-format
    preset was written: the same served weights, bit for bit; each within e4m3's error of the
    unquantized weight, and the modules FP8 checkpoints keep (routers, gates, norms, embeddings, the head)
    unchanged."""
    online = make_runner("tiny-qwen3-next", quantization="fp8").model
    offline = make_runner("tiny-qwen3-next-fp8").model
    plain = make_runner("tiny-qwen3-next").model
    got, want, base = _params(online), _params(offline), _params(plain)
    assert all(torch.equal(got[k], want[k]) for k in got)
    changed = {k for k in got if not torch.equal(got[k], base[k])}
    assert (
        "model.layers.0.linear_attn.out_proj.weight" in changed
        and "model.layers.0.mlp.experts.w13" in changed
    )
    for k in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
              "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.linear_attn.in_proj_ba.weight"):  # fmt: skip
        assert k not in changed, k
    for k in changed:
        # A block's scale is at most its largest magnitude / 448: bound each element by the tensor's.
        assert _within_e4m3(got[k], base[k], base[k].abs().max() / 448), k
    # The logprobs follow the weights: identical to the FP8 checkpoint's.
    lps = []
    for runner in (make_runner("tiny-qwen3-next", quantization="fp8"), make_runner("tiny-qwen3-next-fp8")):
        driver = RunnerDriver(runner)
        lps.append(prefill(driver, driver.new_request(), random_ids(60, seed=5)))
    assert lps[0] == lps[1]


def test_swapped_fp8_linears_load_the_checkpoint_as_cuda_would():
    """The CUDA layout on the CPU: the quantizable linears become Fp8BlockLinear before loading, the
    loader copies the checkpoint's FP8 weights and scales into them (test_fp8_cuda_load.py: also
    scales that do not use e4m3's full range, and tensor parallelism)."""
    path = resolve_model_path("tiny-qwen3-next-fp8")
    cfg = load_hf_config(path)
    with torch.device("meta"):
        from sglang.srt.models.registry import get_model_class

        model = get_model_class(cfg)(cfg)
        report = swap_fp8_linears(model, Fp8Config.from_quantization_config(cfg.quantization_config),
                                  model.fp8_dense_modules)  # fmt: skip
    assert "model.layers.3.self_attn.o_proj" in report.swapped
    assert {"model.layers.0.mlp.gate", "model.layers.0.linear_attn.in_proj_qkvz"} <= set(report.kept)
    assert type(model.lm_head).__name__ == "ParallelLMHead"  # (not a linear: never FP8)
    from sglang.srt.models.loader import iter_checkpoint
    from sglang.srt.models.registry import materialize

    model.quant_config = Fp8Config.from_quantization_config(cfg.quantization_config)
    materialize(model, torch.float32, torch.device("cpu"))
    model.load_weights(iter_checkpoint(path))
    o_proj = model.model.layers[3].self_attn.o_proj
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        assert torch.equal(
            o_proj.weight.view(torch.uint8),
            f.get_tensor("model.layers.3.self_attn.o_proj.weight").view(torch.uint8),
        )
        assert torch.allclose(o_proj.weight_scale_inv, f.get_tensor("model.layers.3.self_attn.o_proj.weight_scale_inv"), rtol=1e-6)  # fmt: skip
