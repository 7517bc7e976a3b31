"""The KV pool's write of a layer's new K and V rows in one Triton launch (layers/attention/triton_ops/
store_kv.py, the CUDA path of `MHATokenToKVPool.set_kv_buffer`, SGLANG_GPU_ELEMENTWISE_BACKEND): the rows
the torch form writes, from strided K / V views, under `TRITON_INTERPRET=1`; a float8 pool or a scale
keeps the torch form; compiled for sm_90 at the 80B's shape."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def _pools(dtype, backend: str) -> MHATokenToKVPool:
    with envs.SGLANG_GPU_ELEMENTWISE_BACKEND.override(backend):
        return MHATokenToKVPool(64, 16, dtype, 2, 8, layer_ids=[3, 7])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_writes_the_rows_torch_writes(interpret, dtype):
    triton_pool, torch_pool = _pools(dtype, "triton"), _pools(dtype, "torch")
    assert triton_pool.store_kv is not None and torch_pool.store_kv is None
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 6 * 16, generator=g).to(dtype)  # q | k | v of a stacked product: strided views
    k, v = wide[:, 32:48].view(5, 2, 8), wide[:, 48:64].view(5, 2, 8)
    loc = torch.tensor([17, 3, 40, 41, 0])
    for pool in (triton_pool, torch_pool):
        pool.set_kv_buffer(7, loc, k, v)
    for a, b in zip(triton_pool.get_kv_buffer(7), torch_pool.get_kv_buffer(7), strict=True):
        assert torch.equal(a, b) and a[loc].abs().sum() > 0
    assert not triton_pool.get_kv_buffer(3)[0].any()  # another layer's buffers untouched


def test_float8_pools_and_scales_keep_the_torch_form(interpret):
    calls = []
    assert _pools(torch.float8_e4m3fn, "triton").store_kv is None
    pool = _pools(torch.bfloat16, "triton")
    pool.store_kv = lambda *a: calls.append(1)
    k = v = torch.randn(2, 2, 8).to(torch.bfloat16)
    pool.set_kv_buffer(3, torch.tensor([1, 2]), k, v, k_scale=0.5)
    assert calls == [] and pool.get_kv_buffer(3)[0][1:3].any()
    pool.set_kv_buffer(3, torch.tensor([1, 2]), k, v)
    assert calls == [1]


def test_compiles_for_sm90():
    """Qwen3-Next-80B: 2 KV heads of 256 in bfloat16; compiles for an H100 from this CPU machine without
    spilling to local memory."""
    from sglang.srt.layers.attention.triton_ops import store_kv as mod
    from sglang.test.sm90 import compile_sm90_in_registers

    sig = {**{k: "*bf16" for k in ("k_ptr", "v_ptr", "kbuf_ptr", "vbuf_ptr")}, "loc_ptr": "*i64",
           **{k: "i64" for k in ("k_tstride", "k_hstride", "v_tstride", "v_hstride")},
           **{k: "constexpr" for k in ("HEADS", "D", "BH", "BD")}}  # fmt: skip
    compile_sm90_in_registers(mod._store_kv_kernel, sig, dict(HEADS=2, D=256, BH=2, BD=256))
