"""test_qwen3_5_vl_models.py's checks on the Qwen3.5-MoE vision-language preset, and the image-keyed
prefix cache under every --mamba-scheduler-strategy and two images at --tp-size 2 on the dense one
(nightly: five engine starts, ~3 min here on the loaded 2 cores). Run:
    .venv/bin/python -m pytest -q test/registered/models_e2e/test_qwen3_5_vl_models_nightly.py"""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.vl_checks import (  # noqa: F401  (collected here, on this module's `setup`)
    start,
    test_bad_images_refused,
    test_chat_image_url_parts,
    test_image_forms_agree,
    test_logprobs_match_oracle,
    test_prefix_cache_keyed_by_image,
    test_text_only_prompt_unchanged,
)

register_cpu_ci(est_time=180, suite="nightly-cpu")


@pytest.fixture(scope="module")
def setup():
    yield from start("tiny-qwen3.5-moe-vl")


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_prefix_cache_keyed_by_image_under_every_strategy(strategy):
    """test_prefix_cache_keyed_by_image on the dense preset under each --mamba-scheduler-strategy, with a
    prompt long enough (~200 tokens) for the extra-buffer strategies' chunk checkpoints."""
    import sglang
    from sglang.test.vl_checks import PLACEHOLDER, b64_png, random_image

    engine = sglang.Engine(model_path="tiny-qwen3.5-vl", mamba_scheduler_strategy=strategy)
    try:
        ids = engine.tokenizer_manager.tokenizer.encode("Describe " + PLACEHOLDER + " in a word" * 40)
        image, other = b64_png(random_image(10, 64, 64)), b64_png(random_image(11, 64, 64))

        def go(prompt_ids: list[int], img: str) -> dict:
            params = {"max_new_tokens": 4, "temperature": 0}
            return engine.generate(
                input_ids=prompt_ids, image_data=[img], sampling_params=params, return_logprob=True
            )

        first = go(ids, image)
        longer = ids + first["output_ids"] + ids[:3]
        hit = go(longer, image)
        engine.flush_cache()
        cold, miss = go(longer, image), go(longer, other)
        assert hit["meta_info"]["cached_tokens"] >= len(ids) + 15  # the prompt, its image expanded
        assert cold["meta_info"]["cached_tokens"] == 0 and hit["output_ids"] == cold["output_ids"]
        lps = [[x[0] for x in out["meta_info"]["output_token_logprobs"]] for out in (hit, cold)]
        assert max(abs(a - b) for a, b in zip(*lps, strict=True)) < 1e-4  # float32 order only (1e-6 measured)
        # Nothing past the text before the image (the other image's tokens differ from the first one).
        assert miss["meta_info"]["cached_tokens"] <= ids.index(
            engine.tokenizer_manager.image_processor.image_token_id
        )
    finally:
        engine.shutdown()


def test_two_images_at_tp2():
    """At --tp-size 2 (the vision tower replicated on both ranks) the two-image prompt's logprobs equal
    the oracle's as at TP 1 (4.8e-6 measured)."""
    import sglang
    from sglang.srt.configs.presets import resolve_model_path
    from sglang.test.vl_checks import PLACEHOLDER, VLOracle, b64_png, random_image

    images = [random_image(0, 64, 64), random_image(1, 48, 96)]
    prompt = "Look at " + " and ".join([PLACEHOLDER] * 2) + " then say"
    engine = sglang.Engine(model_path="tiny-qwen3.5-vl", tp_size=2)
    try:
        out = engine.generate(
            prompt=prompt,
            image_data=[b64_png(im) for im in images],
            sampling_params={"max_new_tokens": 4, "temperature": 0},
            return_logprob=True,
            logprob_start_len=0,
        )
    finally:
        engine.shutdown()
    meta = out["meta_info"]
    got = [x[0] for x in meta["input_token_logprobs"]][1:] + [x[0] for x in meta["output_token_logprobs"]]
    want = VLOracle(resolve_model_path("tiny-qwen3.5-vl")).logprobs(prompt, images, out["output_ids"])
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
