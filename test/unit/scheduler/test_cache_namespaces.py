"""Prefix-cache namespaces (upstream's `extra_key` and `cache_salt`): a request reuses only what requests
of its own namespace left in the radix tree, prefill checkpoints and decode snapshots alike; the
namespace is `cache_salt + extra_key`, per prompt of a batch, and a non-string is refused naming the
field."""

from __future__ import annotations

import pytest

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_validation import RequestError, RequestLimits, build_requests, parse_prompts
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import ORACLE_TOL, SchedulerHarness, token_ids

register_cpu_ci(est_time=8, suite="per-commit-cpu")


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_a_request_hits_only_its_own_namespace(preset, oracles):
    h = SchedulerHarness(preset, mamba_scheduler_strategy="extra_buffer", disable_overlap_schedule=True)
    prompt = token_ids(140, seed=5)
    first = h.generate(prompt, 20, extra_key="tenant-a")
    assert first.cached_tokens == 0
    turn2 = prompt + first.output_ids + token_ids(6, seed=6)
    others = [h.generate(turn2, 4, extra_key=key) for key in (None, "tenant-b")]
    assert [o.cached_tokens for o in others] == [0, 0]  # the same tokens, cached under another name
    own = h.generate(turn2, 4, extra_key="tenant-a")
    assert own.cached_tokens >= 128  # a checkpoint of tenant-a's first turn
    for out in (*others, own):  # a hit or not, the same tokens and logprobs as the oracle's
        h.check_oracle(oracles[preset], turn2, out, ORACLE_TOL)
    assert others[0].output_ids == own.output_ids
    h.sched.check_integrity()
    h.flush_and_check_empty()
    h.shutdown()


def test_ngram_drafts_come_only_from_the_same_namespace():
    """NGRAM's n-gram table is shared, its keys seeded by the namespace: a tenant's drafts never continue
    another tenant's text (whose acceptance the spec_* fields would show)."""
    h = SchedulerHarness(
        "tiny-qwen3-next", speculative_algorithm="NGRAM", speculative_num_draft_tokens=6,
        disable_overlap_schedule=True,
    )  # fmt: skip
    stats = h.sched.spec.stats
    prompt = token_ids(30, seed=7)
    tenant_a, tenant_b = _namespaces(extra_key="tenant-a")[0], _namespaces(extra_key="tenant-b")[0]
    first = h.generate(prompt, 40, extra_key=tenant_a)
    assert h.sched.flush_cache()[0]
    before = stats["accepted_tokens"]
    other = h.generate(prompt, 40, extra_key=tenant_b)
    assert stats["accepted_tokens"] - before <= 2  # (its own text may repeat itself by chance)
    assert h.sched.flush_cache()[0]
    before = stats["accepted_tokens"]
    again = h.generate(prompt, 40, extra_key=tenant_a)
    assert stats["accepted_tokens"] - before >= 20  # drafts from tenant-a's first run
    assert first.output_ids == other.output_ids == again.output_ids
    h.shutdown()


def _namespaces(**fields) -> list[str | None]:
    obj = GenerateReqInput(input_ids=fields.pop("input_ids", [1, 2, 3]), **fields)
    prompts = parse_prompts(obj)
    reqs, _ = build_requests(obj, prompts, [], RequestLimits(context_len=64, max_req_input_len=60, vocab_size=100))
    return [r.req.extra_key for r in reqs]


def test_the_namespace_is_the_salt_then_the_key_per_prompt():
    """As upstream, `cache_salt + extra_key`; kept as a 128-bit digest, whatever their length."""
    assert _namespaces() == [None]
    (k,) = _namespaces(extra_key="k")
    assert len(k) == 32 and _namespaces(cache_salt="k") == [k]
    salted = _namespaces(cache_salt="s", extra_key="k")
    assert salted == _namespaces(extra_key="sk") != _namespaces(extra_key="ks")
    assert _namespaces(cache_salt="", extra_key=None) == [None]
    assert len(_namespaces(cache_salt="x" * 100_000)[0]) == 32
    batch = dict(input_ids=[[1, 2], [3, 4]])
    assert _namespaces(**batch, extra_key=["a", None]) == [_namespaces(extra_key="a")[0], None]
    assert len(set(_namespaces(**batch, cache_salt="s"))) == 1
    for name, value in (("extra_key", 5), ("cache_salt", ["x"])):
        with pytest.raises(RequestError) as e:
            _namespaces(**{name: value})
        assert e.value.param == name
