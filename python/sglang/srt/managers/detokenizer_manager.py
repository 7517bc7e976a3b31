"""DetokenizerManager: turns the scheduler's token deltas into text deltas (its own process).

    Scheduler --BatchTokenIDOut--> DetokenizerManager --BatchStrOut--> TokenizerManager

Text is produced incrementally per request. A byte-level tokenizer can split one UTF-8 character
over several tokens; decoding such a partial sequence yields U+FFFD, so text is held back until the
character is complete and is flushed (as it is) when the request finishes. A request's state is freed
with its final message.

The process imports neither torch nor transformers: it is started with `DetokenizerArgs` (not the
ServerArgs, whose import takes torch) and decodes with what the HTTP process's `DecoderSpec` says
(`decode_tokenizer.py`); token outputs that arrive before the spec wait for it (SPEC_WAIT_S at most,
after which the tokenizer is loaded here).
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import zmq

from sglang.srt.managers.decode_tokenizer import DecoderSpec, load_decoder
from sglang.srt.managers.io_struct import BatchStrOut, BatchTokenIDOut, FreezeGCReq, PortArgs

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Token outputs wait this long at most for the HTTP process's DecoderSpec (sent as it starts, before any
# request), after which this process loads the tokenizer itself.
SPEC_WAIT_S = 30.0


@dataclass
class DetokenizerArgs:
    """What this process needs of the flags."""

    log_level: str
    skip_tokenizer_init: bool
    tokenizer_path: str

    @classmethod
    def of(cls, server_args: Any) -> DetokenizerArgs:
        return cls(server_args.log_level, server_args.skip_tokenizer_init, server_args.tokenizer_path)


class IncrementalDetokenizer:
    """One request's decoding state.

    `ids[surr_offset:read_offset]` is already emitted and ends on a character boundary; it is decoded
    again with the new ids as left context, so a tokenizer that changes how a token renders depending
    on its neighbour (leading spaces, merges) stays right, and the work per step stays small.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.surr_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: list[int], finished: bool = False, drop_last: bool = False) -> str:
        """Add new token ids; return the text that became final. `drop_last` leaves the last id out
        of the text (a matched stop token is not part of the output text)."""
        self.ids.extend(new_ids)
        end = len(self.ids) - 1 if drop_last and self.ids else len(self.ids)
        if end <= self.read_offset:
            return ""
        prefix = self._decode(self.ids[self.surr_offset : self.read_offset])
        full = self._decode(self.ids[self.surr_offset : end])
        if not finished and (len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR)):
            # Incomplete character (or nothing visible yet): wait for more ids.
            return ""
        self.surr_offset, self.read_offset = self.read_offset, end
        return full[len(prefix) :]


