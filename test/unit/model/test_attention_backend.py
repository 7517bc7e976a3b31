"""The paged torch-native attention backend against a float64 per-request reference: extends with and
without a cached prefix, decodes of requests of different lengths, grouped-query heads, scattered KV
slots, float32 and bfloat16; decodes both through SDPA (`SGLANG_CPU_ATTN_BACKEND=torch`) and through
sgl-kernel's C++ op (the default where built); that both modes of the torch path run torch's fused SDPA
kernel (no score matrix), but a float32 decode of large GQA groups, which runs grouped matmuls; that a
bfloat16 pool under a float16 model attends in float32 (bfloat16 holds values float16 cannot); and that
the C++ decode reads the KV in place (no gather)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

HQ, HK, D = 4, 2, 16
# float32: the fused kernel's online softmax reorders sums (measured max error ~3e-7 on these sizes);
# bfloat16: inputs are rounded to bf16 in both, the output once more (one bf16 ulp of |out| <= ~1 is 8e-3).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class _Case:
    def __init__(
        self,
        dtype: torch.dtype,
        seq_lens: list[int],
        seed: int = 0,
        hq: int = HQ,
        hk: int = HK,
        d: int = D,
        backend: str = "torch",
        kv_dtype: torch.dtype | None = None,
    ):
        """`kv_dtype`: the KV pool's (`--kv-cache-dtype`), else `dtype`, which the layer computes in."""
        torch.manual_seed(seed)
        self.kv_dtype = kv_dtype or dtype
        self.hq, self.hk, self.d = hq, hk, d
        total = sum(seq_lens)
        self.req_pool = ReqToTokenPool(len(seq_lens) + 1, max(seq_lens) + 8)
        self.kv_pool = MHATokenToKVPool(total + 64, 1, self.kv_dtype, hk, d, layer_ids=[3])
        with envs.SGLANG_CPU_ATTN_BACKEND.override(backend):
            self.backend = TorchNativeAttnBackend(self.req_pool, self.kv_pool)
        assert (self.backend.cpu_ops is not None) == (backend == "cpp")
        self.layer = SimpleNamespace(
            tp_q_head_num=hq, tp_k_head_num=hk, head_dim=d, scaling=d**-0.5, layer_id=3, kv_scales=(1.0, 1.0)
        )
        # Scattered slots: every request's positions map to a random permutation of the pool rows.
        slots = torch.randperm(total + 63)[:total] + 1
        self.rows = list(range(1, len(seq_lens) + 1))
        self.slots, start = [], 0
        for row, n in zip(self.rows, seq_lens, strict=True):
            s = slots[start : start + n]
            self.req_pool.write(row, 0, s)
            self.slots.append(s)
            start += n
        self.seq_lens = seq_lens
        self.dtype = dtype

    def fill_prefix(self, prefix_lens: list[int]) -> None:
        k_buf, v_buf = self.kv_pool.get_kv_buffer(3)
        for s, p in zip(self.slots, prefix_lens, strict=True):
            k_buf[s[:p]] = torch.randn(p, self.hk, self.d).to(self.kv_dtype)
            v_buf[s[:p]] = torch.randn(p, self.hk, self.d).to(self.kv_dtype)

    def run(self, mode: ForwardMode, new_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the backend's output, the reference's)."""
        out, q, prefix = self.forward(mode, new_lens)
        return out, self.reference(q, prefix, new_lens)

    def forward(self, mode: ForwardMode, new_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        prefix = [n - e for n, e in zip(self.seq_lens, new_lens, strict=True)]
        starts = [sum(new_lens[:i]) for i in range(len(new_lens))]
        fb = SimpleNamespace(
            forward_mode=mode,
            batch_size=len(self.rows),
            req_pool_indices_cpu=self.rows,
            req_pool_indices=torch.tensor(self.rows),
            seq_lens_cpu=self.seq_lens,
            seq_lens=torch.tensor(self.seq_lens),
            extend_start_loc_cpu=starts,
            extend_seq_lens_cpu=new_lens,
            extend_prefix_lens_cpu=prefix,
            out_cache_loc=torch.cat([s[p:] for s, p in zip(self.slots, prefix, strict=True)]),
        )
        tokens = sum(new_lens)
        q = torch.randn(tokens, self.hq * self.d).to(self.dtype)
        k = torch.randn(tokens, self.hk * self.d).to(self.dtype)
        v = torch.randn(tokens, self.hk * self.d).to(self.dtype)
        self.backend.init_forward_metadata(fb)
        return self.backend.forward(q, k, v, self.layer, fb), q, prefix

    def reference(self, q: torch.Tensor, prefix: list[int], new_lens: list[int]) -> torch.Tensor:
        k_buf, v_buf = self.kv_pool.get_kv_buffer(3)
        outs, start = [], 0
        for s, p, e in zip(self.slots, prefix, new_lens, strict=True):
            qi = q[start : start + e].double().view(e, self.hk, self.hq // self.hk, self.d)
            k, v = k_buf[s].double(), v_buf[s].double()  # [S, Hk, D]
            scores = torch.einsum("ehgd,shd->hges", qi, k) * self.d**-0.5
            allowed = torch.arange(len(s))[None, :] <= torch.arange(e)[:, None] + p
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hges,shd->ehgd", probs, v).reshape(e, self.hq * self.d))
            start += e
        return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_with_and_without_prefix(dtype):
    # Request 0 is cold; 1 extends a 37-token prefix by 1 token; 2 extends 64 by 65 (a chunk after
    # the first); 3 is a one-token cold prompt.
    seq_lens, new_lens = [70, 38, 129, 1], [70, 1, 65, 1]
    case = _Case(dtype, seq_lens)
    case.fill_prefix([n - e for n, e in zip(seq_lens, new_lens, strict=True)])
    out, ref = case.run(ForwardMode.EXTEND, new_lens)
    assert (out.double() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 32 query heads per KV head of 16 dims: the grouped matmuls (group x dim >= 512) on the torch path.
@pytest.mark.parametrize("hq,hk", [(HQ, HK), (32, 1)])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_decode_of_requests_of_different_lengths(dtype, hq, hk, backend):
    # Torch pads to 300: the mask must hide every other row's padding. The C++ op's key blocks are 64:
    # 64 and 65 end on and just past a block, 300 crosses several.
    seq_lens = [1, 300, 17, 64, 65]
    case = _Case(dtype, seq_lens, seed=1, hq=hq, hk=hk, backend=backend)
    case.fill_prefix([n - 1 for n in seq_lens])
    out, ref = case.run(ForwardMode.DECODE, [1] * len(seq_lens))
    assert (out.double() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_attention_runs_the_fused_kernel(mode):
    seq_lens = [200, 90]
    new_lens = [120, 90] if mode == ForwardMode.EXTEND else [1, 1]
    case = _Case(torch.float32, seq_lens, seed=2)
    case.fill_prefix([n - e for n, e in zip(seq_lens, new_lens, strict=True)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        case.forward(mode, new_lens)
    ops = {e.key for e in prof.key_averages()}
    # The math fallback (taken e.g. for 3-D inputs) materialises [E, S] scores through softmax.
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_softmax" not in ops


def test_decode_of_large_float32_groups_runs_grouped_matmuls():
    """32 query heads per KV head: one [group, D] x [D, S] product per KV head, no SDPA."""
    case = _Case(torch.float32, [200, 90], seed=3, hq=32, hk=1)
    case.fill_prefix([199, 89])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        case.forward(ForwardMode.DECODE, [1, 1])
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in ops
    assert "aten::matmul" in ops


def test_rope_tables_are_computed_once_per_batch():
    from sglang.srt.layers.rotary_embedding import get_rope

    rope_a, rope_b = (
        get_rope(16, {"partial_rotary_factor": 0.5}),
        get_rope(16, {"partial_rotary_factor": 0.5}),
    )
    positions = torch.tensor([0, 5, 9])
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    cache: dict = {}
    want = rope_a(positions, q, k)
    got_a = rope_a(positions, q, k, cache)
    assert len(cache) == 1
    cos_sin = next(iter(cache.values()))
    got_b = rope_b(positions, q, k, cache)  # a second layer of the same batch reads the first's tables
    assert next(iter(cache.values())) is cos_sin
    for got in (got_a, got_b):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # Another base is another table.
    get_rope(16, {"rope_theta": 500.0})(positions, q, k, cache)
    assert len(cache) == 2


KV_CACHE_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


# The C++ op's head dims: 16, 32 (the demo model's), 64, 128 and 256 are compiled as constants (256 with
# the four-way split dot), 24 and 80 take the loop of any length. Its units hold at most 32 query heads:
# 64 / 2 splits into two whole groups, 96 / 2 and 80 / 2 split groups of 48 / 40 across units (a unit then
# spans two KV heads, which e4m3fn's converted rows must hold: the first scratch bound overflowed there),
# 40 / 8 packs six groups of 5 and then two. With AVX2, head dims 16, 32 and 64 sum the values in
# registers, 64 / d rows at a time: 6 / 3 is a pass of four rows over two KV heads, then two rows alone;
# 128 and 256 of the converted KV dtypes (float16, float8) take explicit AVX2 loops. Every KV pool dtype
# under a float32 model: the reference reads the stored values, so float32's tolerance holds for all.
# The lengths end inside a block of 8 keys (3, 150, 129).
@pytest.mark.parametrize("kv_dtype", [torch.float32, *KV_CACHE_DTYPES])
@pytest.mark.parametrize(
    "d,hq,hk",
    [
        (16, 8, 2),
        (24, 8, 2),
        (32, 4, 2),
        (64, 8, 2),
        (80, 8, 2),
        (128, 8, 2),
        (256, 8, 2),
        (16, 64, 2),
        (16, 96, 2),
        (16, 80, 2),
        (16, 40, 8),
        (16, 6, 3),
    ],
)
@pytest.mark.parametrize("baseline", [False, True])
def test_cpp_decode_at_every_head_dim_and_group(kv_dtype, d, hq, hk, baseline):
    """`baseline`: the SSE2 twin a CPU without AVX2 runs (SGLANG_TEST_CPU_OPS_BASELINE)."""
    seq_lens = [3, 150, 129]
    case = _Case(torch.float32, seq_lens, seed=4, hq=hq, hk=hk, d=d, backend="cpp", kv_dtype=kv_dtype)
    case.fill_prefix([n - 1 for n in seq_lens])
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        out, ref = case.run(ForwardMode.DECODE, [1] * len(seq_lens))
    assert (out.double() - ref).abs().max().item() < TOL[torch.float32]


@pytest.mark.parametrize("d,hq,hk", [(16, 6, 3), (64, 8, 2)])
def test_cpp_decode_of_bfloat16_kv_at_the_register_head_dims(d, hq, hk):
    """The AVX2 paths of head dims 16 and 64 widen bfloat16 keys and values themselves."""
    seq_lens = [3, 150, 129]
    case = _Case(torch.bfloat16, seq_lens, seed=6, hq=hq, hk=hk, d=d, backend="cpp")
    case.fill_prefix([n - 1 for n in seq_lens])
    out, ref = case.run(ForwardMode.DECODE, [1] * len(seq_lens))
    assert (out.double() - ref).abs().max().item() < TOL[torch.bfloat16]


@pytest.mark.parametrize("kv_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("mode,backend", [("extend", "torch"), ("decode", "torch"), ("decode", "cpp")])
def test_a_kv_cache_dtype_pool_under_a_float32_model(kv_dtype, mode, backend):
    """`--kv-cache-dtype`: the layer stores its new keys and values in the pool's dtype and attends in
    float32 over the stored values. The reference reads the same stored values, so the tolerance is
    float32's (a wrong conversion of an element, or a key read as another dtype, is off by O(1))."""
    seq_lens = [70, 38, 129, 1]
    new_lens = [70, 1, 65, 1] if mode == "extend" else [1] * 4
    case = _Case(torch.float32, seq_lens, seed=7, backend=backend, kv_dtype=kv_dtype)
    case.fill_prefix([n - e for n, e in zip(seq_lens, new_lens, strict=True)])
    out, ref = case.run(ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE, new_lens)
    assert (out.double() - ref).abs().max().item() < TOL[torch.float32]


