"""The demo model's trained MTP layer drafts what the model then writes: on held-out Python (modules it
never trained on) with 3 drafts per verify (--speculative-num-steps 3), greedy, NEXTN commits
ACCEPT_LENGTH tokens per request and verify (`training.json`'s `mtp` entry: how the layer was trained).
A draft that is wrong at every position commits 1.0 (the model's own token alone); one fed each row's
hidden state from the row before committed 1.31 here (measured), so the floor sits between that and the
trained layer's number. (The same requests' outputs equal
plain decoding's: `test_speculative_mtp_nightly.py`.)"""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.mtp_checks import demo_outputs, held_out_prompts

register_cpu_ci(est_time=10, suite="per-commit-cpu")

# Measured on this test's requests (180 tokens in 114 verifies); the floor leaves room for a few flipped
# float32 near-ties on another CPU and sits well above what a broken draft reaches.
ACCEPT_LENGTH = 1.58
FLOOR = 1.4


def test_demo_mtp_accepts_on_held_out_python():
    _, stats = demo_outputs(held_out_prompts(4, 96), speculative_algorithm="NEXTN", speculative_num_steps=3)
    accept_length = stats["committed_tokens"] / stats["verify_steps"]
    assert accept_length >= FLOOR, (
        f"NEXTN committed {accept_length:.3f} tokens per verify on held-out Python at 3 drafts "
        f"(measured {ACCEPT_LENGTH}; floor {FLOOR}; a draft that never hits gives 1.0)"
    )
