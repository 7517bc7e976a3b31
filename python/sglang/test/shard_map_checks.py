"""What a TP rank's pools really hold after a prefill, for the shard map's check against the model
(`test_shard_map_model*.py`): run on each rank by `sglang.test.multi_rank.run_ranks`, or at TP 1 in the
test's process. Per preset, the request's rows of the first linear layer's conv and SSM state and of the
first full-attention layer's K and V, and the rank's `ShardLayout` (which global units those rows are)."""

from __future__ import annotations

from typing import Any

import torch

from sglang.srt import distributed as ps

PROMPT_LEN, PROMPT_SEED = 40, 3


def first_layer_rows(
    rank: int, world_size: int, init_method: str | None, paths: dict[str, str]
) -> dict[str, Any]:
    """Per (name -> checkpoint folder), this rank's rows and layout, as plain lists."""
    if world_size > 1:
        ps.init_distributed_environment("gloo", world_size, rank, init_method)
        ps.initialize_model_parallel(world_size, 1)
    try:
        return {name: _rows(path, world_size, rank) for name, path in paths.items()}
    finally:
        if world_size > 1:
            ps.destroy_model_parallel()


def _rows(path: str, tp_size: int, tp_rank: int) -> dict[str, Any]:
    from sglang.srt.disaggregation.shard_map import pools_layout
    from sglang.test.model_checks import make_runner, prefill, random_ids
    from sglang.test.runner_driver import RunnerDriver

    runner = make_runner(
        path, dtype="float32", max_mamba_cache_size=8, max_total_tokens=1024, max_running_requests=4
    )
    driver = RunnerDriver(runner)
    req = driver.new_request()
    prefill(driver, req, random_ids(PROMPT_LEN, seed=PROMPT_SEED))
    kv, state, slot = runner.token_to_kv_pool, runner.mamba_pool, req.mamba_pool_idx
    layout = pools_layout(runner.arch, kv, state, tp_size, tp_rank)
    return {
        "layout": layout.to_dict(),
        "conv": state.conv_state[0, slot].tolist(),  # [channels, K-1]
        "ssm": state.ssm_state[0, slot].tolist(),  # [heads, head_dim, state]
        "k": kv.k_buffer[0][req.kv_slots].tolist(),  # [tokens, heads, head_dim]
        "v": kv.v_buffer[0][req.kv_slots].tolist(),
    }


# Row kind -> (layout axis, the dimension of the rows that holds the units).
ROWS = {"conv": ("conv", 0), "ssm": ("ssm", 0), "k": ("kv", 1), "v": ("kv", 1)}


def cut(whole: list, layout: dict, kind: str) -> torch.Tensor:
    """TP 1's rows of `kind` at the units a rank's layout (`ShardLayout.to_dict`) names, in its order."""
    axis, dim = ROWS[kind]
    units = torch.cat([torch.arange(a, a + n) for a, n in layout[axis]["runs"]])
    return torch.tensor(whole).index_select(dim, units)


def distance(got: list, want: torch.Tensor) -> float:
    """max |got - want| over the rows' largest value (1.0 where they are all zero)."""
    scale = want.abs().max().item() or 1.0
    return (torch.tensor(got) - want).abs().max().item() / scale


# Relative to the rows' largest value, float32. The first linear layer's input is the embeddings' norm
# at every TP size and its projections are column-parallel (no sum across ranks): its conv and SSM rows
# came out bit-equal (0.0). The first full-attention layer's input passed the earlier layers'
# all-reduces, whose order differs from TP 1's sums: measured at most 1.3e-6 (Qwen3.5's K). The rows at
# another rank's units (other heads, channels or groups) differ by more than half the largest value.
TOL = 1e-4
WRONG = 0.1


def check_ranks(tp1: dict, ranks: list[dict], name: str) -> None:
    """Each rank's rows are TP 1's at its layout's units; at the units of a rank holding other ones they
    are not (so the comparison tells units apart)."""
    for r, got in enumerate(ranks):
        got = got[name]
        for kind, (axis, _) in ROWS.items():
            err = distance(got[kind], cut(tp1[name][kind], got["layout"], kind))
            assert err < TOL, (name, r, kind, err)
            for other in ranks:
                layout = other[name]["layout"]
                if layout[axis] != got["layout"][axis]:
                    assert distance(got[kind], cut(tp1[name][kind], layout, kind)) > WRONG, (name, r, kind)
