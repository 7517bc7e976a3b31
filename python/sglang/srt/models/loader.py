"""Loading HF safetensors checkpoints into our model classes: a single `model.safetensors`, or shards
listed by `model.safetensors.index.json`.

Names are the checkpoint's own. Per-expert weights (`...experts.E.{gate,up,down}_proj.weight`) go into
the stacked expert tensors (FP8 experts, `fp8_experts.py`: a checkpoint's FP8 weight with its scales as
one `Fp8Weight`, copied as it is; a dense one quantized); a tensor the model stacks into a fused parameter (Qwen3.5's split input
projections) goes into its block of rows (`load_rows`); every other tensor must match a parameter by
name and shape (an FP8 linear's `Fp8Weight`: its weight and its scales, copied as they are). A
parameter the checkpoint does not provide, wholly, is an error (a silently random
weight would serve garbage).

Tensor parallelism: every tensor arrives whole (as the checkpoint, or a weight update, has it) and is
checked against the checkpoint's shape (`linear.full_shape`); a sharded parameter then takes this rank's
part (`linear.shard_weight`, by the rule it carries) after the model's `served_form`. Experts take
their rank's experts and their intermediate block (`RoutedExperts.expert_weight_rows`); row blocks of a
fused parameter take the part `checkpoint_rows` names.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from sglang.srt.layers.linear import DimShard, full_shape, shard_tensor, shard_weight
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.quantization.fp8 import SCALE_SUFFIX, Fp8BlockLinear, Fp8Weight
from sglang.srt.layers.quantization.fp8_experts import SCALE_NAME, Fp8ExpertPieces
from sglang.srt.models.weight_writes import note_written

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_EXPERT_KEY = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<shard>gate|up|down)_proj\.weight$")


def checkpoint_files(folder: str | Path, prefix: str = "") -> list[Path]:
    """The checkpoint's safetensors files; with `prefix`, where an index says which files hold which
    tensors, only those holding a tensor whose name starts with it."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {file for name, file in weight_map.items() if name.startswith(prefix)}
        return [folder / name for name in sorted(files)]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"No safetensors checkpoint in {folder}.")
    return files


