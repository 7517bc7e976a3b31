"""LoRA adapters served by a real scheduler, against the transformers oracle run on the checkpoint with
the adapter merged into its weights (PEFT's forward in evaluation is exactly `W x + scaling * B A x`).

Each architecture's own rules are crossed: Qwen3-Next's regrouped input projections, Qwen3.5's
projections stored as pieces of one fused module, Granite's split shared MLP and folded multipliers,
Falcon-H1's per-row multipliers, Nemotron-H's Mamba2 projections, LFM2's renamed modules. Every batch
mixes requests on two adapters with requests on the base model."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.reference import ReferenceModel
from sglang.test.scheduler_harness import SchedulerHarness, token_ids
from sglang.tools.make_tiny_lora import make_tiny_lora, merge_lora

register_cpu_ci(est_time=45, suite="per-commit-cpu")

# Engine vs oracle, float32, teacher-forced: ~1e-5 on the tiny presets (as `ORACLE_TOL`); an adapter left
# out, or applied to the wrong rows, moves the logprobs by > 0.1 (the adapters are as large as the weights).
TOL = 1e-4


class Adapters:
    """Per preset: adapters `a` and `b` (different seeds and targets) and their merged oracles."""

    def __init__(self, root):
        self.root, self.made = root, {}

    def get(self, preset: str, name: str, **kw):
        key = (preset, name)
        if key not in self.made:
            seed = {"a": 1, "b": 2, "c": 3}[name]
            path = make_tiny_lora(preset, self.root / f"{preset}-{name}", seed=seed, rank=4 + 4 * (name == "b"), **kw)
            self.made[key] = (path, ReferenceModel(str(merge_lora(preset, path, self.root / f"{preset}-{name}-merged"))))
        return self.made[key]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return Adapters(tmp_path_factory.mktemp("lora"))


PRESETS = ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-granite-4.0-h", "tiny-falcon-h1", "tiny-nemotron-h", "tiny-lfm2"]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_batch_of_two_adapters_and_the_base_model_matches_each_merged_oracle(preset, adapters, oracles):
    (a, oracle_a), (b, oracle_b) = adapters.get(preset, "a"), adapters.get(preset, "b")
    h = SchedulerHarness(preset, lora_paths=[f"a={a}", f"b={b}"])
    if preset == "tiny-qwen3-next":
        h.use_graph_bodies([1, 2, 4, 8])  # the decode graphs' bodies: static slots, a mask for every batch
    cases = [(name, token_ids(12 + 3 * i, seed=40 + i)) for i, name in enumerate(["a", None, "b", "a", None, "b"])]
    rids = [h.submit(p, 6, lora=name) for name, p in cases]
    h.run()
    for (name, prompt), rid in zip(cases, rids, strict=True):
        oracle = {"a": oracle_a, "b": oracle_b, None: oracles[preset]}[name]
        h.check_oracle(oracle, prompt, h.outputs[rid], TOL)
        other = oracles[preset] if name else oracle_a
        assert h.outputs[rid].output_ids != other.greedy(prompt, 6), "the adapter changed nothing"
    h.flush_and_check_empty()


def test_cached_prefixes_stay_with_their_adapter(adapters, oracles):
    """An adapter's prompt states are its own: the base model (or another adapter) never hits them."""
    (a, oracle_a), (b, oracle_b) = adapters.get("tiny-qwen3-next", "a"), adapters.get("tiny-qwen3-next", "b")
    h = SchedulerHarness("tiny-qwen3-next", lora_paths=[f"a={a}", f"b={b}"], mamba_scheduler_strategy="extra_buffer")
    prompt = token_ids(160, seed=7)
    first = h.generate(prompt, 4, lora="a")
    for name, oracle in [(None, oracles["tiny-qwen3-next"]), ("b", oracle_b)]:
        out = h.generate(prompt, 4, lora=name)
        assert out.cached_tokens == 0, f"{name} hit adapter a's prefix"
        h.check_oracle(oracle, prompt, out, TOL)
    again = h.generate(prompt, 4, lora="a")
    assert again.cached_tokens > 0 and again.output_ids == first.output_ids
    h.check_oracle(oracle_a, prompt, again, TOL)


def _three_adapters_in_two_slots(adapters, **flags):
    """Adapters a, b, c of tiny-qwen3-next (with their merged oracles) and a harness serving them in two
    slots (the base model counting as one), chunked prefill of 64."""
    made = {name: adapters.get("tiny-qwen3-next", name) for name in "abc"}
    h = SchedulerHarness(
        "tiny-qwen3-next",
        lora_paths=[f"{n}={p}" for n, (p, _) in made.items()],
        max_loras_per_batch=2,
        chunked_prefill_size=64,
        **flags,
    )
    return made, h


