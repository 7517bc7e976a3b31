"""Checks of images in a batch of several prompts (each prompt with its own images) and of the input ids
a reply shows at image positions; collected by the VL test modules on their `setup` fixture
(`vl_checks.start`)."""

from __future__ import annotations

import pytest

from sglang.srt.managers.request_error import RequestError
from sglang.test.model_checks import max_abs
from sglang.test.vl_checks import GREEDY, PLACEHOLDER, TOL, b64_png, random_image, run


def expanded_ids(oracle, prompt: str, images: list) -> list[int]:
    """The prompt's ids as transformers' processor writes them: each <|image_pad|> repeated per image token."""
    image_token = oracle.model.config.image_token_id
    counts = []
    if images:
        counts = (
            oracle.processor(images=images, return_tensors="pt")["image_grid_thw"].prod(-1) // 4
        ).tolist()
    ids: list[int] = []
    for t in oracle.tokenizer.encode(prompt):
        ids += [t] * counts.pop(0) if t == image_token else [t]
    return ids


def test_batch_prompts_with_their_own_images(setup):
    """One /generate call with four prompts (two of them the same text with different images, one with two
    images, one with none; `image_data` a list of per-prompt lists, as upstream takes it): each prompt's
    logprobs equal the same prompt sent alone and the oracle's, and the input ids shown at image positions
    are the checkpoint's <|image_pad|>, as the processor writes the prompt."""
    engine, oracle = setup
    images = [random_image(40 + i, h, w) for i, (h, w) in enumerate([(64, 64), (64, 64), (48, 96), (32, 64)])]
    prompts = [
        "Look at " + PLACEHOLDER + " then say",
        "Look at " + PLACEHOLDER + " then say",
        "Compare " + PLACEHOLDER + " and " + PLACEHOLDER,
        "No image in this one",
    ]
    per_prompt = [[images[0]], [images[1]], images[2:], []]
    outs = engine.generate(
        prompt=prompts,
        image_data=[[b64_png(im) for im in ims] or None for ims in per_prompt],
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
    )
    for prompt, ims, out in zip(prompts, per_prompt, outs, strict=True):
        meta = out["meta_info"]
        got = [x[0] for x in meta["input_token_logprobs"]][1:] + [x[0] for x in meta["output_token_logprobs"]]
        out_ids = [x[1] for x in meta["output_token_logprobs"]]
        alone, alone_ids, _ = run(engine, prompt, ims)
        assert out_ids == alone_ids and max_abs(got, alone) < TOL
        assert max_abs(got, oracle.logprobs(prompt, ims, out_ids)) < TOL
        assert [x[1] for x in meta["input_token_logprobs"]] == expanded_ids(oracle, prompt, ims)
    # The two prompts of one text differ by their images only: they were not given each other's.
    assert outs[0]["meta_info"]["input_token_logprobs"] != outs[1]["meta_info"]["input_token_logprobs"]


@pytest.mark.parametrize(
    "image_data, words",
    [([["A"], ["B"], ["C"]], "one entry per prompt"), ([None, ["bm90IGFuIGltYWdl"]], "image_data[1][0]")],
    ids=["count", "names-prompt"],
)
def test_batch_image_data_refused(setup, image_data, words):
    """A batch whose image_data has not one entry per prompt, or a bad image in the second prompt's list:
    a 400 naming image_data (and which prompt's image)."""
    engine, _ = setup
    with pytest.raises(RequestError) as err:
        engine.generate(prompt=["See " + PLACEHOLDER] * 2, image_data=image_data, sampling_params=GREEDY)
    assert err.value.param == "image_data" and words in err.value.message
