"""`ForwardBatch`: everything one forward of the model reads, built by the scheduler (or a test driver).

Host/device split: every index the backends decide on is also given as a host list (`*_cpu`), so no
backend syncs on a device tensor to decide anything. `ForwardBatch.create` builds the tensors once per
batch on the host, from host lists; the forward stream then moves them all to the model's device with
one transfer (`ForwardBatch.to_device`: one packed, pinned, non-blocking copy on CUDA; nothing on CPU).

Sequence bookkeeping of request i (extend): positions [prefix, prefix + extend_len) are new; their KV
slots are `out_cache_loc[extend_start_loc[i] : ...]`, and `seq_lens[i] = prefix + extend_len`. The
runner writes `req_to_token_writes` (prefix rewrites, e.g. a cache hit) and then the new tokens' slots
into `req_to_token` on the forward stream, before any layer runs. Decode: one token per request at
position `seq_lens[i] - 1`.

Mamba state (extend and decode): `mamba_pool_indices[i]` is the running slot, read and updated in place.
Tracking writes the state after `mamba_track_seqlens[i]` tokens into `mamba_track_indices[i]` where
`mamba_track_mask[i]` (the exact rule: `layers/attention/mamba/mamba_backend_base.py`). The deferred fields
(`mamba_clear_indices`, then `mamba_cow_src_indices` -> `mamba_cow_dst_indices`) run on the forward
stream before the first layer of an extend and are then set to None.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import Any

import torch

from sglang.srt.utils.host_tensors import (
    host_bool,
    host_float32,
    host_int64,
    move_to_device,
)


class ForwardMode(IntEnum):
    EXTEND = auto()
    DECODE = auto()
    IDLE = auto()
    # Speculative verify (`speculative/ngram_worker.py`): an extend of each request's newest token and its
    # drafts, with logits and a sampled token at every position; linear layers keep the state after
    # each position in the pool's verify rows (`MambaPool.verify_row`) and leave the running slots alone.
    TARGET_VERIFY = auto()

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


@dataclass
class SamplingBatchInfo:
    """Per-request sampling parameters. temperature 0 means greedy; top_k <= 0 means no top-k cut;
    min_p 0 no min-p cut; a request without a seed draws a fresh one from the runner's generator at
    every step. Values are finite (`SamplingParams.verify`).

    Decode batches of the same requests, and batches whose requests all sample alike, share one info
    and its host tensors: nothing writes them in place (`ForwardBatch.to_device` moves a copy)."""

    temperatures: torch.Tensor  # [bs] float32
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64
    is_all_greedy: bool
    min_ps: torch.Tensor | None = None  # [bs] float32; None: no min-p cut
    # Per-request seeds for the sampler on the device: the low 64 bits of each seed as int64 (two's
    # complement, what the sampler's hash reads), and whether the request has one.
    seed_bits: torch.Tensor | None = None  # [bs] int64
    has_seed: torch.Tensor | None = None  # [bs] bool
    # Decided on the host: some row cuts its distribution (top-k, top-p or min-p); and how many of each
    # row's most likely tokens the cut must see in order: the largest top_k, or -1 (the whole
    # vocabulary) when a row cuts by top-p without a top-k, or 0 (min-p alone needs only the maximum).
    needs_truncation: bool = False
    sort_width: int = 0

    @classmethod
    def create(
        cls,
        temperatures: Sequence[float],
        top_ps: Sequence[float] | None = None,
        top_ks: Sequence[int] | None = None,
        seeds: Sequence[int | None] | None = None,
        min_ps: Sequence[float] | None = None,
    ) -> SamplingBatchInfo:
        bs = len(temperatures)
        top_ps = list(top_ps) if top_ps is not None else [1.0] * bs
        top_ks = list(top_ks) if top_ks is not None else [-1] * bs
        seeds = list(seeds) if seeds is not None else [None] * bs
        assert len(top_ps) == len(top_ks) == len(seeds) == bs
        has_min_p = bool(min_ps) and any(min_ps)
        seeded = seeds.count(None) < bs
        # Packed arrays the tensors share (`host_float32`, `host_int64`), and C-level max/min over the
        # lists: a decode batch of new requests builds this for every request at that step, and
        # `torch.tensor` on a list costs several times more (timings: benchmark/README.md).
        return cls(
            temperatures=host_float32(temperatures),
            top_ps=host_float32(top_ps),
            top_ks=host_int64(top_ks),
            is_all_greedy=bs == 0 or max(temperatures) <= 0,
            needs_truncation=bs > 0 and (max(top_ks) > 0 or min(top_ps) < 1 or has_min_p),
            sort_width=_sort_width(top_ps, top_ks),
            min_ps=host_float32(min_ps) if has_min_p else None,
            seed_bits=host_int64([0 if s is None else _int64_bits(s) for s in seeds])
            if seeded
            else torch.zeros(bs, dtype=torch.int64),
            has_seed=host_bool([s is not None for s in seeds])
            if seeded
            else torch.zeros(bs, dtype=torch.bool),
        )

    @classmethod
    def greedy(cls, bs: int) -> SamplingBatchInfo:
        return cls.create([0.0] * bs)

    TENSOR_FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps", "seed_bits", "has_seed")

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SamplingBatchInfo:
        """A copy whose per-row tensors are `fn` of this one's (rows taken, moved to a device)."""
        mapped = {name: fn(t) for name in self.TENSOR_FIELDS if (t := getattr(self, name)) is not None}
        return dataclasses.replace(self, **mapped)

    def repeat_rows(self, counts: Sequence[int]) -> SamplingBatchInfo:
        """Row i `counts[i]` times in a row (a verify samples every position of a request alike); the
        host tensors must not have moved yet. Rows left out (count 0: NEXTN's draft plan of the drafting
        requests) may have been the only sampling ones: the result is then all greedy."""
        index = host_int64([i for i, n in enumerate(counts) for _ in range(n)])
        info = self.map_tensors(lambda t: t.index_select(0, index))
        if not self.is_all_greedy and 0 in counts:
            info.is_all_greedy = not bool((info.temperatures > 0).any())
        return info


