"""`VocabParallelEmbedding`: the token embedding (upstream's name; one rank here, so the whole vocabulary).

Its weight is allocated, never randomly initialised: the model is built on the meta device and filled from
the checkpoint. (`nn.Embedding` initialises with `normal_`, which on the meta device goes through
`torch._refs` and imports `torch._dynamo`: 1-1.4 s of every scheduler's start on this project's CPUs.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
