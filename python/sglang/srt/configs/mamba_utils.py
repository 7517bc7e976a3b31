"""Shapes, dtypes and byte sizes of the recurrent state one request slot holds.

Pool layout (per linear layer, per slot):
  conv state      (conv_dim, conv_kernel - 1)   the last K-1 inputs of the causal conv, window last
  temporal (SSM)  (num_heads, head_dim, state_size)
For Mamba2 `head_dim` is the head's channel count and `state_size` is N. For Gated DeltaNet the
upstream convention is used: heads = value heads, head_dim = value head dim, state = key head dim,
so one head's state S maps a key to a value (v ~ S k).

Under tensor parallelism each rank's pool holds its own heads only: `create` divides the heads and the
conv channels by the TP size (the conv state is q | k | v, or x | B | C, each sub-block split on its own,
so its per-rank size is the sum of the sub-blocks' parts). Groups (Gated DeltaNet's key heads, Mamba2's
B / C groups) split where the TP size divides their count, else every rank holds them all (upstream pads
Mamba2 groups up to the TP size instead; replicating holds the same values without the padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sglang.srt.distributed import get_tensor_model_parallel_world_size
from sglang.srt.environ import envs

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_from_name(name: str, what: str) -> torch.dtype:
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"{what} must be one of {sorted(DTYPE_NAMES)}, got {name!r}.") from None


@dataclass(frozen=True, kw_only=True)
class Mamba2StateShape:
    conv: tuple[int, int]
    temporal: tuple[int, int, int]
    conv_kernel: int

    @classmethod
    def create(
        cls,
        *,
        intermediate_size: int,
        n_groups: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        conv_kernel: int,
        tp_world_size: int | None = None,
    ) -> Mamba2StateShape:
        """One rank's shapes at `tp_world_size` (default: this process's TP group's size)."""
        tp = get_tensor_model_parallel_world_size() if tp_world_size is None else tp_world_size
        if num_heads % tp or intermediate_size % tp:
            raise ValueError(
                f"The linear layers' {num_heads} heads ({intermediate_size} channels) do not split over "
                f"--tp-size {tp}."
            )
        groups = n_groups // tp if n_groups % tp == 0 else n_groups
        conv_dim = intermediate_size // tp + 2 * groups * state_size
        return cls(
            conv=(conv_dim, conv_kernel - 1),
            temporal=(num_heads // tp, head_dim, state_size),
            conv_kernel=conv_kernel,
        )

    @property
    def conv_dim(self) -> int:
        return self.conv[0]


@dataclass(frozen=True)
class Mamba2StateDType:
    conv: torch.dtype
    temporal: torch.dtype


@dataclass(frozen=True, kw_only=True)
class Mamba2CacheParams:
    shape: Mamba2StateShape
    dtype: Mamba2StateDType
    layers: tuple[int, ...]

    @property
    def bytes_per_layer(self) -> int:
        conv = math.prod(self.shape.conv) * self.dtype.conv.itemsize
        temporal = math.prod(self.shape.temporal) * self.dtype.temporal.itemsize
        return conv + temporal

    @property
    def mamba_cache_per_req(self) -> int:
        """Bytes of one pool slot across all linear layers."""
        return self.bytes_per_layer * len(self.layers)


def resolve_state_dtypes(
    model_dtype: torch.dtype, config_ssm_dtype: str | None, ssm_dtype_flag: str | None
) -> Mamba2StateDType:
    """Conv state follows the model dtype unless SGLANG_MAMBA_CONV_DTYPE says otherwise; the SSM
    state is `--mamba-ssm-dtype`, else SGLANG_MAMBA_SSM_DTYPE, else the model config's, else float32."""
    conv_name = envs.SGLANG_MAMBA_CONV_DTYPE.get()
    conv = dtype_from_name(conv_name, "SGLANG_MAMBA_CONV_DTYPE") if conv_name else model_dtype
    if ssm_dtype_flag:
        temporal = dtype_from_name(ssm_dtype_flag, "--mamba-ssm-dtype")
    elif envs.SGLANG_MAMBA_SSM_DTYPE.get():
        temporal = dtype_from_name(envs.SGLANG_MAMBA_SSM_DTYPE.get(), "SGLANG_MAMBA_SSM_DTYPE")
    elif config_ssm_dtype:
        temporal = dtype_from_name(config_ssm_dtype, "the model config's mamba SSM dtype")
    else:
        temporal = torch.float32
    return Mamba2StateDType(conv=conv, temporal=temporal)
