"""`DecodeFastPath`: the decode steady state's shortcuts, owned by the scheduler as one object.

While the same requests decode step after step, four caches spare the scheduler a pass over them:
- `DecodeSetCache` (decode_set.py): which running requests decode, from certificates;
- `DecodeRowsCache` (decode_rows.py): the decode batch's per-request rows;
- `DecodeKVLog` (mem_cache/decode_kv_log.py): each step's KV slots, appended to `Req.kv_indices` later;
- `DecodeTokenLog` (decode_token_log.py): each step's tokens where none can end a request, appended to
  `Req.output_ids` later.
`flush` appends what the logs hold to the requests' lists; `clear` also forgets the decode set (the
next steps start a new one). With SGLANG_TEST_DISABLE_DECODE_FAST_PATH every part is off: each decode
step selects, builds and commits in full and nothing is ever pending, which the scheduler tests run
against (test_decode_fast_path_off.py) to check that the fast path changes no output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.environ import envs
from sglang.srt.managers.scheduler_components.decode_rows import DecodeRowsCache
from sglang.srt.managers.scheduler_components.decode_set import DecodeSetCache
from sglang.srt.managers.scheduler_components.decode_token_log import DecodeTokenLog
from sglang.srt.mem_cache.decode_kv_log import DecodeKVLog

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool


class DecodeFastPath:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        context_len: int,
        prefill_server: bool,
        enabled: bool | None = None,
    ):
        if enabled is None:
            enabled = not envs.SGLANG_TEST_DISABLE_DECODE_FAST_PATH.get()
        self.enabled = enabled
        self.decode_set = DecodeSetCache(context_len, prefill_server, enabled)
        self.rows_cache = DecodeRowsCache(req_to_token_pool, enabled)
        self.kv_log = DecodeKVLog(enabled)
        self.token_log = DecodeTokenLog(enabled)

    def flush(self) -> None:
        """Append every pending decode step's slots and tokens to the requests' lists."""
        self.kv_log.flush()
        self.token_log.flush()

    def clear(self) -> None:
        """`flush`, and forget the decode set: the next decode build reads its requests anew."""
        self.decode_set.clear()
        self.rows_cache.clear()
        self.kv_log.clear()
        self.token_log.clear()

    def check(self) -> None:
        """The logs' invariants (the integrity check's part)."""
        self.kv_log.check()
        self.token_log.check()
