"""Imported at every Python start where this folder is on PYTHONPATH (run_gpu_checks.sh's benchmark
steps): with SGLANG_DUMP_STACKS_AFTER_S set, every thread's stack goes to stderr that many seconds after
the start, once, so a step cut at its limit says where each thread was (the limit's SIGINT only
interrupts the main thread; on 2026-11-30 the `mtp` step's main thread waited on its forward thread and
the log could not say on what). Child processes inherit it and dump at the same age, counted from their
own start: one started late in a step (a later server launch) may dump after the step's limit, or not."""

import faulthandler
import os
import sys

_after = float(os.environ.get("SGLANG_DUMP_STACKS_AFTER_S") or 0)
if _after > 0:
    faulthandler.dump_traceback_later(_after, repeat=False, file=sys.stderr, exit=False)
