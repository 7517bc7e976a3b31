"""A fingerprint of the weights a server computes with, so that a prefill/decode pair serving different
values (another checkpoint of the same shapes, a fine-tune; a weight update applied to one server only)
is refused instead of continuing one server's KV and state with the other's weights.

What it reads: every tensor of the model's state dict (parameters and persistent buffers, the MTP layer's
too) as it is in memory after load, on its own device: no file is read again; the model's config (less
the keys that name where it was read from, `COSMETIC_CONFIG_KEYS`); and the float8 KV cache scales the
attention layers use (`context`: they are numbers on the layers, not in the state dict). Each tensor's
bytes are taken as int64 words (its bits, whatever the dtype; the last few bytes zero-padded into one
more word), each word keyed by its position (word + position * K) and mixed non-linearly (SplitMix64's
finalizer: multiplications by odd constants and xor-shifts), and the mixed words are summed modulo 2**64:
a changed bit, values moved within the tensor, or several changes together change the sum except with
probability ~2**-64 (a plain sum of the words cancels structured changes: two sign flips, or
+d / -d / -d / +d). Integer operations only, and a sum whose order does not matter: the same values give
the same fingerprint on any device, thread count or chunk size (the CPU works in 1 MiB chunks, a GPU in
64 MiB ones, to bound the temporaries). The names, shapes, dtypes, sums, config and scales go into one
SHA-256.

Cost: ~14 passes over each chunk while it is in cache (docs/disaggregation.md has the numbers), on PD
servers only: in full at start, after /update_weights_from_disk and after /resume_memory_occupation of
the weights; after /update_weights_from_tensor and /update_weights_from_distributed (an RL refit sends
hundreds of buckets) only the tensors the update wrote are read again (`models/weight_writes.py`: the
loader notes its targets), the others' sums come from the last fingerprint.

Under --tp-size N each rank fingerprints its own shard; a prefill rank's is checked against the decode
rank's of the same index, which holds the same shard when the two servers hold the same weights and use
the same --tp-size and --ep-size (`PoolLayout.mismatch` refuses another --ep-size first).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.models.weight_writes import last_write, last_write_into

if TYPE_CHECKING:
    from sglang.srt.disaggregation.transfer import PoolLayout

logger = logging.getLogger(__name__)

# Config keys that differ between two copies of one checkpoint and change no computation: where it was
# read from, the transformers version that wrote it, and its dtype (the served dtype, --dtype, is compared
# on its own: `PoolLayout.weights`).
COSMETIC_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype"})

# Words per chunk (a chunk and one temporary of its size at a time): 1 MiB on CPU (they stay in cache
# through the passes), 64 MiB on a GPU (fewer kernel launches). The result does not depend on it.
CHUNK_WORDS = {"cpu": 1 << 17}
DEVICE_CHUNK_WORDS = 1 << 23


def _int64(x: int) -> int:
    """`x` modulo 2**64 as a signed int64."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_POSITION_KEY = _int64(0x9E3779B97F4A7C15)  # (odd: distinct positions, distinct keys)
_MIX1, _MIX2 = _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)  # SplitMix64's
_keys: dict[tuple[torch.device, int], torch.Tensor] = {}  # position keys of a chunk, per device


def _chunk_keys(device: torch.device, n: int) -> torch.Tensor:
    keys = _keys.get((device, n))
    if keys is None:
        keys = _keys[(device, n)] = torch.arange(n, dtype=torch.int64, device=device) * _POSITION_KEY
    return keys


def _xorshift_(z: torch.Tensor, tmp: torch.Tensor, k: int) -> None:
    """z ^= z >>> k (a logical shift: torch's >> on int64 is arithmetic, so the sign bits are masked)."""
    torch.bitwise_right_shift(z, k, out=tmp)
    tmp.bitwise_and_((1 << (64 - k)) - 1)
    z.bitwise_xor_(tmp)


def _mixed_sum(words: torch.Tensor, first: int = 0) -> torch.Tensor:
    """The int64 sum, on `words`' device, of mix(word + (first + i) * K) over the words (a 1-D int64
    tensor), chunk by chunk."""
    n, device = words.numel(), words.device
    chunk = CHUNK_WORDS.get(device.type, DEVICE_CHUNK_WORDS)
    size = min(n, chunk)
    keys, z, tmp = _chunk_keys(device, chunk)[:size], words.new_empty(size), words.new_empty(size)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        zz, tt = z[:m], tmp[:m]
        torch.add(words[start : start + m], keys[:m], out=zz)
        zz.add_(_int64((first + start) * _POSITION_KEY))
        _xorshift_(zz, tt, 30)
        zz.mul_(_MIX1)
        _xorshift_(zz, tt, 27)
        zz.mul_(_MIX2)
        _xorshift_(zz, tt, 31)
        total += zz.sum()
    return total


