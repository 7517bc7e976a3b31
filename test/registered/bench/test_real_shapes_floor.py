"""The real-shape benchmark's floor model (`benchmark/gpu/real_shapes.py`), by hand-computed cases: the
experts a batch touches, the bytes a decode step must move, their scaling to the full model's depth, the
roles of a checkpoint's tensors, the prefill FLOPs per token and the device table. Pure functions: the
GPU run divides its measurements by these."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "gpu"))
import real_shapes as rs  # noqa: E402


def test_experts_touched_by_hand():
    # E = 4, k = 2: each expert is missed by one token with chance 1/2, by two with 1/4: 4 * 3/4 = 3.
    assert rs.experts_touched(4, 2, 2) == pytest.approx(3.0)
    # One token touches exactly its k; many touch all E.
    assert rs.experts_touched(512, 10, 1) == pytest.approx(10.0)
    assert rs.experts_touched(512, 10, 4096) == pytest.approx(512.0)
    # Qwen3-Next-80B at batch 64 and 256 (the facts file's ~366 and ~508 per layer).
    assert rs.experts_touched(512, 10, 64) == pytest.approx(367.1, abs=0.1)
    assert rs.experts_touched(512, 10, 256) == pytest.approx(508.7, abs=0.1)


MODEL = rs.StepModel(
    dense=100, lm_head=50, expert_bytes=10, moe_layers=2, num_experts=4, top_k=2,
    state_per_req=7, kv_per_token=3, layers=4,
)  # fmt: skip


def test_decode_floor_bytes_by_hand():
    parts = rs.decode_floor_bytes(MODEL, batch=2, context=5)
    assert parts["weights"] == 150  # dense + lm_head
    assert parts["experts"] == pytest.approx(3.0 * 10 * 2)  # 3 experts touched x 10 bytes x 2 layers
    assert parts["state"] == 2 * 7 * 2  # read and written, 2 requests
    assert parts["kv"] == 3 * 5 * 2  # 5 tokens of context, 2 requests
    assert parts["total"] == pytest.approx(150 + 60 + 28 + 30)
    # A dense model (no MoE layers) moves no expert bytes whatever its expert count says.
    dense = rs.decode_floor_bytes(rs.StepModel(100, 50, 0, 0, 0, 0, 7, 3, 4), batch=2, context=5)
    assert dense["experts"] == 0 and dense["total"] == pytest.approx(150 + 28 + 30)


def test_scaled_to_full_depth_keeps_the_lm_head_once():
    full = MODEL.scaled_to(12)  # x 3
    assert (full.dense, full.lm_head, full.moe_layers, full.state_per_req, full.kv_per_token) == (
        300, 50, 6, 21, 9
    )
    assert (full.expert_bytes, full.num_experts, full.top_k, full.layers) == (10, 4, 2, 12)


def test_weight_roles_and_the_safetensors_headers(tmp_path):
    tensors = {
        "model.embed_tokens.weight": torch.zeros(10, 4),  # 40
        "lm_head.weight": torch.zeros(10, 4),  # 40
        "model.norm.weight": torch.zeros(4),  # 4
        "model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(3, 4),  # 12, per-expert names
        "model.layers.0.mlp.experts.1.up_proj.weight": torch.zeros(3, 4),  # 12
        "model.layers.0.mlp.shared_expert.up_proj.weight": torch.zeros(3, 4),  # 12: dense
        "model.layers.0.mlp.gate.weight": torch.zeros(2, 4),  # 8: dense
        "model.layers.1.mlp.experts.gate_up_proj": torch.zeros(2, 6, 4),  # 48, fused
        "backbone.layers.2.mixer.in_proj.weight": torch.zeros(5, 4),  # 20: Nemotron-H's names
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    numels = rs.checkpoint_numels(tmp_path)
    assert numels == {k: v.numel() for k, v in tensors.items()}
    w = rs.weight_bytes(numels, itemsize=2)
    assert (w.embed, w.lm_head, w.other) == (80, 80, 8)
    assert w.expert_layers == {0: 48, 1: 96}
    assert w.dense_layers == {0: 40, 2: 40}
    assert w.total() == 2 * sum(numels.values())
    nemotron = rs.weight_bytes({"backbone.embeddings.weight": 6}, itemsize=2)
    assert nemotron.embed == 12


def test_prefill_flops_per_token_by_hand():
    fields = dict(
        dense_params=1000, expert_params=10, top_k=2, moe_layers=3, attn_layers=1, q_heads=2, head_dim=4,
        linear_layers=2, linear_heads=3, dk=4, dv=5, chunk=8,
    )  # fmt: skip
    matmul = 2 * (1000 + 3 * 2 * 10)  # 2120
    attn = 1 * 4 * 2 * 4 * (9 + 1) / 2  # 9 tokens: mean causal context 5 -> 160
    lin = 2 * 3 * (4 * 4 * 5 + 2 * 8 * (4 + 5))  # 2 * 3 * (80 + 144) = 1344
    assert rs.prefill_flops_per_token(fields, 9) == pytest.approx(matmul + attn + lin)


def test_device_peaks_by_name():
    assert rs.device_peaks("NVIDIA H200") == (4.8e12, 989e12)
    assert rs.device_peaks("NVIDIA H100 80GB HBM3") == (3.35e12, 989e12)
    assert rs.device_peaks("NVIDIA H100 PCIe") == (2.0e12, 756e12)
    assert rs.device_peaks("Tesla T4") is None


def test_strategy_rounds_rotate_the_start_order():
    """bench_serving_strategies.py: round r starts the strategies from position r, so each goes first once
    in as many rounds as there are strategies."""
    import bench_serving_strategies as bss

    s = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]
    assert [bss.rotated(s, r)[0] for r in range(3)] == s
    assert bss.rotated(s, 1) == ["extra_buffer", "extra_buffer_lazy", "no_buffer"]
    assert bss.rotated(s, 4) == bss.rotated(s, 1)


def _kinds(config) -> dict[str, int]:
    kinds = getattr(config, "layers_block_type", None) or config.layer_types
    return {k: kinds.count(k) for k in set(kinds)}


@pytest.mark.parametrize("name", list(rs.SLICES))
def test_each_slice_keeps_the_full_models_layer_kinds_in_proportion(name):
    """The extrapolation's premise: every layer kind of the published model appears in the slice, and each
    kind's count times full / slice layers is the full model's count (the published layer lists)."""
    spec = rs.SLICES[name]
    full_cfg = rs.published_config(name)
    full_cfg = full_cfg.get("text_config", full_cfg)
    if "hybrid_override_pattern" in full_cfg:
        pattern = full_cfg["hybrid_override_pattern"]
        full = {"linear_attention": pattern.count("M"), "full_attention": pattern.count("*"),
                "mlp": pattern.count("-")}  # fmt: skip
        assert len(pattern) == full_cfg["num_hidden_layers"]
    else:
        full = {k: full_cfg["layer_types"].count(k) for k in set(full_cfg["layer_types"])}
        assert len(full_cfg["layer_types"]) == full_cfg["num_hidden_layers"]
    assert sum(full.values()) == spec.full_layers
    cut = _kinds(rs.slice_config(name))
    assert sum(cut.values()) == spec.slice_layers
    assert {k: v * spec.full_layers / spec.slice_layers for k, v in cut.items()} == full


def test_the_decode_extrapolation_counts_the_fixed_part_once():
    """bench_real_shapes' full-model decode: the step without layers (the fixed part: host work,
    embedding, lm_head, sampling, the sync) once, the per-layer part at full depth; and `without_layers`
    takes the decoder's layers out (graphs captured again) and puts them back (captured once more)."""
    import bench_real_shapes as brs

    # A 4-layer slice of a 48-layer model: 10 ms with layers, 2 ms without: 2 + 8 / 4 x 48 = 98 ms
    # (scaling the whole step, 10 / 4 x 48 = 120 ms, counts the 2 ms 12 times).
    assert brs.full_decode_ms(10.0, 2.0, 4, 48) == pytest.approx(98.0)
    layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(4))
    decoder = torch.nn.Module()
    decoder.layers, decoder.other = layers, torch.nn.ModuleList([torch.nn.Identity()])
    recaptured, released = [], []
    graphs = type("Graphs", (), {
        "recapture": lambda self: recaptured.append(len(decoder.layers)),
        "release": lambda self: released.append(len(decoder.layers)),
    })()  # fmt: skip
    runner = type("Runner", (), {"model": torch.nn.Sequential(decoder), "graph_runner": graphs})()
    with brs.without_layers(runner, 4):
        assert len(decoder.layers) == 0 and len(decoder.other) == 1
    assert decoder.layers is layers and recaptured == [0, 4] and not released
    # Without the capture after (the bench's prefills follow): the graphs are freed, the runner decodes
    # without them.
    with brs.without_layers(runner, 4, recapture_after=False):
        assert len(decoder.layers) == 0
    assert decoder.layers is layers and recaptured == [0, 4, 0] and released == [4]
    assert runner.graph_runner is None
