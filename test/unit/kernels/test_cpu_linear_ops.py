"""sgl-kernel's C++ linear-attention ops (`sgl-kernel/csrc/linear_attn_cpu.cpp`) against their torch twins:
- decode: the conv update, the Gated DeltaNet step and the Mamba2 selective state update, and the fused
  Mamba2 step against those three calls;
- extend: the conv, GDN and Mamba2 over a variable-length batch (lengths 1, chunk - 1, chunk, chunk + 1
  and more) with snapshots at chunk multiples and at the end, against the per-request chunked torch forms;
each reading and writing a pool in place through slots given out of order, float32 and bfloat16 pools,
untouched slots bit-equal; and the engine gives the same tokens, logprobs and snapshots with the C++ ops
and with the torch path."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.attention.linear.gated_delta_rule import (
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule_step,
)
from sglang.srt.layers.attention.mamba.causal_conv1d import causal_conv1d_extend, causal_conv1d_update
from sglang.srt.layers.attention.mamba.ssd import selective_state_update, ssd_chunk_scan
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, max_abs, random_ids
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=6, suite="per-commit-cpu")

# float32: same arithmetic in another summation order (and a polynomial exp in silu, 8e-8 relative):
# measured <= 5e-7 on these sizes. bfloat16 pools: both sides round the new state to bf16 once, and
# one rounding may land on either side of a tie-free bf16 step (2^-8 relative): states <= 1 in size.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SLOTS = 12
# Extend outputs are float32 either way; states in a bfloat16 pool carry one rounding, as above.


def _slots(bs: int, seed: int) -> torch.Tensor:
    # Out of order, distinct, never the dummy slot 0.
    return torch.randperm(SLOTS - 1, generator=torch.Generator().manual_seed(seed))[:bs] + 1


def _untouched(before: torch.Tensor, after: torch.Tensor, slots: torch.Tensor) -> bool:
    keep = torch.ones(before.shape[0], dtype=torch.bool)
    keep[slots] = False
    return torch.equal(before[keep], after[keep])


# The decode ops compile a conv width of 4 and state rows of 16, 64 and 128 as constants (in an AVX2 twin and
# the baseline one, `baseline` picks); other sizes take the loops of any length.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("width,baseline", [(4, False), (4, True), (3, False)])
def test_conv_update_matches_torch(ops, dtype, with_bias, width, baseline):
    torch.manual_seed(0)
    bs, channels = 5, 40
    x = torch.randn(bs, channels)
    weight = torch.randn(channels, width)
    bias = torch.randn(channels) if with_bias else None
    pool = torch.randn(SLOTS, channels, width - 1).to(dtype)
    slots = _slots(bs, 1)
    want_out, want_state = causal_conv1d_update(x, pool[slots], weight, bias)
    got_pool = pool.clone()
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        got_out = ops.causal_conv1d_update(x, got_pool, slots, weight, bias)
    assert max_abs(got_out, want_out) < TOL[torch.float32]  # the output is float32 either way
    assert max_abs(got_pool[slots].float(), want_state.float()) < TOL[dtype]
    assert _untouched(pool, got_pool, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "dk,baseline", [(8, False), (16, False), (16, True), (32, False), (32, True), (64, False)]
)
def test_gdn_step_matches_torch(ops, dtype, dk, baseline):
    torch.manual_seed(1)
    bs, hk, hv, dv = 6, 2, 6, 12  # three value heads per key head; dk != dv
    qkv = torch.randn(bs, 2 * hk * dk + hv * dv)
    g = -torch.rand(bs, hv)
    beta = torch.rand(bs, hv)
    pool = (0.3 * torch.randn(SLOTS, hv, dv, dk)).to(dtype)
    slots = _slots(bs, 2)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = (l2norm(q.reshape(bs, hk, dk)) * dk**-0.5).repeat_interleave(hv // hk, dim=1)
    k = l2norm(k.reshape(bs, hk, dk)).repeat_interleave(hv // hk, dim=1)
    want_out, want_state = recurrent_gated_delta_rule_step(q, k, v.reshape(bs, hv, dv), g, beta, pool[slots])
    got_pool = pool.clone()
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        got_out = ops.gdn_decode(qkv, g, beta, got_pool, slots, hk, hv, dk, dv)
    assert max_abs(got_out, want_out) < TOL[dtype]
    assert max_abs(got_pool[slots].float(), want_state) < TOL[dtype]
    assert _untouched(pool, got_pool, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n,baseline", [(10, False), (16, False), (16, True), (32, False), (32, True), (128, False)]
)
def test_mamba2_step_matches_torch(ops, dtype, n, baseline):
    torch.manual_seed(2)
    bs, heads, head_dim, groups = 5, 8, 6, 2
    xbc = torch.randn(bs, heads * head_dim + 2 * groups * n)
    dt = torch.rand(bs, heads) * 0.1 + 0.001
    A = -torch.rand(heads) - 0.5
    D = torch.randn(heads)
    pool = (0.3 * torch.randn(SLOTS, heads, head_dim, n)).to(dtype)
    slots = _slots(bs, 3)
    x, B, C = xbc.split([heads * head_dim, groups * n, groups * n], dim=-1)
    B = B.reshape(bs, groups, n).repeat_interleave(heads // groups, dim=1)
    C = C.reshape(bs, groups, n).repeat_interleave(heads // groups, dim=1)
    want_y, want_state = selective_state_update(pool[slots], x.reshape(bs, heads, head_dim), dt, A, B, C, D)
    got_pool = pool.clone()
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        got_y = ops.mamba2_decode(xbc, dt, A, D, got_pool, slots, heads, head_dim, groups, n)
    assert max_abs(got_y, want_y) < TOL[dtype]
    assert max_abs(got_pool[slots].float(), want_state) < TOL[dtype]
    assert _untouched(pool, got_pool, slots)


CHUNK = 16
LENGTHS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


class _Batch:
    """A variable-length extend batch: running slots out of order, and snapshots at every chunk
    multiple inside each sequence plus its end, each into a slot of its own."""

    def __init__(self, seed: int):
        perm = torch.randperm(SLOTS * 2 - 1, generator=torch.Generator().manual_seed(seed)) + 1
        self.running = perm[: len(LENGTHS)].tolist()
        free = iter(perm[len(LENGTHS) :].tolist())
        self.snaps = [[(o, next(free)) for o in [*range(CHUNK, n, CHUNK), n]] for n in LENGTHS]
        cu = [0]
        for n in LENGTHS:
            cu.append(cu[-1] + n)
        self.cu = cu
        ptr, offsets, slots = [0], [], []
        for snaps in self.snaps:
            offsets += [o for o, _ in snaps]
            slots += [s for _, s in snaps]
            ptr.append(len(offsets))
        self.args = tuple(torch.tensor(v) for v in (cu, self.running, ptr, offsets, slots))

    def seqs(self):
        for b, n in enumerate(LENGTHS):
            yield slice(self.cu[b], self.cu[b] + n), self.running[b], self.snaps[b]


def _pool(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return (0.3 * torch.randn(SLOTS * 2, *shape)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("baseline", [False, True])
def test_conv_extend_matches_torch(ops, dtype, baseline):
    """`baseline`: the SSE2 twin a CPU without AVX2 runs."""
    torch.manual_seed(3)
    batch, channels, width = _Batch(4), 24, 4
    x = torch.randn(batch.cu[-1], channels)
    weight, bias = torch.randn(channels, width), torch.randn(channels)
    pool = _pool(dtype, channels, width - 1)
    got_pool = pool.clone()
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        got = ops.causal_conv1d_extend(x, got_pool, weight, bias, *batch.args)
    touched = []
    for tokens, slot, snaps in batch.seqs():
        want, window = causal_conv1d_extend(x[tokens], pool[slot], weight, bias)
        assert max_abs(got[tokens], want) < TOL[torch.float32]
        for offset, snap_slot in [*snaps, (tokens.stop - tokens.start, slot)]:
            # Stored states are the window's inputs rounded to the pool dtype: exact.
            assert torch.equal(got_pool[snap_slot], window[offset : offset + width - 1].t().to(dtype))
            touched.append(snap_slot)
    assert _untouched(pool, got_pool, torch.tensor(touched))


def _check_states(got_pool, want_final, want_inter, slot, snaps, dtype):
    assert max_abs(got_pool[slot].float(), want_final) < TOL[dtype]
    for offset, snap_slot in snaps:
        want = want_final if offset % CHUNK else want_inter[offset // CHUNK]
        assert max_abs(got_pool[snap_slot].float(), want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dk,baseline", [(8, False), (16, False), (16, True), (32, False), (32, True)])
@pytest.mark.parametrize("dv", [12, 36])
def test_gdn_extend_matches_chunked_torch(ops, dtype, dk, baseline, dv):
    """dk 16 and 32 are compiled as constants (AVX2 and baseline twins); 8 takes the loop of any length. Value
    dims run in blocks of 16 lanes: 36 is two blocks and a rest of 4, 12 only a rest."""
    torch.manual_seed(5)
    batch, hk, hv = _Batch(6), 2, 4
    total = batch.cu[-1]
    qkv = torch.randn(total, 2 * hk * dk + hv * dv)
    g, beta = -0.3 * torch.rand(total, hv), torch.rand(total, hv)
    pool = _pool(dtype, hv, dv, dk)
    got_pool = pool.clone()
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        got = ops.gdn_extend(qkv, g, beta, got_pool, *batch.args, hk, hv, dk, dv)
    for tokens, slot, snaps in batch.seqs():
        n = tokens.stop - tokens.start
        q, k, v = qkv[tokens].split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = (l2norm(q.reshape(n, hk, dk)) * dk**-0.5).repeat_interleave(hv // hk, dim=1)
        k = l2norm(k.reshape(n, hk, dk)).repeat_interleave(hv // hk, dim=1)
        want, final, inter = chunk_gated_delta_rule(
            q, k, v.reshape(n, hv, dv), g[tokens], beta[tokens], pool[slot].float(), CHUNK, True
        )
        assert max_abs(got[tokens], want) < TOL[torch.float32]
        _check_states(got_pool, final, inter, slot, snaps, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,baseline", [(10, False), (16, False), (16, True), (32, False), (32, True)])
@pytest.mark.parametrize("head_dim", [6, 36])
def test_mamba2_extend_matches_chunked_torch(ops, dtype, n, baseline, head_dim):
    """A state size of 16 is compiled as a constant (AVX2 and baseline twins); 10 takes the loop of any
    length. Head dims run in blocks of 16 lanes: 36 is two blocks and a rest of 4, 6 only a rest."""
    torch.manual_seed(7)
    batch, heads, groups = _Batch(8), 4, 2
    total = batch.cu[-1]
    xbc = torch.randn(total, heads * head_dim + 2 * groups * n)
    dt = torch.rand(total, heads) * 0.1 + 0.001
    A, D = -torch.rand(heads) - 0.5, torch.randn(heads)
    pool = _pool(dtype, heads, head_dim, n)
    got_pool = pool.clone()
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        got = ops.mamba2_extend(xbc, dt, A, D, got_pool, *batch.args, heads, head_dim, groups, n)
    for tokens, slot, snaps in batch.seqs():
        length = tokens.stop - tokens.start
        x, B, C = xbc[tokens].split([heads * head_dim, groups * n, groups * n], dim=-1)
        B = B.reshape(length, groups, n).repeat_interleave(heads // groups, dim=1)
        C = C.reshape(length, groups, n).repeat_interleave(heads // groups, dim=1)
        x = x.reshape(length, heads, head_dim)
        want, final, inter = ssd_chunk_scan(x, dt[tokens], A, B, C, D, pool[slot].float(), CHUNK, True)
        assert max_abs(got[tokens], want) < TOL[torch.float32]
        _check_states(got_pool, final, inter, slot, snaps, dtype)


def test_bad_shapes_are_refused(ops):
    pool = torch.zeros(SLOTS, 8, 3)
    x, slots, w = torch.zeros(2, 8), torch.tensor([1, 2]), torch.zeros(8, 4)
    with pytest.raises(RuntimeError, match="one value per channel"):
        ops.causal_conv1d_update(x, pool, slots, w, torch.zeros(5))
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.causal_conv1d_update(x, pool, slots, torch.zeros(5, 4), None)
    xbc, ssm = torch.zeros(2, 2 * 3 + 2 * 4), torch.zeros(SLOTS, 2, 3, 4)
    dt, a_or_d = torch.zeros(2, 2), torch.zeros(2)
    with pytest.raises(RuntimeError, match="dt must be"):
        ops.mamba2_decode(xbc, torch.zeros(2, 1), a_or_d, a_or_d, ssm, slots, 2, 3, 1, 4)
    with pytest.raises(RuntimeError, match="D needs"):
        ops.mamba2_decode(xbc, dt, a_or_d, torch.zeros(1), ssm, slots, 2, 3, 1, 4)
    with pytest.raises(RuntimeError, match="A needs"):
        ops.mamba2_decode(xbc, dt, torch.zeros(1), a_or_d, ssm, slots, 2, 3, 1, 4)
    ops.mamba2_decode(xbc, dt, a_or_d, a_or_d, ssm, slots, 2, 3, 1, 4)  # the control: served
    with pytest.raises(RuntimeError, match="conv_state must be"):
        ops.causal_conv1d_update(torch.zeros(2, 9), pool, torch.tensor([1, 2]), torch.zeros(9, 4), None)
    with pytest.raises(RuntimeError, match="int64 vector"):
        ops.causal_conv1d_update(
            torch.zeros(2, 8), pool, torch.tensor([1], dtype=torch.int32), torch.zeros(8, 4), None
        )


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_engine_decodes_alike_with_cpp_and_torch_steps(ops, preset):
    """Three requests of different lengths in one extend (the C++ recurrent path), then 8 greedy
    decode steps with logprobs and a track copy at each step: same tokens, input and output logprobs
    within float32 noise, and the same snapshot. The decode blocks are off: this is about the steps'
    own ops (the blocks call the same ones, test_cpu_decode_blocks.py)."""

    def run(backend: str):
        with envs.SGLANG_CPU_LINEAR_ATTN_BACKEND.override(backend), envs.SGLANG_CPU_DECODE_BLOCKS.override(False):
            runner = make_runner(preset, mamba_scheduler_strategy="extra_buffer")
        linear = runner.attn_backend.linear_attn_backend
        assert (linear.cpu_ops is not None) == (backend == "cpp")
        if linear.cpu_ops is not None:
            linear.cpu_ops = _Recording(linear.cpu_ops)
        driver = RunnerDriver(runner)
        reqs = [driver.new_request() for _ in range(3)]
        first = driver.extend(
            [Extend(r, random_ids(n, seed=90 + n)) for r, n in zip(reqs, (5, 33, 70), strict=True)]
        )
        tokens, logprobs = [], [torch.tensor(sum(first.input_token_logprobs, []))]
        for _ in range(8):
            res = driver.decode(reqs, track={reqs[1]: reqs[1].track_slot})
            tokens.append(res.next_token_ids.tolist())
            logprobs.append(res.next_token_logprobs.clone())
        snapshot = runner.mamba_pool.ssm_state[:, reqs[1].track_slot].clone()
        if backend == "cpp":  # Nemotron-H's decode takes the fused step, Qwen3-Next's the GDN one
            fused = "mamba2_mixer_decode" in linear.cpu_ops.called
            assert fused == (preset == "tiny-nemotron-h"), linear.cpu_ops.called
        return tokens, torch.cat(logprobs), snapshot

    with_cpp, with_torch = run("cpp"), run("torch")
    assert with_cpp[0] == with_torch[0]
    # Over 8 steps and every layer the two paths' float32 rounding differences compound; measured ~1e-6.
    assert max_abs(with_cpp[1], with_torch[1]) < 1e-4
    assert max_abs(with_cpp[2], with_torch[2]) < 1e-4


class _Recording:
    """The ops namespace, noting which ops are called."""

    def __init__(self, ops):
        self.ops, self.called = ops, set()

    def __getattr__(self, name):
        self.called.add(name)
        return getattr(self.ops, name)


def test_bad_extend_descriptions_are_refused(ops):
    x, pool, w = torch.zeros(5, 8), torch.zeros(SLOTS, 8, 3), torch.zeros(8, 4)

    def call(cu, slots, ptr, off, snap_slots):
        args = [torch.tensor(v, dtype=torch.int64) for v in (cu, slots, ptr, off, snap_slots)]
        return ops.causal_conv1d_extend(x, pool, w, None, *args)

    call([0, 2, 5], [1, 2], [0, 1, 1], [2], [3])  # valid: a snapshot at the end of sequence 0
    with pytest.raises(RuntimeError, match="number of tokens"):
        call([0, 2, 4], [1, 2], [0, 0, 0], [], [])
    with pytest.raises(RuntimeError, match="outside the pool"):
        call([0, 2, 5], [1, SLOTS], [0, 0, 0], [], [])
    with pytest.raises(RuntimeError, match="1..length"):
        call([0, 2, 5], [1, 2], [0, 1, 1], [3], [3])  # offset 3 in a 2-token sequence
    with pytest.raises(RuntimeError, match="1..length"):
        call([0, 2, 5], [1, 2], [0, 1, 1], [0], [3])


def test_gdn_gating_matches_torch(ops):
    """beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), from strided slices of one projection
    (as Qwen3-Next's grouped [b | a]), across softplus's threshold of 20."""
    ba = torch.randn(7, 12) * 8
    ba[0, 6:] = torch.tensor([25.0, 19.5, -30.0, 0.0, 21.0, -1.0])  # a + dt_bias on both sides of 20
    b, a = ba[:, :6], ba[:, 6:]
    A_log, dt_bias = torch.randn(6), torch.randn(6) * 0.1
    g, beta = ops.gdn_gating(a, b, A_log, dt_bias)
    want_g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    # float32 exp / log1p from libm against torch's vectorised ones: an ulp or two.
    assert max_abs(beta, b.sigmoid()) < 1e-6
    assert max_abs(g, want_g) < 1e-5 * max(1.0, want_g.abs().max().item())
    with pytest.raises(RuntimeError, match="one value per head"):
        ops.gdn_gating(a, b, A_log[:5].contiguous(), dt_bias)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.gdn_gating(a[:, :5], b, A_log, dt_bias)


def test_mamba2_gating_matches_torch(ops):
    """dt = max(softplus(dt + dt_bias), time_step_min) from a strided slice of the input projection (as
    Nemotron-H's), across softplus's threshold of 20 and below the floor; A = -exp(A_log)."""
    proj = torch.randn(7, 20) * 8
    dt = proj[:, 12:]  # 8 heads, rows 20 apart
    dt[0] = torch.tensor([25.0, 19.5, -30.0, 0.0, 21.0, -1.0, -12.0, 3.0])
    A_log, dt_bias = torch.randn(8), torch.randn(8) * 0.1
    got_dt, got_a = ops.mamba2_gating(dt, dt_bias, A_log, 1e-3)
    want_dt = torch.nn.functional.softplus(dt + dt_bias).clamp(min=1e-3)
    assert (want_dt == 1e-3).any()  # the floor is reached
    # float32 exp / log1p from libm against torch's vectorised ones: an ulp or two.
    assert max_abs(got_dt, want_dt) < 1e-5 * max(1.0, want_dt.abs().max().item())
    assert max_abs(got_a, -A_log.exp()) < 1e-6 * max(1.0, A_log.exp().max().item())
    with pytest.raises(RuntimeError, match="one value per head"):
        ops.mamba2_gating(dt, dt_bias[:5].contiguous(), A_log, 1e-3)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.mamba2_gating(dt.t(), dt_bias, A_log, 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,baseline", [(16, False), (16, True), (10, False)])
def test_mamba2_mixer_decode_is_the_three_calls(ops, dtype, with_bias, n, baseline):
    """The fused decode step on slices of one input projection (as Nemotron-H's mixer splits it) gives
    the outputs and pool states of mamba2_gating, causal_conv1d_update and mamba2_decode called in turn on
    contiguous copies, bit for bit (the same arithmetic in the same order); untouched slots stay."""
    torch.manual_seed(4)
    bs, heads, head_dim, groups, width = 5, 8, 6, 2, 4
    channels = heads * head_dim + 2 * groups * n
    proj = torch.randn(bs, 3 + channels + heads)  # [gate | xBC | dt], rows 3 + channels + heads apart
    xBC, dt = proj[:, 3 : 3 + channels], proj[:, 3 + channels :]
    weight, bias = torch.randn(channels, width), torch.randn(channels) if with_bias else None
    dt_bias, A_log, D = torch.randn(heads) * 0.1, torch.randn(heads), torch.randn(heads)
    conv_pool = torch.randn(SLOTS, channels, width - 1).to(dtype)
    ssm_pool = (0.3 * torch.randn(SLOTS, heads, head_dim, n)).to(dtype)
    slots = _slots(bs, 5)
    want_conv, want_ssm = conv_pool.clone(), ssm_pool.clone()
    got_conv, got_ssm = conv_pool.clone(), ssm_pool.clone()
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        step, A = ops.mamba2_gating(dt, dt_bias, A_log, 1e-3)
        xbc = ops.causal_conv1d_update(xBC.contiguous(), want_conv, slots, weight, bias)
        want_y = ops.mamba2_decode(xbc, step, A, D, want_ssm, slots, heads, head_dim, groups, n)
        args = [
            xBC,
            dt,
            dt_bias,
            A_log,
            D,
            1e-3,
            got_conv,
            weight,
            bias,
            got_ssm,
            slots,
            heads,
            head_dim,
            groups,
            n,
        ]
        got_y = ops.mamba2_mixer_decode(*args)
    assert torch.equal(got_y, want_y)
    assert torch.equal(got_conv, want_conv) and torch.equal(got_ssm, want_ssm)
    assert _untouched(conv_pool, got_conv, slots) and _untouched(ssm_pool, got_ssm, slots)
    for position, bad, message in [
        (0, xBC[:, 1:], "xbc must be"),
        (1, dt[:3], "dt must be"),
        (10, slots + SLOTS, "outside|slot"),
        (8, torch.zeros(3), "one value per channel"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            ops.mamba2_mixer_decode(*args[:position], bad, *args[position + 1 :])
