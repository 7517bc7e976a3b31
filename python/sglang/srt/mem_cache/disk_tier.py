"""`FileStorage`: the `file` storage backend of the hierarchical cache (`--hicache-storage-backend file`),
a third tier on disk under `$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR` (upstream's variable; default
/tmp/hicache), in a folder per model and pool layout (`fingerprint`), so a server never reads another
model's files.

Write-through from host: every checkpoint backed up to host is also written to disk, one entry per
checkpoint: `<name>.pt` (the whole path's KV of every full-attention layer and the state) and then
`<name>.json` (its tokens and namespace), where name is a SHA-256 of the namespace and the tokens. An
entry is complete once its JSON exists (each file is written under a temporary name and renamed). The
index (name -> length) is rebuilt from the JSON files at start, so the tier survives a restart of the
server. Nothing is ever evicted from disk (the folder grows until it is cleared by hand).

Writes and reads touch the host pools' tensors, so they run on the forward stream as host copies do, in
the order recorded (`HiCacheController.record`): a write after the host copy it reads, a read before the
load to the device that follows it. The index changes when an entry is recorded, before its files
exist: any read of it is recorded later, so it runs after the write.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array

import torch

from sglang.srt.mem_cache.host_pool import HostPools


def _page_hashes(key: array, namespace: str | None, page: int):
    """(length, name) of every page-aligned prefix of `key`, shortest first."""
    h = hashlib.sha256(repr(namespace).encode())
    for end in range(page, len(key) + 1, page):
        h.update(key[end - page : end].tobytes())
        yield end, h.copy().hexdigest()


class FileStorage:
    def __init__(self, root: str, host: HostPools, fingerprint: str):
        self.host = host
        self.page = host.page_size
        self.dir = os.path.join(root, hashlib.sha256(fingerprint.encode()).hexdigest()[:16])
        os.makedirs(self.dir, exist_ok=True)
        self.index: dict[str, int] = {}
        for name in os.listdir(self.dir):
            if name.endswith(".json"):
                with open(os.path.join(self.dir, name)) as f:
                    meta = json.load(f)
                self.index[name[: -len(".json")]] = len(meta["tokens"])

    def deepest(self, key: list[int], namespace: str | None) -> tuple[int, str | None]:
        """The longest prefix of `key` with an entry: (length, name), or (0, None)."""
        if not self.index:
            return 0, None
        key = key if isinstance(key, array) else array("q", key)
        best = (0, None)
        for end, name in _page_hashes(key, namespace, self.page):
            if name in self.index:
                best = (end, name)
        return best

    def name_of(self, key: list[int], namespace: str | None) -> str:
        key = key if isinstance(key, array) else array("q", key)
        *_, (_, name) = _page_hashes(key, namespace, self.page)
        return name

    # ---- forward stream ----------------------------------------------------------------------------

    def write(
        self, name: str, tokens: list[int], namespace: str | None, host_kv: list[int], slot: int
    ) -> None:
        h, kv = self.host, torch.tensor(host_kv, dtype=torch.int64)
        data = {
            "k": [b[kv].clone() for b in h.k_buffer],
            "v": [b[kv].clone() for b in h.v_buffer],
            "conv": h.conv_state[:, slot].clone(),
            "ssm": h.ssm_state[:, slot].clone(),
        }
        path = os.path.join(self.dir, name)
        torch.save(data, path + ".pt.tmp")
        os.replace(path + ".pt.tmp", path + ".pt")
        with open(path + ".json.tmp", "w") as f:
            json.dump({"tokens": list(tokens), "namespace": namespace}, f)
        os.replace(path + ".json.tmp", path + ".json")

    def read(self, name: str, start: int, host_kv: list[int], slot: int) -> None:
        """Positions [start, start + len(host_kv)) of the entry's KV into `host_kv`, its state into
        `slot`."""
        h = self.host
        data = torch.load(os.path.join(self.dir, name + ".pt"), map_location="cpu", weights_only=True)
        kv = torch.tensor(host_kv, dtype=torch.int64)
        end = start + len(host_kv)
        for dst, src in zip([*h.k_buffer, *h.v_buffer], [*data["k"], *data["v"]], strict=True):
            dst[kv] = src[start:end]
        h.conv_state[:, slot] = data["conv"]
        h.ssm_state[:, slot] = data["ssm"]
