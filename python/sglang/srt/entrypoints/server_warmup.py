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
the request. The warm-up is not counted in the metrics (the tokenizer's skip it, `log_metrics`; the
scheduler's restart from zero at the warm-up's flush), and the cache is flushed after it: a fresh server
holds nothing. With --dp-size n every request of the warm-up is sent n times at once: the controller's
balancer (round robin, or the shortest queue, all empty: round robin too) gives each replica one, so
every replica warms up every shape. Its requests go in a prefix-cache namespace of their own, new at each start and kept off
the host and disk tiers (`keep_off_host`): with a disk tier, a restart's warm-up would hit the previous
start's and compile nothing, and its entries would take disk room.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
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
    tm: Any,
    context_len: int,
    shape_lengths: list[int] | None = None,
    vocab_size: int | None = None,
    replicas: int = 1,
) -> str | None:
    """Run the warm-up request on the TokenizerManager `tm`, then, with `shape_lengths`, the shape
    warm-up (prompts of random ids below `vocab_size`), each request `replicas` times at once (one for
    each data-parallel replica): None when it finished, else why not, in one sentence (the server then
    shuts down, as upstream's does when its warm-up fails)."""
    if tm.tokenizer is not None:
        ids = tm.tokenizer.encode(WARMUP_TEXT, add_special_tokens=False)[: max(1, context_len - 1)] or [1]
    else:  # --skip-tokenizer-init: ids, as upstream's warm-up sends then
        ids = [i % tm.limits.vocab_size for i in WARMUP_IDS][: max(1, context_len - 1)]
    new_tokens = max(1, min(WARMUP_NEW_TOKENS, context_len - len(ids)))
    namespace = f"warmup-{secrets.token_hex(16)}"  # this start's: no other request shares it
    objs = [
        GenerateReqInput(
            input_ids=list(ids),
            sampling_params={"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
            log_metrics=False,
            extra_key=namespace,
        )
        for _ in range(replicas)
    ]
    start = time.monotonic()
    try:
        out = (await asyncio.wait_for(_generate_all(tm, objs), WARMUP_TIMEOUT_S))[0]
        took = time.monotonic() - start
        if shape_lengths:
            shapes = _shape_warmup(tm, shape_lengths, vocab_size or 1, namespace, replicas)
            await asyncio.wait_for(shapes, WARMUP_TIMEOUT_S)
        flushed = await tm.flush_cache(end_of_warmup=True)
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
    async for chunk in tm.generate_request(obj, warmup=True):
        out = chunk
    return out


async def _generate_all(tm: Any, objs: list[GenerateReqInput]) -> list[Any]:
    return await asyncio.gather(*(_generate(tm, obj) for obj in objs))


async def _shape_warmup(tm: Any, lengths: list[int], vocab_size: int, namespace: str, replicas: int) -> None:
    """One prompt of each length, one after the other (each its own extend), then CONCURRENT_PROMPTS at
    once, each `replicas` times at once (one per data-parallel replica); seeded random ids, so that a prompt shares no cached prefix with another (but by chance), from
    the vocabulary's lower half: its top holds the special tokens (Qwen's image and video placeholders
    among them), which a text prompt does not carry."""
    rng = random.Random(0)
    below = max(1, vocab_size // 2)

    def request(length: int, new_tokens: int) -> GenerateReqInput:
        ids = [rng.randrange(below) for _ in range(length)]
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        return GenerateReqInput(input_ids=ids, sampling_params=params, log_metrics=False, extra_key=namespace)

    for length in lengths:
        await _generate_all(tm, [request(length, 1) for _ in range(replicas)])
    await _generate_all(tm, [request(CONCURRENT_PROMPT_LEN, 4) for _ in range(CONCURRENT_PROMPTS * replicas)])
