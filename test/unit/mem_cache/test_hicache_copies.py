"""The host tier's copies (`HiCacheController` over `HostPools`), one code path for CPU and CUDA: a backup
(device gather, one copy per pool tensor to host, scatter into the host pools once landed) then a load of
the same host rows into other device rows, in one sealed list and in two, give back the source rows
exactly, the MTP draft layer's KV among them (one more KV layer). On CUDA the host pools stay pageable
(only their staging tensors are pinned) and the copies are non-blocking (the GPU case is marked `gpu`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.mem_cache.hicache_controller import HiCacheController
from sglang.srt.mem_cache.host_pool import HostPools
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")


def _pools(device: str):
    """Stand-in device pools: 3 KV layers (2 full attention + the MTP layer) of 64 tokens, 8 state slots,
    random contents (page size 1)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    kv = SimpleNamespace(size=63, page_size=1, k_buffer=[rand(64, 2, 4) for _ in range(3)],
                         v_buffer=[rand(64, 2, 4) for _ in range(3)])  # fmt: skip
    mp = SimpleNamespace(size=7, conv_state=rand(2, 8, 3, 5), ssm_state=rand(2, 8, 2, 4, 4))
    return kv, mp


def _round_trip(device: str, one_list: bool) -> None:
    kv, mp = _pools(device)
    host = HostPools(kv, mp, ratio=2.0, size_gb=0)
    ctl = HiCacheController(host)
    src_kv, host_kv, dst_kv = [3, 4, 5, 9], [10, 11, 12, 13], [40, 41, 42, 43]
    expect_k = [k[src_kv].clone() for k in kv.k_buffer]
    expect_v = [v[src_kv].clone() for v in kv.v_buffer]
    expect_conv, expect_ssm = mp.conv_state[:, 2].clone(), mp.ssm_state[:, 2].clone()
    ctl.backup(src_kv, host_kv, 2, 5)
    if not one_list:
        ctl.run(ctl.seal())
    ctl.load(host_kv, dst_kv, 5, 6)
    ctl.run(ctl.seal())
    ctl.wait()
    for k, v, ek, ev in zip(kv.k_buffer, kv.v_buffer, expect_k, expect_v, strict=True):
        assert torch.equal(k[dst_kv], ek) and torch.equal(v[dst_kv], ev)
    assert torch.equal(mp.conv_state[:, 6], expect_conv) and torch.equal(mp.ssm_state[:, 6], expect_ssm)
    assert torch.equal(host.k_buffer[-1][host_kv], expect_k[-1].cpu())  # (the MTP layer's, on host)
    # Pageable pools on every device: pinned ones would be rounded up to a power of two by torch's caching
    # host allocator (up to 2x the bytes the MemAvailable check counted) and never swapped.
    assert not any(t.is_pinned() for t in (*host.k_buffer, *host.v_buffer, host.conv_state, host.ssm_state))


@pytest.mark.parametrize("one_list", [True, False])
def test_a_load_after_a_backup_gives_the_source_rows_on_cpu(one_list):
    _round_trip("cpu", one_list)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("one_list", [True, False])
def test_gpu_a_load_after_a_backup_gives_the_source_rows(one_list):
    """On CUDA, run on a side stream as the forward worker does (the copy stream orders itself after
    it and makes it wait for the loads)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _round_trip("cuda", one_list)
    torch.cuda.synchronize()
