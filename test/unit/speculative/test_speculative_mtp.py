"""`--speculative-algorithm NEXTN` / `EAGLE` (the checkpoint's MTP layer drafts, `speculative/`) against
plain decoding: greedy outputs are the same tokens with chunked prefill and prefix hits; sampled
positions follow the target's distribution under rejection sampling, with sampled drafts (the eager
loop's) and greedy ones (the draft graphs'), and a seeded request's draws come from its seed; the
refusals.

The tiny presets' MTP layers are random, so their drafts are rarely accepted; `_teacher_drafts` replaces
the drafts by the plain run's own continuation (one in three chains spoiled at its last draft) so that
verifies accept 0..k drafts and the accepted positions' states, KV and MTP KV are exercised. Why equal:
each committed token is the target's argmax after the same tokens (`ngram_worker.py`), and the MTP layer
only decides what is proposed.

Nightly (suite nightly-cpu, `python -m pytest -q test/unit/speculative/test_speculative_mtp_nightly.py`):
Qwen3.5 and Qwen3.5-MoE, every strategy, retractions under KV pressure, sampling batches through the
draft graphs' bodies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.model_executor.forward_batch_info import SamplingBatchInfo
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.speculative.mtp_draft import Drafts, MtpHook
from sglang.test.ci_register import register_cpu_ci
from sglang.test.mtp_checks import NEXTN, QWEN, assert_same, plain_then_spec
from sglang.test.scheduler_harness import token_ids

register_cpu_ci(est_time=32, suite="per-commit-cpu")

NEXTN_STEPS = 3  # --speculative-num-steps' default


def test_greedy_same_as_plain_decoding_with_chunks_and_hits(monkeypatch):
    prompts = [token_ids(90 + 37 * k, seed=k) for k in range(3)]
    assert_same(*plain_then_spec(monkeypatch, QWEN, "extra_buffer", prompts, 24))


def test_greedy_same_as_plain_decoding_through_graph_bodies(monkeypatch):
    """The NEXTN run's decodes and greedy draft loops through the CUDA-graph runners' CPU form
    (`mtp_graphs.py`; three requests pad to bucket 4): padded requests must leave the real ones' KV,
    states and request rows as the eager loop does."""
    prompts = [token_ids(90 + 37 * k, seed=k) for k in range(3)]
    plain, spec, stats = plain_then_spec(
        monkeypatch, QWEN, "extra_buffer", prompts, 24, graph_sizes=[1, 2, 4]
    )
    assert_same(plain, spec, stats)
    assert stats["draft_graph_replays"] == stats["draft_loops"] > 0, stats  # (all greedy, 3 requests)


# Chi-square bounds whose false-failure probability is 1e-6 at 5 and 2 degrees of freedom (checked in the
# test with the chi-square tail, torch.special.gammaincc(df / 2, x / 2)).
CHI2_1E6 = {5: 35.9, 2: 27.7}


def _committed_tokens(
    p_full: torch.Tensor, top_k: int, drafts: torch.Tensor, hook: MtpHook, seeds: list[int] | None = None
) -> torch.Tensor:
    """One drafted position per row, every row with the same target p (`p_full`, cut to its `top_k`); the
    token `hook._reject` commits there. Each request: its newest token (id 0) then its draft; logits rows
    2i (the drafted position) and 2i + 1 (the bonus position, left to the sampler). `seeds`: per request."""
    n = drafts.shape[0]
    input_ids = torch.stack([torch.zeros(n, dtype=torch.int64), drafts], dim=1).reshape(-1)
    logits = p_full.log().repeat(2 * n, 1)
    seeds = None if seeds is None else [s for s in seeds for _ in range(2)]
    info = SamplingBatchInfo.create([1.0] * (2 * n), top_ks=[top_k] * (2 * n), seeds=seeds)
    fb = SimpleNamespace(input_ids=input_ids, sampling_info=info, positions=torch.arange(2 * n) % 2 + 50)
    ids = torch.full((2 * n,), -1, dtype=torch.int64)
    out = hook._reject(fb, logits, ids, starts=list(range(0, 2 * n, 2)), k=1)
    assert (out[1::2] == -1).all()  # the bonus positions are the sampler's
    return out[0::2]


def _chi2(committed: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(committed, minlength=p.shape[0]).double()
    expected = p.double() * committed.shape[0]
    support = expected > 0
    assert (counts[~support] == 0).all(), counts.tolist()  # nothing outside the top k
    return float(((counts - expected)[support] ** 2 / expected[support]).sum())


@pytest.mark.parametrize("greedy_drafts", [False, True])
@pytest.mark.parametrize("top_k", [-1, 3])
def test_rejection_sampling_follows_the_target_distribution(top_k, greedy_drafts, monkeypatch):
    """N rows with the same target p and draft q over 6 tokens; the drafts drawn from q. The committed
    token of a row is its draft if kept, else a resample: its frequencies must follow p, not q
    (chi-square under the 1 - 1e-6 quantile: a correct rule fails once in a million seeds and this
    fixed seed passes; committing q's draft unconditionally gives a statistic in the thousands).
    Sampled drafts (q passed): the acceptance rate is sum(min(p, q)). Greedy drafts (a draft graph's,
    `greedy_drafts`: q = one-hot(d), never built): d kept with probability p(d), else drawn from p
    without d; exact whatever decided d, here q's draws; the acceptance rate is sum(q p). Negative
    control: that residual without d removed fails the same bound (a statistic in the hundreds). With
    top_k = 3 the target is p's three most likely tokens renormalised (before, the truncated p was
    compared with q unnormalised, summing to 0.8: a statistic of 777)."""
    n, vocab = 40_000, 6
    full = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.07, 0.03])
    p = full if top_k < 0 else torch.cat([full[:top_k], torch.zeros(vocab - top_k)]) / full[:top_k].sum()
    q = torch.tensor([0.10, 0.30, 0.05, 0.35, 0.15, 0.05])
    df = int((p > 0).sum()) - 1
    bound = CHI2_1E6[df]
    tail = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(bound / 2.0))
    assert float(tail) < 1e-6
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    runner = SimpleNamespace(generator=gen)
    if greedy_drafts:
        hook = MtpHook(runner, drafts=_drafts(drafts))
        expected_rate = float((q * p).sum())
    else:
        hook = MtpHook(runner, drafts=_drafts(drafts, q.repeat(n, 1, 1)))
        expected_rate = float(torch.minimum(p, q).sum())
    committed = _committed_tokens(full, top_k, drafts, hook)
    chi2 = _chi2(committed, p)
    assert chi2 < bound, (chi2, torch.bincount(committed, minlength=vocab).tolist())
    rate = float((committed == drafts).double().mean())
    assert abs(rate - expected_rate) < 0.01, rate  # (std ~0.0025 at n = 40,000: 4 sigma)
    if greedy_drafts:  # the negative control: the residual keeps d
        monkeypatch.setattr(MtpHook, "_one_hot_rule", staticmethod(lambda p, d, u: (_keep(p, d, u), p)))
        wrong = _chi2(_committed_tokens(full, top_k, drafts, MtpHook(runner, drafts=_drafts(drafts))), p)
        assert wrong > 5 * bound, wrong


def _drafts(drafts: torch.Tensor, probs: torch.Tensor | None = None) -> Drafts:
    """How a verify's drafts (one per row here) were taken: drawn from `probs`, or greedy (None)."""
    return Drafts([[d] for d in drafts.tolist()], probs, greedy=probs is None)


