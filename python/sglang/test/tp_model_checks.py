"""The model side of tensor / expert parallelism, run on each rank by `sglang.test.multi_rank.run_ranks`
(importable by name, as spawn needs). One spawn checks many models: each case builds a `ModelRunner`
on the rank's part of the model and runs a chunked prefill and greedy decode steps.

`run_cases(rank, world_size, init_method, cases)` -> per case a dict: the request's tokens (prompt,
sampled) and their logprobs, the MambaPool's conv / SSM shapes, the KV pool's heads, and the full tensors
`get_weights_by_name` gathers for a few sharded parameters. `run_cases(0, 1, None, cases)` is TP 1, in
process."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.srt import distributed as ps

# Parameters whose gathered values are compared with TP 1's: split by heads (attention, GDN), by q | k | v
# sub-blocks (conv), by value heads, row-parallel, the vocabulary, stacked experts.
GATHERED = (
    "model.layers.0.linear_attn.in_proj_qkvz.weight",
    "model.layers.0.linear_attn.in_proj_ba.weight",
    "model.layers.0.linear_attn.conv1d.weight",
    "model.layers.0.linear_attn.A_log",
    "model.layers.0.linear_attn.out_proj.weight",
    "model.layers.3.self_attn.q_proj.weight",
    "model.layers.3.self_attn.k_proj.weight",
    "model.layers.3.self_attn.o_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
)


@dataclass(frozen=True)
class Case:
    preset: str
    tp: int
    ep: int = 1
    prompt_len: int = 150
    cuts: tuple[int, ...] = (64,)
    steps: int = 6
    server_args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # set while the model loads and runs
    # Checkpoint names to update in place after the decode (`_update`).
    update: tuple[str, ...] = ()


def _one_case(case: Case) -> dict[str, Any]:
    from sglang.test.model_checks import make_runner

    ps.initialize_model_parallel(case.tp, case.ep)
    os.environ.update(case.env)
    try:
        return _run(case, make_runner(case.preset, **{"dtype": "float32", **case.server_args}))
    finally:
        for key in case.env:
            os.environ.pop(key, None)


def _run(case: Case, runner) -> dict[str, Any]:
    from sglang.test.model_checks import decode_steps, prefill, random_ids
    from sglang.test.runner_driver import RunnerDriver

    driver = RunnerDriver(runner)
    req = driver.new_request()
    prompt = random_ids(case.prompt_len, seed=11)
    lps = prefill(driver, req, prompt, cuts=case.cuts)
    lps += decode_steps(driver, [req], case.steps)[0]
    params = dict(runner.model.named_parameters())
    gathered = {n: runner.get_weights_by_name(n, 10**6) for n in GATHERED if n in params}
    pool = runner.mamba_pool
    ids = list(req.token_ids) + [req.next_token]
    updated = _update(runner, driver, req, case.update) if case.update else {}
    experts = params.get("model.layers.0.mlp.experts.w13")
    mtp = None
    if runner.draft_model is not None:  # (NEXTN: `tp_mtp_checks`)
        from sglang.test.tp_mtp_checks import mtp_draft_check

        mtp = mtp_draft_check(runner)
    return {
        "mtp": mtp,
        "w13": tuple(experts.shape) if experts is not None else None,
        "updated": updated,
        "ids": ids,
        "prompt_len": len(prompt),
        "logprobs": lps,
        "conv": tuple(pool.conv_state.shape),
        "ssm": tuple(pool.ssm_state.shape),
        "kv_heads": runner.token_to_kv_pool.k_buffer[0].shape[1],
        "gathered": gathered,
    }


def _update(runner, driver, req, names: tuple[str, ...]) -> dict[str, Any]:
    """`update_weights_from_tensor` with whole, seeded random tensors for the checkpoint names `names`
    (each rank takes its part), then the updated parameters gathered whole and 3 more decode steps'
    logprobs."""
    from sglang.srt.layers.linear import full_shape
    from sglang.test.model_checks import decode_steps

    params = dict(runner.model.named_parameters())
    gen = torch.Generator().manual_seed(5)
    tensors = []
    for name in names:
        target = runner.model.checkpoint_name(name)
        shape = full_shape(params[target]) if target in params else _expert_shape(runner, name)
        tensors.append((name, 0.05 * torch.randn(shape, generator=gen)))
    assert runner.update_weights_from_tensor(tensors) == []
    # load_format "direct": this model's names and layout, whole (what get_weights_by_name gives back).
    direct = "model.layers.3.self_attn.q_proj.weight"
    tensors.append((direct, 0.05 * torch.randn(full_shape(params[direct]), generator=gen)))
    assert runner.update_weights_from_tensor(tensors[-1:], load_format="direct") == []
    gathered = {n: runner.get_weights_by_name(n, 10**6) for n, _ in tensors if n in params}
    return {"gathered": gathered, "logprobs": decode_steps(driver, [req], 3)[0]}


def _expert_shape(runner, name: str) -> tuple[int, int]:
    """One expert's checkpoint weight shape (`...experts.E.{gate,up,down}_proj.weight`)."""
    module = runner.model.get_submodule(name.split(".experts.")[0] + ".experts")
    inter, hidden = module.inter_shard.pieces[0], module.w13.shape[2]
    return (hidden, inter) if ".down_proj." in name else (inter, hidden)


