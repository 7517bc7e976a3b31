"""Qwen3.5 and Qwen3.5-MoE: the runner's logprobs equal transformers' (float32, teacher-forced), the
checkpoint's split Gated DeltaNet projections fill the fused ones row block by row block, and the
published multimodal layout (`Qwen3_5[Moe]ForConditionalGeneration`, the language model under
`model.language_model.` and its config under `text_config`) serves the same language model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang.srt.configs import hybrid_arch_config
from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.managers.finish_checker import FinishChecker
from sglang.srt.models.qwen3_next import Qwen3NextSparseMoeBlock
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import (
    batched_extends_error,
    chunked_prefill_and_decode_error,
    decode_steps,
    make_runner,
    prefill,
    random_ids,
)
from sglang.test.runner_driver import RunnerDriver

register_cpu_ci(est_time=10, suite="per-commit-cpu")

PRESETS = ["tiny-qwen3.5", "tiny-qwen3.5-moe"]
# As test_logprobs_vs_oracle: float32 against float32 differs only in summation order (measured
# ~1e-5 in logprob on these presets); a wrong projection row, state or rotary moves logprobs by 0.05+.
TOL = 1e-4


@pytest.mark.parametrize("preset", PRESETS)
def test_chunked_prefill_and_decode_match_the_oracle(preset, oracles):
    # Chunks that start off the kernel's 64-token grid, then decode across a full-attention page.
    err = chunked_prefill_and_decode_error(
        preset, oracles[preset], prompt_len=200, cuts=[7, 64, 150], decode=20, seed=70
    )
    assert err < TOL


@pytest.mark.parametrize("preset", PRESETS)
def test_batched_extends_with_prefixes_match_the_oracle(preset, oracles):
    assert (
        batched_extends_error(preset, oracles[preset], prefixes=[0, 30, 70], extends=[90, 1, 66], seed=80)
        < TOL
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_split_projections_fill_the_fused_ones(preset, preset_paths):
    """Every layer's [q | k | v | z] and [b | a] rows are the checkpoint's pieces, in that order, and
    each layer's MLP is what the config says (dense in Qwen3.5, a MoE in Qwen3.5-MoE)."""
    ckpt = load_file(Path(preset_paths[preset]) / "model.safetensors")
    model = make_runner(preset).model
    linear = 0
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.mlp, Qwen3NextSparseMoeBlock if preset.endswith("moe") else GatedMLP)
        if not layer.is_linear:
            continue
        linear += 1
        p = f"model.layers.{i}.linear_attn"
        qkvz = torch.cat([ckpt[f"{p}.in_proj_qkv.weight"], ckpt[f"{p}.in_proj_z.weight"]])
        ba = torch.cat([ckpt[f"{p}.in_proj_b.weight"], ckpt[f"{p}.in_proj_a.weight"]])
        assert torch.equal(layer.linear_attn.in_proj_qkvz.weight, qkvz)
        assert torch.equal(layer.linear_attn.in_proj_ba.weight, ba)
    assert linear == 3


VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=8, out_hidden_size=64)


