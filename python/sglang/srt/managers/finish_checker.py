"""When a request is finished: its length limit, its grammar complete, a stop token id or end-of-sequence
id, a stop string or stop regex in the output's tail, or the context length. The tokenizer the stop
strings need and the end-of-sequence ids (model config, generation config, tokenizer) are gathered
here, once. A request's grammar follows its output here: each check first feeds it the new tokens.

What a request's grammar (its accepts and mask fills since the last check), its stop regexes and its
stop strings, where it sends more or longer ones than most clients (`constrained/stop_strings.py`,
`stops_charged`), cost the scheduler thread is charged here, once per check, to the output checks'
budget (`constrained/output_check_budget.py`), which ends a request over it with a 400 naming the field.

A check of a request whose finish depends on facts of this rank alone (a grammar's, a stop_regex
search's and a charged stop strings scan's wall time, whether the search was cut for time, whether its
custom logit processor failed here) has two phases: *measure* (the processor's failure, the grammar fed
the token, the rules' finish with the stop_regex search) and *decide* (the budget's decisions on the
measured numbers, the context length). Under tensor parallelism every rank must end a request at the
same token (`tp_broadcast.py`), so between the two the ranks agree on those numbers (`group`: MAX over
the ranks of the grammar's, the search's and the stop strings' seconds, of whether, and at which
pattern, a search was cut, of whether the processor failed and of whether the grammar refused the token;
where one failed or refused on any rank, every rank ends the request with the first such rank's finish;
the smallest of the ranks' allowances). A batch's results are measured together first (`precheck`:
one all-reduce of a (rows, 7) tensor for the whole batch, none on one rank; a speculative verify's row
gives every token it may commit, each measured on the output up to it, `_precheck_tokens`), and each
row's `check_finished` decides on its stored measurement; a check that was not prechecked (a PD decode
server's first token) measures and agrees alone. A prechecked row's allowance is the one its request
had when it was measured, the batch's rows measured before it counted as charged (`PendingCharges`; a
verify's token after a request's first is given what the step's budget has left; a row stops after the
first one over that, or before one there was no room to measure: `verify_tokens`), the smallest of the
ranks' (`output_check_budget.py`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sglang.srt.constrained.grammar_spec import grammar_key
from sglang.srt.constrained.measured import is_measured
from sglang.srt.constrained.output_check_budget import DRIFT_S, OutputCheckBudget, PendingCharges
from sglang.srt.constrained.stop_search import StopRegexTimeout, match_stop_string, search_message
from sglang.srt.constrained.stop_strings import stops_charged
from sglang.srt.constrained.xgrammar_backend import GrammarRejectedToken
from sglang.srt.managers.output_view import Appended
from sglang.srt.utils.hf_transformers_utils import get_tokenizer

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.server_args import ServerArgs

# `_Work.cut` of a verify's later token not measured (no room for it, decided before measuring it from
# earlier facts): below every pattern's index, so the ranks' MAX of the negated cut takes it first.
SKIPPED = -1

class _Work:
    """One check's measured facts (`FinishChecker._measure`): the time its output rules may take and what
    they took, the rules' finish, and a finish the measure alone decided."""

    __slots__ = (
        "allowance",
        "grammar_s",
        "regex_s",
        "stop_s",
        "field",
        "over",
        "cut",
        "length",
        "error",
        "done",
        "reason",
        "next",
        "later",
    )

    def __init__(self, allowance: float, field: str, length: int = 0):
        self.allowance = allowance
        self.grammar_s = self.regex_s = self.stop_s = 0.0  # (stop_s: the tail's decode and stop strings)
        self.field = field  # the grammar's field, or stop_regex / stop once it costs more ("": not budgeted)
        self.over = False  # went over the allowance (`OutputCheckBudget.over_allowance`)
        self.cut: int | None = None  # the stop_regex pattern at which the search ran out of time
        self.length = length  # the output length it was measured at (what it is valid for)
        self.error: str | None = None  # the custom logit processor's failure (agreed: any rank's)
        self.done: dict[str, Any] | None = None  # the grammar refused the token: the finish
        self.reason: dict[str, Any] | None = None  # the rules' finish but the context length
        self.next: _Work | None = None  # a verify row's check of its next token (`_precheck_tokens`)
        self.later = False  # a verify's token after its request's first: its overrun is no strike


