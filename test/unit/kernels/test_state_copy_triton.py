"""The Triton state-copy kernel: run by the interpreter (`TRITON_INTERPRET=1`) on CPU against the
row-by-row oracle on tiny shapes, and compiled ahead of time for sm_90 (the GPU it is meant for),
where its copies must use 16-byte vector loads and stores."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang.srt.mem_cache.state_copy import StateCopier
from sglang.test.ci_register import register_cpu_ci
from sglang.test.state_copy_checks import (
    assert_same,
    disjoint_rows,
    expected_clear,
    expected_copy,
    make_states,
    poison,
)

register_cpu_ci(est_time=10, suite="per-commit-cpu")

triton = pytest.importorskip("triton")



@pytest.mark.parametrize(
    "n,shape,dtypes",
    [
        (1, "tiny", (torch.bfloat16, torch.float32)),
        (8, "odd", (torch.float16, torch.float32)),  # rows of 30 bytes: 2-byte words
        (8, "tiny", (torch.float32, torch.float32)),
        (256, "tiny", (torch.bfloat16, torch.float32)),
    ],
)
def test_copy_and_clear_match_the_oracle(interpret, n, shape, dtypes):
    num_slots = 2 * n + 3
    states = make_states(num_slots, shape, dtypes, seed=n)
    src, dst = disjoint_rows(n, num_slots, seed=n)
    poison(states, dst + [0])
    want = expected_copy(states, src, dst)
    copier = StateCopier(states, "triton")
    copier.copy(src, dst)
    assert_same(states, want)
    clear = [s for s in dst if s != 0][:8] + [0, -1]
    want = expected_clear(states, clear)
    copier.clear(clear)
    assert_same(states, want)


def test_track_copy_copies_masked_rows_only(interpret):
    states = make_states(40, "tiny")
    running = [3, 4, 5, 6, 7, 8, 0, 9]
    track = [20, 21, 22, 23, -1, 24, 25, 9]
    mask = [True, False, True, True, True, False, True, True]
    poison(states, track + [0])
    want = expected_copy(states, running, track, mask)
    StateCopier(states, "triton").track_copy(torch.tensor(running), torch.tensor(track), torch.tensor(mask))
    assert_same(states, want)


def test_more_rows_than_one_launch_takes_go_in_several(interpret, monkeypatch):
    """A CUDA grid holds at most 65,535 rows (`MAX_ROWS_PER_LAUNCH`): more go in several launches, each
    with its slice of the ids and the mask. Lowered to 3 here, so 8 rows take three launches."""
    from sglang.srt.mem_cache.state_copy import triton_impl

    monkeypatch.setattr(triton_impl, "MAX_ROWS_PER_LAUNCH", 3)
    n, num_slots = 8, 19
    states = make_states(num_slots, "tiny", (torch.bfloat16, torch.float32), seed=1)
    copier = StateCopier(states, "triton")
    src, dst = disjoint_rows(n, num_slots, seed=1)
    poison(states, dst + [0])
    want = expected_copy(states, src, dst)
    copier.copy(src, dst)
    assert_same(states, want)
    running, track = disjoint_rows(n, num_slots, seed=2)
    mask = [True, False, False, True, True, True, False, True]  # no chunk of 3 repeats another
    poison(states, track + [0])
    want = expected_copy(states, running, track, mask)
    copier.track_copy(torch.tensor(running), torch.tensor(track), torch.tensor(mask))
    assert_same(states, want)
    want = expected_clear(states, dst)
    copier.clear(dst)
    assert_same(states, want)
    # The start-up warm-up (copy, clear and masked copy of dummy row 0) moves nothing.
    before = [s.clone() for s in states]
    copier._impl.warm_up()
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, states, strict=True)
    )


def test_a_failing_triton_kernel_is_reported_once_and_refused(interpret, monkeypatch, caplog):
    from sglang.srt.mem_cache import state_copy
    from sglang.srt.mem_cache.state_copy import triton_impl

    def broken(self, tensors):
        raise RuntimeError("PTX assembler failed")

    monkeypatch.setattr(triton_impl.TritonStateCopy, "__init__", broken)
    monkeypatch.setattr(state_copy, "_triton_failure", [])
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            with pytest.raises(ValueError, match="PTX assembler failed"):
                StateCopier(make_states(8, "tiny"), "triton")
    assert sum("Triton state-copy kernel unavailable" in r.getMessage() for r in caplog.records) == 1


def test_triton_is_refused_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="no CPU backend"):
        StateCopier(make_states(8, "tiny"), "triton")


def _compile_sm90(word: str, vec: int, clear: bool, mask: bool):
    from sglang.srt.mem_cache.state_copy import triton_impl
    from sglang.test.sm90 import compile_sm90_in_registers

    signature = {
        "base_ptr": f"*{word}",
        "table_ptr": "*i64",
        "src_ptr": "*i64",
        "dst_ptr": "*i64",
        "mask_ptr": "*i1" if mask else "*i64",
        "num_slots": "i64",
        "NUM_TENSORS": "constexpr",
        "VEC": "constexpr",
        "BLOCK": "constexpr",
        "IS_CLEAR": "constexpr",
        "HAS_MASK": "constexpr",
    }
    constexprs = {
        "NUM_TENSORS": 2,
        "VEC": vec,
        "BLOCK": triton_impl.BLOCK,
        "IS_CLEAR": clear,
        "HAS_MASK": mask,
    }
    return compile_sm90_in_registers(
        triton_impl._state_copy_kernel, signature, constexprs, num_warps=triton_impl.NUM_WARPS
    )


@pytest.mark.parametrize("clear,mask", [(False, False), (True, False), (False, True)])
def test_compiles_for_sm90_with_16_byte_vectors(clear, mask):
    ptx = _compile_sm90("i64", 2, clear, mask).asm["ptx"]
    assert ".target sm_90" in ptx
    if not clear:
        assert "ld.global.v2.b64" in ptx
    assert "st.global.v2.b64" in ptx


def test_compiles_for_sm90_with_narrow_words():
    assert _compile_sm90("i16", 1, False, True).asm["cubin"]
