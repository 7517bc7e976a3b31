"""Extend attention through torch's FlashAttention-2 varlen kernel (`flash_extend.py`): the batch layout
(gathered prefix keys, cumulative lengths, the new tokens' K / V where no request has a prefix), the
choice and its probe, and the Triton backend's dispatch, on CPU with the kernel's contract in torch
standing in for the CUDA kernel; on a GPU the kernel itself at Qwen3-Next-80B's heads."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.attention import flash_extend as fe
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

NUM_SLOTS = 600
KEY_BYTES = 2 * 2 * 256 * 2  # (K and V of 2 heads of 256 in bf16: the 80B's)


def _twin(q, k, v, cu_q, cu_k, max_q, max_k, scale, *, top_left=False):
    """The CUDA kernel's contract on CPU (`fe.flash_varlen_torch`); `top_left`: a kernel with the other
    causal convention, each request's first e keys visible to its e queries (the probe must refuse it)."""
    if not top_left:
        return fe.flash_varlen_torch(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    e = (cu_q[1:] - cu_q[:-1]).tolist()
    index = torch.cat([torch.arange(k0, k0 + n) for k0, n in zip(cu_k.tolist(), e, strict=False)])
    return fe.flash_varlen_torch(q, k[index], v[index], cu_q, cu_q, max_q, max_q, scale)


def _batch(hq, hk, d, dtype, prefix, ext, rows, seed=0, num_slots=NUM_SLOTS):
    g = torch.Generator().manual_seed(seed)
    lens = [p + e for p, e in zip(prefix, ext, strict=True)]
    perm = torch.randperm(num_slots, generator=g).int()
    r2t = torch.zeros(max(rows) + 2, max(256, max(lens)), dtype=torch.int32)
    off = 0
    for row, n in zip(rows, lens, strict=True):
        r2t[row, :n] = perm[off : off + n]
        off += n
    k_buf = torch.randn(num_slots, hk, d, generator=g).to(dtype)
    v_buf = torch.randn(num_slots, hk, d, generator=g).to(dtype)
    q = torch.randn(sum(ext), hq, d, generator=g).to(dtype)
    # The new tokens' K / V as the layer computed them (already stored in the pool at their slots).
    new = torch.cat([r2t[r, p : p + e] for r, p, e in zip(rows, prefix, ext, strict=True)]).long()
    return r2t, k_buf, v_buf, q, k_buf[new], v_buf[new], lens


def _want(q, k_buf, v_buf, r2t, rows, prefix, ext, lens, scale):
    """Float64 attention per request over its row's keys, query j at position prefix + j."""
    group = q.shape[1] // k_buf.shape[1]
    outs, q0 = [], 0
    for row, p, e, n in zip(rows, prefix, ext, lens, strict=True):
        slots = r2t[row, :n].long()
        k = k_buf[slots].double().repeat_interleave(group, 1)
        v = v_buf[slots].double().repeat_interleave(group, 1)
        s = torch.einsum("ehd,thd->eht", q[q0 : q0 + e].double(), k) * scale
        pos = p + torch.arange(e)
        s = s.masked_fill(torch.arange(n)[None, None, :] > pos[:, None, None], float("-inf"))
        outs.append(torch.einsum("eht,thd->ehd", s.softmax(-1), v))
        q0 += e
    return torch.cat(outs)


# bfloat16 inputs: the twin rounds its float32 result once (2^-8 relative); float32 ~1e-6.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "prefix,ext,rows",
    [([0, 17, 130], [90, 40, 3], [2, 5, 9]), ([0, 0], [7, 30], [1, 0]), ([0], [1], [3]), ([20, 3], [1, 2], [0, 4])],
)
def test_the_batch_layout_gives_each_query_its_requests_keys(monkeypatch, dtype, prefix, ext, rows):
    """Gathered prefixes (a request's row, prefix and new keys), cumulative lengths, GQA heads: the
    twin's result is the float64 attention of each request's keys; with no prefix the new K / V are
    read as they are (the pool is not gathered: a poisoned pool changes nothing)."""
    monkeypatch.setattr(fe, "flash_varlen", _twin)
    hq, hk, d, scale = 4, 2, 32, 0.2
    r2t, k_buf, v_buf, q, k_new, v_new, lens = _batch(hq, hk, d, dtype, prefix, ext, rows)
    meta = fe.build_meta(r2t, rows, prefix, ext, torch.tensor(ext), torch.tensor(lens), KEY_BYTES)
    assert (meta.key_index is None) == (not any(prefix))
    assert meta.max_q == max(ext) and meta.max_k == max(lens)
    assert meta.cu_q.dtype == meta.cu_k.dtype == torch.int32 and meta.cu_k[-1].item() == (
        sum(lens) if any(prefix) else sum(ext)
    )
    want = _want(q, k_buf, v_buf, r2t, rows, prefix, ext, lens, scale)
    if meta.key_index is None:
        k_buf, v_buf = torch.full_like(k_buf, float("nan")), torch.full_like(v_buf, float("nan"))
    got = fe.extend_attention(q, k_new, v_new, k_buf, v_buf, meta, scale)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


