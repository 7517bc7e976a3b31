"""Extend (prefill) attention through torch's FlashAttention-2 varlen kernel
(`aten._flash_attention_forward`), for the Triton backend's extend batches on CUDA.

Why: on an H200 (2026-12-01) the project's Triton extend kernel (`triton_ops/extend_attention.py`) took
10.8 of the 35 ms of Qwen3-Next-80B's 4-layer slice prefilling 8,192 tokens (one attention layer:
16 / 2 heads of 256), ~25 TFLOP/s, and attention grows with the square of the prompt. FlashAttention-2
runs the same causal GQA attention with its own tiling (`benchmark/gpu/bench_kernels.py --attention`).

How: the batch's queries [T, Hq, D] in one varlen call; a request's keys are its `req_to_token` row, the
cached prefix and the new tokens (stored before the call), gathered once per batch for every layer
(`ExtendMeta.key_index`), or the layer's new K / V as they are when no request has a prefix. The
causal mask is FlashAttention's bottom-right one (query j of a request with prefix p sees keys
0..p + j), GQA is native (KV head h // group). Not for: a verify (the Triton kernel is graph safe),
float32, a float8 or scaled KV pool, head dims over 256 or not a multiple of 8, GPUs before sm_80; the
Triton kernel serves those. `SGLANG_EXTEND_ATTENTION_BACKEND`: auto (this where it
applies and the one-time probe passed), triton (never), flash (where it applies, and a GPU without it
is a startup error). Batches with prefixes gather their keys only where that pays (`build_meta`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sglang.srt.environ import envs
from sglang.srt.utils.device_probe import probed_once

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "flash")
MAX_HEAD_DIM = 256
# A batch whose requests have cached prefixes takes this kernel only where gathering their keys pays: at
# most this many keys per query (a 128k prompt's last chunk of 8,192 has 16; decode rows of a mixed
# batch, one query over their whole context each, soon pass it: the Triton kernel reads their keys in
# place) and at most GATHER_MAX_BYTES of K and V per layer (transient memory the pools' sizing does
# not reserve: 64 rows of 32k keys at the 80B's 2 KV heads of 256 would be 4 GiB).
MAX_KEYS_PER_QUERY = 16
GATHER_MAX_BYTES = 512 * 2**20
_probed: dict[int, bool] = {}  # CUDA device index -> whether the kernel runs and agrees there


@dataclass
class ExtendMeta:
    """One extend batch's varlen layout, shared by its attention layers."""

    cu_q: torch.Tensor  # [bs + 1] int32: request i's queries are rows cu_q[i]..cu_q[i + 1]
    cu_k: torch.Tensor  # [bs + 1] int32: its keys, in the gathered keys (or the new tokens')
    max_q: int
    max_k: int
    key_index: torch.Tensor | None  # [sum of seq lens] int64 pool slots; None: no prefix, the new K / V


def chosen(device: torch.device) -> bool:
    """Whether the extend batches on `device` take this kernel (read once, at the backend's start)."""
    value = envs.SGLANG_EXTEND_ATTENTION_BACKEND.get()
    if value not in BACKENDS:
        raise ValueError(f"SGLANG_EXTEND_ATTENTION_BACKEND must be one of {', '.join(BACKENDS)}; got {value!r}.")
    if value == "flash" and device.type != "cuda":
        raise ValueError("SGLANG_EXTEND_ATTENTION_BACKEND=flash needs a CUDA device.")
    if value == "triton" or device.type != "cuda":
        return False
    ok = available(device)
    if value == "flash" and not ok:
        raise ValueError(
            "SGLANG_EXTEND_ATTENTION_BACKEND=flash: torch's FlashAttention kernel does not run on this GPU "
            "(see the warning above); use auto or triton."
        )
    return ok


def applies(q: torch.Tensor, k_buf: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """The layer's shapes and dtypes this kernel takes (the batch's were checked by `build_meta`)."""
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and k_buf.dtype == q.dtype
        and k_scale == 1.0
        and v_scale == 1.0
        and d % 8 == 0
        and d <= MAX_HEAD_DIM
    )


