"""`MambaStrategy`: `--mamba-scheduler-strategy` resolved once, by `ServerArgs`, into the numbers every
component reads: the pools, the tracker, the tree, pool sizing and the PD decode pool. This is the one
home of the slot rules; nothing else recomputes them.

- `extra_buffer`: requests snapshot recurrent state for the tree (an extra-buffer strategy with a radix
  cache).
- `lazy` (`extra_buffer_lazy`): a running request holds its running slot only. Each snapshot (prefill
  lattice positions, decode track boundaries) is written into a slot borrowed from the tree's share of
  the pool (evicting one checkpoint if the pool is dry; skipped if none can be had) and handed to the
  tree at once: a prefill snapshot when its batch is prepared, a decode snapshot when its result is
  processed (the tokens before it are known to the scheduler only then, under overlap).
- `track_entries`: ping-pong entries of an `extra_buffer` request's track buffer: 2 with overlap (the
  snapshot being written never is the one the tree may take), 1 without; 0 when nothing is tracked or
  under `lazy`, which keeps no track slot.
- Slots per running request: `resident_slots_per_req` between boundaries (admission),
  `max_slots_per_req` at most (every entry filled, or a lazy request's borrowed snapshot slot not yet
  handed over: what the PD decode pool reserves).
- `tree_headroom`: slots per running request left to the radix tree when the running cap is derived from
  the pool (2 with a radix cache, as upstream's base ratio 3 keeps beside the running slot). Without it a
  saturated pool is all running slots: every checkpoint is evicted by the next admission, and a load of
  shared prefixes hits nothing. `slots_per_running_req` is upstream's "mamba ratio": 1 without a radix
  cache, 3 `no_buffer` and `extra_buffer_lazy`, 5 `extra_buffer` with overlap (4 without).
"""

from __future__ import annotations

from dataclasses import dataclass

EXTRA_BUFFER_STRATEGIES = ("extra_buffer", "extra_buffer_lazy")
TREE_HEADROOM_SLOTS = 2


@dataclass(frozen=True)
class MambaStrategy:
    name: str = "no_buffer"
    extra_buffer: bool = False
    lazy: bool = False
    track_entries: int = 0
    cache_chunk_size: int = 64
    tree_headroom: int = 0

    @classmethod
    def resolve(cls, name: str, radix_cache: bool, overlap: bool, cache_chunk_size: int) -> MambaStrategy:
        extra = radix_cache and name in EXTRA_BUFFER_STRATEGIES
        lazy = extra and name == "extra_buffer_lazy"
        entries = (2 if overlap else 1) if extra and not lazy else 0
        headroom = TREE_HEADROOM_SLOTS if radix_cache else 0
        return cls(name, extra, lazy, entries, cache_chunk_size, headroom)

    @property
    def resident_slots_per_req(self) -> int:
        return 1 + self.track_entries

    @property
    def slots_per_running_req(self) -> int:
        return self.resident_slots_per_req + self.tree_headroom

    @property
    def max_slots_per_req(self) -> int:
        return self.resident_slots_per_req + (1 if self.lazy else 0)

    def slots_to_admit(self, has_running_slot: bool, has_track_buffer: bool) -> int:
        """Slots a request still needs before it can run: its running slot and its track slots."""
        return (0 if has_running_slot else 1) + (0 if has_track_buffer else self.track_entries)

    def other_entry(self, idx: int) -> int:
        return 1 - idx if self.track_entries == 2 else idx

    def keep_entry(self, next_idx: int) -> int:
        """The entry holding a request's newest snapshot: `mamba_next_track_idx` swaps as soon as a
        snapshot is scheduled, so the keep entry is the other one."""
        return self.other_entry(next_idx)
