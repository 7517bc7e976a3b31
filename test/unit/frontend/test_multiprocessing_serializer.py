"""`MultiprocessingSerializer` (upstream's name, importable from `sglang.srt.utils`): tensors travel by
value or by shared-memory file name from any process, and the allowlist refuses a payload that names
anything but tensors and their parts, before calling it. (By file descriptor, to a process the sender
started: `test_engine.test_real_scheduler_through_the_engine`.)"""

from __future__ import annotations

import base64
import codecs
import io
import os
import pickle
import time
import tracemalloc
import zipfile
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler

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
    """A plain pickle's storages are a nested torch.save, read by the serializer itself: one that holds
    a callable is refused too."""
    inner = pickle.dumps(_Reduce(os.getpid))
    evil = pickle.dumps(_Reduce(torch.storage._load_from_bytes, inner))
    with pytest.raises(UnsafePayloadError, match=r"posix\.getpid"):
        MultiprocessingSerializer.deserialize(evil, trusted=False)


def test_malformed_payloads_are_one_value_error():
    malformed = [("%%%", "not valid base64"), (b"\x80\x05junk", "does not unpickle"), (b"", "does not")]
    for payload, words in malformed:
        with pytest.raises(ValueError, match=words):
            MultiprocessingSerializer.deserialize(payload)


# ---- amplification: nothing a payload asks for may take more memory than the payload ----------------


def hex_chain(k: int, seed: int = 1024) -> bytes:
    """The review's payload: `_codecs.encode(..., "hex")` chained k times doubles `seed` bytes k times."""
    enc, s = b"c_codecs\nencode\n", lambda b: b"X" + len(b).to_bytes(4, "little") + b
    prog = enc * (k + 1) + s(b"A" * seed) + s(b"latin1") + b"\x86R" + (s(b"hex") + b"\x86R") * k
    return b"\x80\x02" + prog + b"."


def storage_blob(t: torch.Tensor) -> bytes:
    """torch.save's bytes of a tensor's storage, as a plain pickle of the tensor holds them."""
    return t._typed_storage().__reduce__()[1][0]


def refused_with_peak(payload: bytes) -> tuple[str, int, float]:
    """The refusal's message, the Python heap's peak while deserializing, and the time it took."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(UnsafePayloadError) as e:
            MultiprocessingSerializer.deserialize(payload, trusted=False)
        return str(e.value), tracemalloc.get_traced_memory()[1], time.perf_counter() - start
    finally:
        tracemalloc.stop()


def test_a_hex_chain_is_refused_at_once_with_bounded_memory():
    """bomb(16) is 1.1 KB and today makes 64 MiB (bomb(21), 2 KB, took the scheduler to 3.9 GB); only
    encode(str, "latin1") is allowed, so the chain stops at its second call."""
    payload = hex_chain(16)
    message, peak, _ = refused_with_peak(payload)
    assert "_codecs.encode" in message
    # 1 MiB: the unpickler's own objects are a few KB; a single doubling past the seed is already 4 KB,
    # and the 16th is 64 MiB.
    assert peak < 1 << 20, peak


def test_the_scheduler_is_held_at_most_briefly_by_the_worst_payload():
    """The bystander's bound: deserializing runs on the scheduler thread, so its time is every other
    request's stall. A payload at the HTTP body limit (1.25 MiB) that reuses a 600 KB string with every
    call it can fit (each a few bytes, each asking for 600 KB) is refused within the budget."""
    text = "A" * 600_000
    payload = pickle.dumps([_Reduce(codecs.encode, text, "latin1") for _ in range(30_000)], protocol=2)
    assert len(payload) < 1_300_000  # the string is memoized: sent once, encoded by each call
    message, peak, took = refused_with_peak(payload)
    assert "more than the payload's own" in message
    # One encode (600 KB) fits in the payload's length; today's code made 18 GB. 0.5 s: generous for a
    # shared 2-core machine, where the refusal takes a few ms; the review's victim waited 11.8 s.
    assert peak < 8 << 20 and took < 0.5, (peak, took)


def test_a_memoized_storage_is_not_loaded_again_and_again():
    """A storage blob is sent once and referenced by 200 loads: each load would copy it (13 MB from a
    66 KB payload); over one payload storages add up to at most its length."""
    blob = storage_blob(torch.zeros(16384))
    loads = [_Reduce(torch.storage._load_from_bytes, blob) for _ in range(200)]
    with pytest.raises(UnsafePayloadError, match="storages add up to more bytes"):
        MultiprocessingSerializer.deserialize(pickle.dumps(loads), trusted=False)


def test_a_storage_is_read_only_as_large_as_it_is_sent():
    """torch.load allocates the element count a storage declares; here the count must match the bytes
    that follow it, checked before any allocation."""
    blob = storage_blob(torch.zeros(4))
    declared = blob.index(b"K\x04N")  # BININT1 4 (the element count in the persistent id), then None
    count = len(blob) - 16 - 8  # the int64 count before the 16 bytes of data
    huge = (
        blob[:declared] + b"J\x00\x00\x00\x10N" + blob[declared + 3 : count] + (1 << 28).to_bytes(8, "little")
    )
    huge += blob[-16:]  # 2**28 floats declared twice, 4 sent
    with pytest.raises(UnsafePayloadError, match="declares 1073741824 bytes and holds 16"):
        MultiprocessingSerializer.deserialize(
            pickle.dumps(_Reduce(torch.storage._load_from_bytes, huge)), False
        )


def test_a_zip_archive_storage_is_refused():
    """torch.load also takes a zip archive, whose deflated records inflate ~1000:1 (4 MiB of zeros from
    a few KB here); torch's storage pickles never hold one."""
    buf = io.BytesIO()
    torch.save(torch.zeros(1 << 20), buf)
    deflated = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(deflated, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    assert len(deflated.getvalue()) < 64 << 10
    payload = pickle.dumps(_Reduce(torch.storage._load_from_bytes, deflated.getvalue()))
    with pytest.raises(UnsafePayloadError, match="zip archive"):
        MultiprocessingSerializer.deserialize(payload, trusted=False)


def test_a_tensor_may_not_reach_past_its_storage():
    """torch grows a storage to fit the view rebuilt on it: a 4-element storage with size (2**20,) would
    become 4 MiB (2**32 elements, 16 GiB)."""
    small = torch.zeros(4)._typed_storage()  # (as a tensor pickles its storage)
    for size, stride in [((1 << 20,), (1,)), ((2, 3), (3, 1)), ((4,), (-1,))]:
        payload = pickle.dumps(
            _Reduce(torch._utils._rebuild_tensor_v2, small, 0, size, stride, False, OrderedDict())
        )
        with pytest.raises(UnsafePayloadError, match="tensor"):
            MultiprocessingSerializer.deserialize(payload, trusted=False)
    fits = pickle.dumps(_Reduce(torch._utils._rebuild_tensor_v2, small, 1, (3,), (1,), False, OrderedDict()))
    assert MultiprocessingSerializer.deserialize(fits, trusted=False).shape == (3,)
    assert MultiprocessingSerializer.deserialize(base64.b64encode(fits).decode(), trusted=False).numel() == 3


# ---- the classes are names, BUILD is refused, and what the load returns is bounded ------------------


def rss_mib(field: str = "VmRSS") -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) >> 10


