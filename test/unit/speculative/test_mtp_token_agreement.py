"""Under tensor parallelism the ranks agree on the sampled tokens (`model_runner.agree_on_tokens`: with a
grammar, a custom logit processor or SYNC_TOKEN_IDS_ACROSS_TP every rank takes the smallest id any rank
sampled), and the MTP layer's hook must read the agreed tokens: they are the next tokens the MTP layer
runs on, they decide a verify's accepted drafts, and so the stash rows and the next drafts. Two ranks are
simulated in this process, each a runner of its own: rank 1 samples every token one id above rank 0 (as
a grammar mask or a logit processor evaluated on each rank's own may make it), and the agreement hands
both rank 0's. After a prefill, a verify and a decode step both ranks hold the same stash rows and draft
the same tokens (before, the hook ran on each rank's own sample, before the agreement: the stash rows
already differed after the prefill). The agreement's collective itself: test_tp_runtime."""

from __future__ import annotations

import torch

from sglang.srt.model_executor import model_runner as model_runner_module
from sglang.srt.model_executor.forward_batch_info import SamplingBatchInfo
from sglang.srt.speculative.mtp_draft import DraftPlan, MtpDraftRunner, MtpHook
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, random_ids
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def _rank(monkeypatch, rank: int) -> list:
    """What rank `rank` holds after each forward: its stash rows and the drafts it plans from them."""
    runner = make_runner("tiny-qwen3-next", speculative_algorithm="NEXTN")
    draft, driver = MtpDraftRunner(runner), RunnerDriver(runner)
    steps = runner.server_args.speculative_num_steps
    vocab = runner.model.config.vocab_size
    sampler, agreed = runner.sampler, {}

    def own_sample(*args, **kwargs):
        out = sampler(*args, **kwargs)
        agreed["ids"] = out.next_token_ids.clone()  # (rank 0's: the smaller)
        out.next_token_ids = (out.next_token_ids + rank) % vocab
        return out

    runner.sampler = own_sample
    monkeypatch.setattr(model_runner_module, "agree_on_tokens", lambda ids, fb: agreed["ids"])
    reqs = [driver.new_request() for _ in range(2)]
    prompts = [random_ids(6 + 5 * i, seed=30 + i) for i in range(2)]
    rows = torch.tensor([r.req_pool_idx for r in reqs])
    held = []

    def hold():
        plan = DraftPlan(
            rows=[r.req_pool_idx for r in reqs],
            prefix_lens=[r.seq_len for r in reqs],
            slots=[driver._alloc_kv(r, steps) for r in reqs],
            writes=[],
            sampling_info=SamplingBatchInfo.create([0.0] * len(reqs)),
            steps=steps,
        )
        stash = draft.stash.hidden[rows].clone()
        drafts = draft.draft_steps(plan).chains
        held.append((stash, drafts, [r.next_token for r in reqs]))
        return drafts

    def prefill(fb):
        fb.spec = MtpHook(draft, next_ids=[t for p in prompts for t in p[1:] + [-1]], completes=[True] * 2)
        return runner.forward_batch_generation(fb)

    driver.extend([Extend(r, p) for r, p in zip(reqs, prompts, strict=True)], False, forward=prefill)
    drafts = hold()
    spec = MtpHook(draft, widths=[steps + 1] * 2, num_drafts=[steps] * 2)
    driver.verify(reqs, drafts, return_logprob=False, spec=spec)
    hold()
    fb = driver.decode_batch(reqs, return_logprob=False)
    fb.spec = MtpHook(draft)
    for r, t in zip(reqs, runner.forward_batch_generation(fb).next_token_ids.tolist(), strict=True):
        r.next_token = t
    hold()
    return held


def test_every_rank_drafts_from_the_agreed_tokens(monkeypatch):
    ranks = [_rank(monkeypatch, r) for r in (0, 1)]
    for step, (a, b) in enumerate(zip(*ranks, strict=True)):
        assert a[2] == b[2], step  # (the agreed tokens: the same on both, as the agreement makes them)
        assert torch.equal(a[0], b[0]), step  # the stash rows
        assert a[1] == b[1], step  # the drafts
