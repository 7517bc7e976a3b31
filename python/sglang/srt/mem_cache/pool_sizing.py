"""How big the pools are: KV tokens, mamba slots, request rows, the running cap.

Slots come from `--max-mamba-cache-size`, else from a memory budget split between state and KV by
`--mamba-full-memory-ratio` r (state : KV = r : 1). Tokens come from `--max-total-tokens`, else from the
rest of the budget. The budget (`cache_budget_bytes`) follows SGLang's meaning of `--mem-fraction-static`:
the fraction of the device's memory that weights and caches may hold together. On CUDA it is measured
after the weights are loaded: free memory minus the (1 - fraction) of the total that stays free for
activations. On CPU it is the fraction of RAM minus the weights (default 2%: the tiny presets need
little, and tests start many engines).

Weights larger than the fraction of the device are refused before they load (`check_weights_fit`, from
the config's bytes: `weight_bytes.py`), and `plan_memory` gives the whole plan for a device of a given
size without the device or the weights (docs/state_management.md, "Memory planning").

Tensor parallelism: every number is one rank's, on its own device: its weights, its KV heads (replicated
where --tp-size exceeds the model's key/value heads) and its share of the recurrent heads per slot. Every
rank sizes alike (a rank's weights differ from another's by the vocabulary's padding at most), but the
memory a rank finds free may not be alike (on GPUs another process's allocations, or the driver's): so
the budget each rank finds is reduced with MIN over its TP group before the sizes are derived from it
(`smallest_across_ranks`), so that every rank derives the same sizes or the same refusal and schedules
from the same pools (the scheduler's start checks that the sizes agree). Each data-parallel replica is its
own TP group and sizes its own pools.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from sglang.srt.configs.hybrid_arch import HybridArchConfig
from sglang.srt.mem_cache.weight_bytes import planned_parallel, weight_bytes_from_config
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.speculative.draft_layers import draft_kv_layer_ids

logger = logging.getLogger(__name__)

CPU_DEFAULT_MEM_FRACTION = 0.02
# Where ServerArgs left --mem-fraction-static unset on CUDA (the GPU's memory could not be read; it
# otherwise sets SGLang's default for the GPU: `configs/gpu_memory_defaults.py`).
GPU_DEFAULT_MEM_FRACTION = 0.85
MAX_RUNNING_REQUESTS_CAP = 4096


@dataclass(frozen=True)
class PoolSizes:
    max_total_tokens: int
    max_mamba_cache_size: int
    max_running_requests: int
    resident_slots_per_req: int
    mamba_bytes_per_slot: int
    kv_bytes_per_token: int

    @property
    def req_pool_size(self) -> int:
        return self.max_running_requests

    @property
    def kv_pool_bytes(self) -> int:
        return self.max_total_tokens * self.kv_bytes_per_token

    @property
    def mamba_pool_bytes(self) -> int:
        """The state pool's slots (speculative verify rows come on top: `ModelRunner`'s log)."""
        return self.max_mamba_cache_size * self.mamba_bytes_per_slot


def mem_fraction(device: str, fraction: float | None) -> float:
    """`--mem-fraction-static` as given, else this device's default (the one place it is resolved)."""
    return fraction or (GPU_DEFAULT_MEM_FRACTION if device == "cuda" else CPU_DEFAULT_MEM_FRACTION)


def cache_budget_bytes(
    device: str, fraction: float | None, weight_bytes: int, device_memory: int | None = None
) -> tuple[int, float]:
    """Bytes the KV and state pools may take, and the fraction used (module docstring). `device_memory`
    plans for a device of that many bytes instead of measuring this one (`plan_memory`; the host RAM on
    CPU)."""
    fraction = mem_fraction(device, fraction)
    if device == "cuda" and device_memory is None:
        free, total = torch.cuda.mem_get_info()  # the weights are already resident
        return int(free - total * (1 - fraction)), fraction
    if device_memory is None:
        device_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(device_memory * fraction) - weight_bytes, fraction


