"""`CudaGraphRunner`: decode forwards replayed from CUDA graphs, one captured per batch-size bucket at
startup (SGLang's flags: `--disable-cuda-graph`, `--cuda-graph-max-bs`, `--cuda-graph-bs`).

What a graph holds: a decode's `req_to_token` write, the backends' decode metadata and every layer of
the model, up to the final hidden states. It reads a fixed set of device buffers (`_StaticInputs`, sized
for the largest bucket); a replay copies the batch's tensors into their first rows and pads the rest of
the bucket with the dummy request row 0, KV slot 0 (page 0), mamba slot 0 and length 1, which absorb
the padded rows' writes. The logits, the decode's track copies and sampling run eagerly after the
replay, on the real batch.

A graph replays device work only: anything the body decided on the host at capture would be frozen
into it. So the batch a graph is captured with carries no host values (`_NO_HOST_VALUES` in place of
every `*_cpu` list): code that reads one raises `GraphUnsafeError` at capture. This is also what the CPU
tests check, by running the same runner without graphs (`use_graphs=False`: the body runs eagerly on
the static buffers at every replay, so padding, the dummy rows and the no-host rule are exercised).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, SamplingBatchInfo

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# SGLang's default capture sizes: small ones densely, then every 8.
DEFAULT_MAX_BS = 160


class GraphUnsafeError(RuntimeError):
    """The graph body read a host value that a replay would not update."""


class _NoHostValues(list):
    """Stands in for a batch's host lists in the captured batch: any read raises."""

    def _refuse(self, *args, **kwargs):
        raise GraphUnsafeError(
            "the CUDA-graph decode body read a host list of the batch (frozen at capture); "
            "decide from device tensors instead"
        )

    __iter__ = __getitem__ = __len__ = __bool__ = __contains__ = _refuse


_NO_HOST_VALUES = _NoHostValues()


def capture_bs_list(args: ServerArgs, max_running_requests: int) -> list[int]:
    """The batch sizes to capture: `--cuda-graph-bs` if given, else 1, 2, 4, 8, 12, then every 8 up to
    `--cuda-graph-max-bs` (on CUDA SGLang's default by GPU memory, `configs/gpu_memory_defaults.py`; 160
    where unset); never above the running cap."""
    cap = max_running_requests
    if args.cuda_graph_bs:
        sizes = [b for b in args.cuda_graph_bs if b <= cap]
    else:
        top = min(args.cuda_graph_max_bs or DEFAULT_MAX_BS, cap)
        sizes = [b for b in (1, 2, 4, 8, 12, *range(16, top + 1, 8)) if b <= top]
        if top not in sizes:
            sizes.append(top)
    return sorted(set(sizes))


@dataclass
class _StaticInputs:
    """The device buffers every graph reads, sized for the largest bucket."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    mamba_pool_indices: torch.Tensor
    # Row i holds PADDING[i]'s value (contiguous: `_foreach_copy_`'s one-launch path on CUDA needs dense
    # tensors); `load`'s target and source slices per (batch size, bucket).
    pad_values: torch.Tensor
    load_plans: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=dict
    )

    @classmethod
    def allocate(cls, max_bs: int, device: torch.device) -> _StaticInputs:
        def zeros():
            return torch.zeros(max_bs, dtype=torch.int64, device=device)

        pad_values = torch.empty(len(cls.PADDING), max_bs, dtype=torch.int64, device=device)
        for row, (_, pad) in zip(pad_values, cls.PADDING, strict=True):
            row.fill_(pad)  # filled on the device: no host copy at startup
        inputs = cls(zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), pad_values)
        inputs.seq_lens.fill_(1)
        return inputs

    # (field, value of a padded row): the dummy request row, KV slot and mamba slot are all 0.
    PADDING = (
        ("input_ids", 0),
        ("positions", 0),
        ("req_pool_indices", 0),
        ("seq_lens", 1),
        ("out_cache_loc", 0),
        ("mamba_pool_indices", 0),
    )

    def load(self, fb: ForwardBatch, bucket: int) -> None:
        """The batch's rows, then padding up to the bucket: one `_foreach_copy_` (one launch on CUDA, for
        what was a copy and a fill per field; 5x less host time on the CPU VM), with the buffers' slices
        and the padding's source slices kept per (batch size, bucket)."""
        bs = fb.batch_size
        plan = self.load_plans.get((bs, bucket))
        if plan is None:
            rows = [getattr(self, name)[:bs] for name, _ in self.PADDING]
            pads = [getattr(self, name)[bs:bucket] for name, _ in self.PADDING] if bucket > bs else []
            sources = [self.pad_values[i, : bucket - bs] for i in range(len(pads))]
            plan = self.load_plans[(bs, bucket)] = (rows + pads, sources)
        targets, pad_sources = plan
        sources = [getattr(fb, name) for name, _ in self.PADDING] + pad_sources
        torch._foreach_copy_(targets, sources, non_blocking=True)

    def batch(self, bs: int) -> ForwardBatch:
        """The decode batch a graph of `bs` rows is captured with: views of the buffers, no host lists."""
        views = {name: getattr(self, name)[:bs] for name, _ in self.PADDING}
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            req_pool_indices_cpu=_NO_HOST_VALUES,
            seq_lens_cpu=_NO_HOST_VALUES,
            mamba_pool_indices_cpu=_NO_HOST_VALUES,
            sampling_info=SamplingBatchInfo.greedy(bs),
            return_logprob_mask=[False] * bs,
            top_logprobs_nums=[0] * bs,
            **views,
        )


