"""Mamba2 backend: causal conv over the pooled conv state, then the SSD chunked scan (chunk = the
config's chunk size) for extends (over the whole packed batch where `varlen_impl` is set: FLA on CUDA,
`ssd_varlen.py`; else per request, or sgl-kernel's C++ op on CPU) and the selective state update for decodes: in place on the pool,
by the Triton kernels on CUDA (`decode_triton.py`) and sgl-kernel's C++ ops on CPU where they are built
(float32 layers: gating, conv and state update as one call, `mamba2_mixer_decode`); torch otherwise
(`SGLANG_MAMBA2_DECODE_BACKEND` forces torch or triton).

The layer passes the conv inputs `xBC` [T, I + 2*G*N] (channel order x | B | C) and the raw time step
dt [T, H]; it reads the layer's `layer_id`, `conv1d`, `A_log`, `D`, `dt_bias`, `time_step_min` and
sizes. dt = softplus(dt + dt_bias) is clamped to >= time_step_min on both paths, so a state does not
depend on which path produced it. Returns y [T, H, P] (D skip included, gate not applied) in float32,
or, from the Triton decode step, in the layer's dtype (the rounding the caller's cast would make).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from sglang.srt.environ import envs
from sglang.srt.layers.attention.mamba.mamba_backend_base import MambaAttnBackendBase
from sglang.srt.layers.attention.mamba.ssd import selective_state_update, ssd_chunk_scan
from sglang.srt.layers.attention.mamba.ssd_varlen import ssd_varlen_impl
from sglang.srt.mem_cache.memory_pool import MambaPool

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class Mamba2AttnBackend(MambaAttnBackendBase):
    def __init__(self, mamba_pool: MambaPool, kernel_state_chunk: int):
        super().__init__(mamba_pool, kernel_state_chunk, envs.SGLANG_MAMBA2_DECODE_BACKEND)
        self.varlen_impl, self.varlen_chunk = ssd_varlen_impl(mamba_pool.ssm_state.device, kernel_state_chunk)

    def forward(self, layer: Any, fb: ForwardBatch, xBC: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        weight = layer.conv1d.weight.view(layer.conv1d.weight.shape[0], -1)
        lid = layer.layer_id
        if self.decode_cpp and fb.forward_mode.is_decode() and _all_float32(xBC, dt, weight, layer):
            # The whole step in one C++ call on the projection's slices: the same arithmetic as the
            # gating, conv and state-update calls below, without the copies and calls between them.
            conv, ssm = self.mamba_pool.layer_cache(lid)
            return self.cpu_ops.mamba2_mixer_decode(
                xBC, dt, layer.dt_bias, layer.A_log, layer.D, layer.time_step_min, conv, weight,
                layer.conv1d.bias, ssm, self.meta.slots, layer.num_heads, layer.head_dim, layer.n_groups,
                layer.ssm_state_size,
            )  # fmt: skip
        if self.decode_in_place and fb.forward_mode.is_decode():
            # The Triton step (CUDA): the gating (dt's softplus and clamp, A = -exp(A_log)) in the kernel
            # on the projection's raw dt, y in the layer's dtype (no cast after).
            from sglang.srt.layers.attention.mamba.decode_triton import mamba2_decode_inplace

            return mamba2_decode_inplace(
                self.conv_decode(lid, xBC, weight, layer.conv1d.bias), dt, None, layer.D,
                self.mamba_pool.layer_cache(lid)[1], self.meta.slots, layer.num_heads, layer.head_dim,
                layer.n_groups, layer.ssm_state_size, src_slots=self.meta.src_slots,
                gates=(layer.dt_bias, layer.A_log, layer.time_step_min), out_dtype=xBC.dtype,
            )  # fmt: skip
        if self.cpu_ops is not None and dt.dtype == layer.A_log.dtype == layer.dt_bias.dtype == torch.float32:
            # One C++ call instead of ~6 small ops per layer (the same float32 arithmetic).
            dt, A = self.cpu_ops.mamba2_gating(dt, layer.dt_bias, layer.A_log, layer.time_step_min)
        else:
            A = -torch.exp(layer.A_log.float())
            dt = F.softplus(dt.float() + layer.dt_bias.float()).clamp(min=layer.time_step_min)
        if fb.forward_mode.is_decode():
            xbc = self.conv_decode(lid, xBC, weight, layer.conv1d.bias)
            if self.decode_cpp:
                return self.cpu_ops.mamba2_decode(
                    xbc,
                    dt.contiguous(),
                    A.contiguous(),
                    layer.D.float().contiguous(),
                    self.mamba_pool.layer_cache(lid)[1],
                    self.meta.slots,
                    layer.num_heads,
                    layer.head_dim,
                    layer.n_groups,
                    layer.ssm_state_size,
                )
            x, B, C = self._split(layer, xbc)
            y, state = selective_state_update(self.read_ssm_decode(lid), x, dt, A, B, C, layer.D)
            self.write_ssm_decode(lid, state)
            return y
        if self.varlen_impl is not None:
            xbc = self.conv_extend_packed(lid, xBC, weight, layer.conv1d.bias)
            x, B, C = self._split(layer, xbc, expand=False)
            v_meta = self.meta.varlen
            y, final, chunk_states = self.varlen_impl(
                x, dt, A, B, C, layer.D, self.initial_ssm_batch(lid), v_meta.cu_seqlens, v_meta.cu_seqlens_cpu,
                self.varlen_chunk, chunk_indices=v_meta.chunk_indices, chunk_offsets=v_meta.chunk_offsets,
            )  # fmt: skip
            self.store_varlen_states(lid, final, chunk_states)
            return y
        if self.uses_cpu_extend(layer.head_dim, layer.ssm_state_size):
            xbc = self.conv_extend_batch(lid, xBC, weight, layer.conv1d.bias)
            return self.cpu_ops.mamba2_extend(
                xbc,
                dt.contiguous(),
                A.contiguous(),
                layer.D.float().contiguous(),
                self.mamba_pool.layer_cache(lid)[1],
                *self.meta.cpu_extend,
                layer.num_heads,
                layer.head_dim,
                layer.n_groups,
                layer.ssm_state_size,
            )
        y = torch.empty(xBC.shape[0], layer.num_heads, layer.head_dim, dtype=torch.float32, device=dt.device)
        conv_all = self.conv_extend_all(lid, xBC, weight, layer.conv1d.bias)
        for seq in self.meta.extend:
            xbc = (
                conv_all[seq.tokens]
                if conv_all is not None
                else self.conv_extend(lid, seq, xBC[seq.tokens], weight, layer.conv1d.bias)
            )
            x, B, C = self._split(layer, xbc)
            out, final, inter = ssd_chunk_scan(
                x,
                dt[seq.tokens],
                A,
                B,
                C,
                layer.D,
                self.initial_ssm(lid, seq),
                self.kernel_state_chunk,
                return_intermediate=self.needs_intermediate(seq),
            )
            self.store_ssm(lid, seq, final, inter)
            y[seq.tokens] = out
        return y

    @staticmethod
    def _split(
        layer: Any, xbc: torch.Tensor, expand: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [..., I + 2GN] -> x [..., H, P], B and C [..., H, N] (each group shared by
        consecutive heads; [..., G, N] without `expand`)."""
        h, p, g, n = layer.num_heads, layer.head_dim, layer.n_groups, layer.ssm_state_size
        x, B, C = xbc.split([h * p, g * n, g * n], dim=-1)
        lead = xbc.shape[:-1]
        B, C = B.reshape(*lead, g, n), C.reshape(*lead, g, n)
        if expand:
            B, C = B.repeat_interleave(h // g, dim=-2), C.repeat_interleave(h // g, dim=-2)
        return x.reshape(*lead, h, p), B, C


def _all_float32(xBC: torch.Tensor, dt: torch.Tensor, weight: torch.Tensor, layer: Any) -> bool:
    """The fused decode op's inputs are float32 as they are (a bfloat16 model takes the separate calls,
    which convert)."""
    bias = layer.conv1d.bias
    return all(t.dtype == torch.float32 for t in (xBC, dt, weight, layer.dt_bias, layer.A_log, layer.D)) and (
        bias is None or bias.dtype == torch.float32
    )
