"""Checks of video inputs (`video_data`, chat `video_url` parts) on a Qwen3.5 vision-language preset,
against transformers: its `Qwen3_5ForConditionalGeneration` forward with `pixel_values_videos` /
`video_grid_thw` (its own `get_rope_index` placing the video's tokens), the prompt written as
`Qwen3VLProcessor` writes it (a `<t seconds>` timestamp and the frame tokens per pair of frames, its
`_calculate_timestamps`), frames sampled by `Qwen3VLVideoProcessor.sample_frames` and cut into patches
by its `patchify`. transformers' video processor class itself needs torchvision, which this project
does not install: the oracle resizes with PIL to transformers' `smart_resize` size, as the server does.
Collected by the VL test modules on their `setup` fixture (`vl_checks.start`)."""

from __future__ import annotations

import base64
import io
import json
import os
import types

import numpy as np
import pytest
import torch

from sglang.srt.managers.request_error import RequestError
from sglang.test.model_checks import max_abs
from sglang.test.vl_checks import GREEDY, PLACEHOLDER, TOL, b64_png, random_image

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def frames_of(seed: int, count: int, height: int = 64, width: int = 64) -> list:
    return [random_image(seed * 100 + i, height, width) for i in range(count)]


def mp4_bytes(frames: list, fps: int) -> bytes:
    """The frames encoded as an MPEG-4 video (lossy: decode it to know its frames)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_image(f)))
        out.mux(stream.encode())
    return buf.getvalue()


def decoded_video(data: bytes, path: str) -> tuple[list, list[int], float]:
    """A video file's frames as transformers' PyAV reader gives them, sampled by Qwen3VLVideoProcessor's
    `sample_frames` with the checkpoint's settings: (frames, their indices, the file's fps)."""
    import av
    from PIL import Image
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    with open(os.path.join(path, "video_preprocessor_config.json")) as f:
        cfg = json.load(f)
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        fps, total = float(stream.average_rate), stream.frames
        frames = [Image.fromarray(fr.to_ndarray(format="rgb24")) for fr in c.decode(video=0)]
    sampler = types.SimpleNamespace(
        fps=cfg["fps"], min_frames=cfg["min_frames"], max_frames=cfg["max_frames"]
    )
    indices = Qwen3VLVideoProcessor.sample_frames(sampler, VideoMetadata(total_num_frames=total, fps=fps))
    indices = [int(i) for i in indices]
    return [frames[i] for i in indices], indices, fps


class VideoOracle:
    """transformers' forward of a prompt with images and videos, as its processor would prepare it."""

    def __init__(self, oracle):
        self.oracle = oracle
        self.path = path = oracle.tokenizer.name_or_path  # the checkpoint's folder
        with open(os.path.join(path, "video_preprocessor_config.json")) as f:
            self.cfg = json.load(f)

    def video_pixels(self, frames: list) -> tuple[torch.Tensor, list[int]]:
        from PIL import Image
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

        c = self.cfg
        width, height = frames[0].size
        h, w = smart_resize(
            len(frames), height, width, c["temporal_patch_size"], c["patch_size"] * c["merge_size"],
            c["size"]["shortest_edge"], c["size"]["longest_edge"],
        )  # fmt: skip
        x = np.stack([np.asarray(f.resize((w, h), Image.BICUBIC), np.float32) / 255.0 for f in frames])
        x = (x - np.array(c["image_mean"], np.float32)) / np.array(c["image_std"], np.float32)
        video = torch.from_numpy(x).permute(0, 3, 1, 2)[None]  # [1, frames, C, H, W]
        patches, t, gh, gw = Qwen3VLVideoProcessor.patchify(
            None, video, c["patch_size"], c["merge_size"], c["temporal_patch_size"]
        )
        return patches[0], [t, gh, gw]

    def expanded(self, prompt: str, images: list, videos: list) -> tuple[list[int], dict]:
        """The prompt's ids with each image / video placeholder expanded, and the model's multimodal
        kwargs. `videos`: (frames, indices, fps) each."""
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

        o = self.oracle
        kwargs: dict = {}
        image_counts: list[int] = []
        if images:
            px = o.processor(images=images, return_tensors="pt")
            image_counts = (px["image_grid_thw"].prod(-1) // 4).tolist()
            kwargs.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
        texts = []
        if videos:
            pixels, grids = [], []
            for frames, indices, fps in videos:
                p, g = self.video_pixels(frames)
                pixels.append(p)
                grids.append(g)
                stamps = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
                per_frame = "<|video_pad|>" * (g[1] * g[2] // 4)
                texts.append(
                    "".join(f"<{s:.1f} seconds><|vision_start|>{per_frame}<|vision_end|>" for s in stamps)
                )
            kwargs.update(pixel_values_videos=torch.cat(pixels), video_grid_thw=torch.tensor(grids))
        image_token = o.model.config.image_token_id
        parts = prompt.split("<|video_pad|>")
        text = parts[0] + "".join(t + rest for t, rest in zip(texts, parts[1:], strict=True))
        ids: list[int] = []
        for t in o.tokenizer.encode(text):
            ids += [t] * image_counts.pop(0) if t == image_token else [t]
        return ids, kwargs

    @torch.no_grad()
    def logprobs(self, prompt: str, images: list, videos: list, continuation: list[int]) -> tuple[list, list]:
        """Logprobs of every token after the first of the expanded prompt + `continuation`, and the
        expanded prompt's ids."""
        o = self.oracle
        ids, kwargs = self.expanded(prompt, images, videos)
        x = torch.tensor([ids + continuation])
        kinds = (x == o.model.config.image_token_id).int() + 2 * (x == o.model.config.video_token_id).int()
        logits = o.model(input_ids=x, mm_token_type_ids=kinds, **kwargs).logits[0]
        lp = logits.log_softmax(-1)
        full = ids + continuation
        return lp[torch.arange(len(full) - 1), torch.tensor(full[1:])].tolist(), ids


def _run(engine, prompt: str, images: list, video_data) -> tuple[list[float], list[int], dict]:
    out = engine.generate(
        prompt=prompt,
        image_data=[b64_png(im) for im in images] or None,
        video_data=video_data,
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
    )
    meta = out["meta_info"]
    lps = [x[0] for x in meta["input_token_logprobs"]][1:] + [x[0] for x in meta["output_token_logprobs"]]
    return lps, [x[1] for x in meta["output_token_logprobs"]], meta


@pytest.fixture(scope="module")
def video_oracle(setup):
    return VideoOracle(setup[1])


def test_video_frames_with_an_image_match_oracle(setup, video_oracle):
    """A prompt with an image and a video of 5 frames (a list of frames: the last repeated to a whole
    pair, 3 grids of 16 tokens with their timestamps): logprobs equal transformers', and the returned
    input ids are the processor's (<|image_pad|> / <|video_pad|> at their positions)."""
    engine, _ = setup
    image, frames = random_image(50, 48, 64), frames_of(5, 5)
    prompt = "See " + PLACEHOLDER + " then watch " + VIDEO + " and say"
    got, out_ids, meta = _run(engine, prompt, [image], [[b64_png(f) for f in frames]])
    want, ids = video_oracle.logprobs(prompt, [image], [(frames, list(range(5)), 24.0)], out_ids)
    assert max_abs(got, want) < TOL
    assert [x[1] for x in meta["input_token_logprobs"]] == ids


def test_video_file_matches_oracle_and_chat(setup, video_oracle, tmp_path):
    """An mp4 file (6 frames at 4 fps: transformers' sampler takes 4 of them, timestamps at 4 fps) as
    base64: logprobs equal transformers' on the frames PyAV decodes; the same file as a chat `video_url`
    part answers as /generate on the templated prompt."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.test.vl_checks import _first_reply

    engine, _ = setup
    data = mp4_bytes(frames_of(6, 6, 48, 64), fps=4)
    video = decoded_video(data, video_oracle.path)
    assert video[1] == [0, 2, 3, 5]  # sampled, as transformers samples it
    encoded = base64.b64encode(data).decode()
    prompt = "Watch " + VIDEO + " and say"
    got, out_ids, _ = _run(engine, prompt, [], [encoded])
    want, _ = video_oracle.logprobs(prompt, [], [video], out_ids)
    assert max_abs(got, want) < TOL

    content = [
        {"type": "text", "text": "Watch "},
        {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{encoded}"}},
    ]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0)
    obj = engine._run(OpenAIServingChat(engine.tokenizer_manager, "m").to_generate_input(req))
    via_chat = engine._run(_first_reply(engine.tokenizer_manager.generate_request(obj)))
    templated = f"<|im_start|>user\nWatch {VIDEO}<|im_end|>\n<|im_start|>assistant\n"
    direct = engine.generate(prompt=templated, video_data=encoded, sampling_params=GREEDY)
    assert via_chat["output_ids"] == direct["output_ids"]


def test_prefix_cache_keyed_by_video(setup):
    """A request extending a finished one hits its cached video prefix with the same video (and equals
    a cold prefill); another video misses from its first frame on."""
    engine, oracle = setup
    ids = oracle.tokenizer.encode("Watch " + VIDEO + " in a word")
    video = [b64_png(f) for f in frames_of(7, 4)]
    other = [b64_png(f) for f in frames_of(8, 4)]

    def go(prompt_ids: list[int], v: list) -> tuple[list[float], dict]:
        out = engine.generate(
            input_ids=prompt_ids, video_data=[v], sampling_params=GREEDY, return_logprob=True
        )
        meta = out["meta_info"]
        return [x[0] for x in meta["output_token_logprobs"]], meta | {"output_ids": out["output_ids"]}

    engine.flush_cache()
    first = go(ids, video)[1]
    longer = ids + first["output_ids"] + ids[:3]
    hit, hit_meta = go(longer, video)
    assert hit_meta["cached_tokens"] >= len(ids) - 1 + 2 * 16  # the prompt with its two frame grids
    engine.flush_cache()
    cold, cold_meta = go(longer, video)
    assert cold_meta["cached_tokens"] == 0 and max_abs(hit, cold) < TOL
    miss_meta = go(longer, other)[1]
    # The text before the video and the first timestamp (`<0.0 seconds>`, equal for both) at most.
    assert miss_meta["cached_tokens"] <= ids.index(oracle.model.config.video_token_id) + 8


@pytest.mark.parametrize(
    "video_data, words",
    [
        ([base64.b64encode(b"not a video, nor an image").decode()], "could not be decoded as a video"),
        ([[b64_png(random_image(1, 64, 64))]], "video processor refused"),
        ([[b64_png(random_image(1, 64, 64)), "bm90IGFuIGltYWdl"]], "video_data[0][1]"),
        ([[b64_png(random_image(1, 64, 64)), b64_png(random_image(2, 32, 64))]], "one size"),
        ([["x"], ["y"]], "1 video placeholders"),
    ],
    ids=["corrupt", "one-frame", "bad-frame", "mixed-sizes", "count"],
)
def test_bad_videos_refused(setup, video_data, words):
    engine, _ = setup
    with pytest.raises(RequestError) as err:
        engine.generate(prompt="Watch " + VIDEO, video_data=video_data, sampling_params=GREEDY)
    assert err.value.param == "video_data" and words in err.value.message


def test_video_pixel_bound(setup, monkeypatch):
    """Over video.MAX_DECODED_PIXELS (lowered here to 3 frames of 64x64): a file is refused before its
    frames are decoded, a list of frames after its first; both 400s naming video_data."""
    from sglang.srt.multimodal import video

    engine, _ = setup
    monkeypatch.setattr(video, "MAX_DECODED_PIXELS", 3 * 64 * 64)
    frames = frames_of(9, 4)
    for data in ([base64.b64encode(mp4_bytes(frames, fps=4)).decode()], [[b64_png(f) for f in frames]]):
        with pytest.raises(RequestError) as err:
            engine.generate(prompt="Watch " + VIDEO, video_data=data, sampling_params=GREEDY)
        assert (
            err.value.param == "video_data"
            and "4 frames of 64x64, over the 12288 pixels" in err.value.message
        )


def test_batch_prompts_with_their_own_videos(setup):
    """A batch of three prompts, `video_data` one entry per prompt (a video of frames, another video, none)
    beside `image_data` (none, none, an image): each prompt answers as it does sent alone."""
    engine, _ = setup
    videos = [[b64_png(f) for f in frames_of(11, 4)], [b64_png(f) for f in frames_of(12, 3)]]
    image = b64_png(random_image(13, 64, 64))
    prompts = ["Watch " + VIDEO + " now", "Watch " + VIDEO + " now", "See " + PLACEHOLDER + " now"]
    outs = engine.generate(
        prompt=prompts,
        video_data=[[videos[0]], [videos[1]], None],
        image_data=[None, None, [image]],
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
    )
    alone = [
        engine.generate(prompt=p, video_data=v, image_data=i, sampling_params=GREEDY, return_logprob=True,
                        logprob_start_len=0)
        for p, v, i in zip(prompts, [[videos[0]], [videos[1]], None], [None, None, [image]], strict=True)
    ]  # fmt: skip
    for out, one in zip(outs, alone, strict=True):
        got, want = (
            [x[0] for x in o["meta_info"]["input_token_logprobs"][1:]]
            + [x[0] for x in o["meta_info"]["output_token_logprobs"]]
            for o in (out, one)
        )
        assert out["output_ids"] == one["output_ids"] and max_abs(got, want) < TOL
    assert outs[0]["meta_info"]["input_token_logprobs"] != outs[1]["meta_info"]["input_token_logprobs"]
