"""Functions run on each rank by `sglang.test.multi_rank.run_ranks` (importable by name, as spawn needs)."""

from __future__ import annotations

import torch

from sglang.srt import distributed as ps


def parallel_state_probe(rank: int, world_size: int, init_method: str) -> tuple:
    """TP over all ranks and EP over pairs: a sum, a gather, an EP sum and a broadcast object."""
    ps.init_distributed_environment("gloo", world_size, rank, init_method)
    ps.initialize_model_parallel(world_size, 2)
    try:
        tp, ep = ps.get_tp_group(), ps.get_ep_group()
        summed = tp.all_reduce(torch.full((2,), float(rank + 1)))
        gathered = tp.all_gather(torch.tensor([float(rank)]), dim=0)
        ep_sum = ep.all_reduce(torch.tensor([float(rank)]))
        obj = tp.broadcast_object({"from": rank} if rank == 0 else None)
        return summed.tolist(), gathered.tolist(), ep.ranks, ep.rank_in_group, ep_sum.item(), obj
    finally:
        ps.destroy_model_parallel()


def output_check_agreement(rank: int, world_size: int, init_method: str, costs: list[list[float]]) -> dict:
    """Under TP, each rank's FinishChecker with the ranks' agreement group (`FinishChecker.group`) and a
    request whose grammar reports this rank's `costs[rank]` seconds per check, then one with a stop_regex
    whose search is cut for time on rank 1 only (at its second pattern). Per request: the output length
    at which it ended and its finish reason (None: never ended). Also the agreement's cost per check."""
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from sglang.srt.constrained import stop_search
    from sglang.srt.constrained.output_check_budget import OutputCheckBudget
    from sglang.srt.managers import finish_checker as fc
    from sglang.srt.managers.finish_checker import FinishChecker
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)), backend="gloo")
    try:

        def checker() -> FinishChecker:
            c = FinishChecker(set(), 4096, tokenizer=SimpleNamespace(decode=lambda ids, **kw: "x" * len(ids)))
            c.budget = OutputCheckBudget(per_request_s=0.05, per_step_s=0.2)
            c.group = group
            return c

        def run(c: FinishChecker, req: Req, steps: int) -> tuple[int, dict | None]:
            for n in range(1, steps + 1):
                req.output_ids.append(7)
                c.check_finished(req)
                if req.finished_reason is not None:
                    return n, req.finished_reason
            return steps, None

        out = {}
        mine = list(costs[rank])
        grammar = SimpleNamespace(terminated=False, stopped=False, catch_up=lambda ids: None)
        grammar.take_spent = lambda: mine.pop(0)
        req = Req("g", [5], SamplingParams(ebnf='root ::= "a"', max_new_tokens=100))
        req.grammar = grammar
        out["grammar"] = run(checker(), req, len(costs[rank]))

        # The search is cut on rank 1 at its second pattern (as a loaded rank's `regex` timeout would);
        # rank 0's finds that pattern ("x") in the tail at once: alone, it would stop there.
        real = stop_search._first_match

        def first_match(patterns, text, limit):
            if rank == 1:
                raise stop_search.StopRegexTimeout(patterns[1], limit, 1)
            return real(patterns, text, limit)

        stop_search._first_match = first_match
        try:
            req = Req("r", [5], SamplingParams(stop_regex=["y", "x"], max_new_tokens=100))
            out["stop_regex"] = run(checker(), req, 5)
        finally:
            stop_search._first_match = real

        # The agreement's cost: one all-reduce per check of a request with a grammar or a stop_regex.
        c = checker()
        work = fc._Work(0.05, "ebnf")
        start = time.perf_counter()
        for _ in range(200):
            c._agree([work])
        out["agree_s"] = (time.perf_counter() - start) / 200
        return out
    finally:
        dist.destroy_process_group()
