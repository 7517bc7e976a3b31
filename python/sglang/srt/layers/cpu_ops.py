"""sgl-kernel's C++ ops for CPU tensors, and the env vars that choose them:
- `SGLANG_CPU_LINEAR_ATTN_BACKEND` (`sgl-kernel/csrc/linear_attn_cpu.cpp`), the linear-attention layers:
  decode: the conv update and the Gated DeltaNet / Mamba2 state updates, in place on the pool, one call
  each instead of ~30 small torch ops and whole-state gather/scatter copies; both layers' gates (time
  step, decay) one call each, decode and extend; extend: the conv and the
  GDN / Mamba2 recurrence over the whole variable-length batch in one call each (no Python loop per
  request), with the snapshots the prefix cache asks for; used for heads of at most
  `CPU_RECURRENT_MAX_HEAD_DIM` (`mamba_backend_base.py`), larger ones keep the chunked torch form;
- `SGLANG_CPU_ATTN_BACKEND` (`sgl-kernel/csrc/attention_cpu.cpp`), the full-attention decode: the paged
  KV read in place through `req_to_token` instead of SDPA over a gathered, padded copy;
- `SGLANG_CPU_MOE_BACKEND` (`sgl-kernel/csrc/moe_cpu.cpp`, `moe_routing_cpu.cpp`), the routed experts of
  small MoE layers at decode sizes, with the layer's shared expert in the same call
  (`layers/moe/experts.py`), instead of torch's grouped GEMMs, and their top-k routing
  (`layers/moe/router.py`);
- `SGLANG_CPU_NORM_BACKEND` (`sgl-kernel/csrc/norm_cpu.cpp`), the RMSNorms of float32 activations
  (`layers/layernorm.py`), one call instead of ~7 small ops;
- `SGLANG_CPU_ROPE_BACKEND` (`sgl-kernel/csrc/rope_cpu.cpp`), the rotary embedding of float32 q and k
  (`layers/rotary_embedding.py`), one call instead of ~20 small ops;
- `SGLANG_CPU_SAMPLING_BACKEND` (`sgl-kernel/csrc/sampling_cpu.cpp`), sampling of float32 logits
  (`layers/sampler.py`), two passes over the logits instead of ~5, and a cut (top-k / top-p / min-p)
  from a sort of only the likely tokens instead of a partial sort of every row.

Each is auto (the C++ ops where sgl-kernel's CPU extension is built, else the torch path), torch (force
the torch path, for debugging) or cpp (the C++ ops, or a startup error). Where every part of a decoder
block runs its C++ op, a decode step calls the whole block as one C++ call (`layers/decode_blocks.py`,
`SGLANG_CPU_DECODE_BLOCKS`).
"""

from __future__ import annotations

from typing import Any

import torch

from sglang.srt.environ import EnvStr, envs

CHOICES = ("auto", "torch", "cpp")


def _cpu_ops(env: EnvStr, device: torch.device | str) -> Any | None:
    choice, name = env.get(), env.name
    if choice not in CHOICES:
        raise ValueError(f"{name} must be one of {', '.join(CHOICES)}; got {choice!r}.")
    if torch.device(device).type != "cpu" or choice == "torch":
        return None
    from sglang.srt.utils.sgl_kernel import load_extension

    module, reason = load_extension("cpu")
    if module is None:
        if choice == "cpp":
            raise ValueError(f"{name}=cpp cannot run: {reason}.")
        return None
    return torch.ops.sgl_kernel


def cpu_linear_ops(device: torch.device | str) -> Any | None:
    """`torch.ops.sgl_kernel` when the C++ linear-attention ops serve tensors on `device`, else None."""
    return _cpu_ops(envs.SGLANG_CPU_LINEAR_ATTN_BACKEND, device)


def cpu_attention_ops(device: torch.device | str) -> Any | None:
    """`torch.ops.sgl_kernel` when the C++ decode attention serves tensors on `device`, else None."""
    return _cpu_ops(envs.SGLANG_CPU_ATTN_BACKEND, device)


def cpu_moe_ops(device: torch.device | str) -> Any | None:
    """`torch.ops.sgl_kernel` when the C++ routed experts serve tensors on `device`, else None."""
    return _cpu_ops(envs.SGLANG_CPU_MOE_BACKEND, device)


def cpu_norm_ops(device: torch.device | str) -> Any | None:
    """`torch.ops.sgl_kernel` when the C++ RMSNorms serve tensors on `device`, else None."""
    return _cpu_ops(envs.SGLANG_CPU_NORM_BACKEND, device)


def cpu_rope_ops(device: torch.device | str) -> Any | None:
    """`torch.ops.sgl_kernel` when the C++ rotary embedding serves tensors on `device`, else None."""
    return _cpu_ops(envs.SGLANG_CPU_ROPE_BACKEND, device)


def cpu_sampling_ops(device: torch.device | str) -> Any | None:
    """`torch.ops.sgl_kernel` when the C++ sampling serves logits on `device`, else None."""
    return _cpu_ops(envs.SGLANG_CPU_SAMPLING_BACKEND, device)