def check_weights_fit(server_args: ServerArgs, weight_bytes: int, device_memory: int) -> None:
    """Refuses, in one sentence and before anything loads, weights larger than what
    `--mem-fraction-static` gives weights and caches together on a device of `device_memory` bytes."""
    fraction = mem_fraction(server_args.device, server_args.mem_fraction_static)
    budget = device_memory * fraction
    if weight_bytes >= budget:
        raise ServerArgsError(
            f"The weights of {server_args.model_path} take {weight_bytes / 1e9:.1f} GB, more than the "
            f"{budget / 1e9:.1f} GB that --mem-fraction-static {fraction} of this device's "
            f"{device_memory / 1e9:.1f} GB holds for weights and caches{_per_rank(server_args)}: serve "
            "its FP8 checkpoint (or --quantization fp8), or split it over more GPUs with --tp-size."
        )


def _per_rank(server_args: ServerArgs) -> str:
    tp = server_args.tp_size
    return f" (one rank's part at --tp-size {tp})" if tp > 1 else ""


@dataclass(frozen=True)
class MemoryPlan:
    """What the server does with a device's memory: the weights, then the pools (`plan_memory`)."""

    device_memory: int
    mem_fraction_static: float
    weight_bytes: int
    sizes: PoolSizes
    tp_size: int = 1  # every number is one rank's, on its own device

    @property
    def cache_bytes(self) -> int:
        """Bytes left for the KV and state pools after the weights."""
        return int(self.device_memory * self.mem_fraction_static) - self.weight_bytes

    def describe(self) -> str:
        s = self.sizes
        return (
            f"weights {self.weight_bytes / 1e9:.1f} GB, KV pool {s.kv_pool_bytes / 1e9:.1f} GB "
            f"({s.max_total_tokens} tokens), state pool {s.mamba_pool_bytes / 1e9:.1f} GB "
            f"({s.max_mamba_cache_size} slots) of {self.device_memory / 1e9:.1f} GB at "
            f"--mem-fraction-static {self.mem_fraction_static}"
            + (f", per rank at --tp-size {self.tp_size}" if self.tp_size > 1 else "")
        )


def plan_memory(server_args: ServerArgs, device_memory: int, weight_bytes: int | None = None) -> MemoryPlan:
    """The memory plan for `server_args`' model on a device of `device_memory` bytes, from the config
    alone (`weight_bytes_from_config` unless given): ServerArgsError where the weights do not fit."""
    config = server_args.model_config
    tp, ep = server_args.tp_size, server_args.ep_size
    with planned_parallel(tp, ep):  # one rank's weights and pools (module docstring)
        if weight_bytes is None:
            weight_bytes = weight_bytes_from_config(
                config.hf_config,
                config.torch_dtype,
                server_args.device,
                draft_layers=bool(draft_kv_layer_ids(server_args)),  # EAGLE / NEXTN's MTP layer loads too
            ).total
        check_weights_fit(server_args, weight_bytes, device_memory)
        fraction = mem_fraction(server_args.device, server_args.mem_fraction_static)
        sizes = compute_pool_sizes(server_args, config.arch, weight_bytes, device_memory)
    return MemoryPlan(device_memory, fraction, weight_bytes, sizes, tp)


def smallest_across_ranks(value: int) -> int:
    """The smallest `value` any rank of this process's TP group has (the identity at one rank and under
    the planner's stand-in groups)."""
    from sglang.srt.distributed.parallel_state import tp_gather

    return min(tp_gather(int(value)))  # (host ints, no device)


