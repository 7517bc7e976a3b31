"""Which checkpoints carry draft layers for EAGLE / NEXTN, and where their KV lives (read by the server
options' checks and the model runner's KV pool, before any model code loads); loading them, and how the
RL weight routes reach them (upstream updates the draft worker beside the target on each route):
/update_weights_from_tensor's `mtp.*` tensors, their names for load_format "direct" and
/get_weights_by_name, a /update_weights_from_disk checkpoint's MTP layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from sglang.srt.server_args import ServerArgs

MTP_ALGORITHMS = ("EAGLE", "NEXTN")
DEFAULT_MTP_STEPS = 3  # --speculative-num-steps when not given
# Architectures whose MTP layer this server runs (`models/qwen3_next_mtp.py`).
MTP_ARCHITECTURES = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


def num_mtp_layers(hf_config: Any) -> int:
    """The MTP layers the config says the checkpoint has: `num_nextn_predict_layers` (Qwen3-Next) or
    `mtp_num_hidden_layers` (Qwen3.5, in `text_config`); 0 where it states none."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    for field in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        value = getattr(text, field, None)
        if value:
            return int(value)
    return 0


def draft_kv_layer_ids(args: ServerArgs) -> list[int]:
    """The KV pool's layers beyond the model's full-attention ones: the MTP layer's attention at id
    `num_hidden_layers` with EAGLE / NEXTN, else none."""
    if args.speculative_algorithm not in MTP_ALGORITHMS:
        return []
    hf_config = args.model_config.hf_config
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return [text.num_hidden_layers]


def load_draft_layers(args: ServerArgs, target: Any) -> Any | None:
    """The MTP module EAGLE / NEXTN drafts with (`models/qwen3_next_mtp.py`), loaded from the checkpoint
    onto `target`'s device and dtype; None without them. The model runner loads it beside the target,
    before the pools are sized, so that the memory budget is what is left after both."""
    if args.speculative_algorithm not in MTP_ALGORITHMS:
        return None
    return load_draft_layers_from(args.model_config.path, target)


def load_draft_layers_from(path: str, target: Any) -> Any:
    """The MTP module of the checkpoint at `path` for `target` (that checkpoint's model, loaded), reading
    its `mtp.*` tensors only; ValueError, in one sentence, where it has none (a /update_weights_from_disk
    to a checkpoint saved by a trainer that did not keep the MTP layer)."""
    from sglang.srt.models.checkpoint_reader import plan_checkpoint, read_checkpoint
    from sglang.srt.models.qwen3_next_mtp import PREFIX, load_mtp

    if not plan_checkpoint(path, prefix=PREFIX):
        raise ValueError(
            "it has no MTP layer (no mtp.* tensors), which --speculative-algorithm EAGLE / NEXTN drafts with"
        )
    return load_mtp(target, read_checkpoint(path, prefix=PREFIX), path)


def draft_parameters(draft: Any | None) -> dict[str, Any]:
    """The MTP layer's parameters under the checkpoint's `mtp.` prefix: their names for load_format
    "direct" and /get_weights_by_name (`mtp.fc.weight`, `mtp.layers.0.mlp.experts.w13`, ...)."""
    from sglang.srt.models.qwen3_next_mtp import PREFIX

    return {} if draft is None else {PREFIX + n: p for n, p in draft.named_parameters()}


def draft_update(
    target: Any,
    draft: Any | None,
    named: list[tuple[str, torch.Tensor]],
    before_copy: Callable[[], None] | None,
) -> tuple[list[tuple[str, torch.Tensor]], Callable[[], None] | None, list[str]]:
    """A /update_weights_from_tensor's `mtp.*` tensors for the MTP layer `draft` (the checkpoint's names,
    mapped as `load_mtp` maps them), checked now (ValueError where one does not fit, nothing written):
    (the target's tensors, a `before_copy` for the target's update that runs `before_copy` then writes the
    MTP layer's, so that both are written or neither, the names the MTP layer has no parameter for).
    Without a draft, or no `mtp.*` tensor, everything is the target's (which names `mtp.*` as ignored)."""
    from sglang.srt.models.qwen3_next_mtp import PREFIX, mtp_loader

    ours = [(n, t) for n, t in named if n.startswith(PREFIX)]
    if draft is None or not ours:
        return named, before_copy, []
    loader = mtp_loader(target, draft, ours, update=True)

    def copy_both() -> None:
        # FP8 experts (the model's rules, `mtp_loader`): a weight without its scale is refused before the
        # ranks' vote, as the model's own are.
        for pieces in loader.fp8_experts.values():
            why = pieces.unpaired()
            if why is not None:
                raise ValueError(why)
        if before_copy is not None:
            before_copy()
        loader.finish()

    return [(n, t) for n, t in named if not n.startswith(PREFIX)], copy_both, loader.unused


def build_meta_draft_layers(target: Any) -> Any:
    """The MTP module of `target` (a model on the meta device) on the meta device, as `load_mtp` builds
    it (FP8 modules where the target's are): the memory planner counts its parameters
    (`mem_cache/weight_bytes.py`)."""
    from sglang.srt.models.qwen3_next_mtp import build_mtp

    return build_mtp(target)
