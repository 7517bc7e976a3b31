"""What the GDN and Mamba2 backends share: per-batch metadata (running slots, extend segments, track
targets, built once from host lists: `mamba_batch_metadata`), the causal conv over the pool's conv state,
and state capture.

State capture (tracking), extend: for a tracked request with prefix P and extend length E,
`mamba_track_seqlens[i] = S` writes into `mamba_track_indices[i]` the state after the first S tokens;
`mamba_extra_tracks` entries (i, slot, S) write further snapshots of row i by the same rule.
Valid: P < S <= P + E and either S == P + E (the final state) or (S - P) % kernel_state_chunk == 0
(intermediate index (S - P) // kernel_state_chunk; conv state = the inputs at positions S-K+1..S-1).
Anything else raises: the kernel has no such state. The kernel chunk (GDN 64, Mamba2 the config's
chunk size) is not the cache chunk C = max(chunk, page size): with GDN and C = 128 the state after
128·k tokens of an extend from 0 is intermediate index 2·k.

Decode: after the last layer updated the running slots, masked rows copy them (every layer, conv and
SSM, one fused launch: `track_decode_states`) into their track slots: the state after seq_len tokens.

Speculative verify (`ForwardMode.TARGET_VERIFY`): each request's newest token and its drafts run as a
sequence of decode steps, position by position (`forward_verify`): step t reads the state before it
(the running slot at t = 0, else the verify row of t - 1) and leaves the state after it in the verify row
of t (the Triton steps read one row and write the other; the in-place ones update a copy), so every
position's state is kept and the running slot is untouched; the scheduler copies the accepted
position's state into it afterwards.

Every extend starts from the state in its running slot, a request with no prefix too: the scheduler
gives a fresh slot a deferred clear (`mamba_clear_indices`), so zero state is the pool's job, and the
kernels read initial states uniformly by slot (what batched GPU kernels need).
"""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.layers.attention.mamba.causal_conv1d import causal_conv1d_extend, causal_conv1d_update
from sglang.srt.layers.attention.mamba.mamba_batch_metadata import (
    TRITON_KEYS,
    VARLEN_KEYS,
    ExtendSeq,
    LinearMetadata,
    Snapshot,
    VerifyStep,
    cpu_extend_args,
    decode_uses_triton,
    moved_args,
    triton_extend_args,
    triton_extend_host,
    varlen_args,
    varlen_host,
    verify_keys,
    verify_widths,
)
from sglang.srt.layers.cpu_ops import cpu_linear_ops
from sglang.srt.mem_cache.memory_pool import MambaPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.utils.host_tensors import host_int64

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)


# What a linear backend's `forward` reads of a batch to run one decode step (`forward_verify`).
_DECODE_STEP = SimpleNamespace(forward_mode=ForwardMode.DECODE)


# The C++ extend ops run the recurrence token by token: per token and head K*V multiply-adds against
# C*(K+V) for the chunked form (C = the kernel chunk, 64+), so they serve small heads only.
CPU_RECURRENT_MAX_HEAD_DIM = 64


