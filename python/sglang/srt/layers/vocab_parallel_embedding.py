"""`VocabParallelEmbedding` and `ParallelLMHead` (upstream's names): the vocabulary split across the TP
ranks, padded to a multiple of the TP size (the padding rows are zeros and never reach sampling).

The embedding looks up the ids this rank holds (others give zeros) and sums over the group (one
all-reduce of [T, hidden]); the LM head computes this rank's block of logits and all-gathers them, so
every rank holds the whole [T, vocab] logits and samples the same tokens. At TP 1 both are the plain
lookup and matmul.

Weights are allocated, never randomly initialised: the model is built on the meta device and filled from
the checkpoint. (`nn.Embedding` initialises with `normal_`, which on the meta device goes through
`torch._refs` and imports `torch._dynamo`: 1-1.4 s of every scheduler's start on this project's CPUs.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import get_tensor_model_parallel_world_size, get_tp_group
from sglang.srt.layers.linear import column_shard, set_weight_shards


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_size = tp = get_tensor_model_parallel_world_size()
        shard = column_shard(0, [num_embeddings], pad=-num_embeddings % tp, what="the vocabulary")
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(shard.local_size, embedding_dim), requires_grad=False)
        set_weight_shards(self.weight, shard)

    def vocab_range(self) -> tuple[int, int]:
        """[start, end) of the (padded) vocabulary this rank holds."""
        start = self.shard.part * self.shard.local_size
        return start, start + self.shard.local_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        start, end = self.vocab_range()
        outside = (input_ids < start) | (input_ids >= end)
        out = F.embedding(torch.where(outside, 0, input_ids - start), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return get_tp_group().all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """`hidden @ weight.T` over the whole vocabulary: this rank's rows, then the ranks' blocks gathered
    (the padding columns dropped). Its weight may be the embedding's (tied): the same split."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        return get_tp_group().all_gather(logits, dim=-1)[..., : self.num_embeddings]
