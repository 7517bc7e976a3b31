"""The 16-bit routed experts as fused Triton grouped GEMMs (layers/moe/fused_moe_triton.py,
SGLANG_GPU_MOE_BACKEND=triton_fused): under `TRITON_INTERPRET=1` on tiny shapes against the torch path
(`RoutedExperts.forward_device` with the padded block), with batch 1, experts left empty, other EP ranks'
assignments (id E); the layer's seam that picks them; the tuned-tile files'
lookup (`moe_configs.py`); on a GPU, Qwen3-Next-80B's experts against `torch._grouped_mm`. Their sm_90
compile checks and other activations are in test_fused_moe_triton_nightly.py (each compile takes seconds).

The interpreter runs float16, not bfloat16: Triton 3.9's interpreter computes bfloat16 `tl.dot` from the
raw bits (outputs ~1e10 where float16 and float32 agree with torch to rounding); compiled, the same kernel
serves both (the GPU test runs bfloat16)."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from torch import nn

from sglang.srt.environ import envs
from sglang.srt.layers.moe import fused_moe_triton as ft
from sglang.srt.layers.moe import moe_configs as mc
from sglang.srt.layers.moe.fused_moe_fp8_triton import MoeGemmConfig
from sglang.test.ci_register import register_cpu_ci
from sglang.test.moe_checks import TOL_FP16, assert_close_to, check_layer_runs_fused, make_layer, routing

register_cpu_ci(est_time=7, suite="per-commit-cpu")


# Per commit: batch 1 and a batch leaving experts empty; the nightly file adds non-silu activations.
LAYER_CASES = [(1, 2, 4, "silu", True), (9, 3, 8, "silu", True), (5, 2, 4, "relu2", False)]


@pytest.mark.parametrize("tokens,top_k,e,act,gated", LAYER_CASES, ids=["batch1", "empty-experts", "plain-relu2"])
def test_layer_runs_the_fused_gemms_and_agrees_with_torch(
    interpret, monkeypatch, tokens, top_k, e, act, gated
):
    """With SGLANG_GPU_MOE_BACKEND=triton_fused the layer's forward runs `fused_experts` (gated silu:
    the activation in w13's epilogue; otherwise the layer's activation between the GEMMs) and equals
    forward_device's padded block within TOL_FP16."""
    check_layer_runs_fused(monkeypatch, tokens, top_k, e, act, gated)


def test_other_ep_ranks_assignments_and_tuned_tiles(interpret):
    """Assignments with id E (another EP rank's, weight 0) compute no row and add nothing; a table's
    tiles of another height per GEMM (w13 16 rows, w2 32: two tile maps) give the same result."""
    layer = make_layer(5, 64, 32, "silu", True)
    weights, ids = routing(6, 3, 5, seed=4)
    ids[::2, 1] = 5
    weights[::2, 1] = 0.0
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5)).half()
    want = layer.forward_device(x, weights, ids, grouped=False)
    table = {6: (MoeGemmConfig(16, 32, 32, 4, 2), MoeGemmConfig(32, 64, 16, 4, 2))}
    for tiles in (None, table):
        got = ft.fused_experts(x, layer.w13, layer.w2, weights, ids, layer._activate, True, tiles)
        assert_close_to(got, want, TOL_FP16)


