"""Qwen3.5's vision-language presets and vision tower: the presets are in the published layout
(`model.visual.*`, `model.language_model.*`, an image processor and the vision tokens), and the vision
tower (`models/qwen3_5_vision.py`) loaded from `model.visual.*` gives transformers' image tokens for
several images of different sizes in one forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

VL_PRESETS = ["tiny-qwen3.5-vl", "tiny-qwen3.5-moe-vl"]


@pytest.fixture(scope="module")
def vl_paths() -> dict[str, str]:
    from sglang.srt.configs.presets import resolve_model_path

    return {name: resolve_model_path(name) for name in VL_PRESETS}


def random_images(seed: int, sizes: list[tuple[int, int]]) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.mark.parametrize("preset", VL_PRESETS)
def test_preset_is_published_layout(vl_paths, preset):
    from safetensors import safe_open
    from transformers import AutoImageProcessor, AutoTokenizer

    path = vl_paths[preset]
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        prefixes = {".".join(k.split(".")[:2]) for k in f.keys()}
    assert prefixes == {"model.visual", "model.language_model", "lm_head.weight"}
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer.encode("<|vision_start|><|image_pad|><|vision_end|>")) == 3
    grid = AutoImageProcessor.from_pretrained(path)(images=random_images(0, [(64, 64)]))["image_grid_thw"]
    assert grid.tolist() == [[1, 8, 8]]


@torch.no_grad()
def test_vision_tower_matches_transformers(vl_paths):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from sglang.srt.models.qwen3_5_vision import Qwen3_5VisionModel

    path = vl_paths["tiny-qwen3.5-vl"]
    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ours = Qwen3_5VisionModel(ref.config.vision_config)
    prefix = "model.visual."
    ours.load_state_dict({k[len(prefix) :]: v for k, v in ref.state_dict().items() if k.startswith(prefix)})
    inputs = AutoImageProcessor.from_pretrained(path)(
        images=random_images(1, [(64, 64), (48, 96), (40, 200)]), return_tensors="pt"
    )
    expected = ref.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    got = ours(inputs["pixel_values"], inputs["image_grid_thw"])
    assert got.shape == expected.shape
    # float32 on both sides, the same operations but SDPA's summation order: ~3e-7 measured. A wrong
    # rotary axis, position-grid interpolation or merge order moves the tokens by O(0.1).
    assert (got - expected).abs().max().item() < 1e-5