def run_cases(
    rank: int, world_size: int, init_method: str | None, cases: list[Case], keep: bool = False
) -> list[dict[str, Any]]:
    """Each case's results; `keep`: leave the groups up (the caller destroys them)."""
    if world_size > 1:
        ps.init_distributed_environment("gloo", world_size, rank, init_method)
    try:
        return [_one_case(c) for c in cases]
    finally:
        if not keep:
            ps.destroy_model_parallel()


def fp8_refusal(preset: str = "tiny-qwen3.5-fp8", linears: bool = True) -> str:
    """The refusal of the CUDA FP8 layout (FP8 linears, or with `linears` False FP8 experts) for a
    checkpoint whose shards are not whole 128-blocks (the tiny presets' hidden size 64, experts' 32), at
    this process's TP / EP sizes; "" if it builds."""
    from sglang.srt.configs.model_config import load_hf_config
    from sglang.srt.configs.presets import resolve_model_path
    from sglang.srt.layers.quantization.fp8 import Fp8Layout
    from sglang.srt.models.registry import build_meta_model

    config = load_hf_config(resolve_model_path(preset))
    try:
        build_meta_model(config, "cpu", Fp8Layout(linears=linears, experts=not linears))
    except ValueError as e:
        return str(e)
    return ""


def run_session(rank: int, world_size: int, init_method: str, cases: list[Case]) -> dict[str, Any]:
    """`run_cases`, then `fp8_refusal` at the last case's sizes, in one spawn."""
    out = {"cases": run_cases(rank, world_size, init_method, cases, keep=True)}
    try:
        ps.initialize_model_parallel(world_size, 1)
        out["fp8"] = fp8_refusal()
        out["fp8_experts"] = fp8_refusal("tiny-qwen3.5-moe-fp8", linears=False)
        from sglang.srt.model_executor.model_runner import _collectives_capturable

        out["graphs"] = _collectives_capturable()
    finally:
        ps.destroy_model_parallel()
    return out


def count_decode_collectives(
    rank: int, world_size: int, init_method: str, preset: str, batch: int, ep: int = 1
) -> dict[str, list[int]]:
    """The tensors one decode step of `batch` requests sends through the TP group, counted at the group's
    all_reduce / all_gather: per kind, each call's bytes (the tensor this rank puts in)."""
    from sglang.test.model_checks import make_runner, random_ids
    from sglang.test.runner_driver import Extend, RunnerDriver

    ps.init_distributed_environment("gloo", world_size, rank, init_method)
    ps.initialize_model_parallel(world_size, ep)
    try:
        runner = make_runner(preset, dtype="float32")
        driver = RunnerDriver(runner)
        reqs = [driver.new_request() for _ in range(batch)]
        driver.extend([Extend(r, random_ids(20 + i, seed=i)) for i, r in enumerate(reqs)])
        group = ps.get_tp_group()
        seen: dict[str, list[int]] = {"all_reduce": [], "all_gather": []}
        for kind in seen:
            real = getattr(group, kind)

            def counted(x, *args, _real=real, _kind=kind, **kw):
                seen[_kind].append(x.numel() * x.element_size())
                return _real(x, *args, **kw)

            setattr(group, kind, counted)
        driver.decode(reqs)
        return seen
    finally:
        ps.destroy_model_parallel()


def run_prefix_cases(
    rank: int, world_size: int, init_method: str | None, cases: list[Case]
) -> list[dict[str, Any]]:
    """Per case: a donor prefilled in chunks with a snapshot at 64 tokens, a second request starting from
    that snapshot (the deferred COW) with a prefix hit on the donor's KV, then batched decode steps of
    both. Returns each request's tokens (prompt, sampled) and logprobs, and the pools' shapes."""
    from sglang.test.model_checks import decode_steps, make_runner, random_ids
    from sglang.test.runner_driver import Extend, RunnerDriver

    if world_size > 1:
        ps.init_distributed_environment("gloo", world_size, rank, init_method)
    out = []
    try:
        for case in cases:
            ps.initialize_model_parallel(case.tp, case.ep)
            # extra_buffer: the donor holds a track slot for the snapshot (lazy holds none until a boundary).
            args = {"dtype": "float32", "mamba_scheduler_strategy": "extra_buffer", **case.server_args}
            driver = RunnerDriver(make_runner(case.preset, **args))
            prompt = random_ids(case.prompt_len, seed=21)
            donor, fresh = driver.new_request(), driver.new_request()
            lps = {}
            first = driver.extend([Extend(donor, prompt[:64], track_seqlen=64, next_token=prompt[64])])
            rest = driver.extend([Extend(donor, prompt[64:])])
            lps[0] = (
                first.input_token_logprobs[0]
                + rest.input_token_logprobs[0]
                + [float(rest.next_token_logprobs[0])]
            )
            hit = driver.extend(
                [Extend(fresh, prompt[64:100], prefix_from=(donor, 64), cow_src=donor.track_slot)]
            )
            lps[1] = hit.input_token_logprobs[0] + [float(hit.next_token_logprobs[0])]
            for i, steps in enumerate(decode_steps(driver, [donor, fresh], case.steps)):
                lps[i] += steps
            pool = driver.runner.mamba_pool
            out.append(
                {
                    "ids": [list(r.token_ids) + [r.next_token] for r in (donor, fresh)],
                    "logprobs": [lps[0], lps[1]],
                    "conv": tuple(pool.conv_state.shape),
                    "ssm": tuple(pool.ssm_state.shape),
                }
            )
        return out
    finally:
        ps.destroy_model_parallel()
