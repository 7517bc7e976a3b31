"""NEXTN / EAGLE on an FP8 checkpoint (issue 57): the MTP layer loads through the model's FP8 path.
tiny-qwen3-next-fp8 carries its MTP layer as Qwen's FP8 releases do (`quantize_fp8`: the attention,
shared expert and per-expert weights float8 with block scales, `mtp.fc` and the norms and gates dense).
On the CPU every FP8 tensor is dequantized at load (its parameters equal the checkpoint's dequantized
tensors exactly: the same float32 product); CUDA's layout, built here on the CPU, holds the checkpoint's
FP8 bytes and scales as they are. A weight update of `mtp.*` follows the model's FP8 rules. Greedy
outputs against plain decoding: test_mtp_fp8_nightly.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sglang.srt.layers.quantization.fp8 import SCALE_SUFFIX, Fp8Layout, dequantize_block_fp8
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

FP8 = "tiny-qwen3-next-fp8"
NEXTN = dict(speculative_algorithm="NEXTN")
Q = "mtp.layers.0.self_attn.q_proj.weight"


def _load(layout: Fp8Layout | None = None):
    from sglang.srt.models.registry import load_model
    from sglang.srt.speculative.draft_layers import load_draft_layers

    args = ServerArgs(model_path=FP8, dtype="float32", **NEXTN)
    config = args.model_config
    model = load_model(config.hf_config, config.path, torch.float32, "cpu", layout)
    return model, load_draft_layers(args, model), load_file(f"{config.path}/model.safetensors")


@pytest.fixture(scope="module")
def cpu_layout():
    return _load()


def _pairs(ckpt: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: (t, ckpt[n + SCALE_SUFFIX]) for n, t in ckpt.items() if n + SCALE_SUFFIX in ckpt}


def test_the_checkpoint_stores_the_mtp_layer_as_the_releases(cpu_layout):
    _, _, ckpt = cpu_layout
    fp8 = {n for n in _pairs(ckpt) if n.startswith("mtp.")}
    assert Q in fp8 and "mtp.layers.0.mlp.experts.0.gate_proj.weight" in fp8
    assert "mtp.layers.0.mlp.shared_expert.down_proj.weight" in fp8
    assert ckpt["mtp.fc.weight"].dtype == torch.float32 and "mtp.fc.weight" not in fp8


def test_cpu_mtp_weights_equal_the_checkpoints_dequantized_tensors(cpu_layout):
    _, draft, ckpt = cpu_layout
    params = dict(draft.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())  # (dequantized at load)
    inter = draft.layers[0].mlp.experts.w2.shape[-1]
    checked = 0
    for name, (w, s) in _pairs(ckpt).items():
        if not name.startswith("mtp."):
            continue
        want = dequantize_block_fp8(w, s)
        ours = name.removeprefix("mtp.")
        if ".experts." in ours:
            module, e, proj = ours.removesuffix(".weight").rsplit(".", 2)
            e = int(e)
            if proj == "down_proj":
                got = params[f"{module}.w2"][e]
            else:
                rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                got = params[f"{module}.w13"][e][rows]
        else:
            got = params[ours]
        assert torch.equal(got, want), name
        checked += 1
    assert checked == 7 + 3 * draft.layers[0].mlp.experts.global_num_experts
    assert torch.equal(params["fc.weight"], ckpt["mtp.fc.weight"])


def test_cuda_layout_keeps_the_checkpoints_fp8_bytes():
    """FP8 linears and experts (CUDA's layout, built on the CPU): the MTP layer's FP8 linears hold the
    checkpoint's bytes and scales as they are, `fc` stays dense; the memory planner's meta layer has the
    same parameters byte for byte."""
    from sglang.srt.speculative.draft_layers import build_meta_draft_layers

    model, draft, ckpt = _load(Fp8Layout(linears=True, experts=True))
    params = dict(draft.named_parameters())
    for name, (w, s) in _pairs(ckpt).items():
        ours = name.removeprefix("mtp.")
        if name.startswith("mtp.") and ours in params:
            assert torch.equal(params[ours].view(torch.uint8), w.view(torch.uint8)), name
            assert torch.equal(params[ours + SCALE_SUFFIX], s), name
    assert params["layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert params["layers.0.mlp.experts.w2"].dtype == torch.float8_e4m3fn
    assert params["fc.weight"].dtype == torch.float32
    # (the experts' w2: one down_proj per expert, each one whole block; their bytes are the checkpoint's)
    w2 = torch.stack(
        [
            ckpt[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"]
            for e in range(len(params["layers.0.mlp.experts.w2"]))
        ]
    )
    assert torch.equal(params["layers.0.mlp.experts.w2"].view(torch.uint8), w2.view(torch.uint8))
    meta = {n: (p.shape, p.dtype) for n, p in build_meta_draft_layers(model).named_parameters()}
    assert meta == {n: (p.shape, p.dtype) for n, p in params.items()}
    # Without the checkpoint's files (planning from a config alone) its modules_to_not_convert decides:
    # the same layout for a well-formed export.
    from sglang.srt.models.qwen3_next_mtp import build_mtp

    listed = {n: (p.shape, p.dtype) for n, p in build_mtp(model, path="/nonexistent").named_parameters()}
    assert listed == meta


def test_mtp_weight_updates_follow_the_fp8_rules(cpu_layout):
    """An FP8 pair for the MTP layer writes its dequantized value (as the model's own pairs do on the CPU);
    a weight without its scale is refused with nothing written."""
    from sglang.srt.speculative.draft_layers import draft_update

    model, draft, ckpt = cpu_layout
    w, s = ckpt[Q], ckpt[Q + SCALE_SUFFIX]
    before = draft.layers[0].self_attn.q_proj.weight.detach().clone()
    rest, copy, unused = draft_update(model, draft, [(Q, w), (Q + SCALE_SUFFIX, s * 2)], None)
    assert rest == [] and unused == []
    copy()
    assert torch.equal(draft.layers[0].self_attn.q_proj.weight, dequantize_block_fp8(w, s * 2))
    with pytest.raises(ValueError, match="no matching scale"):
        draft_update(model, draft, [(Q, w)], None)
    assert torch.equal(draft.layers[0].self_attn.q_proj.weight, dequantize_block_fp8(w, s * 2))
    _, copy, _ = draft_update(model, draft, [(Q, w), (Q + SCALE_SUFFIX, s)], None)
    copy()
    assert torch.equal(draft.layers[0].self_attn.q_proj.weight, before)


def test_online_fp8_quantizes_the_mtp_layer_as_the_model_but_fc():
    """`--quantization fp8` on an unquantized checkpoint: the MTP layer's quantizable weights serve their
    FP8-grid values (as the model's do), `fc` its checkpoint value (upstream's draft keeps it dense)."""
    from sglang.srt.layers.quantization.fp8 import quantize_block_fp8
    from sglang.srt.models.registry import load_model
    from sglang.srt.speculative.draft_layers import load_draft_layers

    args = ServerArgs(model_path="tiny-qwen3-next", dtype="float32", quantization="fp8", **NEXTN)
    config = args.model_config
    model = load_model(config.hf_config, config.path, torch.float32, "cpu")
    draft = load_draft_layers(args, model)
    ckpt = load_file(f"{config.path}/model.safetensors")
    on_grid = dequantize_block_fp8(*quantize_block_fp8(ckpt[Q]))
    assert not torch.equal(on_grid, ckpt[Q])
    assert torch.equal(draft.layers[0].self_attn.q_proj.weight, on_grid)
    assert torch.equal(draft.fc.weight, ckpt["mtp.fc.weight"])


def test_a_checkpoint_keeping_the_mtp_layer_dense_loads_it_dense(cpu_layout, tmp_path):
    """The FP8 preset with its `mtp.*` pairs replaced by their dequantized values and its config's list
    unchanged (as exports that keep the draft bf16 without listing it): in CUDA's layout the MTP layer has
    no FP8 module and serves those tensors exactly (the file decides, as for the model:
    `registry.fp8_dense_modules`); before, its FP8 modules requantized them at load."""
    import shutil

    from safetensors.torch import save_file

    from sglang.srt.configs.model_config import load_hf_config
    from sglang.srt.models.registry import load_model
    from sglang.srt.speculative.draft_layers import build_meta_draft_layers, load_draft_layers_from

    _, _, ckpt = cpu_layout
    src = ServerArgs(model_path=FP8).model_config.path
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    tensors = dict(ckpt)
    for name, (w, s) in _pairs(ckpt).items():
        if name.startswith("mtp."):
            tensors[name] = dequantize_block_fp8(w, s)
            del tensors[name + SCALE_SUFFIX]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = load_hf_config(str(tmp_path))
    model = load_model(cfg, str(tmp_path), torch.float32, "cpu", Fp8Layout(linears=True, experts=True))
    draft = load_draft_layers_from(str(tmp_path), model)
    params = dict(draft.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    assert torch.equal(params["layers.0.self_attn.q_proj.weight"], tensors[Q])
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())  # (the model stays FP8)
    meta = build_meta_draft_layers(model)  # (the planner: the folder the config was read from)
    assert {n: p.dtype for n, p in meta.named_parameters()} == {n: p.dtype for n, p in params.items()}


@pytest.mark.parametrize(
    "model_path, quantization",
    [(FP8, None), ("tiny-qwen3-next", "fp8"), ("tiny-qwen3-next", None)],
    ids=["block-fp8", "online-fp8", "dense"],
)
def test_the_planner_counts_the_mtp_layer_as_it_loads(model_path, quantization):
    """In CUDA's layout (built on the CPU) and bfloat16, the bytes the memory planner adds for the MTP
    layer are the loaded layer's, byte for byte, and its FP8 / dense weight counts are the layer's (before,
    every draft parameter counted at bfloat16 and as dense: FP8 weights twice, their float32 scales half,
    161,646 planned against 90,012 loaded for the FP8 preset)."""
    from sglang.srt.mem_cache.weight_bytes import weight_bytes_of
    from sglang.srt.models.registry import build_meta_model, load_model
    from sglang.srt.speculative.draft_layers import load_draft_layers

    layout = Fp8Layout(linears=True, experts=True)
    args = ServerArgs(model_path=model_path, dtype="bfloat16", quantization=quantization, **NEXTN)
    config = args.model_config
    meta = build_meta_model(config.hf_config, "cpu", layout)
    without, with_draft = (weight_bytes_of(meta, torch.bfloat16, d) for d in (False, True))
    model = load_model(config.hf_config, config.path, torch.bfloat16, "cpu", layout)
    params = list(load_draft_layers(args, model).named_parameters())
    fp8 = sum(p.numel() for _, p in params if p.dtype == torch.float8_e4m3fn)
    dense = sum(p.numel() for n, p in params if p.dtype != torch.float8_e4m3fn and not n.endswith(SCALE_SUFFIX))
    assert (fp8 > 0) == (model_path == FP8 or quantization == "fp8")
    assert with_draft.total - without.total == sum(p.numel() * p.element_size() for _, p in params)
    assert with_draft.fp8_params - without.fp8_params == fp8
    assert with_draft.dense_params - without.dense_params == dense
