"""Every pair of features (`sglang.test.combo_sweep`: mamba strategies, page 16, small chunked prefill, no
overlap, no radix cache, FP8 KV cache, online FP8, an FP8 checkpoint, the host cache tier and its disk
tier, NGRAM and NEXTN speculative decoding, TP 2, DP 2, the vision-language preset; each engine also
serves logprobs, a streamed request, n=2 sampling and a json_schema request) either serves or is refused
at start in one sentence naming a flag: none is BROKEN (an exception, a traceback in the log, a hang) or WRONG (a prefix hit's
greedy tokens differ from the cold request's, or an exact pair's from the preset's engine without
features). One engine at a time; the table is printed (-s) and kept in the failure message.

    .venv/bin/python -m pytest -q -s test/registered/test_combo_sweep_nightly.py
"""

from __future__ import annotations

from sglang.test import combo_sweep
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1900, suite="nightly-cpu")


def test_no_pair_of_features_is_broken(tmp_path):
    rows: list[str] = []

    def echo(line: str) -> None:
        rows.append(line)
        print(line, flush=True)

    results = combo_sweep.sweep(combo_sweep.FEATURES, log_dir=tmp_path, echo=echo)
    assert len(results) > 140  # every pair ran (147), and each preset's own case
    bad = [o for o in results if o.status in ("BROKEN", "WRONG")]
    assert not bad, "\n".join(rows)


def test_the_sweep_finds_a_wrong_prefix_hit(tmp_path):
    """The sweep can fail: with the deferred copy of a hit's checkpoint into the request's running slot
    turned off (a test knob), the hit decodes from a slot that does not hold the prefix's state, and the
    case is WRONG, naming the prefix hit."""
    skip_cow = combo_sweep.Feature("skip_cow", env={"SGLANG_TEST_SKIP_DEFERRED_COW": "1"})
    out = combo_sweep.run_case((combo_sweep.BY_NAME["lazy"], skip_cow), tmp_path)
    assert out.status == "WRONG" and out.detail.startswith("prefix hit"), (out.status, out.detail)


def test_the_sweep_finds_a_hang_and_a_refusal(tmp_path, monkeypatch):
    """A reply later than the timeout is BROKEN (the engine is stopped, the sweep goes on); a flag value
    that cannot work is REFUSED with its sentence."""
    monkeypatch.setattr(combo_sweep, "REQUEST_TIMEOUT_S", 2.0)
    slow = combo_sweep.Feature("slow", env={"SGLANG_TEST_FORWARD_DELAY_MS": "1000"})
    out = combo_sweep.run_case((slow,), tmp_path)
    assert out.status == "BROKEN" and "hang" in out.detail, (out.status, out.detail)
    bad = combo_sweep.Feature("bad", dict(page_size=0))
    out = combo_sweep.run_case((bad,), tmp_path)
    assert out.status == "REFUSED" and "--page-size" in out.detail, (out.status, out.detail)
