"""The Triton Gated DeltaNet decode kernel (in place on the pool, q/k prep and gates fused) against its
torch twin (the backend's `_split_heads` and `gdn_gates`, then `recurrent_gated_delta_rule_step`), under
TRITON_INTERPRET=1 on tiny shapes, and compiled for sm_90."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention.linear.gated_delta_rule import recurrent_gated_delta_rule_step
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend, gdn_gates
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")



def _layer(hk: int, hv: int, kd: int, vd: int, seed: int, dtype=torch.float32) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        num_k_heads=hk, num_v_heads=hv, head_k_dim=kd, head_v_dim=vd, cpu_ops=None,
        A_log=torch.randn(hv, generator=g).to(dtype), dt_bias=torch.randn(hv, generator=g).to(dtype),
    )  # fmt: skip


def _inputs(bs: int, layer: SimpleNamespace, seed: int, gate_dtype=torch.float32, device="cpu"):
    """The conv output x [bs, q | k | v] and the raw gate projections a, b as strided columns of one
    [bs, 2 * Hv] tensor (how the grouped projection hands them over); a spans softplus' threshold."""
    g = torch.Generator().manual_seed(seed)
    channels = 2 * layer.num_k_heads * layer.head_k_dim + layer.num_v_heads * layer.head_v_dim
    x = torch.randn(bs, channels, generator=g).to(device)
    ba = (torch.randn(bs, 2 * layer.num_v_heads, generator=g) * 12).to(device, gate_dtype)
    return x, ba[:, layer.num_v_heads :], ba[:, : layer.num_v_heads]


def _twin(x, a, b, layer, state):
    q, k, v = GDNAttnBackend._split_heads(layer, x)
    g, beta = gdn_gates(layer, a, b)
    return recurrent_gated_delta_rule_step(q, k, v, g, beta, state)


@pytest.mark.parametrize(
    "hk,hv,kd,vd,dtype",
    [
        (2, 2, 16, 8, torch.float32),  # one value block per head
        (1, 3, 12, 40, torch.float32),  # dims that are not powers of two, three value heads per key head
        (2, 4, 64, 128, torch.float32),  # several value blocks per head (BV < V)
        (2, 2, 16, 8, torch.bfloat16),  # a bfloat16 pool and gates: read, update in float32, store rounded
    ],
)
@pytest.mark.parametrize("fused_out", [False, True], ids=["out-from-updated", "out-from-decayed"])
def test_matches_the_torch_step_in_place(kernel_device, hk, hv, kd, vd, dtype, fused_out, monkeypatch):
    """Both forms of the output (`FUSED_OUT`: from the updated tile, or from the decayed one plus
    delta (k . q)) against the twin."""
    from sglang.srt.layers.attention.linear import gdn_decode_triton
    from sglang.srt.layers.attention.linear.gdn_decode_triton import block_v, gdn_decode_inplace

    monkeypatch.setattr(gdn_decode_triton, "FUSED_OUT", fused_out)

    dev = kernel_device
    num_slots, slots = 12, [7, 2, 11, 0, 5]  # out of order; a padded row on the dummy slot 0
    pool = torch.randn(num_slots, hv, vd, kd, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
    before = pool.clone()
    layer = _layer(hk, hv, kd, vd, seed=hk + kd, dtype=dtype)
    layer.A_log, layer.dt_bias = layer.A_log.to(dev), layer.dt_bias.to(dev)
    x, a, b = _inputs(len(slots), layer, seed=hv + vd, gate_dtype=dtype, device=dev)
    assert not a.is_contiguous()
    idx = torch.tensor(slots, device=dev)
    want_out, want_state = _twin(x, a, b, layer, pool[idx])
    out = gdn_decode_inplace(x, a, b, layer.A_log, layer.dt_bias, pool, idx, hk, kd)
    # float32: the same sums in another order (~1e-6 relative); bfloat16 states: both round the
    # float32 update to bfloat16 once when stored, so they agree to one bfloat16 ulp (2^-8 relative).
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(pool[idx].float(), want_state.to(dtype).float(), **tol)
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched]), "a slot outside the batch was written"
    if vd > block_v(vd, kd):
        assert vd // block_v(vd, kd) > 1  # the case really splits value rows over programs


def test_a_wrong_key_head_changes_the_result(interpret):
    """The control: value heads read their own key head; pairing them with the other one is visibly
    different, so the comparison above can fail."""
    from sglang.srt.layers.attention.linear.gdn_decode_triton import gdn_decode_inplace

    layer = _layer(2, 4, 16, 8, seed=3)
    x, a, b = _inputs(2, layer, seed=4)
    pool = torch.zeros(3, 4, 8, 16)
    out = gdn_decode_inplace(x, a, b, layer.A_log, layer.dt_bias, pool, torch.tensor([1, 2]), 2, 16)
    swapped = torch.cat([x[:, 16:32], x[:, :16], x[:, 48:64], x[:, 32:48], x[:, 64:]], dim=1)
    want, _ = _twin(swapped, a, b, layer, torch.zeros(2, 4, 8, 16))
    assert (out - want).abs().max() > 1e-2