class MambaAttnBackendBase:
    def __init__(
        self, mamba_pool: MambaPool, kernel_state_chunk: int, decode_choice: Any, conv_silu: bool = True
    ):
        """`decode_choice`: the layer kind's decode-step env var (auto, torch or triton); None: the torch
        step. `conv_silu`: SiLU after the conv (GDN's, Mamba2's: the C++ and Triton convs fuse it);
        False (a short conv): the torch conv and state I/O alone serve."""
        self.mamba_pool = mamba_pool
        self.kernel_state_chunk = kernel_state_chunk
        self.conv_kernel = mamba_pool.cache_params.shape.conv_kernel
        self.conv_silu = conv_silu
        self.meta = LinearMetadata()
        # `_verify_uniform`'s tensors by (batch size, width).
        self._uniform_verify: dict[tuple[int, int], tuple[torch.Tensor, list[VerifyStep]]] = {}
        # The sgl-kernel C++ ops on CPU (None: the torch path).
        self.cpu_ops = cpu_linear_ops(mamba_pool.conv_state.device) if conv_silu else None
        # Decode step: the Triton kernels in place on the pool (CUDA), the C++ ops (CPU, unless the
        # layer's choice names torch or triton), or the torch step.
        fused = conv_silu and decode_choice is not None
        self.decode_in_place = fused and decode_uses_triton(mamba_pool.ssm_state.device, decode_choice)
        self.decode_cpp = (
            fused and self.cpu_ops is not None and decode_choice.get() == "auto" and not self.decode_in_place
        )
        # The extend over the packed batch (the layer kind's contract), or None: per request; it
        # returns states every `varlen_chunk` tokens, a divisor of the kernel state chunk.
        self.varlen_impl: Any = None
        self.varlen_chunk = kernel_state_chunk

    # ---- metadata ---------------------------------------------------------------------------------

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_target_verify() and fb.verify_width:
            order, steps = self._verify_uniform(fb.batch_size, fb.verify_width)
            first = VerifyStep(0, fb.batch_size, fb.mamba_pool_indices, steps[0].dst)  # the running slots
            self.meta = LinearMetadata(
                slots=fb.mamba_pool_indices, verify=[first, *steps[1:]], verify_order=order
            )
        elif fb.forward_mode.is_target_verify():
            device = self.mamba_pool.conv_state.device
            moved = moved_args(verify_keys(fb), fb.aux_tensors, lambda: self._verify_host(fb), device)
            bounds = list(itertools.accumulate(verify_widths(fb), initial=0))
            steps = [
                VerifyStep(lo, hi, *moved[1 + 2 * t : 3 + 2 * t])
                for t, (lo, hi) in enumerate(itertools.pairwise(bounds))
            ]
            self.meta = LinearMetadata(slots=fb.mamba_pool_indices, verify=steps, verify_order=moved[0])
        elif fb.forward_mode.is_extend():
            seqs = self._extend_seqs(fb)
            cpu_extend = cpu_extend_args(seqs) if self.cpu_ops is not None else None
            device, aux = self.mamba_pool.conv_state.device, fb.aux_tensors
            triton_extend = triton_extend_args(seqs, aux, device) if self.decode_in_place else None
            varlen = varlen_args(seqs, self.varlen_chunk, aux, device) if self.varlen_impl else None
            self.meta = LinearMetadata(
                slots=fb.mamba_pool_indices,
                extend=seqs,
                cpu_extend=cpu_extend,
                triton_extend=triton_extend,
                varlen=varlen,
            )
        elif fb.forward_mode.is_decode():
            self.meta = LinearMetadata(slots=fb.mamba_pool_indices, track_rows=self._decode_track_rows(fb))
        else:
            self.meta = LinearMetadata()

    def release_metadata(self) -> None:
        """Drop the last batch's metadata and the uniform verifies' tensors (a CUDA graph's capture leaves
        them in that graph's memory pool; the next batch or capture builds them again)."""
        self.meta = LinearMetadata()
        self._uniform_verify.clear()

    def prepare_host_metadata(self, fb: ForwardBatch) -> None:
        """Before the batch moves to the device (`ModelRunner.move_batch`): an extend's index tensors
        for the Triton conv and the packed kernels go into `fb.aux_tensors`, so they reach the device
        in the batch's one copy (`init_forward_metadata` then takes them from there)."""
        if fb.forward_mode.is_target_verify():
            if self.mamba_pool.conv_state.device.type != "cpu" and not fb.verify_width:
                fb.aux_tensors.update(zip(verify_keys(fb), self._verify_host(fb), strict=True))
            return
        if not fb.forward_mode.is_extend() or not (self.decode_in_place or self.varlen_impl):
            return
        seqs = self._extend_seqs(fb)
        if self.decode_in_place:
            fb.aux_tensors.update(zip(TRITON_KEYS, triton_extend_host(seqs), strict=True))
        if self.varlen_impl:
            fb.aux_tensors.update(zip(VARLEN_KEYS, varlen_host(seqs, self.varlen_chunk), strict=True))

    def _verify_host(self, fb: ForwardBatch) -> list[torch.Tensor]:
        """A verify's tensors on the host: the position order of its tokens, then each position's (src,
        dst) slots."""
        pool, lens, starts = self.mamba_pool, fb.extend_seq_lens_cpu, fb.extend_start_loc_cpu
        slots = fb.mamba_pool_indices_cpu
        order, steps = [], []
        for t in range(max(lens, default=0)):
            rows = [b for b, n in enumerate(lens) if n > t]
            order += [starts[b] + t for b in rows]
            src = [slots[b] if t == 0 else pool.verify_row(b, t - 1) for b in rows]
            steps += [host_int64(src), host_int64([pool.verify_row(b, t) for b in rows])]
        return [host_int64(order), *steps]

    def _verify_uniform(self, bs: int, width: int) -> tuple[torch.Tensor, list[VerifyStep]]:
        """A verify of `bs` requests with `width` positions each: its position order and steps, built once
        per shape on the device and kept (a CUDA graph's capture reads them; a replay of the same shape
        finds them unchanged). Step 0's sources are the batch's running slots (the caller's)."""
        key = (bs, width)
        cached = self._uniform_verify.get(key)
        if cached is None:
            pool, device = self.mamba_pool, self.mamba_pool.conv_state.device

            def tensor(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int64, device=device)

            order = tensor([b * width + t for t in range(width) for b in range(bs)])
            dst = [tensor([pool.verify_row(b, t) for b in range(bs)]) for t in range(width)]
            # (step 0's sources are the running slots: a placeholder here)
            steps = [VerifyStep(t * bs, (t + 1) * bs, dst[max(t - 1, 0)], dst[t]) for t in range(width)]
            cached = self._uniform_verify[key] = (order, steps)
        return cached

    def forward_verify(self, layer: Any, fb: ForwardBatch, *inputs: torch.Tensor) -> torch.Tensor:
        """A verify forward of one layer (module docstring): the layer's decode step once per position,
        on the verify rows. `inputs` are the layer's per-token inputs to `forward`, packed as the batch.
        The Triton steps read each position's state from the row before and write its own (no copy);
        the others update in place, so the row before is copied first."""
        conv, ssm = self.mamba_pool.layer_cache(layer.layer_id)
        meta = self.meta
        order = meta.verify_order
        xs = [x.index_select(0, order) for x in inputs]  # position order: each step's inputs are a slice
        outs = []
        try:
            for step in meta.verify:
                if self.decode_in_place:
                    self.meta = LinearMetadata(slots=step.dst, src_slots=step.src)
                else:
                    conv.index_copy_(0, step.dst, conv.index_select(0, step.src))
                    ssm.index_copy_(0, step.dst, ssm.index_select(0, step.src))
                    self.meta = LinearMetadata(slots=step.dst)
                outs.append(self.forward(layer, _DECODE_STEP, *(x[step.lo : step.hi] for x in xs)))
        finally:
            self.meta = meta
        ordered = torch.cat(outs)
        return torch.empty_like(ordered).index_copy_(0, order, ordered)

    def _tracked_rows(self, fb: ForwardBatch) -> list[int]:
        mask = fb.mamba_track_mask_cpu
        if mask is None:
            return []
        assert fb.mamba_track_indices_cpu is not None, "mamba_track_mask needs mamba_track_indices"
        return [i for i, m in enumerate(mask) if m]

    def _extend_seqs(self, fb: ForwardBatch) -> list[ExtendSeq]:
        seqs = [
            ExtendSeq(start, length, prefix, slot)
            for start, length, prefix, slot in zip(
                fb.extend_start_loc_cpu,
                fb.extend_seq_lens_cpu,
                fb.extend_prefix_lens_cpu,
                fb.mamba_pool_indices_cpu,
                strict=True,
            )
        ]
        targets = [
            (i, fb.mamba_track_indices_cpu[i], fb.mamba_track_seqlens_cpu[i]) for i in self._tracked_rows(fb)
        ]
        for i, slot, target in targets + list(fb.mamba_extra_tracks):
            seq = seqs[i]
            offset = target - seq.prefix
            if not 0 < offset <= seq.length:
                raise ValueError(
                    f"Track position {target} of batch row {i} is outside its extend "
                    f"({seq.prefix}, {seq.prefix + seq.length}]."
                )
            if offset == seq.length:
                chunk = None
            elif offset % self.kernel_state_chunk == 0:
                chunk = offset // self.kernel_state_chunk
            else:
                raise ValueError(
                    f"Track position {target} of batch row {i} is neither the end of its extend "
                    f"({seq.prefix + seq.length}) nor a multiple of the kernel state chunk "
                    f"{self.kernel_state_chunk} after the extend start {seq.prefix}."
                )
            seq.tracks.append(Snapshot(slot, offset, chunk))
        return seqs

    def _decode_track_rows(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        rows = self._tracked_rows(fb)
        if not rows:
            return None
        if fb.mamba_track_seqlens_cpu is not None:
            for i in rows:
                if fb.mamba_track_seqlens_cpu[i] != fb.seq_lens_cpu[i]:
                    raise ValueError(
                        f"A decode step snapshots the state after seq_len tokens; batch row {i} asks "
                        f"for {fb.mamba_track_seqlens_cpu[i]} with seq_len {fb.seq_lens_cpu[i]}."
                    )
        return fb.mamba_pool_indices, fb.mamba_track_indices, fb.mamba_track_mask

    # ---- conv and state I/O ------------------------------------------------------------------------

    def conv_extend(
        self,
        layer_id: int,
        seq: ExtendSeq,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Causal conv of one request's extend inputs x [E, C] over its conv state; updates the running
        slot and, if tracked, the track slot. Returns silu(conv) [E, C] float32 (the conv: `conv_silu` off)."""
        conv, _ = self.mamba_pool.layer_cache(layer_id)
        state = conv[seq.slot]
        out, window = causal_conv1d_extend(x, state, weight, bias, self.conv_silu)
        width = self.conv_kernel - 1
        for t in seq.tracks:
            conv[t.slot] = window[t.offset : t.offset + width].t()
        conv[seq.slot] = window[-width:].t()
        return out

    def uses_cpu_extend(self, *head_dims: int) -> bool:
        return self.meta.cpu_extend is not None and max(head_dims) <= CPU_RECURRENT_MAX_HEAD_DIM

    def conv_extend_batch(
        self, layer_id: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`conv_extend` for every request of the batch in one C++ call (`uses_cpu_extend`)."""
        assert self.conv_silu, "the C++ conv applies SiLU"
        conv, _ = self.mamba_pool.layer_cache(layer_id)
        b = None if bias is None else bias.float().contiguous()
        return self.cpu_ops.causal_conv1d_extend(
            x.float().contiguous(), conv, weight.float().contiguous(), b, *self.meta.cpu_extend
        )

    def conv_extend_all(
        self, layer_id: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The conv of every request of the extend in three Triton launches (with the Triton decode
        kernels, i.e. on CUDA), snapshots and running slots written; None elsewhere (then `conv_extend`
        runs per request)."""
        if self.meta.triton_extend is None:
            return None
        assert self.conv_silu, "the Triton conv applies SiLU"
        from sglang.srt.layers.attention.mamba.decode_triton import causal_conv1d_extend_batch

        cu, slots, snaps, max_len = self.meta.triton_extend
        conv, _ = self.mamba_pool.layer_cache(layer_id)
        return causal_conv1d_extend_batch(x, conv, weight, bias, cu, slots, max_len, snaps)

    def conv_extend_packed(
        self, layer_id: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The conv of the whole extend batch x [T, C] (snapshots and running slots written): the Triton
        launches where they serve, else `conv_extend` per request."""
        out = self.conv_extend_all(layer_id, x, weight, bias)
        if out is None:
            out = torch.cat(
                [self.conv_extend(layer_id, seq, x[seq.tokens], weight, bias) for seq in self.meta.extend]
            )
        return out

    def initial_ssm_batch(self, layer_id: int) -> torch.Tensor:
        """The extend's initial states [N, ...] float32, read from the running slots."""
        _, ssm = self.mamba_pool.layer_cache(layer_id)
        return ssm.index_select(0, self.meta.slots).float()

    def store_varlen_states(self, layer_id: int, final: torch.Tensor, chunk_states: torch.Tensor) -> None:
        """A packed-batch kernel's results into the pool: final states into the running slots, then
        each snapshot from its chunk-start or final state (`VarlenExtend`)."""
        _, ssm = self.mamba_pool.layer_cache(layer_id)
        v = self.meta.varlen
        ssm.index_copy_(0, self.meta.slots, final.to(ssm.dtype))
        if v.chunk_rows.numel():
            ssm.index_copy_(0, v.chunk_slots, chunk_states.index_select(0, v.chunk_rows).to(ssm.dtype))
        if v.final_rows.numel():
            ssm.index_copy_(0, v.final_slots, final.index_select(0, v.final_rows).to(ssm.dtype))

    def initial_ssm(self, layer_id: int, seq: ExtendSeq) -> torch.Tensor:
        _, ssm = self.mamba_pool.layer_cache(layer_id)
        return ssm[seq.slot].float()

    def store_ssm(
        self, layer_id: int, seq: ExtendSeq, final: torch.Tensor, intermediate: torch.Tensor | None
    ) -> None:
        _, ssm = self.mamba_pool.layer_cache(layer_id)
        ssm[seq.slot] = final.to(ssm.dtype)
        for t in seq.tracks:
            snap = final if t.chunk is None else intermediate[t.chunk]
            ssm[t.slot] = snap.to(ssm.dtype)

    def needs_intermediate(self, seq: ExtendSeq) -> bool:
        return any(t.chunk is not None for t in seq.tracks)

    def conv_decode(
        self, layer_id: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """One token per request, x [bs, C]; updates the running slots. Returns silu(conv) float32 (the
        conv alone with `conv_silu` off: then only the torch step serves).
        (`index_select` / `index_copy_`: faster than advanced indexing on CPU; benchmark/README.md.)"""
        conv, _ = self.mamba_pool.layer_cache(layer_id)
        slots = self.meta.slots
        if self.decode_in_place:
            from sglang.srt.layers.attention.mamba.decode_triton import causal_conv1d_update_inplace

            return causal_conv1d_update_inplace(x, conv, slots, weight, bias, src_slots=self.meta.src_slots)
        if self.decode_cpp:
            b = None if bias is None else bias.float().contiguous()
            return self.cpu_ops.causal_conv1d_update(
                x.float().contiguous(), conv, slots, weight.float().contiguous(), b
            )
        out, new_state = causal_conv1d_update(x, conv.index_select(0, slots), weight, bias, self.conv_silu)
        conv.index_copy_(0, slots, new_state.to(conv.dtype))
        return out

    def read_ssm_decode(self, layer_id: int) -> torch.Tensor:
        _, ssm = self.mamba_pool.layer_cache(layer_id)
        return ssm.index_select(0, self.meta.slots)

    def write_ssm_decode(self, layer_id: int, state: torch.Tensor) -> None:
        _, ssm = self.mamba_pool.layer_cache(layer_id)
        ssm.index_copy_(0, self.meta.slots, state.to(ssm.dtype))

    def track_decode_states(self) -> None:
        """After the last layer of a decode: copy the running slots of masked rows into their track
        slots, every layer and both state kinds in one launch."""
        if self.meta.track_rows is not None:
            self.mamba_pool.track_copy(*self.meta.track_rows)
