"""RoutedExperts: the grouped GEMMs (decode-size batches where rows are 16-byte aligned), the batched
path (one padded block for every expert) and the per-expert path (prefill-size batches) all compute each
token's weighted sum of its experts' MLPs, as a plain per-token reference does."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.moe import experts as experts_mod
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")

E, H, INTER, TOP_K = 8, 32, 16, 2
# float32 matmuls of different shapes round differently: 1e-5 relative is far below any routing or
# weighting mistake (a wrong expert or weight changes outputs by O(1)).
TOL = 1e-5


def _experts(gated: bool) -> RoutedExperts:
    torch.manual_seed(0)
    m = RoutedExperts(E, H, INTER, "silu", gated)
    torch.nn.init.normal_(m.w13, std=0.2)
    torch.nn.init.normal_(m.w2, std=0.2)
    return m


def _reference(m: RoutedExperts, x, weights, ids) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            h = m.w13[e] @ x[t]
            h = torch.nn.functional.silu(h[:INTER]) * h[INTER:] if m.gated else torch.nn.functional.silu(h)
            out[t] += w * (m.w2[e] @ h)
    return out


def _routing(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    weights, ids = torch.randn(tokens, E, generator=g).softmax(-1).topk(TOP_K)
    return x, weights, ids


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_every_path_matches_the_reference(gated, tokens, monkeypatch):
    m = _experts(gated)
    x, weights, ids = _routing(tokens, seed=tokens)
    ref = _reference(m, x, weights, ids)
    calls = {"batched": 0, "grouped_mm": 0}
    real_batched, real_grouped = RoutedExperts._batched, torch._grouped_mm

    def batched(self, *a):
        calls["batched"] += 1
        return real_batched(self, *a)

    def grouped(*a, **k):
        calls["grouped_mm"] += 1
        return real_grouped(*a, **k)

    monkeypatch.setattr(RoutedExperts, "_batched", batched)
    monkeypatch.setattr(torch, "_grouped_mm", grouped)
    with torch.no_grad():
        assert m.grouped_mm_applies(x), "float32 rows of 16-byte multiples on CPU"
        decode = m(x, weights, ids)
        assert calls == {"batched": 0, "grouped_mm": 2}, "a decode-size batch takes the grouped GEMMs"
        monkeypatch.setattr(RoutedExperts, "grouped_mm_applies", lambda self, x: False)
        padded = m(x, weights, ids)
        assert calls["batched"] == 1, "without grouped GEMMs, the padded block"
        monkeypatch.setattr(experts_mod, "BATCHED_MAX_ASSIGNMENTS", 0)  # force the per-expert path
        looped = m(x, weights, ids)
    for out in (decode, padded, looped):
        torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)


def test_unaligned_rows_skip_the_grouped_gemms():
    """torch._grouped_mm refuses rows that are not 16-byte multiples (CPU too): 6 float32 = 24 bytes."""
    torch.manual_seed(0)
    m = RoutedExperts(E, H, 6, "silu", True)
    torch.nn.init.normal_(m.w13, std=0.2)
    torch.nn.init.normal_(m.w2, std=0.2)
    x, weights, ids = _routing(5, seed=9)
    assert not m.grouped_mm_applies(x)
    with torch.no_grad():
        assert m(x, weights, ids).shape == x.shape


def test_large_batches_take_the_per_expert_path(monkeypatch):
    m = _experts(True)
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: pytest.fail("grouped GEMMs taken"))
    x, weights, ids = _routing(600, seed=5)  # 1,200 assignments > BATCHED_MAX_ASSIGNMENTS
    monkeypatch.setattr(RoutedExperts, "_batched", lambda *a: pytest.fail("batched path taken"))
    with torch.no_grad():
        torch.testing.assert_close(m(x, weights, ids), _reference(m, x, weights, ids), rtol=TOL, atol=TOL)


def test_skewed_routing_takes_the_per_expert_path(monkeypatch):
    """Few assignments, all on two of 32 experts: the padded block would hold 16x the work (without
    grouped GEMMs, which do not pad)."""
    monkeypatch.setattr(RoutedExperts, "grouped_mm_applies", lambda self, x: False)
    torch.manual_seed(0)
    m = RoutedExperts(32, H, INTER, "silu", True)
    torch.nn.init.normal_(m.w13, std=0.2)
    torch.nn.init.normal_(m.w2, std=0.2)
    x, weights, _ = _routing(16, seed=6)
    ids = torch.tensor([[0, 1]] * 16)
    monkeypatch.setattr(RoutedExperts, "_batched", lambda *a: pytest.fail("batched path taken"))
    with torch.no_grad():
        torch.testing.assert_close(m(x, weights, ids), _reference(m, x, weights, ids), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_device_path_matches_the_reference_without_reading_counts(gated, tokens, monkeypatch):
    """`forward_device` (what GPUs run) never reads a device value on the host: `.tolist()` / `.item()`
    are made to fail. On CUDA float32 takes the padded form, bfloat16 with 16-byte rows the grouped
    GEMMs: both forms, in both dtypes where they run on CPU."""
    m = _experts(gated)
    x, weights, ids = _routing(tokens, seed=tokens)
    ref = _reference(m, x, weights, ids)

    def no_host_read(*a, **k):
        raise AssertionError("the device path read a tensor on the host")

    monkeypatch.setattr(torch.Tensor, "tolist", no_host_read)
    monkeypatch.setattr(torch.Tensor, "item", no_host_read)
    with torch.no_grad():
        fp32 = m.forward_device(x, weights, ids, grouped=False)
        fp32_grouped = m.forward_device(x, weights, ids, grouped=True)
        mb = m.to(torch.bfloat16)
        xb = x.bfloat16()
        assert mb.grouped_mm_applies(xb)
        bf16 = mb.forward_device(xb, weights, ids)
    monkeypatch.undo()
    torch.testing.assert_close(fp32, ref, rtol=TOL, atol=TOL)
    torch.testing.assert_close(fp32_grouped, ref, rtol=TOL, atol=TOL)
    # bfloat16 weights and inputs: ~3 significant digits; outputs are O(1), so 3e-2 absolute is
    # rounding, while a wrong expert, weight or row moves them by O(1).
    ref_b = _reference(mb.float(), xb.float(), weights, ids)
    torch.testing.assert_close(bf16.float(), ref_b, rtol=3e-2, atol=3e-2)


def test_the_torch_combine_sums_each_token_in_pick_order():
    """The combine's bits do not depend on how the rows were sorted: each token's k products summed in
    float32 in pick order (w_0 y_0 + w_1 y_1 + ..., left to right) and rounded once, as the Triton
    combine sums them. Before, the torch path scattered the rows with `index_add_` in sorted (expert)
    order: another order of the float32 sum (different last bits here on CPU), and on CUDA an order of
    atomic adds that changed from run to run (the 80B's experts at 1,024 tokens on an H200). Checked in
    float32 output, where a different summation order shows; a weight-0 row (another EP rank's, never
    computed) holding NaN adds nothing."""
    from sglang.srt.layers.moe.sort_combine import combine, sort_by_expert

    g = torch.Generator().manual_seed(3)
    tokens, top_k, experts, hidden = 64, 6, 16, 48
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    # Products of very different magnitudes, so that the order of a float32 sum shows in its last bits.
    weights = torch.rand(tokens, top_k, generator=g) * torch.logspace(0, -6, top_k)
    weights[5, 2] = 0.0
    sorted_ = sort_by_expert(ids, experts, use_triton=False)
    y = torch.randn(tokens * top_k, hidden, generator=g) * 1e3
    y[sorted_.order.tolist().index(5 * top_k + 2)] = float("nan")
    got = combine(y, sorted_, weights, torch.float32)
    want = torch.zeros(tokens, hidden)
    rows = y[torch.argsort(sorted_.order)].view(tokens, top_k, hidden)  # (token, pick) order
    for j in range(top_k):
        want += torch.where(weights[:, j, None] != 0, rows[:, j] * weights[:, j, None], 0.0)
    assert torch.equal(got, want)
    assert not got.isnan().any()