def build_meta(
    req_to_token: torch.Tensor,
    rows: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    extend_lens_dev: torch.Tensor,
    seq_lens_dev: torch.Tensor,
    key_bytes: int,
) -> ExtendMeta | None:
    """The batch's layout from its host lists (sizes and slices) and its device lengths (the cumulative
    sums: nothing is copied from the host, no sync); `key_bytes`: one key's K and V in the pool (all
    heads). None where the lists are missing or empty, or where the prefixes' gather would not pay
    (MAX_KEYS_PER_QUERY, GATHER_MAX_BYTES): the Triton kernel then."""
    bs = len(rows)
    if bs == 0 or len(prefix_lens) != bs or len(extend_lens) != bs or min(extend_lens) <= 0:
        return None
    cu_q = _cumsum(extend_lens_dev)
    if not any(prefix_lens):
        return ExtendMeta(cu_q, cu_q, max(extend_lens), max(extend_lens), None)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    keys = sum(seq_lens)
    if keys > MAX_KEYS_PER_QUERY * sum(extend_lens) or keys * key_bytes > GATHER_MAX_BYTES:
        return None
    key_index = torch.cat([req_to_token[r, :n] for r, n in zip(rows, seq_lens, strict=True)]).long()
    return ExtendMeta(cu_q, _cumsum(seq_lens_dev), max(extend_lens), max(seq_lens), key_index)


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    meta: ExtendMeta,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D]; k_new, v_new [T, Hk, D] (the new tokens'); k_buf, v_buf [slots, Hk, D] (the pool's
    layer, the new tokens stored) -> [T, Hq, D]."""
    if meta.key_index is None:
        k, v = k_new, v_new
    else:
        k, v = k_buf.index_select(0, meta.key_index), v_buf.index_select(0, meta.key_index)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return flash_varlen(q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, scale)


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal (bottom-right) varlen attention: the one call into torch's FlashAttention-2."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
    return out[0]


def available(device: torch.device) -> bool:
    """Whether the kernel runs on `device` and computes the bottom-right causal GQA attention this module
    needs (checked once per device against float32 math: a torch without the varlen kernel, a GPU
    before sm_80 or another mask convention each turn it off with one warning)."""
    return probed_once(_probed, device, _probe)


def _probe(device: torch.device) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    hq, hk, d = 4, 2, 64
    ext, seq = [5, 3], [5, 11]  # the second request has a prefix of 8
    q = torch.randn(sum(ext), hq, d, device=device, generator=g, dtype=torch.float32)
    k = torch.randn(sum(seq), hk, d, device=device, generator=g, dtype=torch.float32)
    v = torch.randn_like(k)
    cu_q = _cumsum(torch.tensor(ext, device=device))
    cu_k = _cumsum(torch.tensor(seq, device=device))
    try:
        got = flash_varlen(
            q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, max(ext), max(seq), d**-0.5
        ).float()
    except (RuntimeError, TypeError, AttributeError, NotImplementedError) as e:
        logger.warning("torch's FlashAttention varlen kernel is unavailable here (%s: %s); the Triton extend "
                       "kernel serves prefill.", type(e).__name__, e)  # fmt: skip
        return False
    want = flash_varlen_torch(q, k, v, cu_q, cu_k, max(ext), max(seq), d**-0.5)
    # bfloat16 inputs and probabilities: ~2^-8 relative on outputs of magnitude ~1; a top-left mask or
    # a wrong KV head is off by O(0.1).
    if not torch.allclose(got, want, rtol=3e-2, atol=3e-2):
        logger.warning("torch's FlashAttention varlen kernel disagrees with the bottom-right causal GQA "
                       "attention (max error %.3g); the Triton extend kernel serves prefill.",
                       (got - want).abs().max().item())  # fmt: skip
        return False
    return True


def flash_varlen_torch(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """`flash_varlen`'s torch twin (the contract; float32 math, the result in q's dtype; it reads the
    offsets on the host: tests and the probe only): per request, query j of e against keys
    0..s - e + j of s, KV head h // group."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    ext = [b - a for a, b in zip(cq, cq[1:], strict=False)]
    seq = [b - a for a, b in zip(ck, ck[1:], strict=False)]
    assert max_q == max(ext) and max_k == max(seq), "max_q / max_k are the longest lengths"
    group = q.shape[1] // k.shape[1]
    outs = []
    for q0, k0, e, s in zip(cq, ck, ext, seq, strict=False):
        qi = q[q0 : q0 + e].float().transpose(0, 1)
        ki = k[k0 : k0 + s].float().repeat_interleave(group, 1).transpose(0, 1)
        vi = v[k0 : k0 + s].float().repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.arange(s, device=q.device)[None, :] <= (s - e + torch.arange(e, device=q.device))[:, None]
        w = (qi @ ki.transpose(1, 2) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
        outs.append((w @ vi).transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def _cumsum(lens: torch.Tensor) -> torch.Tensor:
    """[n] lengths -> [n + 1] int32 offsets from 0 (FlashAttention's cu_seqlens)."""
    return torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
