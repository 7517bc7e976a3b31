"""Helpers of the MTP layer's weight-route tests (`test/unit/speculative/test_mtp_weight_updates*.py`):
a checkpoint's tensors, a copy of it without its MTP layer or with another one, the serving MTP layer's
values, and the drafts a runner makes (the MTP layer's output after a prefill and decodes, and a greedy
draft loop from it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.forward_batch_info import SamplingBatchInfo
from sglang.srt.models.loader import checkpoint_files
from sglang.srt.speculative.mtp_draft import DraftPlan, MtpDraftRunner, MtpHook
from sglang.test.model_checks import random_ids
from sglang.test.runner_driver import Extend, RunnerDriver


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint folder `path`, the MTP layer's (`mtp.*`) included."""
    out = {}
    for f in checkpoint_files(path):
        out.update(load_file(str(f)))
    return out


def draft_params(runner) -> dict[str, torch.Tensor]:
    """The serving MTP layer's parameters by its own names, copied."""
    return {n: p.detach().clone() for n, p in runner.draft_model.named_parameters()}


def edit_mtp(src: str, dst: Path, edit) -> str:
    """A copy of the checkpoint folder `src` at `dst` whose `mtp.*` tensors are `edit(tensors)`'s (a dict
    of them; an empty one: a checkpoint saved without its MTP layer), the others unchanged."""
    shutil.copytree(src, dst)
    for f in checkpoint_files(dst):
        tensors = load_file(str(f))
        mtp = edit({n: t for n, t in tensors.items() if n.startswith("mtp.")})
        kept = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
        save_file({**kept, **mtp}, str(f), metadata={"format": "pt"})
    return str(dst)


def without_mtp(src: str, dst: Path) -> str:
    return edit_mtp(src, dst, lambda mtp: {})


def drafts(
    runner, draft: MtpDraftRunner | None = None, steps: int = 3
) -> tuple[torch.Tensor, list[list[int]]]:
    """(the stash rows of three requests after a prefill and two decodes with the MTP layer, their greedy
    `steps` drafts), with `draft` (default: a new draft runner over the graph runner's CPU form at
    buckets 1, 2, 4, where three requests pad to 4). The draft loop runs its graph body."""
    if draft is None:
        runner.graph_runner = CudaGraphRunner(runner, [1, 2, 4], use_graphs=False)
        draft = MtpDraftRunner(runner)
    driver = RunnerDriver(runner)
    reqs = [driver.new_request() for _ in range(3)]
    prompts = [random_ids(9 + 13 * i, seed=i) for i in range(3)]

    def prefill(fb):
        fb.spec = MtpHook(draft, next_ids=[t for p in prompts for t in p[1:] + [-1]], completes=[True] * 3)
        return runner.forward_batch_generation(fb)

    driver.extend([Extend(r, p) for r, p in zip(reqs, prompts, strict=True)], False, forward=prefill)
    for _ in range(2):
        fb = driver.decode_batch(reqs, return_logprob=False)
        fb.spec = MtpHook(draft)
        for r, t in zip(reqs, runner.forward_batch_generation(fb).next_token_ids.tolist(), strict=True):
            r.next_token = t
    plan = DraftPlan(
        rows=[r.req_pool_idx for r in reqs],
        prefix_lens=[r.seq_len for r in reqs],
        slots=[driver._alloc_kv(r, steps) for r in reqs],
        writes=[],
        sampling_info=SamplingBatchInfo.create([0.0] * 3),
        steps=steps,
    )
    replays = draft.graphs.replays
    chains = draft.draft_steps(plan).chains
    assert draft.graphs.replays == replays + 1  # (the loop ran its graph body)
    return draft.stash.hidden[[r.req_pool_idx for r in reqs]].clone(), chains
