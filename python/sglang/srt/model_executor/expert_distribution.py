"""Upstream's expert distribution recorder (`--expert-distribution-recorder-mode stat`, and the routes
/start_expert_distribution_record, /stop_expert_distribution_record, /dump_expert_distribution_record):
how many tokens each MoE layer routed to each expert, per forward pass, for sizing expert parallelism
and finding hot experts (512 of them on Qwen3-Next-80B).

While recording, each target-model forward adds one step: a [num_hidden_layers, num_experts] count of the
(token, top-k choice) pairs its routers picked (the routing the MoE layers write to `RoutedExpertsCapture`;
layers without routed experts count 0; every position the model ran counts, a speculative verify's
rejected drafts too, as upstream counts its routers' picks). The last
`--expert-distribution-recorder-buffer-size` steps are kept on the model's device (default 1,000, as
upstream; num_hidden_layers x num_experts x 4 bytes a step: 98 MB on Qwen3-Next-80B); -1 keeps every step
since the start summed into one row (upstream keeps each; summed over the steps they are the same).

`start` clears the record and records; `stop` stops; `dump` writes what was recorded to
`$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR/expert_distribution_recorder_<time>.pt` (default /tmp; with
--dp-size, `_dp<rank>` before `.pt`, one file per replica) as upstream's stat mode writes it,
`{"rank": 0, "logical_count": int32 [steps, num_hidden_layers, num_experts]}` (the oldest step first), and
clears the record (a dump that fails keeps it, for the next). Under tensor or expert parallelism every rank's routers pick alike (the router is
not sharded): TP rank 0 writes.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from sglang.srt.environ import envs
from sglang.srt.utils.atomic_file import write_file

logger = logging.getLogger(__name__)

MODES = ("stat", "stat_approx")  # (stat_approx: upstream's DeepEP approximation; counted exactly here)


class ExpertDistribution:
    def __init__(
        self, num_layers: int, num_experts: int, moe_layers: list[int], buffer_size: int, device: str
    ):
        """`moe_layers`: the layers with routed experts (`RoutedExpertsCapture`); the others count 0."""
        self.num_experts = num_experts
        self.sum_only = buffer_size < 0
        rows = 1 if self.sum_only else buffer_size
        self.steps = torch.zeros(rows, num_layers, num_experts, dtype=torch.int32, device=device)
        self.moe_layers = torch.tensor(sorted(moe_layers), dtype=torch.long, device=device)
        self.recording = False
        self.next = 0  # the row the next step goes to
        self.count = 0  # steps recorded since the last reset

    def reset(self) -> None:
        self.steps.zero_()
        self.next = self.count = 0

    def add(self, rows: torch.Tensor) -> None:
        """One forward's routing, [tokens, num_layers, top_k] (the capture's rows of it), as a step."""
        if not self.recording or rows.shape[0] == 0:
            return
        row = self.steps[0] if self.sum_only else self.steps[self.next]
        if not self.sum_only:
            row.zero_()
        picks = rows[:, self.moe_layers].permute(1, 0, 2).reshape(len(self.moe_layers), -1).long()
        counts = torch.zeros(len(self.moe_layers), self.num_experts, dtype=torch.int32, device=row.device)
        counts.scatter_add_(1, picks, torch.ones_like(picks, dtype=torch.int32))
        row[self.moe_layers] += counts
        self.next = 0 if self.sum_only else (self.next + 1) % self.steps.shape[0]
        self.count += 1

    def logical_count(self) -> torch.Tensor:
        """The recorded steps, oldest first, on the host: [steps, num_layers, num_experts]."""
        if self.sum_only:
            return self.steps.cpu().clone()
        held = min(self.count, self.steps.shape[0])
        order = [(self.next - held + i) % self.steps.shape[0] for i in range(held)]
        return self.steps[torch.tensor(order, dtype=torch.long, device=self.steps.device)].cpu()

    def handle(self, action: str, writes: bool, dp_rank: int | None) -> tuple[bool, str]:
        """`start`, `stop` or `dump` (`writes`: this rank writes the dump's file)."""
        if action == "start":
            if self.recording:
                logger.warning("The expert distribution was being recorded already; its record starts again.")
            self.reset()
            self.recording = True
            return True, "Recording the expert distribution."
        if action == "stop":
            if not self.recording:
                logger.warning("The expert distribution was not being recorded.")
            self.recording = False
            return True, "Stopped recording the expert distribution."
        if not writes:  # (another TP rank writes the same counts)
            self.reset()
            return True, ""
        folder = envs.SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR.get() or "/tmp"
        suffix = "" if dp_rank is None else f"_dp{dp_rank}"
        path = os.path.join(folder, f"expert_distribution_recorder_{time.time()}{suffix}.pt")
        record = {"rank": 0, "logical_count": self.logical_count()}
        try:  # (a new file renamed into place; what fails keeps the record for the next dump)
            os.makedirs(folder, exist_ok=True)
            write_file(folder, os.path.basename(path), lambda tmp: torch.save(record, tmp))
        except Exception as e:  # noqa: BLE001 - torch.save reports a full disk as a RuntimeError
            logger.exception("The expert distribution was not written.")
            return False, f"The expert distribution was not written to {folder}: {type(e).__name__}: {e}"
        self.reset()
        logger.info("Wrote the expert distribution (%d steps) to %s.", record["logical_count"].shape[0], path)
        return True, path
