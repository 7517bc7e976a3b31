"""NEXTN on an FP8 checkpoint (tiny-qwen3-next-fp8, the MTP layer dequantized at load on the CPU;
the per-commit file is test_mtp_fp8.py): the FP8 MTP layer's own drafts (no teacher) leave the committed
tokens plain decoding's on the same checkpoint; a ModelOpt FP8 checkpoint's MTP layer loads its values,
bytes and KV cache scales. Nightly: two scheduler runs and a checkpoint written, ~10 s (more under load)."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=15, suite="nightly-cpu")

FP8 = "tiny-qwen3-next-fp8"
NEXTN = dict(speculative_algorithm="NEXTN")


def test_nextn_greedy_equals_plain_decoding_on_fp8():
    """The FP8 MTP layer's own drafts (no teacher): the committed tokens are plain decoding's."""
    outs = []
    for spec in ({}, NEXTN):
        h = SchedulerHarness(FP8, disable_overlap_schedule=True, **spec)
        try:
            rids = [
                h.submit(token_ids(40 + 11 * k, seed=k), max_new_tokens=12, return_logprob=False)
                for k in range(2)
            ]
            h.run()
            outs.append([h.outputs[r].output_ids for r in rids])
            if spec:
                stats = dict(h.sched.spec.stats)
            h.flush_and_check_empty()
        finally:
            h.shutdown()
    assert outs[0] == outs[1]
    assert stats["verify_steps"] > 0, stats


def test_a_modelopt_fp8_checkpoints_mtp_layer(tmp_path):
    """tiny-qwen3-next in NVIDIA ModelOpt's FP8 format (one scale per tensor, `weight_scale`, static
    `input_scale`s left out, calibrated `k_scale` / `v_scale` on k_proj / v_proj) with its MTP layer: on the
    CPU and in CUDA's layout the MTP projections serve weight * weight_scale exactly (the CUDA layout
    keeps the checkpoint's bytes), and the MTP attention takes its KV cache scales (before, ignored)."""
    import torch
    from safetensors.torch import load_file, save_file

    from sglang.srt.configs.model_config import load_hf_config
    from sglang.srt.layers.quantization.fp8 import Fp8Layout
    from sglang.srt.models.checkpoint_reader import read_checkpoint
    from sglang.srt.models.qwen3_next_mtp import load_mtp
    from sglang.srt.models.registry import load_model
    from sglang.tools.make_tiny_model import make_tiny_model

    make_tiny_model("qwen3_next", tmp_path, seed=3, quantize="fp8-modelopt")
    ckpt = load_file(tmp_path / "model.safetensors")
    base = "mtp.layers.0.self_attn"
    # (the tool calibrates on the transformers model, which has no MTP layer: its scales are 1; set others)
    ckpt[f"{base}.k_proj.k_scale"], ckpt[f"{base}.v_proj.v_scale"] = torch.tensor(0.5), torch.tensor(0.25)
    save_file(ckpt, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = load_hf_config(str(tmp_path))
    for layout in (None, Fp8Layout(linears=True, experts=True)):
        model = load_model(cfg, str(tmp_path), torch.float32, "cpu", layout)
        mtp = load_mtp(model, read_checkpoint(str(tmp_path), prefix="mtp."))
        attn = mtp.layers[0].self_attn
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w, s = ckpt[f"{base}.{proj}.weight"], ckpt[f"{base}.{proj}.weight_scale"]
            linear = getattr(attn, proj)
            if layout is None:
                assert torch.equal(linear.weight, w.float() * s.float()), proj
            else:
                assert torch.equal(linear.weight.view(torch.uint8), w.view(torch.uint8)), proj
                assert torch.equal(linear.dequantized_weight(torch.float32), w.float() * s.float()), proj
        assert (attn.attn.k_scale, attn.attn.v_scale) == (0.5, 0.25)
