"""Run the accelerator path on a machine without one, to catch device mixing and host syncs in CI.

The model, its pools and every batch are put on torch's `meta` device, which stands in for CUDA:
meta tensors have a device, shape and dtype but no data, so every op runs (as shape arithmetic) and
`DeviceAudit`, a dispatch mode that sees every aten op, records:
- `mixed`: ops whose tensor arguments sit on different devices (0-dim CPU scalars aside), which CUDA
  refuses or pays a hidden copy for;
- `host_reads`: reads of a device value on the host (`.item()`, `.tolist()`, `int(t)`), each a device
  sync; they return 0 so that the code goes on and every one is counted;
- `h2d` / `d2h`: copies between the host and the device (a copy out of meta gives an empty host
  tensor).

Values are never computed: this checks where tensors live and what the host waits for, not what the
model outputs (the CPU tests do that). Branches taken only on CUDA itself (pinned buffers, events, the
CUDA stream) are not reached.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten


def _where() -> str:
    """The innermost frame of this project's runtime code that led to the op."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/sglang/srt/" in path:
            return f"{path.split('/sglang/')[-1]}:{frame.lineno}"
    return "?"


@dataclass
class DeviceAudit(TorchDispatchMode):
    device: str = "meta"
    mixed: list[str] = field(default_factory=list)
    host_reads: list[str] = field(default_factory=list)
    h2d: list[str] = field(default_factory=list)
    d2h: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __enter__(self):
        # `torch.tensor(data, device=...)` copies host data to the device below the dispatcher, where
        # no mode sees it: count it here.
        self._tensor = real = torch.tensor

        def counted(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == self.device:
                self.h2d.append(_where())
            return real(*args, **kwargs)

        torch.tensor = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.tensor = self._tensor
        return super().__exit__(*exc)

    def reset(self) -> None:
        for events in (self.mixed, self.host_reads, self.h2d, self.d2h):
            events.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._local_scalar_dense.default, aten.item.default) and args[0].is_meta:
            self.host_reads.append(_where())
            return False if args[0].dtype == torch.bool else 0
        if func.overloadpacket in (aten._to_copy, aten.to):
            target = kwargs.get("device") or next((a for a in args if isinstance(a, torch.device)), None)
            src, dst = args[0].device, torch.device(target) if target is not None else args[0].device
            if src.type != dst.type:
                (self.h2d if dst.type == self.device else self.d2h).append(_where())
                if src.type == self.device:  # out of meta: an empty host tensor
                    dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
                    return torch.zeros(args[0].shape, dtype=dtype or args[0].dtype, device=dst)
                return func(*args, **kwargs)
        if func is aten.copy_.default and args[0].device.type != args[1].device.type:
            (self.h2d if args[0].is_meta else self.d2h).append(_where())
            return args[0] if args[1].is_meta else func(*args, **kwargs)
        devices = {
            t.device.type
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)
        }
        if len(devices) > 1:
            self.mixed.append(f"{func} at {_where()}")
        return func(*args, **kwargs)


# Ops that only make a new view of a tensor (or read its metadata): no kernel runs for them on CUDA.
VIEW_OPS = frozenset(
    """alias as_strided detach expand permute select slice split split_with_sizes squeeze t transpose
    unbind unflatten unfold unsqueeze view view_as _reshape_alias _unsafe_view lift_fresh
    sym_size sym_stride sym_numel sym_storage_offset is_same_size""".split()
)

ALLOCATIONS = frozenset(("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"))


@dataclass
class OpCensus(TorchDispatchMode):
    """Counts the aten ops that run a kernel (views left out), each with where the runtime called it:
    on CUDA each is about one kernel launch, so over a decode step this is what a CUDA graph replays.
    Each op also notes whether `in_body` (a list its user pushes to while a region runs, e.g. a CUDA
    graph's body) was non-empty."""

    ops: list[tuple[str, str, bool]] = field(default_factory=list)
    in_body: list = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        # A view or an input handed back (`.to` its own dtype, `reshape` of a contiguous tensor) shares
        # an input's storage (inference tensors record no view base); an in-place op (`copy_`,
        # `index_add_`) does too but runs a kernel. An allocation runs none.
        storages = {a.untyped_storage()._cdata for a in inputs}
        handed_back = isinstance(out, torch.Tensor) and out.untyped_storage()._cdata in storages
        no_kernel = name in VIEW_OPS or name in ALLOCATIONS or (handed_back and not name.endswith("_"))
        if not no_kernel and any(t.is_meta for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
            self.ops.append((name, _where(), bool(self.in_body)))
        return out


class RecordedLaunches:
    """Stands in for `jit_for_env` in the Triton kernel modules: `kernel[grid](...)` records the
    kernel, checks that the grid is host ints (a device value there would sync) and notes the devices
    of its tensor arguments, and runs nothing (the kernels are tested against their torch twins in
    test/unit/kernels)."""

    MODULES = (
        "sglang.srt.layers.attention.linear.gdn_decode_triton",
        "sglang.srt.layers.attention.mamba.decode_triton",
        "sglang.srt.layers.attention.triton_ops.decode_attention",
        "sglang.srt.layers.attention.triton_ops.extend_attention",
        "sglang.srt.layers.attention.triton_ops.output_gate",
        "sglang.srt.layers.attention.triton_ops.store_kv",
        "sglang.srt.layers.rmsnorm_triton",
        "sglang.srt.layers.rotary_triton",
        "sglang.srt.layers.moe.routing_triton",
        "sglang.srt.layers.moe.dispatch_triton",
        "sglang.srt.layers.moe.elementwise_triton",
        "sglang.srt.layers.moe.fused_moe_fp8_triton",  # (the fused 16-bit MoE GEMMs' kernel too)
    )

    def __init__(self) -> None:
        self.calls: list[tuple[str, set[str]]] = []

    def __call__(self, fn):
        recorder = self

        class Launcher:
            def __getitem__(self, grid):
                assert all(type(g) is int for g in grid), f"{fn.__name__}: grid {grid} is not host ints"

                def launch(*args, **kwargs):
                    devices = {
                        a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                    }
                    recorder.calls.append((fn.__name__, devices))

                return launch

        return Launcher()

    def patches(self) -> list[tuple[object, str, object]]:
        """(module, "jit_for_env", self) for each Triton kernel module, to set with monkeypatch or
        `setattr`."""
        import importlib

        return [(importlib.import_module(name), "jit_for_env", self) for name in self.MODULES]


# What CUDA runs by default, forced where the meta device stands in for it: the Triton decode steps,
# norms, rotary embedding, attention output gate, MoE routing and dispatch with the fused 16-bit MoE GEMMs up to 256 tokens
# (`triton`: auto's CUDA choice on any device), the packed extend (FLA's on a GPU; the same packed
# layout), no CPU C++ ops.
CUDA_DEFAULT_ENV = {
    "SGLANG_GDN_DECODE_BACKEND": "triton",
    "SGLANG_MAMBA2_DECODE_BACKEND": "triton",
    "SGLANG_GDN_EXTEND_BACKEND": "torch_varlen",
    "SGLANG_MAMBA2_EXTEND_BACKEND": "torch_varlen",
    "SGLANG_CPU_LINEAR_ATTN_BACKEND": "torch",
    "SGLANG_GPU_NORM_BACKEND": "triton",
    "SGLANG_GPU_ROPE_BACKEND": "triton",
    "SGLANG_GPU_MOE_BACKEND": "triton",
    "SGLANG_GPU_ELEMENTWISE_BACKEND": "triton",
    "TRITON_INTERPRET": "1",  # what lets `--attention-backend triton` start without CUDA
}
