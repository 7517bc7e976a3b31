"""An Engine with --tp-size 2 on CPU (two gloo ranks, one scheduler process each) serves the same greedy
tokens as one rank: the transformers oracle's, with the engine's logprobs within 1e-4 of the oracle's
on its own tokens (float32; the ranks' reductions may add in another order than one rank's, which moves
a logprob by ~1e-6 at this size). In the same run a prompt longer than --chunked-prefill-size (chunked
prefill on both ranks in step) and a second prompt that extends the first (a prefix hit: every rank's
radix tree must hold the same checkpoint), a regex request (its grammar compiles on each rank's own
thread: rank 0 says when it is done), and /get_server_info lists both ranks' memory. A rank that
decided otherwise than rank 0 would take another batch or slot; the strict idle check compares the ranks'
pool counts each time they go idle. LoRA adapters at TP 2 (each rank its rows or columns of A and B; a
row-parallel module's A x all-reduced before its mask) give the merged checkpoint's tokens, a start-time
adapter and one loaded and unloaded while serving."""

from __future__ import annotations

import re

import pytest

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="per-commit-cpu")

MODEL = "tiny-qwen3-next"
# float32 on both sides; see the module docstring.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A LoRA adapter served from the start (`a`) and one loaded later (`b`), with their merged oracles."""
    from sglang.test.reference import ReferenceModel
    from sglang.tools.make_tiny_lora import make_tiny_lora, merge_lora

    root, out = tmp_path_factory.mktemp("tp_lora"), {}
    for name, seed in (("a", 1), ("b", 2)):
        path = make_tiny_lora(MODEL, root / name, seed=seed)
        out[name] = (str(path), ReferenceModel(str(merge_lora(MODEL, path, root / f"{name}-merged"))))
    return out


@pytest.fixture(scope="module")
def engine(adapters):
    import sglang

    eng = sglang.Engine(
        model_path=MODEL, tp_size=2, chunked_prefill_size=64, random_seed=7, log_level="warning",
        lora_paths=[f"a={adapters['a'][0]}"],
    )  # fmt: skip
    yield eng
    eng.shutdown()


def _check_against_oracle(oracle, ids: list[int], out: dict) -> None:
    tokens = out["output_ids"]
    assert tokens == oracle.greedy(ids, len(tokens))
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    want = oracle.token_logprobs(ids + tokens, start=len(ids)).tolist()
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < LOGPROB_TOL


def test_tp2_serves_one_rank_tokens_with_a_chunked_prefill_and_a_prefix_hit(engine, oracles):
    oracle = oracles[MODEL]
    params = {"max_new_tokens": 8, "temperature": 0}
    long_ids = [(7 * i + 3) % 400 + 5 for i in range(150)]  # > 64: three chunks
    first = engine.generate(input_ids=long_ids, sampling_params=params, return_logprob=True)
    _check_against_oracle(oracle, long_ids, first)
    longer = long_ids + first["output_ids"] + [11, 12, 13]
    second = engine.generate(input_ids=longer, sampling_params=params, return_logprob=True)
    assert second["meta_info"]["cached_tokens"] >= 128, second["meta_info"]
    _check_against_oracle(oracle, longer, second)
    batch = engine.generate(
        input_ids=[[5, 6, 7, 8] * 5, [9, 10, 11] * 9], sampling_params=params, return_logprob=True
    )
    for ids, out in zip([[5, 6, 7, 8] * 5, [9, 10, 11] * 9], batch, strict=True):
        _check_against_oracle(oracle, ids, out)


def test_a_grammar_request_compiles_while_the_ranks_wait_for_rank_0(engine):
    """Its compile ends at a time of its own on each rank: rank 0 decides when it is done (the tick)."""
    out = engine.generate("Digits:", {"max_new_tokens": 16, "temperature": 0, "regex": "(yes|no) [0-9]{3}"})
    assert re.fullmatch(r"(yes|no) [0-9]{3}", out["text"]), out["text"]


def test_server_info_lists_each_rank_memory(engine):
    info = engine.get_server_info()
    assert info["tp_size"] == 2
    ranks = info["internal_states"][0]["memory_bytes_by_rank"]
    assert len(ranks) == 2
    for mem in ranks:
        assert mem["weights"] > 0 and mem["kv_pool"] > 0 and mem["state_pool"] > 0
    assert engine.flush_cache().success


def test_a_tensor_update_reaches_every_rank(engine):
    """Engine.update_weights_from_tensor gives each TP rank its own payload (a CPU tensor's shared-memory
    handle opens once: with one payload only the first rank to open it wrote), so the gathered tensor is
    the new one on both ranks' halves. The old weights are written back for the tests after this one."""
    import torch

    name = "model.layers.0.linear_attn.out_proj.weight"  # row-parallel: each rank holds half the columns
    old = torch.tensor(engine.get_weights_by_name(name, 10**6))
    new = old * 0.5 + 0.01
    success, message = engine.update_weights_from_tensor([(name, new)], load_format="direct")
    try:
        assert success, message
        assert torch.equal(torch.tensor(engine.get_weights_by_name(name, 10**6)), new)
    finally:
        assert engine.update_weights_from_tensor([(name, old)], load_format="direct")[0]


def test_lora_adapters_on_two_ranks_match_their_merged_oracles(engine, adapters, oracles):
    params = {"max_new_tokens": 8, "temperature": 0}
    prompts = [[(5 * i + k) % 300 + 5 for i in range(20 + 7 * k)] for k in range(3)]
    loaded = engine.load_lora_adapter("b", adapters["b"][0])
    assert loaded["success"], loaded
    assert loaded["loaded_adapters"] == {"a": adapters["a"][0], "b": adapters["b"][0]}
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, lora_path=["a", None, "b"])
    for ids, out, oracle in zip(prompts, outs, [adapters["a"][1], oracles[MODEL], adapters["b"][1]], strict=True):
        _check_against_oracle(oracle, ids, out)
    assert engine.unload_lora_adapter("b")["loaded_adapters"] == {"a": adapters["a"][0]}
    with pytest.raises(ValueError, match="'b', which is not loaded"):
        engine.generate(input_ids=prompts[0], sampling_params=params, lora_path="b")


def test_each_rank_writes_its_trace_and_a_stop_answers_for_both(engine, tmp_path):
    """/start_profile at TP 2: every rank runs the message, traces its own batches and writes its own
    file (upstream's names, TP-0 and TP-1); the stop's reply comes after both ranks agreed."""
    from sglang.srt.environ import envs

    with envs.SGLANG_TORCH_PROFILER_DIR.override(str(tmp_path)):
        assert engine.start_profile(profile_id="tp", with_stack=False).success
    engine.generate(input_ids=[5, 6, 7, 8] * 4, sampling_params={"max_new_tokens": 4, "temperature": 0})
    stopped = engine.stop_profile()
    assert stopped.success, stopped.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp-TP-0.trace.json.gz", "tp-TP-1.trace.json.gz"]
    again = engine.stop_profile()
    assert not again.success and "not in progress" in again.message
