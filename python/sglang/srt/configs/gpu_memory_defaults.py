"""SGLang's defaults that scale with the GPU: `--chunked-prefill-size`, `--cuda-graph-max-bs` and
`--mem-fraction-static` where not given, by the device's total memory, as upstream's
`_handle_gpu_memory_settings` picks them for one GPU (tensor parallelism below 4). A GPU with more memory
takes longer prefill chunks (fewer forwards for a long prompt or a burst of prompts: 64 x 256 prompt
tokens are 8 extends at 2,048 tokens, 2 at 8,192), captures CUDA graphs for larger decode batches, and
gives the caches all its memory but a reserve sized for those (`mem_fraction_static_default`), and with
EAGLE / NEXTN for the MTP layer's CUDA graphs, derived from the model's shapes (`mtp_graphs_bytes`).

The memory is read with `nvidia-smi`, as upstream reads it, for the first device CUDA_VISIBLE_DEVICES
names: the process that asks (the server's main process, or the program that makes an `Engine`) gets
no CUDA state of torch's, so it may still fork children that use CUDA. Where `nvidia-smi` cannot answer,
the device's properties are read through torch: no CUDA context either (`torch.cuda.mem_get_info` would
make one), but torch's CUDA state is then initialised in that process.
"""

from __future__ import annotations

import os
import subprocess
from typing import NamedTuple


class GpuMemoryDefaults(NamedTuple):
    chunked_prefill_size: int
    cuda_graph_max_bs: int


# (below this many MiB of device memory, the defaults), in order; SGLang's tiers and their examples.
GPU_MEMORY_TIERS: list[tuple[int, GpuMemoryDefaults]] = [
    (20 * 1024, GpuMemoryDefaults(2048, 8)),  # T4, RTX 4080
    (35 * 1024, GpuMemoryDefaults(4096, 48)),  # A10, RTX 4090 / 5090
    (60 * 1024, GpuMemoryDefaults(4096, 32)),  # A100 40 GB, L40
    (90 * 1024, GpuMemoryDefaults(8192, 256)),  # H100, A100 80 GB
    (160 * 1024, GpuMemoryDefaults(8192, 256)),  # H20, H200
]
LARGEST_GPU = GpuMemoryDefaults(16384, 512)  # B200, MI300
UNKNOWN_GPU = GpuMemoryDefaults(4096, 160)  # the memory could not be read


def gpu_memory_defaults(memory_mib: int | None) -> GpuMemoryDefaults:
    """The defaults for a GPU of `memory_mib` MiB (None: unknown)."""
    if memory_mib is None:
        return UNKNOWN_GPU
    for below, defaults in GPU_MEMORY_TIERS:
        if memory_mib < below:
            return defaults
    return LARGEST_GPU


def mem_fraction_static_default(
    memory_mib: int, prefill_tokens: int, cuda_graph_max_bs: int, draft_graphs_mib: float = 0.0
) -> float | None:
    """The fraction of a GPU of `memory_mib` MiB that weights and caches may take: all but a reserve of
    512 MiB (metadata), 1.5 MiB per token of the largest prefill forward (at least 2,048 tokens:
    activations), 2 MiB per graph batch size up to `cuda_graph_max_bs` (0: no graphs) and 128 MiB (one
    GPU's share of the parallel slack); at least 10 GiB on a GPU above 60 GiB; then EAGLE / NEXTN's MTP
    graphs, `draft_graphs_mib` (`mtp_graphs_reserve_mib`), beside it, as upstream adds its draft's
    reserve after that floor. None where the reserve leaves nothing (the pool sizing's own default then
    applies)."""
    reserved = 512 + max(prefill_tokens, 2048) * 1.5 + cuda_graph_max_bs * 2 + 1024 / 8
    if memory_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    reserved += draft_graphs_mib
    fraction = round((memory_mib - reserved) / memory_mib, 3)
    return fraction if fraction > 0 else None