def peak_growth_and_time(fn) -> tuple[int, float]:
    """The process's peak RSS above its RSS before `fn` (MiB: torch allocates outside tracemalloc's
    sight), and the seconds `fn` took: deserializing runs on the scheduler thread, so that time is the
    stall every other request sees."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak, to the current RSS
    before = rss_mib()
    start = time.perf_counter()
    fn()
    return rss_mib("VmHWM") - before, time.perf_counter() - start


class _ReduceWithState(_Reduce):
    def __init__(self, fn, args, state):
        super().__init__(fn, *args)
        self.state = state

    def __reduce__(self):
        return (self.fn, self.args, self.state)


def refused_untrusted(payload: bytes, words: str) -> None:
    with pytest.raises(UnsafePayloadError, match=words):
        MultiprocessingSerializer.deserialize(payload, trusted=False)


def test_the_tensor_and_storage_classes_cannot_be_called():
    """The review's payloads: `torch.Tensor(2**28)` (31 bytes) and `UntypedStorage(2**30)` (48 bytes)
    each allocated 1 GiB. The classes reach a payload as names for the rebuild functions only."""
    payloads = [
        pickle.dumps(_Reduce(torch.Tensor, 1 << 28), protocol=2),
        pickle.dumps(_Reduce(torch.storage.UntypedStorage, 1 << 30), protocol=2),
        pickle.dumps(_Reduce(torch.storage.TypedStorage, 1 << 28), protocol=2),
        pickle.dumps(_Reduce(torch.nn.Parameter, _Reduce(torch.Tensor, 1 << 28))),
    ]
    for payload in payloads:
        assert len(payload) < 100
        growth, took = peak_growth_and_time(lambda p=payload: refused_untrusted(p, "may only name"))
        # 64 MiB: the refusal allocates nothing of its own (the unpickler's objects are a few KB); the
        # payloads asked for 1 GiB each. 0.5 s: as the hex chain's bound above (measured: under 1 ms).
        assert growth < 64 and took < 0.5, (payload, growth, took)


def test_build_on_a_tensor_or_on_what_the_payload_names_is_refused():
    """BUILD calls `Tensor.__setstate__((storage, 0, Size([2**26]), (1,)))`, whose `set_` grew a
    4-byte storage to 256 MiB past the extent check (492 bytes); BUILD on a class or function the
    payload names would set its attributes in the server for good."""
    from sglang.srt.weight_sync import tensor_bucket

    storage = torch.zeros(1)._typed_storage()
    grown = _ReduceWithState(
        torch._utils._rebuild_tensor_v2,
        (storage, 0, (1,), (1,), False, OrderedDict()),
        (storage, 0, torch.Size([1 << 26]), (1,)),
    )
    refused_untrusted(pickle.dumps([("w", grown)], protocol=2), "BUILD")
    # torch's multiprocessing pickle of an empty tensor (an empty storage, its class named), then BUILD
    # on that tensor, and on a storage.
    from torch.multiprocessing.reductions import rebuild_storage_empty

    fn, args = reduce_of(torch.empty(0))
    for obj in (
        _ReduceWithState(fn, args, ({},)),
        _ReduceWithState(rebuild_storage_empty, (torch.UntypedStorage,), {"nbytes": 1}),
    ):
        buf = io.BytesIO()
        ForkingPickler(buf).dump([("w", obj)])
        refused_untrusted(buf.getvalue(), "BUILD")
    # b"...N}<name><value>s\x86b": BUILD (None, {name: value}), a slot state, which pickle sets with setattr.
    cls = b"\x80\x02csglang.srt.weight_sync.tensor_bucket\nFlattenedTensorMetadata\n"
    fn = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n"
    for head, name in [(cls, b"numel"), (fn, b"__defaults__")]:
        payload = head + b"N}X" + len(name).to_bytes(4, "little") + name + b"K\x01\x85s\x86b."
        with pytest.raises(ValueError):
            MultiprocessingSerializer.deserialize(payload, trusted=False)
    assert "numel" not in vars(tensor_bucket.FlattenedTensorMetadata)


def reduce_of(tensor: torch.Tensor) -> tuple:
    """torch's multiprocessing reduction of a CPU tensor: (rebuild_tensor, (class, storage, metadata))."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(tensor)