def test_no_layout_without_the_host_lists():
    r2t = torch.zeros(4, 16, dtype=torch.int32)
    lens = torch.tensor([3, 4])
    assert fe.build_meta(r2t, [], [], [], lens[:0], lens[:0], KEY_BYTES) is None
    assert fe.build_meta(r2t, [0, 1], [0], [3, 4], lens, lens, KEY_BYTES) is None  # (a list missing: Triton's)
    assert fe.build_meta(r2t, [0], [2], [0], lens[:1], lens[:1], KEY_BYTES) is None


def test_prefixes_are_gathered_only_where_it_pays(monkeypatch):
    """Up to MAX_KEYS_PER_QUERY keys per query and GATHER_MAX_BYTES of K and V per layer (decode rows of
    a mixed batch, one query over a long context each, read their keys in place: the Triton kernel)."""
    r2t = torch.zeros(70, 1100, dtype=torch.int32)
    dev = torch.tensor
    chunk = fe.build_meta(r2t, [0], [1000], [100], dev([100]), dev([1100]), KEY_BYTES)  # 11 keys a query
    assert chunk is not None and chunk.key_index.numel() == 1100
    rows = list(range(64))  # 64 decode rows of 1,000 keys beside a chunk of 100: 640 keys a query
    mixed = ([0] + [999] * 64, [100] + [1] * 64, [100] + [1] * 64, [100] + [1000] * 64)
    assert fe.build_meta(r2t, [65, *rows], mixed[0], mixed[1], dev(mixed[2]), dev(mixed[3]), KEY_BYTES) is None
    monkeypatch.setattr(fe, "GATHER_MAX_BYTES", 1100 * KEY_BYTES - 1)  # one byte short of the chunk's keys
    assert fe.build_meta(r2t, [0], [1000], [100], dev([100]), dev([1100]), KEY_BYTES) is None
    no_prefix = fe.build_meta(r2t, [0], [0], [100], dev([100]), dev([100]), 10**12)  # (nothing to gather)
    assert no_prefix is not None and no_prefix.key_index is None


def test_applies_only_where_the_kernel_computes_the_same():
    q = torch.zeros(3, 4, 256, dtype=torch.bfloat16)
    kv = torch.zeros(8, 2, 256, dtype=torch.bfloat16)
    assert fe.applies(q, kv, 1.0, 1.0)
    assert not fe.applies(q.float(), kv.float(), 1.0, 1.0)  # float32: the Triton kernel's exact dots
    assert not fe.applies(q, kv.to(torch.float8_e4m3fn), 1.0, 1.0)  # a float8 pool
    assert not fe.applies(q, kv, 0.5, 1.0) and not fe.applies(q, kv, 1.0, 2.0)  # scaled K / V
    assert not fe.applies(torch.zeros(3, 4, 512, dtype=torch.bfloat16), kv, 1.0, 1.0)  # head over 256
    assert not fe.applies(torch.zeros(3, 4, 36, dtype=torch.bfloat16), kv, 1.0, 1.0)  # not a multiple of 8


def test_the_choice_and_its_sentences(monkeypatch):
    cpu = torch.device("cpu")
    assert not fe.chosen(cpu)  # auto on CPU: the torch-native / Triton paths
    with envs.SGLANG_EXTEND_ATTENTION_BACKEND.override("flash"), pytest.raises(ValueError) as err:
        fe.chosen(cpu)
    assert str(err.value) == "SGLANG_EXTEND_ATTENTION_BACKEND=flash needs a CUDA device."
    with envs.SGLANG_EXTEND_ATTENTION_BACKEND.override("fa3"), pytest.raises(ValueError) as err:
        fe.chosen(cpu)
    assert str(err.value) == "SGLANG_EXTEND_ATTENTION_BACKEND must be one of auto, triton, flash; got 'fa3'."
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fe, "available", lambda device: False)
    assert not fe.chosen(cuda)
    with envs.SGLANG_EXTEND_ATTENTION_BACKEND.override("flash"), pytest.raises(ValueError, match="does not run"):
        fe.chosen(cuda)
    monkeypatch.setattr(fe, "available", lambda device: True)
    assert fe.chosen(cuda)
    with envs.SGLANG_EXTEND_ATTENTION_BACKEND.override("triton"):
        assert not fe.chosen(cuda)


