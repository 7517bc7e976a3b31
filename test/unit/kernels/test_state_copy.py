"""State-copy ops on CPU: the torch reference and sgl-kernel's C++ op against a row-by-row oracle of the
documented semantics (NaN-poisoned destinations, -1 / 0 / self rows skipped, dtype mixes, 1 to 256
slots), overlap rejected, the masked track copy, and the dispatch (auto, forced, build failure)."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.mem_cache.state_copy import StateCopier
from sglang.srt.utils import sgl_kernel
from sglang.test.ci_register import register_cpu_ci
from sglang.test.state_copy_checks import (
    assert_same,
    disjoint_rows,
    expected_clear,
    expected_copy,
    make_states,
    poison,
)

register_cpu_ci(est_time=26, suite="per-commit-cpu")

CPU_IMPLS = ["torch", "cpp"]
DTYPES = [
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32),
    (torch.float16, torch.bfloat16),
]


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("n", [1, 8, 64, 256])
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_copy_and_clear_match_the_oracle(impl, n, dtypes):
    num_slots = 2 * n + 3
    for shape in ("tiny", "odd"):
        states = make_states(num_slots, shape, dtypes, seed=n)
        src, dst = disjoint_rows(n, num_slots, seed=n)
        poison(states, dst + [0])
        want = expected_copy(states, src, dst)
        copier = StateCopier(states, impl)
        assert copier.impl == impl
        copier.copy(src, dst)
        assert_same(states, want)
        # The same ids as tensors (the engine's deferred COW passes tensors).
        states = make_states(num_slots, shape, dtypes, seed=n + 1)
        poison(states, dst + [0])
        want = expected_copy(states, src, dst)
        StateCopier(states, impl).copy(torch.tensor(src), torch.tensor(dst))
        assert_same(states, want)

        clear = [s for s in dst if s != 0] + [0, -1] + dst[:2]  # duplicates, the dummy, -1
        states = make_states(num_slots, shape, dtypes, seed=n + 2)
        want = expected_clear(states, clear)
        StateCopier(states, impl).clear(clear)
        assert_same(states, want)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32)], ids=str)
def test_large_launches_match_the_oracle(impl, dtypes):
    """Over 8 MB per launch: the C++ op streams its stores, unaligned rows included."""
    n, num_slots = 24, 51  # 18 kept rows of 0.51 MiB: 9.2 MiB
    states = make_states(num_slots, "large", dtypes, seed=3)
    src, dst = disjoint_rows(n, num_slots, seed=3)
    poison(states, dst + [0])
    want = expected_copy(states, src, dst)
    copier = StateCopier(states, impl)
    copier.copy(src, dst)
    assert_same(states, want)
    want = expected_clear(states, dst)
    copier.clear(dst)
    assert_same(states, want)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_track_copy_copies_masked_rows_only(impl):
    states = make_states(40, "tiny")
    running = [3, 4, 5, 6, 7, 8, 0, 9]
    track = [20, 21, 22, 23, -1, 24, 25, 9]
    mask = [True, False, True, True, True, False, True, True]
    poison(states, track + [0])
    want = expected_copy(states, running, track, mask)
    StateCopier(states, impl).track_copy(torch.tensor(running), torch.tensor(track), torch.tensor(mask))
    assert_same(states, want)
    # The poisoned unmasked destinations stay NaN: the oracle's own check is not vacuous.
    assert torch.isnan(states[1][:, 21]).all() and not torch.isnan(states[1][:, 20]).any()


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_overlapping_host_ids_are_rejected_and_self_copies_are_no_ops(impl):
    states = make_states(16, "tiny")
    copier = StateCopier(states, impl)
    before = [t.clone() for t in states]
    with pytest.raises(ValueError, match="both a source and a destination"):
        copier.copy([1, 2], [2, 3])  # chain: 2 is read by one row and written by another
    with pytest.raises(ValueError, match="appears twice"):
        copier.copy([1, 2], [5, 5])
    with pytest.raises(ValueError, match="past the pool"):
        copier.copy([1], [16])
    with pytest.raises(ValueError, match="past the pool"):
        copier.clear([16])
    with pytest.raises(ValueError, match="sources for"):
        copier.copy([1, 2], [3])
    assert_same(states, before)  # a rejected call writes nothing
    copier.copy([4, 2], [4, 7])  # 4 -> 4 is skipped, so 4 is no source of a kept row
    assert_same(states, expected_copy(before, [4, 2], [4, 7]))


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_tensor_ids_past_the_pool_raise(impl):
    copier = StateCopier(make_states(8, "tiny"), impl)
    with pytest.raises((IndexError, RuntimeError)):
        copier.copy(torch.tensor([1]), torch.tensor([8]))


def test_auto_picks_cpp_on_cpu_and_the_env_var_forces_torch():
    states = make_states(8, "tiny")
    assert StateCopier(states).impl == "cpp"
    with envs.SGLANG_MAMBA_STATE_COPY_BACKEND.override("torch"):
        assert StateCopier(states).impl == "torch"
    with (
        envs.SGLANG_MAMBA_STATE_COPY_BACKEND.override("cuda"),
        pytest.raises(ValueError, match="cuda tensors"),
    ):
        StateCopier(states)
    with (
        envs.SGLANG_MAMBA_STATE_COPY_BACKEND.override("fast"),
        pytest.raises(ValueError, match="auto or one of"),
    ):
        StateCopier(states)


def test_auto_tries_the_cuda_op_first_where_its_build_is_cached(monkeypatch):
    from sglang.srt.mem_cache import state_copy

    monkeypatch.setattr(sgl_kernel, "is_built", lambda kind: kind == "cuda")
    assert state_copy.auto_order("cuda") == ("cuda", "triton", "torch")
    monkeypatch.setattr(sgl_kernel, "is_built", lambda kind: False)
    assert state_copy.auto_order("cuda") == ("triton", "cuda", "torch")  # no first build at startup
    assert state_copy.auto_order("cpu") == ("cpp", "torch")


def test_is_built_means_a_cached_build_stamped_with_what_it_would_be_built_from(tmp_path, monkeypatch):
    monkeypatch.setattr(sgl_kernel, "_loaded", {})
    monkeypatch.setattr(sgl_kernel, "_missing_prerequisite", lambda kind: None)  # as where nvcc exists
    with envs.SGLANG_CACHE_DIR.override(str(tmp_path)):
        assert not sgl_kernel.is_built("cuda")
        out = sgl_kernel.build_folder("cuda")
        out.mkdir(parents=True)
        (out / "sgl_kernel_cuda.so").write_bytes(b"")
        assert not sgl_kernel.is_built("cuda"), "a build without a stamp (from before stamps) may be stale"
        (out / sgl_kernel.STAMP).write_text(sgl_kernel.build_key("cuda"))
        assert sgl_kernel.is_built("cuda")
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.0")  # another target: torch's load would rebuild
        assert not sgl_kernel.is_built("cuda")
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
        monkeypatch.setattr(sgl_kernel, "_flags", lambda kind: {"extra_cuda_cflags": ["-O2"]})  # other flags
        assert not sgl_kernel.is_built("cuda")


def test_a_failed_build_falls_back_to_torch_with_one_warning(monkeypatch, caplog):
    def broken(kind, verbose):
        raise RuntimeError("c++: not found")

    monkeypatch.setattr(sgl_kernel, "_build", broken)
    monkeypatch.setattr(sgl_kernel, "_loaded", {})
    with caplog.at_level(logging.WARNING):
        assert StateCopier(make_states(8, "tiny")).impl == "torch"
        assert StateCopier(make_states(8, "tiny")).impl == "torch"
    warnings = [r for r in caplog.records if "CPU ops unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "c++: not found" in warnings[0].getMessage()
    with (
        envs.SGLANG_MAMBA_STATE_COPY_BACKEND.override("cpp"),
        pytest.raises(ValueError, match="build failed"),
    ):
        StateCopier(make_states(8, "tiny"))


def test_host_slot_lists_reach_the_device_in_one_copy():
    """On a device (`meta` standing in for CUDA under the audit), a copy's two host id lists travel
    together in one packed transfer, as a clear's list does on its own."""
    from sglang.test.device_audit import DeviceAudit

    class Recording:  # the kernels' calls (torch's `nonzero` has no meta kernel)
        calls: list = []

        def copy(self, src, dst, mask):
            self.calls.append((src, dst))

        def clear(self, slots):
            self.calls.append((slots,))

    with DeviceAudit() as audit:
        copier = StateCopier([torch.zeros(2, 6, 3, device="meta"), torch.zeros(2, 6, 4, device="meta")], "torch")
        copier._impl = Recording()
        audit.reset()
        copier.copy([1, 2], [3, 4])
        assert len(audit.h2d) == 1, audit.h2d
        copier.clear([5])
        assert len(audit.h2d) == 2 and not audit.mixed and not audit.host_reads
    (src, dst), (slots,) = Recording.calls
    assert src.device.type == dst.device.type == slots.device.type == "meta"
    assert src.shape == dst.shape == (2,) and src.dtype == torch.int64
