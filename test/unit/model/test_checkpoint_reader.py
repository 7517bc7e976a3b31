"""The checkpoint read ahead by threads (`checkpoint_reader.read_checkpoint`, what the server loads with)
yields `loader.iter_checkpoint`'s tensors in its order, bit for bit, reads at most its look-ahead ahead,
and loads a model whose parameters are the serial load's; the loader's result does not depend on the
order the tensors come in."""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.models import checkpoint_reader
from sglang.srt.models.checkpoint_reader import PIECE_BYTES, PlannedTensor, read_ahead_order, read_checkpoint
from sglang.srt.models.loader import iter_checkpoint
from sglang.srt.models.registry import build_meta_model, materialize
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


def _write_shards(folder: Path, tensors: dict[str, torch.Tensor], shards: int) -> Path:
    folder.mkdir(exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names[i::shards]}, str(folder / file))
        weight_map.update(dict.fromkeys(names[i::shards], file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_read_ahead_yields_the_serial_tensors_in_order(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"model.layers.{i}.w": torch.randn(37 + i, 19, generator=gen).to(dtype)
        for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16] * 5)
    }
    tensors["model.layers.0.count"] = torch.arange(7)  # an integer tensor, a 0-d one, an empty one
    tensors["model.scalar"] = torch.tensor(3.5)
    tensors["model.empty"] = torch.zeros(0, 4)
    tensors["mtp.fc.weight"] = torch.randn(8, 8, generator=gen)
    folder = _write_shards(tmp_path / "ckpt", tensors, shards=3)
    for prefix in ("", "mtp."):
        serial = list(iter_checkpoint(folder, prefix))
        # A look-ahead of 1 KB: fewer bytes than most tensors, so the bound is what paces the reads.
        ahead = list(read_checkpoint(folder, prefix, threads=4, read_ahead=1024))
        assert [n for n, _ in ahead] == [n for n, _ in serial]
        for (name, a), (_, b) in zip(ahead, serial, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name
    assert {n for n, _ in read_checkpoint(folder, "mtp.", threads=4)} == {"mtp.fc.weight"}


@pytest.mark.parametrize("read_ahead", [0, 300, 10**9])
def test_reads_stay_within_the_look_ahead(read_ahead):
    sizes = [100, 250, 0, 2 * PIECE_BYTES + 5, 40, 120, 90]
    plan = [PlannedTensor(Path("x"), f"t{i}", n) for i, n in enumerate(sizes)]
    submitted: list[tuple[int, int, int]] = []  # (tensor, start, stop)
    handed: list[int] = []
    most_ahead = 0

    def submit(t: PlannedTensor, start: int, stop: int) -> Future:
        nonlocal most_ahead
        submitted.append((int(t.name[1:]), start, stop))
        tensors = {i for i, _, _ in submitted} - set(handed)
        most_ahead = max(most_ahead, sum(sizes[i] for i in tensors))
        done: Future = Future()
        done.set_result(None)
        return done

    for i in read_ahead_order(plan, submit, read_ahead):
        assert sizes[i] == 0 or i in {j for j, _, _ in submitted}  # its reads were done first
        handed.append(i)
    assert handed == list(range(len(sizes)))
    # Every byte of every tensor is read once, in pieces of at most PIECE_BYTES.
    for i, n in enumerate(sizes):
        pieces = sorted((a, b) for j, a, b in submitted if j == i)
        assert [a for a, _ in pieces] == list(range(0, n, PIECE_BYTES)) and (not n or pieces[-1][1] == n)
        assert all(b - a <= PIECE_BYTES for a, b in pieces)
    assert most_ahead <= max(read_ahead, max(sizes))  # one tensor beyond the bound is always read
    if read_ahead >= sum(sizes):
        assert most_ahead == sum(sizes)


def test_a_read_error_reaches_the_consumer(monkeypatch, tmp_path):
    folder = _write_shards(tmp_path / "ckpt", {f"w{i}": torch.ones(64, 64) for i in range(6)}, shards=2)

    def failing_read(files, item, start, stop):
        if item.name == "w3":
            raise OSError("Input/output error")

    monkeypatch.setattr(checkpoint_reader, "_read", failing_read)
    names = []
    with pytest.raises(OSError, match="Input/output error"):
        for name, _ in read_checkpoint(folder, threads=3):
            names.append(name)
    assert names == ["w0", "w2", "w4", "w1"]  # (shard 1 holds w0, w2, w4; shard 2 w1, w3, w5)
    assert not [t for t in threading.enumerate() if t.name.startswith("weight-read")]


def _load(path: str, tensors) -> dict[str, torch.Tensor]:
    cfg = load_hf_config(path)
    model = build_meta_model(cfg, "cpu")
    materialize(model, torch.float32, torch.device("cpu"))
    model.load_weights(tensors)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_a_model_loads_the_same_read_ahead_serially_or_shuffled(preset, preset_paths, tmp_path):
    src = Path(preset_paths[preset])
    folder = _write_shards(tmp_path / "ckpt", load_file(src / "model.safetensors"), shards=3)
    (folder / "config.json").write_text((src / "config.json").read_text())
    serial = _load(str(folder), iter_checkpoint(folder))
    ahead = _load(str(folder), read_checkpoint(folder, threads=4, read_ahead=4096))
    shuffled = list(iter_checkpoint(folder))
    random.Random(1).shuffle(shuffled)
    reordered = _load(str(folder), iter(shuffled))
    assert serial.keys() == ahead.keys() == reordered.keys()
    for name, value in serial.items():
        assert torch.equal(value, ahead[name]), name  # bit-identical: the same bytes copied
        assert torch.equal(value, reordered[name]), name


@pytest.mark.parametrize(("setting", "threads"), [(None, 8), ("3", 3), ("1", None)])
def test_the_threads_follow_the_environment(setting, threads, monkeypatch, tmp_path):
    folder = _write_shards(tmp_path / "ckpt", {f"w{i}": torch.ones(64, 64) for i in range(4)}, shards=2)
    if setting is None:
        monkeypatch.delenv("SGLANG_WEIGHT_READ_THREADS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_WEIGHT_READ_THREADS", setting)
    pools = []

    class Recorded(ThreadPoolExecutor):
        def __init__(self, max_workers, **kwargs):
            pools.append(max_workers)
            super().__init__(max_workers, **kwargs)

    monkeypatch.setattr(checkpoint_reader, "ThreadPoolExecutor", Recorded)
    assert [n for n, _ in read_checkpoint(folder)] == [n for n, _ in iter_checkpoint(folder)]
    assert pools == ([threads] if threads else [])  # 1: iter_checkpoint itself, no pool


def _rss_file_bytes() -> int:
    """The process's resident file-backed memory (mapped file pages), from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no RssFile in /proc/self/status")


def test_read_ahead_keeps_about_one_shard_resident(tmp_path):
    # 4 shards of 32 MiB (2 tensors each), all read ahead at once: what the reading threads read must
    # not stay mapped in the process (it did: each thread kept its own mapping of every file until the
    # load ended, so all 128 MiB were resident, an 80B checkpoint's 160 GB). The loader maps one shard
    # at a time, as the serial load does. The bound, 1.5 shards, leaves 16 MiB for the loader's
    # mapping's read-around and pages of libraries the first reads fault in; the old code is 4 shards.
    shard = 32 << 20
    tensors = {f"w{i}": torch.full((shard // 8,), float(i)) for i in range(8)}  # 16 MiB each (float32)
    folder = _write_shards(tmp_path / "ckpt", tensors, shards=4)
    before = _rss_file_bytes()
    most = 0
    for name, tensor in read_checkpoint(folder, threads=4, read_ahead=1 << 30):
        assert float(tensor[-1]) == float(name[1:])
        most = max(most, _rss_file_bytes() - before)
    assert most <= 1.5 * shard, f"{most / 2**20:.0f} MiB resident of {4 * shard / 2**20:.0f} MiB"
