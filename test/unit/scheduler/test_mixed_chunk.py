"""--enable-mixed-chunk: the running requests' decode step rides in the prefill batches of long prompts.

Each workload runs twice, mixed and not: decoders run while long prompts are prefilled in chunks, then
each decoder's conversation continues (turn 2 = its prompt + outputs + new tokens). Mixed, every output
matches the transformers oracle (teacher-forced logprobs within ORACLE_TOL), the turn-2 prefix hits
equal the unmixed run's (the decode snapshots that mixed batches wrote sit where a decode batch puts
them), greedy and seeded outputs are the unmixed run's token for token, and the pools are whole after a
flush. Upstream's mixing corrupts hybrid models' snapshots (sgl-project/sglang#39342); the turn-2 hits
and their oracle checks are what would catch that here. The test also asserts that batches did mix and
that decode rows of mixed batches wrote snapshots (else it would prove nothing).
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler_components.mixed_chunk import mixed_prefill_tokens
from sglang.test.ci_register import per_commit_cases, register_cpu_ci
from sglang.test.scheduler_harness import ORACLE_TOL, SchedulerHarness, token_ids

register_cpu_ci(est_time=60, suite="per-commit-cpu")

QWEN, NEMO = "tiny-qwen3-next", "tiny-nemotron-h"
# (preset, strategy, overlap, page size, chunked prefill size)
CASES = [
    (QWEN, "extra_buffer", True, 1, 64),
    (NEMO, "extra_buffer_lazy", True, 16, 64),
    (QWEN, "no_buffer", False, 1, 64),
    (QWEN, "extra_buffer_lazy", False, 16, 128),
    ("tiny-falcon-h1", "extra_buffer", True, 1, 64),
    ("tiny-lfm2", "extra_buffer_lazy", True, 1, 64),
]
KEPT = CASES[:3]
GPU_ORACLE_TOL = 1e-3  # test_strategy_matrix.GPU_ORACLE_TOL: float32 on CUDA, measured there
# (prompt length, max_new_tokens); the short ones finish while the long prompts are prefilled, their
# newest decode snapshot written by a mixed batch (37 + 11 = 48, 70 + 10 = 80).
DECODERS = [(37, 14), (70, 13), (58, 45), (90, 70)]
LONG = [300, 270]  # prompts prefilled in chunks while the decoders run


class MixedLog:
    """What the launched batches were: how many decode rows each mixed batch had, and every decode
    snapshot: (rid, the sequence length the state is of, whether a mixed batch's decode row wrote it)."""

    def __init__(self, h: SchedulerHarness):
        self.decode_rows: list[int] = []
        self.tokens: list[int] = []  # each mixed batch's forward tokens
        self.decode_rids: list[str] = []  # each mixed batch's decode rows' requests, in turn
        self.snapshots: list[tuple[str, int, bool]] = []
        launch = h.sched.launch

        def record(batch: ScheduleBatch) -> None:
            mixed = batch.forward_mode.is_extend() and batch.num_decode_rows > 0
            first = batch.batch_size - batch.num_decode_rows
            if mixed:
                self.decode_rows.append(batch.num_decode_rows)
                self.tokens.append(batch.forward_batch.num_tokens)
                self.decode_rids += [r.rid for r in batch.reqs[first:]]
            for row, (_, seq_len) in batch.pending_tracks.items():
                assert not batch.forward_mode.is_extend() or row >= first, "prefill rows track otherwise"
                self.snapshots.append((batch.reqs[row].rid, seq_len, mixed))
            launch(batch)

        h.sched.launch = record

    def last_mixed(self) -> dict[str, int]:
        """{rid: S} for each request whose newest decode snapshot a mixed batch wrote (S tokens)."""
        last = {rid: (seq_len, mixed) for rid, seq_len, mixed in self.snapshots}
        return {rid: seq_len for rid, (seq_len, mixed) in last.items() if mixed}


INTERVAL = 16  # decode snapshots every 16 tokens: a few fall into the mixed batches


def _harness(preset, strategy, overlap, page, chunk, mixed: bool) -> SchedulerHarness:
    return SchedulerHarness(
        preset,
        mamba_scheduler_strategy=strategy,
        disable_overlap_schedule=not overlap,
        page_size=page,
        chunked_prefill_size=chunk,
        mamba_track_interval=INTERVAL,
        enable_mixed_chunk=mixed,
    )


def _run(h: SchedulerHarness, oracle, tol: float = ORACLE_TOL) -> dict:
    """The workload; returns what must not depend on mixing, and the log."""
    log = MixedLog(h)
    decoders = [token_ids(n, seed=100 + n) for n, _ in DECODERS]
    rids = [h.submit(p, m) for p, (_, m) in zip(decoders, DECODERS, strict=True)]
    # A seeded sampled decoder (its draws depend on the request's seed and position only) and one
    # with top logprobs.
    sampled = token_ids(44, seed=7)
    rids.append(h.submit(sampled, 50, temperature=1.0, sampling_seed=11))
    tops = token_ids(51, seed=8)
    rids.append(h.submit(tops, 40, top_logprobs_num=3))
    prompts = [*decoders, sampled, tops]
    for _ in range(6):  # the decoders are decoding when the long prompts come
        h.sched.step()
    longs = [token_ids(n, seed=200 + n) for n in LONG]
    rids += [h.submit(p, 12) for p in longs]
    prompts += longs
    h.run()
    got = {"tokens": [], "log": log}
    for p, rid in zip(prompts, rids, strict=True):
        out = h.outputs[rid]
        h.check_oracle(oracle, p, out, tol)  # (temperature 1.0: the logprobs are the model's)
        got["tokens"].append(out.output_ids)
    # The top-3 token ids of each step (the values: within the oracle's tolerance, checked above).
    got["top"] = [[pair[1] for pair in step] for step in h.outputs[rids[len(DECODERS) + 1]].top_logprobs]
    assert len(got["top"]) == 40 and all(len(step) == 3 for step in got["top"])
    # A request's newest decode snapshot stays in the tree beside its final state: a branch that
    # leaves its sequence right there can only hit that snapshot. Those that mixed batches wrote:
    seqs = {rid: p + h.outputs[rid].output_ids for p, rid in zip(prompts, rids, strict=True)}
    got["branches"] = log.last_mixed()
    for rid, seq_len in got["branches"].items():
        seq = seqs[rid]
        branch = seq[:seq_len] + [t for t in (7, 8, 9, 10) if t != seq[seq_len]][:3]
        out = h.generate(branch, max_new_tokens=2)
        h.check_oracle(oracle, branch, out, tol)
        assert out.cached_tokens == seq_len, (rid, seq_len, out.cached_tokens)
    h.flush_and_check_empty()
    return got


@pytest.mark.parametrize("case", per_commit_cases(CASES, KEPT), ids=lambda v: str(v))
def test_mixed_batches_match_the_oracle_and_the_unmixed_run(case, oracles):
    preset = case[0]
    results = {}
    for mixed in (False, True):
        h = _harness(*case, mixed=mixed)
        try:
            results[mixed] = _run(h, oracles[preset])
        finally:
            h.shutdown()
    plain, mixed = results[False], results[True]
    assert not plain["log"].decode_rows, "without the flag no batch mixes"
    assert len(mixed["log"].decode_rows) >= 5, mixed["log"].decode_rows  # chunks of the long prompts
    if case[1] != "no_buffer":  # (no_buffer writes no decode snapshots)
        assert len(mixed["branches"]) >= 2, mixed["log"].snapshots  # (else this checks no mixed snapshot)
    assert mixed["tokens"] == plain["tokens"]
    assert mixed["top"] == plain["top"]
    if case[1] == "no_buffer":  # (chunks align to the page: the decode rows' tokens come off the budget)
        assert max(mixed["log"].tokens) == case[4], mixed["log"].tokens


REGEX = r"([a-c] ?){24,40}x"  # (long enough to outlast the long prompt's prefill)
HIDDEN_TOL = 1e-4  # float32: the decode and the one-token extend forms sum in other orders (~1e-6)


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_decode_rows_with_grammars_hidden_states_penalties_and_streams(overlap, oracles):
    """Decode rows of every kind a request can make: a grammar's mask, hidden states, count-based
    penalties, a stream with input logprobs; mixed, their outputs are the unmixed run's."""
    prompts = [token_ids(n, seed=300 + n) for n in (33, 47, 61, 75)]
    kinds = [
        dict(regex=REGEX, temperature=1.0, sampling_seed=5),
        dict(return_hidden_states=True),
        dict(frequency_penalty=0.8, presence_penalty=0.5, logit_bias={"17": 2.0}),
        dict(stream=True, logprob_start_len=0),
    ]
    runs = {}
    for mixed in (False, True):
        h = SchedulerHarness(
            QWEN,
            chunked_prefill_size=64,
            disable_overlap_schedule=not overlap,
            enable_return_hidden_states=True,
            enable_mixed_chunk=mixed,
        )
        log = MixedLog(h)
        try:
            rids = [h.submit(p, 30, **kw) for p, kw in zip(prompts, kinds, strict=True)]
            while h.sched.grammar_queue:  # (the regex compiles on a thread: its request decodes first)
                h.sched.step()
            for _ in range(4):
                h.sched.step()
            h.submit(token_ids(400, seed=9), 4)
            h.run()
            outs = [h.outputs[r] for r in rids]
            assert all(len(o.output_ids) >= 2 for o in outs), [o.finished_reason for o in outs]
            h.check_oracle(oracles[QWEN], prompts[1], outs[1])
            h.sched.check_integrity()
            h.flush_and_check_empty()
        finally:
            h.shutdown()
        runs[mixed] = (outs, log)
    (plain, _), (mixed, log) = runs[False], runs[True]
    rode = {o.rid: log.decode_rids.count(o.rid) for o in mixed}
    assert min(rode.values()) >= 3, rode  # each kind rode along in mixed batches
    for a, b in zip(plain, mixed, strict=True):
        assert a.output_ids == b.output_ids, (a.rid, a.output_ids, b.output_ids)
        assert a.finished_reason == b.finished_reason
        assert a.messages == b.messages  # (the stream's: one per token, then the finish)
        assert len(a.input_logprobs) == len(b.input_logprobs)
    got, want = torch.tensor(mixed[1].hidden_states), torch.tensor(plain[1].hidden_states)
    assert got.shape == want.shape and got.shape[0] == len(prompts[1]) + 29, got.shape
    assert (got - want).abs().max().item() <= HIDDEN_TOL


def test_speculative_decoding_and_pd_servers_do_not_mix(caplog):
    """As upstream for speculative decoding: the flag is turned off at start, with a warning."""
    from sglang.srt.server_args import ServerArgs

    with caplog.at_level("WARNING"):
        spec = ServerArgs(model_path=QWEN, enable_mixed_chunk=True, speculative_algorithm="NGRAM")
    assert not spec.enable_mixed_chunk
    assert "Mixed chunked prefill is disabled because of using speculative decoding." in caplog.text
    pd = ServerArgs(model_path=QWEN, enable_mixed_chunk=True, disaggregation_mode="prefill")
    assert not pd.enable_mixed_chunk
    assert ServerArgs(model_path=QWEN, enable_mixed_chunk=True).enable_mixed_chunk


def test_batch_log_and_token_counters_count_decode_rows_as_decode(caplog):
    """A mixed batch's log line counts its prefill rows as new sequences and tokens and names its decode
    rows; sglang:realtime_tokens_total counts their tokens as decoded, as the unmixed server does, and
    sglang:gen_throughput's window counts them (its time includes the mixed forwards)."""
    counters = {}
    for mixed in (False, True):
        h = SchedulerHarness(QWEN, chunked_prefill_size=64, enable_mixed_chunk=mixed, log_level="info")
        stats, windowed = h.sched.batch_stats, []
        launch = stats.on_launch

        def on_launch(batch, running, queued, stats=stats, launch=launch, windowed=windowed):
            before, open_window = stats._generated, stats._since is not None
            launch(batch, running, queued)
            if batch.num_decode_rows and open_window:
                windowed.append(stats._generated - before == batch.num_decode_rows)

        stats.on_launch = on_launch
        try:
            prompts = [token_ids(30, seed=1), token_ids(200, seed=2)]
            h.submit(prompts[0], 20)
            h.sched.step()
            h.sched.step()
            with caplog.at_level("INFO"):
                h.submit(prompts[1], 2)
                h.run()
            counters[mixed] = dict(h.sched.batch_stats.realtime_tokens)
            assert all(windowed) and len(windowed) >= 2 * mixed, windowed
            assert counters[mixed]["prefill_compute"] == sum(map(len, prompts))  # (nothing cached)
        finally:
            h.shutdown()
    assert counters[True] == counters[False]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch.")]
    mixed_lines = [line for line in lines if "#mixed-decode-req: 1" in line]
    assert mixed_lines and all("#new-seq: 1, #new-token: 64," in line for line in mixed_lines[:2]), lines


def test_the_decode_rows_take_their_tokens_from_the_prefill_budget():
    """Upstream's rule, so that a mixed forward stays within --chunked-prefill-size; where that would
    leave less than one chunk alignment the prompt keeps its budget (it must progress)."""
    assert mixed_prefill_tokens(8192, 200, 64) == 7992  # (the chunk then aligns down to 7936)
    assert mixed_prefill_tokens(64, 3, 1) == 61
    assert mixed_prefill_tokens(64, 3, 64) == 64
    assert mixed_prefill_tokens(100, 100, 1) == 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", KEPT, ids=lambda v: str(v))
def test_gpu_mixed_batches_match_the_oracle(case, oracles):
    """The same workload on CUDA (float32): decode rows through the Triton extend kernels and FLA's
    varlen prefill from their running slots; the unmixed run decodes in CUDA graphs. Tolerance: the
    strategy matrix's GPU one (test_strategy_matrix.GPU_ORACLE_TOL, why there)."""
    preset, strategy, overlap, page, chunk = case
    results = {}
    for mixed in (False, True):
        h = SchedulerHarness(
            preset, mamba_scheduler_strategy=strategy, disable_overlap_schedule=not overlap, page_size=page,
            chunked_prefill_size=chunk, mamba_track_interval=INTERVAL, enable_mixed_chunk=mixed,
            device="cuda", dtype="float32",
        )  # fmt: skip
        try:
            results[mixed] = _run(h, oracles[preset], GPU_ORACLE_TOL)
        finally:
            h.shutdown()
    assert len(results[True]["log"].decode_rows) >= 5

