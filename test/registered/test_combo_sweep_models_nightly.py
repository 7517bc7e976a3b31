"""Every other architecture's preset (`sglang.test.combo_sweep.MODEL_FEATURES`: Qwen3.5 dense and MoE,
Nemotron-H, Granite-4.0-H, Falcon-H1, Bamba, LFM2 dense and MoE) paired with the serving features that
touch the state pools, the cache or the batch (mamba strategies, page 16, small chunked prefill, no
overlap, a small pool that evicts, the host cache tier, FP8 KV cache, online FP8, NGRAM and NEXTN, TP 2,
DP 2): each either serves or is refused at start in one sentence naming a flag, never BROKEN or WRONG
(each engine also answers a prefix hit, a streamed request with logprobs, logprobs, n=2 sampling and a
json_schema request). One engine at a time.

    .venv/bin/python -m pytest -q -s test/registered/test_combo_sweep_models_nightly.py
"""

from __future__ import annotations

from sglang.test import combo_sweep
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1200, suite="nightly-cpu")

FEATURES = "extra_buffer,lazy,no_buffer,page16,chunked,no_overlap,small_pool,hicache,kv_fp8,quant_fp8,ngram"
FEATURES += ",nextn,tp2,dp2"


def test_no_architecture_pair_is_broken(tmp_path):
    rows: list[str] = []

    def echo(line: str) -> None:
        rows.append(line)
        print(line, flush=True)

    features = [combo_sweep.BY_NAME[n] for n in FEATURES.split(",")] + combo_sweep.MODEL_FEATURES
    models = {f.name for f in combo_sweep.MODEL_FEATURES}
    results = combo_sweep.sweep(features, models, log_dir=tmp_path, echo=echo)
    # Every model with every feature (8 x 14), and each model's own case.
    assert len(results) == len(models) * (len(FEATURES.split(",")) + 1), "\n".join(rows)
    bad = [o for o in results if o.status in ("BROKEN", "WRONG")]
    assert not bad, "\n".join(rows)