def _on(t: torch.Tensor | None, device: torch.device) -> bool:
    """`t` is on `device` (one with its index, as `_resolved` gives)."""
    return t is not None and t.device == device


def _resolved(device: torch.device) -> torch.device:
    """`device` with its index: "cuda" is the current CUDA device, where tensors moved to "cuda" land
    (their `device` then reads cuda:N, which is not equal to a plain "cuda")."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _sort_width(top_ps: list[float], top_ks: list[int]) -> int:
    """`SamplingBatchInfo.sort_width`."""
    if not top_ks:
        return 0
    if min(top_ps) < 1 and any(p < 1 and k <= 0 for p, k in zip(top_ps, top_ks, strict=True)):
        return -1
    return max(max(top_ks), 0)


def _int64_bits(value: int) -> int:
    """The low 64 bits of a non-negative int, as the int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _prebuilt_or_int64(built: dict[str, torch.Tensor], name: str, values: Sequence[int]) -> torch.Tensor:
    tensor = built.get(name)
    return host_int64(values) if tensor is None else tensor


def _opt_long(values: Sequence[int] | None) -> torch.Tensor | None:
    return None if values is None else host_int64(values)


def _pair(values: Sequence[int] | None) -> tuple[torch.Tensor | None, list[int] | None]:
    """An optional host list and its tensor."""
    if values is None:
        return None, None
    return host_int64(values), list(values)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    req_pool_indices_cpu: list[int]
    seq_lens: torch.Tensor  # [bs] int64, length after this forward
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot of each new token
    mamba_pool_indices: torch.Tensor  # [bs] int64, running slots
    mamba_pool_indices_cpu: list[int]
    sampling_info: SamplingBatchInfo

    # Extend only (empty / None for decode).
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    extend_start_loc_cpu: list[int] = field(default_factory=list)  # offset of each request's first token
    extend_seq_lens: torch.Tensor | None = None
    extend_last_loc: torch.Tensor | None = None  # [bs] offset of each request's last new token
    # (request row, first position, KV slots): rewrites of req_to_token before the new tokens' entries.
    req_to_token_writes: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    # A verify whose requests all run this many positions (the shape a CUDA graph serves, from the
    # device tensors alone: `cuda_graph_runner.py`); 0: its widths are read from the host lists.
    verify_width: int = 0

    # State capture.
    mamba_track_indices: torch.Tensor | None = None
    mamba_track_indices_cpu: list[int] | None = None
    mamba_track_mask: torch.Tensor | None = None
    mamba_track_mask_cpu: list[bool] | None = None
    mamba_track_seqlens: torch.Tensor | None = None
    mamba_track_seqlens_cpu: list[int] | None = None
    # Extend only: further snapshots, (batch row, slot, seqlen), same rule as the primary one.
    mamba_extra_tracks: list[tuple[int, int, int]] = field(default_factory=list)

    # Deferred state operations (extend only): clear, then copy src -> dst.
    mamba_cow_src_indices: torch.Tensor | None = None
    mamba_cow_dst_indices: torch.Tensor | None = None
    mamba_clear_indices: torch.Tensor | None = None

    # Logprobs. `extend_logprob_start_lens_cpu[i]` is relative to the extend start;
    # `extend_logprob_next_ids_cpu[i]`, when not None, is the input token that follows this extend
    # (the first token of the next prefill chunk): its logprob is appended to the input logprobs.
    return_logprob: bool = False
    return_logprob_mask: list[bool] = field(default_factory=list)
    top_logprobs_nums: list[int] = field(default_factory=list)
    # Per request, the token ids whose logprobs it wants (upstream's token_ids_logprob) or None;
    # None for the batch when no request wants any.
    token_ids_logprobs: list[Sequence[int] | None] | None = None
    extend_logprob_start_lens_cpu: list[int] = field(default_factory=list)
    # Per request, whether it returns its positions' hidden states (`LogitsProcessor`); None: none does.
    return_hidden_states_mask: list[bool] | None = None
    extend_logprob_next_ids_cpu: list[int | None] | None = None

    # Overlap: where each request's sampled token goes in the forward worker's `token_lookup` (future
    # slot k at -(k + 1); set by the worker, moved with the batch).
    future_slots: torch.Tensor | None = None

    # Logit penalties of the batch's penalized requests (`sampling/penaltylib.py`); None: none.
    penalties: Any = None
    # Grammar masks of the batch's constrained requests (`constrained/vocab_mask.py`); None: none.
    vocab_mask: Any = None
    # Custom logit processors of the batch's requests (`sampling/custom_logit_processor.py`); None: none.
    custom_logit: Any = None
    # EAGLE / NEXTN: what runs after sampling (`speculative/mtp_draft.MtpHook`); None: nothing.
    spec: Any = None
    # Extend only: per request its images (`multimodal.inputs.MultimodalInputs`) or None; None: none has.
    mm_inputs: list[Any] | None = None
    # LoRA: each request's adapter slot [bs] (-1: the base model; None: every request's is), and the
    # adapters copied into slots before this forward, (slot, id or None) (`lora/lora_manager.py`).
    lora_slots: torch.Tensor | None = None
    lora_loads: list[tuple[int, str | None]] = field(default_factory=list)
    # The slots [lo, hi) that hold every adapter the batch runs (read on the host when it is built; None:
    # all of them, as a CUDA graph's batch, which is captured for any)
    lora_slot_range: tuple[int, int] | None = None

    # Backends' index tensors built on the host before the batch moves (`prepare_host_metadata`), by
    # name: `to_device` moves them with the batch's own. `moved`: `ModelRunner.move_batch` ran.
    aux_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    moved: bool = False

    # Set by the model runner.
    attn_backend: Any = None
    # RoPE cos/sin of this batch's positions, computed by the first attention layer and read by the
    # others (`RotaryEmbedding.forward`), keyed by (rotary_dim, base).
    rope_cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Per-request logprob lists may be left empty by a builder that wants the defaults.
        if not self.return_logprob_mask:
            self.return_logprob_mask = [self.return_logprob] * self.batch_size
        if not self.top_logprobs_nums:
            self.top_logprobs_nums = [0] * self.batch_size
        if not self.extend_logprob_start_lens_cpu:
            self.extend_logprob_start_lens_cpu = [0] * len(self.extend_seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    TENSOR_FIELDS = (
        "input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc", "mamba_pool_indices",
        "extend_seq_lens", "extend_last_loc", "mamba_track_indices", "mamba_track_mask", "mamba_track_seqlens",
        "mamba_cow_src_indices", "mamba_cow_dst_indices", "mamba_clear_indices", "future_slots", "lora_slots",
    )  # fmt: skip

    def to_device(self, device: str | torch.device) -> None:
        """Move every tensor of the batch (its sampling parameters and prefix rewrites too) to `device`
        in one transfer (`move_to_device`); a batch already there is left alone. The model runner calls
        it on the forward stream, before anything reads the batch."""
        device = _resolved(torch.device(device))
        if device.type == "cpu" or _on(self.input_ids, device):
            return
        # The sampling info gets a copy of its own first: batches of the same requests share one.
        info = self.sampling_info = dataclasses.replace(self.sampling_info)
        owners = [(self, name) for name in self.TENSOR_FIELDS]
        # (An info already on the device, as the MTP draft steps share one per verify, stays as it is.)
        owners += [
            (info, name) for name in SamplingBatchInfo.TENSOR_FIELDS if not _on(getattr(info, name), device)
        ]
        for extra in (self.penalties, self.vocab_mask, self.custom_logit):
            if extra is not None:
                owners += [(extra, name) for name in extra.TENSOR_FIELDS]
        tensors = [getattr(obj, name) for obj, name in owners]
        aux = list(self.aux_tensors)
        tensors += [self.aux_tensors[name] for name in aux]
        tensors += [slots for _, _, slots in self.req_to_token_writes]
        moved = move_to_device(tensors, device)
        for (obj, name), t in zip(owners, moved[: len(owners)], strict=True):
            setattr(obj, name, t)
        self.aux_tensors = dict(zip(aux, moved[len(owners) : len(owners) + len(aux)], strict=True))
        writes = moved[len(owners) + len(aux) :]
        self.req_to_token_writes = [
            (row, start, slots)
            for (row, start, _), slots in zip(self.req_to_token_writes, writes, strict=True)
        ]

    @classmethod
    def create(
        cls,
        forward_mode: ForwardMode,
        *,
        input_ids: Sequence[int],
        req_pool_indices: Sequence[int],
        seq_lens: Sequence[int],
        out_cache_loc: Sequence[int],
        mamba_pool_indices: Sequence[int],
        extend_prefix_lens: Sequence[int] | None = None,
        req_to_token_writes: Sequence[tuple[int, int, Sequence[int] | torch.Tensor]] = (),
        mamba_track_indices: Sequence[int] | None = None,
        mamba_track_mask: Sequence[bool] | None = None,
        mamba_track_seqlens: Sequence[int] | None = None,
        mamba_extra_tracks: Sequence[tuple[int, int, int]] = (),
        mamba_cow_src_indices: Sequence[int] | None = None,
        mamba_cow_dst_indices: Sequence[int] | None = None,
        mamba_clear_indices: Sequence[int] | None = None,
        sampling_info: SamplingBatchInfo | None = None,
        return_logprob_mask: Sequence[bool] | None = None,
        top_logprobs_nums: Sequence[int] | None = None,
        token_ids_logprobs: list[Sequence[int] | None] | None = None,
        extend_logprob_start_lens: Sequence[int] | None = None,
        extend_logprob_next_ids: Sequence[int | None] | None = None,
        host_tensors: dict[str, torch.Tensor] | None = None,
    ) -> ForwardBatch:
        """Build a batch from host lists, its tensors on the host (`to_device` moves them). For an
        extend, `extend_prefix_lens` is required and the extend lengths are `seq_lens - prefix`; for a
        decode every request has one input token. `host_tensors` (by field name: `req_pool_indices`,
        `mamba_pool_indices`) are tensors of those lists built before, which the batch shares instead
        of building its own (nothing writes a batch's host tensors); `lora_slots` (each request's LoRA
        slot) comes that way only, so every builder that passes a decode's rows carries it."""
        bs = len(req_pool_indices)
        built = host_tensors or {}
        seq_lens = list(seq_lens)
        assert len(seq_lens) == len(mamba_pool_indices) == bs
        seq_lens_tensor = host_int64(seq_lens)
        extend = forward_mode.is_extend()
        if extend:
            assert extend_prefix_lens is not None, "an extend needs extend_prefix_lens"
            prefix = list(extend_prefix_lens)
            ext = [s - p for s, p in zip(seq_lens, prefix, strict=True)]
            assert all(e > 0 for e in ext), "every request of an extend needs at least one new token"
            ranges = [torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix, seq_lens, strict=True)]
            positions = torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.int64)
        else:
            prefix, ext = [], []
            # Not `seq_lens_tensor - 1`: one arithmetic op on the scheduler thread right after a forward
            # costs more than the list (timings: benchmark/README.md).
            positions = host_int64([n - 1 for n in seq_lens])
        assert len(input_ids) == len(out_cache_loc) == positions.numel()
        mask = list(return_logprob_mask) if return_logprob_mask is not None else [False] * bs
        track_mask = None if mamba_track_mask is None else list(map(bool, mamba_track_mask))
        track_idx, track_idx_cpu = _pair(mamba_track_indices)
        track_len, track_len_cpu = _pair(mamba_track_seqlens)
        starts = list(itertools.accumulate(ext, initial=0))[:-1]
        batch = cls(
            forward_mode=forward_mode,
            batch_size=bs,
            input_ids=host_int64(input_ids),
            positions=positions,
            req_pool_indices=_prebuilt_or_int64(built, "req_pool_indices", req_pool_indices),
            req_pool_indices_cpu=list(req_pool_indices),
            seq_lens=seq_lens_tensor,
            seq_lens_cpu=seq_lens,
            out_cache_loc=host_int64(out_cache_loc),
            mamba_pool_indices=_prebuilt_or_int64(built, "mamba_pool_indices", mamba_pool_indices),
            mamba_pool_indices_cpu=list(mamba_pool_indices),
            sampling_info=sampling_info or SamplingBatchInfo.greedy(bs),
            extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=ext,
            extend_start_loc_cpu=starts,
            req_to_token_writes=[
                (row, start, torch.as_tensor(slots, dtype=torch.int64))
                for row, start, slots in req_to_token_writes
            ],
            mamba_track_indices=track_idx,
            mamba_track_indices_cpu=track_idx_cpu,
            mamba_track_mask=None if track_mask is None else host_bool(track_mask),
            mamba_track_mask_cpu=track_mask,
            mamba_track_seqlens=track_len,
            mamba_track_seqlens_cpu=track_len_cpu,
            mamba_extra_tracks=list(mamba_extra_tracks),
            mamba_cow_src_indices=_opt_long(mamba_cow_src_indices),
            mamba_cow_dst_indices=_opt_long(mamba_cow_dst_indices),
            mamba_clear_indices=_opt_long(mamba_clear_indices),
            return_logprob=any(mask),
            return_logprob_mask=mask,
            top_logprobs_nums=list(top_logprobs_nums or []),
            token_ids_logprobs=token_ids_logprobs,
            extend_logprob_start_lens_cpu=list(extend_logprob_start_lens or []),
            extend_logprob_next_ids_cpu=None
            if extend_logprob_next_ids is None
            else list(extend_logprob_next_ids),
        )
        batch.lora_slots = built.get("lora_slots")
        if batch.lora_slots is not None:
            used = [s for s in batch.lora_slots.tolist() if s >= 0]
            batch.lora_slot_range = (min(used), max(used) + 1) if used else None
        if extend:
            batch.extend_seq_lens = host_int64(ext)
            batch.extend_last_loc = host_int64([s + e - 1 for s, e in zip(starts, ext, strict=True)])
        return batch

    @classmethod
    def idle(cls) -> ForwardBatch:
        return cls.create(
            ForwardMode.IDLE,
            input_ids=[],
            req_pool_indices=[],
            seq_lens=[],
            out_cache_loc=[],
            mamba_pool_indices=[],
        )
