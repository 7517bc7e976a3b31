"""The model side of LoRA serving: which linears take adapters, each adapter's weights in this rank's
layout, and the slots the forward reads (`lora_layers.py` has the math).

- Target modules: every linear of the language model whose name (the last part of its path) is in
  --lora-target-modules, or all of them with `all` (not the LM head, nor a vision tower's). Their
  buffers are allocated at start, before the KV and state pools are sized from what is left.
- An adapter loads on every rank (`load`): each of its modules goes through what a checkpoint weight
  of that module goes through (the model's renames, folded multipliers, served row order: Qwen3-Next's
  regrouped input projections), applied to B's rows, A's columns untouched; then this rank's part is
  taken by the module's own split. An adapter is kept on the host (pinned on CUDA), scaled and in the
  model's dtype, and copied into a slot when the scheduler gives it one (`write_slot`, on the forward
  stream: the batch that first runs it carries the copy, `ForwardBatch.lora_loads`).
- Each forward: the per-token mask from the batch's per-request slots (`prepare`, a pre-hook of the
  model, so a CUDA graph's capture records it from the static buffers).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from sglang.srt.layers.linear import full_shape, shard_tensor
from sglang.srt.lora.lora_config import LoRAAdapter, LoRAAdapterError, read_adapter
from sglang.srt.lora.lora_layers import LoRABatch, LoRAModule
from sglang.srt.models.causal_lm import fold_scale

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Module paths that never take an adapter: the LM head, the vision tower, MTP draft layers; and the MoE
# routers (`gate`, `shared_expert_gate`), which the routing ops read as weights.
_EXCLUDED = ("lm_head", "visual", "mtp")
_ROUTERS = ("gate", "shared_expert_gate")


def drop_decode_blocks(model: nn.Module) -> None:
    """The CPU decode blocks (`layers/decode_blocks.py`) call their weights in one C++ op, past the
    modules' hooks: with adapters every layer runs its modules one by one."""
    from sglang.srt.layers import decode_blocks as db

    kinds = (db.GdnBlock, db.AttentionBlock, db.Mamba2Block, db.MLPBlock, db.MoEBlock)
    for module in model.modules():
        for attr in ("mixer_block", "mlp_block", "fused"):
            if isinstance(getattr(module, attr, None), kinds):
                setattr(module, attr, None)


def unfuse_shared_experts(model: nn.Module, targets: list[nn.Module]) -> None:
    """A shared expert the MoE kernels run as one more expert (`RoutedExperts.fuse_shared_expert`: the
    CPU op's, the fused GEMMs' stacks) runs past its modules' hooks: where an adapter may change one of
    its linears, it runs as its own modules again (same weights, views of the stacks)."""
    hooked = {id(m) for m in targets}
    for module in model.modules():
        gemms = getattr(module, "fused_gemms", None)
        for owner, attr in ((module, "fused_shared"), (gemms, "shared")):
            fused = getattr(owner, attr, None) if owner is not None else None
            if fused is not None and any(id(m) in hooked for m in fused[0].modules()):
                setattr(owner, attr, None)


def _is_linear(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("in_features", "out_features", "weight"))