def test_empty_batch_launches_nothing(interpret):
    from sglang.srt.layers.attention.linear.gdn_decode_triton import gdn_decode_inplace

    layer = _layer(2, 2, 16, 8, seed=0)
    x, a, b = _inputs(0, layer, seed=0)
    out = gdn_decode_inplace(x, a, b, layer.A_log, layer.dt_bias, torch.zeros(3, 2, 8, 16), torch.empty(0, dtype=torch.int64), 2, 16)
    assert out.shape == (0, 2, 8)


@pytest.mark.parametrize("fused_out", [False, True])
@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_compiles_for_sm90(state, fused_out):
    """Qwen3-Next-80B shapes (16 key heads, 32 value heads, K = V = 128; bfloat16 gates): the kernel
    compiles for an H100 from this CPU machine, without spilling to local memory."""
    from sglang.srt.layers.attention.linear import gdn_decode_triton as mod
    from sglang.test.sm90 import compile_sm90_in_registers

    signature = {
        "x_ptr": "*fp32", "a_ptr": "*bf16", "b_ptr": "*bf16", "a_log_ptr": "*bf16", "dt_bias_ptr": "*bf16",
        "state_ptr": f"*{state}", "slot_ptr": "*i64", "src_ptr": "*i64", "out_ptr": "*fp32",
        **{name: "i64" for name in ("x_stride", "ab_stride", "slot_stride")},
        **{name: "constexpr" for name in ("NUM_HEADS", "KEY_HEADS", "K", "V", "BK", "BV", "FUSED_OUT")},
    }  # fmt: skip
    constexprs = {"NUM_HEADS": 32, "KEY_HEADS": 16, "K": 128, "V": 128, "BK": 128, "BV": mod.block_v(128, 128),
                  "FUSED_OUT": fused_out}  # fmt: skip
    compile_sm90_in_registers(mod._gdn_decode_kernel, signature, constexprs, num_warps=mod.NUM_WARPS)


def test_engine_decodes_through_the_kernel_as_through_the_torch_step(interpret):
    """tiny-qwen3-next, prefill then 6 greedy decode steps of 3 requests (one with a track copy), once
    with the kernel forced (SGLANG_GDN_DECODE_BACKEND=triton, interpreted) and once with the torch step."""
    from sglang.srt.environ import envs
    from sglang.test.model_checks import make_runner, random_ids
    from sglang.test.runner_driver import Extend, RunnerDriver

    runs = []
    for backend in ("triton", "torch"):
        # The C++ CPU ops off, so that the extend's conv is the Triton one too.
        with (
            envs.SGLANG_GDN_DECODE_BACKEND.override(backend),
            envs.SGLANG_CPU_LINEAR_ATTN_BACKEND.override("torch"),
        ):
            runner = make_runner("tiny-qwen3-next", mamba_scheduler_strategy="extra_buffer")
        assert runner.attn_backend.linear_attn_backend.decode_in_place == (backend == "triton")
        driver = RunnerDriver(runner)
        reqs = [driver.new_request() for _ in range(3)]
        driver.extend([Extend(r, random_ids(20 + 7 * i, seed=i)) for i, r in enumerate(reqs)])
        tokens, logprobs = [], []
        for step in range(6):
            track = {reqs[0]: reqs[0].track_slot} if step == 3 else None
            res = driver.decode(reqs, track=track)
            tokens.append(res.next_token_ids.tolist())
            logprobs += res.next_token_logprobs.tolist()
        runs.append((tokens, logprobs, runner.mamba_pool.ssm_state[:, reqs[0].track_slot].clone()))
    (tok_a, lp_a, snap_a), (tok_b, lp_b, snap_b) = runs
    assert tok_a == tok_b
    # The same float32 math summed in another order: ~1e-6 relative per step, amplified a little by
    # the tiny net over 6 steps; a wrong state update moves logprobs by O(1).
    torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(snap_a, snap_b, rtol=1e-4, atol=1e-4)


def test_the_step_reads_src_slots_and_writes_the_slots(interpret):
    """A speculative verify's positions (`src_slots`): each row's state is read from its source slot,
    which stays as it was, and the updated state goes to its own slot: the twin's state and output."""
    from sglang.srt.layers.attention.linear.gdn_decode_triton import gdn_decode_inplace

    layer = _layer(2, 4, 16, 8, seed=6)
    x, a, b = _inputs(3, layer, seed=7)
    pool = torch.randn(12, 4, 8, 16, generator=torch.Generator().manual_seed(8))
    before = pool.clone()
    src, dst = torch.tensor([3, 9, 4]), torch.tensor([10, 2, 6])
    want_out, want_state = _twin(x, a, b, layer, pool[src])
    out = gdn_decode_inplace(x, a, b, layer.A_log, layer.dt_bias, pool, dst, 2, 16, src_slots=src)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[dst], want_state, rtol=1e-5, atol=1e-5)
    rest = [s for s in range(12) if s not in dst.tolist()]
    assert torch.equal(pool[rest], before[rest]), "the sources or another slot were written"
