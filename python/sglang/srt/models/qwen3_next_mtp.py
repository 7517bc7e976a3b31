"""Qwen3-Next's multi-token-prediction (MTP) layer, the draft of `--speculative-algorithm NEXTN` / `EAGLE`.

Published layout (Qwen/Qwen3-Next-80B-A3B-*; the same names in Qwen3.5's checkpoints, `qwen3_5_mtp.py`),
as vLLM's `qwen3_next_mtp.py` and `qwen3_5_mtp.py` read it (github.com/vllm-project/vllm,
vllm/model_executor/models/): every tensor at the checkpoint's top level under `mtp.`:

    mtp.pre_fc_norm_embedding.weight   [hidden]          RMSNorm (1 + w) of the token's embedding
    mtp.pre_fc_norm_hidden.weight      [hidden]          RMSNorm (1 + w) of the target's hidden state
    mtp.fc.weight                      [hidden, 2*hidden] fuses cat(embedding, hidden) -> hidden, no bias
    mtp.layers.0.*                     one full-attention decoder layer as the model's own (gated
                                       attention with q/k norms, then the MoE with its shared expert, or
                                       Qwen3.5's dense MLP), named like `model.layers.N.*`
    mtp.norm.weight                    [hidden]          the final RMSNorm (1 + w)

The embedding (`model.embed_tokens`) and the LM head are the target's, shared. The number of such layers
is the config's `num_nextn_predict_layers` (Qwen3-Next, as SGLang and vLLM read it) or
`mtp_num_hidden_layers` (Qwen3.5, in `text_config`): `speculative/draft_layers.num_mtp_layers`. Qwen3.5
and Qwen3.5-MoE use this module as it is (their MTP layer is the same, with the dense MLP or the MoE
their config gives every layer: `is_sparse_layer`).

The rule at position t: g_t = norm(layer(fc(cat(norm_e(embed(x_(t+1))), norm_h(h_t))))), where h_t is the
target's final (normed) hidden state at t, and lm_head(g_t) predicts x_(t+2). Drafting further steps feeds
g_t back in place of h: step j runs at position t + j - 1 with the token drafted before. The layer's
attention keeps its KV at layer id `num_hidden_layers` of the target's KV pool, in the request's own KV
slots, so the draft's KV is allocated, freed and cached with the request's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.loader import WeightLoader
from sglang.srt.models.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextGatedDeltaNet

PREFIX = "mtp."


class Qwen3NextMTP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_id = config.num_hidden_layers  # its attention's layer in the KV pool
        # The decoder layer reads its kind from layer_types: this one is full attention at index layer_id.
        layer_config = copy.copy(config)
        layer_config.layer_types = [*config.layer_types, "full_attention"]
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps=eps, offset_one=True)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps=eps, offset_one=True)
        self.layers = nn.ModuleList(
            [Qwen3NextDecoderLayer(layer_config, self.layer_id, Qwen3NextGatedDeltaNet)]
        )
        self.norm = RMSNorm(hidden, eps=eps, offset_one=True)

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        """`embeds` [T, h] of the tokens after each position, `hidden` [T, h] the target's (or the
        previous step's) normed hidden state at it; returns the normed output g [T, h]."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        out, residual = self.layers[0](positions, self.fc(x), fb)
        return self.norm.add_and_norm(out, residual)[0]


def mtp_parameter_name(target: nn.Module, name: str) -> str:
    """The name of the MTP layer's parameter that the checkpoint's `mtp.*` tensor `name` loads into, under
    the same prefix (the target's renames applied: its experts' fused names)."""
    return PREFIX + target.checkpoint_name("model." + name.removeprefix(PREFIX)).removeprefix("model.")


def load_mtp(target: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Qwen3NextMTP:
    """The MTP module of `target` (a loaded Qwen3-Next / Qwen3.5 model), on its device and in its dtype,
    with the checkpoint's `mtp.*` tensors; ValueError naming what a checkpoint without them lacks."""
    param = target.lm_head.weight
    config = target.config
    with torch.device(param.device):
        mtp = Qwen3NextMTP(config).to(param.dtype)
    mtp_loader(target, mtp, weights).finish()
    for module in reversed(list(mtp.modules())):
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return mtp.eval().requires_grad_(False)


def mtp_loader(
    target: nn.Module,
    mtp: Qwen3NextMTP,
    weights: Iterable[tuple[str, torch.Tensor]],
    update: bool = False,
) -> WeightLoader:
    """A `WeightLoader` of `mtp`, its parameters named `mtp.*` as the checkpoint names them (and its
    errors), that has taken the checkpoint's `mtp.*` tensors of `weights`, each checked against its
    parameter; with `update` (a weight update of the serving layer) nothing is copied until `finish`."""
    loader = WeightLoader(nn.ModuleDict({PREFIX.removesuffix("."): mtp}), update=update)
    for name, tensor in weights:
        if name.startswith(PREFIX):
            loader.load(mtp_parameter_name(target, name), tensor)
    return loader
