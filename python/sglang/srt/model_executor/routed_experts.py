"""Routed experts (upstream's `--enable-return-routed-experts`, what RL frameworks replay in training:
"R3", rollout routing replay): the experts each MoE layer's router picked for every position of a
request, returned in `meta_info["routed_experts"]` when the request asks (`return_routed_experts`).

Format (upstream's, as slime decodes it): base64 (ASCII) of a little-endian int32 array [positions,
num_hidden_layers, top_k], positions 0 .. len(prompt) + len(output) - 2 (every position the model
ran: the last output token is never fed), each row the layer's top-k expert ids in the router's order
(best first); a layer without routed experts (a dense or attention-only layer of a hybrid) holds 0s,
as upstream's.

How (`RoutedExpertsCapture`): each target-model MoE layer writes its ids into a device buffer by batch
row as it runs (`record`: fixed shapes, so a CUDA graph captures it); after the forward the batch's rows
go to a host table by KV slot (`commit`, after the step's sampling is queued: on CUDA its copy waits where the step's
results are waited for anyway), so a position's routing lives as long as its KV does: a prefix-cache hit returns the routing computed when the prefix was (exactly what that
forward used). The scheduler reads a finished request's rows by its KV slots before releasing them
(`rows_of`; not for an abort, whose last chunk may still be queued on the forward stream), and the HTTP
process base64-encodes them (`encode`; a long request's off its event loop). The MTP draft layer's experts are not the target model's and are not recorded. The host
table costs num_hidden_layers * top_k * 4 bytes per KV slot (Qwen3-Next-80B: 1,920 B).

Refused at start (`server_args_checks.check_routed_experts`, and here for a model without routed
experts): with the hierarchical cache (KV loaded back from host memory lands in other slots, without its
routing) and with PD disaggregation (the prompt's routing stays on the prefill server).
"""

from __future__ import annotations

import base64
import logging
import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sglang.srt.model_executor.expert_distribution import ExpertDistribution
from sglang.srt.utils.graph_capture import in_graph_body

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# The expert distribution's steps at most (device memory beside the pools, which are not sized for it).
MAX_RECORD_BYTES = 1 << 30


