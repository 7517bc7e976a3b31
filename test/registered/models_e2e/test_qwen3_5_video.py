"""Video and batched images on the Qwen3.5-MoE vision-language preset (issue 59), nightly: every check
of `sglang.test.vl_video_checks` (video frames with an image and an mp4 file against transformers'
float32 forward, chat `video_url`, the prefix cache keyed by video, bad videos) and of
`sglang.test.vl_batch_checks` (a batch of prompts with their own images). The dense preset runs them per
commit in test_qwen3_5_vl_models.py; a batch of prompts with their own videos runs here only. Run:
    .venv/bin/python -m pytest -q test/registered/models_e2e/test_qwen3_5_video.py"""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.vl_batch_checks import (  # noqa: F401  (collected here, on this module's `setup`)
    test_batch_image_data_refused,
    test_batch_prompts_with_their_own_images,
)
from sglang.test.vl_video_checks import (  # noqa: F401
    test_bad_videos_refused,
    test_batch_prompts_with_their_own_videos,
    test_prefix_cache_keyed_by_video,
    test_video_file_matches_oracle_and_chat,
    test_video_frames_with_an_image_match_oracle,
    test_video_pixel_bound,
    video_oracle,
)

register_cpu_ci(est_time=60, suite="nightly-cpu")


@pytest.fixture(scope="module")
def setup():
    from sglang.test.vl_checks import start

    yield from start("tiny-qwen3.5-moe-vl")