@pytest.mark.parametrize("masked", [False, True], ids=["one-rank", "expert-parallel"])
def test_the_shared_expert_runs_as_one_more_expert(interpret, monkeypatch, masked):
    """Qwen3-Next's form: a gated silu shared expert of the experts' width with a sigmoid gate, fused at
    load as expert E of stacks that the parameters become views of (a weight update in place reaches
    the kernels): the layer's output equals the routed experts' torch path plus sigmoid(gate) x the
    shared MLP, within TOL_FP16. Under expert parallelism (half the experts here, the rest another
    rank's: id E after the local assignments) those assignments stay uncomputed past the shared
    expert. The stacks' tiles are the tuned file's of E + 1 experts (what the GEMMs run over, as
    tune_fused_moe.py names them), the routed experts' alone those of E."""
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.layers.mlp import GatedMLP

    e, hidden, inter = 4, 64, 32
    layer = make_layer(e, hidden, inter, "silu", True)
    if masked:
        layer.global_num_experts = 2 * e  # this rank holds experts 0..3 of 8
    g = torch.Generator().manual_seed(7)
    mlp = GatedMLP(hidden, inter, "silu", reduce_results=False).half()
    gate = ReplicatedLinear(hidden, 1, bias=False).half()
    for p in (*mlp.parameters(), *gate.parameters()):
        p.data = (torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5).half()
    old = {t.untyped_storage().data_ptr() for t in (layer.w13, layer.w2, *mlp.parameters())}
    tuned = {5: (MoeGemmConfig(16, 32, 32, 4, 2), MoeGemmConfig(32, 64, 16, 4, 2))}
    monkeypatch.setattr(ft, "tuned_table", lambda experts, *shape: tuned if experts == e + 1 else None)
    with envs.SGLANG_GPU_MOE_BACKEND.override("triton_fused"), envs.SGLANG_CPU_MOE_BACKEND.override("torch"):
        layer.fuse_shared_expert(mlp, gate)
    stack13, stack2 = layer.fused_gemms.stack
    assert stack13.shape == (e + 1, 2 * inter, hidden) and stack2.shape == (e + 1, hidden, inter)
    assert mlp.up_proj.weight.data_ptr() == stack13[e, inter:].data_ptr()
    assert layer.w2.data_ptr() == stack2.data_ptr()
    assert layer.fused_gemms.table == {} and layer.fused_gemms.stack_table == tuned
    # One copy stays: no live tensor holds the storages the weights had before the stacking.
    gc.collect()
    tensors = [o for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter)]
    live = {t.untyped_storage().data_ptr() for t in tensors}
    assert not old & live
    weights, ids = routing(5, 2, layer.global_num_experts, seed=8)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(9)).half()
    mlp.down_proj.weight.data.mul_(2)  # an in-place update after the fusion

    def want():
        w, i = layer._local_assignments(weights, ids) if masked else (weights, ids)
        shared = mlp(x).float() * torch.sigmoid(gate(x).float())
        return layer.forward_device(x, w, i, grouped=False).float() + shared

    tables, real = [], ft.fused_experts
    monkeypatch.setattr(ft, "fused_experts", lambda *a: tables.append(a[7]) or real(*a))
    assert_close_to(layer(x, weights, ids, mlp, gate), want(), TOL_FP16)
    assert tables == [tuned]


def test_auto_runs_the_fused_gemms_for_decode_batches_only(interpret, monkeypatch):
    """SGLANG_GPU_MOE_BACKEND=auto on CUDA (here: the Triton choice made as on CUDA, the kernels
    interpreted) runs batches of up to FUSED_AUTO_MAX_TOKENS tokens through the fused GEMMs (an H200
    measured them faster there) and larger ones through the grouped_mm path (faster at prefill chunks),
    as triton does on any device; triton_fused runs every batch fused, triton_grouped none. Both paths
    agree within TOL_FP16."""
    from sglang.srt.layers.moe import experts as ex

    monkeypatch.setattr(ex, "triton_chosen", lambda choice, *a, **k: choice.get() != "torch")
    monkeypatch.setattr(ex, "FUSED_AUTO_MAX_TOKENS", 4)
    calls, real = [], ft.fused_experts
    monkeypatch.setattr(ft, "fused_experts", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    cases = (("auto", [3, 4]), ("triton", [3, 4]), ("triton_fused", [3, 4, 5]), ("triton_grouped", []))
    for backend, fused_sizes in cases:
        layer, calls[:] = make_layer(4, 64, 32, "silu", True), []
        with envs.SGLANG_GPU_MOE_BACKEND.override(backend), envs.SGLANG_CPU_MOE_BACKEND.override("torch"):
            layer.process_weights_after_loading()
            for tokens in (3, 4, 5):
                weights, ids = routing(tokens, 2, 4, seed=tokens)
                x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).half()
                assert_close_to(layer(x, weights, ids), layer.forward_device(x, weights, ids, grouped=False), TOL_FP16)
        assert calls == fused_sizes, backend


