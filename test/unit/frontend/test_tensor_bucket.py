"""Upstream's trainer-side helpers at their import paths: `FlattenedTensorBucket` (the flattened_bucket
format of /update_weights_from_tensor) and `monkey_patch_torch_reductions` (CUDA tensors named by GPU
UUID). A bucket gives back the tensors it was built from, of any dtypes in any order; the server takes a
received one apart only after checking that every entry lies within the bytes it names."""

from __future__ import annotations

import base64
import pickle
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing import reductions

from sglang.srt.utils import MultiprocessingSerializer, patch_torch
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        ("a", torch.randn(3, generator=g).to(torch.bfloat16)),  # 6 bytes: the next starts unaligned
        ("b", torch.randn(2, 5, generator=g)[:, ::2]),  # float32, not contiguous
        ("c", torch.arange(4, dtype=torch.int64)),
        ("d", torch.randn(0, 4, generator=g)),
    ]


def payload(bucket: FlattenedTensorBucket) -> dict:
    return {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}


def test_a_bucket_gives_back_its_tensors_after_travelling_by_value():
    tensors = named()
    bucket = FlattenedTensorBucket(named_tensors=tensors)
    wire = base64.b64encode(pickle.dumps(payload(bucket))).decode()
    received = FlattenedTensorBucket.from_payload(MultiprocessingSerializer.deserialize(wire, trusted=False))
    out = received.reconstruct_tensors()
    assert [n for n, _ in out] == [n for n, _ in tensors]
    for (_, got), (_, want) in zip(out, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_a_malformed_bucket_is_refused_naming_what():
    flat = FlattenedTensorBucket(named_tensors=named()).get_flattened_tensor()
    meta = lambda **kw: FlattenedTensorMetadata(**{"name": "w", "shape": torch.Size([2]),  # noqa: E731
                                                   "dtype": torch.float32, "start_idx": 0, "end_idx": 8,
                                                   "numel": 2, **kw})  # fmt: skip
    for bad, words in [
        ([("w", torch.zeros(2))], "is {"),
        ({"flattened_tensor": flat.float(), "metadata": []}, "1-D uint8"),
        ({"flattened_tensor": flat, "metadata": "x"}, "must be a list"),
        ({"flattened_tensor": flat, "metadata": [{"name": "w"}]}, "entry 0 is not"),
        ({"flattened_tensor": flat, "metadata": [meta(dtype="float32")]}, "entry 0 is not"),
        ({"flattened_tensor": flat, "metadata": [meta(end_idx=len(flat) + 8, start_idx=len(flat))]}, "bytes"),
        ({"flattened_tensor": flat, "metadata": [meta(numel=3)]}, "does not match"),
        ({"flattened_tensor": flat, "metadata": [meta(end_idx=12)]}, "does not match"),
        ({"flattened_tensor": flat, "metadata": [meta(start_idx=-8, end_idx=0)]}, "does not match"),
    ]:
        with pytest.raises(ValueError, match=words):
            FlattenedTensorBucket.from_payload(bad)
    with pytest.raises(ValueError, match="at least one"):
        FlattenedTensorBucket(named_tensors=[])


@pytest.fixture
def fake_gpus(monkeypatch):
    uuids = ["GPU-aaaa", "GPU-bbbb"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))
    return uuids


def test_the_uuid_patch_names_gpus_by_uuid(fake_gpus):
    assert [patch_torch.device_uuid(i) for i in range(2)] == fake_gpus
    assert patch_torch.device_index("GPU-bbbb") == 1 and patch_torch.device_index(0) == 0
    with pytest.raises(ValueError, match="GPU-cccc"):
        patch_torch.device_index("GPU-cccc")


def test_the_uuid_patch_sends_a_cuda_tensor_with_its_gpus_uuid(fake_gpus, monkeypatch):
    """The sending side, with torch's reduction faked for a CUDA tensor on GPU 1 (no GPU here): the
    rebuild named is the patch's, with the GPU's UUID where torch puts the index; the receiving side maps
    it back to the local index."""
    args = tuple(range(15))[:6] + (1,) + tuple(range(7, 15))
    torch_reduce = lambda t: (reductions.rebuild_cuda_tensor, args)  # noqa: E731
    monkeypatch.setattr(reductions, "_reduce_tensor_original", torch_reduce, raising=False)
    rebuild, sent = patch_torch._reduce_tensor_by_uuid(SimpleNamespace(is_cuda=True))
    assert rebuild is patch_torch._rebuild_cuda_tensor_by_uuid and sent[6] == "GPU-bbbb"
    assert sent[:6] == args[:6] and sent[7:] == args[7:]
    got = []
    monkeypatch.setattr(reductions, "_rebuild_cuda_tensor_original", lambda *a: got.append(a), raising=False)
    rebuild(*sent)
    assert got == [args]


