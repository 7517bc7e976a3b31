"""The server's warm-up request (upstream's, skipped with --skip-server-warmup): one short greedy
generation through the whole path before the port listens and "ready to roll" is logged.

On a GPU the first forward of each shape compiles Triton kernels and autotunes flash-linear-attention's
(a minute on a fresh H200 for a 147M Qwen3-Next); without the warm-up the first user's request pays it.
Its autotune keys hold the heads and head sizes, not the token count, so one short prompt covers every
later extend. The warm-up is not counted in the metrics, and the cache is flushed after it: a fresh
server holds nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from sglang.srt.managers.io_struct import GenerateReqInput

logger = logging.getLogger(__name__)

WARMUP_TEXT = "The capital city of France is"
WARMUP_IDS = (10, 11, 12, 13, 14, 15)
WARMUP_NEW_TOKENS = 8
# As upstream's warm-up request: long enough for a first forward that compiles and autotunes kernels,
# finite where --watchdog-timeout is off and a forward hangs.
WARMUP_TIMEOUT_S = 600.0


async def run_server_warmup(tm: Any, context_len: int) -> str | None:
    """Run the warm-up request on the TokenizerManager `tm`: None when it finished, else why not, in one
    sentence (the server then shuts down, as upstream's does when its warm-up fails)."""
    if tm.tokenizer is not None:
        ids = tm.tokenizer.encode(WARMUP_TEXT, add_special_tokens=False)[: max(1, context_len - 1)] or [1]
    else:  # --skip-tokenizer-init: ids, as upstream's warm-up sends then
        ids = [i % tm.limits.vocab_size for i in WARMUP_IDS][: max(1, context_len - 1)]
    new_tokens = max(1, min(WARMUP_NEW_TOKENS, context_len - len(ids)))
    obj = GenerateReqInput(
        input_ids=ids,
        sampling_params={"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
        log_metrics=False,
    )
    start = time.monotonic()
    try:
        out = await asyncio.wait_for(_generate(tm, obj), WARMUP_TIMEOUT_S)
        flushed = await tm.flush_cache()
    except TimeoutError:
        return f"The warm-up request did not finish within {WARMUP_TIMEOUT_S:.0f} s."
    except Exception as e:  # noqa: BLE001 - any failure stops the start, named in one sentence
        reason = str(e).strip().rstrip(".") or type(e).__name__
        return f"The warm-up request failed ({reason})."
    generated = len(out["output_ids"]) if isinstance(out, dict) and "output_ids" in out else "?"
    logger.info(
        "Warm-up request done in %.2f s: %d prompt tokens, %s generated%s (--skip-server-warmup skips it).",
        time.monotonic() - start,
        len(ids),
        generated,
        "" if flushed.success else "; the cache was not flushed",
    )
    return None


async def _generate(tm: Any, obj: GenerateReqInput) -> Any:
    out = None
    async for chunk in tm.generate_request(obj):
        out = chunk
    return out
