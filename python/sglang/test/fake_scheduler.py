"""A fake scheduler process: the real one's entry signature and ZMQ protocol, no model.

Front-end tests (TokenizerManager, detokenizer, Engine, HTTP server) run against it, so they do not
depend on the model or the scheduler. Tokens are deterministic (a function of the previous token, the
position and the seed); logprobs are made up but consistent; a finished request's ids are remembered
so that a repeated prefix reports `cached_tokens`, as a prefix cache would. It honours max_new_tokens,
stop_token_ids, stop strings and regexes, aborts (one or all), flush_cache (refused while requests
run), pause/continue (no steps while paused) and internal-state queries with the real scheduler's keys, and
sends the heartbeat. `SGLANG_TEST_FORWARD_DELAY_MS` slows each step, as it slows the real forward.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import zmq

from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import (
    HEARTBEAT_INTERVAL_S,
    AbortReq,
    BatchTokenIDOut,
    BatchTokenizedGenerateReqInput,
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    PortArgs,
    SchedulerHeartbeat,
    TokenizedGenerateReqInput,
)
from sglang.srt.utils.hf_transformers_utils import get_tokenizer

FAKE_TOTAL_TOKENS = 16384
FAKE_MAMBA_SLOTS = 256
NUM_SPECIAL = 3  # ids 0..2 are special in the tiny presets; the fake never samples them


def fake_token(prev: int, pos: int, seed: int, vocab: int) -> int:
    return NUM_SPECIAL + (prev * 31 + pos * 17 + seed * 7) % (vocab - NUM_SPECIAL)


def fake_logprob(token: int, pos: int) -> float:
    return -(((token * 7 + pos) % 50) / 10.0) - 0.01


class _Req:
    def __init__(self, req: TokenizedGenerateReqInput, cached: int):
        self.req = req
        self.output: list[int] = []
        self.cached = cached
        self.sent_first = False


class FakeScheduler:
    def __init__(self, server_args: Any, port_args: PortArgs):
        self.server_args = server_args
        cfg = server_args.model_config
        self.vocab = cfg.vocab_size
        self.context_len = cfg.context_len
        self.max_running = server_args.max_running_requests or 64
        self.tokenizer = get_tokenizer(server_args.tokenizer_path)
        self.running: dict[str, _Req] = {}
        self.waiting: list[_Req] = []
        self.cache: list[tuple[int, ...]] = []
        self.paused = False
        self.counters = dict.fromkeys(
            (
                "num_requests_total",
                "num_prompt_tokens_total",
                "num_generation_tokens_total",
                "num_cached_tokens_total",
            ),
            0,
        )
        ctx = zmq.Context()
        self.recv = ctx.socket(zmq.PULL)
        self.recv.bind(port_args.scheduler_input_ipc_name)
        self.to_detok = ctx.socket(zmq.PUSH)
        self.to_detok.connect(port_args.detokenizer_ipc_name)
        self.to_tokenizer = ctx.socket(zmq.PUSH)
        self.to_tokenizer.connect(port_args.tokenizer_ipc_name)

    def ready_message(self) -> dict[str, Any]:
        return {
            "status": "ready",
            "max_total_num_tokens": FAKE_TOTAL_TOKENS,
            "max_req_input_len": self.context_len - 1,
            "context_len": self.context_len,
            "vocab_size": self.vocab,
            "max_running_requests": self.max_running,
        }

    # ---- loop ----------------------------------------------------------------------------------

    def serve(self) -> None:
        parent = os.getppid()
        last_beat = 0.0
        while True:
            if time.monotonic() - last_beat >= HEARTBEAT_INTERVAL_S:  # as the real scheduler's loop
                last_beat = time.monotonic()
                self.to_tokenizer.send_pyobj(SchedulerHeartbeat())
            busy = bool(self.running or self.waiting) and not self.paused
            if self.recv.poll(0 if busy else 100):
                while self.recv.poll(0):
                    self.handle(self.recv.recv_pyobj())
            elif not busy and os.getppid() != parent:
                return
            if (self.running or self.waiting) and not self.paused:
                delay = envs.SGLANG_TEST_FORWARD_DELAY_MS.get()
                time.sleep(delay / 1000 if delay > 0 else 0.001)
                self.step()

    def handle(self, msg: Any) -> None:
        if isinstance(msg, BatchTokenizedGenerateReqInput):
            for one in msg:
                self.handle(one)
        elif isinstance(msg, TokenizedGenerateReqInput):
            self.waiting.append(_Req(msg, self._cached_len(msg.input_ids)))
        elif isinstance(msg, AbortReq):
            targets = list(self.running.values()) + self.waiting if msg.abort_all else []
            if msg.rid in self.running:
                targets.append(self.running[msg.rid])
            targets += [r for r in self.waiting if r.req.rid == msg.rid]
            if targets:
                self.waiting = [r for r in self.waiting if r not in targets]
                for r in targets:
                    self.running.pop(r.req.rid, None)
                self._send(
                    targets, [{"type": "abort", "message": msg.message}] * len(targets), [[]] * len(targets)
                )
        elif isinstance(msg, FlushCacheReqInput):
            busy = bool(self.running or self.waiting)
            if not busy:
                self.cache.clear()
            message = "The cache was not flushed: requests are running." if busy else ""
            self.to_tokenizer.send_pyobj(FlushCacheReqOutput(success=not busy, message=message))
        elif isinstance(msg, GetInternalStateReq):
            self.to_tokenizer.send_pyobj(GetInternalStateReqOutput(self.internal_state()))
        elif isinstance(msg, PauseGenerationReqInput):
            self.paused = True
            self.to_tokenizer.send_pyobj(PauseGenerationReqOutput())
        elif isinstance(msg, ContinueGenerationReqInput):
            self.paused = False
            self.to_tokenizer.send_pyobj(ContinueGenerationReqOutput())

    def step(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting.pop(0)
            self.running[r.req.rid] = r
        reqs, reasons, new_ids = [], [], []
        for r in list(self.running.values()):
            p = r.req.sampling_params
            ids = r.req.input_ids + r.output
            new: list[int] = []
            if p.max_new_tokens > len(r.output) and len(ids) < self.context_len:
                tok = fake_token(ids[-1], len(ids), p.sampling_seed or 0, self.vocab)
                r.output.append(tok)
                new.append(tok)
            reason = self._finish_reason(r)
            if reason is not None:
                del self.running[r.req.rid]
                self._on_finish(r)
            reqs.append(r)
            reasons.append(reason)
            new_ids.append(new)
        if reqs:
            self._send(reqs, reasons, new_ids)

    def _finish_reason(self, r: _Req) -> dict[str, Any] | None:
        p = r.req.sampling_params
        if r.output and r.output[-1] in p.stop_token_ids:
            return {"type": "stop", "matched": r.output[-1]}
        if p.stop or p.stop_regex:
            text = self.tokenizer.decode(r.output[-8:])
            for s in p.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
            for pattern in p.stop_regex:
                if re.search(pattern, text):
                    return {"type": "stop", "matched": pattern}
        if len(r.output) >= p.max_new_tokens or len(r.req.input_ids) + len(r.output) >= self.context_len:
            return {"type": "length", "length": len(r.output)}
        return None

    def _on_finish(self, r: _Req) -> None:
        self.cache.append(tuple(r.req.input_ids + r.output))
        c = self.counters
        c["num_requests_total"] += 1
        c["num_prompt_tokens_total"] += len(r.req.input_ids)
        c["num_generation_tokens_total"] += len(r.output)
        c["num_cached_tokens_total"] += r.cached

    def _cached_len(self, ids: list[int]) -> int:
        best = 0
        for seq in self.cache:
            n = 0
            for a, b in zip(seq, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1)

    def _send(self, reqs: list[_Req], reasons: list[Any], new_ids: list[list[int]]) -> None:
        out = BatchTokenIDOut(
            rids=[r.req.rid for r in reqs],
            finished_reasons=reasons,
            output_ids=new_ids,
            prompt_tokens=[len(r.req.input_ids) for r in reqs],
            completion_tokens=[len(r.output) for r in reqs],
            cached_tokens=[r.cached for r in reqs],
            skip_special_tokens=[r.req.sampling_params.skip_special_tokens for r in reqs],
        )
        for r, ids in zip(reqs, new_ids, strict=True):
            self._add_logprobs(out, r, ids)
            r.sent_first = True
        self.to_detok.send_pyobj(out)

    def _add_logprobs(self, out: BatchTokenIDOut, r: _Req, ids: list[int]) -> None:
        req = r.req
        if not req.return_logprob:
            for lst in (out.output_token_logprobs, out.output_top_logprobs):
                lst.append(None)
            out.input_token_logprobs.append(None)
            out.input_top_logprobs.append(None)
            return
        start = len(req.input_ids) + len(r.output) - len(ids)
        out.output_token_logprobs.append([(fake_logprob(t, start + k), t) for k, t in enumerate(ids)])
        out.output_top_logprobs.append(
            [self._top(t, start + k, req.top_logprobs_num) for k, t in enumerate(ids)]
        )
        first = not r.sent_first and req.logprob_start_len >= 0
        positions = range(req.logprob_start_len, len(req.input_ids)) if first else range(0)
        out.input_token_logprobs.append(
            [(None if p == 0 else fake_logprob(req.input_ids[p], p), req.input_ids[p]) for p in positions]
            if first
            else None
        )
        out.input_top_logprobs.append(
            [None if p == 0 else self._top(req.input_ids[p], p, req.top_logprobs_num) for p in positions]
            if first
            else None
        )

    def _top(self, token: int, pos: int, k: int) -> list[tuple[float, int]]:
        others = [NUM_SPECIAL + (token + 1 + j) % (self.vocab - NUM_SPECIAL) for j in range(max(k - 1, 0))]
        return [(fake_logprob(token, pos), token)] + [
            (fake_logprob(token, pos) - 1 - j, t) for j, t in enumerate(others)
        ]

    def internal_state(self) -> dict[str, Any]:
        held_tokens = sum(len(r.req.input_ids) + len(r.output) for r in self.running.values())
        tree_tokens = min(sum(len(s) for s in self.cache), FAKE_TOTAL_TOKENS - held_tokens)
        slots = self.server_args.mamba_strategy.resident_slots_per_req
        held_slots = slots * len(self.running)
        tree_slots = min(len(self.cache), FAKE_MAMBA_SLOTS - held_slots)
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "mamba_scheduler_strategy": self.server_args.mamba_scheduler_strategy,
            "mamba_strategy_reason": self.server_args.mamba_strategy_reason,
            "resident_slots_per_req": slots,
            "max_running_requests": self.max_running,
            "max_total_num_tokens": FAKE_TOTAL_TOKENS,
            "token_usage": {
                "total": FAKE_TOTAL_TOKENS,
                "free": FAKE_TOTAL_TOKENS - held_tokens - tree_tokens,
                "held_by_requests": held_tokens,
                "held_by_tree": tree_tokens,
            },
            "mamba_usage": {
                "total": FAKE_MAMBA_SLOTS,
                "free": FAKE_MAMBA_SLOTS - held_slots - tree_slots,
                "held_by_requests": held_slots,
                "held_by_tree": tree_slots,
                "reserved_by_group": 0,
            },
            "lazy_alloc_failures": {"first_try": 0, "retry": 0},
            "counters": dict(self.counters),
        }


def run_scheduler_process(server_args: Any, port_args: PortArgs, pipe_writer: Any) -> None:
    try:
        scheduler = FakeScheduler(server_args, port_args)
    except Exception as e:
        pipe_writer.send({"status": "error", "message": str(e)})
        raise
    pipe_writer.send(scheduler.ready_message())
    scheduler.serve()


def run_failing_scheduler_process(server_args: Any, port_args: PortArgs, pipe_writer: Any) -> None:
    """Reports a startup error, as the real scheduler does when the model cannot be loaded."""
    pipe_writer.send({"status": "error", "message": "the fake model cannot be loaded (test)."})


def run_crashing_scheduler_process(server_args: Any, port_args: PortArgs, pipe_writer: Any) -> None:
    """Dies before the handshake, as a process killed by the OOM killer would."""
    os._exit(3)