def test_more_adapters_than_slots_wait_their_turn_under_chunked_prefill(adapters):
    """Three adapters, two slots (the base model's requests counting as one): every request still
    runs on its own adapter (slots freed and refilled between batches), chunked prompts included."""
    made, h = _three_adapters_in_two_slots(adapters)
    loads = []
    apply = h.sched.model_runner.lora.apply_loads
    h.sched.model_runner.lora.apply_loads = lambda batch_loads: (loads.extend(batch_loads), apply(batch_loads))
    cases = [(n, token_ids(30 + 40 * (i % 3), seed=60 + i)) for i, n in enumerate("abcabc")]
    rids = [h.submit(p, 5, lora=n) for n, p in cases]
    h.run()
    for (name, prompt), rid in zip(cases, rids, strict=True):
        h.check_oracle(made[name][1], prompt, h.outputs[rid], TOL)
    assert len([uid for _, uid in loads if uid is not None]) > 2, "three adapters in two slots: some were replaced"
    h.flush_and_check_empty()


@pytest.mark.parametrize("algorithm", ["NGRAM", "NEXTN"])
def test_speculative_verifies_run_each_request_on_its_adapter(algorithm, adapters, oracles):
    """The verify of drafts (NGRAM's from the n-gram table, NEXTN's from the base model's MTP layer:
    adapters change the target model only) runs each request's positions on its adapter: the second
    round's drafts are accepted (NGRAM) and every output is its oracle's."""
    a, oracle_a = adapters.get("tiny-qwen3-next", "a")
    spec = dict(speculative_algorithm=algorithm, speculative_num_draft_tokens=4)
    if algorithm == "NEXTN":
        spec.update(speculative_num_steps=3, speculative_eagle_topk=1)
    h = SchedulerHarness("tiny-qwen3-next", lora_paths=[f"a={a}"], **spec)
    prompt = token_ids(30, seed=5)
    for _ in range(2):  # (the second round drafts from the first's outputs)
        rids = [h.submit(prompt, 12, lora="a"), h.submit(prompt, 12)]
        h.run()
        for rid, oracle in zip(rids, [oracle_a, oracles["tiny-qwen3-next"]], strict=True):
            h.check_oracle(oracle, prompt, h.outputs[rid], TOL)
    stats = h.sched.spec.stats
    assert stats["verify_steps"] > 0 and (algorithm != "NGRAM" or stats["accepted_tokens"] > 0), stats


def test_a_request_whose_adapter_does_not_fit_is_not_passed_and_priority_never_preempts_for_it(adapters):
    """--max-loras-per-batch 2 with the base model and adapter a running: a request on b waits, and
    nobody behind it passes it (a steady stream of base and a requests starved it when later requests
    went first); with priority scheduling, a preferred request on b preempts nobody (room made for it
    would not admit it: it preempted and re-admitted the same request step after step)."""
    (a, _), (b, oracle_b) = adapters.get("tiny-qwen3-next", "a"), adapters.get("tiny-qwen3-next", "b")
    for priority in (False, True):
        h = SchedulerHarness("tiny-qwen3-next", lora_paths=[f"a={a}", f"b={b}"], max_loras_per_batch=2,
                             max_running_requests=3 if priority else 32, enable_priority_scheduling=priority)  # fmt: skip
        s = h.sched
        for i, name in enumerate([None, "a", "a"]):
            h.submit(token_ids(20, seed=i), 30, lora=name)
        for _ in range(4):
            s.step()
        prompt = token_ids(20, seed=9)
        y = h.submit(prompt, 5, lora="b")
        s.reqs_by_rid[y].priority = 100
        later = []
        for step in range(300):
            if step % 5 == 0 and step < 150:
                later += [h.submit(token_ids(20, seed=100 + step), 10, lora=name) for name in (None, "a")]
            s.step()
            h.collect()
            if h.outputs[y].finished_reason is not None:
                break
        out = h.outputs[y]
        assert out.finished_reason is not None, f"the request on b never ran (priority={priority})"
        h.check_oracle(oracle_b, prompt, out, TOL)
        assert not any(h.outputs[r].output_ids for r in later[4:]), "later requests passed it"
        assert s.counters["num_preemptions_total"] == 0
        h.run()


