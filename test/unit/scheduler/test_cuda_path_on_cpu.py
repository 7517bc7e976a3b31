"""The CUDA path's numerics without a GPU: the scheduler serving with every kernel CUDA runs by default
forced and interpreted (`TRITON_INTERPRET=1`: Triton attention, the linear layers' decode steps, the
norms, the rotary embedding, the routing; the packed extend in its torch form, FLA's layout), against
the transformers oracle at the CPU tolerance, with the caching rules' hits. The kernels' own tests
compare each with its torch twin; this one checks that they compose into the same model."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import per_commit_cases, register_cpu_ci
from sglang.test.device_audit import CUDA_DEFAULT_ENV
from sglang.test.scheduler_harness import ORACLE_TOL, SchedulerHarness, token_ids

register_cpu_ci(est_time=65, suite="per-commit-cpu")


# Falcon-H1: its Mamba2 output norm gates after the grouped norm (the norm kernel's other mode, which the
# kernel's own tests compare with its torch twin). Per commit Qwen3-Next (Gated DeltaNet); Nemotron-H
# (Mamba2) and Falcon-H1 in the nightly full matrix (Mamba2's decode kernel against its twin per commit:
# test_mamba_decode_triton.py).
@pytest.mark.parametrize(
    "preset",
    per_commit_cases(["tiny-qwen3-next", "tiny-nemotron-h", "tiny-falcon-h1"], ["tiny-qwen3-next"]),
)
def test_cuda_default_kernels_serve_the_oracles_logprobs(preset, oracles, monkeypatch):
    for name, value in CUDA_DEFAULT_ENV.items():
        monkeypatch.setenv(name, value)
    h = SchedulerHarness(
        preset, attention_backend="triton", mamba_scheduler_strategy="extra_buffer", page_size=16,
        disable_overlap_schedule=True,
    )  # fmt: skip
    runner = h.sched.model_runner
    linear = runner.attn_backend.linear_attn_backend
    assert linear.decode_in_place and linear.varlen_impl is not None
    assert type(runner.attn_backend.full_attn_backend).__name__ == "TritonAttnBackend"
    modules = list(runner.model.modules())
    assert all(m.triton for m in modules if hasattr(m, "triton") and getattr(m, "rotary_dim", 1) > 0)
    try:
        # A cold prompt, then its continuation: prefill, decode (past a track boundary) and a cache hit,
        # all through the kernels.
        prompt = token_ids(90, seed=1)
        out = h.generate(prompt, max_new_tokens=12)
        h.check_oracle(oracles[preset], prompt, out, ORACLE_TOL)
        turn2 = prompt + out.output_ids + token_ids(7, seed=2)
        out2 = h.generate(turn2, max_new_tokens=4)
        h.check_oracle(oracles[preset], turn2, out2, ORACLE_TOL)
        assert out2.cached_tokens > 0
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("preset", per_commit_cases(["tiny-qwen3-next", "tiny-nemotron-h"], ["tiny-qwen3-next"]))
def test_cuda_default_kernels_serve_speculative_verifies(preset, oracles, monkeypatch):
    """NGRAM verifies through the same kernels: Triton attention's extend over the cached prefix, and
    the decode-step kernels in place on the pool's verify rows, position by position."""
    for name, value in CUDA_DEFAULT_ENV.items():
        monkeypatch.setenv(name, value)
    h = SchedulerHarness(
        preset, attention_backend="triton", mamba_scheduler_strategy="extra_buffer", page_size=16,
        speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, mamba_track_interval=64,
    )  # fmt: skip
    assert h.sched.model_runner.attn_backend.linear_attn_backend.decode_in_place
    try:
        # The same prompt twice (the second run's drafts are the first's tokens; the prefix cache emptied
        # between), then a turn that hits the state the second run's verifies left at the track boundary
        # (64) its output crossed.
        prompt = token_ids(50, seed=1)
        first = h.generate(prompt, max_new_tokens=20)
        assert h.sched.flush_cache()[0]
        again = h.generate(prompt, max_new_tokens=20)
        assert again.output_ids == first.output_ids and h.sched.spec.stats["accepted_tokens"] >= 9
        h.check_oracle(oracles[preset], prompt, again, ORACLE_TOL)
        turn2 = prompt + first.output_ids + token_ids(5, seed=2)
        out2 = h.generate(turn2, max_new_tokens=4)
        h.check_oracle(oracles[preset], turn2, out2, ORACLE_TOL)
        assert out2.cached_tokens >= 64
        h.flush_and_check_empty()
    finally:
        h.shutdown()


def test_cuda_default_kernels_serve_mixed_chunks(oracles, monkeypatch):
    """--enable-mixed-chunk through the kernels: decode rows as one-token extends at any position of a
    page (the linear layers' packed extend from the running slots) beside a chunked prompt, their
    attention as CUDA runs an extend: FlashAttention-2's varlen call (`flash_extend.py`; here its torch
    twin, on this float32 preset) over the batch layout the backend builds from the real batches (the
    chunks' and the decode rows' prefixes gathered)."""
    from sglang.srt.layers.attention import flash_extend as fe

    for name, value in CUDA_DEFAULT_ENV.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(fe, "chosen", lambda device: True)
    monkeypatch.setattr(fe, "applies", lambda q, k_buf, ks, vs: k_buf.dtype == q.dtype and ks == vs == 1.0)
    monkeypatch.setattr(fe, "flash_varlen", lambda *a: calls.append(a[3].numel() - 1) or fe.flash_varlen_torch(*a))
    preset = "tiny-qwen3-next"
    h = SchedulerHarness(
        preset, attention_backend="triton", mamba_scheduler_strategy="extra_buffer", page_size=16,
        chunked_prefill_size=64, enable_mixed_chunk=True, disable_overlap_schedule=True,
    )  # fmt: skip
    mixed = []
    launch = h.sched.launch
    h.sched.launch = lambda batch: (mixed.append(batch.num_decode_rows), launch(batch))
    try:
        prompts = [token_ids(37, seed=3), token_ids(150, seed=4)]
        first = h.submit(prompts[0], max_new_tokens=10)
        h.sched.step()
        h.sched.step()
        second = h.submit(prompts[1], max_new_tokens=2)
        h.run()
        for prompt, rid in zip(prompts, (first, second), strict=True):
            h.check_oracle(oracles[preset], prompt, h.outputs[rid], ORACLE_TOL)
        assert sum(n > 0 for n in mixed) >= 2, mixed
        assert max(calls) >= 2, calls  # (batches of several requests through the varlen layout)
        h.flush_and_check_empty()
    finally:
        h.shutdown()