class TargetMap:
    """Where each checkpoint linear of the language model loads: the served module (path) and, for a
    piece of a fused one, its rows (`HybridCausalLM.checkpoint_rows`). Read from the checkpoint's
    names and shapes (its safetensors headers) through the model's own rules (renames, splits, row
    blocks), so an adapter's module, named as the checkpoint names it, goes where that weight went."""

    def __init__(self, model: nn.Module, model_path: str):
        from safetensors import safe_open

        from sglang.srt.configs.presets import resolve_model_path
        from sglang.srt.models.loader import checkpoint_files

        self.model = model
        # checkpoint module -> [(served module path, rows or None)]; served path -> pieces loading into it
        self.routes: dict[str, list[tuple[str, tuple | None]]] = {}
        self.pieces: dict[str, int] = {}
        for file in checkpoint_files(resolve_model_path(model_path)):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118
                    shape = f.get_slice(key).get_shape()
                    if key.endswith(".weight") and len(shape) == 2:
                        self._route(key, torch.empty(shape, device="meta"))

    def _route(self, key: str, weight: torch.Tensor) -> None:
        module = key[: -len(".weight")]
        if any(part in _EXCLUDED for part in module.split(".")):
            return
        routes = []
        for target, _ in self.model.checkpoint_tensors(key, weight):
            rows = self.model.checkpoint_rows(target)
            path = (rows[0] if rows is not None else target).removesuffix(".weight")
            try:
                served = self.model.get_submodule(path)
            except AttributeError:
                return
            if not _is_linear(served) or path.rsplit(".", 1)[-1] in _ROUTERS:
                return
            routes.append((path, rows))
        if routes:
            self.routes[module] = routes
            for path, _ in routes:
                self.pieces[path] = self.pieces.get(path, 0) + 1

    def targets(self, names: set[str] | None) -> dict[str, int]:
        """Served module path -> pieces, of the checkpoint modules named in `names` (None: all)."""
        out: dict[str, int] = {}
        for module, routes in self.routes.items():
            if names is None or module.rsplit(".", 1)[-1] in names:
                for path, _ in routes:
                    out[path] = self.pieces[path]
        return out


