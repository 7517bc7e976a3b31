"""A fingerprint of the weights a server computes with, so that a prefill/decode pair serving different
values (another checkpoint of the same shapes, a fine-tune; a weight update applied to one server only)
is refused instead of continuing one server's KV and state with the other's weights. It is the same for
the same weights at any --tp-size and --ep-size, so servers sharded differently compare.

What it reads: every tensor of the model's state dict (parameters and persistent buffers, the MTP layer's
too) as it is in memory after load, on its own device: no file is read again; the model's config (less
the keys that name where it was read from, `COSMETIC_CONFIG_KEYS`); and the float8 KV cache scales the
attention layers use (`context`: they are numbers on the layers, not in the state dict).

Two parts. The meta digest, a SHA-256 of the tensors' names, FULL shapes (the checkpoint's,
`linear.full_shape`) and dtypes, the config and the scales: the same on every rank. And the values: each
element's bits (zero-extended to an int64, whatever the dtype: a shard boundary may cut a word of 8 bytes)
keyed by its position in the full tensor and by the tensor's name (bits + position * K + hash(name)),
mixed non-linearly (SplitMix64's finalizer: multiplications by odd constants and xor-shifts) and summed
modulo 2**64 over every element of every tensor. A sharded parameter's local elements get their global
positions from its `DimShard`s (`weight_shards`; padded rows past the full size are skipped), and an
element several ranks hold (a replicated tensor, KV heads replicated above their count, experts held by
tp / ep ranks, Mamba2 groups replicated over ranks) counts on the lowest TP rank holding it only. So each
rank's share (`weights_share`, no collective) sums over the ranks to the same total at any sharding, and
the server's fingerprint is the meta digest and that total (`weights_total`). A changed bit, values moved
within or between tensors, or several changes together change the total except with probability ~2**-64
(a plain sum cancels structured changes: two sign flips, or +d / -d / -d / +d). Integer operations only,
and a sum whose order does not matter: the same values give the same fingerprint on any device, thread
count, chunk size (the CPU works in chunks of 2**17 elements, a GPU of 2**23, to bound the temporaries) or
storage order (the CPU keeps MoE experts transposed).

Each rank also sums the same mixed values over every element it holds, copies included (its held sum,
`PoolLayout.weights_held`): a copy one rank alone got wrong (one rank's payload of
/update_weights_from_tensor) changes no total, and two servers of the same --tp-size and --ep-size, whose
ranks hold the same elements, compare the held sums rank by rank (`weights_mismatch`). Between servers
sharded otherwise only the totals compare: the copies on ranks other than the lowest holding them are
not compared.

Cost: ~15 passes over each chunk of elements while it is in cache, both sums from one set of mixed
values (docs/disaggregation.md has the numbers), on PD servers only: in full at start, after
/update_weights_from_disk and after /resume_memory_occupation of the weights; after
/update_weights_from_tensor and /update_weights_from_distributed (an RL refit sends hundreds of buckets)
only the tensors the update wrote are read again (`models/weight_writes.py`: the loader notes its
targets), the others' sums come from the last fingerprint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
import uuid
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.layers.linear import DimShard, full_shape, weight_shards
from sglang.srt.models.weight_writes import last_write, last_write_into

if TYPE_CHECKING:
    from sglang.srt.disaggregation.transfer import PoolLayout

logger = logging.getLogger(__name__)

# Config keys that differ between two copies of one checkpoint and change no computation: where it was
# read from, the transformers version that wrote it, and its dtype (the served dtype, --dtype, is compared
# on its own: `PoolLayout.weights`).
COSMETIC_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype"})

# Elements per chunk (a chunk and two int64 temporaries of its size at a time): 1 MiB each on CPU (they
# stay in cache through the passes), 64 MiB on a GPU (fewer kernel launches). The result does not depend
# on it.
CHUNK_ELEMENTS = {"cpu": 1 << 17}
DEVICE_CHUNK_ELEMENTS = 1 << 23
MASK64 = (1 << 64) - 1


def _int64(x: int) -> int:
    """`x` modulo 2**64 as a signed int64."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_POSITION_KEY = _int64(0x9E3779B97F4A7C15)  # (odd: distinct positions, distinct keys)
