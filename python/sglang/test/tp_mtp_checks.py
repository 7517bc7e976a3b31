"""The MTP draft layer (EAGLE / NEXTN) under tensor parallelism, run on each rank by `tp_model_checks`
for a case served with --speculative-algorithm NEXTN: two prompts prefilled with the MTP hook (the
layer runs after the target, its KV at layer id num_hidden_layers of the rank's pool), then the draft
logits of each request's stashed MTP output g over the whole vocabulary (`MtpDraftRunner._logits`: the
vocab-parallel head gathered), and the layer's sharded weights gathered whole."""

from __future__ import annotations

from typing import Any

import torch

# The MTP layer's parameters split across ranks (by heads, row-parallel, the experts' intermediate rows)
# and the replicated `fc`, by the names /get_weights_by_name gives them.
MTP_GATHERED = (
    "mtp.layers.0.self_attn.q_proj.weight",
    "mtp.layers.0.self_attn.k_proj.weight",
    "mtp.layers.0.self_attn.o_proj.weight",
    "mtp.layers.0.mlp.shared_expert.down_proj.weight",
    "mtp.fc.weight",
)


def mtp_draft_check(runner: Any) -> dict[str, Any]:
    from sglang.srt.speculative.mtp_draft import MtpDraftRunner, MtpHook
    from sglang.test.model_checks import random_ids
    from sglang.test.runner_driver import Extend, RunnerDriver

    draft = MtpDraftRunner(runner)
    driver = RunnerDriver(runner)
    reqs = [driver.new_request() for _ in range(2)]
    prompts = [random_ids(9 + 13 * i, seed=20 + i) for i in range(2)]
    hook = MtpHook(draft, next_ids=[t for p in prompts for t in p[1:] + [-1]], completes=[True] * 2)

    def forward(fb):
        fb.spec = hook
        return runner.forward_batch_generation(fb)

    driver.extend([Extend(r, p) for r, p in zip(reqs, prompts, strict=True)], False, forward=forward)
    rows = torch.tensor([r.req_pool_idx for r in reqs], device=runner.device)
    g = draft.stash.hidden[rows]
    logits = draft._logits(g)
    return {
        "stash": g.cpu().tolist(),
        "logits": logits.cpu().tolist(),
        "greedy": logits.argmax(dim=-1).tolist(),
        "gathered": {n: runner.get_weights_by_name(n, 10**6) for n in MTP_GATHERED},
        "mtp_kv_heads": runner.token_to_kv_pool.k_buffer[-1].shape[1],
    }
