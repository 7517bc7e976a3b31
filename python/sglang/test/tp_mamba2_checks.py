"""Tensor-parallel checks of the Mamba2 family (Nemotron-H, Granite-4.0-H, Falcon-H1, Bamba) and LFM2 /
LFM2-MoE: `run_presets` runs on each rank (`sglang.test.multi_rank.run_ranks`) and, with no process group,
at TP 1 in the test's own process; the test compares the two and both with the transformers oracle.

Each preset serves the same two requests: one extend batch of two fresh prompts, the second request's
prompt continued by a second extend (over its prefix), then batched greedy decode steps.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sglang.srt import distributed as ps
from sglang.srt.layers.linear import RowParallelLinear, shard_weight, weight_shards
from sglang.srt.layers.mamba2_mixer import Mamba2Mixer
from sglang.srt.models.lfm2 import Lfm2ShortConv
from sglang.test.model_checks import batched_extends_with_prefixes, make_runner
from sglang.test.runner_driver import RunnerDriver

UNREDUCED = "unreduced row-parallel"
MOE_PRESETS = ("tiny-nemotron-h", "tiny-granite-4.0-h", "tiny-lfm2-moe")
PRESETS = (
    "tiny-nemotron-h",
    "tiny-granite-4.0-h",
    "tiny-falcon-h1",
    "tiny-bamba",
    "tiny-lfm2",
    "tiny-lfm2-moe",
)
PREFIXES, EXTENDS, DECODE, SEED = (0, 40), (37, 50), 6, 300


def run_preset(path: str) -> dict[str, Any]:
    """One preset (checkpoint folder) on this process's TP group: the requests' full token sequences, their
    logprobs (prompt tokens after the first, then each sampled one) and the pool's per-layer shapes."""
    runner = make_runner(path, max_mamba_cache_size=8, max_total_tokens=1024, max_running_requests=4)
    driver = RunnerDriver(runner)
    reqs, lps = batched_extends_with_prefixes(driver, PREFIXES, EXTENDS, decode=DECODE, seed=SEED)
    pool = runner.mamba_pool
    return {
        "sequences": [r.token_ids + [r.next_token] for r in reqs],
        "logprobs": lps,
        "conv": tuple(pool.conv_state.shape[2:]),
        "ssm": tuple(pool.ssm_state.shape[2:]),
        "kv_heads": runner.token_to_kv_pool.k_buffer[0].shape[1],
        "all_reduces_per_decode": count_all_reduces(lambda: driver.decode(reqs)),
        "first_mixer_weights": first_mixer_weights(runner),
    }


def first_mixer_weights(runner: Any) -> dict[str, list]:
    """The first recurrent mixer's parameters as /get_weights_by_name gives them (whole, gathered from
    every rank's rows: a collective each)."""
    prefix, mixer = next(
        (n, m) for n, m in runner.model.named_modules() if isinstance(m, Mamba2Mixer | Lfm2ShortConv)
    )
    names = [f"{prefix}.{name}" for name, _ in mixer.named_parameters()]
    return {name: runner.get_weights_by_name(name, truncate_size=1 << 20) for name in names}


def count_all_reduces(step: Callable[[], Any]) -> int:
    """How many all-reduces over the TP group `step` runs."""
    group, calls = ps.get_tp_group(), []
    reduce = group.all_reduce
    group.all_reduce = lambda x: calls.append(x.shape) or reduce(x)
    try:
        step()
    finally:
        del group.all_reduce  # the class's method again
    return len(calls)


def run_presets(
    rank: int, world_size: int, init_method: str, paths: dict[str, str], ep_size: int = 1
) -> dict[str, Any]:
    """`run_preset` for every (name -> folder) of `paths` at TP `world_size` (gloo; EP `ep_size`), and
    under UNREDUCED the summed output of an unreduced row-parallel linear with a bias
    (`unreduced_row_parallel`)."""
    ps.init_distributed_environment("gloo", world_size, rank, init_method)
    ps.initialize_model_parallel(world_size, ep_size)
    try:
        out: dict[str, Any] = {name: run_preset(path) for name, path in paths.items()}
        out[UNREDUCED] = unreduced_row_parallel()
        return out
    finally:
        ps.destroy_model_parallel()


