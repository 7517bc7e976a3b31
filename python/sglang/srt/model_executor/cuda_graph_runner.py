"""`CudaGraphRunner`: decode forwards replayed from CUDA graphs, one captured per batch-size bucket at
startup (SGLang's flags: `--disable-cuda-graph`, `--cuda-graph-max-bs`, `--cuda-graph-bs`).

What a graph holds: a decode's `req_to_token` write, the backends' decode metadata and every layer of
the model, up to the final hidden states. It reads a fixed set of device buffers (`_StaticInputs`, sized
for the largest bucket); a replay copies the batch's tensors into their first rows and pads the rest of
the bucket with the dummy request row 0, KV slot 0 (page 0), mamba slot 0 and length 1, which absorb
the padded rows' writes. The logits, the decode's track copies and sampling run eagerly after the
replay, on the real batch.

With NGRAM speculative decoding (`verify_width` W > 0) the runner also captures verify forwards
(`ForwardMode.TARGET_VERIFY`) per bucket: every request runs exactly W positions (its newest token, its
drafts, filler after them: `NgramWorker` pads a verify to W where a graph serves it), so a bucket's
shape is fixed: bucket x W tokens, each request's W in a row. Padded requests run W positions of the
dummy row, KV slot 0 and mamba slot 0 (their verify rows are the bucket's spare ones). The logits and
sampling of every position run eagerly after the replay.

EAGLE / NEXTN add graphs of their own beside these (`add_companion`, `speculative/mtp_graphs.py`: the
draft loop, and the MTP layer after a replay, which reads these graphs' buffers and outputs), captured
after them and captured again and released with them.

A graph replays device work only: anything the body decided on the host at capture would be frozen
into it. So the batch a graph is captured with carries no host values (`_NO_HOST_VALUES` in place of
every `*_cpu` list): code that reads one raises `GraphUnsafeError` at capture. This is also what the CPU
tests check, by running the same runner without graphs (`use_graphs=False`: the body runs eagerly on
the static buffers at every replay, so padding, the dummy rows and the no-host rule are exercised).
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from sglang.srt.distributed.parallel_state import tp_gather
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, SamplingBatchInfo
from sglang.srt.utils.graph_capture import graph_body

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)
K = TypeVar("K")  # a graph's key: its batch size, or (kind, batch size)

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


@dataclass
class _StaticInputs:
    """The device buffers every graph of one kind reads, sized for the largest bucket: `width` tokens
    per request (1: decode; W: a verify of W positions per request)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    mamba_pool_indices: torch.Tensor
    # Row i holds PADDING[i]'s value, over the widest field (contiguous: `_foreach_copy_`'s one-launch
    # path on CUDA needs dense tensors); `load`'s target and source slices per (batch size, bucket).
    pad_values: torch.Tensor
    width: int = 1
    # A verify's extend lengths: W for every request (never loaded: every batch it serves has them).
    extend_seq_lens: torch.Tensor | None = None
    load_plans: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=dict
    )
    # LoRA: each request's adapter slot (-1 for the base model and for padding), where adapters are served.
    lora_slots: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_bs: int, device: torch.device, width: int = 1, lora: bool = False) -> _StaticInputs:
        def zeros(per_request: int):
            return torch.zeros(max_bs * per_request, dtype=torch.int64, device=device)

        pad_values = torch.empty(len(cls.PADDING), max_bs * width, dtype=torch.int64, device=device)
        for row, (name, pad) in zip(pad_values, cls.PADDING, strict=True):
            row.fill_(width if name == "seq_lens" else pad)  # on the device: no host copy at startup
        sizes = [width if name in cls.PER_TOKEN else 1 for name, _ in cls.PADDING]
        inputs = cls(*(zeros(n) for n in sizes), pad_values, width)
        inputs.seq_lens.fill_(width)
        if width > 1:
            inputs.extend_seq_lens = torch.full((max_bs,), width, dtype=torch.int64, device=device)
        if lora:
            inputs.lora_slots = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        return inputs

    # (field, value of a padded row): the dummy request row, KV slot and mamba slot are all 0; a padded
    # request's length is its tokens' count (`width`), so a verify's prefix is empty.
    PADDING = (
        ("input_ids", 0),
        ("positions", 0),
        ("req_pool_indices", 0),
        ("seq_lens", 1),
        ("out_cache_loc", 0),
        ("mamba_pool_indices", 0),
    )
    PER_TOKEN = frozenset(("input_ids", "positions", "out_cache_loc"))

    def reset(self) -> None:
        """Every row back to padding (as `allocate` made them): a capture's body then runs on the dummy
        rows and slots only, never on what the last real batch left in the buffers."""
        for i, (name, _) in enumerate(self.PADDING):
            buf = getattr(self, name)
            buf.copy_(self.pad_values[i, : buf.numel()])
        if self.lora_slots is not None:
            self.lora_slots.fill_(-1)

    def _rows(self, name: str, bs: int) -> int:
        return bs * self.width if name in self.PER_TOKEN else bs

    def load(self, fb: ForwardBatch, bucket: int) -> None:
        """The batch's rows, then padding up to the bucket: one `_foreach_copy_` (one launch on CUDA, for
        what was a copy and a fill per field, and far less host time on CPU), with the buffers' slices
        and the padding's source slices kept per (batch size, bucket)."""
        bs = fb.batch_size
        plan = self.load_plans.get((bs, bucket))
        if plan is None:
            names = [name for name, _ in self.PADDING]
            rows = [getattr(self, n)[: self._rows(n, bs)] for n in names]
            pads, sources = [], []
            if bucket > bs:
                for i, n in enumerate(names):
                    lo, hi = self._rows(n, bs), self._rows(n, bucket)
                    pads.append(getattr(self, n)[lo:hi])
                    sources.append(self.pad_values[i, : hi - lo])
            plan = self.load_plans[(bs, bucket)] = (rows + pads, sources)
        targets, pad_sources = plan
        sources = [getattr(fb, name) for name, _ in self.PADDING] + pad_sources
        torch._foreach_copy_(targets, sources, non_blocking=True)
        if self.lora_slots is not None:  # (a batch on the base model alone has none: all -1)
            if fb.lora_slots is not None:
                self.lora_slots[:bs].copy_(fb.lora_slots, non_blocking=True)
            self.lora_slots[bs if fb.lora_slots is not None else 0 : bucket].fill_(-1)

    def batch(self, bs: int) -> ForwardBatch:
        """The batch a graph of `bs` requests is captured with: views of the buffers, no host lists."""
        views = {name: getattr(self, name)[: self._rows(name, bs)] for name, _ in self.PADDING}
        rows = bs * self.width
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if self.width == 1 else ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            req_pool_indices_cpu=_NO_HOST_VALUES,
            seq_lens_cpu=_NO_HOST_VALUES,
            mamba_pool_indices_cpu=_NO_HOST_VALUES,
            sampling_info=SamplingBatchInfo.greedy(rows),
            return_logprob_mask=[False] * rows,
            top_logprobs_nums=[0] * rows,
            **views,
        )
        if self.lora_slots is not None:
            fb.lora_slots = self.lora_slots[:bs]
        if self.width > 1:
            fb.extend_prefix_lens_cpu = fb.extend_seq_lens_cpu = fb.extend_start_loc_cpu = _NO_HOST_VALUES
            fb.extend_seq_lens = self.extend_seq_lens[:bs]
            fb.verify_width = self.width
        return fb


