"""How many logprobs, and hidden-state floats, one request may ask for.

A reply's logprobs are one entry per input position from `logprob_start_len` (plus `top_logprobs_num`
and the `token_ids_logprob` ids at each of them), and `top_logprobs_num` plus those ids at each output
position, for every sample of the request. Nothing else in a request costs so much for so few bytes:
4,000 input ids with the whole vocabulary as top logprobs made a 16 KB body cost gigabytes and a
259 MB reply. Two bounds hold it:

- `--max-logprobs` (vLLM's name and default, 20; the OpenAI routes cap at 20 as OpenAI does): the most
  `top_logprobs_num`, and the most ids in `token_ids_logprob`, at one position;
- `--max-logprob-entries-per-request`: the entries above, summed over a request's samples (prompts x n)
  (the output positions' own logprob is not counted: one per generated token, it is as big as the
  output ids a reply carries anyway).

`return_hidden_states` (with --enable-return-hidden-states) is the same kind of cost: a hidden state
(the model's hidden size in floats) per input position and per output token, for every sample; the
review's 262,142 ids with n = 8 at Qwen3-Next's 2,048 were 4.3 G floats in one reply. It has its own
bound, `--max-hidden-state-floats-per-request`, in floats: the logprob budget in those units (2**18
floats) would admit 128 positions at that hidden size, where a float costs the HTTP process less than
an entry (each position's row becomes a list in one call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sglang.srt.managers.request_error import RequestError

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput

DEFAULT_MAX_LOGPROBS = 20
# 2**18 entries: top 20 over a 13,000-token prompt, or top 5 at every position of 8 samples of 6,500
# tokens. Each entry costs the HTTP process CPU time to take in, build and encode (most of it off the
# event loop) and ~40 bytes of JSON (10 MB), so a request at the bound delays others by a fraction of
# a second, where the review's 8.2M entries took most of a minute (timings: benchmark/README.md).
DEFAULT_MAX_LOGPROB_ENTRIES = 1 << 18
# 2**22 floats (16 MiB as float32): 2,048 positions at Qwen3-Next's hidden size of 2,048, over a
# request's samples. The HTTP process makes each message's rows lists on its event loop (~30 ns a
# float) and the reply's ~80 MB of JSON off it, so a reply at the bound stalls other clients ~0.13 s
# (measured on a loaded 2-core host: test_logprob_bounds.py).
DEFAULT_MAX_HIDDEN_STATE_FLOATS = 1 << 22


def check_logprobs_per_position(count: int, cap: int, vocab_size: int, param: str) -> None:
    """`top_logprobs_num`, or the number of `token_ids_logprob` ids, against --max-logprobs."""
    most = min(cap, vocab_size)
    if count > most:
        flag = " (--max-logprobs)" if cap <= vocab_size else " (the vocabulary's size)"
        what = (
            "top_logprobs_num must be at most" if param == "top_logprobs_num" else f"{param} may name at most"
        )
        unit = "" if param == "top_logprobs_num" else " ids"
        raise RequestError(f"{what} {most}{unit}{flag}, got {count}.", param)


def check_logprob_entries(reqs: Sequence[TokenizedGenerateReqInput], bound: int) -> None:
    """The entries all samples of one request ask for (see the module's docstring), against `bound`.
    The field named is the one whose entries are the larger part: `logprob_start_len` for the input
    positions', else `top_logprobs_num` (or `token_ids_logprob` where it asks for no top logprobs)."""
    at_input = at_output = 0
    for req in reqs:
        if not req.return_logprob:
            continue
        per_position = req.top_logprobs_num + len(req.token_ids_logprob or ())
        if req.logprob_start_len >= 0:
            at_input += (len(req.input_ids) - req.logprob_start_len) * (1 + per_position)
        at_output += req.sampling_params.max_new_tokens * per_position
    total = at_input + at_output
    if total <= bound:
        return
    if at_input >= at_output:
        param = "logprob_start_len"
    else:
        top = any(r.return_logprob and r.top_logprobs_num for r in reqs)
        param = "top_logprobs_num" if top else "token_ids_logprob"
    raise RequestError(
        f"This request asks for {total} logprob entries over its {len(reqs)} samples ({at_input} at input "
        f"positions from logprob_start_len, {at_output} top_logprobs_num and token_ids_logprob entries at up "
        f"to max_new_tokens output positions); the server returns at most {bound} per request "
        f"(--max-logprob-entries-per-request): raise logprob_start_len, or ask for fewer top logprobs, ids, "
        f"tokens or samples.",
        param,
    )


def check_hidden_state_floats(
    reqs: Sequence[TokenizedGenerateReqInput], hidden_size: int, bound: int
) -> None:
    """The hidden-state floats all samples of one request ask for (input positions and up to
    max_new_tokens outputs, each `hidden_size` floats), against `bound`."""
    positions = sum(
        len(r.input_ids) + r.sampling_params.max_new_tokens for r in reqs if r.return_hidden_states
    )
    total = positions * hidden_size
    if total <= bound:
        return
    raise RequestError(
        f"This request asks for {total} hidden-state floats over its {len(reqs)} samples ({positions} input "
        f"and output positions x the hidden size {hidden_size}); the server returns at most {bound} per "
        f"request (--max-hidden-state-floats-per-request): ask for return_hidden_states with a shorter "
        f"input, fewer tokens or fewer samples.",
        "return_hidden_states",
    )
