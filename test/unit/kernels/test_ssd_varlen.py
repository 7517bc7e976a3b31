"""The packed-batch Mamba2 SSD extend: flash-linear-attention's simple-GLA kernels (CUDA) against the
torch twin of the same contract (`mamba/ssd_varlen.py`). The CPU tests run the twin through the engine
against the transformers oracle (`test/unit/model/test_state_snapshots.py`); FLA runs only on a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sglang.srt.layers.attention.fla_chunks import chunk_offsets
from sglang.srt.layers.attention.mamba.ssd import ssd_chunk_scan
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def _inputs(lengths: list[int], heads: int, p: int, groups: int, n: int, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    t = sum(lengths)
    x = torch.randn(t, heads, p, device=device, generator=g)
    dt = torch.rand(t, heads, device=device, generator=g) * 0.1 + 0.01
    a = -torch.rand(heads, device=device, generator=g) - 0.5
    b = torch.randn(t, groups, n, device=device, generator=g) * 0.3
    c = torch.randn(t, groups, n, device=device, generator=g) * 0.3
    d = torch.randn(heads, device=device, generator=g)
    h0 = torch.randn(len(lengths), heads, p, n, device=device, generator=g) * 0.1
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return x, dt, a, b, c, d, h0, torch.tensor(cu, device=device), cu


def test_cuda_auto_takes_fla_at_a_chunk_it_divides(monkeypatch, caplog, fla_modules):
    """The selection on a GPU, without one: `auto` on CUDA takes FLA (states every 64 tokens) when it
    imports and 64 divides the model's chunk; otherwise the per-request torch form, with the reason in
    a warning; `fla` asked for and unable to serve is an error naming the reason."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention.mamba import ssd_varlen

    cuda = torch.device("cuda")
    monkeypatch.setenv(envs.SGLANG_MAMBA2_EXTEND_BACKEND.name, "auto")
    fla_modules.missing()
    with caplog.at_level("WARNING"):
        assert ssd_varlen.ssd_varlen_impl(cuda, 256) == (None, 256)
    assert "flash-linear-attention is unavailable" in caplog.text
    fla_modules.importable("fla.ops.common.chunk_h")
    assert ssd_varlen.ssd_varlen_impl(cuda, 256) == (ssd_varlen.ssd_varlen_fla, 64)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert ssd_varlen.ssd_varlen_impl(cuda, 100) == (None, 100)
    assert "chunk size 100 is not a multiple of FLA's 64" in caplog.text
    monkeypatch.setenv(envs.SGLANG_MAMBA2_EXTEND_BACKEND.name, "fla")
    with pytest.raises(ValueError, match="chunk size 100"):
        ssd_varlen.ssd_varlen_impl(cuda, 100)
    assert ssd_varlen.ssd_varlen_impl(torch.device("cpu"), 256) == (ssd_varlen.ssd_varlen_fla, 64)


def test_the_twin_returns_every_chunk_start_state():
    """Lengths 1, S - 1, S, S + 1, 2S + 3 with S = 16; 4 heads over 2 groups."""
    from sglang.srt.layers.attention.mamba.ssd_varlen import ssd_varlen_torch

    s, lengths = 16, [1, 15, 16, 17, 35]
    x, dt, a, b, c, d, h0, cu, cu_cpu = _inputs(lengths, 4, 8, 2, 16, "cpu")
    y, final, chunks = ssd_varlen_torch(x, dt, a, b, c, d, h0, cu, cu_cpu, s)
    first = chunk_offsets(cu_cpu, s)
    assert chunks.shape[0] == first[-1] == 1 + 1 + 1 + 2 + 3
    be, ce = b.repeat_interleave(2, 1), c.repeat_interleave(2, 1)
    for i, (lo, hi) in enumerate(zip(cu_cpu, cu_cpu[1:], strict=False)):
        for k in range(-(-(hi - lo) // s)):
            end = lo + k * s
            want = h0[i]
            if end > lo:
                _, want, _ = ssd_chunk_scan(x[lo:end], dt[lo:end], a, be[lo:end], ce[lo:end], d, h0[i], s)
            torch.testing.assert_close(chunks[first[i] + k], want, rtol=1e-5, atol=1e-5)
        want_y, want_final, _ = ssd_chunk_scan(x[lo:hi], dt[lo:hi], a, be[lo:hi], ce[lo:hi], d, h0[i], s)
        torch.testing.assert_close(final[i], want_final, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y[lo:hi], want_y, rtol=1e-5, atol=1e-5)


gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
    reason="needs a CUDA GPU and flash-linear-attention (fla-core)",
)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fla_matches_the_twin_at_nemotron_h_shapes(dtype):
    """Nemotron-H-8B's Mamba2 layer (128 heads x 64, state 128, 8 groups), lengths 100, 64, 257, 1.
    Tolerances from the facts file's H100 measurement against ssd_chunk_scan (fp32: y 2.0e-3, states
    3.5e-4; bf16: 5.6e-3 / 2.3e-3), with headroom."""
    from sglang.srt.layers.attention.mamba.ssd_varlen import FLA_CHUNK, ssd_varlen_fla, ssd_varlen_torch

    x, dt, a, b, c, d, h0, cu, cu_cpu = _inputs([100, 64, 257, 1], 128, 64, 8, 128, "cuda")
    want = ssd_varlen_torch(x, dt, a, b, c, d, h0, cu, cu_cpu, FLA_CHUNK)
    got = ssd_varlen_fla(x.to(dtype), dt, a, b.to(dtype), c.to(dtype), d, h0, cu, cu_cpu, FLA_CHUNK)
    y_tol, state_tol = (5e-3, 2e-3) if dtype == torch.float32 else (2e-2, 1e-2)
    torch.testing.assert_close(got[0], want[0], rtol=y_tol, atol=y_tol)
    torch.testing.assert_close(got[1], want[1], rtol=state_tol, atol=state_tol)
    assert got[2].shape == want[2].shape
    torch.testing.assert_close(got[2].float(), want[2], rtol=state_tol, atol=state_tol)
