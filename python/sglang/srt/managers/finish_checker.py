"""When a request is finished: its length limit, its grammar complete, a stop token id or end-of-sequence
id, a stop string or stop regex in the output's tail, or the context length. The tokenizer the stop
strings need and the end-of-sequence ids (model config, generation config, tokenizer) are gathered
here, once. A request's grammar follows its output here: each check first feeds it the new tokens."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import regex

from sglang.srt.constrained.xgrammar_backend import GrammarRejectedToken
from sglang.srt.utils.hf_transformers_utils import get_tokenizer

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.server_args import ServerArgs

# Output tokens decoded to look for a stop regex: a regex has no length to size the window by.
STOP_REGEX_TAIL_TOKENS = 64
# What a request's stop regexes may take, together, to search that tail at one step. The search runs
# on the scheduler thread: a pattern that backtracks exponentially (`(a|aa)+$` on "aaa...b") would
# stop every request for hours; one that runs out of this budget ends its request with a 400 naming
# stop_regex. The `regex` module counts its timeout in the process's CPU time (C `clock()`, every
# thread's), so other busy threads spend the budget too: it is generous, as a sane pattern takes
# ~5 us over the tail (measured on the CPU VM), 20,000 times less.
STOP_REGEX_BUDGET_S = 0.1


class StopRegexTimeout(Exception):
    """A stop regex ran out of its time on the output's tail."""

    def __init__(self, pattern: str):
        super().__init__(pattern)
        self.pattern = pattern


class FinishChecker:
    def __init__(self, eos_token_ids: set[int], context_len: int, tokenizer: Any = None):
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.tokenizer = tokenizer

    @classmethod
    def from_server_args(cls, server_args: ServerArgs) -> FinishChecker:
        eos: set[int] = set()
        cfg = server_args.model_config
        # A multimodal checkpoint (Qwen3.5's) may state its ids only in the language model's config.
        configs = (cfg.hf_config, cfg.arch.hf_config)
        values = [getattr(c, "eos_token_id", None) for c in configs] + [_generation_config_eos(cfg.path)]
        for value in values:
            if isinstance(value, int):
                eos.add(value)
            elif value:
                eos.update(value)
        tokenizer = None
        if not server_args.skip_tokenizer_init:
            tokenizer = get_tokenizer(server_args.tokenizer_path)
            if tokenizer.eos_token_id is not None:
                eos.add(tokenizer.eos_token_id)
        return cls(eos, cfg.context_len, tokenizer)

    def check_finished(self, req: Req) -> None:
        """Set `req.finished_reason` if its newest output token ends it."""
        if req.finish_token_ids is None:
            self.set_quick_check(req)
        if req.custom_logit_error is not None:
            req.finished_reason = {
                "type": "abort",
                "status_code": 400,
                "message": req.custom_logit_error,
                "param": "custom_logit_processor",
            }
            return
        grammar = req.grammar
        if grammar is not None:
            try:
                grammar.catch_up(req.output_ids)
            except GrammarRejectedToken as e:
                message = f"The request's grammar does not allow the {e} it was given."
                if req.bootstrap is not None and grammar.accepted == 0:
                    # A PD decode server's first token is the prefill server's, sampled under its flags.
                    message += (
                        " The prefill server sampled it: start both servers of the pair with the same "
                        "--grammar-backend and --constrained-json-disable-any-whitespace."
                    )
                req.finished_reason = {"type": "abort", "status_code": 500, "message": message}
                return
        sp = req.sampling_params
        n = len(req.output_ids)
        if n >= sp.max_new_tokens:
            req.finished_reason = {"type": "length", "length": sp.max_new_tokens}
            return
        token = req.output_ids[-1]
        if grammar is not None and grammar.terminated:
            # The grammar is complete (on an end-of-sequence id): upstream's "matched token" finish.
            req.finished_reason = {"type": "stop", "matched": token}
            return
        if n > sp.min_new_tokens:
            if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
                req.finished_reason = {"type": "stop", "matched": token}
                return
            if sp.stop or sp.stop_regex:
                try:
                    matched = self.match_stop_string(req)
                except StopRegexTimeout as e:
                    req.finished_reason = {
                        "type": "abort",
                        "status_code": 400,
                        "param": "stop_regex",
                        "message": f"stop_regex {e.pattern!r} took more than {STOP_REGEX_BUDGET_S * 1e3:g} "
                        "ms to search the output; use a pattern that does not backtrack without bound.",
                    }
                    return
                if matched is not None:
                    req.finished_reason = {"type": "stop", "matched": matched}
                    return
        if len(req.origin_input_ids) + n >= self.context_len:  # req.seqlen
            req.finished_reason = {"type": "length", "length": n}

    def set_quick_check(self, req: Req) -> None:
        """What a decode step's result loop tests before calling `check_finished` (one length compare
        and one set lookup per request instead of the call): the output length from which a length
        limit or a stop string may end `req`, and the token ids that may stop it."""
        sp = req.sampling_params
        ids = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            ids |= self.eos_token_ids
        req.finish_token_ids = frozenset(ids)
        if sp.stop or sp.stop_regex or req.grammar is not None or req.custom_logit_processor is not None:
            # The output's text is searched, or its grammar advanced, or its processor's failure
            # looked for, after every token.
            req.finish_check_len = 0
        else:
            req.finish_check_len = min(sp.max_new_tokens, self.context_len - len(req.origin_input_ids))

    def match_stop_string(self, req: Req) -> str | None:
        """The stop string in the output's tail, else the stop regex (its pattern, as upstream reports
        it) that matches there, else None. Raises StopRegexTimeout for a regex out of time."""
        if self.tokenizer is None:
            return None
        sp = req.sampling_params
        window = max((len(s) for s in sp.stop), default=0) + 8
        if sp.stop_regex:
            window = max(window, STOP_REGEX_TAIL_TOKENS)
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False)
        matched = next((s for s in sp.stop if s in tail), None)
        if matched is None and sp.stop_regex:
            matched = _first_match(sp.stop_regex, tail)
        return matched


def _first_match(patterns: list[str], text: str) -> str | None:
    """The first pattern found in `text`, within one budget of process CPU time for them all."""
    deadline = time.process_time() + STOP_REGEX_BUDGET_S
    for pattern in patterns:
        left = deadline - time.process_time()
        try:
            if left <= 0:
                raise TimeoutError
            if regex.search(pattern, text, timeout=left) is not None:
                return pattern
        except TimeoutError:
            raise StopRegexTimeout(pattern) from None
    return None


def _generation_config_eos(model_path: str) -> Any:
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("eos_token_id")