def test_the_probe_refuses_a_missing_or_other_kernel(monkeypatch, caplog):
    """The probe on CPU tensors with the kernel replaced: it passes the contract, refuses a kernel that
    raises (an older torch) or masks top-left, each with one warning."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(fe, "flash_varlen", _twin)
    assert fe._probe(cpu)

    def raises(*a, **kw):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    caplog.set_level(logging.WARNING, logger=fe.__name__)
    monkeypatch.setattr(fe, "flash_varlen", raises)
    assert not fe._probe(cpu)
    monkeypatch.setattr(fe, "flash_varlen", lambda *a: _twin(*a, top_left=True))
    assert not fe._probe(cpu)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "unavailable here (RuntimeError" in messages[0] and "disagrees" in messages[1]


def test_the_triton_backend_takes_it_for_extends_not_verifies(monkeypatch):
    """The backend builds the layout once per extend batch (none for a verify or a decode) and its
    forward returns the kernel's result for a layer it applies to."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention import triton_backend as tb
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    monkeypatch.setattr(fe, "chosen", lambda device: True)
    monkeypatch.setattr(fe, "flash_varlen", _twin)
    hq, hk, d = 4, 2, 32
    prefix, ext, rows = [0, 9], [6, 4], [1, 3]
    r2t, k_buf, v_buf, q, k_new, v_new, lens = _batch(hq, hk, d, torch.bfloat16, prefix, ext, rows)
    pool = SimpleNamespace(
        set_kv_buffer=lambda *a: None, get_kv_buffer=lambda layer_id: (k_buf, v_buf), k_buffer=[k_buf]
    )  # (the pool already holds the new tokens)
    backend = tb.TritonAttnBackend(SimpleNamespace(req_to_token=r2t), pool)
    assert backend.flash_extend

    def batch(mode):
        return SimpleNamespace(
            forward_mode=mode, extend_seq_lens=torch.tensor(ext), extend_seq_lens_cpu=ext, verify_width=0,
            seq_lens=torch.tensor(lens),
            extend_prefix_lens_cpu=prefix, req_pool_indices_cpu=rows, out_cache_loc=None,
        )  # fmt: skip

    backend.init_forward_metadata(batch(ForwardMode.TARGET_VERIFY))
    assert backend.flash_meta is None
    fb = batch(ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    assert backend.flash_meta is not None and backend.flash_meta.key_index.numel() == sum(lens)
    layer = SimpleNamespace(tp_q_head_num=hq, tp_k_head_num=hk, head_dim=d, kv_scales=(1.0, 1.0), scaling=0.2, layer_id=0)
    out = backend.forward(q.view(sum(ext), hq * d), k_new, v_new, layer, fb)
    want = _want(q, k_buf, v_buf, r2t, rows, prefix, ext, lens, 0.2)
    torch.testing.assert_close(out.view_as(q).double(), want, **TOL[torch.bfloat16])
    backend.init_forward_metadata(batch(ForwardMode.DECODE))
    assert backend.flash_meta is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernel_at_the_80b_heads(dtype):
    """torch's kernel on this GPU (the probe passes) at Qwen3-Next-80B's attention heads (16 / 2 of 256):
    cached prefixes of 0 / 17 / 1,030 keys and extends over several of its tiles, against float64."""
    assert fe.available(torch.device("cuda")), "torch's FlashAttention varlen kernel does not run here"
    prefix, ext, rows = [0, 17, 1030], [300, 140, 3], [2, 5, 9]
    r2t, k_buf, v_buf, q, k_new, v_new, lens = _batch(16, 2, 256, dtype, prefix, ext, rows, seed=5, num_slots=4096)
    dev = [t.cuda() for t in (r2t, k_buf, v_buf, q, k_new, v_new)]
    meta = fe.build_meta(dev[0], rows, prefix, ext, torch.tensor(ext).cuda(), torch.tensor(lens).cuda(), KEY_BYTES)
    got = fe.extend_attention(dev[3], dev[4], dev[5], dev[1], dev[2], meta, 256**-0.5)
    want = _want(q, k_buf, v_buf, r2t, rows, prefix, ext, lens, 256**-0.5)
    torch.testing.assert_close(got.cpu().double(), want, **TOL[torch.bfloat16])
    meta0 = fe.build_meta(dev[0], rows[:1], prefix[:1], ext[:1], torch.tensor(ext[:1]).cuda(), torch.tensor(lens[:1]).cuda(), KEY_BYTES)  # no prefix: the new K / V as they are
    got0 = fe.extend_attention(dev[3][:300], dev[4][:300], dev[5][:300], dev[1], dev[2], meta0, 256**-0.5)
    torch.testing.assert_close(got0.cpu().double(), want[:300], **TOL[torch.bfloat16])
