"""NEXTN with --tp-size 2 (issue 57, part 2): Engines on two gloo ranks (one scheduler process each).
The demo model (its MTP layer trained, so verifies accept 0..3 drafts) on held-out text: greedy NEXTN at
TP 2 commits plain decoding's tokens at TP 1 and NEXTN's at TP 1, token for token, with the same
acceptance histogram per request (every rank drafts the same tokens from the gathered logits, so the
ranks' verifies accept alike and their batches stay identical; the ranks' reductions differ from one
rank's only by float32 noise, far below the demo model's logit gaps). A sampled request at TP 2 runs
to its length with the ranks in step. The FP8 twin of tiny-qwen3-next at TP 2 (its MTP layer dequantized
on the CPU) serves plain decoding's tokens. The per-commit check (sharded weights, the MTP layer's
output and full-vocabulary draft logits at TP 1 vs 2): test_tp_model.py's NEXTN case."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.mtp_checks import DEMO, held_out_prompts

register_cpu_ci(est_time=90, suite="nightly-cpu")

GREEDY = {"max_new_tokens": 32, "temperature": 0}


def _serve(model: str, tp: int, prompts: list[list[int]], sampled: bool = False, **kw) -> list[dict]:
    import sglang

    eng = sglang.Engine(
        model_path=model, tp_size=tp, random_seed=7, log_level="warning", dtype="float32", **kw
    )
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        if sampled:
            params = {"max_new_tokens": 24, "temperature": 1.0, "top_k": 8, "ignore_eos": True}
            outs.append(eng.generate(input_ids=prompts[0], sampling_params=params))
        return outs
    finally:
        eng.shutdown()


def test_nextn_at_tp2_equals_tp1_and_plain_decoding():
    prompts = held_out_prompts(3, 48)
    plain = _serve(DEMO, 1, prompts)
    nextn = _serve(DEMO, 1, prompts, speculative_algorithm="NEXTN")
    tp2 = _serve(DEMO, 2, prompts, sampled=True, speculative_algorithm="NEXTN")
    accepted = 0
    for k, (a, b, c) in enumerate(zip(plain, nextn, tp2, strict=False)):
        assert c["output_ids"] == b["output_ids"] == a["output_ids"], k
        hist = c["meta_info"]["spec_accept_histogram"]
        assert hist == b["meta_info"]["spec_accept_histogram"], k
        accepted += c["meta_info"]["spec_accepted_drafts"]
    assert accepted > 0  # (drafts were accepted: the verifies' accepted positions exercised)
    assert len(tp2[-1]["output_ids"]) == 24  # the sampled request


def test_nextn_at_tp2_on_the_fp8_twin():
    prompts = [[(7 * i + 3 + 13 * k) % 400 + 5 for i in range(40 + 17 * k)] for k in range(2)]
    plain = _serve("tiny-qwen3-next-fp8", 1, prompts)
    tp2 = _serve("tiny-qwen3-next-fp8", 2, prompts, speculative_algorithm="NEXTN")
    assert [o["output_ids"] for o in tp2] == [o["output_ids"] for o in plain]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in tp2)
