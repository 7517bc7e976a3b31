"""State capture: track slots hold the oracle's state after the requested position (extend: aligned
intermediate positions and the final one, several tracked requests with different prefixes in one
batch; decode: the state after the step), and a fresh request started from a track slot continues
exactly. Under `extra_buffer` the snapshot goes into the request's own (ping-pong) track slot; under
`extra_buffer_lazy`, the default, a request has no track slot and the snapshot goes into a slot
borrowed from the pool (what `MambaTracker` hands the forward): both are covered. Page sizes 1, 16, 128; the cache chunk C = max(kernel chunk, page) picks the positions, so
GDN at page 128 (C = 128, kernel chunk 64) reads intermediate index 2k for position 128k."""

from __future__ import annotations

import pytest

from sglang.srt.environ import envs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, max_abs, pool_state, prefill, random_ids, state_errors
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=10, suite="per-commit-cpu")

# The SSM state is a float32 sum over the whole prefix; the chunked kernels reorder that sum, which
# costs ~1e-6 of the state's scale (measured <= 2e-6). The conv state is a copy of projected inputs:
# only the projection's round-off differs (measured <= 1e-6). A wrong chunk index errs by O(1).
SSM_REL_TOL = 1e-5
CONV_REL_TOL = 1e-5
LOGPROB_TOL = 1e-4


def _cache_chunk(runner) -> int:
    return runner.server_args.mamba_cache_chunk_size


EXTRA = "extra_buffer"
LAZY = "extra_buffer_lazy"


def _snapshot_slots(driver: RunnerDriver, reqs, strategy: str) -> list[int]:
    """Where each request's extend snapshot goes: its own track slot under `extra_buffer`; under
    `extra_buffer_lazy` (one slot per running request, no track slot) a slot borrowed from the pool."""
    if strategy == LAZY:
        assert all(r.mamba_ping_pong_track_buffer is None for r in reqs), "lazy keeps no track slot"
        return driver.alloc_mamba_slots(len(reqs))
    return [r.track_slot for r in reqs]


