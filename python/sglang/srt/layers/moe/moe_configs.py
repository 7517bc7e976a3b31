"""Tile configurations of the 16-bit fused MoE GEMMs (`fused_moe_triton.py`), tuned per (experts,
width, hidden, dtype, GPU) and kept in the repository as JSON under `configs/`, one file per layer shape
and GPU, named like upstream's fused-MoE configs (E = the experts the GEMMs run over on the rank, N = their
intermediate width on the rank) with the hidden size and dtype added, since both GEMMs' shapes follow
from the three. E counts a shared expert stacked as one more (`FusedExperts.fuse_shared`; upstream names
its fused shared experts' files so too): Qwen3-Next-80B's layers run 512 routed + 1, so

    E=513,N=512,K=2048,device_name=NVIDIA_H200,dtype=bf16.json

holds their tiles, tuned with top-k + 1 = 11 picks per token (`tune_fused_moe.py`, by default); E=512 a
layer's routed experts alone (`--unstacked`).

Each file maps a batch size (tokens, as a string) to one configuration per GEMM:

    {"64": {"w13": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "num_warps": 4,
                    "num_stages": 3}, "w2": {...}}, ...}

A batch takes the entry of the nearest batch size in its file (over twice the largest, the fallback).
`benchmark/gpu/tune_fused_moe.py` writes these files on a GPU. Where no file matches (another GPU, shape
or dtype) the fallback below serves: tiles by the mean rows per expert, chosen without a GPU; on an H200
(2026-11-30) the tuned tiles beat them by 1.00-1.08x at the 80B's and the 35B-A3B's shapes."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from sglang.srt.layers.moe.fused_moe_fp8_triton import MoeGemmConfig, config_by_mean_rows

CONFIG_DIR = Path(__file__).parent / "configs"
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
GEMMS = ("w13", "w2")
FIELDS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages")

# (mean rows per expert T k / E, the first whose bound holds it) -> tile, both GEMMs. Decode at the 80B's
# shapes has 0.02 (batch 1) to 5 (batch 256) rows per expert: 16-row tiles (mma's smallest useful M) and
# 64 columns, so that many programs stream the touched experts' weights; 128-long K steps in 3 stages
# keep ~36 KB per stage in flight (the gated w13 GEMM reads a gate and an up tile). Prefill takes 64-row
# tiles. Each compiles for sm_90 without spilling (test_fused_moe_triton.py).
FALLBACK_CONFIGS: tuple[tuple[float, MoeGemmConfig], ...] = (
    (4.0, MoeGemmConfig(16, 64, 128, 4, 3)),
    (32.0, MoeGemmConfig(32, 64, 128, 4, 3)),
    (float("inf"), MoeGemmConfig(64, 128, 64, 4, 3)),
)

# The tiles `benchmark/gpu/tune_fused_moe.py` times (kept here so the nightly sm_90 check compiles each
# one a GPU run may pick): decode moves the touched experts' weights, so 16-row tiles with more or fewer
# columns and K steps, and two taller tiles for batches of several rows per expert. (block_m, block_n,
# block_k, warps, stages)
TUNE_CANDIDATES = [
    MoeGemmConfig(*c)
    for c in (
        (16, 32, 128, 4, 4), (16, 64, 64, 4, 4), (16, 64, 128, 4, 3), (16, 64, 128, 4, 4), (16, 128, 64, 4, 4),
        (16, 128, 128, 8, 3), (32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3),
    )
]  # fmt: skip

Table = dict[int, tuple[MoeGemmConfig, MoeGemmConfig]]


def device_name(device: torch.device) -> str:
    """The GPU's name as the files spell it (torch's name, spaces as underscores); the device type
    elsewhere (no file matches it)."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device).replace(" ", "_")


def config_file_name(num_experts: int, inter: int, hidden: int, dtype: torch.dtype, device: str) -> str:
    kind = DTYPE_NAMES.get(dtype, dtype)
    return f"E={num_experts},N={inter},K={hidden},device_name={device},dtype={kind}.json"


def parse_table(text: str, source: str) -> Table:
    """A file's text -> {batch size: (w13's config, w2's)}; ValueError naming `source` where it is not one."""
    try:
        raw = json.loads(text)
        table = {
            int(batch): tuple(MoeGemmConfig(*(int(entry[gemm][f]) for f in FIELDS)) for gemm in GEMMS)
            for batch, entry in raw.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{source} is not a fused-MoE config file ({type(e).__name__}: {e}).") from e
    if not table:
        raise ValueError(f"{source} holds no batch size.")
    return table


def table_to_json(table: Table) -> str:
    entries = {
        str(b): {g: dict(zip(FIELDS, cfg, strict=True)) for g, cfg in zip(GEMMS, table[b], strict=True)}
        for b in sorted(table)
    }
    return json.dumps(entries, indent=1)


@functools.cache
def tuned_table(
    num_experts: int,
    inter: int,
    hidden: int,
    dtype: torch.dtype,
    device: str,
    directory: str = str(CONFIG_DIR),
) -> Table | None:
    """The tuned configurations for this layer shape on `device` (a name from `device_name`), or None
    where the repository has none."""
    path = Path(directory) / config_file_name(num_experts, inter, hidden, dtype, device)
    if not path.is_file():
        return None
    return parse_table(path.read_text(), str(path))


def pick_configs(
    table: Table | None, num_tokens: int, assignments: int, num_experts: int
) -> tuple[MoeGemmConfig, MoeGemmConfig]:
    """(w13's config, w2's) for a batch: the tuned entry of the nearest batch size (the smaller on a tie),
    or the fallback for both where there is no table or the batch is over twice its largest size (the
    tuning covers decode sizes; a prefill of thousands of tokens wants taller tiles than batch 256's)."""
    if not table or num_tokens > 2 * max(table):
        cfg = config_by_mean_rows(FALLBACK_CONFIGS, assignments, num_experts)
        return cfg, cfg
    return table[min(table, key=lambda b: (abs(b - num_tokens), b))]