def _keep(p: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return u < p.gather(1, drafts[:, None])[:, 0]


def test_a_draft_plan_without_the_sampling_requests_is_all_greedy():
    """The draft plan's sampling rows are the drafting requests' (`repeat_rows` with 0 for the others):
    greedy drafters beside a sampling request that does not draft (a penalty, its budget) make an
    all-greedy plan, which needs no draft distributions and may replay a graph whatever
    SGLANG_MTP_EAGER_SAMPLED_DRAFTS says (before, it kept the whole batch's False)."""
    info = SamplingBatchInfo.create([0.0, 1.0, 0.0])
    assert info.repeat_rows([1, 0, 1]).is_all_greedy
    assert not info.repeat_rows([0, 1, 1]).is_all_greedy and not info.repeat_rows([1, 4, 1]).is_all_greedy


def test_seeded_rejection_sampling_is_reproducible_and_exact():
    """Requests with seeds draw their acceptance and resample uniforms from (seed, position) (the
    sampler's hash, salted apart): the committed tokens are the same whatever state the draft runner's
    generator is in (before, it drew them: a seeded request's tokens changed from run to run), and with
    a seed per request they still follow p (the chi-square bound above; the keep and resample draws
    taken from one uniform would be correlated: a rejected draft's resample would then see only
    u >= p(d)). Requests without a seed still draw from the generator: two states, other tokens. (10,000
    requests: at least 300 expected per token, where the chi-square approximation holds.)"""
    n = 10_000
    full = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.07, 0.03])
    q = torch.tensor([0.10, 0.30, 0.05, 0.35, 0.15, 0.05])
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(0))
    for greedy in (True, False):
        taken = _drafts(drafts) if greedy else _drafts(drafts, q.repeat(n, 1, 1))
        runs = {}
        for seeded in (True, False):
            for state in (1, 2):
                hook = MtpHook(SimpleNamespace(generator=torch.Generator().manual_seed(state)), drafts=taken)
                seeds = list(range(n)) if seeded else None
                runs[seeded, state] = _committed_tokens(full, -1, drafts, hook, seeds)
        assert torch.equal(runs[True, 1], runs[True, 2])
        assert not torch.equal(runs[False, 1], runs[False, 2])
        assert _chi2(runs[True, 1], full) < CHI2_1E6[5], greedy


