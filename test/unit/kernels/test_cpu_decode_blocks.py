"""sgl-kernel's whole-block decode ops (`sgl-kernel/csrc/decode_blocks_cpu.cpp`, `layers/decode_blocks.py`):
the engine with the blocks on decodes bit for bit as with them off (the same sgl-kernel ops and GEMMs
called one by one from Python) on both presets, pool states included, and the blocks did run; each block
is built only where all of its parts run their C++ ops and steps aside per batch where one would not
(an extend, too many tokens for the MoE op, a torch decode step, a float8 KV pool); bad input is refused
with a message."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.decode_blocks import (
    AttentionBlock,
    GdnBlock,
    Mamba2Block,
    MLPBlock,
    MoEBlock,
    built_blocks,
)
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.layers.moe.experts import CPU_OP_MAX_SHARED_TOKENS
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import greedy_tokens_and_logprobs, make_runner, pool_state

register_cpu_ci(est_time=12, suite="per-commit-cpu")

def _blocks(runner) -> list:
    """Every decode block the runner's model built, in layer order."""
    return [block for _, _, block in built_blocks(runner.model)]


def _count_calls(blocks: list) -> dict[int, int]:
    """Counts each block's op calls (by block id) from now on."""
    calls = {id(b): 0 for b in blocks}
    for b in blocks:

        def counted(*args, _op=b.op, _key=id(b)):
            calls[_key] += 1
            return _op(*args)

        b.op = counted
    return calls


QWEN_BLOCKS = {GdnBlock: 3, AttentionBlock: 1, MoEBlock: 4}
NEMOTRON_BLOCKS = {Mamba2Block: 3, AttentionBlock: 1, MoEBlock: 1, MLPBlock: 1}


@pytest.mark.parametrize(
    "preset,kinds,page_size",
    [("tiny-qwen3-next", QWEN_BLOCKS, 1), ("tiny-nemotron-h", NEMOTRON_BLOCKS, 1), ("tiny-qwen3-next", QWEN_BLOCKS, 16)],
)
def test_engine_decodes_bit_for_bit_with_and_without_blocks(ops, preset, kinds, page_size):
    """A 3-request extend of 180 tokens (over the MoE op's 128: the parts run; the dense MLP block runs at
    any size), a 2-request extend of 14 tokens (the MoE blocks run, the mixers' and attention's do not:
    an extend) and 8 greedy decode steps of each (every block runs): the same tokens, logprobs and pool
    states (recurrent and KV), exactly."""

    def run(on: bool):
        with envs.SGLANG_CPU_DECODE_BLOCKS.override(on):
            runner = make_runner(preset, page_size=page_size)
        blocks = _blocks(runner)
        calls = _count_calls(blocks)
        results = [greedy_tokens_and_logprobs(runner, lens, steps=8) for lens in ((7, 60, 113), (5, 9))]
        states = [pool_state(runner, slot) for slot in range(1, 6)]
        kv = runner.token_to_kv_pool
        return blocks, calls, results, (states, kv.k_buffer, kv.v_buffer)

    blocks, calls, with_blocks, states_on = run(True)
    assert {k: sum(isinstance(b, k) for b in blocks) for k in kinds} == kinds
    # Mixers and attention: 16 decode steps. MoE: those and the 14-token extend. Dense MLP: every forward.
    runs = {GdnBlock: 16, Mamba2Block: 16, AttentionBlock: 16, MoEBlock: 17, MLPBlock: 18}
    for b in blocks:
        assert calls[id(b)] == runs[type(b)], type(b).__name__
    no_blocks, _, without, states_off = run(False)
    assert no_blocks == []
    for (tok_on, lp_on), (tok_off, lp_off) in zip(with_blocks, without, strict=True):
        assert tok_on == tok_off
        assert torch.equal(lp_on, lp_off)  # the same ops on the same tensors: no rounding may differ
    for k_on, k_off in zip(states_on[1] + states_on[2], states_off[1] + states_off[2], strict=True):
        assert torch.equal(k_on, k_off)
    for on, off in zip(states_on[0], states_off[0], strict=True):
        for layer in on:
            assert torch.equal(on[layer].conv, off[layer].conv) and torch.equal(on[layer].ssm, off[layer].ssm)


@pytest.mark.parametrize(
    "env,built",
    [
        (envs.SGLANG_CPU_NORM_BACKEND, {}),
        (envs.SGLANG_CPU_MOE_BACKEND, {GdnBlock: 3, AttentionBlock: 1}),
        (envs.SGLANG_CPU_LINEAR_ATTN_BACKEND, {AttentionBlock: 1, MoEBlock: 4}),
        (envs.SGLANG_CPU_ROPE_BACKEND, {GdnBlock: 3, MoEBlock: 4}),
    ],
)
def test_a_part_forced_to_torch_keeps_its_block_off(ops, env, built):
    """A user forcing one part's torch path gets that part's torch ops: its blocks are not built."""
    with env.override("torch"):
        blocks = _blocks(make_runner("tiny-qwen3-next"))
    assert {k: sum(isinstance(b, k) for b in blocks) for k in built} == built
    assert len(blocks) == sum(built.values())


def test_bfloat16_models_build_no_blocks(ops):
    assert _blocks(make_runner("tiny-nemotron-h", dtype="bfloat16")) == []


