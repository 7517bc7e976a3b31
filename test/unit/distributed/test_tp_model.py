"""Tensor and expert parallelism, the model side (issue 54): Qwen3-Next, Qwen3.5 and Qwen3.5-MoE on two
gloo ranks (`sglang.test.tp_model_checks`) give TP 1's greedy tokens, logprobs within float32 reduction
noise of TP 1's and of the transformers oracle, per-rank pools of half TP 1's heads, and
`get_weights_by_name` gathers TP 1's full tensors; with NEXTN the MTP draft layer's output and
whole-vocabulary draft logits are TP 1's (`tp_mtp_checks`). The sharding rule itself (`layers/linear.py`)
and the refusals are checked in process. TP 4 and every strategy: test_tp_model_nightly.py."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.configs.hybrid_arch import parallel_attention_heads
from sglang.srt.configs.mamba_utils import Mamba2StateShape
from sglang.srt.layers.linear import DimShard, shard_tensor
from sglang.test.ci_register import register_cpu_ci
from sglang.test.multi_rank import run_ranks
from sglang.test.tp_model_checks import Case, run_cases, run_session

register_cpu_ci(est_time=38, suite="per-commit-cpu")

# float32 throughout. A rank's row-parallel product sums half the terms and the all-reduce adds the two
# halves: another order of the same float32 sum, ~1e-7 relative per layer; over 4 layers and the
# logits' log-softmax the logprobs move by ~1e-6 (measured: see TP_TOL's test). 1e-4 is the oracle
# tolerance every other float32 test of this project uses.
TP_TOL = 1e-4
ORACLE_TOL = 1e-4
# FP8 experts quantize their inputs per 128-column group to e4m3 (2^-4 relative steps): an input that
# differs by float32 reduction noise can round to the neighbouring e4m3 value, which moves the logprobs by
# ~1e-3 (measured 1.3e-3 against TP 1); their oracle error is another test's (test_fp8_experts.py).
FP8_TP_TOL = 1e-2
# Updated in place (each rank slicing its part of the whole tensor): a per-key-head projection (regrouped
# as it loads), a row-parallel one, one expert's intermediate block; then q_proj by load_format "direct".
UPDATE = (
    "model.layers.0.linear_attn.in_proj_qkvz.weight",
    "model.layers.3.self_attn.o_proj.weight",
    "model.layers.1.mlp.experts.3.down_proj.weight",
)
CASES = [
    Case("tiny-qwen3-next", 2, update=UPDATE),
    Case("tiny-qwen3-next", 2, ep=2),
    Case("tiny-qwen3.5", 2),
    Case("tiny-qwen3.5-moe", 2, ep=2),
    # Block-FP8 experts kept FP8 (the CUDA layout, run by its torch twin here), distributed by EP 2.
    Case("tiny-qwen3.5-moe-fp8", 2, ep=2, env={"SGLANG_FP8_EXPERTS": "fp8"}),
    # NEXTN: the MTP draft layer split as the model's layers (`tp_mtp_checks`).
    Case("tiny-qwen3-next", 2, server_args={"speculative_algorithm": "NEXTN"}),
]


def test_the_sharding_rule_takes_each_piece_apart():
    """Rows [q | k | v] of sizes (4, 4, 8) in 2 parts: rank 1 holds q[2:4], k[2:4], v[4:8]; with 4 parts of 2
    pieces on 8 ranks, rank r holds part r // 2."""
    full = torch.arange(16.0)
    shard = DimShard(0, (4, 4, 8), 2, (0, 1))
    assert shard.positions(1).tolist() == [2, 3, 6, 7, 12, 13, 14, 15]
    shard_two = DimShard(0, (4, 4, 8), 2, (1, 1))  # every rank holding part 1 (replicated parts)
    assert shard_tensor(full, (shard_two,)).tolist() == [2, 3, 6, 7, 12, 13, 14, 15]
    padded = DimShard(0, (5,), 2, (0, 1), pad=1)
    assert padded.positions(1).tolist() == [3, 4, 5] and padded.local_size == 3


def test_refusals_name_the_flag():
    with pytest.raises(ValueError, match="--tp-size 3 does not divide the model's 4 attention heads"):
        parallel_attention_heads(4, 2, tp=3)
    assert parallel_attention_heads(4, 2, tp=4) == (1, 1)  # key/value heads replicated
    with pytest.raises(ValueError, match="--tp-size 4"):
        Mamba2StateShape.create(intermediate_size=64, n_groups=2, num_heads=2, head_dim=32, state_size=16,
                                conv_kernel=4, tp_world_size=4)  # fmt: skip
    shape = Mamba2StateShape.create(intermediate_size=64, n_groups=2, num_heads=4, head_dim=16, state_size=16,
                                    conv_kernel=4, tp_world_size=2)  # fmt: skip
    assert shape.conv == (32 + 2 * 16, 3) and shape.temporal == (2, 16, 16)


@pytest.fixture(scope="module")
def tp1():
    return run_cases(
        0, 1, None, [Case(c.preset, 1, env=c.env, update=c.update, server_args=c.server_args) for c in CASES]
    )


@pytest.fixture(scope="module")
def session():
    return run_ranks(run_session, 2, CASES)