def test_flags_and_refusals():
    args = ServerArgs(model_path=QWEN, **NEXTN)
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (
        3,
        1,
        4,
    )
    assert args.speculative_draft_model_path == QWEN and not args.enable_overlap_schedule
    # FP8: the MTP layer loads through the model's FP8 path (`test_mtp_fp8.py`); before, both refused.
    assert ServerArgs(model_path="tiny-qwen3-next-fp8", **NEXTN).speculative_num_draft_tokens == 4
    assert ServerArgs(model_path=QWEN, quantization="fp8", **NEXTN).speculative_num_draft_tokens == 4
    assert (
        ServerArgs(
            model_path=QWEN, speculative_algorithm="EAGLE", speculative_num_steps=2
        ).speculative_num_draft_tokens
        == 3
    )
    bad = {
        "--speculative-eagle-topk 4 is not supported: drafts are one chain": dict(speculative_eagle_topk=4),
        r"--speculative-num-draft-tokens 6 must be --speculative-num-steps \+ 1 = 4": dict(
            speculative_num_draft_tokens=6
        ),
        "--speculative-num-steps must be a positive": dict(speculative_num_steps=0),
        "--speculative-draft-model-path other is not supported": dict(speculative_draft_model_path="other"),
        "tiny-nemotron-h has none": dict(model_path="tiny-nemotron-h"),
        "--speculative-algorithm EAGLE3 needs a separate draft model": dict(speculative_algorithm="EAGLE3"),
    }
    # The MTP layer's KV is one more layer of the pool (tiny-qwen3-next has one full-attention layer): the
    # planner counts it.
    from sglang.srt.mem_cache.pool_sizing import compute_pool_sizes

    plain, nextn = (ServerArgs(model_path=QWEN, **kw) for kw in ({}, NEXTN))
    per_token = [compute_pool_sizes(a, a.model_config.arch, 0).kv_bytes_per_token for a in (plain, nextn)]
    assert per_token[1] == 2 * per_token[0]
    for message, flags in bad.items():
        flags = {"model_path": QWEN, **NEXTN, **flags}
        with pytest.raises(ServerArgsError, match=message):
            ServerArgs(**flags)