@pytest.mark.parametrize(
    "env,value,aside",
    [(envs.SGLANG_GDN_DECODE_BACKEND, "torch", GdnBlock), (envs.SGLANG_CPU_ATTN_BACKEND, "torch", AttentionBlock)],
)
def test_a_torch_decode_step_keeps_its_block_aside(ops, env, value, aside):
    """SGLANG_GDN_DECODE_BACKEND=torch: the C++ gates still run (the block is built) but the decode step
    is torch's; SGLANG_CPU_ATTN_BACKEND=torch: SDPA attends. That block steps aside at every batch, the
    others still run."""
    with env.override(value):
        runner = make_runner("tiny-qwen3-next")
    blocks = _blocks(runner)
    calls = _count_calls(blocks)
    greedy_tokens_and_logprobs(runner, (6, 11), steps=3)
    assert any(isinstance(b, aside) for b in blocks)
    for b in blocks:
        assert calls[id(b)] == (0 if isinstance(b, aside) else 4 if isinstance(b, MoEBlock) else 3)


@pytest.mark.parametrize(
    "server_args,interpret",
    [(dict(kv_cache_dtype="fp8_e4m3"), False), (dict(attention_backend="triton"), True)],
)
def test_attention_blocks_step_aside_for_what_they_do_not_do(ops, monkeypatch, server_args, interpret):
    """A float8 pool (written through a byte view) and `--attention-backend triton` (its own kernels, here
    interpreted): the parts store and attend, the other blocks still run, and the decode is the one
    without blocks, exactly."""
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")

    def run(on: bool):
        with envs.SGLANG_CPU_DECODE_BLOCKS.override(on):
            runner = make_runner("tiny-nemotron-h", **server_args)
        blocks = _blocks(runner)
        calls = _count_calls(blocks)
        return blocks, calls, greedy_tokens_and_logprobs(runner, (6, 11), steps=3)

    blocks, calls, (tokens, logprobs) = run(True)
    assert any(isinstance(b, AttentionBlock) for b in blocks)
    assert all(calls[id(b)] == 0 for b in blocks if isinstance(b, AttentionBlock))
    assert any(calls[id(b)] == 3 for b in blocks if isinstance(b, Mamba2Block))
    _, _, (tokens_off, logprobs_off) = run(False)
    assert tokens == tokens_off and torch.equal(logprobs, logprobs_off)


@pytest.mark.parametrize(
    "env,built",
    [(envs.SGLANG_GPU_NORM_BACKEND, {}), (envs.SGLANG_GPU_MOE_BACKEND, {GdnBlock: 3, AttentionBlock: 1})],
)
def test_a_part_on_its_triton_kernel_keeps_its_block_off(ops, monkeypatch, env, built):
    """The modules check their Triton choice first (on CPU under the interpreter, as the CUDA-path tests
    run them): a block would run the C++ op instead, so it is not built."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with env.override("triton"):
        blocks = _blocks(make_runner("tiny-qwen3-next"))
    assert {k: sum(isinstance(b, k) for b in blocks) for k in built} == built
    assert len(blocks) == sum(built.values())


def test_a_gated_mlp_block_equals_its_parts(ops):
    """Qwen3-Next's dense layers (none in the tiny preset): a silu GatedMLP with the offset norm."""
    torch.manual_seed(0)
    norm, mlp = RMSNorm(64, offset_one=True), GatedMLP(64, 96, "silu")
    torch.nn.init.normal_(norm.weight, std=0.1)
    norm.process_weights_after_loading()
    block = MLPBlock.build(norm, mlp)
    assert block is not None
    hidden = torch.randn(5, 64)
    with torch.inference_mode():
        assert torch.equal(block(hidden), hidden + mlp(norm(hidden)))


def test_moe_block_serves_up_to_the_ops_token_limit(ops):
    """At CPU_OP_MAX_SHARED_TOKENS tokens the block equals the layer's parts; one more and it steps aside."""
    runner = make_runner("tiny-qwen3-next")
    layer = runner.model.model.layers[0]
    torch.manual_seed(0)
    hidden = torch.randn(CPU_OP_MAX_SHARED_TOKENS + 1, layer.input_layernorm.weight.shape[0])
    assert layer.mlp_block(hidden) is None
    rows = hidden[:CPU_OP_MAX_SHARED_TOKENS]
    with torch.inference_mode():
        want = rows + layer.mlp(layer.post_attention_layernorm(rows))
        assert torch.equal(layer.mlp_block(rows), want)


def test_bad_hidden_is_refused(ops):
    runner = make_runner("tiny-qwen3-next")
    block = runner.model.model.layers[0].mlp_block
    with pytest.raises(RuntimeError, match="hidden must be a contiguous float32"):
        block(torch.zeros(2, 64, dtype=torch.bfloat16))


def test_blocks_refuse_weights_of_other_shapes(ops):
    """The ops check what the Python side cannot have checked for them: a message, not a wrong read."""
    runner = make_runner("tiny-qwen3-next")
    layer = runner.model.model.layers[0]
    block = layer.mixer_block
    head = list(block.head)
    head[3] = head[3][:-1]  # w_qkvz one row short
    conv, ssm = runner.mamba_pool.layer_cache(0)
    slots = torch.ones(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="w_qkvz must have"):
        block.op(torch.zeros(2, 64), *head, conv, block.conv_weight, ssm, slots, *block.tail)
    with pytest.raises(RuntimeError, match="unknown activation code"):
        ops.mlp_block_decode(torch.zeros(2, 64), *_norm_and_mlp_args(layer), 9)


def _norm_and_mlp_args(layer) -> tuple:
    """A Qwen3-Next layer's post-attention norm and shared expert as mlp_block_decode's arguments."""
    norm, mlp = layer.post_attention_layernorm, layer.mlp.shared_expert
    return (norm.weight, norm.eps, 1.0, mlp.gate_proj.weight, None, mlp.up_proj.weight, None, mlp.down_proj.weight, None)
