"""Drive a real `Scheduler` in-process: submit token-id requests, run until idle, collect each request's
accumulated output, and check it against the transformers oracle (teacher-forced)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.srt.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from sglang.srt.managers.request_validation import cache_namespace
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.routed_experts import encode as encode_routed_experts
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

# Engine vs oracle, float32, teacher-forced: both sides err by ~1e-5 at most on the tiny presets
# (measured), and a wrong state (no hit, wrong checkpoint) costs > 0.5.
ORACLE_TOL = 1e-4


@dataclass
class Output:
    rid: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Per output position (with top_logprobs_num / token_ids_logprob): [(logprob, token id)].
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_logprobs: list[tuple[float | None, int]] | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0
    finished_reason: dict | None = None
    messages: int = 0
    hidden_states: list[list[float]] = field(default_factory=list)  # with return_hidden_states
    routed_experts: str | None = None  # with return_routed_experts: meta_info's (base64)


def token_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def prompt_with_unique_token(oracle, prompt_len: int, m: int) -> tuple[list[int], int]:
    """A prompt whose m-th greedy output token appears nowhere earlier in the output (a stop token that
    ends generation after exactly m tokens), and that token."""
    for seed in range(100, 200):
        prompt = token_ids(prompt_len, seed=seed)
        out = oracle.greedy(prompt, m)
        if out[-1] not in out[:-1]:
            return prompt, out[-1]
    raise AssertionError("no prompt found")


def churn_harness(overlap: bool, **kwargs: Any) -> SchedulerHarness:
    """A lazy-strategy scheduler too small for `run_churn`'s outputs (retractions), 8 running."""
    args = dict(
        mamba_scheduler_strategy="extra_buffer_lazy",
        disable_overlap_schedule=not overlap,
        max_running_requests=8,
        max_total_tokens=520,
        mamba_track_interval=64,
    )
    args.update(kwargs)
    return SchedulerHarness("tiny-qwen3-next", **args)


def run_churn(h: SchedulerHarness, abort_at: int = 40, max_steps: int = 600) -> list[str]:
    """14 requests of 10-101 prompt tokens and 20-137 new tokens (every third one with stop ids), run
    until idle; the sixth is aborted at step `abort_at` (running by then, or finished: either is fine).
    Returns the rids in submission order, outputs collected."""
    rids = []
    for k in range(14):
        prompt = token_ids(10 + 7 * k, seed=k)
        stops = {"stop_token_ids": list(range(3, 12))} if k % 3 == 0 else {}
        rids.append(h.submit(prompt, max_new_tokens=20 + 9 * k, return_logprob=False, **stops))
    for step in range(max_steps):
        if step == abort_at:
            h.sched.abort_request(rids[5])
        if not h.sched.step():
            break
    h.collect()
    return rids


