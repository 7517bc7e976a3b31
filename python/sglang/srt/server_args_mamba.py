"""The resolution of the mamba cache flags in `ServerArgs.__post_init__`: what a PD decode server keeps
(no prefix cache unless --disaggregation-decode-enable-radix-cache) and --mamba-scheduler-strategy (`auto`
resolved, with why, and the strategy's own refusals, each one sentence naming the flag). What the resolved
strategy means to the components is `mem_cache/mamba_strategy.py`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang.srt.mem_cache.mamba_strategy import EXTRA_BUFFER_STRATEGIES
from sglang.srt.server_args_checks import ServerArgsError

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def resolve_pd_decode_cache(args: ServerArgs) -> None:
    """The decode server of PD disaggregation keeps no prefix cache unless
    --disaggregation-decode-enable-radix-cache (as upstream)."""
    if args.disaggregation_mode != "decode" or args.disaggregation_decode_enable_radix_cache:
        return
    if not args.disable_radix_cache:
        logger.warning("--disaggregation-mode decode: the radix cache is turned off on the decode server.")
        args.disable_radix_cache = True
    if args.mamba_scheduler_strategy in EXTRA_BUFFER_STRATEGIES:
        logger.warning(
            "--disaggregation-mode decode: --mamba-scheduler-strategy %s falls back to no_buffer, "
            "since the decode server keeps no prefix cache.",
            args.mamba_scheduler_strategy,
        )
        args.mamba_scheduler_strategy = "no_buffer"


def resolve_mamba_strategy(args: ServerArgs) -> None:
    """--mamba-scheduler-strategy: `auto` resolved (the reason kept in `mamba_strategy_reason`), then
    what the strategy needs of the other flags."""
    arch = args.model_config.arch
    strategy = args.mamba_scheduler_strategy
    if strategy == "auto":
        if args.disable_radix_cache:
            strategy, reason = "no_buffer", "the radix cache is disabled, so no state is cached"
        elif not arch.supports_extra_buffer:
            strategy, reason = "no_buffer", f"{arch.architecture} does not write track snapshots"
        elif args.enable_overlap_schedule:
            strategy, reason = "extra_buffer_lazy", "overlap is on: one slot per running request"
        else:
            strategy, reason = "extra_buffer", "overlap is off: one track slot per request"
        args.mamba_strategy_reason = f"auto chose {strategy}: {reason}"
        logger.info("--mamba-scheduler-strategy %s", args.mamba_strategy_reason)
        args.mamba_scheduler_strategy = strategy
    if args.disable_radix_cache:
        return
    if strategy == "no_buffer":
        if args.page_size != 1:
            raise ServerArgsError(
                f"--mamba-scheduler-strategy no_buffer needs --page-size 1, got {args.page_size}."
            )
        if args.enable_overlap_schedule:
            logger.info("--mamba-scheduler-strategy no_buffer runs without the overlap schedule.")
            args.disable_overlap_schedule = True
    else:
        if not arch.supports_extra_buffer:
            raise ServerArgsError(
                f"--mamba-scheduler-strategy {strategy} is not supported by {arch.architecture}."
            )
