"""Images and videos of a request, from `image_data` (one item or a list: a file path, base64 bytes, or a
`data:image/...;base64,` URI) and `video_data` (`multimodal/video.py`) to the request's prompt ids and
`MultimodalInputs`, with the model's own image processor from transformers (`AutoImageProcessor`, the
checkpoint's `preprocessor_config.json`) and its video processor settings.

Runs off the event loop, one item at a time in the media pool (`media_pool.MediaJob`: the requests take
its threads in turn, and a request whose client left stops between items): decoding and resizing take
milliseconds to seconds. Each item first reserves the decoded bytes its header says it may hold in the
process's media memory (`media_pool.MediaMemory`). Reading and decoding each item, within this server's
bounds, is `media_io`'s.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sglang.srt.managers.request_validation import RequestError
from sglang.srt.multimodal import video as videos
from sglang.srt.multimodal.inputs import MultimodalInputs, mrope_positions, pad_value
from sglang.srt.multimodal.media_io import FIELD, PixelBudget, image_bytes, load_image
from sglang.srt.multimodal.media_pool import MediaJob, check_cancelled, media_memory


class ImageInputProcessor:
    """The vision side of a vision-language model: its image processor, video settings and the ids it
    needs."""

    def __init__(self, model_path: str, hf_config: Any):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token_id = hf_config.image_token_id
        self.merge = hf_config.vision_config.spatial_merge_size
        # The most pixels the processor resizes an image to, and how many make one image token: the
        # request's decode bounds (media_io.PixelBudget.for_model).
        self.max_pixels = _max_pixels(self.image_processor)
        patch = getattr(self.image_processor, "patch_size", None) or hf_config.vision_config.patch_size
        self.pixels_per_token = (patch * self.merge) ** 2
        self.presize = _presize_settings(self.image_processor)
        self.vocab_size = hf_config.get_text_config().vocab_size
        self.video = videos.VideoConfig.load(model_path)
        self.video_refusal = None
        if self.video is None:
            self.video_refusal = (
                f"{videos.FIELD} is not served for this checkpoint: it ships no video processor "
                "(video_preprocessor_config.json)."
            )
        else:
            self.video_token_id = hf_config.video_token_id
            self.frame_open = [hf_config.vision_start_token_id]
            self.frame_close = [hf_config.vision_end_token_id]
            # Frame timestamps (`<1.5 seconds>`) are text between special tokens: tokenized alone.
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    # Why this server refuses images although its model takes them (None: it serves them).
    refusal: str | None = None
    # How images are resized before the processor sees them (`presize`; None: not).
    presize: tuple[int, int, int, int] | None = None

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
        media_memory()  # SGLANG_MEDIA_MEMORY_MB read at start: a bad value stops it, naming the variable
        if getattr(server_args, "disaggregation_mode", "null") != "null":
            # The decode server never runs the prompt, so it would lack the request's rotary delta.
            processor.refusal = (
                "image_data and video_data are not served with --disaggregation-mode (issue 59)."
            )
        return processor

    def pixel_budget(self, context_len: int) -> PixelBudget:
        """A request's decode bounds: per image, and over its images and video frames."""
        return PixelBudget.for_model(self.max_pixels, context_len, self.pixels_per_token)

    async def process(
        self,
        job: MediaJob,
        input_ids: list[int],
        image_data: Any,
        video_data: Any = None,
        where: tuple[str, str] = ("", ""),
        pixels: PixelBudget | None = None,
        done: dict[int, Any] | None = None,
    ) -> tuple[list[int], MultimodalInputs]:
        """The prompt with each image's placeholder token expanded to its image tokens (as pad values),
        each video's to its frames (per pair of frames: the timestamp, <|vision_start|>, the tokens,
        <|vision_end|>, as transformers' Qwen3VLProcessor writes it), and the request's
        `MultimodalInputs`. `where` names the prompt's images and videos in errors; their decoded pixels
        are charged to `pixels` (the request's, over all its prompts). Each image is decoded, processed
        and dropped before the next (one decoded image held at a time), each a step of `job` in the media
        pool; `done` (the request's, by the item's id) keeps what an item gave, so an item shared by a
        batch's prompts is processed once."""
        done = {} if done is None else done
        image_where, video_where = where[0] or FIELD, where[1] or videos.FIELD
        # Each placeholder's expansion: [(ids before, pixels, grid, checkpoint token, ids after)].
        expand: dict[int, list[tuple[list[int], torch.Tensor, list[int], int, list[int]]]] = {}
        if image_data is not None:
            items = image_data if isinstance(image_data, list) else [image_data]
            at = self._placeholders(input_ids, self.image_token_id, len(items), "image", image_where)
            for i, (place, item) in enumerate(zip(at, items, strict=True)):
                if id(item) not in done:  # its bytes reserved in the process's media memory first
                    need = await job.run(image_bytes, item, pixels)
                    at_i = f"{image_where}[{i}]"
                    done[id(item)] = await job.run(self._image, item, at_i, pixels, reserve=need)
                chunk, grid = done[id(item)]
                expand[place] = [([], chunk, grid, self.image_token_id, [])]
        if video_data is not None:
            items = video_data if isinstance(video_data, list) else [video_data]
            at = self._placeholders(input_ids, self.video_token_id, len(items), "video", video_where)
            for k, (place, item) in enumerate(zip(at, items, strict=True)):
                if id(item) not in done:
                    probe = videos.probe_bytes(item, pixels)  # its estimate opens the file
                    need = await job.run(videos.video_bytes, item, self.video, pixels, reserve=probe)
                    at_k = f"{video_where}[{k}]"
                    done[id(item)] = await job.run(self._video_frames, item, at_k, pixels, reserve=need)
                expand[place] = done[id(item)]
        return await job.run(self._assemble, input_ids, expand)

    def _assemble(
        self, input_ids: list[int], expand: dict[int, list[Any]]
    ) -> tuple[list[int], MultimodalInputs]:
        """The prompt with each placeholder expanded, and its `MultimodalInputs` (hashes every item)."""
        ids, pixels, grids, offsets, pads, tokens, prev = [], [], [], [], [], [], 0
        for place in sorted(expand):
            ids += input_ids[prev:place]
            for before, chunk, grid, token, after in expand[place]:
                ids += before
                n = grid[0] * grid[1] * grid[2] // self.merge**2
                pads.append(pad_value(chunk, grid, self.vocab_size, token))
                offsets.append((len(ids), n))
                ids += [pads[-1]] * n
                ids += after
                pixels.append(chunk)
                grids.append(grid)
                tokens.append(token)
            prev = place + 1
        ids += input_ids[prev:]
        positions, delta = mrope_positions(len(ids), offsets, grids, self.merge)
        return ids, MultimodalInputs(torch.cat(pixels), grids, offsets, pads, tokens, positions, delta)

    def _image(self, item: Any, where: str, pixels: PixelBudget | None) -> tuple[torch.Tensor, list[int]]:
        """One image's patches and grid (the processor treats each image of a list alone). Its client gone
        while it decoded, it stops before the resize and the processor (MediaCancelled)."""
        image = load_image(item, where, pixels, self.max_pixels)
        check_cancelled()
        image = presize(image, self.presize)
        check_cancelled()
        try:
            out = self.image_processor(images=[image], return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio the processor cannot resize
            raise RequestError(f"{where}: the image processor refused it ({e}).", FIELD) from None
        return out["pixel_values"], out["image_grid_thw"][0].tolist()

    @staticmethod
    def _placeholders(input_ids: list[int], token: int, count: int, kind: str, where: str) -> list[int]:
        at = [i for i, t in enumerate(input_ids) if t == token]
        if len(at) != count:
            field = where.split("[")[0]
            raise RequestError(
                f"The prompt has {len(at)} {kind} placeholders "
                f"(<|vision_start|><|{kind}_pad|><|vision_end|>) "
                f"for {count} {kind}s in {where}; give one per {kind}.",
                field,
            )
        return at

    def _video_frames(
        self, item: Any, where: str, pixels: PixelBudget | None
    ) -> list[tuple[list[int], torch.Tensor, list[int], int, list[int]]]:
        """A video's expansion: per pair of frames, its timestamp and frame tokens (a (1, h, w) grid, as
        transformers' get_rope_index splits a video)."""
        assert self.video is not None
        video = videos.load_video(item, where, self.video, pixels)
        check_cancelled()  # its client gone while it decoded: no patches
        patches, (t, h, w) = videos.video_patches(video, self.video)
        stamps = video.timestamps(self.video.temporal_patch_size)
        out = []
        for k, chunk in enumerate(patches.split(h * w)):
            stamp = self.tokenizer.encode(f"<{stamps[k]:.1f} seconds>", add_special_tokens=False)
            out.append((stamp + self.frame_open, chunk, [1, h, w], self.video_token_id, self.frame_close))
        assert len(out) == t
        return out


def per_prompt(data: Any, num_prompts: int, is_batch: bool, field: str) -> list[Any]:
    """`image_data` or `video_data` split by prompt, as upstream takes them: for one prompt, one item or a
    list of its items; for a batch, one item (every prompt gets it) or a list with one entry per prompt,
    each what one prompt takes (a list of its items, one item) or None / [] (none). A video item is a
    video file or a list of frames, so one prompt's single video of frames is `[[frame, ...]]`."""
    if data is None or data == []:
        return [None] * (num_prompts if is_batch else 1)
    if not is_batch:
        return [data]
    if not isinstance(data, list):
        return [data] * num_prompts
    if len(data) != num_prompts:
        raise RequestError(
            f"{field} in a batch of {num_prompts} prompts needs one entry per prompt (a list of its "
            f"items, or null), got {len(data)}.",
            field,
        )
    return [None if entry is None or entry == [] else entry for entry in data]


async def attach_media(
    processor: ImageInputProcessor | None,
    items: list[Any],
    image_data: Any,
    video_data: Any,
    limits: Any,
    is_batch: bool,
    job: MediaJob | None = None,
) -> None:
    """Expand the prompts of `items` (the `NormalizedRequest`s of one /generate call: each sample of
    each prompt) with their prompt's images and videos, processed off the event loop as steps of `job`
    (the request's, default a new one: MediaCancelled once its client is gone). The samples of one
    prompt share its processed media."""
    from sglang.srt.managers.request_validation import check_input_len

    given = [f for f, d in ((FIELD, image_data), (videos.FIELD, video_data)) if d is not None and d != []]
    if not given:
        return
    if processor is None:
        raise RequestError(f"{given[0]} was given, but this model takes no images or videos.", given[0])
    if processor.refusal is not None:
        raise RequestError(processor.refusal, given[0])
    if video_data is not None and video_data != [] and processor.video_refusal is not None:
        raise RequestError(processor.video_refusal, videos.FIELD)
    num_prompts = max(item.prompt for item in items) + 1
    images = per_prompt(image_data, num_prompts, is_batch, FIELD)
    clips = per_prompt(video_data, num_prompts, is_batch, videos.FIELD)
    first = {}  # prompt -> its first sample
    for item in items:
        first.setdefault(item.prompt, item)
    todo = [
        (p, list(first[p].req.input_ids), im, vid)
        for p, (im, vid) in enumerate(zip(images, clips, strict=True))
        if im is not None or vid is not None
    ]

    job = job or MediaJob()
    where = lambda p: (f"{FIELD}[{p}]", f"{videos.FIELD}[{p}]") if is_batch else ("", "")  # noqa: E731
    pixels = processor.pixel_budget(limits.context_len)  # the request's: its prompts' media together
    shared: dict[int, Any] = {}  # an item shared by the batch's prompts: processed once
    done = {}
    for p, ids, im, vid in todo:
        done[p] = await processor.process(job, ids, im, vid, where(p), pixels, shared)
    for p, _, _, vid in todo:  # the field named: the prompt's videos if it has any (the larger part)
        check_input_len(len(done[p][0]), limits, FIELD if vid is None else videos.FIELD)
    for item in items:
        if item.prompt in done:
            item.req.input_ids, item.req.mm_inputs = done[item.prompt]


def _max_pixels(image_processor: Any) -> int | None:
    """The most pixels `image_processor` resizes an image to (Qwen2-VL's `max_pixels`, transformers 5's
    `size["longest_edge"]`); None when it says none."""
    value = getattr(image_processor, "max_pixels", None)
    if not value:
        size = getattr(image_processor, "size", None)
        try:
            value = size["longest_edge"] if size is not None else None
        except (KeyError, TypeError):
            value = None
    return int(value) if value else None


def _presize_settings(image_processor: Any) -> tuple[int, int, int, int] | None:
    """(factor, min_pixels, max_pixels, PIL filter) for `presize` when `image_processor` is transformers'
    PIL Qwen2-VL processor (Qwen3.5's), whose resize is PIL's to `smart_resize`'s size; None otherwise."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:
        return None
    if not isinstance(image_processor, Qwen2VLImageProcessorPil) or not image_processor.do_resize:
        return None
    size = image_processor.size
    factor = image_processor.patch_size * image_processor.merge_size
    return factor, size["shortest_edge"], size["longest_edge"], int(image_processor.resample)


def presize(image: Any, settings: tuple[int, int, int, int] | None) -> Any:
    """`image` resized to the size the processor resizes it to, with its filter: the processor then
    gets the same pixels it would make (checked bit for bit in test_media_bounds) without its own
    full-size copies (a 4032x3024 photo: 0.70 s -> 0.15 s of CPU). Unchanged when `settings` is None."""
    if settings is None:
        return image
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    factor, min_pixels, max_pixels, resample = settings
    try:
        height, width = smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
    except ValueError:  # the processor refuses it, with its own message
        return image
    if (width, height) == image.size:
        return image
    return image.resize((width, height), Image.Resampling(resample))
