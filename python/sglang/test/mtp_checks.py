"""Checks of EAGLE / NEXTN speculative decoding against plain decoding (`test/unit/speculative/
test_speculative_mtp*.py`): two turns of the same prompts (the second hits the first's prefixes) on a
plain scheduler and on a NEXTN one whose drafts are the plain run's own continuation (`teacher_drafts`);
and the MTP layer after target forwards with and without CUDA-graph bodies (`test_mtp_graphs*.py`)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.environ import envs
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.speculative.mtp_draft import MtpDraftRunner, MtpHook
from sglang.test.model_checks import make_runner, random_ids
from sglang.test.runner_driver import Extend, RunnerDriver
from sglang.test.scheduler_harness import SchedulerHarness

QWEN = "tiny-qwen3-next"
DEMO = "tiny-qwen3-next-demo"
NEXTN = dict(speculative_algorithm="NEXTN")


@contextmanager
def teacher_drafts(
    monkeypatch, h: SchedulerHarness, truth: dict[tuple[int, ...], list[int]]
) -> Iterator[None]:
    """Drafts = the plain run's continuation of each request (by prompt), every third chain with its last
    draft spoiled; their distributions stay the MTP layer's (greedy requests never read them)."""
    original = MtpDraftRunner.draft_steps
    calls = [0]

    def drafts(self, plan):
        out = original(self, plan)
        chains = out.chains
        by_row = {r.req_pool_idx: r for r in h.sched.running}
        for n, (row, p) in enumerate(zip(plan.rows, plan.prefix_lens, strict=True)):
            seq = truth[tuple(by_row[row].origin_input_ids)]
            chain = seq[p + 1 : p + 1 + plan.steps]
            calls[0] += 1
            if calls[0] % 3 == 0:
                chain[-1] = (chain[-1] + 1) % 500 + 3
            chains[n] = chain
        return out

    monkeypatch.setattr(MtpDraftRunner, "draft_steps", drafts)
    yield


def two_turns(h: SchedulerHarness, prompts: list[list[int]], new: int) -> list[list]:
    """Turn 1: every prompt; turn 2: the same prompts again (prefix hits on turn 1's cache)."""
    turns = []
    for _ in range(2):
        rids = [h.submit(p, max_new_tokens=new + 5 * k, return_logprob=False) for k, p in enumerate(prompts)]
        h.run()
        h.sched.check_integrity()
        turns.append([h.outputs[r] for r in rids])
    return turns


def plain_then_spec(
    monkeypatch, preset: str, strategy: str, prompts, new: int, graph_sizes: list[int] | None = None, **kw
):
    """Plain and NEXTN outputs of `two_turns`, and the NEXTN run's totals (with `draft_loops`,
    `draft_graph_replays`, those of them a graph served, `mtp_forward_graph_replays`, the MTP layers
    after a target forward a graph served, and `mtp_verify_graph_replays`, those after a verify).
    `graph_sizes`: the NEXTN run's decodes and greedy draft loops go through the CUDA-graph runners' CPU
    form at those sizes (`SchedulerHarness.use_graph_bodies`)."""
    args = dict(
        mamba_scheduler_strategy=strategy,
        disable_overlap_schedule=True,
        chunked_prefill_size=64,  # the prompts below are chunked
        mamba_track_interval=64,
    )
    args.update(kw)
    h = SchedulerHarness(preset, **args)
    try:
        plain = two_turns(h, prompts, new)
        h.flush_and_check_empty()
    finally:
        h.shutdown()
    truth = {tuple(p): p + o.output_ids for p, o in zip(prompts, plain[0], strict=True)}
    h = SchedulerHarness(preset, **args, **NEXTN)
    try:
        if graph_sizes:
            h.use_graph_bodies(graph_sizes)
        with teacher_drafts(monkeypatch, h, truth):
            spec = two_turns(h, prompts, new)
        stats = dict(h.sched.spec.stats)
        draft = h.sched.spec.draft
        stats["draft_loops"] = draft.loops
        stats["draft_graph_replays"] = draft.graphs.replays if draft.graphs is not None else 0
        after = draft.forward_graphs
        stats["mtp_forward_graph_replays"] = after.replays if after is not None else 0
        stats["mtp_verify_graph_replays"] = after.verify_replays if after is not None else 0
        h.flush_and_check_empty()
    finally:
        h.shutdown()
    return plain, spec, stats


def assert_same(plain, spec, stats) -> None:
    for turn, (a_turn, b_turn) in enumerate(zip(plain, spec, strict=True)):
        for k, (a, b) in enumerate(zip(a_turn, b_turn, strict=True)):
            assert b.output_ids == a.output_ids, f"turn {turn + 1}, request {k}"
            assert b.cached_tokens == a.cached_tokens, f"turn {turn + 1}, request {k}"
    assert any(o.cached_tokens > 0 for o in spec[1]), "turn 2 hits turn 1's prefixes"
    # Teacher drafts: two chains in three are right, so most drafts are accepted.
    assert stats["accepted_tokens"] > stats["verify_steps"], stats