def iter_checkpoint(folder: str | Path, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by name; with `prefix`, only those whose name starts with it, the others
    never read (the MTP layer's few GB of an 80B checkpoint's 160)."""
    for path in checkpoint_files(folder, prefix):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)


class WeightLoader:
    """Copies named tensors into a model's parameters and checks that all of them were provided.

    With `update` (a weight update of a serving model: `/update_weights_from_tensor`), any subset may
    come, and nothing is copied until `finish`: a tensor that does not fit refuses the whole update
    with the weights untouched."""

    def __init__(
        self,
        model: nn.Module,
        update: bool = False,
        form: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
        before_copy: Callable[[], None] | None = None,
    ):
        """`form(name, tensor)`: a checkpoint tensor in the layout parameter `name` is served in (the
        model's `served_form`), before this rank's part of it is taken. `before_copy()`, in update
        mode, once every tensor has fitted: it raises to copy nothing (under tensor parallelism, where
        another rank's tensors did not fit)."""
        self.update = update
        self.before_copy = before_copy
        self.form = form or (lambda name, tensor: tensor)
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, source), in update mode
        self.params = dict(model.named_parameters())
        self.experts = {name: m for name, m in model.named_modules() if isinstance(m, RoutedExperts)}
        # FP8 linears (CUDA) by their weight's name: a checkpoint's FP8 weight and scales (`Fp8Weight`)
        # are copied as they are; a dense tensor is quantized into the weight and scales.
        self.fp8 = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, Fp8BlockLinear)}
        # FP8 experts by module name, and their stacked parameters (w13, w2) by name.
        self.fp8_experts = {n: Fp8ExpertPieces(m, n) for n, m in self.experts.items() if m.fp8}
        self.fp8_stacked = {f"{n}.{a}": (p, a) for n, p in self.fp8_experts.items() for a in ("w13", "w2")}
        self.loaded: set[str] = set()
        self.expert_pieces: dict[str, set[tuple[int, str]]] = {name: set() for name in self.experts}
        self.row_blocks: dict[str, list[tuple[int, int, str]]] = {}  # param -> (start, stop, source)
        self.unused: list[str] = []

    def keeps_fp8(self, name: str) -> bool:
        """Whether the parameter or expert weight `name` (our name) takes a checkpoint's FP8 weight and
        scales as they are (`fp8_checkpoint_stream`'s `keep_fp8`)."""
        match = _EXPERT_KEY.match(name)
        return match["module"] in self.fp8_experts if match else name in self.fp8_stacked

    def load(self, name: str, tensor: torch.Tensor | Fp8Weight) -> None:
        match = _EXPERT_KEY.match(name)
        module = match["module"] if match and match["module"] in self.experts else None
        fp8_piece = isinstance(tensor, Fp8Weight)
        if not fp8_piece and (module is not None or name in self.params):
            _check_unquantized(name, tensor)
        if module is not None:
            expert, shard = int(match["expert"]), match["shard"]
            pieces = self.fp8_experts.get(module)
            if pieces is not None:
                piece = tensor if fp8_piece else pieces.quantized(tensor.to(pieces.experts.w13.device))
                for target, source in pieces.copies(expert, shard, piece):
                    self._copy(target, source)
            else:
                target, part = self.experts[module].local_expert_weight(expert, shard, tensor)
                if target is not None:  # (another expert-parallel rank's expert: not held here)
                    self._copy(target, part)
            self.expert_pieces[module].add((expert, shard))
            return
        if name in self.fp8_stacked:
            pieces, attr = self.fp8_stacked[name]
            piece = tensor if fp8_piece else pieces.quantized(tensor.to(pieces.experts.w13.device))
            for target, source in pieces.whole(attr, piece):
                self._copy(target, source)
            self.loaded |= {name, name + SCALE_NAME}
            return
        if fp8_piece and name in self.fp8:
            self._load_fp8_linear(name, tensor)
            return
        if fp8_piece:
            raise ValueError(f"Checkpoint tensor {name} came in FP8 for a parameter that is not.")
        param = self.params.get(name)
        if param is None:
            self.unused.append(name)
            return
        if full_shape(param) != tuple(tensor.shape):
            raise ValueError(
                f"Checkpoint tensor {name} has shape {tuple(tensor.shape)}; the model expects {full_shape(param)}."
            )
        tensor = shard_weight(param, self.form(name, tensor))
        fp8 = self.fp8.get(name)
        if fp8 is not None:
            weight, scale = fp8.quantized(tensor.to(param.device))
            self._copy(fp8.weight_scale_inv.data, scale)
            self.loaded.add(name + SCALE_SUFFIX)
            tensor = weight
        self._copy(param.data, tensor)
        self.loaded.add(name)

    def _load_fp8_linear(self, name: str, piece: Fp8Weight) -> None:
        """A checkpoint's FP8 weight and its scales into an FP8 linear as they are (this rank's part of
        both: `shard_fp8_like` made the scales split in whole blocks with the weight)."""
        fp8 = self.fp8[name]
        if fp8.uniform_scale:  # (one scale per tensor; the rank's grid cuts its blocks: it takes the scale)
            value = piece.scale_inv.reshape(-1)[:1]
            if not bool((piece.scale_inv == value).all()):
                raise ValueError(
                    f"Checkpoint FP8 tensor for {name} has more than one scale; one is expected."
                )
            piece = Fp8Weight(piece.weight, value.expand(full_shape(fp8.weight_scale_inv)))
        for param, tensor in ((fp8.weight, piece.weight), (fp8.weight_scale_inv, piece.scale_inv)):
            if full_shape(param) != tuple(tensor.shape):
                raise ValueError(
                    f"Checkpoint FP8 tensor for {name} has a {'weight' if param is fp8.weight else 'scale'} "
                    f"of shape {tuple(tensor.shape)}; the model expects {full_shape(param)}."
                )
            self._copy(param.data, shard_weight(param, tensor))
        self.loaded |= {name, name + SCALE_SUFFIX}

    def load_rows(
        self, name: str, start: int, source: str, tensor: torch.Tensor, shard: DimShard | None = None
    ) -> None:
        """Copy `tensor` (checkpoint name `source`) into rows [start, start + len) of parameter `name`;
        with `shard`, this rank's part of it (`start` is then a row of this rank's parameter)."""
        param = self.params.get(name)
        if param is None:
            self.unused.append(source)
            return
        _check_unquantized(source, tensor)
        if shard is not None and shard.parts > 1:
            if tensor.shape[0] != shard.full_size:
                raise ValueError(
                    f"Checkpoint tensor {source} has shape {tuple(tensor.shape)}; the model expects "
                    f"{shard.full_size} rows."
                )
            tensor = shard_tensor(tensor, (shard,))
        if name in self.fp8:
            raise ValueError(f"{name} is an FP8 linear; its rows cannot load piece by piece ({source}).")
        stop = start + tensor.shape[0]
        if tuple(param.shape[1:]) != tuple(tensor.shape[1:]) or stop > param.shape[0]:
            raise ValueError(
                f"Checkpoint tensor {source} has shape {tuple(tensor.shape)}; the model expects rows "
                f"[{start}, {stop}) of {name}, shape {tuple(param.shape)}."
            )
        self._copy(param.data[start:stop], tensor)
        self.row_blocks.setdefault(name, []).append((start, stop, source))

    def _copy(self, target: torch.Tensor, tensor: torch.Tensor) -> None:
        if self.update:
            self.copies.append((target, tensor))
        else:
            target.copy_(tensor)

    def _check_row_blocks(self) -> None:
        """A stacked parameter is loaded when its blocks tile its rows exactly once."""
        for name, blocks in self.row_blocks.items():
            end = 0
            for start, stop, source in sorted(blocks):
                if start != end:
                    raise ValueError(
                        f"Checkpoint tensor {source} lands on rows [{start}, {stop}) of {name}, whose "
                        f"rows [{min(start, end)}, {max(start, end)}) are "
                        f"{'given twice' if start < end else 'not given'}."
                    )
                end = stop
            if end == self.params[name].shape[0]:
                self.loaded.add(name)

    def finish(self) -> None:
        if self.update:
            self._finish_update()
            return
        self._check_row_blocks()
        for name, module in self.experts.items():
            shards = ("gate", "up", "down") if module.gated else ("up", "down")
            if len(self.expert_pieces[name]) == module.global_num_experts * len(shards):
                self.loaded |= {f"{name}.w13", f"{name}.w2"}
                if module.fp8:
                    self.loaded |= {f"{name}.w13{SCALE_NAME}", f"{name}.w2{SCALE_NAME}"}
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"The checkpoint lacks {len(missing)} weight(s) of the model: {shown}")
        if self.unused:
            logger.warning(
                "Ignored %d checkpoint tensor(s) the model has no use for, e.g. %s",
                len(self.unused),
                self.unused[0],
            )

    def _finish_update(self) -> None:
        """Copy an update's tensors, every one of which fitted (`load` raised otherwise). Those no
        parameter takes stay in `unused`, for the reply to name (upstream ignores them silently)."""
        for pieces in self.fp8_experts.values():
            why = pieces.unpaired()
            if why is not None:
                raise ValueError(why)
        if self.before_copy is not None:
            self.before_copy()
        note_written(target for target, _ in self.copies)  # (before copying: a failed copy counts too)
        with torch.no_grad():
            for target, tensor in self.copies:
                target.copy_(tensor)
        self.copies.clear()


def _check_unquantized(name: str, tensor: torch.Tensor) -> None:
    """A quantized checkpoint's packed integers or float8 values would load as wrong numbers (block-FP8
    ones arrive here dequantized, where the config says the checkpoint is FP8)."""
    if not tensor.is_floating_point() or tensor.element_size() < 2:
        raise ValueError(
            f"Checkpoint tensor {name} is {tensor.dtype}: quantized weights are not supported without a "
            "quantization_config naming them (block-wise FP8: quant_method fp8, weight_block_size)."
        )