_MIX1, _MIX2 = _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)  # SplitMix64's
# Integer views of each element size, and the mask that zero-extends their (sign-extended) int64 copy.
_VIEWS = {1: (torch.uint8, None), 2: (torch.int16, 0xFFFF), 4: (torch.int32, 0xFFFFFFFF), 8: (torch.int64, None)}


def name_key(name: str) -> int:
    """The 64-bit key a tensor's name adds to its elements' (an int64), so that tensors sum into one."""
    return _int64(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))


def _xorshift_(z: torch.Tensor, tmp: torch.Tensor, k: int) -> None:
    """z ^= z >>> k (a logical shift: torch's >> on int64 is arithmetic, so the sign bits are masked)."""
    torch.bitwise_right_shift(z, k, out=tmp)
    tmp.bitwise_and_((1 << (64 - k)) - 1)
    z.bitwise_xor_(tmp)


def _mix_(z: torch.Tensor, tmp: torch.Tensor) -> None:
    """SplitMix64's finalizer, in place."""
    _xorshift_(z, tmp, 30)
    z.mul_(_MIX1)
    _xorshift_(z, tmp, 27)
    z.mul_(_MIX2)
    _xorshift_(z, tmp, 31)


def _bits(t: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """`t`'s elements' bits as an integer tensor of its shape (one more trailing dimension of bytes for an
    element size other than 1, 2, 4 or 8), and the mask that zero-extends their int64 copy (None: the
    copy is zero-extended already, from an unsigned view where the device copies those)."""
    size = t.element_size()
    if size not in _VIEWS:
        return t.unsqueeze(-1).view(torch.uint8), None
    dtype, mask = _VIEWS[size]
    if mask is not None and _copies_unsigned(t.device.type):
        return t.view({2: torch.uint16, 4: torch.uint32}[size]), None
    return t.view(dtype), mask


@functools.cache
def _copies_unsigned(device_type: str) -> bool:
    """Whether the device copies uint16 / uint32 into int64, zero-extending (one pass less than a
    sign-extending copy and a mask; torch's barebones unsigned dtypes)."""
    try:
        for dtype, bits in ((torch.int16, 0xFFFF), (torch.int32, 0xFFFFFFFF)):
            src = torch.full((1,), -1, dtype=dtype, device=device_type)
            unsigned = src.view({torch.int16: torch.uint16, torch.int32: torch.uint32}[dtype])
            if int(torch.empty(1, dtype=torch.int64, device=device_type).copy_(unsigned).cpu()) != bits:
                return False
        return True
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False


def _counted(t: torch.Tensor, shape: tuple[int, ...], full: tuple[int, ...], tp_rank: int):
    """Per dimension of `t`'s bits (local `shape`, full `full`): (the local entries this rank holds, None
    for all of them; their positions in the full tensor), padding past the full size skipped; and which
    of them this rank counts in its share: True (all), False (a lower TP rank holds every one), or per
    dimension a mask over its held entries (None: all), an element a lower rank also holds counting
    there."""
    shards = {s.dim: s for s in weight_shards(t)}
    positions = [shards[d].positions(shards[d].part_of_rank[tp_rank]) if d in shards else torch.arange(n)
                 for d, n in enumerate(shape)]  # fmt: skip
    for d, p in enumerate(positions):
        if p.numel() != shape[d]:
            raise ValueError(f"a tensor's shards name {p.numel()} entries of its dimension {d}, not {shape[d]}")
    keep = [p < full[d] if d in shards else None for d, p in enumerate(positions)]
    out = []
    for k, p in zip(keep, positions, strict=True):
        out.append((None, p) if k is None or bool(k.all()) else (torch.nonzero(k).flatten(), p[k]))
    owned: list[torch.Tensor | None] = [None] * len(shape)
    for other in range(tp_rank):
        partial = []  # (dimension, which held entries `other` holds too), where it holds some, not all
        for d, s in shards.items():
            mine, theirs = s.part_of_rank[tp_rank], s.part_of_rank[other]
            if type(s) is DimShard:  # (disjoint parts: one rank's part is another's or shares nothing)
                if mine != theirs:
                    break
                continue
            held = torch.isin(out[d][1], s.positions(theirs))
            if not held.any():
                break
            if not held.all():
                partial.append((d, held))
        else:  # `other` holds these elements too: every one, or those of some entries of one dimension
            if not partial:
                return out, False
            if len(partial) > 1:  # (none such: a part held by several ranks is whole in its other dims)
                raise ValueError("a tensor's elements are held by another rank along two sharded dimensions")
            d, held = partial[0]
            owned[d] = ~held if owned[d] is None else owned[d] & ~held
    return out, (True if all(m is None for m in owned) else owned)


def _tensor_sums(t: torch.Tensor, key: int, tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's parts of the mixed sum of `t`'s elements over the full tensor (0-dim int64 tensors on
    its device), mix(bits + position * K + key) chunk by chunk: over the elements it counts (`_counted`:
    its share) and over every element it holds, copies of a lower rank's included (the same mixed values,
    summed twice)."""
    device = t.device
    zero = torch.zeros((), dtype=torch.int64, device=device)
    x = t.detach()
    bits, mask = _bits(x.reshape(1) if x.dim() == 0 else x)
    full = (full_shape(t) or (1,)) + tuple(bits.shape[max(x.dim(), 1) :])
    counted, owned = _counted(t, tuple(bits.shape), full, tp_rank)
    offsets = []  # per dimension: each held entry's position times the full tensor's stride, times K
    stride = _POSITION_KEY
    for d in reversed(range(bits.dim())):
        local, pos = counted[d]
        if local is not None:
            bits = bits.index_select(d, local.to(device))
        offsets.append(pos.to(device=device, dtype=torch.int64) * stride)
        stride = _int64(stride * full[d])
    offsets.reverse()
    if bits.numel() == 0:
        return zero, zero
    masks = [m.to(device) if m is not None else None for m in owned] if owned not in (True, False) else None
    shares: list[torch.Tensor] = []  # (per chunk, summed at the end: no accumulator per tensor)
    helds: list[torch.Tensor] = []
    # In logical order, not memory order: the CPU keeps MoE experts transposed (`experts.py`), a GPU does
    # not, and equal values must fingerprint alike (the copy is the CPU's, of its transposed experts).
    cols = bits.shape[-1]
    rows = bits.numel() // cols
    flat = bits.contiguous().view(rows, cols)
    chunk = CHUNK_ELEMENTS.get(device.type, DEVICE_CHUNK_ELEMENTS)
    row_step, col_step = max(1, chunk // cols), min(cols, chunk)
    z = torch.empty(min(chunk, rows * cols), dtype=torch.int64, device=device)
    tmp = torch.empty_like(z)
    # The three terms of bits + position * K + key (the row's key, the column's offset, the bits) side by
    # side, added by one sum over them: torch's int64 add multiplies by its alpha (twice the time of a
    # xor on a CPU), its sum does not. The columns' offsets stay from one chunk to the next of a row.
    terms = torch.empty((3, z.numel()), dtype=torch.int64, device=device)
    filled = None  # (the chunk shape and first column of the offsets in terms[1])
    outer = list(zip(bits.shape[:-1], offsets[:-1], masks[:-1] if masks else [None] * (bits.dim() - 1),
                     strict=True))[::-1]  # fmt: skip
    for r0 in range(0, rows, row_step):
        r1 = min(rows, r0 + row_step)
        # Each row's key: the name's plus its entries' offsets in the outer dimensions (from its index),
        # and whether this rank counts it (the outer dimensions' ownership masks).
        index = torch.arange(r0, r1, device=device)
        base = torch.full((r1 - r0,), key, dtype=torch.int64, device=device)
        mine = None
        for size, offs, m in outer:
            base += offs[index % size]
            if m is not None:
                mine = m[index % size] if mine is None else mine & m[index % size]
            index //= size
        for c0 in range(0, cols, col_step):
            c1 = min(cols, c0 + col_step)
            n = (r1 - r0) * (c1 - c0)
            shape = (r1 - r0, c1 - c0)
            zz, tt = z[:n].view(shape), tmp[:n].view(shape)
            terms[0, :n].view(shape).copy_(base[:, None])
            if filled != (shape, c0):
                terms[1, :n].view(shape).copy_(offsets[-1][None, c0:c1])
                filled = (shape, c0)
            bits_now = terms[2, :n].view(shape)
            bits_now.copy_(flat[r0:r1, c0:c1])  # (zero-extended, or sign-extended and masked back)
            if mask is not None:
                bits_now.bitwise_and_(mask)
            torch.sum(terms[:, :n], 0, out=z[:n])
            _mix_(zz, tt)
            if masks is None:  # (this rank counts all it holds, or none of it)
                helds.append(zz.sum())
                continue
            # Counted by a part: the rows' sums once, then those of the rows (and columns) this rank owns.
            last = masks[-1]
            if last is None:
                row_sums = zz.sum(1)
                helds.append(row_sums.sum())
                shares.append(row_sums.sum() if mine is None else row_sums[mine].sum())
            else:
                helds.append(zz.sum())
                shares.append((zz if mine is None else zz[mine])[:, last[c0:c1]].sum())
    held = helds[0] if len(helds) == 1 else torch.stack(helds).sum()
    if masks is None:
        return (held if owned else zero), held
    return (shares[0] if len(shares) == 1 else torch.stack(shares).sum()), held


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


# Per model (dropped with it): each state-dict tensor's (address, shape, strides, dtype, device, TP rank),
# the number of the last weight write noted when its sums were taken (`weight_writes.py`), and the sums.
_sums: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_share(
    *models: torch.nn.Module | None, context: str = "", cached: bool = False, tp_rank: int | None = None
) -> tuple[str, int, int]:
    """The models' (None entries skipped) meta digest (16 hex digits: names, full shapes, dtypes, configs
    and `context`; the same on every rank), this TP rank's share of their values (an int in [0, 2**64):
    the elements it counts; `tp_rank`: this process's by default) and its held sum (the same over every
    element it holds, its copies of a lower rank's included: `PoolLayout.weights_held`). With `cached`,
    a tensor no weight write has noted since the last fingerprint of its model (same address and layout)
    keeps its sums from then; else every tensor is read."""
    if tp_rank is None:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
    h = hashlib.sha256(context.encode())
    sums: list[torch.Tensor] = []  # (each tensor's share and held sum)
    seen = last_write()  # (before any read: a write noted after it makes the shares stale)
    for i, model in enumerate(models):
        if model is None:
            continue
        h.update(f"{i}:config:{config_text(model)};".encode())
        before, now = _sums.get(model, {}) if cached else {}, {}
        for name, t in model.state_dict(keep_vars=True).items():
            if t is None or t.device.type == "meta" or t.numel() == 0:
                h.update(f"{i}:{name}:empty;".encode())
                continue
            h.update(f"{i}:{name}:{full_shape(t)}:{t.dtype};".encode())
            where = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, tp_rank)
            hit = before.get(name)
            if hit is not None and hit[0] == where and last_write_into(t) <= hit[1]:
                pair = hit[2]
            else:
                pair = _tensor_sums(t, name_key(f"{i}:{name}"), tp_rank)
            now[name] = (where, seen, pair)
            sums.extend(pair)
        _sums[model] = now
    share = held = 0
    if sums:  # (one copy to the host: the sums wait on the device until then)
        both = torch.stack([s.to(sums[0].device) for s in sums]).view(-1, 2).sum(0).cpu()
        share, held = (int(v) & MASK64 for v in both)
    return h.hexdigest()[:16], share, held


def fingerprint_text(digest: str, total: int) -> str:
    """A server's fingerprint as shown and compared: its meta digest, then the ranks' shares' sum in hex."""
    return f"{digest}{total & MASK64:016x}"