def unreduced_row_parallel() -> list[list[float]]:
    """`RowParallelLinear(reduce_results=False)` with a bias (a MoE block's shared expert, summed with the
    routed experts' part by one all-reduce): every rank's output summed, for `unreduced_row_parallel_want`."""
    weight, bias, x = unreduced_row_parallel_inputs()
    linear = RowParallelLinear(16, 4, bias=True, reduce_results=False)
    linear.weight.data.copy_(shard_weight(linear.weight, weight))
    linear.bias.data.copy_(bias)
    (cols,) = weight_shards(linear.weight)  # the input columns this rank holds
    # A list: a tensor would cross to the parent through shared memory this exiting rank holds.
    return ps.tensor_model_parallel_all_reduce(linear(x[:, cols.positions(cols.part)])).tolist()


def unreduced_row_parallel_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(4, 16, generator=g), torch.randn(4, generator=g), torch.randn(3, 16, generator=g)


def expected_rank_state(name: str, conv: tuple, ssm: tuple, tp: int) -> tuple[tuple, tuple]:
    """(conv, SSM) shapes one rank's pool holds at TP `tp` given TP 1's: LFM2's conv channels split (its SSM
    row is unread filler); a Mamba2 layer's heads split, its conv rows [x | B | C] with x split and B, C
    split where `tp` divides the groups, else one group (the one its heads read) per rank."""
    if name.startswith("tiny-lfm2"):
        return (conv[0] // tp, conv[1]), ssm
    heads, head_dim, n = ssm
    x = heads * head_dim
    groups = (conv[0] - x) // (2 * n)
    local_groups = groups // tp if groups % tp == 0 else 1
    return (x // tp + 2 * local_groups * n, conv[1]), (heads // tp, head_dim, n)


def refused_tp_size(rank: int, world_size: int, init_method: str, path: str) -> str:
    """The error building `path`'s runner at TP `world_size` raises (empty if none)."""
    ps.init_distributed_environment("gloo", world_size, rank, init_method)
    ps.initialize_model_parallel(world_size, 1)
    try:
        make_runner(path, max_mamba_cache_size=8, max_total_tokens=1024, max_running_requests=4)
        return ""
    except ValueError as e:
        return str(e)
    finally:
        ps.destroy_model_parallel()


def one_group_bamba(src: str, dst: Path) -> str:
    """A copy of the Bamba checkpoint `src` with one Mamba2 group (group 0's B and C kept, `mamba_n_groups`
    1): the layout Granite-4.0-H and Bamba ship, under which the groups are replicated across TP ranks and
    each output-norm group spans them."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    groups, n = cfg["mamba_n_groups"], cfg["mamba_d_state"]
    inner = cfg["mamba_n_heads"] * cfg["mamba_d_head"]
    gn = groups * n

    def keep_group0(t: torch.Tensor, x_end: int) -> torch.Tensor:
        # rows [..x_end) stay, then B's first group, C's first group, then whatever follows C (dt)
        return torch.cat(
            [t[:x_end], t[x_end : x_end + n], t[x_end + gn : x_end + gn + n], t[x_end + 2 * gn :]]
        )

    path = dst / "model.safetensors"
    weights = load_file(str(path))
    for name, t in weights.items():
        if ".mamba.in_proj." in name:
            weights[name] = keep_group0(t, 2 * inner)
        elif ".mamba.conv1d." in name:
            weights[name] = keep_group0(t, inner)
    save_file(weights, str(path), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**cfg, "mamba_n_groups": 1}))
    return str(dst)
