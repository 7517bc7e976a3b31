"""RMSNorm variants of the supported architectures. All normalise in float32 and return the input dtype.
On CPU, float32 activations take one sgl-kernel C++ call (`sgl-kernel/csrc/norm_cpu.cpp`, the same
arithmetic; `SGLANG_CPU_NORM_BACKEND=torch` forces the torch ops); on CUDA every norm is one Triton
kernel (`layers/rmsnorm_triton.py`, the same arithmetic; `SGLANG_GPU_NORM_BACKEND=torch` forces the torch
ops). Both are chosen when the weights are loaded."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.environ import envs
from sglang.srt.layers.cpu_ops import cpu_norm_ops
from sglang.srt.layers.gpu_ops import triton_chosen


def _tri():
    """The Triton kernel's module, imported where a norm runs it (a CPU install may lack triton)."""
    from sglang.srt.layers import rmsnorm_triton

    return rmsnorm_triton


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class _DeviceNorm(nn.Module):
    """Picks the C++ op (CPU) or the Triton kernel (GPU) for this module once its weight is on its
    device (`process_weights_after_loading`)."""

    cpu_ops = None
    triton = False

    def process_weights_after_loading(self) -> None:
        self.cpu_ops = cpu_norm_ops(self.weight.device) if self.weight.dtype == torch.float32 else None
        self.triton = triton_chosen(
            envs.SGLANG_GPU_NORM_BACKEND, self.weight.device, "sglang.srt.layers.rmsnorm_triton"
        )

    def _use_cpu_op(self, x: torch.Tensor) -> bool:
        return self.cpu_ops is not None and x.dtype == torch.float32 and x.device.type == "cpu"


class RMSNorm(_DeviceNorm):
    """`weight * norm(x)` (Nemotron-H), or `(1 + weight) * norm(x)` with `offset_one` (Qwen3-Next, whose
    checkpoints store the weight centred on 0)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset_one: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if offset_one else torch.ones(hidden_size))
        self.eps = eps
        self.offset_one = offset_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton:
            tri = _tri()
            return tri.rmsnorm_triton(x, self.weight, self.eps, tri.PLAIN, offset_one=self.offset_one)
        if self._use_cpu_op(x):
            return self.cpu_ops.rmsnorm(
                x.contiguous(), self.weight, self.eps, 1.0 if self.offset_one else 0.0
            )
        w = self.weight.float()
        if self.offset_one:
            w = 1.0 + w
        return (_rms(x.float(), self.eps) * w).to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(residual + x), residual + x): a decoder layer's residual add and its next norm, as
        upstream's fused add-RMSNorm; residual None (the first layer's input): (self(x), x). With the
        Triton kernel one launch; otherwise the add, then the norm (the same values: the kernel rounds
        the sum where torch's add does)."""
        if residual is None:
            return self(x), x
        if self.triton and x.shape == residual.shape and x.dtype == residual.dtype:
            tri = _tri()
            return tri.add_rmsnorm_triton(x, residual, self.weight, self.eps, offset_one=self.offset_one)
        total = residual + x
        return self(total), total


class GatedRMSNorm(_DeviceNorm):
    """Qwen3-Next's gated norm over the last dim: `weight * norm(x) * silu(gate)` (norm before gate)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.triton:
            tri = _tri()
            return tri.rmsnorm_triton(x, self.weight, self.eps, tri.GATE_AFTER, gate=gate)
        if self._use_cpu_op(x) and gate.dtype == torch.float32:
            return self.cpu_ops.gated_rmsnorm(
                x.contiguous(), gate.contiguous(), self.weight, self.eps, x.shape[-1], False
            )
        # The oracle casts the normalised value to the input dtype before the weight: same here, so
        # that bfloat16 rounds where it does.
        y = self.weight * _rms(x.float(), self.eps).to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


class GroupedGatedRMSNorm(_DeviceNorm):
    """Nemotron-H's Mamba2 output norm: `x * silu(gate)` first, then RMSNorm within groups of
    `group_size` channels, then the weight (gate before norm). With `gate_first=False` (Falcon-H1's
    `mamba_norm_before_gate`): the grouped norm, the weight, then `* silu(gate)`."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6, gate_first: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps
        self.gate_first = gate_first

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.triton:
            tri, out_dtype = _tri(), torch.promote_types(self.weight.dtype, x.dtype)
            mode = tri.GATE_FIRST if self.gate_first else tri.GATE_AFTER
            return tri.rmsnorm_triton(
                x, self.weight, self.eps, mode, gate=gate, group_size=self.group_size, out_dtype=out_dtype
            )
        if self._use_cpu_op(x) and gate.dtype == torch.float32:
            return self.cpu_ops.gated_rmsnorm(
                x.contiguous(), gate.contiguous(), self.weight, self.eps, self.group_size, self.gate_first
            )
        dtype = x.dtype
        if not self.gate_first:
            # Falcon-H1's order: float32 throughout, one rounding at the end (the Triton kernel's
            # GATE_AFTER rounds twice more, as Qwen3-Next's norm does: a bfloat16 step or two apart).
            shape = x.shape
            normed = _rms(x.float().view(*shape[:-1], -1, self.group_size), self.eps).view(shape)
            return (self.weight.float() * normed * F.silu(gate.float())).to(dtype)
        y = x.float() * F.silu(gate.float())
        shape = y.shape
        y = _rms(y.view(*shape[:-1], -1, self.group_size), self.eps).view(shape)
        return self.weight * y.to(dtype)


class SplitGroupGatedRMSNorm(nn.Module):
    """`GroupedGatedRMSNorm` on one tensor-parallel rank whose channels are part of a norm group that
    spans several ranks (a Mamba2 mixer with fewer groups than ranks: `Mamba2Shards`). The group's
    sum of squares is the sum of every rank's partial sum: each rank puts its own into its group's
    column of a [T, num_groups] tensor, one all-reduce adds them up, so the norm is the unsplit one
    (float32 sums, added in another order). The torch ops only: the C++ and Triton kernels normalise
    within one process."""

    cpu_ops = None  # no whole-block C++ call takes it (`decode_blocks.py`)
    triton = False

    def __init__(
        self, local_size: int, group_size: int, num_groups: int, group: int, eps: float, gate_first: bool
    ):
        """`local_size` channels of norm group `group` (of `num_groups`, each `group_size` wide)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_size))
        self.group_size, self.num_groups, self.group = group_size, num_groups, group
        self.eps = eps
        self.gate_first = gate_first

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float() * F.silu(gate.float()) if self.gate_first else x.float()
        sums = y.new_zeros(y.shape[0], self.num_groups)
        sums[:, self.group] = y.pow(2).sum(-1)
        total = tensor_model_parallel_all_reduce(sums)[:, self.group : self.group + 1]
        y = y * torch.rsqrt(total / self.group_size + self.eps)
        if self.gate_first:
            return self.weight * y.to(dtype)
        return (self.weight.float() * y * F.silu(gate.float())).to(dtype)