class FinishChecker:
    def __init__(self, eos_token_ids: set[int], context_len: int, tokenizer: Any = None):
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.tokenizer = tokenizer
        self.budget = OutputCheckBudget()
        # Tensor parallelism: the gloo group (the scheduler thread's own) over which the ranks agree on
        # the measured checks (`_agree`); None on one rank.
        self.group: Any = None
        # The batch's measured checks (`precheck`), by request, until its `check_finished` takes them;
        # `clear_prechecks` empties it once the batch is processed.
        self._measured: dict[Req, _Work] = {}
        # Measurements agreed (`_agree` calls, with or without a group) and how many of them were a
        # check's own (not a batch's `precheck`): what the tests count.
        self.agreements = self.alone = 0
        # Verify steps prechecked: the row their later tokens start from turns with it (`_precheck_tokens`).
        self.verifies = 0

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

    # Whether a request's check is measured, then agreed (`is_measured`, the rule's one owner).
    measured = staticmethod(is_measured)

    @staticmethod
    def budgeted(req: Req) -> bool:
        """Whether `req`'s checks are charged to the output checks' budget."""
        sp = req.sampling_params
        return req.grammar is not None or bool(sp.stop_regex) or stops_charged(sp.stop)

    def precheck(self, rows: Iterable[tuple[Req, Any]], several: bool = False) -> None:
        """Measure the checks of a batch's rows before their tokens are committed (`token`: the token
        `req` is about to commit, or None for a check of its output as it is; with `several`, a verify's
        rows: the tokens each will commit, its accepted drafts and the bonus token, `_precheck_tokens`),
        then agree on them all at once: each row's `check_finished`, with that token committed, decides
        on it. Rows that are finished, that need no measure (`is_measured`), or that the budget ended
        already (their check ends them on that) are left out, alike on every rank."""
        rows = [(r, t) for r, t in rows if r.finished_reason is None and is_measured(r)]
        if not rows:
            return
        works: list[_Work] = []
        pending = PendingCharges(self.budget)
        if several:
            self._precheck_tokens(rows, pending, works)
        else:
            for req, token in rows:
                if self.budget.is_ended(req):
                    continue
                # (the output as it will be once `BatchResultProcessor.commit`, the one place that appends
                # to it, has committed the token; not a copy)
                out = req.output_ids if token is None else Appended(req.output_ids, (token,))
                work = self._measure(req, pending, out)
                if work.field:  # (a check the budget charges)
                    pending.add(req, work.grammar_s + work.regex_s + work.stop_s)
                self._measured[req] = work
                works.append(work)
        if works:
            self._agree(works)

    def _precheck_tokens(self, rows: list[tuple[Req, list[int]]], pending: PendingCharges, works: list):
        """A verify's rows: a check per token a row may commit, measured on the output up to that token and
        chained (`_Work.next`) for its `check_finished` calls in turn. They are measured by position, every
        row's first token, then every row's second, and so on: the first tokens are given what a decode
        step's would be, the later ones what the step's budget has left beside the load and the batch's
        rises (`OutputCheckBudget.allowance`, `later`; a first token's cost drop is no room). A later token
        is measured only while the step's budget has room for it at its request's latest cost beside the
        load, and its allowance fits that cost (else it is `SKIPPED`: decided from earlier facts, before
        its value matters); a row commits no skipped token, nor any after one over its allowance
        (`verify_tokens`): the budget bounds how many tokens a verify commits and what it spends. A request with
        a grammar or a custom logit processor has no drafts (`NgramWorker._drafts_for`): should it have
        some, its first token only is measured here (a matcher takes back no token it was fed), the others
        alone at their check. A row's measuring stops after a token that ends the request on what every
        rank knows alike (`_token_finish`, the context length; not a search, which one rank may cut):
        every rank measures, or counts as cut, and agrees on the same tokens. The later tokens' rows are
        taken from the next one at each verify step (`verifies`, alike on every rank); the first tokens'
        in batch order (the order they are charged in)."""
        budget = self.budget
        room = budget.per_step_s - budget.load  # (for the later tokens: the first ones replace the load's)
        live = [(req, tokens) for req, tokens in rows if not budget.is_ended(req)]
        live = [(req, tokens, None, i) for i, (req, tokens) in enumerate(live)]
        # The later tokens from the next row at each step (where the budget runs out, the same rows would
        # go without); the first tokens in batch order, the commit's: a first token's allowance counts the
        # rows measured before it as charged, cost drops included, which holds only in the commit's order.
        turn, count = (self.verifies % len(live), len(live)) if live else (0, 1)
        self.verifies += bool(live)
        k = 0
        while live:
            after = []
            if k:
                live.sort(key=lambda row: (row[3] - turn) % count)
            for req, tokens, prev, i in live:
                out = Appended(req.output_ids, tokens[: k + 1])
                if not k:
                    work = self._measure(req, pending, out)
                else:
                    cost = budget.cost(req)
                    if cost > room + DRIFT_S:
                        continue  # (this token and the row's next ones are not committed this step)
                    room -= cost
                    allowance = budget.allowance(req, pending, True)
                    if allowance + DRIFT_S < cost or allowance <= 0:
                        work = _Work(allowance, "", len(out))  # (not measured: would not fit)
                        work.cut = SKIPPED
                    else:
                        work = self._measure(req, pending, out, True)
                    work.later = True
                if work.field:
                    pending.add(req, work.grammar_s + work.regex_s + work.stop_s, k > 0)
                if prev is None:
                    self._measured[req] = work
                else:
                    prev.next = work
                works.append(work)
                if k + 1 == len(tokens) or req.grammar is not None or req.custom_logit_processor is not None:
                    continue
                n = len(out)
                if self._token_finish(req, n, tokens[k]) or self._context_finish(req, None, n):
                    continue  # (it ends there on every rank)
                after.append((req, tokens, work, i))
            live, k = after, k + 1

    def verify_tokens(self, req: Req) -> int | None:
        """How many of the tokens its verify row was prechecked with (`precheck`, `several`) `req` may
        commit; None where the row was not prechecked. A token after the first is committed where it was
        measured (not `SKIPPED`), and the row stops after the first one whose agreed check went over the
        allowance it was given (a search cut, or costs past it): whether a token is committed depends on
        the tokens before it only, never on its own cost, so a sampled token keeps its distribution (the
        positions after it are sampled again at the next step, as after a rejected draft). That token's
        overrun is no strike (`_decide`) and its cut search finds nothing (searched again at the next
        token), so a later token ends no request by itself (its overrun, charged in full, may still end the
        costliest request for the step's load, as a decode token's can). Every rank counts alike."""
        work = self._measured.get(req)
        if work is None:
            return None
        n, work = 1, work.next
        while work is not None and work.cut != SKIPPED:
            n += 1
            if work.cut is not None or work.grammar_s + work.regex_s + work.stop_s > work.allowance:
                break  # (committed: its own cost decides only whether the tokens after it are)
            work = work.next
        return n

    def clear_prechecks(self) -> None:
        """The batch is processed: measurements no check took (its requests ended meanwhile) go."""
        self._measured.clear()

    def check_finished(self, req: Req) -> None:
        """Set `req.finished_reason` if its newest output token ends it."""
        if req.finish_token_ids is None:
            self.set_quick_check(req)
        if not is_measured(req):
            reason = self._rule_finish(req, None)
            req.finished_reason = self._context_finish(req, reason)
            return
        budget = self.budget
        budgeted = self.budgeted(req)
        if budgeted:
            why = budget.ended(req)
            if why is not None:
                self._measured.pop(req, None)
                req.finished_reason = _bad_request(budget.over_load_message(why), why)
                return
        work = self._measured.pop(req, None)
        if work is None or work.length != len(req.output_ids):
            work = self._measure(req)
            self.alone += 1
            self._agree([work])
        elif work.next is not None:
            self._measured[req] = work.next  # (a verify's next token: its check comes next)
        self._decide(req, work, budgeted)
        if not budgeted:
            return
        if req.finished_reason is not None:
            budget.forget(req)
            return
        budget.charge(req, work.grammar_s + work.regex_s + work.stop_s, work.field, work.over)
        why = budget.ended(req)
        if why is not None:
            req.finished_reason = _bad_request(budget.over_load_message(why), why)

    def _measure(
        self, req: Req, pending: PendingCharges | None = None, out: Any = None, later: bool = False
    ) -> _Work:
        """What this rank alone knows of `req`'s check of its newest token (`out`: its output, by default
        `req.output_ids`; `later`: a verify's token after the first, `OutputCheckBudget.allowance`): the
        processor's failure, the grammar fed the token (its refusal, its seconds), the rules' finish (the
        stop_regex search, cut for time: `work.cut`)."""
        out = req.output_ids if out is None else out
        sp = req.sampling_params
        if self.budgeted(req):
            key = grammar_key(sp)
            field = "stop_regex" if sp.stop_regex else "stop"
            field = field if req.grammar is None else key[0] if key is not None else "grammar"
            work = _Work(self.budget.allowance(req, pending, later), field, len(out))
        else:
            work = _Work(math.inf, "", len(out))
        work.error = req.custom_logit_error
        if work.error is not None:
            return work  # (the check ends the request on it: nothing else is measured)
        grammar = req.grammar
        if grammar is not None:
            try:
                grammar.catch_up(out)
            except GrammarRejectedToken as e:
                message = f"The request's grammar does not allow the {e} it was given."
                if req.bootstrap is not None and grammar.accepted == 0:
                    # A PD decode server's first token is the prefill server's, sampled under its flags.
                    message += (
                        " The prefill server sampled it: start both servers of the pair with the same "
                        "--grammar-backend, --constrained-json-disable-any-whitespace, --reasoning-parser, "
                        "--enable-strict-thinking and SGLANG_MAX_THINK_TOKENS."
                    )
                work.done = {"type": "abort", "status_code": 500, "message": message}
                return work
            work.grammar_s = grammar.take_spent()
        work.reason = self._rule_finish(req, work, out)
        return work

    def _decide(self, req: Req, work: _Work, budgeted: bool) -> None:
        """`req`'s finish from its agreed measure: a processor's failure first, then the grammar's
        refusal, then the budget's decisions (the grammar's overrun before any other finish, then a cut
        search), then the rules' finish and the context length."""
        if work.error is not None:
            req.finished_reason = _bad_request(work.error, "custom_logit_processor")
            return
        if work.done is not None:
            req.finished_reason = work.done
            return
        reason = work.reason
        if budgeted:
            if work.grammar_s > work.allowance:
                work.over = True
                if not work.later and self.budget.over_allowance(req, work.grammar_s, work.allowance):
                    message = self.budget.over_allowance_message(work.field, work.grammar_s, work.allowance)
                    req.finished_reason = _bad_request(message, work.field)
                    return
            if work.regex_s > work.grammar_s:
                work.field = "stop_regex"
            if work.stop_s > max(work.grammar_s, work.regex_s):
                work.field = "stop" if req.sampling_params.stop else "stop_regex"
            limit = work.allowance - work.grammar_s - work.stop_s  # (what the search was given)
            if work.cut is None and limit > 0 and work.regex_s > limit:
                # A search that ended past what the agreed allowance left it (under TP each rank searched
                # within its own allowance; the slowest rank's time is agreed) is over it as a cut one is.
                work.over = True
                if not work.later and self.budget.over_allowance(req, work.regex_s, limit):
                    req.finished_reason = _bad_request(search_message(req, None, limit), "stop_regex")
                    return
            if work.cut is not None:
                work.over = True
                # (None at all where the grammar took the whole allowance: that overrun is the grammar's,
                # judged above; the search runs again at the next token.)
                if limit > 0 and not work.later and self.budget.over_allowance(req, limit, limit):
                    req.finished_reason = _bad_request(search_message(req, work.cut, limit), "stop_regex")
                    return
                reason = None  # (searched again, over the same tail and more, at the next token)
        req.finished_reason = self._context_finish(req, reason)

    def _context_finish(self, req: Req, reason: dict[str, Any] | None, n: int | None = None) -> dict | None:
        n = len(req.output_ids) if n is None else n
        if reason is None and len(req.origin_input_ids) + n >= self.context_len:  # req.seqlen
            return {"type": "length", "length": n}
        return reason

    def _rule_finish(self, req: Req, work: _Work | None, out: Any = None) -> dict[str, Any] | None:
        """The finish the request's rules give the newest token of `out` (its output, by default
        `req.output_ids`) but the context length: its length limit, its grammar complete, a stop token,
        a stop string or stop regex (a search cut for time is `work.cut`, and finds nothing)."""
        sp = req.sampling_params
        out = req.output_ids if out is None else out
        n = len(out)
        reason = self._token_finish(req, n, out[-1] if n else None)
        if reason is not None:
            return reason
        token = out[-1]
        if req.grammar is not None and req.grammar.terminated:
            # The grammar is complete (on an end-of-sequence id): upstream's "matched token" finish.
            return {"type": "stop", "matched": token}
        if n > sp.min_new_tokens:
            if sp.stop or sp.stop_regex:
                try:
                    matched = match_stop_string(self.tokenizer, req, work, out)
                except StopRegexTimeout as e:
                    work.cut = e.index
                    return None
                if matched is not None:
                    return {"type": "stop", "matched": matched}
        return None

    def _token_finish(self, req: Req, n: int, token: int | None) -> dict[str, Any] | None:
        """The finish an output of `n` tokens ending in `token` has by `req`'s length limit or a stop token
        (stop_token_ids, end-of-sequence ids): what every rank knows alike, measured or not."""
        sp = req.sampling_params
        if n >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        if n > sp.min_new_tokens and (
            token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids)
        ):
            return {"type": "stop", "matched": token}
        return None

    def _agree(self, works: list[_Work]) -> None:
        """Every rank takes, per measured check, the smallest of the ranks' allowances, the greatest of
        their costs, the search as cut (at the first pattern cut) where any rank's was, and the processor
        as failed or the token as refused by the grammar where any rank's was: one all-reduce MAX of a
        (checks, 7) tensor on the scheduler thread's gloo group, and, only where a processor failed or a
        grammar refused, one gather of those finishes (every rank takes the first such rank's). Nothing
        to do on one rank."""
        self.agreements += 1
        if self.group is None:
            return
        values = torch.tensor(
            [
                (
                    -w.allowance,
                    w.grammar_s,
                    w.regex_s,
                    w.stop_s,
                    _negated(w.cut),
                    w.error is not None,
                    w.done is not None,
                )
                for w in works
            ],
            dtype=torch.float64,
        )
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        failed = []
        # (a host tensor, read through numpy: no device sync)
        for i, (work, row) in enumerate(zip(works, values.numpy(), strict=True)):
            allowance, grammar_s, regex_s, stop_s, cut, error, refused = map(float, row)
            work.allowance, work.grammar_s, work.regex_s, work.stop_s = -allowance, grammar_s, regex_s, stop_s
            work.cut = None if cut == -math.inf else int(-cut)
            if error > 0 or refused > 0:
                failed.append((i, error > 0, refused > 0))
        if failed:
            # Where a processor failed or a grammar refused the token on any rank, every rank ends the
            # request with the first such rank's finish (a matcher that refused on one rank only: another
            # xgrammar build on another node). The processor's failure comes first, as in `_decide`.
            mine = {i: (works[i].error, works[i].done) for i, _, _ in failed}
            everyone: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, mine, group=self.group)
            for i, error, refused in failed:
                if error:
                    works[i].error = next(m[i][0] for m in everyone if m[i][0] is not None)
                if refused:
                    works[i].done = next(m[i][1] for m in everyone if m[i][1] is not None)

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


def _negated(cut: int | None) -> float:
    """A cut pattern's index for the MAX all-reduce: the first pattern cut on any rank wins."""
    return -math.inf if cut is None else -float(cut)


def _bad_request(message: str, param: str) -> dict[str, Any]:
    return {"type": "abort", "status_code": 400, "message": message, "param": param}


def _generation_config_eos(model_path: str) -> Any:
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("eos_token_id")
