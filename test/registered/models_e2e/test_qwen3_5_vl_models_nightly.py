"""test_qwen3_5_vl_models.py's checks on the Qwen3.5-MoE vision-language preset (nightly: another
engine start and oracle, ~35 s here). Run: pytest test/registered/models_e2e/test_qwen3_5_vl_models_nightly.py"""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.vl_checks import (  # noqa: F401  (collected here, on this module's `setup`)
    start,
    test_bad_images_refused,
    test_chat_image_url_parts,
    test_logprobs_match_oracle,
    test_prefix_cache_keyed_by_image,
    test_text_only_prompt_unchanged,
)

register_cpu_ci(est_time=40, suite="nightly-cpu")


@pytest.fixture(scope="module")
def setup():
    yield from start("tiny-qwen3.5-moe-vl")
