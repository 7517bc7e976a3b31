"""FLA's chunk layout built on the host (`layers/attention/fla_chunks.py`), and the packed-extend glue
that hands it to FLA instead of letting FLA build it with a host sync per layer: on CPU through a
stand-in for FLA on the `meta` device under the device audit (`sglang/test/fake_fla.py`), on a GPU with
the real FLA under torch's sync check."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from sglang.srt.layers.attention.fla_chunks import chunk_layout, chunk_layout_host, chunk_offsets
from sglang.test.ci_register import register_cpu_ci
from sglang.test.device_audit import DeviceAudit
from sglang.test.fake_fla import fake_fla

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def _cu(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("chunk", [16, 64])
def test_the_layout_is_flas_definition(chunk):
    """Per chunk of the batch, sequence by sequence, (sequence, chunk within it); offsets the first chunk
    of each sequence, the total last. Lengths 1, C - 1, C, C + 1, 2C + 3 and a lone 1 at the end."""
    lengths = [1, chunk - 1, chunk, chunk + 1, 2 * chunk + 3, 1]
    cu = _cu(lengths)
    indices, offsets = chunk_layout_host(cu, chunk)
    want = [(i, c) for i, n in enumerate(lengths) for c in range(math.ceil(n / chunk))]
    assert indices.shape == (len(want), 2) and indices.dtype == torch.int64
    assert [tuple(p) for p in indices.tolist()] == want
    assert offsets.tolist() == chunk_offsets(cu, chunk) == [0, 1, 2, 3, 5, 8, 9]
    # The same through the one copy it takes where no batch carries it.
    moved = chunk_layout(cu, chunk, torch.device("cpu"))
    assert torch.equal(moved[0], indices) and torch.equal(moved[1], offsets)


def _meta_gdn_inputs(lengths, hk=2, hv=4, d=16):
    t = sum(lengths)
    meta = dict(device="meta")
    q, k = torch.empty(t, hk, d, **meta), torch.empty(t, hk, d, **meta)
    v = torch.empty(t, hv, d, **meta)
    g, beta = torch.empty(t, hv, **meta), torch.empty(t, hv, **meta)
    h0 = torch.empty(len(lengths), hv, d, d, **meta)
    return q, k, v, g, beta, h0


def _meta_layout(cu: list[int], chunk: int):
    indices, offsets = chunk_layout_host(cu, chunk)
    return indices.to("meta"), offsets.to("meta"), torch.tensor(cu).to("meta")


def test_gdn_glue_hands_flas_kernels_the_layout_and_waits_for_nothing():
    """With the batch's layout given, the glue and FLA's wrappers run with no host read of a device
    value and no host-to-device copy; every wrapper gets the given tensors (one built by FLA would be a
    blocking copy per layer). Without it, the glue builds it in one copy of its own, still no read."""
    from sglang.srt.layers.attention.linear.gdn_varlen import chunk_gdn_varlen_fla

    lengths = [1, 63, 64, 65, 131]
    cu = _cu(lengths)
    indices, offsets, cu_dev = _meta_layout(cu, 64)
    inputs = _meta_gdn_inputs(lengths)
    with fake_fla() as fla, DeviceAudit() as audit:
        out, final, chunks = chunk_gdn_varlen_fla(
            *inputs, cu_dev, cu, 64, chunk_indices=indices, chunk_offsets=offsets
        )
    assert audit.host_reads == [] and audit.h2d == [] and audit.mixed == [], (audit.host_reads, audit.h2d)
    assert fla.called("prepare_chunk_indices") == []
    for name in ("chunk_local_cumsum", "chunk_gated_delta_rule_fwd_intra", "chunk_gated_delta_rule_fwd_h", "chunk_fwd_o"):
        (call,) = fla.called(name)
        assert call["chunk_indices"] is indices, name
    assert fla.called("chunk_gated_delta_rule_fwd_h")[0]["chunk_offsets"] is offsets
    assert chunks.shape[0] == indices.shape[0] == sum(math.ceil(n / 64) for n in lengths)
    assert out.shape == inputs[2].shape and final.shape == inputs[5].shape

    with fake_fla() as fla, DeviceAudit() as audit:
        chunk_gdn_varlen_fla(*inputs, cu_dev, cu, 64)
    assert audit.host_reads == [] and len(audit.h2d) == 1 and fla.called("prepare_chunk_indices") == []


def test_gdn_glue_in_flas_state_layout_keeps_the_pools():
    """`kernel_state_v_first=False` (the default): FLA's kernels get the initial states transposed to
    their [K, V] layout, contiguous, and the final and chunk states come back in the pool's [V, K] (key
    dim 16, value dim 8 here, so a missed transpose shows in the shapes); True hands them the pool's."""
    from sglang.srt.layers.attention.linear.gdn_varlen import chunk_gdn_varlen_fla

    lengths = [70, 5]
    cu = _cu(lengths)
    indices, offsets, cu_dev = _meta_layout(cu, 64)
    q, k, _, g, beta, _ = _meta_gdn_inputs(lengths, d=16)
    v = torch.empty(sum(lengths), 4, 8, device="meta")
    h0 = torch.empty(len(lengths), 4, 8, 16, device="meta")  # [N, Hv, V, K]
    for v_first in (True, False):
        with fake_fla() as fla:
            out, final, chunks = chunk_gdn_varlen_fla(
                q, k, v, g, beta, h0, cu_dev, cu, 64, chunk_indices=indices, chunk_offsets=offsets,
                kernel_state_v_first=v_first,
            )  # fmt: skip
        (call,) = fla.called("chunk_gated_delta_rule_fwd_h")
        assert call["state_v_first"] is v_first
        given = call["initial_state"]
        assert given.is_contiguous() and given.shape == ((2, 4, 8, 16) if v_first else (2, 4, 16, 8))
        assert final.shape == (2, 4, 8, 16) and chunks.shape == (2 + 1, 4, 8, 16) and out.shape == v.shape