def test_no_fused_gemms_where_they_would_not_run(interpret, ops):
    """SGLANG_GPU_MOE_BACKEND=triton_fused builds the fused GEMMs (and stacks the shared expert) only for
    16-bit experts the C++ op does not serve: a float32 layer on CPU keeps the C++ op's transposed storage
    and runs its shared expert inside the op (the stack's copy replaced that storage: "w13t and w2t must
    be contiguous" at the first forward); float32 without the op builds nothing either."""
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.layers.mlp import GatedMLP

    for cpu_backend in ("cpp", "torch"):
        layer = make_layer(4, 64, 32, "silu", True, torch.float32)
        g = torch.Generator().manual_seed(7)
        mlp, gate = GatedMLP(64, 32, "silu", reduce_results=False), ReplicatedLinear(64, 1, bias=False)
        for p in (*mlp.parameters(), *gate.parameters()):
            p.data = torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5
        gpu_backend = envs.SGLANG_GPU_MOE_BACKEND.override("triton_fused")
        with gpu_backend, envs.SGLANG_CPU_MOE_BACKEND.override(cpu_backend):
            layer.fuse_shared_expert(mlp, gate)
            assert layer.fused_gemms is None
            assert (layer.cpu_ops is not None) == (cpu_backend == "cpp")
            assert (layer.fused_shared is not None) == (cpu_backend == "cpp")
            weights, ids = routing(3, 2, 4, seed=8)
            x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
            want = layer.forward_device(x, weights, ids, grouped=False) + mlp(x) * torch.sigmoid(gate(x))
            # Float32 throughout: the C++ op sums in another order (1e-5 of outputs of O(1)).
            torch.testing.assert_close(layer(x, weights, ids, mlp, gate), want, rtol=1e-5, atol=1e-5)


def test_tuned_tiles_are_looked_up_by_shape_and_gpu(tmp_path):
    """A file named for (E, N, K, dtype, GPU) is read; the nearest batch size's entry serves (the
    smaller on a tie) up to twice the largest; another shape, dtype or GPU has none (the fallback by mean
    rows serves); a malformed file is one error naming it."""
    table = {1: (MoeGemmConfig(16, 64, 128, 4, 3), MoeGemmConfig(16, 32, 64, 4, 4)),
             64: (MoeGemmConfig(32, 64, 128, 4, 3), MoeGemmConfig(32, 128, 64, 8, 3))}  # fmt: skip
    name = mc.config_file_name(512, 512, 2048, torch.bfloat16, "NVIDIA_H200")
    assert name == "E=512,N=512,K=2048,device_name=NVIDIA_H200,dtype=bf16.json"
    (tmp_path / name).write_text(mc.table_to_json(table))
    found = mc.tuned_table(512, 512, 2048, torch.bfloat16, "NVIDIA_H200", str(tmp_path))
    assert found == table
    assert mc.pick_configs(found, 8, 80, 512) == table[1]
    assert mc.pick_configs(found, 33, 330, 512) == table[64]
    assert mc.pick_configs(found, 128, 1280, 512) == table[64]
    # Over twice the largest tuned batch (prefill): the fallback by mean rows, not batch 64's tiles.
    assert mc.pick_configs(found, 8192, 81920, 512) == (mc.FALLBACK_CONFIGS[-1][1],) * 2
    others = [(512, 512, 2048, torch.float16, "NVIDIA_H200"), (512, 512, 2048, torch.bfloat16, "NVIDIA_H100"),
              (256, 512, 2048, torch.bfloat16, "NVIDIA_H200")]  # fmt: skip
    for other in others:
        assert mc.tuned_table(*other, str(tmp_path)) is None
    assert mc.pick_configs(None, 1, 10, 512) == (mc.FALLBACK_CONFIGS[0][1],) * 2
    assert mc.pick_configs(None, 8192, 81920, 512) == (mc.FALLBACK_CONFIGS[-1][1],) * 2
    bad = mc.config_file_name(4, 8, 16, torch.bfloat16, "X")
    (tmp_path / bad).write_text(json.dumps({"1": {"w13": {"BLOCK_SIZE_M": 16}}}))
    with pytest.raises(ValueError, match="is not a fused-MoE config file"):
        mc.tuned_table(4, 8, 16, torch.bfloat16, "X", str(tmp_path))


