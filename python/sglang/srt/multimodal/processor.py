"""Images of a request, from `image_data` (one item or a list: a file path, base64 bytes, or a
`data:image/...;base64,` URI) to the request's prompt ids and `MultimodalInputs`, with the model's own
image processor from transformers (`AutoImageProcessor`, the checkpoint's `preprocessor_config.json`).

Runs off the event loop (the tokenizer manager's executor): decoding and resizing take milliseconds
to seconds. Reading and decoding each item, within this server's bounds, is `media_io`'s.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sglang.srt.managers.request_validation import RequestError
from sglang.srt.multimodal.inputs import MultimodalInputs, mrope_positions, pad_value
from sglang.srt.multimodal.media_io import FIELD, load_image


class ImageInputProcessor:
    """The image side of a vision-language model: its image processor and the ids it needs."""

    def __init__(self, model_path: str, hf_config: Any):
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token_id = hf_config.image_token_id
        self.merge = hf_config.vision_config.spatial_merge_size
        self.vocab_size = hf_config.get_text_config().vocab_size

    # Why this server refuses images although its model takes them (None: it serves them).
    refusal: str | None = None

    @classmethod
    def create(cls, model_path: str, server_args: Any = None) -> ImageInputProcessor | None:
        """None for a model without a vision tower (its config.json has no `vision_config`)."""
        import json

        from transformers import AutoConfig

        config_file = os.path.join(model_path, "config.json")
        if not os.path.isfile(config_file):
            return None
        with open(config_file) as f:
            if "vision_config" not in json.load(f):
                return None
        hf_config = AutoConfig.from_pretrained(model_path)
        if not hasattr(hf_config, "image_token_id"):
            return None
        processor = cls(model_path, hf_config)
        if getattr(server_args, "disaggregation_mode", "null") != "null":
            # The decode server never runs the prompt, so it would lack the request's rotary delta.
            processor.refusal = f"{FIELD} is not served with --disaggregation-mode (issue 59)."
        return processor

    def process(
        self, input_ids: list[int], image_data: Any, where: str = FIELD
    ) -> tuple[list[int], MultimodalInputs]:
        """The prompt with each image's placeholder token expanded to its image tokens (as pad values),
        and the request's `MultimodalInputs`. `where` names the prompt's images in errors."""
        items = image_data if isinstance(image_data, list) else [image_data]
        images = [load_image(item, f"{where}[{i}]") for i, item in enumerate(items)]
        at = [i for i, t in enumerate(input_ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise RequestError(
                f"The prompt has {len(at)} image placeholders (<|vision_start|><|image_pad|><|vision_end|>) "
                f"for {len(images)} images in {where}; give one per image.",
                FIELD,
            )
        try:
            out = self.image_processor(images=images, return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio the processor cannot resize
            raise RequestError(f"{FIELD}: the image processor refused an image ({e}).", FIELD) from None
        pixels, grids = out["pixel_values"], out["image_grid_thw"].tolist()
        sizes = [t * h * w for t, h, w in grids]
        ids, offsets, pads, prev = [], [], [], 0
        for i, (place, chunk) in enumerate(zip(at, torch.split(pixels, sizes), strict=True)):
            n = sizes[i] // self.merge**2
            pads.append(pad_value(chunk, grids[i], self.vocab_size, self.image_token_id))
            ids += input_ids[prev:place]
            offsets.append((len(ids), n))
            ids += [pads[-1]] * n
            prev = place + 1
        ids += input_ids[prev:]
        positions, delta = mrope_positions(len(ids), offsets, grids, self.merge)
        tokens = [self.image_token_id] * len(pads)
        return ids, MultimodalInputs(pixels, grids, offsets, pads, tokens, positions, delta)


def images_per_prompt(image_data: Any, num_prompts: int, is_batch: bool) -> list[Any]:
    """`image_data` split by prompt, as upstream takes it: for one prompt, one item or a list of its
    images; for a batch, one item (every prompt gets it) or a list with one entry per prompt, each a
    list of that prompt's images, one image, or None / [] (no image)."""
    if not is_batch:
        return [image_data]
    if not isinstance(image_data, list):
        return [[image_data]] * num_prompts
    if len(image_data) != num_prompts:
        raise RequestError(
            f"{FIELD} in a batch of {num_prompts} prompts needs one entry per prompt (a list of its "
            f"images, or null), got {len(image_data)}.",
            FIELD,
        )
    return [None if entry is None or entry == [] else entry for entry in image_data]


async def attach_images(
    processor: ImageInputProcessor | None, items: list[Any], image_data: Any, limits: Any, is_batch: bool
) -> None:
    """Expand the prompts of `items` (the `NormalizedRequest`s of one /generate call: each sample of
    each prompt) with their prompt's images, processed off the event loop. The samples of one prompt
    share its processed images."""
    import asyncio

    from sglang.srt.managers.request_validation import check_input_len

    if processor is None:
        raise RequestError(f"{FIELD} was given, but this model takes no images.", FIELD)
    if processor.refusal is not None:
        raise RequestError(processor.refusal, FIELD)
    num_prompts = max(item.prompt for item in items) + 1
    per_prompt = images_per_prompt(image_data, num_prompts, is_batch)
    first = {}  # prompt -> its first sample
    for item in items:
        first.setdefault(item.prompt, item)
    todo = [(p, list(first[p].req.input_ids), data) for p, data in enumerate(per_prompt) if data is not None]

    def run() -> dict[int, tuple[list[int], MultimodalInputs]]:
        return {p: processor.process(ids, data, f"{FIELD}[{p}]" if is_batch else FIELD) for p, ids, data in todo}

    done = await asyncio.get_running_loop().run_in_executor(None, run)
    for ids, _ in done.values():
        check_input_len(len(ids), limits, FIELD)
    for item in items:
        if item.prompt in done:
            item.req.input_ids, item.req.mm_inputs = done[item.prompt]
