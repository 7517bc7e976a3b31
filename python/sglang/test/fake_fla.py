"""A stand-in for the parts of flash-linear-attention (FLA 0.6.0) our packed-extend glue calls
(`linear/gdn_varlen.py`, `mamba/ssd_varlen.py`), for the device audit on the `meta` device
(`device_audit.py`): FLA does not run without a GPU, and its kernels are tested there.

The stand-in keeps what the audit looks at and nothing else: each function returns empty tensors of
the real shapes on its inputs' device, records its call (name and keyword arguments), and does on the
host what FLA 0.6.0's Python does before its launch: left without `chunk_indices`, a wrapper builds
them itself (`prepare_chunk_indices`: a blocking host-to-device copy of the host-built pairs, or, with
no host copy of `cu_seqlens`, a read of their count on the host); `chunk_fwd_h` reads its number of
chunks back with `.item()`. So glue that leaves FLA to build its layout shows up in the audit as the
syncs it costs on a GPU.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager

import torch


class FakeFla:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    # ---- fla.ops.utils.index ---------------------------------------------------------------------

    def prepare_chunk_indices(self, cu_seqlens, chunk_size, cu_seqlens_cpu=None):
        self.calls.append(("prepare_chunk_indices", {}))
        src = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
        counts = (src[1:] - src[:-1] + chunk_size - 1) // chunk_size
        total = int(counts.sum())  # FLA: repeat_interleave sizes its output from the counts
        pairs = torch.zeros(total, 2, dtype=src.dtype, device=src.device)
        return pairs.to(cu_seqlens)  # FLA: `.to(cu_seqlens)`, blocking when built on the host

    def prepare_chunk_offsets(self, cu_seqlens, chunk_size):
        counts = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1) // chunk_size
        return torch.nn.functional.pad(counts, (1, 0)).cumsum(-1)

    def _layout(self, cu_seqlens, chunk_size, chunk_indices):
        if chunk_indices is None and cu_seqlens is not None:
            chunk_indices = self.prepare_chunk_indices(cu_seqlens, chunk_size)
        return chunk_indices

    # ---- the kernels' wrappers -------------------------------------------------------------------

    def chunk_local_cumsum(self, g, chunk_size, scale=None, cu_seqlens=None, chunk_indices=None, **kw):
        self.calls.append(("chunk_local_cumsum", dict(chunk_indices=chunk_indices, **kw)))
        self._layout(cu_seqlens, chunk_size, chunk_indices)
        return torch.empty_like(g, dtype=torch.float32)

    def chunk_gated_delta_rule_fwd_intra(self, k, v, g, beta, cu_seqlens=None, chunk_indices=None, chunk_size=64):
        self.calls.append(("chunk_gated_delta_rule_fwd_intra", dict(chunk_indices=chunk_indices)))
        self._layout(cu_seqlens, chunk_size, chunk_indices)
        t, hv = v.shape[1], v.shape[2]
        return k.new_empty(1, t, hv, k.shape[-1]), torch.empty_like(v), k.new_empty(1, t, hv, chunk_size)

    def chunk_gated_delta_rule_fwd_h(
        self, k, w, u, g=None, initial_state=None, output_final_state=False, chunk_size=64,
        state_v_first=False, cu_seqlens=None, chunk_indices=None, chunk_offsets=None, **kw,
    ):  # fmt: skip
        self.calls.append((
            "chunk_gated_delta_rule_fwd_h",
            dict(chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, initial_state=initial_state,
                 state_v_first=state_v_first),
        ))  # fmt: skip
        chunk_indices = self._layout(cu_seqlens, chunk_size, chunk_indices)
        if chunk_offsets is None:
            chunk_offsets = self.prepare_chunk_offsets(cu_seqlens, chunk_size)
        hv, dk, dv = u.shape[2], k.shape[-1], u.shape[-1]
        state = (dv, dk) if state_v_first else (dk, dv)
        h = k.new_empty(1, len(chunk_indices), hv, *state)
        final = k.new_zeros(len(cu_seqlens) - 1, hv, *state, dtype=torch.float32)
        return h, torch.empty_like(u), final

    def chunk_fwd_o(self, q, k, v, h, g=None, scale=None, state_v_first=False, cu_seqlens=None, chunk_size=64,
                    chunk_indices=None, **kw):  # fmt: skip
        self.calls.append(("chunk_fwd_o", dict(chunk_indices=chunk_indices)))
        self._layout(cu_seqlens, chunk_size, chunk_indices)
        return torch.empty_like(v)

    def chunk_fwd_h(self, k, v, g=None, h0=None, output_final_state=False, state_v_first=False, cu_seqlens=None,
                    chunk_size=64, states_in_fp32=False, **kw):  # fmt: skip
        self.calls.append(("chunk_fwd_h", {}))
        offsets = self.prepare_chunk_offsets(cu_seqlens, chunk_size)
        num_chunks = offsets[-1].item()  # FLA 0.6.0 reads it back
        heads, dk, dv = k.shape[2], k.shape[-1], v.shape[-1]
        h = k.new_empty(1, num_chunks, heads, dv, dk, dtype=torch.float32)
        return h, k.new_empty(len(cu_seqlens) - 1, heads, dv, dk, dtype=torch.float32)

    @property
    def chunk_fwd_kernel_h(self):
        fake = self

        class Kernel:
            def __getitem__(self, grid):
                def launch(**kwargs):
                    fake.calls.append(("chunk_fwd_kernel_h", kwargs))

                return launch

        return Kernel()

    # ---- installing it -----------------------------------------------------------------------------

    MODULES = {
        "fla.ops.utils": ("chunk_local_cumsum", "prepare_chunk_indices", "prepare_chunk_offsets"),
        "fla.ops.utils.index": ("prepare_chunk_indices", "prepare_chunk_offsets"),
        "fla.ops.utils.constant": (),
        "fla.ops.common.chunk_delta_h": ("chunk_gated_delta_rule_fwd_h",),
        "fla.ops.common.chunk_o": ("chunk_fwd_o",),
        "fla.ops.common.chunk_h": ("chunk_fwd_h", "chunk_fwd_kernel_h"),
        "fla.ops.gated_delta_rule.chunk_fwd": ("chunk_gated_delta_rule_fwd_intra",),
    }

    def modules(self) -> dict[str, types.ModuleType]:
        out: dict[str, types.ModuleType] = {}
        for name, attrs in self.MODULES.items():
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                out.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
            for attr in attrs:
                setattr(out[name], attr, getattr(self, attr))
        out["fla.ops.utils.constant"].RCP_LN2 = 1.4426950216293335
        return out

    def called(self, name: str) -> list[dict]:
        return [kw for n, kw in self.calls if n == name]


@contextmanager
def fake_fla():
    """`FakeFla` installed as `fla` in `sys.modules` for the duration (the real one, if any, put back)."""
    fake = FakeFla()
    saved = {name: mod for name, mod in sys.modules.items() if name == "fla" or name.startswith("fla.")}
    for name in saved:
        del sys.modules[name]
    sys.modules.update(fake.modules())
    try:
        yield fake
    finally:
        for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
            del sys.modules[name]
        sys.modules.update(saved)