class CudaGraphRunner:
    def __init__(
        self, model_runner: ModelRunner, bs_list: list[int], use_graphs: bool = True, verify_width: int = 0
    ):
        """Captures a graph per size in `bs_list` (largest first, one memory pool), and with
        `verify_width` W a verify graph of W positions per request for every size up to the pool's
        verify rows; `use_graphs=False` runs the same bodies eagerly at every replay (CPU tests)."""
        self.model_runner = model_runner
        self.use_graphs = use_graphs
        self.device = torch.device(model_runner.device)
        self.verify_width = verify_width
        lora = getattr(model_runner, "lora", None) is not None  # (the CPU tests' stand-in runners have none)
        self.kinds: dict[ForwardMode, _GraphSet] = {
            ForwardMode.DECODE: _GraphSet(_StaticInputs.allocate(max(bs_list), self.device, lora=lora), bs_list)
        }
        if verify_width > 1:  # (one position per request is a decode: no verify is ever built)
            verify_bs = [bs for bs in bs_list if bs <= model_runner.mamba_pool.verify_shape[0]]
            if verify_bs:
                static = _StaticInputs.allocate(max(verify_bs), self.device, verify_width, lora=lora)
                self.kinds[ForwardMode.TARGET_VERIFY] = _GraphSet(static, verify_bs)
        # Graphs of other forwards that live and die with these (EAGLE / NEXTN's draft loop,
        # `speculative/mtp_graphs.py`): `capture()` and `release()`, called after and with this runner's.
        self.companions: list = []
        self._last_replayed: weakref.ref[ForwardBatch] | None = None
        self._capture_all()

    @property
    def last_replayed(self) -> ForwardBatch | None:
        """The batch whose rows the static buffers and outputs hold (None after `release`, or once that
        batch is gone): a weak reference, so that the runner never keeps a batch alive (its `spec` may
        hold EAGLE's draft distributions, [requests, k, vocab] float32) until the next replay."""
        return self._last_replayed() if self._last_replayed is not None else None

    @last_replayed.setter
    def last_replayed(self, fb: ForwardBatch | None) -> None:
        self._last_replayed = weakref.ref(fb) if fb is not None else None

    def add_companion(self, companion) -> None:
        """Capture `companion`'s graphs now, and again and released whenever this runner's are."""
        companion.capture()
        self.companions.append(companion)

    def remove_companion(self, companion) -> None:
        """Release `companion`'s graphs and stop capturing them with this runner's."""
        companion.release()
        self.companions.remove(companion)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        for mode, graphs in self.kinds.items():
            self._capture(graphs, sorted(graphs.batches, reverse=True), pool)
            if self.use_graphs:
                width = self.verify_width
                what = "decode" if mode == ForwardMode.DECODE else f"verify ({width} positions each)"
                logger.info("CUDA graphs captured for %s batch sizes %s.", what, graphs.bs_list)
        for companion in self.companions:
            companion.capture()

    def recapture(self) -> None:
        """Capture every graph again, of the model runner's model as it is now (its weights were replaced:
        the old graphs read the old tensors). The old graphs and their memory pool are freed first."""
        self.release()
        self._capture_all()

    def release(self) -> None:
        """Free every graph and its memory pool (/release_memory_occupation; `recapture` makes them again:
        the scheduler runs no batch until then, and `can_run` says no). Nothing keeps a tensor of the
        pools: the captured batches' rotary cos / sin (the last body's: the target's, or the MTP layer's
        companion) and the per-batch metadata the last capture left in the target's attention backends
        (full and linear) are dropped; a capture's body computes them again."""
        for graphs in self.kinds.values():
            graphs.graphs.clear()
            graphs.outputs.clear()
            graphs.bs_list = []
            graphs.static.reset()  # (they hold the last replayed batch's rows: live requests' slots)
            for fb in graphs.batches.values():
                fb.rope_cache = {}
        self.model_runner.attn_backend.release_metadata()
        for companion in self.companions:
            companion.release()
        self.last_replayed = None
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @property
    def decode(self) -> _GraphSet:
        return self.kinds[ForwardMode.DECODE]

    @property
    def bs_list(self) -> list[int]:
        """The captured decode batch sizes."""
        return self.decode.bs_list

    @property
    def max_bs(self) -> int:
        return self.decode.max_bs

    def verify_max_bs(self) -> int:
        """The largest verify batch a graph serves (0: none)."""
        graphs = self.kinds.get(ForwardMode.TARGET_VERIFY)
        return graphs.max_bs if graphs is not None else 0

    def can_run(self, fb: ForwardBatch) -> bool:
        if fb.forward_mode.is_target_verify():
            return 0 < fb.batch_size <= self.verify_max_bs() and fb.verify_width == self.verify_width
        return fb.forward_mode.is_decode() and 0 < fb.batch_size <= self.max_bs

    def bucket(self, bs: int) -> int:
        return self.decode.bucket(bs)

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """The forward's final hidden states, a row per token: the batch loaded into the static buffers,
        padded to its bucket, and the bucket's graph replayed."""
        graphs = self.kinds[fb.forward_mode]
        bucket = graphs.bucket(fb.batch_size)
        graphs.static.load(fb, bucket)
        if self.use_graphs:
            graphs.graphs[bucket].replay()
        else:  # (kept where a graph leaves its output: what a companion's body reads)
            graphs.outputs[bucket] = self._body(graphs.batches[bucket])
        self.last_replayed = fb
        return graphs.outputs[bucket][: fb.batch_size * graphs.static.width]

    def _body(self, fb: ForwardBatch) -> torch.Tensor:
        runner = self.model_runner
        fb.rope_cache = {}
        fb.attn_backend = runner.attn_backend
        runner.write_new_token_slots(fb)
        runner.attn_backend.init_forward_metadata(fb)
        return runner.model(fb.input_ids, fb.positions, fb)

    def _capture(self, graphs: _GraphSet, sizes: list[int], pool) -> None:
        def loaded(bs: int) -> ForwardBatch:
            graphs.static.load(graphs.batches[bs], bs)  # every row padding: a valid batch of dummy rows
            return graphs.batches[bs]

        def left_out(bs: int, e: Exception) -> None:
            logger.warning("%s batch size %d cannot be captured in a CUDA graph (%s); its batches replay the "
                           "next larger captured size, or run eagerly above the largest.",
                           graphs.batches[bs].forward_mode.name, bs, e)  # fmt: skip

        with torch.inference_mode():
            capture_each(
                sizes,
                lambda bs: self._body(loaded(bs)),
                (lambda bs: self._capture_one(loaded(bs), pool)) if self.use_graphs else None,
                graphs.graphs,
                graphs.outputs,
                left_out,
            )
        graphs.bs_list = sorted(graphs.outputs)

    def _capture_one(self, fb: ForwardBatch, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        return capture_graph(lambda: self._body(fb), self.device, pool)


def capture_each(
    keys: Iterable[K],
    body: Callable[[K], torch.Tensor],
    capture: Callable[[K], tuple[torch.cuda.CUDAGraph, torch.Tensor]] | None,
    graphs: dict[K, torch.cuda.CUDAGraph],
    outputs: dict[K, torch.Tensor],
    left_out: Callable[[K, Exception], None],
) -> None:
    """Per key, in order, the CUDA graph and output `capture(key)` gives (of `body(key)`); with no
    `capture` (the CPU form, `use_graphs=False`) `body(key)`'s output alone. A key whose capture fails is
    left out of both (`left_out` logs it: another size, or the eager path, serves its batches); a
    GraphUnsafeError (a body that reads a host value: a bug, not a size) stops the capture.

    Under TP a key is kept only where every rank captured it (`tp_gather`): a size one rank failed to
    capture (its graph memory, which differs between GPUs) would have that rank run a batch eagerly while
    the others replay it padded to the bucket: collectives of other sizes, and for EAGLE / NEXTN's draft
    loop other drafts (a graph drafts greedily, the eager loop samples a sampling request's drafts from
    the draft generator), so ranks that commit different tokens from then on. The gather cannot
    interleave with another collective on the TP group's gloo group: every rank captures at the same
    point, on its scheduler's thread (at startup, building the model runner; a recapture: a weight swap or
    update, or /resume_memory_occupation, between steps with no batch in flight), the other host-value
    exchanges (the scheduler's `TpBroadcast`, the PD queues' `PdRanks`, the host tier's agreement) have
    gloo groups of their own, the pool planner's gather ran before, and where the model's collectives
    share that group (gloo on CPU) the forward thread has no batch to run them for meanwhile."""
    keys = list(keys)
    for key in keys:
        if capture is None:
            outputs[key] = body(key)
            continue
        try:
            graphs[key], outputs[key] = capture(key)
        except GraphUnsafeError:
            raise
        except Exception as e:  # noqa: BLE001 - a size that cannot be captured is left out
            graphs.pop(key, None)
            outputs.pop(key, None)
            left_out(key, e)
    mine = [key for key in keys if key in outputs]
    everyone = tp_gather(mine)
    for key in mine:
        if not all(key in theirs for theirs in everyone):
            graphs.pop(key, None)
            del outputs[key]
            left_out(key, RuntimeError("another TP rank could not capture it"))


def capture_graph(body, device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of `body()` and the tensor it returns (read after each replay). Warmed up on a side
    stream first (Triton compiles, cuBLAS picks its kernels). Capture checks this thread's calls only
    (`thread_local`): a recapture (a weight swap, a KV-scale change, a resume) may run while another
    thread of the server uses the GPU (a PD transfer packing state), whose allocations would otherwise
    end the capture or fail that thread; the bodies make no unsafe call themselves."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with graph_body():  # (warm-up and capture take the same kernels: utils/graph_capture.py)
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = body()
    return graph, out


@dataclass
class _GraphSet:
    """One kind's graphs (decode, or verify): its static inputs, the batch each size is captured with,
    and per captured size the graph and its output."""

    static: _StaticInputs
    sizes: list[int]
    batches: dict[int, ForwardBatch] = field(default_factory=dict)
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    bs_list: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.batches = {bs: self.static.batch(bs) for bs in self.sizes}

    @property
    def max_bs(self) -> int:
        return self.bs_list[-1] if self.bs_list else 0

    def bucket(self, bs: int) -> int:
        return self.bs_list[bisect.bisect_left(self.bs_list, bs)]