def test_what_the_load_returns_holds_at_most_the_payloads_bytes(monkeypatch):
    """Whatever grows a storage after its tensor was checked (`set_`, which BUILD reached), the storages
    the load returns are counted: here a rebuild made to grow each storage to 1 MiB stands in for the
    next such hole."""
    from sglang.srt.utils import multiprocessing_serializer as ms

    def growing(storage, offset, size, stride, *rest):
        t = torch._utils._rebuild_tensor(storage, offset, size, stride)
        torch.Tensor.untyped_storage(t).resize_(1 << 20)
        return t

    tensors = [("w", torch.zeros(4)), ("v", torch.zeros(2))]
    payload = pickle.dumps(tensors)
    assert same(MultiprocessingSerializer.deserialize(payload, trusted=False), tensors)
    monkeypatch.setattr(ms.torch._utils, "_rebuild_tensor_v2", growing)
    with pytest.raises(
        UnsafePayloadError, match=f"hold 2097152 bytes, more than the payload's own {len(payload)}"
    ):
        MultiprocessingSerializer.deserialize(payload, trusted=False)
    assert len(MultiprocessingSerializer.deserialize(payload, trusted=True)) == 2  # trusted: not counted


def test_an_untrusted_cuda_tensor_lies_within_the_storage_its_handle_names():
    """Without a handle torch makes an empty CUDA storage and grows it to the tensor's size: 4 GiB of the
    GPU from a 200-byte payload. Refused before anything is rebuilt (here without a GPU too)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    def payload(size, handle, nbytes, stride=(1,), offset=0):
        args = (torch.Tensor, size, stride, offset, torch.storage.TypedStorage, torch.float32, 0, handle, nbytes,
                0, False, b"/torch_12_345_6", 16, b"event", False)  # fmt: skip
        return pickle.dumps([("w", _Reduce(rebuild_cuda_tensor, *args))])

    for size, handle, nbytes, words in [
        ((1 << 30,), None, 0, "reaches byte 4294967296 of a storage of 0"),
        ((1 << 30,), b"ipc", 0, "of a storage of 0"),
        ((3,), b"ipc", 8, "reaches byte 12 of a storage of 8"),
        ((2,), b"ipc", -8, "byte count"),
    ]:
        refused_untrusted(payload(size, handle, nbytes), words)
    with pytest.raises(ValueError) as e:  # fits: refused only for want of CUDA here
        MultiprocessingSerializer.deserialize(payload((2,), b"ipc", 8), trusted=False)
    assert not isinstance(e.value, UnsafePayloadError) or torch.cuda.is_available(), e.value


@pytest.mark.parametrize("trusted", [False, True])
def test_the_tensors_come_back_as_torch_made_them(trusted):
    """The BUILD guards are the load's: the tensors returned pickle, copy and take state as any other."""
    tensors = named()
    payload = pickle.dumps(tensors) if not trusted else MultiprocessingSerializer.serialize(tensors)
    back = MultiprocessingSerializer.deserialize(payload, trusted=trusted)
    assert same(back, tensors)
    for _, t in back:
        assert "__setstate__" not in vars(t)
        assert "__setstate__" not in vars(torch.Tensor.untyped_storage(t))
    assert same(pickle.loads(pickle.dumps(back)), tensors)