def compute_pool_sizes(
    server_args: ServerArgs, arch: HybridArchConfig, weight_bytes: int, device_memory: int | None = None
) -> PoolSizes:
    dtype = server_args.model_config.torch_dtype
    per_slot = arch.mamba_cache_per_req(dtype, server_args.mamba_ssm_dtype)
    per_token = arch.kv_bytes_per_token(server_args.model_config.kv_cache_torch_dtype)
    # EAGLE / NEXTN: the MTP layer's K and V, one more layer of the pool in the same slots.
    layers = len(arch.full_attention_layer_ids)
    per_token = per_token * (layers + len(draft_kv_layer_ids(server_args))) // layers
    strategy = server_args.mamba_strategy
    resident = strategy.resident_slots_per_req
    slots, tokens = server_args.max_mamba_cache_size, server_args.max_total_tokens
    # Speculative decoding's verify rows (`MambaPool.verify_shape`): a slot's bytes per draft position of
    # each running request, paid from the budget wherever a size is derived from it.
    draft = server_args.speculative_num_draft_tokens if server_args.speculative_algorithm else 0

    if slots is None or tokens is None:
        rest, fraction = cache_budget_bytes(
            server_args.device, server_args.mem_fraction_static, weight_bytes, device_memory
        )
        # Under TP the budget of the rank with the least: every rank then derives the same sizes, and a
        # refusal below is every rank's (one rank refusing alone would leave the others waiting in the
        # reduction at the end until --dist-timeout).
        rest = smallest_across_ranks(rest)
        if rest <= 0:
            raise ServerArgsError(
                f"--mem-fraction-static {fraction} leaves no memory for the caches after the weights "
                f"({weight_bytes} bytes)."
            )
        r = server_args.mamba_full_memory_ratio
        if slots is None:
            state_budget = rest - tokens * per_token if tokens is not None else int(rest * r / (1 + r))
            slots = state_budget // per_slot
        elif draft:
            # Slots given, tokens derived: the rows of as many running requests as the slots hold first.
            cap = server_args.max_running_requests or max(
                1, min(slots // strategy.slots_per_running_req, MAX_RUNNING_REQUESTS_CAP)
            )
            rest -= cap * draft * per_slot
            if rest <= slots * per_slot:
                raise ServerArgsError(
                    f"--speculative-num-draft-tokens {draft}: the verify rows of {cap} running requests "
                    "and the given mamba slots leave no memory for KV tokens; lower it, or "
                    "--max-mamba-cache-size, or raise --mem-fraction-static."
                )
        if tokens is None:
            tokens = (rest - slots * per_slot) // max(per_token, 1)

    if slots < resident:
        raise ServerArgsError(
            f"--max-mamba-cache-size {slots} is smaller than the {resident} slot(s) one request needs with "
            f"--mamba-scheduler-strategy {server_args.mamba_scheduler_strategy}."
        )
    page = server_args.page_size
    if tokens < 2 * page:
        raise ServerArgsError(
            f"--max-total-tokens {tokens} is smaller than the two pages of {page} token(s) one request needs."
        )
    tokens = tokens // page * page
    # Derived slots pay for the verify rows (a size given by flag is the cache's own).
    verify_rows = draft if server_args.max_mamba_cache_size is None else 0
    # The derived cap leaves the tree its headroom (`MambaStrategy.tree_headroom`); a cap given by flag
    # may take it all.
    per_running = strategy.slots_per_running_req + verify_rows
    derived = min(slots // per_running, tokens // 2, MAX_RUNNING_REQUESTS_CAP)
    running = server_args.max_running_requests or max(1, derived)
    slots -= running * verify_rows
    if slots < resident:
        raise ServerArgsError(
            f"--speculative-num-draft-tokens {verify_rows} for {running} running requests leaves "
            f"{max(slots, 0)} mamba slots in the state budget; lower --max-running-requests or raise "
            "--mem-fraction-static."
        )
    if server_args.max_running_requests and running > slots // resident:
        logger.warning(
            "--max-running-requests %d exceeds what %d mamba slots hold at %d per request; "
            "requests beyond that wait in the queue.",
            running, slots, resident,
        )  # fmt: skip
    sizes = PoolSizes(
        max_total_tokens=tokens,
        max_mamba_cache_size=slots,
        max_running_requests=running,
        resident_slots_per_req=resident,
        mamba_bytes_per_slot=per_slot,
        kv_bytes_per_token=per_token,
    )
    # (Under TP every rank derived these from the same budget: the scheduler's start checks they agree.)
    return sizes