def _tensor_sum(t: torch.Tensor) -> torch.Tensor:
    """The mixed sum of `t`'s bits (a 0-dim int64 tensor on its device): its bytes as int64 words, the
    bytes past the last whole word zero-padded into one more."""
    # In logical order, not memory order: the CPU keeps MoE experts transposed (`experts.py`), a GPU does
    # not, and equal values must fingerprint alike (the copy is the CPU's, of its transposed experts).
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = data.numel() // 8 * 8
    try:
        words = data[:whole].view(torch.int64)
    except RuntimeError:  # (a view whose start is not 8-byte aligned: an aligned copy)
        words = data[:whole].clone().view(torch.int64)
    total = _mixed_sum(words) if whole else torch.zeros((), dtype=torch.int64, device=data.device)
    if whole < data.numel():
        pad = torch.zeros(8, dtype=torch.uint8, device=data.device)
        pad[: data.numel() - whole] = data[whole:]
        total = total + _mixed_sum(pad.view(torch.int64), words.numel())
    return total


def config_text(model: torch.nn.Module) -> str:
    """The model's config as sorted JSON, less `COSMETIC_CONFIG_KEYS` at any depth ("" without one)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        return ""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in COSMETIC_CONFIG_KEYS}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value

    return json.dumps(strip(config.to_dict()), sort_keys=True, default=str)


# Per model (dropped with it): each state-dict tensor's (address, shape, strides, dtype), the number of the
# last weight write noted when its sum was taken (`weight_writes.py`), and the sum.
_sums: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_fingerprint(*models: torch.nn.Module | None, context: str = "", cached: bool = False) -> str:
    """The fingerprint of the models' weights and configs (None entries skipped) and of `context`: 16 hex
    digits. With `cached`, a tensor no weight write has noted since the last fingerprint of its model
    (same address and layout) keeps its sum from then; else every tensor is read."""
    h = hashlib.sha256(context.encode())
    sums: list[torch.Tensor] = []
    seen = last_write()  # (before any read: a write noted after it makes the sums stale)
    for i, model in enumerate(models):
        if model is None:
            continue
        h.update(f"{i}:config:{config_text(model)};".encode())
        before, now = _sums.get(model, {}) if cached else {}, {}
        for name, t in model.state_dict(keep_vars=True).items():
            if t is None or t.device.type == "meta" or t.numel() == 0:
                h.update(f"{i}:{name}:empty;".encode())
                continue
            h.update(f"{i}:{name}:{tuple(t.shape)}:{t.dtype};".encode())
            where = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
            hit = before.get(name)
            if hit is not None and hit[0] == where and last_write_into(t) <= hit[1]:
                total = hit[2]
            else:
                total = _tensor_sum(t)
            now[name] = (where, seen, total)
            sums.append(total)
        _sums[model] = now
    if sums:  # (one copy to the host: the sums wait on the device until then)
        h.update(torch.stack([s.to(sums[0].device) for s in sums]).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def kv_scales_text(runner: Any) -> str:
    """The float8 KV cache scales the attention layers use (`ModelRunner._kv_scales`: (1.0, 1.0) each for
    a pool that is not float8), "" for a runner without them."""
    scales = getattr(runner, "_kv_scales", None)
    return f"kv scales {scales()}" if scales is not None else ""


def with_weights(layout: PoolLayout, sched: Any, model_path: str, full: bool = True) -> PoolLayout:
    """`layout` naming the weights `sched`'s model runner serves now: their dtype and quantization, the
    --ep-size that shards the experts, their fingerprint (`full`: every tensor read; else those the last
    updates wrote, `weights_fingerprint`'s `cached`), and where they came from (`model_path`:
    --model-path, or the last /update_weights_from_disk's; the weight version: --weight-version, or the
    last update's that named one)."""
    args, runner = sched.server_args, sched.model_runner
    start = time.perf_counter()
    try:
        models = (runner.model, getattr(runner, "draft_model", None))
        digest = weights_fingerprint(*models, context=kv_scales_text(runner), cached=not full)
    except Exception as e:  # noqa: BLE001 - (out of memory for a copy, say) after an update that succeeded
        # Not a crash of the scheduler, and no match with any peer: this server's pair refuses.
        digest = f"not computed ({type(e).__name__}, {uuid.uuid4().hex[:8]})"
        logger.warning("The weights' fingerprint could not be computed (%r): PD pairs will refuse.", e)
    logger.info(
        "Weights fingerprint %s (%s), computed in %.1f ms%s.", digest, model_path,
        (time.perf_counter() - start) * 1e3, "" if full else " (the tensors written since the last)",
    )  # fmt: skip
    return replace(
        layout,
        weights=f"--dtype {runner.dtype}, --quantization {args.quantization or 'none'}",
        ep_size=getattr(args, "ep_size", 1),
        weights_digest=digest,
        weights_source=f"model {model_path}, weight version {args.weight_version}",
    )
