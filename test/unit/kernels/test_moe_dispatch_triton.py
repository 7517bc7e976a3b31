"""The MoE bookkeeping kernels (layers/moe/dispatch_triton.py, the CUDA path) against the torch form of
`RoutedExperts.forward_device`: under `TRITON_INTERPRET=1` on small shapes, compiled for sm_90 at
Qwen3-Next-80B's 512 experts / top-10, and through the engine."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.moe import dispatch_triton as dt
from sglang.test.ci_register import register_cpu_ci
from sglang.test.sm90 import compile_sm90_in_registers

register_cpu_ci(est_time=15, suite="per-commit-cpu")



def _ids(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """Distinct experts per token (as top-k gives), few experts so that many share one, some unused."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 8), (37, 3, 5), (300, 2, 16), (9, 10, 512)])
def test_align_matches_a_stable_sort(kernel_device, tokens, top_k, experts):
    ids = _ids(tokens, top_k, experts, seed=tokens).to(kernel_device)
    token_of, inv, offs = dt.moe_align(ids, experts)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    assert torch.equal(token_of, order // top_k)
    assert torch.equal(order[inv], torch.arange(flat.numel(), device=kernel_device))  # inv is order's inverse
    assert offs.dtype == torch.int32
    assert torch.equal(offs, torch.cumsum(torch.bincount(flat, minlength=experts), 0).to(torch.int32))


def test_align_of_an_empty_batch(interpret):
    token_of, inv, offs = dt.moe_align(torch.zeros(0, 2, dtype=torch.int64), 4)
    assert token_of.numel() == inv.numel() == 0 and offs.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_matches_the_index_add_form(kernel_device, dtype):
    tokens, top_k, hidden = 6, 3, 40
    ids = _ids(tokens, top_k, 7, seed=3).to(kernel_device)
    _, inv, _ = dt.moe_align(ids, 7)
    g = torch.Generator().manual_seed(4)
    y = torch.randn(tokens * top_k, hidden, generator=g).to(kernel_device, dtype)
    weights = torch.rand(tokens, top_k, generator=g).to(kernel_device)
    order = torch.argsort(ids.reshape(-1), stable=True)
    want = torch.zeros(tokens, hidden, device=kernel_device)
    want.index_add_(0, order // top_k, y.float() * weights.reshape(-1)[order, None])
    got = dt.moe_combine(y, inv, weights, dtype)
    assert got.dtype == dtype
    # float32: the same products summed in another order (~1e-7 relative); bfloat16: one rounding of it,
    # which the interpreter truncates where torch rounds to nearest (one step, 2^-7 relative).
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **tol)


def test_other_ep_ranks_rows_are_sorted_last_and_ignored(interpret):
    """Under expert parallelism the assignments of another rank's experts carry id E (one past the
    local experts, `RoutedExperts._local_assignments`) and weight 0: align sorts them last and leaves
    them out of offs, and combine ignores their rows, which the grouped GEMMs never write (NaN here)."""
    tokens, top_k, experts, hidden = 5, 3, 4, 8
    ids = torch.tensor([[0, 4, 2], [4, 4, 1], [3, 0, 4], [4, 4, 4], [1, 2, 3]])
    token_of, inv, offs = dt.moe_align(ids, experts)
    local = int((ids < experts).sum())
    assert offs.tolist()[-1] == local and sorted(inv[(ids >= experts).reshape(-1)].tolist())[0] == local
    g = torch.Generator().manual_seed(5)
    y = torch.randn(tokens * top_k, hidden, generator=g)
    y[local:] = float("nan")
    weights = torch.rand(tokens, top_k, generator=g) * (ids < experts)
    got = dt.moe_combine(y, inv, weights, torch.float32)
    want = torch.zeros(tokens, hidden)
    order = torch.argsort(ids.reshape(-1), stable=True)[:local]
    want.index_add_(0, order // top_k, y[:local] * weights.reshape(-1)[order, None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # float32 sums in another order


def test_compiles_for_sm90():
    """Qwen3-Next-80B (512 experts, top 10, hidden 2,048, bfloat16): the four kernels compile for an H100
    from this CPU machine, at the tiles `moe_align` and `moe_align_tiles` (513 experts: the shared one
    stacked, two tile heights) launch, without spilling to local memory."""
    align = {"ids_ptr": "*i64", "token_ptr": "*i64", "inv_ptr": "*i64", "n": "i32",
             **{k: "constexpr" for k in ("TOP_K", "BI", "BJ")}}  # fmt: skip
    compile_sm90_in_registers(dt._align_kernel, align, dict(TOP_K=10, BI=dt._BI, BJ=dt._BJ))
    offsets = {"ids_ptr": "*i64", "offs_ptr": "*i32", "n": "i32", **{k: "constexpr" for k in ("E", "BE", "BJ")}}
    compile_sm90_in_registers(dt._offsets_kernel, offsets, dict(E=512, BE=dt._BE, BJ=dt._BJ))
    merged = {"ids_ptr": "*i64", "token_ptr": "*i64", "inv_ptr": "*i64", "offs_ptr": "*i32", "tile1_ptr": "*i32",
              "tile2_ptr": "*i32", "n": "i32", "ALIGN_PROGRAMS": "i32",
              **{k: "constexpr" for k in ("TOP_K", "E", "BI", "BJ", "BE", "BM1", "BM2")}}  # fmt: skip
    consts = dict(TOP_K=11, E=513, BI=dt._BI, BJ=dt._BJ, BE=dt._MERGED_BE, BM1=16, BM2=64)
    compile_sm90_in_registers(dt._align_tiles_kernel, merged, consts)
    combine = {"y_ptr": "*bf16", "inv_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*bf16",
               **{k: "constexpr" for k in ("H", "TOP_K", "BH")}}  # fmt: skip
    compile_sm90_in_registers(dt._combine_kernel, combine, dict(H=2048, TOP_K=10, BH=1024))


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_engine_through_the_kernels_as_through_the_torch_form(interpret, preset, monkeypatch):
    """Prefill then 4 greedy decode steps of 2 requests with SGLANG_GPU_MOE_BACKEND=triton (the experts'
    bookkeeping and the routing through the kernels, interpreted; the C++ MoE op off, so the grouped GEMMs
    run) and =torch: the same tokens and logprobs."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.moe import elementwise_triton as ew
    from sglang.srt.layers.moe import routing_triton
    from sglang.srt.layers.moe.experts import RoutedExperts
    from sglang.test.model_checks import greedy_tokens_and_logprobs, make_runner

    calls = []
    spied = [(dt, "moe_align"), (routing_triton, "softmax_topk_triton"), (ew, "silu_mul"), (ew, "add_sigmoid_mul"),
             (routing_triton, "grouped_sigmoid_topk_triton")]  # fmt: skip
    for module, name in spied:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    runs = []
    for backend in ("triton", "torch"):
        with envs.SGLANG_GPU_MOE_BACKEND.override(backend), envs.SGLANG_CPU_MOE_BACKEND.override("torch"):
            runner = make_runner(preset, mamba_scheduler_strategy="extra_buffer")
        experts = [m for m in runner.model.modules() if isinstance(m, RoutedExperts)]
        assert experts and all(m.triton == (backend == "triton") for m in experts)
        runs.append(greedy_tokens_and_logprobs(runner, (17, 26), steps=4))
        if backend == "triton":
            # Qwen3-Next: gated experts (silu) and a gated shared expert; Nemotron-H: plain ones (relu2).
            qwen = {"moe_align", "softmax_topk_triton", "silu_mul", "add_sigmoid_mul"}
            want = qwen if "qwen" in preset else {"moe_align", "grouped_sigmoid_topk_triton"}
            assert set(calls) == want, calls
            calls.clear()
    assert not calls
    (tok_a, lp_a), (tok_b, lp_b) = runs
    assert tok_a == tok_b
    # The same experts with weights ~1e-7 apart and the same float32 products summed in another order; a
    # wrong expert, row or weight moves logprobs by O(0.1).
    torch.testing.assert_close(lp_a, lp_b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 11, 513), (3, 2, 8), (46, 11, 513), (20, 3, 70)])
@pytest.mark.parametrize("heights", [(16,), (16, 64)])
def test_align_and_tile_maps_in_one_launch(kernel_device, tokens, top_k, experts, heights):
    """`moe_align_tiles` (decode batches of the fused GEMMs): `moe_align`'s three outputs and the tile
    map of each height, as `moe_align` and `tile_map` give them apart; other EP ranks' assignments
    (id E) sorted last, counted nowhere; an empty batch all zeros."""
    from sglang.srt.layers.moe.fused_moe_fp8_triton import tile_map_torch

    ids = _ids(tokens, top_k, experts, seed=tokens + top_k).to(kernel_device)
    ids[::3, -1] = experts  # another rank's
    token_of, inv, offs, tiles = dt.moe_align_tiles(ids, experts, heights)
    want = dt.moe_align(ids, experts)
    assert torch.equal(token_of, want[0]) and torch.equal(inv, want[1]) and torch.equal(offs, want[2])
    assert len(tiles) == len(heights)
    for got, block_m in zip(tiles, heights, strict=True):
        assert got.dtype == torch.int32 and torch.equal(got, tile_map_torch(offs, block_m))
    _, _, offs0, tiles0 = dt.moe_align_tiles(torch.zeros(0, top_k, dtype=torch.int64, device=kernel_device), 5, heights)
    assert offs0.tolist() == [0] * 5 and all(t.tolist() == [0] * 5 for t in tiles0)


def test_the_fused_gemms_sort_eager_batches_in_one_launch_and_captures_in_three(interpret, monkeypatch):
    """The fused GEMMs' bookkeeping in an eager forward's small batch is one launch (align, offsets and
    tile maps: less host time); in a CUDA graph's body, its warm-up and capture (less device time on an
    H200), and above
    MERGED_MAX_ASSIGNMENTS the launches apart; the outputs are the same either way."""
    from sglang.srt.layers.moe import fused_moe_triton as ft
    from sglang.srt.utils.graph_capture import graph_body, in_graph_body
    from sglang.test.moe_checks import TOL_FP16, assert_close_to, make_layer, routing

    layer = make_layer(6, 64, 32, "silu", True)
    launched = []
    for name in ("moe_align_tiles", "moe_align"):
        real = getattr(dt, name)
        monkeypatch.setattr(dt, name, lambda *a, _real=real, _name=name: launched.append(_name) or _real(*a))
    weights, ids = routing(5, 2, 6, seed=1)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).half()
    merged = ft.fused_experts(x, layer.w13, layer.w2, weights, ids, layer._activate, True)
    with graph_body():  # (a graph's warm-up and capture)
        captured = ft.fused_experts(x, layer.w13, layer.w2, weights, ids, layer._activate, True)
    monkeypatch.setattr(dt, "MERGED_MAX_ASSIGNMENTS", 4)  # (10 assignments: over it)
    apart = ft.fused_experts(x, layer.w13, layer.w2, weights, ids, layer._activate, True)
    assert launched == ["moe_align_tiles", "moe_align", "moe_align"]
    assert torch.equal(captured, apart)
    assert not in_graph_body(ids.device)  # (outside a body, on CPU tensors: never)
    assert torch.equal(merged, apart)
    assert_close_to(merged, layer.forward_device(x, weights, ids, grouped=False), TOL_FP16)