def weights_fingerprint(*models: torch.nn.Module | None, context: str = "", cached: bool = False) -> str:
    """`weights_share` as a fingerprint (32 hex digits): a whole server's at one TP rank."""
    return fingerprint_text(*weights_share(*models, context=context, cached=cached)[:2])


def weights_total(layouts: list[PoolLayout]) -> str:
    """A server's fingerprint from every TP rank's layout (`with_weights`): the meta digest they share and
    the sum of their shares. A rank whose fingerprint failed, or ranks that disagree on the meta digest,
    give their digests instead, which match no server's fingerprint."""
    digests = list(dict.fromkeys(layout.weights_digest for layout in layouts))
    if len(digests) != 1 or len(digests[0]) != 16:
        return "; ".join(digests)
    return fingerprint_text(digests[0], sum(layout.weights_share for layout in layouts))


def weights_mismatch(prefill: list[PoolLayout], decode: list[PoolLayout]) -> str | None:
    """Why the two servers' weights differ (the prefill server's ranks' layouts, then the decode server's;
    any --tp-size each), or None. The totals compare at any sizes; at the same --tp-size and --ep-size
    the ranks hold the same elements, and each rank's held sum (its copies of replicated elements
    included) compares with the same rank's too: a copy one rank alone got wrong (a per-rank payload of
    /update_weights_from_tensor) changes no total. At other sizes the copies on ranks other than the
    lowest holding them are not compared."""
    here, there = weights_total(prefill), weights_total(decode)
    if here == there:
        if len(prefill) != len(decode) or {p.ep_size for p in prefill} != {d.ep_size for d in decode}:
            return None
        for r, (mine, theirs) in enumerate(zip(prefill, decode, strict=True)):
            if mine.weights_held != theirs.weights_held:
                held = f"{mine.weights_held:016x}, the decode server's {theirs.weights_held:016x}"
                return f"{_differ(prefill, decode, here, there, f'; its TP rank {r} holds {held}')} (TP rank {r})"
        return None
    return _differ(prefill, decode, here, there)


