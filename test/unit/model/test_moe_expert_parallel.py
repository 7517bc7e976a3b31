"""Expert parallelism in `RoutedExperts`: at EP 2 each rank computes GEMM rows only for the assignments
routed to its own experts (about half of T k), on every path (grouped GEMMs, padded block, per-expert
loop, the C++ op, the FP8 twin), and the two ranks' outputs sum to the EP 1 output. The ranks are
simulated in one process (the EP rank and size the layer reads at construction are patched); the
multi-process TP 2 + EP 2 equality is test/unit/distributed/test_tp_model.py's."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.moe import experts as experts_mod
from sglang.srt.layers.moe import fused_moe_fp8_triton
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.quantization.fp8 import quantize_block_fp8
from sglang.srt.layers.quantization.fp8_experts import make_fp8_experts
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

E, H, INTER, TOP_K, EP = 8, 32, 16, 2, 2
# float32 matmuls of different shapes and sums in another order: 1e-5 is rounding, a wrong expert,
# weight or row moves outputs by O(1).
TOL = 1e-5


def _layer(ep_rank: int | None, monkeypatch, full: RoutedExperts) -> RoutedExperts:
    """The layer as EP rank `ep_rank` of EP builds it (None: EP 1), holding `full`'s experts."""
    ep = 1 if ep_rank is None else EP
    monkeypatch.setattr(experts_mod, "get_moe_expert_parallel_world_size", lambda: ep)
    monkeypatch.setattr(experts_mod, "get_moe_expert_parallel_rank", lambda: ep_rank or 0)
    monkeypatch.setattr(experts_mod, "get_tensor_model_parallel_world_size", lambda: ep)
    m = RoutedExperts(E, H, INTER, "silu", True)
    n = E // ep
    with torch.no_grad():
        m.w13.copy_(full.w13[m.expert_offset : m.expert_offset + n])
        m.w2.copy_(full.w2[m.expert_offset : m.expert_offset + n])
    monkeypatch.undo()
    return m


def _full() -> RoutedExperts:
    torch.manual_seed(0)
    m = RoutedExperts(E, H, INTER, "silu", True)
    torch.nn.init.normal_(m.w13, std=0.2)
    torch.nn.init.normal_(m.w2, std=0.2)
    return m


def _routing(tokens: int):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    weights, ids = torch.randn(tokens, E, generator=g).softmax(-1).topk(TOP_K)
    return x, weights, ids


def _routed_to(ids: torch.Tensor, rank: int) -> int:
    n = E // EP
    return int(((ids >= rank * n) & (ids < (rank + 1) * n)).sum())


class RowCounter:
    """Rows the experts' first GEMMs compute, on whichever path runs."""

    def __init__(self, monkeypatch):
        self.rows = 0
        real_grouped, real_mlp = torch._grouped_mm, RoutedExperts._mlp

        def grouped(a, b, offs=None, **k):
            if b.shape[1] == H:  # the w13 GEMM ([E, H, 2I]); rows past offs[-1] are in no group
                self.rows += int(offs[-1])
            return real_grouped(a, b, offs=offs, **k)

        def mlp(layer, x, w13_t, w2_t):
            self.rows += x.shape[0] if x.dim() == 2 else 0  # the padded block is counted by `_batched`
            return real_mlp(layer, x, w13_t, w2_t)

        real_batched = RoutedExperts._batched

        def batched(layer, x, expert_of, token_of, counts, most):
            self.rows += int((expert_of < layer.num_experts).sum())
            return real_batched(layer, x, expert_of, token_of, counts, most)

        monkeypatch.setattr(torch, "_grouped_mm", grouped)
        monkeypatch.setattr(RoutedExperts, "_mlp", mlp)
        monkeypatch.setattr(RoutedExperts, "_batched", batched)


def _paths(monkeypatch):
    """(name, setup) for each CPU path of `RoutedExperts.forward`."""

    def grouped():
        pass

    def padded():
        monkeypatch.setattr(RoutedExperts, "grouped_mm_applies", lambda self, x: False)

    def looped():
        monkeypatch.setattr(experts_mod, "BATCHED_MAX_ASSIGNMENTS", 0)

    return {"grouped": grouped, "padded": padded, "looped": looped}