def test_ssd_glue_launches_the_state_pass_with_the_hosts_chunk_count():
    """The Mamba2 glue runs FLA's state kernel itself with the number of chunks from the layout's shape:
    FLA's `chunk_fwd_h` reads it back with `.item()` (a sync per layer), which the stand-in keeps."""
    from sglang.srt.layers.attention.mamba.ssd_varlen import ssd_varlen_fla

    lengths = [64, 1, 200]
    cu = _cu(lengths)
    indices, offsets, cu_dev = _meta_layout(cu, 64)
    t, heads, p, groups, n = sum(lengths), 4, 8, 2, 16
    meta = dict(device="meta")
    x, dt = torch.empty(t, heads, p, **meta), torch.empty(t, heads, **meta)
    a, d = torch.empty(heads, **meta), torch.empty(heads, **meta)
    b, c = torch.empty(t, groups, n, **meta), torch.empty(t, groups, n, **meta)
    h0 = torch.empty(len(lengths), heads, p, n, **meta)
    with fake_fla() as fla, DeviceAudit() as audit:
        y, final, chunks = ssd_varlen_fla(
            x, dt, a, b, c, d, h0, cu_dev, cu, 64, chunk_indices=indices, chunk_offsets=offsets
        )
    assert audit.host_reads == [] and audit.h2d == [] and audit.mixed == [], (audit.host_reads, audit.h2d)
    assert fla.called("chunk_fwd_h") == [] and fla.called("prepare_chunk_indices") == []
    (launch,) = fla.called("chunk_fwd_kernel_h")
    # Every argument FLA 0.6.0's `chunk_fwd_h` passes its kernel, by name (a missing or misspelled one
    # would fail only on a GPU); the block sizes and heuristics are the kernel's decorators'.
    assert set(launch) == {
        "k", "v", "h", "g", "g_gamma", "gk", "gv", "h0", "ht", "cu_seqlens", "split_offsets", "T", "H", "K",
        "V", "BT", "BS", "USE_G", "USE_G_GAMMA", "USE_GK", "USE_GV", "STATE_V_FIRST",
    }  # fmt: skip
    assert launch["split_offsets"] is offsets and launch["cu_seqlens"] is cu_dev
    assert launch["h"].shape == (1, 1 + 1 + 4, heads, p, n) and launch["h"].dtype == torch.float32
    assert launch["ht"].shape == h0.shape and launch["h0"].shape == h0.shape
    assert (launch["BT"], launch["BS"], launch["STATE_V_FIRST"], launch["USE_G"]) == (64, 64, True, True)
    assert chunks.shape == launch["h"].shape[1:] and final is launch["ht"] and y.shape == x.shape


gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
    reason="needs a CUDA GPU and flash-linear-attention (fla-core)",
)


