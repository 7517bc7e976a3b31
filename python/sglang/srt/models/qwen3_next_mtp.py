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

FP8 checkpoints (`layers/quantization/`): the layer is laid out as the target is (`build_mtp`): FP8 linears
where the target's are (CUDA), FP8 experts where the target's are, everything else dense, and its
`mtp.*` tensors go through the target's FP8 stream (dequantized where the module is dense, as they are
where it holds FP8). `fc` stays dense always, as upstream's draft holds it (a plain nn.Linear) and as
Qwen's FP8 releases store it (`mtp.fc` in modules_to_not_convert); an FP8 `mtp.fc` loads dequantized.
The checkpoint's unquantized modules (`modules_to_not_convert`: the whole `mtp` or parts of it) stay
dense; `--quantization fp8` quantizes the layer as it does the target's, `fc` aside.

Tensor parallelism: the decoder layer splits as the target's layers do (its attention's heads, its
experts); `fc` and the norms are replicated (upstream: a plain nn.Linear on every rank).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from sglang.srt.layers.attention.kv_scales import KVScaleLoader
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.quantization.fp8 import (
    FP8_DTYPE,
    Fp8BlockLinear,
    Fp8Config,
    Fp8Weight,
    dequantize_block_fp8,
    fp8_checkpoint_stream,
    swap_fp8_linears,
)
from sglang.srt.layers.quantization.fp8_experts import swap_fp8_experts
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.loader import WeightLoader
from sglang.srt.models.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextGatedDeltaNet

PREFIX = "mtp."
# `fc` stays dense in every layout (upstream's draft: a plain nn.Linear; Qwen's FP8 releases keep it).
DENSE_FC = PREFIX + "fc"


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


def build_mtp(target: nn.Module, path: str | None = None) -> Qwen3NextMTP:
    """The MTP module of `target` (its model, on any device, meta included) on the meta device, laid out
    as `target` is: FP8 linears where the target has them, FP8 experts where its experts are FP8, `fc`
    and the modules the checkpoint at `path` (default: the folder the config came from) holds unquantized
    dense. The memory planner counts it (`draft_layers.build_meta_draft_layers`); `load_mtp` allocates
    and fills it."""
    with torch.device("meta"):
        mtp = Qwen3NextMTP(target.config)
    quant = getattr(target, "quant_config", None)
    if quant is None:
        return mtp
    linears = any(isinstance(m, Fp8BlockLinear) for m in target.modules())
    experts = any(isinstance(m, RoutedExperts) and m.fp8 for m in target.modules())
    named = nn.ModuleDict({PREFIX.removesuffix("."): mtp})  # (module names as the checkpoint's)
    path = path or getattr(target.config, "_name_or_path", None)
    skip = _dense_modules(target, named, quant, path) | {DENSE_FC}
    if linears:
        swap_fp8_linears(named, quant, getattr(target, "fp8_dense_modules", ()), skip)
    if experts:
        swap_fp8_experts(named, quant, skip)
    return mtp


def _dense_modules(target: nn.Module, named: nn.Module, quant: Fp8Config, path: str | None) -> set[str]:
    """The MTP layer's modules (names under `mtp.`) the FP8 checkpoint at `path` holds in their own dtype,
    by the model's rule (`registry.fp8_dense_modules`): each module a dense `mtp.*` tensor of two or more
    dimensions loads into (a checkpoint that keeps the whole layer bf16, listed or not, loads it dense);
    its listed modules where `path` holds no weights. `--quantization fp8`: none."""
    from sglang.srt.models.registry import _DENSE_DTYPES, _listed_as_unquantized, checkpoint_tensor_types

    if not quant.is_checkpoint_fp8_serialized:
        return set()
    tensors = checkpoint_tensor_types(path) if path else None
    if tensors is None:  # (the list, its `mtp.*` names mapped as the loader maps them)
        named.checkpoint_name = lambda n: mtp_parameter_name(target, n) if n.startswith(PREFIX) else n
        return _listed_as_unquantized(named, quant)
    dense = set()
    for name, (dtype, shape) in tensors.items():
        if not name.startswith(PREFIX) or dtype not in _DENSE_DTYPES or len(shape) < 2:
            continue
        if not name.endswith(("_scale", "_scale_inv")):  # (scales: the FP8 tensors' own)
            dense.add(mtp_parameter_name(target, name).rpartition(".")[0])
    return dense


def load_mtp(
    target: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], path: str | None = None
) -> Qwen3NextMTP:
    """The MTP module of `target` (a loaded Qwen3-Next / Qwen3.5 model), on its device and in its dtype
    (FP8 modules as `build_mtp` lays them out for the checkpoint at `path`), with the checkpoint's `mtp.*`
    tensors; ValueError naming what a checkpoint without them lacks."""
    from sglang.srt.models.registry import materialize

    param = target.lm_head.weight
    mtp = build_mtp(target, path)
    materialize(mtp, param.dtype, param.device)
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
    parameter; with `update` (a weight update of the serving layer) nothing is copied until `finish`.

    An FP8 model's tensors go through its FP8 stream as the model's own do (`HybridCausalLM.load_weights`):
    a checkpoint's FP8 weight and scales stay FP8 for an FP8 linear or FP8 experts and are dequantized for
    a dense module; a dense tensor for an FP8 module is quantized at load; `--quantization fp8` passes the
    quantizable tensors through the FP8 grid."""
    loader = _MtpLoader(nn.ModuleDict({PREFIX.removesuffix("."): mtp}), update=update)
    quant = getattr(target, "quant_config", None)
    ours = ((n, t) for n, t in weights if n.startswith(PREFIX))
    if quant is not None:
        keep = None
        if loader.fp8:
            keep = lambda n: True  # noqa: E731
        elif loader.fp8_experts:
            keep = lambda n: loader.keeps_fp8(mtp_parameter_name(target, n))  # noqa: E731
        ours = _fc_around(ours, lambda weights: fp8_checkpoint_stream(weights, quant, keep))
    for name, tensor in ours:
        param = mtp_parameter_name(target, name)
        if isinstance(tensor, Fp8Weight) and not (loader.keeps_fp8(param) or param in loader.fp8):
            tensor = dequantize_block_fp8(*tensor, quant.weight_block_size)
        if not loader.kv_scales.take(param, tensor):
            loader.load(param, tensor)
    return loader


class _MtpLoader(WeightLoader):
    """The MTP layer's `WeightLoader`, which also takes the float8 KV cache scales of its attention
    (`k_scale` / `v_scale`, as the model's loader does: ModelOpt puts them on `k_proj` / `v_proj`) and sets
    them once its weights are written."""

    def __init__(self, model: nn.Module, update: bool = False):
        super().__init__(model, update=update)
        self.kv_scales = KVScaleLoader(model)

    def finish(self) -> None:
        super().finish()
        self.kv_scales.apply()


def _fc_around(weights: Iterable[tuple[str, Any]], stream: Any) -> Iterator[tuple[str, Any]]:
    """`stream(weights)` with a dense `mtp.fc.weight` given as it is (`--quantization fp8` would pass it
    through the FP8 grid; upstream keeps its `fc` unquantized): an FP8 one (with its scale) goes through."""
    dense = []

    def others() -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            if name == DENSE_FC + ".weight" and tensor.dtype != FP8_DTYPE:
                dense.append((name, tensor))
                continue
            yield name, tensor

    yield from stream(others())
    yield from dense
