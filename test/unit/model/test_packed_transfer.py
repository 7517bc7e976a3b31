"""`move_to_device`'s packing (`pack_bytes` / `unpack_bytes`): a batch's tensors go to the device as one
buffer and come back as views with their dtypes, shapes and values, each at a 16-byte offset (any dtype's
alignment), None kept in place. Checked on the host buffer itself (what the device copy holds)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.utils.host_tensors import move_to_device, pack_bytes, unpack_bytes
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

DTYPES = [torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.bool, torch.uint8]


@st.composite
def host_tensor(draw) -> torch.Tensor | None:
    if draw(st.integers(0, 5)) == 0:
        return None
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    t = (torch.arange(int(torch.tensor(shape).prod()) if shape else 1) * 7 % 11).to(dtype).reshape(shape)
    if t.dim() >= 1 and t.shape[0] > 1 and draw(st.booleans()):
        t = t[::2]  # not contiguous: packed from a contiguous copy
    return t


@settings(max_examples=150, deadline=None)
@given(st.lists(host_tensor(), max_size=12))
def test_unpacked_views_equal_the_tensors_at_aligned_offsets(tensors):
    host, sizes = pack_bytes(tensors)
    assert host.dtype == torch.uint8 and host.dim() == 1
    out = unpack_bytes(host, tensors, sizes)
    assert len(out) == len(tensors)
    for t, u in zip(tensors, out, strict=True):
        if t is None:
            assert u is None
            continue
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
        assert u.data_ptr() % 16 == 0 or u.numel() == 0
        assert u.untyped_storage().data_ptr() == host.untyped_storage().data_ptr(), "a view of the buffer"


def test_move_to_device_keeps_dtypes_shapes_and_none():
    tensors = [torch.arange(5), None, torch.ones(2, 3, dtype=torch.bfloat16), torch.tensor([True, False])]
    moved = move_to_device(tensors, torch.device("meta"))
    assert moved[1] is None
    for t, m in zip(tensors, moved, strict=True):
        if t is not None:
            assert m.device.type == "meta" and m.dtype == t.dtype and m.shape == t.shape
    assert move_to_device(tensors, torch.device("cpu"))[0] is tensors[0]  # the host: as they are


def test_host_floats_beyond_float32_become_inf_at_any_length():
    """`host_float32` packs 16 or more values with `struct`, which refuses a float beyond float32's range
    (it crashed the scheduler on a batch of 16 requests with temperature 1e39, a value upstream accepts);
    they become inf, as in `array` (below 16) and in torch."""
    from sglang.srt.utils.host_tensors import host_float32

    for n in (3, 16, 40):
        values = [0.5] * (n - 1) + [1e39]
        packed = host_float32(values)
        assert torch.equal(packed, torch.tensor(values, dtype=torch.float32)) and packed[-1].isinf()
