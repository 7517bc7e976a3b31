"""sgl-kernel's whole-block decode ops (`sgl-kernel/csrc/decode_blocks_cpu.cpp`, `layers/decode_blocks.py`):
the engine with the blocks on decodes bit for bit as with them off (the same sgl-kernel ops and GEMMs
called one by one from Python) on both presets, pool states included, and the blocks did run; each block
is built only where all of its parts run their C++ ops and steps aside per batch where one would not
(an extend, too many tokens for the MoE op); bad input is refused with a message."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.decode_blocks import GdnBlock, Mamba2Block, MoEBlock
from sglang.srt.layers.moe.experts import CPU_OP_MAX_SHARED_TOKENS
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import greedy_tokens_and_logprobs, make_runner, pool_state

register_cpu_ci(est_time=12, suite="per-commit-cpu")

BLOCK_ATTRS = ("mixer_block", "moe_block", "fused")


def _blocks(runner) -> list:
    """Every decode block the runner's model built, in layer order."""
    found = []
    for module in runner.model.modules():
        found += [getattr(module, a) for a in BLOCK_ATTRS if getattr(module, a, None) is not None]
    return found


def _count_calls(blocks: list) -> dict[int, int]:
    """Counts each block's op calls (by block id) from now on."""
    calls = {id(b): 0 for b in blocks}
    for b in blocks:

        def counted(*args, _op=b.op, _key=id(b)):
            calls[_key] += 1
            return _op(*args)

        b.op = counted
    return calls


@pytest.mark.parametrize(
    "preset,kinds",
    [("tiny-qwen3-next", {GdnBlock: 3, MoEBlock: 4}), ("tiny-nemotron-h", {Mamba2Block: 3, MoEBlock: 1})],
)
def test_engine_decodes_bit_for_bit_with_and_without_blocks(ops, preset, kinds):
    """A 3-request extend of 180 tokens (over the MoE op's 128: the parts run), a 2-request extend of 14
    tokens (the MoE blocks run, the mixers' do not: an extend) and 8 greedy decode steps of each (every
    block runs): the same tokens, logprobs and pool states, exactly."""

    def run(on: bool):
        with envs.SGLANG_CPU_DECODE_BLOCKS.override(on):
            runner = make_runner(preset)
        blocks = _blocks(runner)
        calls = _count_calls(blocks)
        results = [greedy_tokens_and_logprobs(runner, lens, steps=8) for lens in ((7, 60, 113), (5, 9))]
        states = [pool_state(runner, slot) for slot in range(1, 6)]
        return blocks, calls, results, states

    blocks, calls, with_blocks, states_on = run(True)
    assert {k: sum(isinstance(b, k) for b in blocks) for k in kinds} == kinds
    # Mixers: 16 decode steps. MoE: those and the 14-token extend.
    for b in blocks:
        assert calls[id(b)] == (17 if isinstance(b, MoEBlock) else 16), type(b).__name__
    no_blocks, _, without, states_off = run(False)
    assert no_blocks == []
    for (tok_on, lp_on), (tok_off, lp_off) in zip(with_blocks, without, strict=True):
        assert tok_on == tok_off
        assert torch.equal(lp_on, lp_off)  # the same ops on the same tensors: no rounding may differ
    for on, off in zip(states_on, states_off, strict=True):
        for layer in on:
            assert torch.equal(on[layer].conv, off[layer].conv) and torch.equal(on[layer].ssm, off[layer].ssm)


@pytest.mark.parametrize(
    "env,mixers,moes",
    [
        (envs.SGLANG_CPU_NORM_BACKEND, False, False),
        (envs.SGLANG_CPU_MOE_BACKEND, True, False),
        (envs.SGLANG_CPU_LINEAR_ATTN_BACKEND, False, True),
    ],
)
def test_a_part_forced_to_torch_keeps_its_block_off(ops, env, mixers, moes):
    """A user forcing one part's torch path gets that part's torch ops: its blocks are not built."""
    with env.override("torch"):
        blocks = _blocks(make_runner("tiny-qwen3-next"))
    assert any(isinstance(b, GdnBlock) for b in blocks) == mixers
    assert any(isinstance(b, MoEBlock) for b in blocks) == moes


def test_bfloat16_models_build_no_blocks(ops):
    assert _blocks(make_runner("tiny-nemotron-h", dtype="bfloat16")) == []


def test_a_torch_decode_step_keeps_the_mixer_blocks_aside(ops):
    """SGLANG_GDN_DECODE_BACKEND=torch: the C++ gates still run (the block is built) but the decode step
    is torch's, so the block steps aside at every batch; the MoE blocks still run."""
    with envs.SGLANG_GDN_DECODE_BACKEND.override("torch"):
        runner = make_runner("tiny-qwen3-next")
    blocks = _blocks(runner)
    calls = _count_calls(blocks)
    greedy_tokens_and_logprobs(runner, (6, 11), steps=3)
    assert any(isinstance(b, GdnBlock) for b in blocks)
    for b in blocks:
        assert calls[id(b)] == (4 if isinstance(b, MoEBlock) else 0)


def test_moe_block_serves_up_to_the_ops_token_limit(ops):
    """At CPU_OP_MAX_SHARED_TOKENS tokens the block equals the layer's parts; one more and it steps aside."""
    runner = make_runner("tiny-qwen3-next")
    layer = runner.model.model.layers[0]
    torch.manual_seed(0)
    hidden = torch.randn(CPU_OP_MAX_SHARED_TOKENS + 1, layer.input_layernorm.weight.shape[0])
    assert layer.moe_block(hidden) is None
    rows = hidden[:CPU_OP_MAX_SHARED_TOKENS]
    with torch.inference_mode():
        want = rows + layer.mlp(layer.post_attention_layernorm(rows))
        assert torch.equal(layer.moe_block(rows), want)


def test_bad_hidden_is_refused(ops):
    runner = make_runner("tiny-qwen3-next")
    block = runner.model.model.layers[0].moe_block
    with pytest.raises(RuntimeError, match="hidden must be a contiguous float32"):
        block(torch.zeros(2, 64, dtype=torch.bfloat16))