@pytest.mark.parametrize(
    "preset,page_size,extend,strategy",
    [
        ("tiny-qwen3-next", 1, "auto", EXTRA),
        ("tiny-qwen3-next", 16, "auto", EXTRA),
        ("tiny-qwen3-next", 128, "auto", EXTRA),  # C = 128, twice the GDN kernel chunk
        ("tiny-qwen3-next", 16, "auto", LAZY),
        # The packed-batch extend (FLA's contract on CUDA) with its torch twin: snapshots taken from
        # the chunk-start states of the packed batch (GDN here, Mamba2 below).
        ("tiny-qwen3-next", 1, "torch_varlen", EXTRA),
        ("tiny-qwen3-next", 128, "torch_varlen", LAZY),
        ("tiny-nemotron-h", 1, "auto", EXTRA),
        ("tiny-nemotron-h", 16, "auto", EXTRA),
        ("tiny-nemotron-h", 128, "auto", EXTRA),  # C = 128, four times the Mamba2 chunk of 32
        ("tiny-nemotron-h", 128, "auto", LAZY),
        ("tiny-nemotron-h", 1, "torch_varlen", EXTRA),
        ("tiny-nemotron-h", 128, "torch_varlen", EXTRA),
        # States every 16 tokens for a state chunk of 32 (as FLA's 64 serves a config chunk of 128+):
        # snapshot rows are picked by token offset, not by chunk index.
        ("tiny-nemotron-h", 1, "torch_varlen_half", EXTRA),
    ],
)
def test_extend_and_decode_snapshots_match_the_oracle(preset, page_size, extend, strategy, oracles):
    ref = oracles[preset]
    choice = extend.removesuffix("_half")
    with envs.SGLANG_GDN_EXTEND_BACKEND.override(choice), envs.SGLANG_MAMBA2_EXTEND_BACKEND.override(choice):
        runner = make_runner(preset, page_size=page_size, mamba_scheduler_strategy=strategy)
    linear = runner.attn_backend.linear_attn_backend
    assert (linear.varlen_impl is not None) == (choice == "torch_varlen")
    if extend.endswith("_half"):
        linear.varlen_chunk //= 2
    driver = RunnerDriver(runner)
    c = _cache_chunk(runner)
    assert c == max(page_size, runner.arch.kernel_state_chunk)

    # (prefix, extend length, tracked position): a non-final aligned position deep inside a long
    # extend, the final position of an extend, and a non-final one on top of a two-chunk prefix.
    plan = [(0, 2 * c + 37, 2 * c), (c, c + 5, 2 * c + 5), (2 * c, 3 * c + 11, 3 * c)]
    prompts = [random_ids(p + e, seed=20 + i) for i, (p, e, _) in enumerate(plan)]
    reqs = [driver.new_request() for _ in plan]
    driver.extend([Extend(r, pr[:p]) for r, pr, (p, _, _) in zip(reqs, prompts, plan, strict=True) if p])
    snaps = _snapshot_slots(driver, reqs, strategy)
    items = [
        Extend(r, pr[p : p + e], track_seqlen=s, track_slot=slot)
        for r, pr, (p, e, s), slot in zip(reqs, prompts, plan, snaps, strict=True)
    ]
    driver.extend(items)
    for req, prompt, (_, _, s), slot in zip(reqs, prompts, plan, snaps, strict=True):
        conv_err, ssm_err = state_errors(pool_state(runner, slot), ref.states_after(prompt, s))
        assert conv_err < CONV_REL_TOL and ssm_err < SSM_REL_TOL, (s, conv_err, ssm_err)
        # The running slot holds the final state.
        conv_err, ssm_err = state_errors(
            pool_state(runner, req.mamba_pool_idx), ref.states_after(prompt, len(prompt))
        )
        assert conv_err < CONV_REL_TOL and ssm_err < SSM_REL_TOL

    # Decode-step snapshot: two of three requests are tracked in the second step.
    slots = driver.alloc_mamba_slots(2)
    driver.decode(reqs)
    driver.decode(reqs, track={reqs[0]: slots[0], reqs[2]: slots[1]})
    for req, slot in [(reqs[0], slots[0]), (reqs[2], slots[1])]:
        conv_err, ssm_err = state_errors(
            pool_state(runner, slot), ref.states_after(req.token_ids, req.seq_len)
        )
        assert conv_err < CONV_REL_TOL and ssm_err < SSM_REL_TOL


@pytest.mark.parametrize("strategy", [EXTRA, LAZY])
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_request_started_from_a_track_slot_continues_exactly(preset, page_size, strategy, oracles):
    runner = make_runner(preset, page_size=page_size, mamba_scheduler_strategy=strategy)
    driver = RunnerDriver(runner)
    c = _cache_chunk(runner)
    prompt = random_ids(2 * c + 60, seed=30)
    donor = driver.new_request()
    [snap] = _snapshot_slots(driver, [donor], strategy)
    driver.extend([Extend(donor, prompt, track_seqlen=2 * c, track_slot=snap)])

    # A new request shares the donor's first 2C positions of KV and starts from its snapshot.
    fresh = driver.new_request()
    res = driver.extend([Extend(fresh, prompt[2 * c :], prefix_from=(donor, 2 * c), cow_src=snap)])
    lps = res.input_token_logprobs[0] + [float(res.next_token_logprobs[0])]
    ref = oracles[preset].token_logprobs(prompt + [fresh.next_token], start=2 * c + 1)
    assert max_abs(lps, ref) < LOGPROB_TOL


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_track_positions_the_kernel_does_not_have_are_refused(preset):
    # The default strategy (lazy): the snapshot goes into a borrowed slot.
    driver = RunnerDriver(make_runner(preset))
    [snap] = driver.alloc_mamba_slots(1)
    chunk = driver.runner.arch.kernel_state_chunk
    prompt = random_ids(3 * chunk, seed=31)
    for bad in (chunk + 1, 0, 3 * chunk + 1):
        req = driver.new_request()
        with pytest.raises(ValueError, match="Track position"):
            driver.extend([Extend(req, prompt, track_seqlen=bad, track_slot=snap)])
    # An aligned position relative to an unaligned extend start is fine.
    req = driver.new_request()
    prefill(driver, req, prompt[:5])
    driver.extend([Extend(req, prompt[5:], track_seqlen=5 + chunk, track_slot=snap)])
