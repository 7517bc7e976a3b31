"""Images on the Qwen3.5 vision-language preset through the engine (issue 59): teacher-forced
logprobs of prompts with one and with two images, and the decode after them, equal transformers'
(float32); the prefix cache reuses a prompt's images only for the same images; bad images are refused
naming `image_data`; a text-only prompt on the VL model is unchanged; a batch of prompts with their own
images, and video (frames and an mp4 file, chat `video_url`) against transformers. The checks live in
`sglang.test.vl_checks`, `vl_batch_checks` and `vl_video_checks`; the MoE preset runs them in
test_qwen3_5_vl_models_nightly.py and test_qwen3_5_video.py."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.vl_batch_checks import (  # noqa: F401
    test_batch_image_data_refused,
    test_batch_prompts_with_their_own_images,
)
from sglang.test.vl_checks import (  # noqa: F401  (collected here, on this module's `setup`)
    start,
    test_bad_images_refused,
    test_chat_image_url_parts,
    test_image_forms_agree,
    test_logprobs_match_oracle,
    test_prefix_cache_keyed_by_image,
    test_text_only_prompt_unchanged,
)
from sglang.test.vl_video_checks import (  # noqa: F401
    test_bad_videos_refused,
    test_prefix_cache_keyed_by_video,
    test_video_file_matches_oracle_and_chat,
    test_video_frames_with_an_image_match_oracle,
    test_video_pixel_bound,
    video_oracle,
)

# 20 s for the image checks, ~11 s more for the batch and video ones (the engine is shared).
register_cpu_ci(est_time=31, suite="per-commit-cpu")


@pytest.fixture(scope="module")
def setup():
    yield from start("tiny-qwen3.5-vl")