def held_out_prompts(n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` demo-model tokens spread over the held-out modules' source (never trained on)."""
    from transformers import AutoTokenizer

    from sglang.tools.train_tiny_model import corpus_files, read

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEMO))
    ids = tokenizer("".join(read(corpus_files()[1])))["input_ids"]
    step = (len(ids) - length) // n
    return [ids[i * step : i * step + length] for i in range(n)]


def demo_outputs(prompts: list[list[int]], **spec) -> tuple[list[list[int]], dict | None]:
    """The demo model's greedy 48 tokens for each prompt, and the speculative totals (with `spec`)."""
    h = SchedulerHarness(DEMO, disable_overlap_schedule=True, **spec)
    try:
        rids = [h.submit(p, max_new_tokens=48, return_logprob=False) for p in prompts]
        h.run()
        stats = dict(h.sched.spec.stats) if spec else None
        h.flush_and_check_empty()
        return [h.outputs[r].output_ids for r in rids], stats
    finally:
        h.shutdown()


def mtp_after_forward_run(kind: str, graphs: bool, device: str = "cpu") -> SimpleNamespace:
    """Three requests prefilled with the MTP hook, then four decodes or graph-shaped verifies with it (the
    verify's drafts: fixed tokens). `graphs`: a graph runner at buckets 1, 2, 4 (the three requests pad
    to 4), real CUDA graphs on CUDA (float32), its CPU form elsewhere. Returns `tokens` (sampled),
    `stash` (the requests' stash rows), `kv` (the KV pool, on the host), `replays` (the MTP layer's
    graphs after the target's), `runner`, `draft` and `last_batch` (a weak reference to the last
    forward's batch)."""
    on_cuda = device == "cuda"
    kw = dict(speculative_algorithm="NEXTN", device=device)
    if on_cuda:  # (the eager side: no graph runner of the runner's own)
        kw.update(dtype="float32", disable_cuda_graph=True)
    if kind == "verify":  # (Triton's extend attention: the torch-native one sizes itself from host lists)
        with (
            envs.SGLANG_GDN_DECODE_BACKEND.override("triton"),
            envs.SGLANG_MAMBA2_DECODE_BACKEND.override("triton"),
        ):
            runner = make_runner(QWEN, attention_backend="triton", **kw)
    else:
        runner = make_runner(QWEN, **kw)
    steps = runner.server_args.speculative_num_steps
    if graphs:  # buckets 1, 2, 4: the three requests pad to 4
        width = steps + 1 if kind == "verify" else 0
        runner.graph_runner = CudaGraphRunner(runner, [1, 2, 4], use_graphs=on_cuda, verify_width=width)
    draft = MtpDraftRunner(runner)
    driver = RunnerDriver(runner)
    reqs = [driver.new_request() for _ in range(3)]
    prompts = [random_ids(7 + 11 * i, seed=10 + i) for i in range(3)]
    hook = MtpHook(draft, next_ids=[t for p in prompts for t in p[1:] + [-1]], completes=[True] * 3)

    def prefill(fb):
        fb.spec = hook
        return runner.forward_batch_generation(fb)

    driver.extend([Extend(r, p) for r, p in zip(reqs, prompts, strict=True)], False, forward=prefill)
    tokens, last = [], [None]

    def forward(fb):
        last[0] = weakref.ref(fb)
        return runner.forward_batch_generation(fb)

    for step in range(4):
        if kind == "verify":
            drafts = [[(step * 7 + i) % 500 + 3] * steps for i in range(3)]
            spec = MtpHook(draft, widths=[steps + 1] * 3, num_drafts=[steps] * 3)
            res = driver.verify(
                reqs, drafts, return_logprob=False, graph_shaped=True, spec=spec, forward=forward
            )
        else:
            fb = driver.decode_batch(reqs, return_logprob=False)
            fb.spec = MtpHook(draft)
            res = forward(fb)
            del fb
            for r, t in zip(reqs, res.next_token_ids.tolist(), strict=True):
                r.next_token = t
        tokens.append(res.next_token_ids.tolist())
    rows = torch.tensor([r.req_pool_idx for r in reqs], device=runner.device)
    pool = runner.token_to_kv_pool
    kv = torch.stack([torch.stack(pair) for pair in zip(pool.k_buffer, pool.v_buffer, strict=True)])
    return SimpleNamespace(
        tokens=tokens,
        stash=draft.stash.hidden[rows].cpu(),
        kv=kv.cpu(),
        replays=draft.forward_graphs.replays if draft.forward_graphs is not None else 0,
        runner=runner,
        draft=draft,
        last_batch=last[0],
    )


def assert_mtp_layer_graphs_match(kind: str, device: str) -> SimpleNamespace:
    """`mtp_after_forward_run` with the graphs and without: the MTP layer's graphs served the four
    forwards' MTP layers, the sampled tokens are the same and the stash rows and KV are the eager layer's
    within a tolerance: CPU float32 1e-5 (padded rows only change the matmuls' summation blocking, ~1e-7);
    CUDA float32 1e-4 (cuBLAS may pick another kernel for a padded shape, ~1e-6 per matmul, over the
    target's layers and the MTP layer: the target graphs' GPU test's bound). A padded position writing a
    real slot, or stale hidden rows, moves them by O(1). Slot 0 is left out: padding writes there.
    Returns the graph run."""
    run = mtp_after_forward_run(kind, graphs=True, device=device)
    eager = mtp_after_forward_run(kind, graphs=False, device=device)
    tol = 1e-4 if device == "cuda" else 1e-5
    assert run.replays == 4 and eager.replays == 0
    assert run.tokens == eager.tokens
    torch.testing.assert_close(run.stash, eager.stash, rtol=tol, atol=tol)
    torch.testing.assert_close(run.kv[:, :, 1:], eager.kv[:, :, 1:], rtol=tol, atol=tol)
    return run
