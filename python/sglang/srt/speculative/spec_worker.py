"""The scheduler's speculative worker for `--speculative-algorithm` (`Scheduler.spec`): NGRAM's
(`ngram_worker.py`) or EAGLE / NEXTN's (`eagle_worker.py`, the checkpoint's MTP layers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang.srt.speculative.ngram_worker import NgramWorker, VerifyCollaborators

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs


def create_spec_worker(
    args: ServerArgs,
    deps: VerifyCollaborators,
    model_runner: Any,
    run_on_stream: Callable[[Callable[[], Any]], Any],
) -> NgramWorker:
    if args.speculative_algorithm in ("EAGLE", "NEXTN"):
        from sglang.srt.speculative.eagle_worker import EagleWorker
        from sglang.srt.speculative.mtp_draft import MtpDraftRunner

        return EagleWorker(args, deps, MtpDraftRunner(model_runner), run_on_stream)
    return NgramWorker(args, deps)
