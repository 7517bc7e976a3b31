"""Routed experts kept in block FP8 as the published checkpoints store them: `w13` [E, 2I, H] (gate rows
then up rows) and `w2` [E, H, I] in float8_e4m3fn, with `w13_weight_scale_inv` [E, ceil(2I/b0),
ceil(H/b1)] and `w2_weight_scale_inv` [E, ceil(H/b0), ceil(I/b1)] float32 (upstream's names), the layout
`RoutedExperts` runs through `fused_moe_fp8_triton.py`. Each expert's checkpoint weight and its scales are
copied into its slice as they are: the bytes served are the checkpoint's.

Gate and up rows share w13, and each 128-row block of w13 has one scale. Where the intermediate size I is
a multiple of the block, gate's blocks and up's are whole blocks of w13 and load as they are. Where it is
not, w13's blocks straddle the two (and up's rows sit off its own grid by I mod 128): upstream refuses
such a model; here the expert's gate and up are dequantized together and w13 requantized, gate's whole
blocks kept as they are (a warning per layer). Each requantized value is within one more e4m3 rounding
(2^-4 of itself) of the checkpoint's, and the experts still take one byte a weight. No published FP8
checkpoint served here straddles (Qwen3-Next and Qwen3.5 I = 512 or 1024, LFM2-8B 1792; Nemotron's
experts are not gated, Granite's are stored stacked); the tiny presets' I = 32 does.

A dense tensor arriving for FP8 experts (`--quantization fp8`, a weight update by checkpoint names) is
quantized the same way as it loads.

Tensor / expert parallelism: a rank takes its experts' pieces (`--ep-size`) and, where the experts'
intermediate dimension is split too (tp / ep > 1 ranks per expert), its block of each piece with the
scales of those blocks: every rank's part must then be whole 128-blocks (I / (tp / ep) a multiple of the
block), else the model is refused in one sentence naming --tp-size, as upstream refuses it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch
from torch import nn

from sglang.srt.layers.linear import (
    DimShard,
    full_shape,
    set_weight_shards,
    shard_tensor,
    shard_weight,
    weight_shards,
)
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.quantization.fp8 import (
    FP8_DTYPE,
    SCALE_SUFFIX,
    Fp8Config,
    Fp8Weight,
    dequantize_block_fp8,
    quantize_block_fp8,
    under_any,
)

logger = logging.getLogger(__name__)

SCALE_NAME = "_weight" + SCALE_SUFFIX  # w13 -> w13_weight_scale_inv (upstream's names)


def swap_fp8_experts(model: nn.Module, config: Fp8Config, skip: set[str] = frozenset()) -> list[str]:
    """Before loading (on any device, meta included): the routed experts of `model` hold FP8 weights
    and their block scales, except those in, under or above a module in `skip` (the checkpoint's
    unquantized ones, in our names: a listed expert keeps the stacked experts dense). Returns the
    experts' module names made FP8."""
    made = []
    for name, module in model.named_modules():
        listed = under_any(name, skip) or any(s.startswith(name + ".") for s in skip)
        if isinstance(module, RoutedExperts) and not listed:
            make_fp8_experts(module, config.weight_block_size, per_tensor=config.method == "modelopt")
            made.append(name)
    return made