@pytest.fixture(scope="module")
def tp2(session):
    return [[rank["cases"][i] for rank in session] for i in range(len(CASES))]


@pytest.mark.parametrize(
    "i", range(len(CASES)), ids=[f"{c.preset}-ep{c.ep}{'-nextn' if c.server_args else ''}" for c in CASES]
)
def test_tp2_equals_tp1_and_the_oracle(i, tp1, tp2, oracles):
    want, ranks, fp8 = tp1[i], tp2[i], CASES[i].preset.endswith("-fp8")
    for got in ranks:  # every rank samples the same tokens (the logits are gathered whole)
        assert got["ids"] == want["ids"]
        err = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
        assert err < (FP8_TP_TOL if fp8 else TP_TOL), err
    if not fp8:
        oracle = oracles[CASES[i].preset].token_logprobs(want["ids"])
        err = (torch.tensor(ranks[0]["logprobs"], dtype=torch.float64) - oracle.double()).abs().max().item()
        assert err < ORACLE_TOL, err
    # Each rank's pool holds its own heads: half of TP 1's conv channels and SSM heads.
    conv, ssm = want["conv"], want["ssm"]
    assert ranks[0]["conv"] == (conv[0], conv[1], conv[2] // 2, conv[3])
    assert ranks[0]["ssm"] == (ssm[0], ssm[1], ssm[2] // 2, *ssm[3:])
    assert ranks[0]["kv_heads"] == want["kv_heads"] // 2
    if want["w13"] is not None:  # EP 2: half the experts, whole; EP 1: every expert, half its rows
        experts, rows, hidden = want["w13"]
        ep = CASES[i].ep
        assert ranks[0]["w13"] == (experts // ep, rows // (2 // ep), hidden)
    for name, full in want["gathered"].items():
        for got in ranks:
            assert got["gathered"][name] == full, name
    if want["mtp"] is not None:  # NEXTN: the MTP layer's output and full-vocabulary draft logits
        mtp = want["mtp"]
        for got in ranks:
            assert got["mtp"]["gathered"] == mtp["gathered"]  # (the sharded weights reassemble)
            # (its attention and experts reduce across ranks: TP_TOL, as the logprobs above)
            torch.testing.assert_close(torch.tensor(got["mtp"]["stash"]), torch.tensor(mtp["stash"]),
                                       rtol=0, atol=TP_TOL)  # fmt: skip
            torch.testing.assert_close(torch.tensor(got["mtp"]["logits"]), torch.tensor(mtp["logits"]),
                                       rtol=0, atol=TP_TOL)  # fmt: skip
            assert got["mtp"]["greedy"] == mtp["greedy"]
        # (the logits' shape is checked above: the whole vocabulary on each rank, not its half)
        assert ranks[0]["mtp"]["mtp_kv_heads"] == mtp["mtp_kv_heads"] // 2  # its KV split as the model's
        assert ranks[0]["mtp"]["logits"] == ranks[1]["mtp"]["logits"]  # identical drafts on every rank
    if want["updated"]:  # the same new weights, and what they compute (3 decode steps)
        for got in ranks:
            assert got["updated"]["gathered"] == want["updated"]["gathered"]
            new, old = got["updated"]["logprobs"], want["updated"]["logprobs"]
            assert max(abs(a - b) for a, b in zip(new, old, strict=True)) < TP_TOL


def test_refusals_in_one_sentence_and_no_cuda_graphs_over_gloo(session, monkeypatch):
    import sglang.srt.models.qwen3_next as qwen3_next
    from sglang.srt.configs.model_config import load_hf_config
    from sglang.srt.configs.presets import resolve_model_path

    # The tiny presets' 2 linear key heads do not split 4 ways (the GDN layer's check, at TP size 4).
    monkeypatch.setattr(qwen3_next, "get_tensor_model_parallel_world_size", lambda: 4)
    config = load_hf_config(resolve_model_path("tiny-qwen3-next"))
    with pytest.raises(
        ValueError, match="--tp-size 4 does not divide the model's 2 linear-attention key heads"
    ):
        qwen3_next.Qwen3NextGatedDeltaNet(config, 0)
    # --ep-size must divide the experts (here 6 over 4 EP ranks).
    import sglang.srt.layers.moe.experts as experts

    monkeypatch.setattr(experts, "get_moe_expert_parallel_world_size", lambda: 4)
    monkeypatch.setattr(experts, "get_tensor_model_parallel_world_size", lambda: 4)
    with pytest.raises(ValueError, match="--ep-size 4 does not divide the model's 6 experts"):
        experts.RoutedExperts(6, 64, 32, "silu", True)
    # At TP 2 a rank's part of a 128-row FP8 projection is 64 rows: half a scale block.
    assert "--tp-size 2" in session[0]["fp8"] and "128-wide scale blocks" in session[0]["fp8"]
    # CUDA graphs cannot hold gloo's collectives (several ranks on one GPU): the runner turns them off.
    assert session[0]["graphs"] is False
    # FP8 experts at TP 2 / EP 1: each rank's 16 of the experts' 32 intermediate rows, not whole blocks.
    assert "--tp-size 2" in session[0]["fp8_experts"] and "16 of 32" in session[0]["fp8_experts"]