class LoRAManager:
    def __init__(
        self, model: nn.Module, model_path: str, slots: int, rank: int, target_names: set[str] | None, dtype, device
    ):
        self.model = model
        self.dtype = dtype
        self.pin = torch.device(device).type == "cuda"
        self.batch = LoRABatch(slots, rank)
        self.map = TargetMap(model, model_path)
        self.modules = {
            path: LoRAModule(path, model.get_submodule(path), self.batch, dtype, pieces)
            for path, pieces in self.map.targets(target_names).items()
        }
        if not self.modules:
            raise ValueError(f"--lora-target-modules {sorted(target_names or [])} names no linear module of the model.")
        drop_decode_blocks(model)
        unfuse_shared_experts(model, [model.get_submodule(p) for p in self.modules])
        self.slot_ids = torch.arange(slots, device=device)
        # adapter id -> served module path -> (A [r', in_local], B [out_local, r']), r' its pieces' ranks
        self.adapters: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.hook = model.register_forward_pre_hook(self._prepare)

    @classmethod
    def create(cls, args: ServerArgs, model: nn.Module, dtype, device) -> LoRAManager | None:
        if not args.enable_lora:
            return None
        names = None if args.lora_target_modules == ["all"] else set(args.lora_target_modules)
        return cls(model, args.model_path, args.max_loras_per_batch, args.max_lora_rank, names, dtype, device)

    def attach(self, model: nn.Module) -> None:
        """Serve the same adapters and slots on `model` (a weight update's new model, same shapes)."""
        self.hook.remove()
        for path, lora in self.modules.items():
            lora.handle.remove()
            lora.handle = model.get_submodule(path).register_forward_hook(lora._hook)
        self.model = model
        drop_decode_blocks(model)
        unfuse_shared_experts(model, [model.get_submodule(p) for p in self.modules])
        self.hook = model.register_forward_pre_hook(self._prepare)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.modules.values())

    # ---- adapters --------------------------------------------------------------------------------

    def load(self, uid: str, name: str, path: str) -> LoRAAdapter:
        """Read the adapter at `path` into this rank's layout under `uid` (LoRAAdapterError naming it and
        the module it cannot serve)."""
        adapter = read_adapter(name, path, self.batch.rank)
        parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, (a, b) in adapter.weights.items():
            for served, a_local, b_local in self._served(name, module, a, b * adapter.scaling):
                parts.setdefault(served, []).append((a_local, b_local))
        # The pieces of one fused module side by side: [A_1; A_2], [B_1 | B_2] (each B zero off its rows).
        self.adapters[uid] = {
            served: (self._host(torch.cat([a for a, _ in ab])), self._host(torch.cat([b for _, b in ab], dim=1)))
            for served, ab in parts.items()
        }
        logger.info("LoRA adapter %r loaded from %s (rank %d, %d modules).", name, path, adapter.rank, len(parts))
        return adapter

    def unload(self, uid: str) -> None:
        self.adapters.pop(uid, None)

    def _served(self, name: str, module: str, a: torch.Tensor, b: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """[(served module, A, B)] of adapter module `module` (checkpoint naming) as this rank holds it: B's
        rows go where the weight's rows go (the model's splits, folded multipliers, row blocks of a fused
        module, served row order, this rank's rows), applied to a weight-shaped tensor holding B in its
        first r columns; A's columns are split as the weight's input is."""
        model, r = self.model, a.shape[0]
        routes = self.map.routes.get(module)
        if routes is None or any(path not in self.modules for path, _ in routes):
            raise LoRAAdapterError(
                f"LoRA adapter {name!r} changes {module}, which is not a target module of this server (a linear "
                f"named in --lora-target-modules; LoRA on MoE experts and routers, embeddings and the LM head is "
                f"not served)."
            )
        weight_name = f"{module}.weight"
        full = torch.Size((b.shape[0], a.shape[1]))
        out = []
        padded = b.new_zeros(full)
        padded[:, :r] = b
        for (target, piece), (path, rows) in zip(model.checkpoint_tensors(weight_name, padded), routes, strict=True):
            lora = self.modules[path]
            scale = model.folded_scale(target)
            if scale is not None:
                piece = fold_scale(piece, scale)
            weight = model.get_parameter(f"{path}.weight")
            if rows is None:
                if tuple(piece.shape) != full_shape(weight):
                    raise self._misfit(name, module, a, b, full_shape(weight))
                b_local = shard_tensor(model.served_form(target, piece)[:, :r], lora.row_shards)
            else:
                start, shard = rows[1], (rows[2] if len(rows) > 2 else None)
                if shard is not None and shard.parts > 1:
                    piece = shard_tensor(piece, (shard,))
                b_local = piece.new_zeros(weight.shape[0], r)
                if start + piece.shape[0] > weight.shape[0] or piece.shape[1] != full_shape(weight)[1]:
                    raise self._misfit(name, module, a, b, full_shape(weight))
                b_local[start : start + piece.shape[0]] = piece[:, :r]
            if a.shape[1] != full_shape(weight)[1]:
                raise self._misfit(name, module, a, b, full_shape(weight))
            out.append((path, shard_tensor(a, lora.col_shards), b_local))
        return out

    @staticmethod
    def _misfit(name: str, module: str, a: torch.Tensor, b: torch.Tensor, shape: tuple) -> LoRAAdapterError:
        return LoRAAdapterError(
            f"LoRA adapter {name!r}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
            f"the model's weight {tuple(shape)}."
        )

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.dtype).contiguous()
        return t.pin_memory() if self.pin else t

    # ---- slots and batches -----------------------------------------------------------------------

    def write_slot(self, slot: int, uid: str | None) -> None:
        """Slot `slot` holds adapter `uid` from the next forward on (None: zeros)."""
        held = self.adapters.get(uid, {}) if uid is not None else {}
        for path, lora in self.modules.items():
            ab = held.get(path)
            lora.write(slot, *(ab if ab is not None else (None, None)))

    def apply_loads(self, loads: list[tuple[int, str | None]]) -> None:
        for slot, uid in loads:
            self.write_slot(slot, uid)

    def _prepare(self, module: nn.Module, args: tuple) -> None:
        fb: ForwardBatch = args[2]
        slots = fb.lora_slots
        if slots is None:
            self.batch.mask = None
            return
        tokens = int(fb.input_ids.shape[0])
        if fb.forward_mode.is_decode() or fb.verify_width:
            per_token = slots.repeat_interleave(tokens // fb.batch_size, output_size=tokens)
        else:
            per_token = slots.repeat_interleave(fb.extend_seq_lens, output_size=tokens)
        lo, hi = fb.lora_slot_range or (0, self.batch.slots)
        self.batch.lo, self.batch.hi = lo, hi
        self.batch.mask = (per_token[:, None] == self.slot_ids[None, lo:hi]).to(self.dtype)