@pytest.mark.parametrize("mode,backend", [("extend", "torch"), ("decode", "torch"), ("decode", "cpp")])
def test_a_bfloat16_pool_under_a_float16_model_keeps_float16s_largest_values_finite(mode, backend):
    """float16's largest value, 65504, is 65536 in a bfloat16 pool: inf in float16. A key or value there
    must not turn the output to NaN or inf (the layer attends in float32 for this pair of dtypes)."""
    seq_lens = [70, 38, 129, 1]
    new_lens = [70, 1, 65, 1] if mode == "extend" else [1] * 4
    prefix = [n - e for n, e in zip(seq_lens, new_lens, strict=True)]
    case = _Case(torch.float16, seq_lens, seed=8, backend=backend, kv_dtype=torch.bfloat16)
    case.fill_prefix(prefix)
    k_buf, v_buf = case.kv_pool.get_kv_buffer(3)
    for s, p in zip(case.slots, prefix, strict=True):
        if p >= 2:  # one key element and one value element of the cached prefix
            k_buf[s[0], 0, 0] = torch.tensor(65504.0, dtype=torch.float16).to(torch.bfloat16)
            v_buf[s[1], 1, 2] = torch.tensor(-65504.0, dtype=torch.float16).to(torch.bfloat16)
    assert k_buf[case.slots[2][0], 0, 0].item() == 65536.0  # beyond float16 once stored
    out, ref = case.run(ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE, new_lens)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    # The reference reads the same stored values; what is left is the float16 output's rounding, one
    # part in 2**11 of |out| (outputs reach ~1e3 where the large value carries 1/70 of the weight).
    assert ((out.double() - ref).abs() <= 1e-3 * ref.abs().clamp(min=1)).all()


def test_cpp_decode_reads_the_kv_in_place():
    case = _Case(torch.float32, [200, 90], seed=5, backend="cpp")
    case.fill_prefix([199, 89])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        case.forward(ForwardMode.DECODE, [1, 1])
    ops = {e.key for e in prof.key_averages()}
    assert "sgl_kernel::decode_attention" in ops
    assert not ops & {
        "aten::index_select",
        "aten::index",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    }
