"""Tiny, random-weight Qwen3.5 vision-language checkpoints in the published layout
(`Qwen3_5[Moe]ForConditionalGeneration`: `model.language_model.*`, `model.visual.*`, `lm_head.*`), built
with transformers' own classes from a fixed seed, with the processor files the published checkpoints
ship (`preprocessor_config.json` for the image processor, `video_preprocessor_config.json` for the video
processor, a tokenizer that has the vision tokens).

    python -m sglang.tools.make_tiny_vl_model --arch qwen3_5 --out DIR [--seed 0]

The language model is `make_tiny_model`'s Qwen3.5 preset (vocabulary widened to hold the vision
tokens); the vision tower is 2 blocks of width 32 with 8-pixel patches, so a 64x64 image is an 8x8
patch grid merged into 16 image tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sglang.tools import make_tiny_model as base

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VL_VOCAB_SIZE = 520  # the BPE's 512 ids and the 4 vision tokens after them, rounded up
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 8, 2, 2
# The image processor's pixel bounds: at least a 32x32 image (one merged token per 2x2 patches), at
# most 128x128 (64 image tokens), so a large image is resized down, never rejected by the processor.
MIN_PIXELS, MAX_PIXELS = 32 * 32, 128 * 128
# The published chat template's placeholders: a content part {"type": "image"} becomes
# <|vision_start|><|image_pad|><|vision_end|> (the processor repeats the pad per image token), a part
# {"type": "video"} <|vision_start|><|video_pad|><|vision_end|> (the processor writes each pair of
# frames there: its timestamp and tokens).
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] in ('video', 'video_url') %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The video processor's pixel bounds over all of a video's frames (transformers' Qwen3VLVideoProcessor
# `size`): 4 frames of 32x32 at least, 8 frames of 64x64 at most, so a few-frame video of 64x64 frames
# keeps its size (16 tokens per pair of frames).
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 4 * 32 * 32, 8 * 64 * 64
ARCHS = ("qwen3_5", "qwen3_5_moe")


def build_vl_tokenizer():
    tokenizer = base.build_tokenizer()
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def tiny_vl_config(arch: str):
    if arch not in ARCHS:
        raise ValueError(f"--arch must be one of {ARCHS}, got {arch!r}.")
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = base.tiny_config(arch)
    text.vocab_size = VL_VOCAB_SIZE
    # Half the head rotates (8 of 16 channels: 4 frequencies), so that the temporal, height and width
    # axes each turn at least one frequency ([2, 1, 1] interleaved: t, h, w, t).
    text.rope_parameters = dict(text.rope_parameters, partial_rotary_factor=0.5, mrope_section=[2, 1, 1])
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        out_hidden_size=text.hidden_size,
        num_position_embeddings=16,  # a 4x4 learned grid, interpolated to each image's patch grid
        initializer_range=0.05,
    )
    tokenizer = build_vl_tokenizer()
    ids = {
        f"{name}_token_id": tokenizer.convert_tokens_to_ids(f"<|{name}_pad|>") for name in ("image", "video")
    }
    ids.update(
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    cls = Qwen3_5Config if arch == "qwen3_5" else Qwen3_5MoeConfig
    return cls(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False, **ids)


def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )


def video_processor_config() -> dict:
    """`video_preprocessor_config.json` as transformers' Qwen3VLVideoProcessor saves it (written as JSON:
    the processor class needs torchvision, which this project does not install)."""
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "size": {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "do_sample_frames": True,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
    }


@torch.no_grad()
def make_tiny_vl_model(arch: str, out: str | Path, seed: int = 0) -> Path:
    from transformers import AutoModelForImageTextToText, GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_vl_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    base._condition_weights(model, arch, torch.Generator().manual_seed(seed + 1))
    base.save_model(model, out)
    config_path = out / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["text_config"]["full_attention_interval"] = 4
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        eos_token_id=[base.IM_END_ID, base.PAD_ID], pad_token_id=base.PAD_ID, do_sample=False
    ).save_pretrained(out)
    build_vl_tokenizer().save_pretrained(out)
    image_processor().save_pretrained(out)
    (out / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(), indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--arch", required=True, choices=ARCHS)
    parser.add_argument("--out", required=True, help="Folder to write the checkpoint into.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        f"Wrote a tiny {args.arch} vision-language checkpoint to {make_tiny_vl_model(args.arch, args.out, args.seed)}"
    )


if __name__ == "__main__":
    main()