def _differ(
    prefill: list[PoolLayout], decode: list[PoolLayout], here: str, there: str, more: str = ""
) -> str:
    """The refusal: what to do, then what each server serves (and `more`)."""
    # (the flag first: a client or log may cut the long paths after it)
    return (
        "the weights' values differ: serve the same checkpoint (--model-path) on both servers and apply "
        "every weight update (/update_weights_from_disk, /update_weights_from_tensor, "
        "/update_weights_from_distributed) to both (the prefill server serves "
        f"{prefill[0].weights_source or 'unnamed weights'}, fingerprint {here or 'none'}; the decode server "
        f"{decode[0].weights_source or 'unnamed weights'}, fingerprint {there or 'none'}{more})"
    )


def kv_scales_text(runner: Any) -> str:
    """The float8 KV cache scales the attention layers use (`ModelRunner._kv_scales`: (1.0, 1.0) each for
    a pool that is not float8), "" for a runner without them."""
    scales = getattr(runner, "_kv_scales", None)
    return f"kv scales {scales()}" if scales is not None else ""


def with_weights(layout: PoolLayout, sched: Any, model_path: str, full: bool = True) -> PoolLayout:
    """`layout` naming the weights `sched`'s model runner serves now: their dtype and quantization, their
    meta digest and this rank's share of their values (`full`: every tensor read; else those the last
    updates wrote, `weights_share`'s `cached`), and where they came from (`model_path`: --model-path, or
    the last /update_weights_from_disk's; the weight version: --weight-version, or the last update's that
    named one)."""
    args, runner = sched.server_args, sched.model_runner
    start = time.perf_counter()
    try:
        models = (runner.model, getattr(runner, "draft_model", None))
        digest, share, held = weights_share(*models, context=kv_scales_text(runner), cached=not full)
    except Exception as e:  # noqa: BLE001 - (out of memory for a copy, say) after an update that succeeded
        # Not a crash of the scheduler, and no match with any peer: this server's pair refuses.
        digest, share, held = f"not computed ({type(e).__name__}, {uuid.uuid4().hex[:8]})", 0, 0
        logger.warning("The weights' fingerprint could not be computed (%r): PD pairs will refuse.", e)
    logger.info(
        "Weights fingerprint %s, this TP rank's share %016x, held %016x (%s), computed in %.1f ms%s.",
        digest, share, held, model_path, (time.perf_counter() - start) * 1e3,
        "" if full else " (the tensors written since the last)",
    )  # fmt: skip
    return replace(
        layout,
        weights=f"--dtype {runner.dtype}, --quantization {args.quantization or 'none'}",
        weights_digest=digest,
        weights_share=share,
        weights_held=held,
        ep_size=getattr(args, "ep_size", 1) or 1,
        weights_source=f"model {model_path}, weight version {args.weight_version}",
    )