@pytest.mark.parametrize("path", ["grouped", "padded", "looped"])
def test_each_rank_computes_only_its_experts_rows(path, monkeypatch):
    full = _full()
    ranks = [_layer(r, monkeypatch, full) for r in range(EP)]
    x, weights, ids = _routing(24)
    with torch.no_grad():
        want = full(x, weights, ids)
        _paths(monkeypatch)[path]()
        counter = RowCounter(monkeypatch)
        outs, rows = [], []
        for m in ranks:
            counter.rows = 0
            outs.append(m(x, weights, ids))
            rows.append(counter.rows)
    assert rows == [_routed_to(ids, r) for r in range(EP)], f"{path}: rows computed per rank"
    assert sum(rows) == ids.numel() and all(0 < r < ids.numel() for r in rows)
    torch.testing.assert_close(outs[0] + outs[1], want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("grouped", [True, False])
def test_device_path_sums_to_ep1_without_host_reads(grouped, monkeypatch):
    """`forward_device` (no host read: the masked rows' count is not known) leaves the other rank's rows
    out of the groups; the combine ignores whatever those unwritten rows hold."""
    full = _full()
    ranks = [_layer(r, monkeypatch, full) for r in range(EP)]
    x, weights, ids = _routing(7)
    with torch.no_grad():
        want = full(x, weights, ids)
        outs = []
        for m in ranks:
            w, local = m._local_assignments(weights, ids)
            outs.append(m.forward_device(x, w, local, grouped=grouped))
    assert all(torch.isfinite(o).all() for o in outs)
    torch.testing.assert_close(outs[0] + outs[1], want, rtol=TOL, atol=TOL)


def test_cpu_op_runs_only_its_experts_rows(monkeypatch):
    full = _full()
    ranks = [_layer(r, monkeypatch, full) for r in range(EP)]
    for m in ranks:
        m.process_weights_after_loading()
    if ranks[0].cpu_ops is None:
        pytest.skip("sgl-kernel's C++ MoE op is not built here")
    x, weights, ids = _routing(24)
    rows = []

    class Counted:
        def __init__(self, ops):
            self.ops = ops

        def moe_experts(self, xr, *args):
            rows.append(xr.shape[0])
            return self.ops.moe_experts(xr, *args)

    with torch.no_grad():
        want = full(x, weights, ids)
        outs = []
        for m in ranks:
            m.cpu_ops = Counted(m.cpu_ops)
            outs.append(m(x, weights, ids))
    assert rows == [_routed_to(ids, r) for r in range(EP)]
    # The op sums in float32 in its own order: rounding only.
    torch.testing.assert_close(outs[0] + outs[1], want, rtol=TOL, atol=TOL)


def test_fp8_twin_runs_only_its_experts_rows(monkeypatch):
    full = _full()
    ranks = [_layer(r, monkeypatch, full) for r in range(EP)]
    block = (16, 16)
    for m in [full, *ranks]:
        dense = (m.w13.data.clone(), m.w2.data.clone())
        make_fp8_experts(m, block)
        for attr, w in zip(("w13", "w2"), dense, strict=True):
            for e in range(w.shape[0]):
                q, s = quantize_block_fp8(w[e], block)
                getattr(m, attr).data[e] = q
                getattr(m, attr + "_weight_scale_inv").data[e] = s
    x, weights, ids = _routing(24)
    rows = []
    real = fused_moe_fp8_triton.dequantize_block_fp8

    def counted(w, s, blk):
        if blk == (1, block[1]) and w.shape[-1] == INTER:  # the activation's rows, per expert
            rows[-1] += w.shape[0]
        return real(w, s, blk)

    with torch.no_grad():
        want = full(x, weights, ids)
        monkeypatch.setattr(fused_moe_fp8_triton, "dequantize_block_fp8", counted)
        outs = []
        for m in ranks:
            rows.append(0)
            outs.append(m(x, weights, ids))
    assert rows == [_routed_to(ids, r) for r in range(EP)]
    # The same FP8 values in both; only float32 sums differ.
    torch.testing.assert_close(outs[0] + outs[1], want, rtol=TOL, atol=TOL)