def test_the_planner_counts_the_mtp_layers_weights():
    """With NEXTN the MTP layer loads beside the model, so the weights the memory plan holds back are the
    model's and the layer's, byte for byte as they load; without NEXTN the model's alone. (Before, the
    plan left the layer out: on a GPU the pools took its bytes, 3.3 GB for Qwen3-Next-80B in bf16.)"""
    from sglang.srt.mem_cache.pool_sizing import plan_memory
    from sglang.srt.mem_cache.weight_bytes import weight_bytes_from_config
    from sglang.srt.models.registry import load_model
    from sglang.srt.speculative.draft_layers import load_draft_layers

    def param_bytes(module):
        return sum(p.numel() * p.element_size() for p in module.parameters())

    for dtype in ("float32", "bfloat16"):
        plain, nextn = (ServerArgs(model_path=QWEN, dtype=dtype, **kw) for kw in ({}, NEXTN))
        config = nextn.model_config
        model = load_model(config.hf_config, config.path, config.torch_dtype, "cpu")
        draft = load_draft_layers(nextn, model)
        assert load_draft_layers(plain, model) is None
        planned = [
            weight_bytes_from_config(config.hf_config, config.torch_dtype, "cpu", draft_layers=d).total
            for d in (False, True)
        ]
        assert planned == [param_bytes(model), param_bytes(model) + param_bytes(draft)], dtype
        # The whole plan for a device (`plan_memory`, from the config alone) holds the same bytes back.
        assert [plan_memory(a, 10**10).weight_bytes for a in (plain, nextn)] == planned, dtype
        assert param_bytes(draft) > 0.2 * param_bytes(model)  # (one decoder layer of tiny-qwen3-next's 4)