class CudaGraphRunner:
    def __init__(self, model_runner: ModelRunner, bs_list: list[int], use_graphs: bool = True):
        """Captures a graph per size in `bs_list` (largest first, one memory pool); `use_graphs=False`
        runs the same body eagerly at every replay (CPU tests)."""
        self.model_runner = model_runner
        self.use_graphs = use_graphs
        self.device = torch.device(model_runner.device)
        self.static = _StaticInputs.allocate(max(bs_list), self.device)
        self.batches = {bs: self.static.batch(bs) for bs in bs_list}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture(sorted(bs_list, reverse=True))
        self.bs_list = sorted(self.outputs)
        if use_graphs:
            logger.info("CUDA graphs captured for decode batch sizes %s.", self.bs_list)

    @property
    def max_bs(self) -> int:
        return self.bs_list[-1] if self.bs_list else 0

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode.is_decode() and 0 < fb.batch_size <= self.max_bs

    def bucket(self, bs: int) -> int:
        return self.bs_list[bisect.bisect_left(self.bs_list, bs)]

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """The decode's final hidden states [bs, H]: the batch loaded into the static buffers, padded to
        its bucket, and the bucket's graph replayed."""
        bucket = self.bucket(fb.batch_size)
        self.static.load(fb, bucket)
        if self.use_graphs:
            self.graphs[bucket].replay()
            hidden = self.outputs[bucket]
        else:
            hidden = self._body(self.batches[bucket])
        return hidden[: fb.batch_size]

    def _body(self, fb: ForwardBatch) -> torch.Tensor:
        runner = self.model_runner
        fb.rope_cache = {}
        fb.attn_backend = runner.attn_backend
        runner.write_new_token_slots(fb)
        runner.attn_backend.init_forward_metadata(fb)
        return runner.model(fb.input_ids, fb.positions, fb)

    def _capture(self, sizes: list[int]) -> None:
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        with torch.inference_mode():
            for bs in sizes:
                fb = self.batches[bs]
                self.static.load(fb, bs)  # every row padding: a valid batch of dummy rows
                if not self.use_graphs:
                    self.outputs[bs] = self._body(fb)
                    continue
                try:
                    self.graphs[bs], self.outputs[bs] = self._capture_one(fb, pool)
                except GraphUnsafeError:
                    raise
                except Exception as e:  # noqa: BLE001 - a bucket that cannot be captured is left out
                    logger.warning("Decode batch size %d cannot be captured in a CUDA graph (%s); its batches "
                                   "replay the next larger captured size, or run eagerly above the largest.",
                                   bs, e)  # fmt: skip
                    self.graphs.pop(bs, None)

    def _capture_one(self, fb: ForwardBatch, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._body(fb)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self._body(fb)
        return graph, out