def test_an_unloaded_adapter_stays_for_its_requests_then_frees_its_place_at_once(adapters):
    """Unloading: a request sent before (here still compiling its grammar) finishes on the adapter,
    not on the base model; once none holds it the adapter's place is free at once (a load under
    --max-loaded-loras 2 was refused until some other request came)."""
    import json
    from concurrent.futures import Future

    from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput

    (a, _), (b, _), (c, _) = (adapters.get("tiny-qwen3-next", n) for n in "abc")
    h = SchedulerHarness("tiny-qwen3-next", lora_paths=[f"a={a}"], max_loaded_loras=2, max_loras_per_batch=2,
                         max_lora_rank=8)  # fmt: skip
    schema = json.dumps({"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]})
    prompt = token_ids(20, seed=11)
    # (Grammar masks renormalize the logprobs: the reference is the same request before the unload.)
    want, base = (h.generate(prompt, 8, lora=name, json_schema=schema) for name in ("a", None))
    assert want.output_ids != base.output_ids
    backend, held = h.sched.grammar_queue.backend, []
    submit = backend.submit
    backend.submit = lambda *key: held.append((f := Future(), submit(*key))) or f  # the compile held
    rid = h.submit(prompt, 8, lora="a", json_schema=schema)
    h.sched.step()
    a_id = h.lora_id("a")
    assert h.control_reply(UnloadLoRAAdapterReqInput("a", a_id)).success
    h.submit(token_ids(10, seed=12), 1)  # (an admission pass)
    for _ in range(3):
        h.sched.step()
    assert h.sched.lora.knows(a_id)  # its request still compiles its grammar
    for future, result in held:
        future.set_result(result.result())
    backend.submit = submit
    h.run()
    got = h.outputs[rid]
    assert got.output_ids == want.output_ids and max(abs(x - y) for x, y in zip(got.logprobs, want.logprobs, strict=True)) < TOL
    assert not h.sched.lora.knows(a_id) and a_id not in h.sched.model_runner.lora.adapters
    assert h.control_reply(LoadLoRAAdapterReqInput("b", str(b), lora_id="b:1")).success
    assert h.control_reply(UnloadLoRAAdapterReqInput("b", "b:1")).success
    assert not h.sched.lora.knows("b:1")  # freed at the unload: nothing held it
    assert h.control_reply(LoadLoRAAdapterReqInput("c", str(c), lora_id="c:1")).success


def test_all_target_modules_and_an_adapter_loaded_while_serving(adapters):
    """--enable-lora without --lora-paths (--max-lora-rank and --lora-target-modules all): every linear
    takes slots, and an adapter loaded by a control call serves its merged oracle's tokens (its pieces of
    the fused Gated DeltaNet projections included)."""
    from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput, TokenizedGenerateReqInput
    from sglang.srt.managers.request_validation import cache_namespace
    from sglang.srt.sampling.sampling_params import SamplingParams

    a, oracle_a = adapters.get("tiny-qwen3.5", "a")
    h = SchedulerHarness("tiny-qwen3.5", enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])
    assert "model.layers.0.linear_attn.in_proj_qkvz" in h.sched.model_runner.lora.modules
    assert h.control_reply(LoadLoRAAdapterReqInput("a", str(a), lora_id="a:1")).success
    prompt = token_ids(25, seed=21)
    params = SamplingParams.from_dict(dict(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    h.sched.add_request(TokenizedGenerateReqInput(
        rid="on-a", input_text=None, input_ids=prompt, sampling_params=params, return_logprob=True,
        lora_id="a:1", extra_key=cache_namespace(None, None, "a:1"),
    ))  # fmt: skip
    h.run()
    h.check_oracle(oracle_a, prompt, h.outputs["on-a"], TOL)


def test_mixed_chunks_carry_each_decode_rows_adapter(adapters):
    """--enable-mixed-chunk: decode rows on adapters ride in prefill batches of other adapters' long
    prompts (three adapters, two slots); every request matches its merged oracle."""
    made, h = _three_adapters_in_two_slots(adapters, enable_mixed_chunk=True)
    mixed = []
    launch = h.sched.launch
    h.sched.launch = lambda batch: (mixed.append(batch.num_decode_rows), launch(batch))
    cases = [("a", token_ids(20, seed=70), 30), ("b", token_ids(25, seed=71), 30)]
    rids = [h.submit(p, n, lora=name) for name, p, n in cases]
    for _ in range(3):
        h.sched.step()
    late = [("a", token_ids(300, seed=72), 4), ("c", token_ids(200, seed=73), 4), ("b", token_ids(260, seed=74), 4)]
    rids += [h.submit(p, n, lora=name) for name, p, n in late]
    h.run()
    for (name, prompt, _), rid in zip(cases + late, rids, strict=True):
        h.check_oracle(made[name][1], prompt, h.outputs[rid], TOL)
    assert sum(n > 0 for n in mixed) >= 4, mixed
    h.flush_and_check_empty()