def test_the_mtp_layer_loads_reading_its_own_tensors_only(monkeypatch):
    """Loading the draft layer reads the checkpoint's `mtp.*` tensors and no other (before, it read the
    whole checkpoint again: 173 tensors for 19 on tiny-qwen3-next, ~160 GB for 3.3 GB on the 80B)."""
    from sglang.srt.models import checkpoint_reader, loader
    from sglang.srt.models.registry import load_model
    from sglang.srt.speculative.draft_layers import load_draft_layers

    args = ServerArgs(model_path=QWEN, **NEXTN)
    config = args.model_config
    model = load_model(config.hf_config, config.path, config.torch_dtype, "cpu")
    read, opened = [], loader.safe_open

    class Counting:
        def __init__(self, *a, **kw):
            self.f = opened(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    # Both readers: the serial one, and the threads that read ahead (`checkpoint_reader`).
    monkeypatch.setattr(loader, "safe_open", Counting)
    monkeypatch.setattr(checkpoint_reader, "safe_open", Counting)
    assert load_draft_layers(args, model) is not None
    assert read and all(name.startswith("mtp.") for name in read), read


def test_sampling_drafts_keep_no_distribution_between_verifies(monkeypatch):
    """Sampling requests draft (rejection sampling reads q_1..q_k over the vocabulary), yet between
    forwards the draft keeps one hidden-size row per request row and nothing vocabulary-wide: q_1 is drawn
    in the draft steps from that row, and the distributions a verify carries are its drafting requests'
    k rows. (Before, a [request rows, vocab] float32 table stayed allocated once a request sampled: 311
    MB at 512 rows of a 152k vocabulary.)"""
    from sglang.srt.speculative.mtp_draft import MtpDraftRunner
    from sglang.test.scheduler_harness import SchedulerHarness

    shapes = []
    original = MtpDraftRunner.draft_steps

    def record(self, plan):
        out = original(self, plan)
        chains, probs = out.chains, out.probs
        shapes.append((len(plan.rows), tuple(probs.shape)))
        assert torch.allclose(probs.sum(dim=-1), torch.ones(()), atol=1e-4)  # (float32 sums over 1k)
        first = torch.tensor([c[0] for c in chains])
        # top_k=2 leaves q_1 two tokens of the vocabulary: a d_1 drawn from anything else lands outside.
        assert ((probs[:, 0] > 0).sum(dim=-1) <= 2).all()
        assert (probs[:, 0].gather(1, first[:, None]) > 0).all()  # d_1 was drawn from q_1
        return out

    monkeypatch.setattr(MtpDraftRunner, "draft_steps", record)
    h = SchedulerHarness(QWEN, disable_overlap_schedule=True, **NEXTN)
    try:
        for k in range(2):
            h.submit(token_ids(40 + 9 * k, seed=k), max_new_tokens=10, temperature=1.0, top_k=2, return_logprob=False)
        h.run()
        draft = h.sched.spec.draft
        vocab = draft.lm_head.weight.shape[0]
        rows = h.sched.model_runner.req_to_token_pool.req_to_token.shape[0]
        kept = [t for t in vars(draft.stash).values() if isinstance(t, torch.Tensor)]
        assert [tuple(t.shape) for t in kept] == [(rows, draft.lm_head.weight.shape[1])]
        h.flush_and_check_empty()
    finally:
        h.shutdown()
    steps = NEXTN_STEPS
    assert shapes and all(shape == (n, steps, vocab) for n, shape in shapes), shapes


def test_first_drafts_match_a_transformers_built_mtp_layer(monkeypatch):
    """The engine's first k drafts for a prompt (its MTP layer, KV and hidden-state feeding) against the
    published layout built from transformers' own Qwen3-Next layers (`sglang.tools.train_mtp`), loaded
    with the checkpoint's `mtp.*` tensors, over the whole sequence at once: step j at position L + j - 2
    sees the canonical rows (x_(t+1), h_t) before L and the draft rows after. Greedy on the random preset
    (head gain 5: top logits far apart), so the argmaxes are the same tokens."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from sglang.srt.configs.presets import resolve_model_path
    from sglang.srt.speculative.mtp_draft import MtpDraftRunner
    from sglang.test.scheduler_harness import SchedulerHarness
    from sglang.tools.train_mtp import TrainableMTP

    seen = []
    original = MtpDraftRunner.draft_steps

    def record(self, plan):
        out = original(self, plan)
        seen.append((plan.prefix_lens[0], out.chains[0]))
        return out

    monkeypatch.setattr(MtpDraftRunner, "draft_steps", record)
    prompt = token_ids(75, seed=3)
    h = SchedulerHarness(QWEN, disable_overlap_schedule=True, **NEXTN)
    try:
        rid = h.submit(prompt, max_new_tokens=6, return_logprob=False)
        h.run()
        first = h.outputs[rid].output_ids[0]
        # The pools were sized after the weights of the model and of its MTP layer (loaded beside it).
        runner = h.sched.model_runner
        loaded = sum(p.numel() * p.element_size() for p in runner.draft_model.parameters())
        assert runner.draft_model is h.sched.spec.draft.mtp and loaded > 0
        assert runner.memory_bytes["weights"] == loaded + sum(
            p.numel() * p.element_size() for p in runner.model.parameters()
        )
    finally:
        h.shutdown()
    p, drafts = seen[0]
    assert p == len(prompt)

    path = resolve_model_path(QWEN)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mtp = TrainableMTP(base).eval()
    tensors = load_file(f"{path}/model.safetensors")
    mtp.load_state_dict({k.removeprefix("mtp."): v for k, v in tensors.items() if k.startswith("mtp.")})
    seq = prompt + [first]
    with torch.no_grad():
        hidden = base.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        next_ids, rows = list(seq[1:]), [hidden[t] for t in range(len(prompt))]
        want = []
        for _ in range(len(drafts)):
            logits, g = _reference_step(mtp, base, next_ids, rows)
            want.append(int(logits.argmax()))
            next_ids.append(want[-1])
            rows.append(g)
    assert drafts == want


def _reference_step(mtp, base, next_ids: list[int], rows: list[torch.Tensor]):
    """The reference layer over all rows; the last row's logits and output g."""
    captured = {}
    handle = mtp.norm.register_forward_hook(lambda m, i, o: captured.update(g=o[0, -1]))
    try:
        logits = mtp(base, torch.tensor([next_ids]), torch.stack(rows)[None])
    finally:
        handle.remove()
    return logits[0, -1], captured["g"]


# On CUDA (issue 57's GPU check): float32, the server's CUDA graphs, Triton attention's extend over the
# cached prefix; the draft steps and verifies must give plain decoding's tokens and cache hits exactly as
# on CPU (test_speculative_ngram's GPU test asserts the same of NGRAM's verifies).
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_gpu_greedy_same_as_plain_decoding(monkeypatch, strategy):
    prompts = [token_ids(90 + 37 * k, seed=k) for k in range(3)]
    plain, spec, stats = plain_then_spec(
        monkeypatch, QWEN, strategy, prompts, 24, device="cuda", dtype="float32"
    )
    assert_same(plain, spec, stats)
    # The draft loops were CUDA graphs (all greedy, at most three requests: every bucket is captured), and
    # so was the MTP layer after the verifies (graph-shaped where a graph serves them): each draft loop's
    # verify, counted apart from the decodes' (which alone could outnumber the loops).
    assert stats["draft_graph_replays"] == stats["draft_loops"] > 0, stats
    assert stats["mtp_verify_graph_replays"] >= stats["draft_loops"], stats



@pytest.mark.parametrize("per_step", [0.012, 0.009])
def test_verifies_cut_by_the_output_checks_budget_same_as_plain_decoding(monkeypatch, per_step):
    """NEXTN verifies whose tokens the output checks' budget cuts (four stop_regex requests, each search
    2 ms on a fake clock, cut under 2 ms; 12 and 9 ms a step: plain decoding's steps fit 8 ms, a verify's
    later tokens only what is left): greedy outputs, finishes, cached tokens and logprobs are plain
    decoding's, and a request whose verify committed fewer tokens than it accepted drafts nothing at its
    next verify (`EagleWorker.cut_short`: the MTP output stashed for its next first draft came from tokens
    it did not commit; its one-position row stashes the right one). Review F3: without it those requests
    drafted at once from the stale stash. Logprobs: 1e-4, the float32 noise of one forward's batch shape
    against another's."""
    from sglang.srt.speculative.eagle_worker import EagleWorker
    from sglang.test.fake_stop_search import fake_stop_search
    from sglang.test.mtp_checks import teacher_drafts
    from sglang.test.scheduler_harness import SchedulerHarness

    fake_stop_search(monkeypatch, lambda pattern, text, limit: 0.002)  # (cut where less is left)
    monkeypatch.setenv("SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP", str(per_step))
    args = dict(mamba_scheduler_strategy="extra_buffer", disable_overlap_schedule=True, chunked_prefill_size=64)
    prompts = [token_ids(60 + 11 * k, seed=70 + k) for k in range(4)]

    def run(h):
        rids = [h.submit(p, max_new_tokens=30 + 3 * k, stop_regex=["\x00never"], return_logprob=True)
                for k, p in enumerate(prompts)]
        h.run()
        h.sched.check_integrity()
        return [h.outputs[r] for r in rids]

    h = SchedulerHarness(QWEN, **args)
    try:
        plain = run(h)
        h.flush_and_check_empty()
    finally:
        h.shutdown()
    cut, late, cuts = set(), [], [0]  # (requests cut short, those that drafted at their next verify)
    build, short = EagleWorker.get_new_batch_verify, EagleWorker.cut_short

    def get_new_batch_verify(self, reqs):
        batch = build(self, reqs)
        if batch is not None:
            late.extend(r.rid for r, d in zip(reqs, batch.spec_info.drafts, strict=True) if d and r.rid in cut)
        cut.difference_update(r.rid for r in reqs)
        return batch

    def cut_short(self, req):
        cuts[0] += 1
        cut.add(req.rid)
        short(self, req)

    monkeypatch.setattr(EagleWorker, "get_new_batch_verify", get_new_batch_verify)
    monkeypatch.setattr(EagleWorker, "cut_short", cut_short)
    h = SchedulerHarness(QWEN, **args, **NEXTN)
    try:
        truth = {tuple(p): p + o.output_ids for p, o in zip(prompts, plain, strict=True)}
        with teacher_drafts(monkeypatch, h, truth):
            spec = run(h)
        stats = dict(h.sched.spec.stats)
        h.flush_and_check_empty()
    finally:
        h.shutdown()
    for k, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert b.output_ids == a.output_ids and b.finished_reason == a.finished_reason, k
        assert b.cached_tokens == a.cached_tokens, k
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4), k
    assert stats["accepted_tokens"] > 0 and cuts[0] > 0, (stats, cuts)
    assert not late, late
