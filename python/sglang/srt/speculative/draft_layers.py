"""Which checkpoints carry draft layers for EAGLE / NEXTN, and where their KV lives (read by the server
options' checks and the model runner's KV pool, before any model code loads)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from sglang.srt.models.checkpoint_reader import read_checkpoint
    from sglang.srt.models.qwen3_next_mtp import PREFIX, load_mtp

    return load_mtp(target, read_checkpoint(args.model_config.path, prefix=PREFIX))


def build_meta_draft_layers(target: Any) -> Any:
    """The MTP module of `target` (a model on the meta device) on the meta device, as `load_mtp` builds
    it: the memory planner counts its parameters (`mem_cache/weight_bytes.py`)."""
    import torch

    from sglang.srt.models.qwen3_next_mtp import Qwen3NextMTP

    with torch.device("meta"):
        return Qwen3NextMTP(target.config)
