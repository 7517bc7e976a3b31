"""/v1/score's arithmetic (`serving_score.scores_of`): probabilities over the vocabulary, or renormalized
over the labels; labels no position can be are 0, never NaN. The route on a real server:
test_score_api in test/registered/openai_server/test_openai_api.py."""

from __future__ import annotations

import math

from sglang.srt.entrypoints.openai.serving_score import scores_of
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")


def _out(pairs: dict[int, float]) -> dict:
    return {"meta_info": {"output_token_ids_logprobs": [[(lp, tid, None) for tid, lp in pairs.items()]]}}


def test_scores_are_probabilities_or_their_share_among_the_labels():
    out = _out({5: math.log(0.2), 7: math.log(0.05)})
    ((p5, p7),) = scores_of([out], [5, 7], False)
    assert abs(p5 - 0.2) < 1e-12 and abs(p7 - 0.05) < 1e-12, "each over the whole vocabulary"
    (soft,) = scores_of([out], [7, 5], True)
    assert abs(soft[0] - 0.2) < 1e-12 and abs(soft[1] - 0.8) < 1e-12, "renormalized, in the labels' order"


def test_labels_no_position_can_be_score_zero_not_nan():
    out = _out({5: -math.inf, 7: -math.inf})
    assert scores_of([out], [5, 7], True) == [[0.0, 0.0]]
    assert scores_of([out], [5, 7], False) == [[0.0, 0.0]]