def test_committed_config_files_parse():
    """Every file in configs/ is named as the lookup spells names and parses (tiles of powers of two)."""
    for path in mc.CONFIG_DIR.glob("*.json"):
        assert path.name.startswith("E=") and ",device_name=" in path.name, path.name
        for cfgs in mc.parse_table(path.read_text(), str(path)).values():
            for cfg in cfgs:
                assert all(v & (v - 1) == 0 for v in (cfg.block_m, cfg.block_n, cfg.block_k)), (
                    path.name,
                    cfg,
                )


def test_a_bad_backend_value_is_one_sentence():
    layer = make_layer(2, 16, 16, "silu", True)
    with envs.SGLANG_GPU_MOE_BACKEND.override("fused"), pytest.raises(ValueError) as err:
        layer.process_weights_after_loading()
    assert (
        str(err.value)
        == "SGLANG_GPU_MOE_BACKEND must be one of auto, torch, triton, triton_fused, triton_grouped; got 'fused'."
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 64, 256, 1024])
def test_gpu_experts_at_the_80b_shapes(tokens):
    """Qwen3-Next-80B's experts (512, top 10, hidden 2,048, width 512) in bfloat16, compiled, against the
    grouped_mm path, and run to run bit for bit (the combine's fixed order). Each path rounds w2's input
    to bf16 from float32 sums taken in other orders (the torch path also rounds h first): one bf16 step
    (2^-8) on some of 512 terms, then the output's own rounding (2^-8); 2^-6 of the outputs' scale holds
    a few such and is far below a wrong expert, row or weight (O(1))."""
    layer = make_layer(512, 2048, 512, "silu", True, torch.bfloat16, "cuda")
    weights, ids = routing(tokens, 10, 512, seed=tokens, device="cuda")
    x = torch.randn(tokens, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16()
    got = ft.fused_experts(x, layer.w13, layer.w2, weights, ids, layer._activate, True)
    assert torch.equal(got, ft.fused_experts(x, layer.w13, layer.w2, weights, ids, layer._activate, True))
    assert_close_to(got, layer.forward_device(x, weights, ids, grouped=True), 2**-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 64])
def test_gpu_layer_with_its_shared_expert_at_the_80b_shapes(tokens):
    """Qwen3-Next-80B's MoE layer through `RoutedExperts` with SGLANG_GPU_MOE_BACKEND=triton_fused: the
    shared expert (512 wide, sigmoid gate) stacked as expert 512, against the grouped_mm path plus the
    shared MLP apart, within the bound of test_gpu_experts_at_the_80b_shapes (2^-6 of the outputs)."""
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.layers.mlp import GatedMLP

    layer = make_layer(512, 2048, 512, "silu", True, torch.bfloat16, "cuda")
    mlp = GatedMLP(2048, 512, "silu", reduce_results=False).to("cuda", torch.bfloat16)
    gate = ReplicatedLinear(2048, 1, bias=False).to("cuda", torch.bfloat16)
    g = torch.Generator("cuda").manual_seed(1)
    for p in (*mlp.parameters(), *gate.parameters()):
        p.data = (torch.randn(p.shape, device="cuda", generator=g) / p.shape[1] ** 0.5).bfloat16()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    with envs.SGLANG_GPU_MOE_BACKEND.override("triton_fused"):
        layer.fuse_shared_expert(mlp, gate)
    assert layer.fused_gemms.stack is not None
    # The old storages went back to the device, not to torch's cache: what is reserved grows by about the
    # shared expert's 6 MB (stack of 513 vs 512 experts; a 2 MB rounding per segment), not by a copy of
    # the routed experts (3.2 GB).
    assert torch.cuda.memory_reserved() - reserved < 64 * 2**20
    weights, ids = routing(tokens, 10, 512, seed=tokens, device="cuda")
    x = torch.randn(tokens, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).bfloat16()
    want = layer.forward_device(x, weights, ids, grouped=True).float()
    want += mlp(x).float() * torch.sigmoid(gate(x).float())
    assert_close_to(layer(x, weights, ids, mlp, gate), want, 2**-6)