class DetokenizerManager:
    def __init__(self, tokenizer: Any, tokenizer_path: str | None = None):
        """`tokenizer` None: with a `tokenizer_path`, token outputs wait for the HTTP process's
        DecoderSpec (`take_spec`); without (--skip-tokenizer-init), the ids pass through with no text."""
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self.states: dict[str, IncrementalDetokenizer] = {}
        self.waiting: list[BatchTokenIDOut] = []  # outputs that came before the decoder
        self.waiting_since = 0.0

    @property
    def needs_decoder(self) -> bool:
        return self.tokenizer is None and self.tokenizer_path is not None

    def take_spec(self, spec: DecoderSpec) -> list[BatchStrOut]:
        """The decoder (the first spec only), then the replies to the outputs that waited for it."""
        if self.needs_decoder:
            self.tokenizer = load_decoder(spec, self.tokenizer_path)
        replies = [self.handle_batch_token_id_out(out) for out in self.waiting]
        self.waiting.clear()
        return replies

    def take_output(self, out: BatchTokenIDOut) -> list[BatchStrOut]:
        """Its reply, or none yet while the decoder has not come."""
        if self.needs_decoder:
            self.waiting_since = self.waiting_since if self.waiting else time.monotonic()
            self.waiting.append(out)
            return []
        return [self.handle_batch_token_id_out(out)]

    def wait_ms(self) -> int | None:
        """How long the process may wait for its next message: forever (None) unless outputs wait for
        the decoder, SPEC_WAIT_S after the first of them at most."""
        if not self.waiting:
            return None
        return max(0, int((self.waiting_since + SPEC_WAIT_S - time.monotonic()) * 1000))

    def handle_batch_token_id_out(self, out: BatchTokenIDOut) -> BatchStrOut:
        texts = self._texts(out) if self.tokenizer is not None else [""] * len(out.rids)
        return BatchStrOut(
            rids=out.rids,
            finished_reasons=out.finished_reasons,
            output_strs=texts,
            output_ids=out.output_ids,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            output_token_logprobs=out.output_token_logprobs,
            output_top_logprobs=out.output_top_logprobs,
            input_token_logprobs=out.input_token_logprobs,
            input_top_logprobs=out.input_top_logprobs,
            output_token_ids_logprobs=out.output_token_ids_logprobs,
            input_token_ids_logprobs=out.input_token_ids_logprobs,
            spec_counts=out.spec_counts,
            output_hidden_states=out.output_hidden_states,
            routed_experts=out.routed_experts,
        )

    def _texts(self, out: BatchTokenIDOut) -> list[str]:
        texts = []
        for i, rid in enumerate(out.rids):
            finished = out.finished_reasons[i] is not None
            skip = out.skip_special_tokens[i] if i < len(out.skip_special_tokens) else True
            keep_stop = i < len(out.no_stop_trim) and out.no_stop_trim[i]
            drop_stop = not keep_stop and _drops_stop_token(out.finished_reasons[i])
            state = self.states.get(rid)
            if state is None:
                state = self.states[rid] = IncrementalDetokenizer(self.tokenizer, skip)
            try:
                texts.append(state.push(out.output_ids[i], finished, drop_stop))
            except Exception:
                # A request must still get its (final) message; losing some text beats hanging it.
                logger.exception("Failed to detokenize request %s", rid)
                texts.append("")
            if finished:
                del self.states[rid]
        return texts


def _drops_stop_token(reason: dict | None) -> bool:
    """A request stopped by a stop token id: that token is not part of the text (SGLang trims it unless
    the request asks `no_stop_trim`)."""
    return bool(reason) and reason.get("type") == "stop" and isinstance(reason.get("matched"), int)


def run_detokenizer_process(args: DetokenizerArgs, port_args: PortArgs, pipe_writer: Any = None) -> None:
    """Process entry: serve until the process is stopped. The launcher makes it exit with its parent."""
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s detokenizer] %(levelname)s %(message)s")
    try:
        manager = DetokenizerManager(None, None if args.skip_tokenizer_init else args.tokenizer_path)
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        send = ctx.socket(zmq.PUSH)
        for sock in (recv, send):
            # Output for a receiver that is gone must never hold up this process's exit.
            sock.setsockopt(zmq.LINGER, 0)
        recv.bind(port_args.detokenizer_ipc_name)
        send.connect(port_args.tokenizer_ipc_name)
    except Exception as e:  # reported to the launcher, which turns it into one clear startup error
        if pipe_writer is None:
            raise
        pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        sys.exit(1)
    if pipe_writer is not None:
        pipe_writer.send({"status": "ready"})
    while True:
        wait = manager.wait_ms()
        if wait is not None and (wait == 0 or not recv.poll(wait)):  # (overdue even while messages come)
            logger.warning("No decoder spec from the HTTP process in %.0f s: loading the tokenizer.", SPEC_WAIT_S)
            replies = manager.take_spec(DecoderSpec(None))
        else:
            msg = recv.recv_pyobj()
            replies = []
            if isinstance(msg, DecoderSpec):
                replies = manager.take_spec(msg)
            elif isinstance(msg, BatchTokenIDOut):
                replies = manager.take_output(msg)
            elif isinstance(msg, FreezeGCReq):
                gc.freeze()
            else:
                logger.warning("Detokenizer ignores an unexpected message %s", type(msg).__name__)
        for reply in replies:
            send.send_pyobj(reply)
