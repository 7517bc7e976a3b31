"""EAGLE / NEXTN's MTP layer in CUDA graphs. `MtpDraftGraphs`: the draft loop of a verify
(`MtpDraftRunner.draft_steps`) replayed from CUDA graphs, one captured per batch-size bucket, for every
draft batch that fits one: its drafts are the argmax chains, sampling requests' included (the verify then
takes q = one-hot(draft) in their rejection sampling: `MtpHook._reject`). `MtpForwardGraphs` (below):
the MTP layer after a target decode or verify that replayed the target's graph.

What a graph holds: from the drafting requests' stash rows g, d_1 = argmax(lm_head(g)), then steps
2..k: the MTP layer at positions P, P + 1, .. (its `req_to_token` entries, its attention metadata and
its KV written into the verify's slots of those positions), the lm_head and the argmax; its output is
the [bucket, k] draft ids, which come back to the host in one copy as the eager loop's do. Its inputs
are one static int64 buffer of a row per field (request row, P, the KV slot of each of the k - 1 MTP
steps) and a column per request; a replay copies the plan's values into its first columns and pads the
rest of the bucket with the dummy request row 0, P = 0 and KV slot 0, which absorb the padded requests'
writes (the stash row 0 they read is never a request's). The plan's prefix rewrites of `req_to_token`
run before the replay, on the forward stream, as the eager loop does them.

Batches over the largest bucket (and, with SGLANG_MTP_EAGER_SAMPLED_DRAFTS=1, batches with a sampling
request) run the eager loop (which draws a sampling request's d_j from its
distribution, and hands those to the verify's rejection sampling). Greedy drafts keep a sampling
request's tokens distributed as the target's (rejection sampling is exact for any draft rule), at a
lower acceptance at high temperatures (docs/server.md has the benchmark's numbers). Both kinds of graphs
are captured beside the target's (`CudaGraphRunner.add_companion`: the draft loop's at its sizes up to
the verify rows, the MTP layer's at every size of each of its kinds;
captured again and released with them); on CPU the same bodies run eagerly on the static buffers
(`use_graphs=False`), so padding and the no-host-values rule (`GraphUnsafeError`) are checked by the CPU
tests. The MTP layer after a prefill chunk, or after a forward no graph served, runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import torch

from sglang.srt.environ import envs
from sglang.srt.model_executor.cuda_graph_runner import _NO_HOST_VALUES, capture_each, capture_graph
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, SamplingBatchInfo
from sglang.srt.utils.host_tensors import host_int64

if TYPE_CHECKING:
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.srt.speculative.mtp_draft import DraftPlan, MtpDraftRunner

logger = logging.getLogger(__name__)

ROW, PREFIX = 0, 1  # the static buffer's rows; then the KV slot of MTP step j at row 2 + j


class MtpDraftGraphs:
    def __init__(self, draft: MtpDraftRunner, sizes: list[int], steps: int, use_graphs: bool = True):
        self.draft = draft
        self.sizes = sorted(sizes)
        self.steps = steps
        self.use_graphs = use_graphs
        self.device = draft.stash.hidden.device
        self.inputs = torch.zeros(2 + steps - 1, max(sizes), dtype=torch.int64, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.bs_list: list[int] = []
        self.replays = 0  # draft loops served by a graph (the GPU test reads it)

    def capture(self) -> None:
        """A graph per size, largest first, in one memory pool (`use_graphs=False`: the body's first run);
        under TP the sizes every rank captured (`capture_each`): whether a plan replays greedy drafts or
        samples them eagerly is then the same on every rank."""
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.inputs.zero_()  # every column padding: a capture runs on the dummy row and slot only
        def left_out(bs: int, e: Exception) -> None:
            logger.warning("The MTP draft loop at batch size %d cannot be captured in a CUDA graph (%s); its "
                           "batches replay the next larger size, or run eagerly.", bs, e)  # fmt: skip

        with torch.inference_mode():
            capture_each(
                reversed(self.sizes),
                self._body,
                (lambda bs: capture_graph(lambda: self._body(bs), self.device, pool))
                if self.use_graphs
                else None,
                self.graphs,
                self.outputs,
                left_out,
            )
        self.bs_list = sorted(self.outputs)
        if self.use_graphs:
            logger.info("CUDA graphs captured for the MTP draft loop (%d steps) at batch sizes %s.",
                        self.steps, self.bs_list)  # fmt: skip

    def release(self) -> None:
        """Free the graphs (`CudaGraphRunner.release`); no plan is served until `capture`."""
        self.graphs.clear()
        self.outputs.clear()
        self.bs_list = []
        self.inputs.zero_()  # (it holds the last plan's rows and slots)

    def can_run(self, plan: DraftPlan) -> bool:
        """Any plan up to the largest captured size, whatever its sampling options (greedy drafts), unless
        SGLANG_MTP_EAGER_SAMPLED_DRAFTS keeps a plan with a sampling request on the eager loop."""
        if not plan.sampling_info.is_all_greedy and envs.SGLANG_MTP_EAGER_SAMPLED_DRAFTS.get():
            return False
        return 0 < len(plan.rows) <= (self.bs_list or [0])[-1]

    def replay(self, plan: DraftPlan) -> list[list[int]]:
        """Each planned request's k greedy drafts: the plan loaded into the static buffer, padded to its
        bucket, and the bucket's graph replayed."""
        bs = len(plan.rows)
        bucket = self.bs_list[bisect.bisect_left(self.bs_list, bs)]
        pool = self.draft.runner.req_to_token_pool
        for row, start, slots in plan.writes:
            pool.write(row, start, host_int64(slots).to(self.device))
        pad = [0] * (bucket - bs)
        columns = [plan.rows, plan.prefix_lens, *([s[j] for s in plan.slots] for j in range(self.steps - 1))]
        values = host_int64([v for column in columns for v in (*column, *pad)]).view(len(columns), bucket)
        self.inputs[:, :bucket].copy_(values, non_blocking=True)
        if self.use_graphs:
            self.graphs[bucket].replay()
            drafts = self.outputs[bucket]
        else:
            drafts = self._body(bucket)
        self.replays += 1
        return drafts[:bs].tolist()

    def _body(self, bs: int) -> torch.Tensor:
        """The eager loop's greedy steps on the static buffer's first `bs` columns, no host value read."""
        draft, runner = self.draft, self.draft.runner
        rows, prefix = self.inputs[ROW, :bs], self.inputs[PREFIX, :bs]
        g = draft.stash.hidden[rows]
        tokens = draft._greedy(g)
        drafts = [tokens]
        for j in range(self.steps - 1):
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE,
                batch_size=bs,
                input_ids=tokens,
                positions=prefix + j,
                req_pool_indices=rows,
                req_pool_indices_cpu=_NO_HOST_VALUES,
                seq_lens=prefix + (j + 1),
                seq_lens_cpu=_NO_HOST_VALUES,
                out_cache_loc=self.inputs[2 + j, :bs],
                mamba_pool_indices=torch.zeros_like(rows),
                mamba_pool_indices_cpu=_NO_HOST_VALUES,
                sampling_info=SamplingBatchInfo.greedy(bs),
            )
            runner.write_new_token_slots(fb)
            g = draft._run(fb, tokens, g)
            tokens = draft._greedy(g)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)


