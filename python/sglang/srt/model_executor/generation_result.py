"""What one forward returns (`GenerationBatchResult`), and the TP ranks' agreement on the tokens they
sampled (`agree_on_tokens`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sglang.srt.distributed import get_tp_group
from sglang.srt.environ import envs
from sglang.srt.layers.logits_processor import HiddenRows, TopLogprobs
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class GenerationBatchResult:
    """Results of one forward: sampled ids and logprobs on the device, the rest host lists. Logprob conventions: see `layers/logits_processor.py`."""

    next_token_ids: torch.Tensor  # [bs] int64, on the model's device
    next_token_logprobs: torch.Tensor | None = None  # [bs] float32, on the model's device
    next_token_top_logprobs: list[TopLogprobs | None] | None = None
    next_token_ids_logprobs: list[TopLogprobs | None] | None = None  # upstream's token_ids_logprob
    # Extend only, per request (empty for requests without return_logprob).
    input_token_logprobs: list[list[float]] | None = None
    input_top_logprobs: list[list[TopLogprobs]] | None = None
    input_token_ids_logprobs: list[list[TopLogprobs]] | None = None
    hidden_states: HiddenRows | None = None  # `LogitsProcessorOutput.hidden_states`


def agree_on_tokens(ids: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """Under TP every rank samples the same token from the same logits (seeded), but a grammar's mask
    and a custom logit processor run on each rank's own, and a rank that took another token would stop
    the ranks in step. Where those act, or with SYNC_TOKEN_IDS_ACROSS_TP, every rank takes the smallest
    id any rank sampled (upstream's all-reduce MIN); with SGLANG_ENABLE_STRICT_TP_TOKEN_CHECK (the tests)
    the ranks compare their ids every step and all stop, naming the row, where they differ."""
    tp = get_tp_group()
    if tp.world_size == 1 or ids.numel() == 0:  # (every sample at TP 1: no environment lookups)
        return ids
    strict = envs.SGLANG_ENABLE_STRICT_TP_TOKEN_CHECK.get()
    sync = envs.SYNC_TOKEN_IDS_ACROSS_TP.get() or fb.vocab_mask is not None or fb.custom_logit is not None
    if not (sync or strict):
        return ids
    bounds = torch.stack([ids, -ids])  # (one all-reduce MIN gives every row's smallest and largest id)
    dist.all_reduce(bounds, op=dist.ReduceOp.MIN, group=tp.device_group)
    low, high = bounds[0], -bounds[1]
    if strict and not torch.equal(low, high):
        row = int((low != high).nonzero()[0, 0])
        raise RuntimeError(
            f"The TP ranks sampled different tokens in row {row}: {int(low[row])} and {int(high[row])}."
        )
    return low if sync else ids