class RoutedExpertsCapture:
    def __init__(self, num_layers: int, top_k: int, kv_slots: int, device: str, rows: int = 256):
        """`rows`: at least the tokens of the largest CUDA-graph batch (graphs write into this buffer at
        the address they were captured with); larger eager forwards use a second buffer, grown as needed.
        `kv_slots` 0: no host table (only the expert distribution reads the routing)."""
        self.num_layers, self.top_k = num_layers, top_k
        self.device = device
        self.rows = self._zeros(rows)
        self.big: torch.Tensor | None = None
        self.by_slot = torch.zeros(kv_slots, num_layers, top_k, dtype=torch.int32) if kv_slots else None
        # --expert-distribution-recorder-mode: the counts each forward's routing adds to, while recording.
        self.distribution: ExpertDistribution | None = None

    def _zeros(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self.num_layers, self.top_k, dtype=torch.int32, device=self.device)

    def _buffer(self, tokens: int) -> torch.Tensor:
        """The buffer of a forward of `tokens` rows (the same for its `record`s and its `commit`)."""
        if tokens <= self.rows.shape[0]:
            return self.rows
        if self.big is None or self.big.shape[0] < tokens:
            self.big = self._zeros(max(tokens, 2 * self.rows.shape[0]))
        return self.big

    @classmethod
    def create(
        cls, server_args: Any, model: nn.Module, kv_slots: int, device: str
    ) -> RoutedExpertsCapture | None:
        returned, recorded = (
            server_args.enable_return_routed_experts,
            server_args.expert_distribution_recorder_mode,
        )
        if not returned and recorded is None:
            return None
        from sglang.srt.server_args_checks import ServerArgsError

        hf = server_args.model_config.arch.hf_config
        top_k = getattr(hf, "num_experts_per_tok", None)
        layers = getattr(hf, "num_hidden_layers", None)
        graph_bs = max(server_args.cuda_graph_bs or [server_args.cuda_graph_max_bs or 0])
        rows = max(256, graph_bs * max(1, server_args.speculative_num_draft_tokens or 1))
        capture = cls(layers, top_k, kv_slots if returned else 0, device, rows) if top_k and layers else None
        if capture is None or not capture.attach(model):
            flag = "--enable-return-routed-experts" if returned else "--expert-distribution-recorder-mode"
            raise ServerArgsError(
                f"{flag} needs a mixture-of-experts checkpoint; this one has no routed experts."
            )
        if recorded is not None:
            size = server_args.expert_distribution_recorder_buffer_size or 1000
            step = layers * capture.num_experts * 4
            if size * step > MAX_RECORD_BYTES:
                raise ServerArgsError(
                    f"--expert-distribution-recorder-buffer-size {size} keeps {size * step / 2**30:.1f} GiB of counts "
                    f"on the device ({step} bytes a step); keep at most {MAX_RECORD_BYTES // step} steps, or -1 for one sum."
                )
            capture.distribution = ExpertDistribution(
                layers, capture.num_experts, capture.moe_layers, size, device
            )
        if capture.by_slot is not None:
            table = capture.by_slot.numel() * capture.by_slot.element_size()
            logger.info("Routed experts: %.1f MiB of host memory (%d KV slots).", table / 2**20, kv_slots)
        return capture

    def attach(self, model: nn.Module) -> int:
        """Give every routed-experts module of the target model (not its MTP layer) this capture and its
        decoder layer's index; returns how many there are. Again after a weight swap (new modules)."""
        from sglang.srt.layers.moe.experts import RoutedExperts
        from sglang.srt.lora.lora_manager import drop_decode_blocks

        drop_decode_blocks(model)  # (the CPU decode blocks route past `RoutedExperts.forward`)
        self.moe_layers: set[int] = set()
        self.num_experts = 0
        for name, module in model.named_modules():
            match = _LAYER.search(name)
            if isinstance(module, RoutedExperts) and match and not name.startswith("mtp"):
                module.routing_capture, module.routing_layer = self, int(match.group(1))
                self.moe_layers.add(module.routing_layer)
                self.num_experts = max(self.num_experts, module.global_num_experts)
        return len(self.moe_layers)

    def record(self, layer: int, ids: torch.Tensor) -> None:
        """Layer `layer`'s top-k ids [T, k] of this forward's rows (an eager forward that nobody reads the
        rows of, with only the expert distribution's flag and it not recording, skips the copy; a CUDA
        graph's body, its warm-up and capture, always records: `utils/graph_capture.py`)."""
        if self.by_slot is None and not self.distribution.recording and not in_graph_body(ids.device):
            return
        tokens = ids.shape[0]
        self._buffer(tokens)[:tokens, layer].copy_(ids)

    def commit(self, fb: ForwardBatch) -> None:
        """The forward's rows to the host table at their KV slots (after the layers ran), and to the
        expert distribution while it records."""
        tokens = fb.out_cache_loc.shape[0]
        rows = self._buffer(tokens)[:tokens]
        if self.distribution is not None:
            self.distribution.add(rows)
        if self.by_slot is not None:
            self.by_slot[fb.out_cache_loc.to("cpu")] = rows.to("cpu")

    def rows_of(self, slots: list[int]) -> torch.Tensor:
        """The rows of KV slots `slots` (a request's positions in order): a copy [n, layers, k], which
        the HTTP process encodes (`encode`) off the scheduler thread."""
        return self.by_slot[torch.tensor(slots, dtype=torch.int64)] if slots else self.by_slot[:0].clone()


def encode(rows: torch.Tensor) -> str:
    """Upstream's wire format: base64 (ASCII) of the little-endian int32 array."""
    return base64.b64encode(rows.numpy().astype("<i4", copy=False).tobytes()).decode("ascii")