class MtpGraphShapes(NamedTuple):
    """What the memory of EAGLE / NEXTN's MTP-layer CUDA graphs (`speculative/mtp_graphs.py`) scales with."""

    vocab_size: int
    hidden_size: int
    ffn_size: int  # the MTP layer's MLP width per token (an MoE's: its top-k experts' and shared expert's)
    dtype_bytes: int
    steps: int  # --speculative-num-steps k (a verify: k + 1 positions per request)
    sizes: list[int]  # the captured batch sizes


def mtp_graphs_bytes(shapes: MtpGraphShapes) -> int:
    """The memory the MTP layer's graphs hold, estimated high from the shapes (each kind's graphs share
    one pool, captured largest first, so a smaller size reuses the largest one's blocks; what a graph
    returns stays allocated per size):
    - the draft loop: at the largest size B, k steps' logits [B, vocab] in the model dtype and their
      float32 copy (counted as if none were freed within the capture), the MTP layer's activations over
      B rows, and each size's [size, k] int64 drafts;
    - the MTP layer after a decode or verify: its output g [rows, hidden] per size of each kind (a decode's
      rows: size; a verify's: size x (k + 1)) and its activations over the largest verify's rows.
    The MTP layer's activations per row: 8 hidden-wide tensors (norms, the residual, q / k / v / gate /
    attention output, the embedding and hidden inputs and their concatenation) and 3 MLP-wide ones (gate,
    up, their product). A verify's sizes are bounded by the pool's verify rows, counted here as every
    captured size (an over-estimate where they are fewer)."""
    d, k, top = shapes.dtype_bytes, shapes.steps, max(shapes.sizes)
    row = (8 * shapes.hidden_size + 3 * shapes.ffn_size) * d
    draft = k * top * shapes.vocab_size * (d + 4) + top * row + sum(shapes.sizes) * k * 8
    after = sum(shapes.sizes) * (1 + (k + 1)) * shapes.hidden_size * d + top * (k + 1) * row
    return draft + after


# SGLang's default capture sizes: small ones densely, then every 8.
DEFAULT_MAX_BS = 160


def capture_bs_list(args, max_running_requests: int) -> list[int]:
    """The batch sizes to capture: `--cuda-graph-bs` if given, else 1, 2, 4, 8, 12, then every 8 up to
    `--cuda-graph-max-bs` (on CUDA SGLang's default by GPU memory, above; 160
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


def mtp_graphs_reserve_mib(args, graph_bs: int) -> float:
    """`mtp_graphs_bytes` in MiB for a server of `args` capturing graphs up to `graph_bs` (0: none), with
    EAGLE / NEXTN (else 0): the model's shapes from its config, the sizes `capture_bs_list` takes."""
    from sglang.srt.speculative.draft_layers import MTP_ALGORITHMS  # (torch: only where asked)

    if not graph_bs or args.speculative_algorithm not in MTP_ALGORITHMS:
        return 0.0
    cfg = args.model_config.arch.hf_config
    moe = getattr(cfg, "num_experts_per_tok", None) and getattr(cfg, "moe_intermediate_size", None)
    if moe:
        ffn = cfg.num_experts_per_tok * cfg.moe_intermediate_size
        ffn += getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    else:
        ffn = cfg.intermediate_size
    shapes = MtpGraphShapes(
        cfg.vocab_size, cfg.hidden_size, ffn, args.model_config.torch_dtype.itemsize,
        args.speculative_num_steps, capture_bs_list(args, graph_bs),
    )  # fmt: skip
    return mtp_graphs_bytes(shapes) / 2**20


def gpu_memory_mib() -> int | None:
    """Total memory of the CUDA device the server runs on (the first visible one), in MiB: from
    `nvidia-smi`, else from torch's device properties (module docstring); None if neither can read it."""
    device = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", device]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass  # no nvidia-smi, or a device it does not name this way (a MIG instance): ask torch
    try:
        import torch

        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory // 2**20
    except Exception:  # noqa: BLE001 - no readable device: the caller falls back to UNKNOWN_GPU
        return None