def test_the_uuid_patch_leaves_host_tensors_alone_and_is_idempotent(monkeypatch):
    for name in ("reduce_tensor", "rebuild_cuda_tensor"):
        monkeypatch.setattr(reductions, name, getattr(reductions, name))
    monkeypatch.delattr(reductions, "_sglang_uuid_patched", raising=False)
    try:
        patch_torch.monkey_patch_torch_reductions()
        patched = reductions.reduce_tensor
        patch_torch.monkey_patch_torch_reductions()
        assert reductions.reduce_tensor is patched is patch_torch._reduce_tensor_by_uuid
        tensors = named()
        back = MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(tensors))
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(back, tensors, strict=True))
    finally:
        monkeypatch.undo()
        reductions.init_reductions()  # ForkingPickler's registrations back to torch's own
        if hasattr(reductions, "_sglang_uuid_patched"):
            del reductions._sglang_uuid_patched


def peak_rss_growth_mib(fn) -> int:
    """The process's peak RSS above its RSS before `fn` (torch allocates outside tracemalloc's sight)."""
    status = lambda field: int(  # noqa: E731
        next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]
    )
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak, to the current RSS
    before = status("VmRSS")
    fn()
    return (status("VmHWM") - before) >> 10


def test_overlapping_entries_are_refused_before_anything_is_copied():
    """An entry at an odd byte is copied (a view cannot reinterpret it): 1,000 entries over the same
    64 KiB of a by-value bucket made 64 MiB; a bucket's entries are disjoint, in any order."""
    flat = torch.zeros(1 << 16, dtype=torch.uint8)
    k = ((1 << 16) - 2) // 2
    entry = FlattenedTensorMetadata("w", torch.Size([k]), torch.float16, 1, 1 + 2 * k, k)
    wire = pickle.dumps({"flattened_tensor": flat, "metadata": [entry] * 1000})

    def refuse():
        with pytest.raises(ValueError, match="entries for w and w overlap"):
            FlattenedTensorBucket.from_payload(MultiprocessingSerializer.deserialize(wire, trusted=False))

    # 16 MiB: the refusal copies nothing (the payload itself is 70 KB); the copies were 64 MiB.
    assert peak_rss_growth_mib(refuse) < 16
    tensors = named()
    bucket = FlattenedTensorBucket(named_tensors=tensors)
    shuffled = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()[::-1]}
    out = FlattenedTensorBucket.from_payload(shuffled).reconstruct_tensors()
    assert {n: t.shape for n, t in out} == {n: t.shape for n, t in tensors}


def test_the_reviews_bucket_is_refused_with_bounded_memory():
    """The review's flattened_bucket: a storage of the class called with a size, four unaligned entries
    over it (668 bytes made 1 GiB of RSS; here at 32 MiB a storage)."""
    from torch.multiprocessing import reductions as red

    from sglang.srt.managers.scheduler_components.weight_update import named_tensors_of

    class R:
        def __init__(self, f, *args):
            self.f, self.args = f, args

        def __reduce__(self):
            return (self.f, self.args)

    n = 32 << 20
    typed = R(red.rebuild_typed_storage, R(torch.storage.UntypedStorage, n), torch.uint8)
    flat = R(torch._utils._rebuild_tensor_v2, typed, 0, (n,), (1,), False, OrderedDict())
    k = (n - 2) // 2
    meta = [
        FlattenedTensorMetadata(f"w{i}", torch.Size([k]), torch.float16, 1, 1 + 2 * k, k) for i in range(4)
    ]
    payload = pickle.dumps({"flattened_tensor": flat, "metadata": meta}, protocol=2)
    assert len(payload) < 1000

    def refuse():
        with pytest.raises(ValueError, match="UntypedStorage, which a payload may only name"):
            named_tensors_of(payload, False, "flattened_bucket")

    # 16 MiB: nothing is allocated for the payload; the review's took 4 x 256 MiB.
    assert peak_rss_growth_mib(refuse) < 16
