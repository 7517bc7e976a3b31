"""The Triton decode kernels of `layers/attention/mamba/decode_triton.py` (conv update, Mamba2 state
update; in place on the pool) against their torch twins under TRITON_INTERPRET=1 on tiny shapes, through
the engine, and compiled for sm_90 at Nemotron-H / Qwen3-Next-80B shapes."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.attention.mamba.causal_conv1d import causal_conv1d_update
from sglang.srt.layers.attention.mamba.ssd import selective_state_update
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

SLOTS = [7, 2, 11, 0, 5]  # out of order; a padded row on the dummy slot 0
NUM_SLOTS = 12
# float32: the same sums in another order (~1e-6 relative); bfloat16 pools: both sides round the float32
# result to bfloat16 once when stored, so they agree to one bfloat16 ulp (2^-8 relative).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}



def _untouched(before: torch.Tensor, after: torch.Tensor) -> None:
    rest = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(after[rest], before[rest]), "a slot outside the batch was written"


@pytest.mark.parametrize(
    "channels,width,bias,dtype",
    [
        (24, 4, True, torch.float32),  # one channel block, not a power of two
        (600, 4, False, torch.float32),  # two channel blocks (512 + a masked one)
        (40, 3, True, torch.float32),  # a conv of width 3: two state columns
        (24, 4, True, torch.bfloat16),  # a bfloat16 pool: the new input is stored rounded
    ],
)
def test_conv_update_matches_torch_in_place(interpret, channels, width, bias, dtype):
    from sglang.srt.layers.attention.mamba.decode_triton import causal_conv1d_update_inplace, conv_block

    g = torch.Generator().manual_seed(channels + width)
    pool = torch.randn(NUM_SLOTS, channels, width - 1, generator=g).to(dtype)
    before = pool.clone()
    # x a column slice of a wider product (Qwen3-Next's mixed q|k|v beside z): rows read in place.
    x = torch.randn(len(SLOTS), channels + 5, generator=g)[:, 2 : 2 + channels]
    assert not x.is_contiguous()
    weight = torch.randn(channels, width, generator=g)
    b = torch.randn(channels, generator=g) if bias else None
    idx = torch.tensor(SLOTS)
    # The dummy slot 0 is written by its padded row only; compare the real rows.
    real = [i for i, s in enumerate(SLOTS) if s != 0]
    want_out, want_state = causal_conv1d_update(x, pool[idx], weight, b)
    out = causal_conv1d_update_inplace(x, pool, idx, weight, b)
    torch.testing.assert_close(out[real], want_out[real], **TOL[torch.float32])
    torch.testing.assert_close(pool[idx][real].float(), want_state[real].float(), **TOL[dtype])
    _untouched(before, pool)
    if channels == 600:
        assert conv_block(channels, width - 1) < channels  # the case really splits channels


@pytest.mark.parametrize(
    "heads,head_dim,groups,n,dtype",
    [
        (4, 8, 2, 16, torch.float32),  # two heads per group
        (3, 12, 3, 10, torch.float32),  # dims that are not powers of two; one head per group
        (2, 64, 1, 128, torch.float32),  # several row blocks per head (BP < P)
        (4, 8, 2, 16, torch.bfloat16),
    ],
)
def test_mamba2_step_matches_torch_in_place(interpret, heads, head_dim, groups, n, dtype):
    from sglang.srt.layers.attention.mamba.decode_triton import head_block, mamba2_decode_inplace

    g = torch.Generator().manual_seed(heads * head_dim + n)
    bs = len(SLOTS)
    pool = (0.3 * torch.randn(NUM_SLOTS, heads, head_dim, n, generator=g)).to(dtype)
    before = pool.clone()
    xbc = torch.randn(bs, heads * head_dim + 2 * groups * n, generator=g)
    dt = torch.rand(bs, heads, generator=g) * 0.1 + 0.001
    A, D = -torch.rand(heads, generator=g) - 0.5, torch.randn(heads, generator=g)
    x, B, C = xbc.split([heads * head_dim, groups * n, groups * n], dim=-1)
    B = B.reshape(bs, groups, n).repeat_interleave(heads // groups, dim=1)
    C = C.reshape(bs, groups, n).repeat_interleave(heads // groups, dim=1)
    idx = torch.tensor(SLOTS)
    want_y, want_state = selective_state_update(pool[idx], x.reshape(bs, heads, head_dim), dt, A, B, C, D)
    y = mamba2_decode_inplace(xbc, dt, A, D, pool, idx, heads, head_dim, groups, n)
    real = [i for i, s in enumerate(SLOTS) if s != 0]
    torch.testing.assert_close(y, want_y, **TOL[dtype])
    torch.testing.assert_close(pool[idx][real].float(), want_state[real].to(dtype).float(), **TOL[dtype])
    _untouched(before, pool)
    if head_dim > head_block(head_dim, n):
        assert head_dim // head_block(head_dim, n) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_step_gates_the_raw_dt_in_the_kernel(interpret, dtype):
    """`gates` (the CUDA path): dt the projection's raw, strided slice, softplus(dt + dt_bias) clamped at
    dt_min and A = -exp(A_log) computed in the kernel, as the torch form computes them (softplus past
    its threshold 20 and far below 0 included); y in the layer's dtype, rounded once."""
    from sglang.srt.layers.attention.mamba.decode_triton import mamba2_decode_inplace

    heads, head_dim, groups, n = 4, 8, 2, 16
    g = torch.Generator().manual_seed(11)
    bs = len(SLOTS)
    pool = (0.3 * torch.randn(NUM_SLOTS, heads, head_dim, n, generator=g)).to(dtype)
    xbc = torch.randn(bs, heads * head_dim + 2 * groups * n, generator=g)
    proj = torch.randn(bs, 3 + heads, generator=g) * 3
    proj[0, 3:] = torch.tensor([25.0, -30.0, 0.0, -4.0])  # past the threshold, far below, at 0, clamped
    proj[1, 3:] = torch.tensor([-9.0, -12.0, -14.5, float("nan")])  # log1p's range; a NaN stays NaN
    raw = proj[:, 3:]  # the projection's dt columns: rows strided
    dt_bias, a_log = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    dt_min, D = 0.0, torch.randn(heads, generator=g)  # (Bamba / Granite / Falcon-H1: no clamp)
    dt = torch.nn.functional.softplus(raw + dt_bias).clamp(min=dt_min)
    A = -torch.exp(a_log)
    x, B, C = xbc.split([heads * head_dim, groups * n, groups * n], dim=-1)
    B = B.reshape(bs, groups, n).repeat_interleave(heads // groups, dim=1)
    C = C.reshape(bs, groups, n).repeat_interleave(heads // groups, dim=1)
    idx = torch.tensor(SLOTS)
    want_y, want_state = selective_state_update(pool[idx], x.reshape(bs, heads, head_dim), dt, A, B, C, D)
    y = mamba2_decode_inplace(
        xbc, raw, None, D, pool, idx, heads, head_dim, groups, n, gates=(dt_bias, a_log, dt_min), out_dtype=dtype
    )
    real = [i for i, s in enumerate(SLOTS) if s != 0]
    nan_row = 1 if SLOTS[1] != 0 else None
    if nan_row is not None:  # the NaN head's outputs and state stay NaN (torch's clamp keeps it), others not
        assert y[nan_row, 3].isnan().all() and not y[nan_row, :3].isnan().any()
    real = [i for i in real if i != nan_row]
    assert y.dtype == dtype
    torch.testing.assert_close(y[real].float(), want_y[real].to(dtype).float(), **TOL[dtype])
    torch.testing.assert_close(pool[idx][real].float(), want_state[real].to(dtype).float(), **TOL[dtype])


def test_empty_batches_launch_nothing(interpret):
    from sglang.srt.layers.attention.mamba.decode_triton import (
        causal_conv1d_update_inplace,
        mamba2_decode_inplace,
    )

    none = torch.empty(0, dtype=torch.int64)
    out = causal_conv1d_update_inplace(torch.zeros(0, 8), torch.zeros(3, 8, 3), none, torch.zeros(8, 4), None)
    assert out.shape == (0, 8)
    y = mamba2_decode_inplace(
        torch.zeros(0, 2 * 4 + 2 * 4), torch.zeros(0, 2), torch.zeros(2), torch.zeros(2),
        torch.zeros(3, 2, 4, 4), none, 2, 4, 1, 4,
    )  # fmt: skip
    assert y.shape == (0, 2, 4)


# (state dtype, activation dtype): the model's dtype on a GPU is bfloat16 (`--dtype auto`), so the conv
# kernels read bfloat16 inputs, weights and bias there.
@pytest.mark.parametrize("state,act", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")])
def test_compiles_for_sm90(state, act):
    """Nemotron-H-8B shapes (128 heads of 64, 8 groups, N = 128; conv over 10,240 channels, width 4) and
    Qwen3-Next-80B's conv (8,192 channels): the decode kernels and the extend conv's two kernels
    compile for an H100 from this CPU machine, without spilling to local memory."""
    from sglang.srt.layers.attention.mamba import decode_triton as mod
    from sglang.test.sm90 import compile_sm90_in_registers

    conv_sig = {
        "x_ptr": f"*{act}", "state_ptr": f"*{state}", "slot_ptr": "*i64", "src_ptr": "*i64", "w_ptr": f"*{act}",
        "bias_ptr": f"*{act}", "out_ptr": "*fp32", "slot_stride": "i64", "x_stride": "i64",
        **{k: "constexpr" for k in ("CHANNELS", "KEEP", "BKEEP", "BC", "HAS_BIAS")},
    }  # fmt: skip
    for channels, bias in ((10240, True), (8192, False)):
        consts = {
            "CHANNELS": channels,
            "KEEP": 3,
            "BKEEP": 4,
            "BC": mod.conv_block(channels, 3),
            "HAS_BIAS": bias,
        }
        compile_sm90_in_registers(mod._conv_update_kernel, conv_sig, consts)
    ssm_sig = {
        **{k: "*fp32" for k in ("xbc_ptr", "a_ptr", "d_ptr")}, "dt_ptr": f"*{act}",
        "state_ptr": f"*{state}", "slot_ptr": "*i64", "src_ptr": "*i64", "y_ptr": f"*{act}", "slot_stride": "i64",
        "dt_stride": "i64", "dt_bias_ptr": "*fp32", "dt_min": "fp32",
        **{k: "constexpr" for k in ("HEADS", "P", "N", "GROUPS", "BP", "BN", "GATED")},
    }  # fmt: skip
    for gated in (False, True):  # (the gating in the kernel: the CUDA path's)
        consts = {"HEADS": 128, "P": 64, "N": 128, "GROUPS": 8, "BP": mod.head_block(64, 128), "BN": 128}
        consts["GATED"] = gated
        compile_sm90_in_registers(mod._mamba2_decode_kernel, ssm_sig, consts, num_warps=mod.NUM_WARPS)
    ext_sig = {
        "x_ptr": f"*{act}", "state_ptr": f"*{state}", "cu_ptr": "*i64", "slot_ptr": "*i64", "w_ptr": f"*{act}",
        "bias_ptr": f"*{act}", "out_ptr": "*fp32", "slot_stride": "i64",
        **{k: "constexpr" for k in ("CHANNELS", "KEEP", "BT", "BC", "HAS_BIAS")},
    }  # fmt: skip
    bc = mod.conv_block(10240, 3)
    consts = {"CHANNELS": 10240, "KEEP": 3, "BT": 2048 // bc, "BC": bc, "HAS_BIAS": True}
    compile_sm90_in_registers(mod._conv_extend_kernel, ext_sig, consts)
    win_sig = {
        "x_ptr": f"*{act}", "state_ptr": f"*{state}",
        **{k: "*i64" for k in ("cu_ptr", "slot_ptr", "seq_ptr", "off_ptr", "dst_ptr")}, "slot_stride": "i64",
        **{k: "constexpr" for k in ("CHANNELS", "KEEP", "BKEEP", "BC")},
    }  # fmt: skip
    consts = {"CHANNELS": 10240, "KEEP": 3, "BKEEP": 4, "BC": bc}
    compile_sm90_in_registers(mod._conv_window_kernel, win_sig, consts)


@pytest.mark.parametrize("preset", ["tiny-nemotron-h"])  # Qwen3-Next: test_gdn_decode_triton.py
def test_engine_decodes_through_the_kernels_as_through_the_torch_step(interpret, preset):
    """Prefill then 5 greedy decode steps of 3 requests (one with a track copy), once with the Triton
    kernels forced (interpreted: the extend's batched conv, the conv update and the Mamba2 step) and once
    with the torch path."""
    from sglang.srt.environ import envs
    from sglang.test.model_checks import make_runner, random_ids
    from sglang.test.runner_driver import Extend, RunnerDriver

    choice = (
        envs.SGLANG_MAMBA2_DECODE_BACKEND if preset == "tiny-nemotron-h" else envs.SGLANG_GDN_DECODE_BACKEND
    )
    runs = []
    for backend in ("triton", "torch"):
        # The C++ CPU ops off: with them the extend would not reach the Triton conv.
        with choice.override(backend), envs.SGLANG_CPU_LINEAR_ATTN_BACKEND.override("torch"):
            runner = make_runner(preset, mamba_scheduler_strategy="extra_buffer")
        linear = runner.attn_backend.linear_attn_backend
        assert linear.decode_in_place == (backend == "triton") and linear.cpu_ops is None
        driver = RunnerDriver(runner)
        reqs = [driver.new_request() for _ in range(3)]
        driver.extend([Extend(r, random_ids(20 + 7 * i, seed=i)) for i, r in enumerate(reqs)])
        tokens, logprobs = [], []
        for step in range(5):
            track = {reqs[0]: reqs[0].track_slot} if step == 3 else None
            res = driver.decode(reqs, track=track)
            tokens.append(res.next_token_ids.tolist())
            logprobs += res.next_token_logprobs.tolist()
        pool = runner.mamba_pool
        runs.append(
            (tokens, logprobs, [t[:, reqs[0].track_slot].clone() for t in (pool.conv_state, pool.ssm_state)])
        )
    (tok_a, lp_a, snap_a), (tok_b, lp_b, snap_b) = runs
    assert tok_a == tok_b
    # The same float32 math in another order: ~1e-6 relative per step, amplified a little by the tiny
    # net; a wrong update (state or conv window) moves logprobs by O(1).
    torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), rtol=1e-4, atol=1e-4)
    for a, b in zip(snap_a, snap_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "width,channels,dtype",
    [
        (4, 40, torch.float32),  # one channel tile, one token tile per sequence
        (3, 40, torch.float32),
        (4, 40, torch.bfloat16),
        (4, 600, torch.float32),  # two channel tiles of 512 and token tiles of 4: tile edges inside
    ],
)
def test_conv_extend_batch_matches_torch(interpret, width, channels, dtype):
    """Sequences of 1, 2 (shorter than the window), 7 and 20 tokens from pool slots out of order, with
    snapshots after 1, 3 and 16 tokens (windows reaching into the initial state) and the final windows."""
    from sglang.srt.layers.attention.mamba.causal_conv1d import causal_conv1d_extend
    from sglang.srt.layers.attention.mamba.decode_triton import causal_conv1d_extend_batch, conv_block

    g = torch.Generator().manual_seed(width + channels)
    lengths, running = [1, 2, 7, 20], [9, 3, 11, 6]
    assert (conv_block(channels, width - 1) < channels) == (channels == 600)
    snaps = [(2, 1, 1), (2, 3, 4), (3, 16, 8)]  # (sequence, offset, slot)
    pool = torch.randn(NUM_SLOTS, channels, width - 1, generator=g).to(dtype)
    before = pool.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(int(cu[-1]), channels, generator=g)
    weight, bias = torch.randn(channels, width, generator=g), torch.randn(channels, generator=g)
    snap_t = tuple(torch.tensor(col) for col in zip(*snaps, strict=True))
    out = causal_conv1d_extend_batch(x, pool, weight, bias, cu, torch.tensor(running), max(lengths), snap_t)
    written = set(running) | {s for _, _, s in snaps}
    for b, (n, slot) in enumerate(zip(lengths, running, strict=True)):
        tokens = slice(int(cu[b]), int(cu[b]) + n)
        want, window = causal_conv1d_extend(x[tokens], before[slot], weight, bias)
        torch.testing.assert_close(out[tokens], want, **TOL[torch.float32])
        # Stored windows are the inputs rounded to the pool dtype: exact in float32; in bfloat16 within
        # one ulp (the interpreter rounds float32 -> bfloat16 toward zero, torch to nearest).
        for dst, off in [(slot, n)] + [(d, o) for s, o, d in snaps if s == b]:
            torch.testing.assert_close(
                pool[dst].float(), window[off : off + width - 1].t().to(dtype).float(), **TOL[dtype]
            )
    rest = [s for s in range(NUM_SLOTS) if s not in written]
    assert torch.equal(pool[rest], before[rest])


def test_steps_read_src_slots_and_write_the_slots(interpret):
    """A speculative verify's positions (`src_slots`): each row's state is read from its source slot,
    which stays as it was, and the updated state goes to its own slot: the twin's state and output."""
    from sglang.srt.layers.attention.mamba.decode_triton import (
        causal_conv1d_update_inplace,
        mamba2_decode_inplace,
    )

    g = torch.Generator().manual_seed(5)
    src, dst = torch.tensor([3, 9, 4]), torch.tensor([10, 2, 6])
    heads, head_dim, groups, n, channels = 4, 8, 2, 16, 24
    conv = torch.randn(NUM_SLOTS, channels, 3, generator=g)
    ssm = 0.3 * torch.randn(NUM_SLOTS, heads, head_dim, n, generator=g)
    before_conv, before_ssm = conv.clone(), ssm.clone()
    x, weight, bias = torch.randn(3, channels, generator=g), torch.randn(channels, 4, generator=g), None
    want_out, want_window = causal_conv1d_update(x, conv[src], weight, bias)
    out = causal_conv1d_update_inplace(x, conv, dst, weight, bias, src_slots=src)
    torch.testing.assert_close(out, want_out, **TOL[torch.float32])
    torch.testing.assert_close(conv[dst], want_window, **TOL[torch.float32])
    xbc = torch.randn(3, heads * head_dim + 2 * groups * n, generator=g)
    dt = torch.rand(3, heads, generator=g) * 0.1 + 0.001
    A, D = -torch.rand(heads, generator=g) - 0.5, torch.randn(heads, generator=g)
    xs, B, C = xbc.split([heads * head_dim, groups * n, groups * n], dim=-1)
    B = B.reshape(3, groups, n).repeat_interleave(heads // groups, dim=1)
    C = C.reshape(3, groups, n).repeat_interleave(heads // groups, dim=1)
    want_y, want_state = selective_state_update(ssm[src], xs.reshape(3, heads, head_dim), dt, A, B, C, D)
    y = mamba2_decode_inplace(xbc, dt, A, D, ssm, dst, heads, head_dim, groups, n, src_slots=src)
    torch.testing.assert_close(y, want_y, **TOL[torch.float32])
    torch.testing.assert_close(ssm[dst], want_state, **TOL[torch.float32])
    rest = [s for s in range(NUM_SLOTS) if s not in dst.tolist()]
    assert torch.equal(conv[rest], before_conv[rest]) and torch.equal(ssm[rest], before_ssm[rest])
