"""The packed-batch Gated DeltaNet extend: flash-linear-attention's kernels (CUDA) against the torch
twin of the same contract (`linear/gdn_varlen.py`). The CPU tests run the twin through the engine
against the transformers oracle (`test/unit/model/test_state_snapshots.py`); FLA itself runs only on a
GPU (its chunked kernels fail under the Triton interpreter)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sglang.srt.layers.attention.fla_chunks import chunk_offsets
from sglang.srt.layers.attention.linear.gated_delta_rule import l2norm
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def _inputs(lengths: list[int], hk: int, hv: int, d: int, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    t = sum(lengths)
    q = l2norm(torch.randn(t, hk, d, device=device, generator=g)) * d**-0.5
    k = l2norm(torch.randn(t, hk, d, device=device, generator=g))
    v = torch.randn(t, hv, d, device=device, generator=g)
    decay = -torch.rand(t, hv, device=device, generator=g) * 0.1
    beta = torch.rand(t, hv, device=device, generator=g)
    h0 = torch.randn(len(lengths), hv, d, d, device=device, generator=g) * 0.1
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return q, k, v, decay, beta, h0, torch.tensor(cu, device=device), cu


def test_cuda_auto_takes_fla_where_it_imports_and_warns_where_not(monkeypatch, caplog, fla_modules):
    """The selection on a GPU, without one: `auto` on CUDA takes FLA when it imports, else the
    per-request torch form with a warning naming the fix; `fla` asked for and missing is an error; CPU
    `auto` never takes it."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention.linear import gdn_varlen

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setenv(envs.SGLANG_GDN_EXTEND_BACKEND.name, "auto")
    fla_modules.missing()
    with caplog.at_level("WARNING"):
        assert gdn_varlen.gdn_varlen_impl(cuda) is None
    assert "pip install fla-core" in caplog.text
    monkeypatch.setenv(envs.SGLANG_GDN_EXTEND_BACKEND.name, "fla")
    with pytest.raises(ImportError):
        gdn_varlen.gdn_varlen_impl(cuda)
    fla_modules.importable("fla.ops.common.chunk_delta_h")
    assert gdn_varlen.gdn_varlen_impl(cuda) is gdn_varlen.chunk_gdn_varlen_fla
    monkeypatch.setenv(envs.SGLANG_GDN_EXTEND_BACKEND.name, "auto")
    assert gdn_varlen.gdn_varlen_impl(cuda) is gdn_varlen.chunk_gdn_varlen_fla
    assert gdn_varlen.gdn_varlen_impl(cpu) is None


def test_the_twin_returns_every_chunk_start_state():
    """Chunk state offsets(cu)[i] + c is sequence i's state after c * C tokens: lengths 1, C - 1, C,
    C + 1 and 2C + 3 (3 chunks)."""
    from sglang.srt.layers.attention.linear.gated_delta_rule import chunk_gated_delta_rule
    from sglang.srt.layers.attention.linear.gdn_varlen import chunk_gdn_varlen_torch

    c, lengths = 16, [1, 15, 16, 17, 35]
    q, k, v, decay, beta, h0, cu, cu_cpu = _inputs(lengths, 2, 4, 8, "cpu")
    out, final, chunks = chunk_gdn_varlen_torch(q, k, v, decay, beta, h0, cu, cu_cpu, c)
    first = chunk_offsets(cu_cpu, c)
    assert chunks.shape[0] == first[-1] == 1 + 1 + 1 + 2 + 3
    qe, ke = q.repeat_interleave(2, 1), k.repeat_interleave(2, 1)
    for i, (a, b) in enumerate(zip(cu_cpu, cu_cpu[1:], strict=False)):
        for n_chunks in range(-(-(b - a) // c)):
            # The state after n_chunks * c tokens: a run over just those tokens ends in it.
            end = a + n_chunks * c
            want = h0[i]
            if end > a:
                _, want, _ = chunk_gated_delta_rule(
                    qe[a:end], ke[a:end], v[a:end], decay[a:end], beta[a:end], h0[i], c
                )
            torch.testing.assert_close(chunks[first[i] + n_chunks], want, rtol=1e-5, atol=1e-5)
        _, want, _ = chunk_gated_delta_rule(qe[a:b], ke[a:b], v[a:b], decay[a:b], beta[a:b], h0[i], c)
        torch.testing.assert_close(final[i], want, rtol=1e-5, atol=1e-5)


gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
    reason="needs a CUDA GPU and flash-linear-attention (fla-core)",
)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fla_matches_the_twin_at_80b_shapes(dtype):
    """Qwen3-Next-80B's GDN heads (16 key / 32 value heads, dims 128), lengths 100, 64, 257, 1.
    Tolerances from the facts file's H100 measurement (FLA's dots run in TF32: fp32 output 1.4e-4,
    states 1.4e-3; bf16 output 7.9e-4, states ~1e-2), with headroom."""
    from sglang.srt.layers.attention.linear.gdn_varlen import chunk_gdn_varlen_fla, chunk_gdn_varlen_torch

    q, k, v, decay, beta, h0, cu, cu_cpu = _inputs([100, 64, 257, 1], 16, 32, 128, "cuda")
    want = chunk_gdn_varlen_torch(q, k, v, decay, beta, h0, cu, cu_cpu, 64)
    got = chunk_gdn_varlen_fla(q.to(dtype), k.to(dtype), v.to(dtype), decay, beta, h0, cu, cu_cpu, 64)
    out_tol, state_tol = (1e-3, 5e-3) if dtype == torch.float32 else (5e-3, 5e-2)
    torch.testing.assert_close(got[0].float(), want[0], rtol=out_tol, atol=out_tol)
    torch.testing.assert_close(got[1].float(), want[1], rtol=state_tol, atol=state_tol)
    assert got[2].shape == want[2].shape
    torch.testing.assert_close(got[2].float(), want[2], rtol=state_tol, atol=state_tol)
