"""`MultiprocessingSerializer` (upstream's name, importable from `sglang.srt.utils`): tensors travel by
value or by shared-memory file name from any process, and the allowlist refuses a payload that names
anything but tensors and their parts, before calling it. (By file descriptor, to a process the sender
started: `test_engine.test_real_scheduler_through_the_engine`.)"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.multiprocessing_serializer import UnsafePayloadError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")


def named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=g)
    return [
        ("a.weight", base),
        ("b.weight", base[1:, 2:]),  # a strided view
        ("c.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("d.weight", torch.nn.Parameter(torch.ones(3), requires_grad=False)),
    ]


def same(a, b) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("form", ["plain", "plain-protocol-2", "base64"])
def test_forms_any_process_can_send(form):
    tensors = [*named(), ("e.empty", torch.empty(0))]
    if form == "base64":
        import base64

        payload = base64.b64encode(pickle.dumps(tensors)).decode()
    else:
        payload = pickle.dumps(tensors, protocol=2 if form == "plain-protocol-2" else pickle.HIGHEST_PROTOCOL)
    assert same(MultiprocessingSerializer.deserialize(payload, trusted=False), tensors)


def test_shared_files_only_from_a_trusted_sender():
    """A file under /dev/shm (torch's file_system strategy) is opened, grown and unlinked by torch: an
    HTTP client could name any file there. The Engine's payloads are trusted."""
    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        tensors = named()
        payload = MultiprocessingSerializer.serialize(tensors)
    finally:
        torch.multiprocessing.set_sharing_strategy(old)
    with pytest.raises(UnsafePayloadError, match="by value"):
        MultiprocessingSerializer.deserialize(payload, trusted=False)
    assert same(MultiprocessingSerializer.deserialize(payload), tensors)


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def test_the_allowlist_refuses_before_calling(tmp_path):
    marker = tmp_path / "ran"
    for payload, words in [
        (pickle.dumps([("w", _Reduce(os.system, f"touch {marker}"))]), "posix.system"),
        (pickle.dumps(_Reduce(open, str(marker), "w")), "io.open"),
        (pickle.dumps([("w", _Reduce(torch.load, "x"))]), "torch.serialization.load"),
        (MultiprocessingSerializer.serialize(named()), "shared memory of the sender"),  # untrusted below
    ]:
        with pytest.raises(UnsafePayloadError, match=words.replace(".", r"\.")):
            MultiprocessingSerializer.deserialize(payload, trusted=False)
    assert not marker.exists()


def test_an_untrusted_cuda_tensor_names_only_torchs_reference_counters():
    """torch decrements an int64 in the reference-counter file a CUDA tensor names, at the offset it
    names, when the tensor is freed: checked before anything is opened."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    def payload(handle: bytes, offset: int) -> bytes:
        args = (torch.Tensor, (2,), (1,), 0, torch.UntypedStorage, torch.float32, 0, b"ipc", 8, 0, False,
                handle, offset, b"event", False)  # fmt: skip
        return pickle.dumps([("w", _Reduce(rebuild_cuda_tensor, *args))])

    for handle, offset, words in [
        (b"/review_probe", 0, "not torch's"),
        (b"/torch_1_2/../x", 0, "not torch's"),
        (b"/torch_12_3", 10**6, "out of range"),
        (b"/torch_12_3", -8, "out of range"),
    ]:
        with pytest.raises(UnsafePayloadError, match=words):
            MultiprocessingSerializer.deserialize(payload(handle, offset), trusted=False)


def test_a_cuda_tensor_as_torch_pickles_it_passes_the_allowlist():
    """The arguments torch's reduce_tensor gives a CUDA tensor (its storage class is TypedStorage), with a
    reference counter of torch's naming: nothing refuses them, in either mode; the rebuild itself then
    needs CUDA (here it fails as any malformed payload does, not as an unsafe one)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = (torch.Tensor, (2,), (1,), 0, torch.storage.TypedStorage, torch.float32, 0, b"ipc", 8, 0, False,
            b"/torch_12_345_6", 16, b"event", False)  # fmt: skip
    payload = pickle.dumps([("w", _Reduce(rebuild_cuda_tensor, *args))])
    for trusted in (True, False):
        with pytest.raises(ValueError) as e:
            MultiprocessingSerializer.deserialize(payload, trusted=trusted)
        assert not isinstance(e.value, UnsafePayloadError), e.value
    bad_class = (torch.Size, *args[1:])
    with pytest.raises(UnsafePayloadError, match="not torch's"):
        MultiprocessingSerializer.deserialize(pickle.dumps(_Reduce(rebuild_cuda_tensor, *bad_class)), False)


def test_protocol_2_bytes_cannot_allocate():
    """Protocol 2 writes b"" as `bytes()`; `bytes(2**30)` from a payload must not allocate (and zero) a
    gigabyte: a few more and the scheduler is out of memory."""
    assert MultiprocessingSerializer.deserialize(pickle.dumps(b"", protocol=2), trusted=False) == b""
    huge = b"\x80\x02c__builtin__\nbytes\n\x8a\x05\x00\x00\x00\x40\x00\x85R."  # bytes(2**30)
    with pytest.raises(ValueError, match="does not unpickle"):
        MultiprocessingSerializer.deserialize(huge, trusted=False)


def test_a_plain_pickles_storage_loads_without_unrestricted_unpickling():
    """A plain pickle's storages are a nested torch.save; it loads with weights_only, so one that holds
    a callable is refused too."""
    inner = pickle.dumps(_Reduce(os.getpid))
    evil = pickle.dumps(_Reduce(torch.storage._load_from_bytes, inner))
    with pytest.raises(ValueError, match="does not unpickle"):
        MultiprocessingSerializer.deserialize(evil, trusted=False)


def test_malformed_payloads_are_one_value_error():
    malformed = [("%%%", "not valid base64"), (b"\x80\x05junk", "does not unpickle"), (b"", "does not")]
    for payload, words in malformed:
        with pytest.raises(ValueError, match=words):
            MultiprocessingSerializer.deserialize(payload)
