"""Upstream's /freeze_gc on the scheduler: it freezes its own collector, passes the call on to the
detokenizer (which hears only from it) and answers. The route on the real server:
test/registered/openai_server/test_openai_api.py::test_freeze_gc."""

from __future__ import annotations

import gc

from sglang.srt.managers.io_struct import FreezeGCReq
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def test_the_scheduler_freezes_tells_the_detokenizer_and_serves_on():
    h = SchedulerHarness()
    try:
        gc.unfreeze()
        reply = h.control_reply(FreezeGCReq())
        assert reply.success and gc.get_freeze_count() > 0, reply
        assert any(isinstance(m, FreezeGCReq) for m in h.sched.detokenizer_outbox)
        h.sched.detokenizer_outbox.clear()
        assert len(h.generate(token_ids(16, seed=1), max_new_tokens=4).output_ids) == 4
    finally:
        gc.unfreeze()  # (this test process is the scheduler's: the other tests keep a plain collector)
        h.shutdown()