class SchedulerHarness:
    def __init__(self, model_path: str = "tiny-qwen3-next", **kwargs: Any):
        defaults = dict(
            max_total_tokens=8192, max_mamba_cache_size=96, max_running_requests=32, random_seed=0
        )
        defaults.update(kwargs)
        self.server_args = ServerArgs(model_path=model_path, **defaults)
        self.sched = Scheduler(self.server_args)
        self.outputs: dict[str, Output] = {}
        self._ids = itertools.count()

    # ---- requests ----------------------------------------------------------------------------------

    def submit(
        self,
        ids: list[int],
        max_new_tokens: int = 8,
        *,
        return_logprob: bool = True,
        logprob_start_len: int = -1,
        stream: bool = False,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        extra_key: str | None = None,
        return_hidden_states: bool = False,
        return_routed_experts: bool = False,
        custom_logit_processor: str | None = None,
        warmup: bool = False,
        lora: str | None = None,
        require_reasoning: bool = False,
        **sampling: Any,
    ) -> str:
        """`lora`: the name of an adapter of --lora-paths (its id and cache namespace as the tokenizer
        gives them)."""
        rid = f"req-{next(self._ids)}"
        params = dict(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        params.update(sampling)
        self.sched.add_request(
            TokenizedGenerateReqInput(
                rid=rid,
                input_text=None,
                input_ids=list(ids),
                sampling_params=SamplingParams.from_dict(params),
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                token_ids_logprob=token_ids_logprob,
                stream=stream,
                extra_key=extra_key if lora is None else cache_namespace(extra_key, None, self.lora_id(lora)),
                return_hidden_states=return_hidden_states,
                return_routed_experts=return_routed_experts,
                custom_logit_processor=custom_logit_processor,
                warmup=warmup,
                lora_id=None if lora is None else self.lora_id(lora),
                require_reasoning=require_reasoning,
            )
        )
        self.outputs[rid] = Output(rid)
        return rid

    def lora_id(self, name: str) -> str:
        """The id of adapter `name` of --lora-paths."""
        return next(r.lora_id for r in self.server_args.lora_refs if r.lora_name == name)

    def run(self) -> None:
        self.sched.run_until_idle()
        self.collect()

    def use_graph_bodies(self, sizes: list[int]) -> Any:
        """Serve decodes (and EAGLE / NEXTN's greedy draft loops) through the CUDA-graph
        runners' CPU form (their bodies run eagerly at each replay) at batch sizes `sizes`; the runner."""
        from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

        runner = self.sched.model_runner
        runner.graph_runner = CudaGraphRunner(runner, sizes, use_graphs=False)
        draft = getattr(self.sched.spec, "draft", None)
        if draft is not None:  # EAGLE / NEXTN: its draft loop's graph bodies too (`mtp_graphs.py`)
            draft.use_graphs(runner.graph_runner)
        return runner.graph_runner

    def control_reply(self, msg: Any | None = None, timeout: float = 60) -> Any:
        """Send the control message `msg` (None: none, a reply is due already) and return the scheduler's
        one reply, polling what its loop polls each iteration (a weight update loading, a weight-update
        group operation) until it comes."""
        if msg is not None:
            self.sched.process_input_requests([msg])
        deadline = time.monotonic() + timeout
        while not self.sched.tokenizer_outbox:
            assert time.monotonic() < deadline, "no reply from the scheduler"
            self.sched.finish_weight_update()
            self.sched.finish_weights_group_op()
            time.sleep(0.01)
        (reply,) = self.sched.tokenizer_outbox
        self.sched.tokenizer_outbox.clear()
        return reply

    def generate(self, ids: list[int], max_new_tokens: int = 8, **kw: Any) -> Output:
        rid = self.submit(ids, max_new_tokens, **kw)
        self.run()
        return self.outputs[rid]

    def collect(self) -> None:
        box = self.sched.detokenizer_outbox
        for msg in box:
            assert isinstance(msg, BatchTokenIDOut)
            for i, rid in enumerate(msg.rids):
                out = self.outputs.setdefault(rid, Output(rid))
                assert out.finished_reason is None, f"{rid} got a message after it finished"
                out.messages += 1
                out.output_ids += msg.output_ids[i]
                if msg.output_token_logprobs[i] is not None:
                    out.logprobs += [lp for lp, _ in msg.output_token_logprobs[i]]
                out.top_logprobs += msg.output_top_logprobs[i] or []
                out.token_ids_logprobs += msg.output_token_ids_logprobs[i] or []
                out.input_token_ids_logprobs += msg.input_token_ids_logprobs[i] or []
                if msg.input_token_logprobs[i] is not None:
                    out.input_logprobs = list(msg.input_token_logprobs[i])
                out.cached_tokens = msg.cached_tokens[i]
                out.prompt_tokens = msg.prompt_tokens[i]
                out.finished_reason = msg.finished_reasons[i]
                if i < len(msg.routed_experts) and msg.routed_experts[i] is not None:
                    out.routed_experts = encode_routed_experts(msg.routed_experts[i])  # (as the HTTP process)
                rows = msg.output_hidden_states[i]
                out.hidden_states += [] if rows is None else rows.tolist()
        box.clear()

    # ---- checks ------------------------------------------------------------------------------------

    def check_oracle(self, oracle, prompt: list[int], out: Output, tol: float = ORACLE_TOL) -> float:
        """Max |logprob - oracle| over the output tokens (the oracle scores the engine's own tokens)."""
        assert out.finished_reason is not None and len(out.logprobs) == len(out.output_ids)
        if not out.output_ids:
            return 0.0
        ref = oracle.token_logprobs(prompt + out.output_ids, start=len(prompt))
        err = (torch.tensor(out.logprobs) - ref).abs().max().item()
        assert err <= tol, f"{out.rid}: max |dlogprob| {err:.2e} > {tol:.0e} (cached {out.cached_tokens})"
        return err

    def flush_and_check_empty(self) -> None:
        ok, msg = self.sched.flush_cache()
        assert ok, msg
        state = self.sched.get_internal_state()
        assert state["mamba_usage"]["free"] == state["mamba_usage"]["total"], state
        assert state["token_usage"]["free"] == state["token_usage"]["total"], state

    def shutdown(self) -> None:
        self.sched.shutdown()


def check_penalized_oracle(oracle, prompt: list[int], out: Output, **params: Any) -> None:
    """Greedy output under logit penalties (`params`: the sampling fields of
    sglang/srt/sampling/penaltylib.py) against the oracle: every token is the argmax, and its logprob
    the log-softmax, of the oracle's logits with upstream's rules applied to the tokens before it
    (written out here, independently of the runtime's tensors)."""
    freq, pres = params.get("frequency_penalty", 0.0), params.get("presence_penalty", 0.0)
    rep, bias = params.get("repetition_penalty", 1.0), params.get("logit_bias") or {}
    min_new, stops = params.get("min_new_tokens", 0), params.get("stop_token_ids", [])
    n = len(prompt)
    logits = oracle.logits(prompt + out.output_ids)[n - 1 : n - 1 + len(out.output_ids)]
    counts = torch.zeros(logits.shape[1])
    for t, token in enumerate(out.output_ids):
        row = logits[t].clone()
        for i in counts.nonzero()[:, 0].tolist():
            row[i] = row[i] / rep if row[i] > 0 else row[i] * rep
            row[i] -= freq * counts[i] + pres
        for i, b in bias.items():
            row[int(i)] += b
        if t < min_new:
            row[list(stops)] = float("-inf")
        lp = row.log_softmax(-1)
        # Greedy: the token is the maximum (up to the engine-vs-oracle error, ORACLE_TOL).
        assert lp[token] >= lp.max() - ORACLE_TOL, f"{out.rid} step {t}: {token} is not the penalized argmax"
        assert abs(out.logprobs[t] - lp[token].item()) < ORACLE_TOL, f"{out.rid} step {t}: logprob"
        counts[token] += 1
