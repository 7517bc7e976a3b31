"""Gated DeltaNet backend: causal conv over the pooled conv state, then the gated delta rule over the
pooled SSM state, in 64-token kernel chunks for extends and one recurrent step for decodes.

The extend runs over the whole packed batch where `varlen_impl` is set (flash-linear-attention on CUDA,
`gdn_varlen.py`), else per request (torch's chunked form, or sgl-kernel's C++ op on CPU for small heads).
The decode step is the Triton kernel that updates the pool in place (`gdn_decode_triton.py`) on CUDA,
sgl-kernel's C++ op (also in place, q/k normalisation fused) on CPU where it is built, and the torch
step (gather, update, scatter) otherwise; `SGLANG_GDN_DECODE_BACKEND` / `SGLANG_CPU_LINEAR_ATTN_BACKEND`
force one.

The layer passes the conv inputs `mixed_qkv` [T, 2*Hk*Dk + Hv*Dv] (channel order q | k | v, as the
conv state stores them) and its gate projections a, b [T, Hv]; the gates (log-decay g = -exp(A_log) *
softplus(a + dt_bias), write strength beta = sigmoid(b)) are computed here (`gdn_gates`), inside the
kernel on the CUDA decode path. It reads the layer's `layer_id`, `conv1d` weight, `A_log`, `dt_bias`,
`cpu_ops` and head sizes. Returns the core output [T, Hv, Dv] in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from sglang.srt.environ import envs
from sglang.srt.layers.attention.linear.gated_delta_rule import (
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule_step,
)
from sglang.srt.layers.attention.linear.gdn_varlen import gdn_varlen_impl
from sglang.srt.layers.attention.mamba.mamba_backend_base import MambaAttnBackendBase
from sglang.srt.mem_cache.memory_pool import MambaPool

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def gdn_gates(layer: Any, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-decay g and write strength beta [T, Hv] in float32, from the layer's raw projections: one
    sgl-kernel call on CPU (the layer's `cpu_ops`, SGLANG_CPU_LINEAR_ATTN_BACKEND), else torch ops."""
    if layer.cpu_ops is not None and a.dtype == torch.float32:
        return layer.cpu_ops.gdn_gating(a, b, layer.A_log, layer.dt_bias)
    beta = b.float().sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    return g, beta


class GDNAttnBackend(MambaAttnBackendBase):
    def __init__(self, mamba_pool: MambaPool, kernel_state_chunk: int):
        super().__init__(mamba_pool, kernel_state_chunk, envs.SGLANG_GDN_DECODE_BACKEND)
        self.varlen_impl = gdn_varlen_impl(mamba_pool.ssm_state.device)

    def forward(
        self, layer: Any, fb: ForwardBatch, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:
        weight = layer.conv1d.weight.view(layer.conv1d.weight.shape[0], -1)
        lid = layer.layer_id
        if fb.forward_mode.is_decode():
            x = self.conv_decode(lid, mixed_qkv, weight, layer.conv1d.bias)
            if self.decode_in_place:  # the gates and the q/k prep inside the kernel
                from sglang.srt.layers.attention.linear.gdn_decode_triton import gdn_decode_inplace

                return gdn_decode_inplace(
                    x, a, b, layer.A_log, layer.dt_bias, self.mamba_pool.layer_cache(lid)[1], self.meta.slots,
                    layer.num_k_heads, layer.head_k_dim, src_slots=self.meta.src_slots, out_dtype=mixed_qkv.dtype,
                )  # fmt: skip
            g, beta = gdn_gates(layer, a, b)
            if self.decode_cpp:
                return self.cpu_ops.gdn_decode(
                    x,
                    g.contiguous(),
                    beta.contiguous(),
                    self.mamba_pool.layer_cache(lid)[1],
                    self.meta.slots,
                    layer.num_k_heads,
                    layer.num_v_heads,
                    layer.head_k_dim,
                    layer.head_v_dim,
                )
            q, k, v = self._split_heads(layer, x)
            out, state = recurrent_gated_delta_rule_step(q, k, v, g, beta, self.read_ssm_decode(lid))
            self.write_ssm_decode(lid, state)
            return out
        g, beta = gdn_gates(layer, a, b)
        if self.varlen_impl is not None:
            x = self.conv_extend_packed(lid, mixed_qkv, weight, layer.conv1d.bias)
            q, k, v = self._split_heads(layer, x, expand=False)
            v_meta = self.meta.varlen
            out, final, chunk_states = self.varlen_impl(
                q, k, v, g, beta, self.initial_ssm_batch(lid), v_meta.cu_seqlens, v_meta.cu_seqlens_cpu,
                self.varlen_chunk, chunk_indices=v_meta.chunk_indices, chunk_offsets=v_meta.chunk_offsets,
            )  # fmt: skip
            self.store_varlen_states(lid, final, chunk_states)
            return out.float()
        if self.uses_cpu_extend(layer.head_k_dim, layer.head_v_dim):
            x = self.conv_extend_batch(lid, mixed_qkv, weight, layer.conv1d.bias)
            return self.cpu_ops.gdn_extend(
                x,
                g.contiguous(),
                beta.contiguous(),
                self.mamba_pool.layer_cache(lid)[1],
                *self.meta.cpu_extend,
                layer.num_k_heads,
                layer.num_v_heads,
                layer.head_k_dim,
                layer.head_v_dim,
            )
        out = torch.empty(
            mixed_qkv.shape[0], layer.num_v_heads, layer.head_v_dim, dtype=torch.float32, device=g.device
        )
        conv_all = self.conv_extend_all(lid, mixed_qkv, weight, layer.conv1d.bias)
        for seq in self.meta.extend:
            x = (
                conv_all[seq.tokens]
                if conv_all is not None
                else self.conv_extend(lid, seq, mixed_qkv[seq.tokens], weight, layer.conv1d.bias)
            )
            q, k, v = self._split_heads(layer, x)
            o, final, inter = chunk_gated_delta_rule(
                q,
                k,
                v,
                g[seq.tokens],
                beta[seq.tokens],
                self.initial_ssm(lid, seq),
                self.kernel_state_chunk,
                return_intermediate=self.needs_intermediate(seq),
            )
            self.store_ssm(lid, seq, final, inter)
            out[seq.tokens] = o
        return out

    @staticmethod
    def _split_heads(
        layer: Any, x: torch.Tensor, expand: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [..., C] -> q, k [..., Hv, Dk] (normalised, q scaled, key heads shared by
        consecutive value heads; [..., Hk, Dk] without `expand`) and v [..., Hv, Dv]."""
        hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
        q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
        lead = x.shape[:-1]
        q = l2norm(q.reshape(*lead, hk, dk)) * dk**-0.5
        k = l2norm(k.reshape(*lead, hk, dk))
        if hv != hk and expand:
            q = q.repeat_interleave(hv // hk, dim=-2)
            k = k.repeat_interleave(hv // hk, dim=-2)
        return q, k, v.reshape(*lead, hv, dv)
