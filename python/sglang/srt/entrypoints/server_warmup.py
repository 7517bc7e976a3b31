"""The server's warm-up request (upstream's, skipped with --skip-server-warmup): one short greedy
generation through the whole path before the port listens and "ready to roll" is logged.

On a GPU the first forward of each shape compiles Triton kernels and autotunes flash-linear-attention's
(a minute on a fresh H200 for a 147M Qwen3-Next); without the warm-up the first user's request pays it.
The capture of the CUDA graphs has run every decode batch size by then, but a kernel also compiles anew
for each token-count class it meets in a prefill: the FP8 GEMM's and the FP8 experts' tiles are chosen
by rows (`fp8_kernel.GEMM_CONFIGS`, `fused_moe_fp8_triton.MOE_GEMM_CONFIGS`: classes at least 4x wide),
Triton specializes an integer argument by whether it is a multiple of 16, and a batch of several
sequences or a chunk on a cached prefix is a kernel variant of its own. So on CUDA the shape warm-up
follows the request: one prompt of each length of `warmup_prompt_lengths` (powers of two and one more,
up to the chunk, and a chunk and a bit: its second chunk extends a prefix), then a few prompts at once.
On the CPU nothing compiles at run time (torch, and C++ ops built before the start), so it runs only
the request. The warm-up is not counted in the metrics, and the cache is flushed after it: a fresh
server holds nothing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import GenerateReqInput

logger = logging.getLogger(__name__)

WARMUP_TEXT = "The capital city of France is"
WARMUP_IDS = (10, 11, 12, 13, 14, 15)
WARMUP_NEW_TOKENS = 8
# As upstream's warm-up request: long enough for a first forward that compiles and autotunes kernels,
# finite where --watchdog-timeout is off and a forward hangs.
WARMUP_TIMEOUT_S = 600.0


# The shape warm-up's prompts sent at once (an extend of several sequences, then decodes at that batch).
CONCURRENT_PROMPTS = 4
CONCURRENT_PROMPT_LEN = 33
# A chunk and this many tokens: the second chunk extends the first (the prefill of a cached prefix).
CHUNK_TAIL = 17


def warmup_prompt_lengths(
    chunk: int | None, max_prefill_tokens: int, max_input_len: int, pool_tokens: int
) -> list[int]:
    """The prompt lengths the shape warm-up prefills, one request each: 1, 2, 3, 4, 5, 8, 9, ... (each
    power of two and one more) below the largest extend (`chunk`, the chunked-prefill size, or
    `max_prefill_tokens` without chunking), that extend, and with chunking a chunk and CHUNK_TAIL more;
    none longer than a prompt may be (`max_input_len`) or than the pool holds with one new token."""
    limit = min(max_input_len, pool_tokens - 1)
    chunked = chunk is not None and chunk > 0
    top = min(chunk if chunked else max_prefill_tokens, limit)
    if top < 1:
        return []
    lengths = {top}
    n = 1
    while n < top:
        lengths |= {n, n + 1}
        n *= 2
    if chunked and top < limit:
        lengths.add(min(top + CHUNK_TAIL, limit))
    return sorted(lengths)


def needs_shape_warmup(server_args: Any) -> bool:
    """Whether the shape warm-up runs: SGLANG_SHAPE_WARMUP on / off, else (auto) where kernels compile at
    run time, on CUDA (Triton, flash-linear-attention)."""
    setting = envs.SGLANG_SHAPE_WARMUP.get()  # (auto, on or off: server_args_checks.py)
    if setting != "auto":
        return setting == "on"
    return str(server_args.device).startswith("cuda")


async def run_server_warmup(
    tm: Any, context_len: int, shape_lengths: list[int] | None = None, vocab_size: int | None = None
) -> str | None:
    """Run the warm-up request on the TokenizerManager `tm`, then, with `shape_lengths`, the shape
    warm-up (prompts of random ids below `vocab_size`): None when it finished, else why not, in one
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
        took = time.monotonic() - start
        if shape_lengths:
            await asyncio.wait_for(_shape_warmup(tm, shape_lengths, vocab_size or 1), WARMUP_TIMEOUT_S)
        flushed = await tm.flush_cache()
    except TimeoutError:
        return f"The warm-up request did not finish within {WARMUP_TIMEOUT_S:.0f} s."
    except Exception as e:  # noqa: BLE001 - any failure stops the start, named in one sentence
        reason = str(e).strip().rstrip(".") or type(e).__name__
        return f"The warm-up request failed ({reason})."
    generated = len(out["output_ids"]) if isinstance(out, dict) and "output_ids" in out else "?"
    logger.info(
        "Warm-up request done in %.2f s: %d prompt tokens, %s generated%s (--skip-server-warmup skips it).",
        took,
        len(ids),
        generated,
        "" if flushed.success else "; the cache was not flushed",
    )
    if shape_lengths:
        logger.info(
            "Shape warm-up done in %.2f s: prompts of %s tokens, then %d of %d at once.",
            time.monotonic() - start - took,
            ", ".join(map(str, shape_lengths)),
            CONCURRENT_PROMPTS,
            CONCURRENT_PROMPT_LEN,
        )
    return None


async def _generate(tm: Any, obj: GenerateReqInput) -> Any:
    out = None
    async for chunk in tm.generate_request(obj):
        out = chunk
    return out


async def _shape_warmup(tm: Any, lengths: list[int], vocab_size: int) -> None:
    """One prompt of each length, one after the other (each its own extend), then CONCURRENT_PROMPTS at
    once; seeded random ids, so that a prompt shares no cached prefix with another (but by chance), from
    the vocabulary's lower half: its top holds the special tokens (Qwen's image and video placeholders
    among them), which a text prompt does not carry."""
    rng = random.Random(0)
    below = max(1, vocab_size // 2)

    def request(length: int, new_tokens: int) -> GenerateReqInput:
        ids = [rng.randrange(below) for _ in range(length)]
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        return GenerateReqInput(input_ids=ids, sampling_params=params, log_metrics=False)

    for length in lengths:
        await _generate(tm, request(length, 1))
    batch = [request(CONCURRENT_PROMPT_LEN, 4) for _ in range(CONCURRENT_PROMPTS)]
    await asyncio.gather(*(_generate(tm, obj) for obj in batch))