def make_fp8_experts(experts: RoutedExperts, block: tuple[int, int], per_tensor: bool = False) -> None:
    """`per_tensor`: the checkpoint has one scale per expert weight (ModelOpt), so a rank's part of the
    intermediate dimension may cut the blocks: its scale grid is its own, every block the weight's scale
    (`uniform_scale`)."""
    b0, b1 = block
    inter = experts.inter_shard
    uneven = inter.parts > 1 and bool(experts.intermediate_size % b0 or experts.intermediate_size % b1)
    if uneven and not per_tensor:
        raise ValueError(
            f"Each rank's part of the FP8 experts' intermediate size ({experts.intermediate_size} of "
            f"{inter.pieces[0]}) is not a whole number of {b0}-wide scale blocks at --tp-size "
            f"{len(inter.part_of_rank)} (--ep-size {experts.global_num_experts // experts.num_experts}); "
            "use a --tp-size / --ep-size ratio that leaves whole blocks."
        )
    for attr in ("w13", "w2"):
        param = getattr(experts, attr)
        num, rows, cols = param.shape
        with torch.device(param.device):
            weight = nn.Parameter(torch.empty(param.shape, dtype=FP8_DTYPE), requires_grad=False)
            scale = torch.ones(num, math.ceil(rows / b0), math.ceil(cols / b1), dtype=torch.float32)
            scale = nn.Parameter(scale, requires_grad=False)
        shards = weight_shards(param)
        set_weight_shards(weight, *shards)
        # The scales split as the weight, in blocks (whole ones: checked above).
        blocks = {1: b0, 2: b1}
        set_weight_shards(
            scale,
            *(
                replace(d, pieces=tuple(p // blocks.get(d.dim, 1) for p in d.pieces))
                for d in shards
                if not (uneven and d.dim in blocks)  # (uneven: the rank's own grid, not split)
            ),
        )
        setattr(experts, attr, weight)
        setattr(experts, attr + SCALE_NAME, scale)
    experts.weight_block_size = tuple(block)
    experts.uniform_scale = uneven


class Fp8ExpertPieces:
    """Where the checkpoint's pieces of one FP8 experts module go: `copies` gives (target, source)
    pairs for the loader to copy (none yet for half of a straddling gate / up pair)."""

    def __init__(self, experts: RoutedExperts, name: str):
        self.experts, self.name = experts, name
        self.block = tuple(experts.weight_block_size)
        self.straddles = experts.gated and experts.intermediate_size % self.block[0] != 0
        self.waiting: dict[int, dict[str, Fp8Weight]] = {}  # straddling experts' first half
        self.requantized = 0

    def quantized(self, tensor: torch.Tensor) -> Fp8Weight:
        return Fp8Weight(*quantize_block_fp8(tensor, self.block))

    def copies(self, expert: int, shard: str, piece: Fp8Weight) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (global) expert's checkpoint weight of `shard` (gate, up or down) with its scales: this
        rank's part of them, none for another EP rank's expert."""
        ex = self.experts
        target, weight = ex.local_expert_weight(expert, shard, piece.weight)
        if target is None:
            return []
        expert -= ex.expert_offset
        if weight is not piece.weight and getattr(ex, "uniform_scale", False):
            value = piece.scale_inv.reshape(-1)[:1]  # (one scale per weight: the rank's grid holds it)
            if not bool((piece.scale_inv == value).all()):
                raise ValueError(
                    f"The FP8 weight of {self.name} expert {expert} {shard}_proj has more than one scale."
                )
            grid = tuple(math.ceil(n / b) for n, b in zip(weight.shape, self.block, strict=True))
            piece = Fp8Weight(weight, value.reshape(1, 1).expand(grid))
        elif weight is not piece.weight:  # the intermediate dimension split: the same blocks' scales
            inter = ex.inter_shard
            dim = 1 if shard == "down" else 0
            blocks = DimShard(dim, (inter.pieces[0] // self.block[dim],), inter.parts, inter.part_of_rank)
            piece = Fp8Weight(weight, shard_tensor(piece.scale_inv, (blocks,)))
        if shard == "down":
            return self._pair(target, ex.w2_weight_scale_inv.data[expert], piece, shard)
        if not ex.gated:
            return self._pair(target, ex.w13_weight_scale_inv.data[expert], piece, shard)
        if not self.straddles:
            half = ex.intermediate_size // self.block[0]
            scales = ex.w13_weight_scale_inv.data[expert]
            return self._pair(target, scales[:half] if shard == "gate" else scales[half:], piece, shard)
        halves = self.waiting.setdefault(expert, {})
        halves[shard] = piece
        if len(halves) < 2:
            return []
        del self.waiting[expert]
        return self._requantized(expert, halves["gate"], halves["up"])

    def whole(self, attr: str, piece: Fp8Weight) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A stacked checkpoint tensor for all experts' `attr` (w13 or w2) with its scales."""
        param = getattr(self.experts, attr)
        scale = getattr(self.experts, attr + SCALE_NAME)
        if tuple(piece.weight.shape) != full_shape(param):
            raise ValueError(
                f"Checkpoint tensor for {self.name}.{attr} has shape {tuple(piece.weight.shape)}; the model "
                f"expects {full_shape(param)}."
            )
        if tuple(piece.scale_inv.shape) == full_shape(scale):
            piece = Fp8Weight(shard_weight(param, piece.weight), shard_weight(scale, piece.scale_inv))
        return self._pair(param.data, scale.data, piece, attr)

    def unpaired(self) -> str | None:
        """Why an update cannot be written, where it gave half of a straddling gate / up pair."""
        if not self.waiting:
            return None
        expert, halves = next(iter(self.waiting.items()))
        return (
            f"expert {expert} of {self.name} got {next(iter(halves))}_proj alone: its gate_proj and up_proj "
            f"share FP8 blocks (intermediate size {self.experts.intermediate_size} is not a multiple of "
            f"{self.block[0]}), so an update must carry both."
        )

    def _pair(
        self, target: torch.Tensor, scale_target: torch.Tensor, piece: Fp8Weight, what: str
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if tuple(piece.scale_inv.shape) != tuple(scale_target.shape):
            raise ValueError(
                f"The FP8 scales for {self.name} {what} have shape {tuple(piece.scale_inv.shape)}; "
                f"{list(self.block)} blocks need {tuple(scale_target.shape)}."
            )
        return [(target, piece.weight), (scale_target, piece.scale_inv)]

    def _requantized(
        self, expert: int, gate: Fp8Weight, up: Fp8Weight
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """w13's blocks of one expert from its gate and up where they straddle (module docstring)."""
        for shard, piece in (("gate", gate), ("up", up)):
            want = tuple(math.ceil(n / b) for n, b in zip(piece.weight.shape, self.block, strict=True))
            if tuple(piece.scale_inv.shape) != want:
                raise ValueError(
                    f"The FP8 scales for {self.name} expert {expert} {shard}_proj have shape "
                    f"{tuple(piece.scale_inv.shape)}; {list(self.block)} blocks need {want}."
                )
        dense = torch.cat([dequantize_block_fp8(p.weight, p.scale_inv, self.block) for p in (gate, up)])
        weight, scale = quantize_block_fp8(dense, self.block)
        whole = self.experts.intermediate_size // self.block[0]  # gate's blocks that do not straddle
        weight[: whole * self.block[0]] = gate.weight[: whole * self.block[0]]
        scale[:whole] = gate.scale_inv[:whole]
        if self.requantized == 0:
            logger.warning(
                "%s: gate and up share FP8 blocks (intermediate size %d is not a multiple of %d): their "
                "blocks are requantized together (upstream refuses such a model).",
                self.name,
                self.experts.intermediate_size,
                self.block[0],
            )
        self.requantized += 1
        return [
            (self.experts.w13.data[expert], weight),
            (self.experts.w13_weight_scale_inv.data[expert], scale),
        ]
