"""`HybridCausalLM`: the CausalLM wrapper every hybrid model shares. A backbone (under the checkpoint's
own attribute name: `model` or `backbone`), an LM head tied to the input embedding when the config says
so, and weight loading through `WeightLoader`; a model adds only its forward and its name mapping."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sglang.srt.layers.attention.kv_scales import KVScaleLoader
from sglang.srt.layers.linear import DimShard
from sglang.srt.layers.quantization.fp8 import (
    Fp8Config,
    Fp8Weight,
    dequantize_block_fp8,
    fp8_checkpoint_stream,
    row_block_of,
)
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglang.srt.models.loader import WeightLoader


class HybridCausalLM(nn.Module):
    backbone_attr: str  # the backbone's attribute, as the checkpoint names it
    # Small per-parameter tensors kept in float32 whatever the model dtype.
    fp32_param_suffixes: tuple[str, ...] = ()
    # Checkpoint prefixes that have no module here (multi-token prediction heads).
    skip_prefixes: tuple[str, ...] = ("mtp.",)
    # (checkpoint name piece, ours), each replaced at its first occurrence by `checkpoint_name`.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # Linears (name suffixes) that stay dense under FP8: their rows are regrouped or assembled after
    # loading, which block scales cannot follow.
    fp8_dense_modules: tuple[str, ...] = ()
    # The weight format (`load_model` sets it from the config): None, or block-wise FP8.
    quant_config: Fp8Config | None = None

    def __init__(self, config: Any, backbone: nn.Module, embedding: nn.Module):
        super().__init__()
        self.config = config
        setattr(self, self.backbone_attr, backbone)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = embedding.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: Any) -> torch.Tensor:
        """Final hidden states [T, hidden]; the logits processor applies `lm_head` where needed."""
        return getattr(self, self.backbone_attr)(input_ids, positions, fb)

    def checkpoint_name(self, name: str) -> str:
        """The parameter a checkpoint tensor loads into (`checkpoint_renames`; a model may map more)."""
        for old, new in self.checkpoint_renames:
            name = name.replace(old, new, 1)
        return name

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The (parameter name, tensor) pairs a checkpoint tensor loads as: itself under `checkpoint_name`,
        unless a model splits it or folds a constant into it."""
        return [(self.checkpoint_name(name), tensor)]

    def folded_scale(self, name: str) -> float | torch.Tensor | None:
        """A constant the parameter `name` loads multiplied by (a config multiplier folded into the weight:
        Granite's, Falcon-H1's; a tensor scales each output row), or None."""
        return None

    def checkpoint_rows(self, name: str) -> tuple[str, int] | tuple[str, int, DimShard] | None:
        """(parameter, first row) where the checkpoint tensor `name` (after `checkpoint_name`) is a block
        of rows of a parameter that fuses several (a model maps the names it stacks); under tensor
        parallelism also the block's split (this rank's rows of it go to the first row of this rank's
        parameter named)."""
        return None

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        update: bool = False,
        before_copy: Callable[[], None] | None = None,
    ) -> list[str]:
        """Load checkpoint-named tensors: all of them, or with `update` any subset into the serving model
        (`WeightLoader`: all or nothing; `before_copy` as its). Returns the names of tensors no parameter
        took (with `update`, also those it skips: multi-token prediction heads, a tied LM head)."""
        loader = WeightLoader(self, update=update, form=self.served_form, before_copy=before_copy)
        kv_scales = KVScaleLoader(self)  # float8 KV cache scales go to their attention layers
        skipped = []  # (an update's names the model does not serve, told to its client)
        if self.quant_config is not None:
            # FP8 experts and FP8 linears (CUDA) take their pairs as they are (`Fp8Weight`); with FP8
            # linears every pair comes so, and one no FP8 module can take is dequantized below.
            keep = None
            if loader.fp8:
                keep = lambda n: True  # noqa: E731
            elif loader.fp8_experts:
                keep = lambda n: loader.keeps_fp8(self.checkpoint_name(n))  # noqa: E731
            weights = fp8_checkpoint_stream(weights, self.quant_config, keep)
        for name, tensor in weights:
            tied_head = name == "lm_head.weight" and self.config.tie_word_embeddings
            if tied_head or name.startswith(self.skip_prefixes):
                skipped.append(name)
                continue
            if isinstance(tensor, Fp8Weight):
                pieces = self._fp8_pieces(name, tensor, loader)
                for target, piece in pieces or ():
                    loader.load(target, piece)
                if pieces is not None:
                    continue
                tensor = dequantize_block_fp8(*tensor, self.quant_config.weight_block_size)
            if kv_scales.take(self.checkpoint_name(name), tensor):
                continue
            for target, piece in self.checkpoint_tensors(name, tensor):
                scale = self.folded_scale(target)
                if scale is not None:
                    piece = fold_scale(piece, scale)
                rows = self.checkpoint_rows(target)
                if rows is None:
                    loader.load(target, piece)
                else:
                    loader.load_rows(*rows[:2], target, piece, *rows[2:])
        loader.finish()
        kv_scales.apply()
        return loader.unused + skipped if update else loader.unused

    def _fp8_pieces(
        self, name: str, fp8: Fp8Weight, loader: WeightLoader
    ) -> list[tuple[str, Fp8Weight]] | None:
        """Where checkpoint pair `name` loads as it is: (parameter, FP8 piece) pairs for FP8 experts or
        FP8 linears, each with the model's folded multiplier in its scales; None where it must load
        dequantized (a parameter that is not FP8, rows assembled into a fused parameter, a split off the
        block grid, a per-row multiplier). A model whose `served_form` changes an FP8 linear's layout
        lists it in `fp8_dense_modules` instead."""
        target = self.checkpoint_name(name)
        if loader.keeps_fp8(target):  # (experts: their loader takes any shape of piece it fits)
            return [(target, fp8.scaled(self.folded_scale(target)))]
        out = []
        for target, rows in self.checkpoint_tensors(name, fp8.weight):
            piece = row_block_of(fp8, rows, self.quant_config.weight_block_size)
            factor = self.folded_scale(target)
            if (
                piece is None
                or target not in loader.fp8
                or self.checkpoint_rows(target) is not None
                or (isinstance(factor, torch.Tensor) and factor.numel() != 1)
            ):
                return None
            out.append((target, piece.scaled(factor)))
        return out or None

    def served_form(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The checkpoint's (whole) `tensor` for parameter `name` in the layout the serving model holds
        it in: the same, unless `process_weights_after_loading` changed the parameter's layout (then a
        weight update's tensor must change alike). The loader then takes this rank's part of it."""
        return tensor


def fold_scale(tensor: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """`tensor * scale` in float32 (the copy into the parameter rounds once, to its dtype)."""
    if isinstance(scale, torch.Tensor):
        scale = scale.to(tensor.device, torch.float32).view(-1, *([1] * (tensor.ndim - 1)))
    return tensor.float() * scale