class MtpForwardGraphs:
    """The MTP layer after a target decode or verify that replayed a CUDA graph (`MtpHook.after_sampling`):
    per captured bucket of each kind, a graph of the MTP layer over the bucket's positions, reading the
    target graph's static inputs (the batch as its replay loaded it, padding included) and its output
    hidden states, with the tokens sampled after it copied into a static buffer (0 in padded positions);
    its output is g per position. Padded positions write the MTP layer's KV into slot 0 only. What the
    hook does with g (the stash rows, a verify's accepted position) runs eagerly after it."""

    def __init__(self, draft: MtpDraftRunner, target: CudaGraphRunner):
        self.draft = draft
        self.target = target
        self.use_graphs = target.use_graphs
        self.ids = {mode: torch.zeros_like(graphs.static.input_ids) for mode, graphs in target.kinds.items()}
        self.graphs: dict[tuple[ForwardMode, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[ForwardMode, int], torch.Tensor] = {}
        self.replays = 0  # MTP layers after a forward served by a graph (decodes and verifies)
        self.verify_replays = 0  # (of them after a verify)

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

        def body(key: tuple[ForwardMode, int]) -> torch.Tensor:
            return self._body(*key)

        def capture(key: tuple[ForwardMode, int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
            return capture_graph(lambda: self._body(*key), self.target.device, pool)

        def left_out(key: tuple[ForwardMode, int], e: Exception) -> None:  # (that size's layer: eager)
            logger.warning("The MTP layer after a %s of batch size %d cannot be captured in a CUDA graph "
                           "(%s); it runs eagerly.", key[0].name, key[1], e)  # fmt: skip

        with torch.inference_mode():
            for mode, graphs in self.target.kinds.items():
                # Every row padding (a capture then writes the dummy row and slot 0 only, never the slots
                # of a batch the buffers last held) and no replayed batch to follow.
                graphs.static.reset()
                self.target.last_replayed = None
                self.ids[mode].zero_()
                keys = [(mode, bs) for bs in reversed(graphs.bs_list)]
                use = capture if self.use_graphs else None
                capture_each(keys, body, use, self.graphs, self.outputs, left_out)
        if self.use_graphs:
            done = sorted((m.name, bs) for m, bs in self.graphs)
            logger.info("CUDA graphs captured for the MTP layer after %s.", done)

    def release(self) -> None:
        """Free the graphs (`CudaGraphRunner.release`, which also drops the cos / sin the MTP layer's
        captures left in the target's captured batches) and the attention metadata the last capture left
        in the MTP layer's backend (a verify's `extend_start_loc`, in this pool); `capture` makes both
        again."""
        self.graphs.clear()
        self.outputs.clear()
        self.draft.attn.full_attn_backend.release_metadata()

    def can_run(self, fb: ForwardBatch) -> bool:
        """`fb` is the batch the target's graphs replayed last (their buffers hold it) and its bucket's
        MTP graph exists."""
        if self.target.last_replayed is not fb:
            return False
        bucket = self.target.kinds[fb.forward_mode].bucket(fb.batch_size)
        return (fb.forward_mode, bucket) in self.outputs

    def replay(self, fb: ForwardBatch, ids: torch.Tensor) -> torch.Tensor:
        """g at each of the batch's positions, `ids` the tokens after them."""
        graphs = self.target.kinds[fb.forward_mode]
        bucket = graphs.bucket(fb.batch_size)
        n, rows = ids.shape[0], bucket * graphs.static.width
        buf = self.ids[fb.forward_mode]
        buf[:n].copy_(ids)
        buf[n:rows].zero_()
        key = (fb.forward_mode, bucket)
        if self.use_graphs:
            self.graphs[key].replay()
            g = self.outputs[key]
        else:
            g = self._body(fb.forward_mode, bucket)
        self.replays += 1
        self.verify_replays += fb.forward_mode.is_target_verify()
        return g[:n]

    def _body(self, mode: ForwardMode, bs: int) -> torch.Tensor:
        graphs = self.target.kinds[mode]
        fb = graphs.batches[bs]
        fb.rope_cache = {}  # (the MTP layer's own cos / sin, in its own graph)
        rows = bs * graphs.static.width
        return self.draft._run(fb, self.ids[mode][:rows], graphs.outputs[bs])
