"""`MemoryOccupation`: upstream's /release_memory_occupation and /resume_memory_occupation for one
model runner, by tag: "weights" (the model's and, with EAGLE / NEXTN, its MTP layer's), "kv_cache" (the
KV, state and request-to-token pools) and "cuda_graph" (the MTP layer's graphs too: companions).

Releasing a tag empties the storages of its tensors in place (`UntypedStorage.resize_(0)`, the memory
back to the allocator and, on CUDA, to the driver); resuming gives every storage its size back. Every
tensor that views a storage (a parameter, the decode blocks' references, a transposed layout) keeps
viewing it, but the memory's address changes: what holds raw addresses is rebuilt (the state copier's
tables at once; the CUDA graphs once nothing is released any more), and a PD server, whose transfer
engine registered the pools' addresses, may not release the pools. The pools come back zeroed, as they were made; the weights come
back with their values only with `--enable-weights-cpu-backup` (otherwise a weight update writes them,
as an RL loop does between the two calls). Upstream does the same with torch_memory_saver, which keeps
the addresses; here no library is needed, and the graphs pay one capture.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


class MemoryOccupation:
    def __init__(self, runner: ModelRunner, cpu_backup: bool):
        self.runner = runner
        self.cpu_backup = cpu_backup
        self.released: set[str] = set()
        # tag -> the storages released and their sizes in bytes; weights' host copies, by storage.
        self._storages: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}
        self._backup: list[torch.Tensor] = []
        self._graphs_stale = False

    def release(self, tags: list[str]) -> None:
        """Free the memory of `tags` (those not released already); nothing may run meanwhile."""
        self._sync()
        for tag in tags:
            if tag in self.released:
                continue
            if tag == CUDA_GRAPH:
                if self.runner.graph_runner is not None:
                    self.runner.graph_runner.release()
            else:
                storages = _unique_storages(self._tensors(tag))
                if tag == WEIGHTS and self.cpu_backup:  # (before anything is freed: it may not fit)
                    self._backup = [_host_copy(_bytes_of(s)) for s, _ in storages]
                for storage, _ in storages:
                    storage.resize_(0)
                self._storages[tag] = storages
            self.released.add(tag)
            self._graphs_stale = True
        self._sync()
        if torch.device(self.runner.device).type == "cuda":
            torch.cuda.empty_cache()

    def resume(self, tags: list[str]) -> None:
        """Give `tags` their memory back (pools zeroed, weights from the host copy where kept); once
        nothing is released, capture the CUDA graphs again."""
        for tag in tags:
            if tag not in self.released:
                continue
            if tag != CUDA_GRAPH:
                storages = self._storages[tag]
                try:
                    for storage, nbytes in storages:
                        storage.resize_(nbytes)
                except Exception:
                    for storage, _ in storages:  # all or none: the tag stays released
                        storage.resize_(0)
                    raise
                del self._storages[tag]
                if tag == KV_CACHE:
                    for storage, _ in storages:
                        _bytes_of(storage).zero_()
                    self.runner.mamba_pool.state_copier.rebind()  # its tables hold the old addresses
                elif self._backup:
                    for (storage, _), host in zip(storages, self._backup, strict=True):
                        _bytes_of(storage).copy_(host)
                    self._backup = []
            self.released.discard(tag)
        if not self.released and self._graphs_stale:
            if self.runner.graph_runner is not None:
                try:
                    self.runner.graph_runner.recapture()
                except Exception:
                    self.runner.graph_runner.release()  # no half-captured graphs: they stay released
                    self.released.add(CUDA_GRAPH)
                    raise
            self._graphs_stale = False
        self._sync()

    def recapture_graphs(self) -> None:
        """Capture the CUDA graphs again (the weights or the float8 KV scales they hold were replaced): now
        where nothing is released, else at the resume that leaves nothing released (a capture meanwhile
        would write the KV pool's slot 0 into released storages, or bring back released graphs)."""
        if self.runner.graph_runner is None:
            return
        if self.released:
            self._graphs_stale = True
        else:
            self.runner.graph_runner.recapture()

    def _tensors(self, tag: str) -> list[torch.Tensor]:
        runner = self.runner
        if tag == WEIGHTS:  # (with EAGLE / NEXTN the MTP layer's too, as upstream's memory saver region)
            return [p for m in (runner.model, runner.draft_model) if m is not None for p in m.parameters()]
        pools = (runner.req_to_token_pool, runner.mamba_pool, runner.token_to_kv_pool)
        return [t for pool in pools for t in _device_tensors(pool)]

    def _sync(self) -> None:
        if torch.device(self.runner.device).type == "cuda":
            torch.cuda.synchronize(self.runner.device)


def _device_tensors(obj: object) -> list[torch.Tensor]:
    """The tensors a pool holds as attributes, alone or in lists (its buffers, not views of them)."""
    out = []
    for value in vars(obj).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        out += [t for t in items if isinstance(t, torch.Tensor)]
    return out


def _unique_storages(tensors: list[torch.Tensor]) -> list[tuple[torch.UntypedStorage, int]]:
    """Each storage behind `tensors` once (views and tied weights share one), with its size in bytes."""
    seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage._cdata not in seen:
            seen[storage._cdata] = (storage, storage.nbytes())
    return list(seen.values())


def _host_copy(data: torch.Tensor) -> torch.Tensor:
    """A copy of `data` in host memory, made once. Pageable, not pinned: torch's pinned-memory cache would
    keep the blocks (rounded up to powers of two) from the trainer after the resume."""
    return torch.empty(data.shape, dtype=data.dtype, device="cpu").copy_(data)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
