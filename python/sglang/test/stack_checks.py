"""Checks shared by the stacked-linears tests (test_stacked_linears.py, test_fp8_stacks.py)."""

from __future__ import annotations

from torch import nn

from sglang.srt.environ import envs
from sglang.srt.layers.stacked_linears import stack_linear_weights


def assert_left_as_they_are(linears: list[nn.Module], switch_off: bool = False) -> None:
    """`stack_linear_weights` refuses `linears` (with SGLANG_STACK_LINEARS off where `switch_off`) and
    leaves each weight where it was."""
    ptrs = [lin.weight.data_ptr() for lin in linears]
    with envs.SGLANG_STACK_LINEARS.override(not switch_off):
        assert stack_linear_weights(linears) is None
    assert [lin.weight.data_ptr() for lin in linears] == ptrs
