"""`DecodeFastPath`: the decode steady state's shortcuts, owned by the scheduler as one object.

While the same requests decode step after step, four caches spare the scheduler a pass over them:
- `DecodeSetCache` (decode_set.py): which running requests decode, from certificates;
- `DecodeRowsCache` (decode_rows.py): the decode batch's per-request rows;
- `DecodeKVLog` (mem_cache/decode_kv_log.py): each step's KV slots, appended to `Req.kv_indices` later;
- `DecodeTokenLog` (decode_token_log.py): each step's tokens where none can end a request, committed to
  `Req.output_ids` later (`batch_result_processor.commit_logged`).

`Req.output_ids` and `Req.kv_indices` are plain lists: while steps wait in the logs they are short, and
nothing reads them. Every boundary that reads them calls `flush` first, once, where it happens:
- the decode build: a decode set read anew (`select`), the newest tokens read from the lists rather
  than from the previous step (`ScheduleBatch.prepare_for_decode`), a dirty-row rewrite, a speculative
  verify's drafts (`Scheduler.get_new_batch_decode`);
- a decode result that is not only logged (its loop commits and reads the lists), a decode snapshot's
  commit (`BatchResultProcessor.settle`: the tree may take the request's prefix; that request alone), and
  the output sent to the client (`BatchResultProcessor.stream_output`, `send_finished`);
- a request leaving the running set: a finish or an abort (`BatchResultProcessor.release_finished`:
  `clear`, the release reads the lists and inserts them into the tree), a retraction (`clear`), a PD
  hand-off or transfer abort (through the same release);
- the integrity check (`check` first: no log holds steps of a request that left the running set).
An idle scheduler, and so /flush_cache and a weight update that flushes the cache, finds the logs empty:
the step that builds no decode batch forgets the decode set (`clear`).

`clear` also forgets the decode set (the next steps start a new one). With
SGLANG_TEST_DISABLE_DECODE_FAST_PATH every part is off: each decode step selects, builds and commits in
full and nothing is ever pending, which the scheduler tests run against (test_decode_fast_path_off.py,
and the nightly run of the scheduler tests with the switch) to check that the fast path changes no output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.environ import envs
from sglang.srt.managers.scheduler_components.batch_result_processor import commit_logged
from sglang.srt.managers.scheduler_components.decode_rows import DecodeRowsCache
from sglang.srt.managers.scheduler_components.decode_set import DecodeSetCache
from sglang.srt.managers.scheduler_components.decode_token_log import DecodeTokenLog
from sglang.srt.mem_cache.decode_kv_log import DecodeKVLog

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
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

    def select(self, running: list[Req]) -> list[Req]:
        """The requests of this decode build (`DecodeSetCache.select`); a selection that reads them anew
        flushes first."""
        return self.decode_set.select(running, before_read=self.flush)

    def flush(self, req: Req | None = None) -> None:
        """Append every pending decode step's slots and tokens to the requests' lists (to `req`'s alone,
        if given: a boundary of one request while the others go on, as a snapshot insert)."""
        self.kv_log.flush(req)
        commit_logged(self.token_log, req)

    def clear(self) -> None:
        """`flush`, and forget the decode set: the next decode build reads its requests anew."""
        self.flush()
        self.decode_set.clear()
        self.rows_cache.clear()
        self.kv_log.clear()
        self.token_log.clear()

    def check(self, running: list[Req]) -> None:
        """The integrity check's part: no log holds steps of a request that left `running`, and each
        log's lengths add up (lists plus pending steps)."""
        for log in (self.kv_log, self.token_log):
            log.check_members(running)
        self.kv_log.check()
        self.token_log.check()