def _gpu_inputs(dev: torch.device, t: int):
    """Inputs at the shapes the other FLA tests and `bench_kernels.py` use (FLA autotunes per head
    count, dims, layout and dtype: shapes of their own would add minutes of autotuning to a GPU
    session): Qwen3-Next-80B's GDN (16 key / 32 value heads, dims 128), Nemotron-H-8B's Mamba2 (128
    heads x 64, state 128, 8 groups)."""
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device=dev, generator=gen) * scale

    def unit(*shape):
        return torch.rand(*shape, device=dev, generator=gen)

    norm = torch.nn.functional.normalize
    gdn = (norm(rand(t, 16, 128), dim=-1) * 128**-0.5, norm(rand(t, 16, 128), dim=-1), rand(t, 32, 128),
           -unit(t, 32) * 0.1, unit(t, 32), rand(4, 32, 128, 128, scale=0.1))  # fmt: skip
    ssd = (rand(t, 128, 64), unit(t, 128) * 0.1, -unit(128), rand(t, 8, 128), rand(t, 8, 128), rand(128),
           rand(4, 128, 64, 128, scale=0.1))  # fmt: skip
    return gdn, ssd


@pytest.mark.gpu
@gpu
def test_gpu_the_fla_extends_run_without_a_sync_and_as_without_the_layout():
    """The real FLA: our layout is FLA's own (`prepare_chunk_indices` / `prepare_chunk_offsets`); the
    Mamba2 state pass we launch gives what FLA's `chunk_fwd_h` gives; both glues, given the layout (as
    the backend moves it with the batch), make no host sync (torch's sync check raises on one) and give
    what they give without it; and the GDN glue in FLA's own [K, V] state layout (the measurement
    switch) gives the pool's layout's results."""
    from fla.ops.common.chunk_h import chunk_fwd_h
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    from sglang.srt.layers.attention.linear.gdn_varlen import chunk_gdn_varlen_fla
    from sglang.srt.layers.attention.mamba.ssd_varlen import _chunk_states, _heads, ssd_varlen_fla

    dev = torch.device("cuda")
    cu = _cu([100, 64, 257, 1])
    cu_dev = torch.tensor(cu, device=dev)
    gdn, ssd = _gpu_inputs(dev, cu[-1])
    indices, offsets = chunk_layout(cu, 64, dev)
    assert torch.equal(indices, prepare_chunk_indices(cu_dev, 64))
    assert torch.equal(offsets, prepare_chunk_offsets(cu_dev, 64))
    # The state pass as the SSD glue calls it (B expanded to the heads, v = x * dt, log-decay dt * A).
    x, dt, a, b, _, _, h0 = ssd
    k_ssd = _heads(b, 128)[None].contiguous()
    v_ssd, g_ssd = (x * dt[..., None])[None].contiguous(), (dt * a[None])[None].contiguous()
    want = chunk_fwd_h(k=k_ssd, v=v_ssd, g=g_ssd, h0=h0, output_final_state=True, state_v_first=True,
                       cu_seqlens=cu_dev, chunk_size=64, states_in_fp32=True)  # fmt: skip
    got = _chunk_states(k_ssd, v_ssd, g_ssd, h0, cu_dev, offsets, indices.shape[0], 64)
    for mine, fla in zip(got, want, strict=True):
        assert torch.equal(mine, fla)
    for glue, inputs in ((chunk_gdn_varlen_fla, gdn), (ssd_varlen_fla, ssd)):
        want = glue(*inputs, cu_dev, cu, 64)  # also compiles and autotunes outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = glue(*inputs, cu_dev, cu, 64, chunk_indices=indices, chunk_offsets=offsets)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for mine, theirs in zip(got, want, strict=True):
            assert torch.equal(mine, theirs), glue.__name__
    # The layout switch, in bfloat16 as `bench_kernels.py` times it.
    bf16 = [t.to(torch.bfloat16) for t in gdn[:3]] + list(gdn[3:])
    v_first = chunk_gdn_varlen_fla(*bf16, cu_dev, cu, 64, chunk_indices=indices, chunk_offsets=offsets,
                                   kernel_state_v_first=True)  # fmt: skip
    k_first = chunk_gdn_varlen_fla(*bf16, cu_dev, cu, 64, chunk_indices=indices, chunk_offsets=offsets,
                                   kernel_state_v_first=False)  # fmt: skip
    # FLA against FLA: the two layouts' kernels sum in other orders, in bfloat16 (chunk states stored in
    # bfloat16); the bfloat16 tolerances of the FLA-vs-twin test (output 5e-3, states 5e-2), doubled.
    for got_, want_, tol in zip(k_first, v_first, (1e-2, 1e-1, 1e-1), strict=True):
        torch.testing.assert_close(got_.float(), want_.float(), rtol=tol, atol=tol)