def _multimodal_layout(src: Path, dst: Path, moe: bool, tied: bool = False) -> Path:
    """The text checkpoint `src` rewritten as the published multimodal one: config under `text_config`,
    the language model under `model.language_model.`, plus a vision tower and an MTP head to skip.
    `tied`: the top-level config ties the LM head to the embedding (the text config still says not), and
    the checkpoint has no `lm_head.weight`, as the small tied releases."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    text = json.loads((src / "config.json").read_text())
    kind = "qwen3_5_moe" if moe else "qwen3_5"
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": kind,
        "text_config": {**text, "model_type": f"{kind}_text"},
        "vision_config": VISION,
        "tie_word_embeddings": tied,
    }
    (dst / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        tensors[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    g = torch.Generator().manual_seed(0)
    # A whole (tiny) vision tower: the model loads it (models/qwen3_5_vision.py).
    from transformers import Qwen3_5VisionConfig

    from sglang.srt.models.qwen3_5_vision import Qwen3_5VisionModel

    tower = Qwen3_5VisionModel(Qwen3_5VisionConfig(**VISION))
    tensors |= {f"model.visual.{k}": torch.randn(v.shape, generator=g) for k, v in tower.state_dict().items()}
    tensors["mtp.fc.weight"] = torch.randn(64, 128, generator=g)
    if tied:
        del tensors["lm_head.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("preset", PRESETS)
def test_multimodal_checkpoint_serves_its_language_model(preset, preset_paths, tmp_path):
    moe = preset.endswith("moe")
    folder = _multimodal_layout(Path(preset_paths[preset]), tmp_path / "vl", moe)
    hf = load_hf_config(str(folder))
    arch = hybrid_arch_config(hf)
    assert arch.hf_config is hf.text_config and arch.vocab_size == 512
    assert arch.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    prompt = random_ids(90, seed=90)
    results = []
    for path in (preset, str(folder)):
        driver = RunnerDriver(make_runner(path))
        req = driver.new_request()
        results.append(prefill(driver, req, prompt, cuts=[40]) + decode_steps(driver, [req], 4)[0])
    assert results[0] == results[1]

    # The stop ids come from the language model's config where the checkpoint states them only there.
    (folder / "generation_config.json").unlink()
    args = ServerArgs(model_path=str(folder), skip_tokenizer_init=True)
    assert getattr(hf, "eos_token_id", None) is None and hf.text_config.eos_token_id == 2
    assert FinishChecker.from_server_args(args).eos_token_ids == {2}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("drop_z", r"lacks 1 weight.*model\.layers\.0\.linear_attn\.in_proj_qkvz\.weight"),
        ("b_twice", r"in_proj_b\.weight.*rows \[0, 4\) are given twice"),
        ("a_too_tall", r"in_proj_a\.weight has shape \(8, 64\); the model expects rows \[4, 12\)"),
    ],
)
def test_broken_split_projections_are_refused(edit, message, preset_paths, tmp_path):
    src = Path(preset_paths["tiny-qwen3.5"])
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    p = "model.layers.0.linear_attn"
    if edit == "drop_z":
        del tensors[f"{p}.in_proj_z.weight"]
    elif edit == "b_twice":
        # A stray copy in a second file (a folder of safetensors files without an index reads them all).
        save_file({f"{p}.in_proj_b.weight": tensors[f"{p}.in_proj_b.weight"]}, str(dst / "extra.safetensors"))
    else:
        tensors[f"{p}.in_proj_a.weight"] = torch.cat([tensors[f"{p}.in_proj_a.weight"]] * 2)
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model-main.safetensors"))
    with pytest.raises(ValueError, match=message):
        make_runner(str(dst))


def test_the_multimodal_configs_tie_flag_decides(preset_paths, tmp_path):
    """transformers ties the LM head by the top-level config's flag and does not copy it into
    `text_config` (which says untied here): the checkpoint without `lm_head.weight` loads, tied."""
    folder = _multimodal_layout(Path(preset_paths["tiny-qwen3.5"]), tmp_path / "vl", moe=False, tied=True)
    model = make_runner(str(folder)).model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_split_projection_for_an_attention_layer_is_left_unused(preset_paths, tmp_path):
    """A checkpoint whose split projection names a layer that is full attention here loads (the tensor
    is reported unused), instead of failing on the missing module."""
    dst = tmp_path / "extra"
    shutil.copytree(preset_paths["tiny-qwen3.5"], dst)
    tensors = load_file(dst / "model.safetensors")
    stray = tensors["model.layers.0.linear_attn.in_proj_qkv.weight"].clone()
    tensors["model.layers.3.linear_attn.in_proj_qkv.weight"] = stray
    save_file(tensors, str(dst / "model.safetensors"))
    assert make_runner(str(dst)).model.model.layers[3].is_linear is False


def test_quantized_checkpoints_are_refused_by_name(preset_paths, tmp_path):
    from sglang.srt.server_args import ServerArgsError

    dst = tmp_path / "fp8"
    shutil.copytree(preset_paths["tiny-qwen3.5"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    # Per-tensor FP8 (no weight_block_size) is another format than the block-wise one served.
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ServerArgsError, match=r"cannot be served: its FP8 weights have one scale per tensor"):
        ServerArgs(model_path=str(dst))
    # Without the config's word, float8 tensors are still refused as they load.
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.3.self_attn.o_proj.weight"] = tensors["model.layers.3.self_attn.o_proj.weight"].to(
        torch.float8_e4m3fn
    )
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"o_proj.weight is torch.float8_e4m3fn: quantized weights are not supported without"
    ):
        make_runner(str(dst))
