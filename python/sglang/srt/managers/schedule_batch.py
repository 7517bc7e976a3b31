"""`Req`: one request's scheduling state, with SGLang's field names.

KV bookkeeping on the host: `kv_indices[i]` is the KV slot of position i for positions the request
holds KV for. Positions [0, cache_protected_len) are owned by the radix tree and locked through
`last_node`; later positions are the request's own. `req_to_token_dirty_from` is the first position
whose device row entry must be (re)written at the next forward (the forward stream does the write).

Mamba fields (upstream names):
  mamba_pool_idx                running slot (host int), or None
  mamba_ping_pong_track_buffer  track slots (list of ints, -1 = empty entry), or None
  mamba_next_track_idx          the entry the next snapshot is written to
  mamba_last_track_seqlen       sequence length whose state the keep entry holds (None: nothing)
  mamba_branching_seqlen        chunk-aligned end of a KV match deeper than its checkpoint
  mamba_cow_src_index           checkpoint slot to copy into the running slot (deferred to the forward)
  mamba_needs_clear             the running slot is fresh and must be zeroed (deferred to the forward)
  mamba_lazy_is_insert          lazy mode: false while the newest snapshot may be unsafe to insert
"""

from __future__ import annotations

from typing import Any


class Req:
    def __init__(self, rid: str, origin_input_ids: list[int], sampling_params: Any = None):
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params

        # KV and radix cache
        self.req_pool_idx: int | None = None
        self.kv_indices: list[int] = []
        self.prefix_len = 0
        self.cache_protected_len = 0
        self.last_node: Any = None
        self.req_to_token_dirty_from: int | None = None
        self.cached_tokens = 0

        # Mamba state
        self.mamba_pool_idx: int | None = None
        self.mamba_ping_pong_track_buffer: list[int] | None = None
        self.mamba_next_track_idx = 0
        self.mamba_last_track_seqlen: int | None = None
        self.mamba_branching_seqlen: int | None = None
        self.mamba_cow_src_index: int | None = None
        self.mamba_needs_clear = False
        self.mamba_lazy_is_insert = True

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def mark_req_to_token_dirty(self, start: int) -> None:
        if self.req_to_token_dirty_from is None or start < self.req_to_token_dirty_from:
            self.req_to_token_dirty_from = start

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"
