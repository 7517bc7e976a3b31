"""Helpers for the vision-language tests: images, and the transformers oracle's teacher-forced
logprobs of a prompt with images."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from sglang.srt.managers.request_error import RequestError
from sglang.test.model_checks import max_abs

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def random_image(seed: int, height: int, width: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def b64_png(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def png_header(width: int, height: int) -> str:
    """Base64 of a PNG that declares width x height pixels and holds none (a decoder would have to
    allocate the whole image to find out)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")
    return base64.b64encode(png).decode()


class VLOracle:
    """transformers' `Qwen3_5[Moe]ForConditionalGeneration` of a checkpoint, float32."""

    def __init__(self, path: str):
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        self.processor = AutoImageProcessor.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    @torch.no_grad()
    def logprobs(self, prompt: str, images: list, continuation: list[int]) -> list[float]:
        """Logprobs of every token after the first of the expanded prompt + `continuation`."""
        image_token = self.model.config.image_token_id
        kwargs = {}
        counts: list[int] = []
        if images:
            pixels = self.processor(images=images, return_tensors="pt")
            counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
            kwargs = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        ids: list[int] = []
        for t in self.tokenizer.encode(prompt):
            ids += [t] * counts.pop(0) if t == image_token else [t]
        ids += continuation
        x = torch.tensor([ids])
        logits = self.model(input_ids=x, mm_token_type_ids=(x == image_token).int(), **kwargs).logits[0]
        lp = logits.log_softmax(-1)
        return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


# float32 on both sides; the kernels differ from transformers' in summation order only (measured
# 4.8e-6 over 56 positions with two images). Measured on the oracle for the two-image prompt: image
# tokens at text positions (no mRoPE) move a logprob by 0.30, another first image by 5.3; a decode
# position without the request's delta is the same kind of error as the former.
TOL = 1e-4
GREEDY = {"max_new_tokens": 4, "temperature": 0}


def start(preset: str):
    """The `setup` fixture of a test module that imports the tests below: (engine, oracle)."""
    import sglang
    from sglang.srt.configs.presets import resolve_model_path

    engine = sglang.Engine(model_path=preset)
    yield engine, VLOracle(resolve_model_path(preset))
    engine.shutdown()


# The tests, collected by the test modules that import them (each with its own `setup` fixture).


def run(engine, prompt: str, images: list) -> tuple[list[float], list[int], dict]:
    """The engine's input logprobs (after the first token) + output logprobs, its output ids, meta."""
    out = engine.generate(
        prompt=prompt,
        image_data=[b64_png(im) for im in images] or None,
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
    )
    meta = out["meta_info"]
    lps = [x[0] for x in meta["input_token_logprobs"]][1:] + [x[0] for x in meta["output_token_logprobs"]]
    return lps, [x[1] for x in meta["output_token_logprobs"]], meta


@pytest.mark.parametrize("sizes", [[(64, 64)], [(64, 64), (48, 96)]], ids=["one", "two"])
def test_logprobs_match_oracle(setup, sizes):
    engine, oracle = setup
    images = [random_image(i, h, w) for i, (h, w) in enumerate(sizes)]
    prompt = "Look at " + " and ".join([PLACEHOLDER] * len(images)) + " then say"
    got, out_ids, _ = run(engine, prompt, images)
    assert max_abs(got, oracle.logprobs(prompt, images, out_ids)) < TOL


def test_text_only_prompt_unchanged(setup):
    engine, oracle = setup
    got, out_ids, _ = run(engine, "A plain prompt with no image in it", [])
    assert max_abs(got, oracle.logprobs("A plain prompt with no image in it", [], out_ids)) < TOL


