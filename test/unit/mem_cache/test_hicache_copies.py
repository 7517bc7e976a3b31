"""The host tier's copies (`HiCacheController` over `HostPools`), one code path for CPU and CUDA: a backup
(device gather, one copy per pool tensor to host, scatter into the host pools once landed) then a load of
the same host rows into other device rows, in one sealed list and in two, give back the source rows
exactly (bit for bit, float8 KV too: `--kv-cache-dtype fp8_e4m3 / fp8_e5m2`, whose rows torch cannot
`index_copy_`), the MTP draft layer's KV among them (one more KV layer). On CUDA the host pools stay pageable
(only their staging tensors are pinned) and the copies are non-blocking (the GPU case is marked `gpu`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.mem_cache.hicache_controller import Gathered, HiCacheController
from sglang.srt.mem_cache.host_pool import HostPools
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")


KV_DTYPES = [torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (an exact comparison for every dtype; torch.equal has no float8 form)."""
    return t.cpu().contiguous().view(torch.uint8)


def _pools(device: str, kv_dtype: torch.dtype = torch.float32):
    """Stand-in device pools: 3 KV layers (2 full attention + the MTP layer) of 64 tokens in `kv_dtype`,
    8 state slots, random contents (page size 1)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    kv = SimpleNamespace(size=63, page_size=1, k_buffer=[rand(64, 2, 4, dtype=kv_dtype) for _ in range(3)],
                         v_buffer=[rand(64, 2, 4, dtype=kv_dtype) for _ in range(3)])  # fmt: skip
    mp = SimpleNamespace(size=7, conv_state=rand(2, 8, 3, 5), ssm_state=rand(2, 8, 2, 4, 4))
    return kv, mp


def _round_trip(device: str, one_list: bool, kv_dtype: torch.dtype = torch.float32) -> None:
    kv, mp = _pools(device, kv_dtype)
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
        assert torch.equal(_bits(k[dst_kv]), _bits(ek)) and torch.equal(_bits(v[dst_kv]), _bits(ev))
    assert torch.equal(mp.conv_state[:, 6], expect_conv) and torch.equal(mp.ssm_state[:, 6], expect_ssm)
    assert torch.equal(_bits(host.k_buffer[-1][host_kv]), _bits(expect_k[-1]))  # (the MTP layer's, on host)
    assert host.k_buffer[0].dtype == kv_dtype
    # Pageable pools on every device: pinned ones would be rounded up to a power of two by torch's caching
    # host allocator (up to 2x the bytes the MemAvailable check counted) and never swapped.
    assert not any(t.is_pinned() for t in (*host.k_buffer, *host.v_buffer, host.conv_state, host.ssm_state))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("one_list", [True, False])
def test_a_load_after_a_backup_gives_the_source_rows_on_cpu(one_list, kv_dtype):
    _round_trip("cpu", one_list, kv_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("one_list", [True, False])
def test_gpu_a_load_after_a_backup_gives_the_source_rows(one_list, kv_dtype):
    """On CUDA, run on a side stream as the forward worker does (the copy stream orders itself after
    it and makes it wait for the loads)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _round_trip("cuda", one_list, kv_dtype)
    torch.cuda.synchronize()


class _Event:
    """A CUDA event's stand-in (a backup of an earlier `run` still landing): never done by itself."""

    def __init__(self, log: list[str]):
        self.log = log

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.log.append("wait")


def _logged(host: HostPools, log: list[str]) -> None:
    scatter, load = host.scatter, host.load
    host.scatter = lambda kv, slots, rows: (log.append(f"scatter {slots.tolist()}"), scatter(kv, slots, rows))
    host.load = lambda kv, h, d: (log.append(f"load {h.tolist()}"), load(kv, h, d))


@pytest.mark.parametrize("same_rows", [False, True, "earlier"])
def test_a_load_waits_only_for_the_backups_writing_the_rows_it_reads(same_rows):
    """Review item 6: a load used to land every backup before it (on CUDA: synchronizing the copy stream,
    which waits for the forward stream, so the forward thread blocked until the previous batch ended).
    Now a load of host rows no pending backup writes waits for nothing: this run's backup lands after
    it, an earlier run's event is not waited for before it. A load of rows a backup writes
    lands that backup first, and what it loads is the backup's rows."""
    kv, mp = _pools("cpu")
    host = HostPools(kv, mp, ratio=2.0, size_gb=0)
    ctl = HiCacheController(host)
    ctl.backup([1, 2], [20, 21], 1, 3)  # (host rows 20, 21 and slot 3: landed before the test starts)
    ctl.run(ctl.seal())
    log: list[str] = []
    _logged(host, log)
    earlier = [Gathered(True, torch.tensor([30, 31]), [torch.zeros(2, 2, 4) for _ in range(6)], frozenset({30, 31}))]
    ctl.landing.append((_Event(log), earlier))  # (an earlier run's backup of host rows 30, 31, in flight)
    src = [3, 4]
    ctl.backup(src, [10, 11], 2, 5)
    read_kv, read_slot = {False: ([20, 21], 3), True: ([10, 11], 5), "earlier": ([30, 31], 3)}[same_rows]
    ctl.load(read_kv, [40, 41], read_slot, 6)
    ctl.run(ctl.seal())
    if same_rows == "earlier":  # (the earlier run's event alone before it; this run's backup after it)
        assert log == ["wait", "scatter [30, 31]", "load [30, 31]", "load [3]", "scatter [10, 11]", "scatter [5]"]
        assert not kv.k_buffer[0][[40, 41]].any()  # (what that backup wrote: zeros)
    elif same_rows:  # (every backup before it: the earlier run's event waited for, then this run's)
        assert log[:4] == ["wait", "scatter [30, 31]", "scatter [10, 11]", "scatter [5]"], log
        assert log[4:] == ["load [10, 11]", "load [5]"], log
        assert torch.equal(kv.k_buffer[0][[40, 41]], kv.k_buffer[0][src])
        assert torch.equal(mp.conv_state[:, 6], mp.conv_state[:, 2])
    else:
        # The loads first; the rest lands after them (on CPU at the run's end; on CUDA in a later run).
        assert log == ["load [20, 21]", "load [3]", "wait", "scatter [30, 31]", "scatter [10, 11]", "scatter [5]"]
        assert torch.equal(kv.k_buffer[0][[40, 41]], kv.k_buffer[0][[1, 2]])
        assert torch.equal(mp.conv_state[:, 6], mp.conv_state[:, 1])
    ctl.wait()
    assert not ctl.landing and torch.equal(host.k_buffer[0][[10, 11]], kv.k_buffer[0][src])