def test_prefix_cache_keyed_by_image(setup):
    """A finished request leaves its state after its last fed token in the tree: a request that extends
    its sequence hits it with the same image, and not with another image."""
    engine, oracle = setup
    ids = oracle.tokenizer.encode("Describe " + PLACEHOLDER + " in a word")
    image, other = b64_png(random_image(10, 64, 64)), b64_png(random_image(11, 64, 64))

    def go(prompt_ids: list[int], img: str) -> tuple[list[float], dict]:
        # Output logprobs only: input logprobs from position 0 would keep the request off the cache.
        out = engine.generate(
            input_ids=prompt_ids, image_data=[img], sampling_params=GREEDY, return_logprob=True
        )
        meta = out["meta_info"]
        return [x[0] for x in meta["output_token_logprobs"]], meta | {"output_ids": out["output_ids"]}

    engine.flush_cache()
    first = go(ids, image)[1]
    longer = ids + first["output_ids"] + ids[:3]
    hit, hit_meta = go(longer, image)
    assert hit_meta["cached_tokens"] >= len(ids) - 1 + 16  # the prompt with its 16 image tokens
    engine.flush_cache()
    cold, cold_meta = go(longer, image)
    assert cold_meta["cached_tokens"] == 0 and max_abs(hit, cold) < TOL
    miss_meta = go(longer, other)[1]
    assert miss_meta["cached_tokens"] <= ids.index(oracle.model.config.image_token_id)


@pytest.mark.parametrize(
    "data, words",
    [
        ("bm90IGFuIGltYWdl", "could not be decoded"),
        (png_header(100_000, 100_000), "over the"),
        (b64_png(random_image(0, 2, 600)), "image processor refused it"),
        ("http://127.0.0.1:9/x.png", "non-public address"),
        ("/dev/zero", "neither an existing file"),
        ("BIG_FILE", "is a file over"),
    ],
    ids=["corrupt", "huge", "aspect", "url", "device", "big-file"],
)
def test_bad_images_refused(setup, data, words, tmp_path):
    engine, _ = setup
    if data == "BIG_FILE":  # a sparse file: no disk written
        data = str(tmp_path / "big.png")
        with open(data, "wb") as f:
            f.truncate(100 << 20)
    with pytest.raises(RequestError) as err:
        engine.generate(prompt="See " + PLACEHOLDER, image_data=data, sampling_params=GREEDY)
    assert err.value.param == "image_data" and words in err.value.message


def test_chat_image_url_parts(setup):
    """OpenAI `image_url` content parts: the chat template puts the placeholders, the images follow
    in order, and the answer equals /generate's on the same templated prompt."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    engine, _ = setup
    images = [b64_png(random_image(20, 64, 64)), b64_png(random_image(21, 32, 64))]
    content = [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{images[0]}"}},
    ]
    content += [{"type": "text", "text": " with "}, {"type": "image_url", "image_url": {"url": images[1]}}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0)
    chat = OpenAIServingChat(engine.tokenizer_manager, "m")
    obj = engine._run(chat.to_generate_input(req))
    assert obj.image_data == [content[1]["image_url"]["url"], images[1]]
    via_chat = engine._run(_first_reply(engine.tokenizer_manager.generate_request(obj)))
    prompt = f"<|im_start|>user\nCompare {PLACEHOLDER} with {PLACEHOLDER}<|im_end|>\n<|im_start|>assistant\n"
    direct = engine.generate(prompt=prompt, image_data=images, sampling_params=GREEDY)
    assert via_chat["output_ids"] == direct["output_ids"]


async def _first_reply(agen):
    async for item in agen:
        return item


def test_image_forms_agree(setup, tmp_path):
    """A file path, base64 and a data URI of one image give the same answer."""
    engine, _ = setup
    image = random_image(30, 48, 48)
    path = tmp_path / "im.png"
    image.save(path)
    encoded = b64_png(image)
    outs = [
        engine.generate(prompt="See " + PLACEHOLDER, image_data=item, sampling_params=GREEDY)["output_ids"]
        for item in (str(path), encoded, "data:image/png;base64," + encoded)
    ]
    assert outs[0] == outs[1] == outs[2]
