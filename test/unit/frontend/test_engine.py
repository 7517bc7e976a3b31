"""sglang.Engine: generate (single, batch, n, streaming), async use, abort on close, control, startup
errors and shutdown. Mostly against the fake scheduler (same protocol, no model); the last test runs the
real scheduler through the same front end."""

from __future__ import annotations

import asyncio
import base64
import math
import pstats
import threading
import time
import types

import numpy as np
import pytest
import torch

import sglang
from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.entrypoints.process_launcher import ServerStartupError
from sglang.srt.environ import envs
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.managers.tokenizer_manager import BackendDeadError
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
from sglang.test import fake_scheduler
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import noisy_checkpoint, served_tensors
from sglang.test.reference import ReferenceModel
from sglang.test.test_utils import find_free_port
from sglang.test.weight_broadcaster import Broadcaster

register_cpu_ci(est_time=20, suite="per-commit-cpu")

GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def engine():
    # A slow fake forward, so that a stream can be closed while its request still runs.
    with envs.SGLANG_TEST_FORWARD_DELAY_MS.override(20):
        eng = sglang.Engine(
            scheduler_entry=fake_scheduler.run_scheduler_process, model_path="tiny-qwen3-next"
        )
    yield eng
    eng.shutdown()


def wait_idle(eng, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = eng.get_internal_state()
        if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
            return state
        time.sleep(0.05)
    raise AssertionError(f"not idle after {timeout} s: {state}")


def test_generate_single(engine):
    out = engine.generate(
        input_ids=[5, 6, 7], sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2
    )
    expected, prev = [], 7
    for pos in range(3, 9):
        prev = fake_scheduler.fake_token(prev, pos, 0, 512)
        expected.append(prev)
    assert out["output_ids"] == expected
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 6)
    assert [e[1] for e in meta["output_token_logprobs"]] == expected
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert meta["input_token_logprobs"] == []  # logprob_start_len defaults to -1


def test_generate_batch_and_n(engine):
    outs = engine.generate(["a", "bb"], [{"max_new_tokens": 2}, {"max_new_tokens": 3}])
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 3]
    outs = engine.generate("a", {"max_new_tokens": 2, "n": 3})
    assert len(outs) == 3 and len({o["meta_info"]["id"] for o in outs}) == 3


def test_a_batch_larger_than_the_http_bound_is_taken(engine):
    """The HTTP server bounds a request's sequences (--max-samples-per-request, 4,096 by default); the
    Engine, as upstream's, takes a batch of any size unless the flag is given."""
    outs = engine.generate(input_ids=[[5, 6]] * 4100, sampling_params={"max_new_tokens": 1})
    assert len(outs) == 4100 and all(len(o["output_ids"]) == 1 for o in outs)
    assert engine.get_server_info()["max_samples_per_request"] is None  # (what it reports: no bound)


def test_stream_is_cumulative_and_matches_non_stream(engine):
    full = engine.generate(input_ids=[9, 10], sampling_params=GREEDY)
    chunks = list(engine.generate(input_ids=[9, 10], sampling_params=GREEDY, stream=True))
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["output_ids"] == full["output_ids"] and chunks[-1]["text"] == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_closing_a_stream_aborts_the_request(engine):
    before = wait_idle(engine)["counters"]["num_generation_tokens_total"]
    it = engine.generate(input_ids=[11, 12], sampling_params={"max_new_tokens": 3000}, stream=True)
    next(it), next(it)
    it.close()
    state = wait_idle(engine, timeout=5)
    # 3000 tokens at 20 ms each would take a minute; idle within seconds means it was aborted.
    assert state["counters"]["num_generation_tokens_total"] == before, "an aborted request is not counted"


def test_async_generate_from_another_loop(engine):
    async def main():
        out = await engine.async_generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
        stream = await engine.async_generate(input_ids=[5, 6, 7], sampling_params=GREEDY, stream=True)
        chunks = [c async for c in stream]
        return out, chunks

    out, chunks = asyncio.run(main())
    assert chunks[-1]["output_ids"] == out["output_ids"]


def test_bad_input_raises_at_the_call(engine):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate(input_ids=[1, 99999])
    with pytest.raises(RequestError) as e:
        engine.generate("x", {"temperature": -1}, stream=True)
    assert e.value.param == "sampling_params.temperature"


def test_flush_and_server_info(engine):
    engine.generate(input_ids=[1, 2, 3, 4], sampling_params={"max_new_tokens": 1})
    second = engine.generate(input_ids=[1, 2, 3, 4, 5], sampling_params={"max_new_tokens": 1})
    assert second["meta_info"]["cached_tokens"] == 4
    assert engine.flush_cache().success
    info = engine.get_server_info()
    assert info["model_path"] == "tiny-qwen3-next" and info["vocab_size"] == 512
    state = info["internal_states"][0]
    assert state["token_usage"]["held_by_tree"] == 0 and state["mamba_usage"]["held_by_requests"] == 0


@pytest.mark.parametrize(
    "entry, words",
    [
        (fake_scheduler.run_failing_scheduler_process, "the fake model cannot be loaded"),
        (fake_scheduler.run_crashing_scheduler_process, "exited (code 3)"),
    ],
)
def test_startup_failure_is_one_clear_error(entry, words):
    with pytest.raises(ServerStartupError) as e:
        sglang.Engine(scheduler_entry=entry, model_path="tiny-qwen3-next")
    assert words in str(e.value) and "scheduler" in str(e.value)


def test_dead_scheduler_fails_requests_and_shutdown_is_idempotent():
    with envs.SGLANG_TEST_FORWARD_DELAY_MS.override(20):
        eng = sglang.Engine(
            scheduler_entry=fake_scheduler.run_scheduler_process, model_path="tiny-qwen3-next"
        )
    procs = list(eng._launched.processes)
    it = eng.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 3000}, stream=True)
    next(it)
    procs[0].kill()  # the scheduler dies mid-request: the request fails instead of hanging
    with pytest.raises(BackendDeadError):
        for _ in it:
            pass
    eng.shutdown()
    eng.shutdown()
    assert all(not p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate("x")


def test_shutdown_ends_a_call_waiting_on_another_thread():
    """A call blocked on another thread (sync or async) ends with an error when the engine shuts down;
    it waited forever: the stopped loop never completed its future (found by sglang.test.combo_sweep's
    timeout). The loop bridge alone, with a call that never returns, as an Engine's generate waits."""

    class Closing:
        async def close(self):
            pass

    eng = sglang.Engine.__new__(sglang.Engine)
    eng._closed, eng._loop = False, asyncio.new_event_loop()
    eng._thread = threading.Thread(target=eng._loop.run_forever, daemon=True)
    eng._thread.start()
    eng.tokenizer_manager, eng._launched = Closing(), types.SimpleNamespace(shutdown=lambda: None)
    errors: list[BaseException] = []

    def call(sync: bool):
        try:
            if sync:
                eng._run(asyncio.Event().wait())
            else:
                asyncio.run(eng._await(asyncio.Event().wait()))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(sync,), daemon=True) for sync in (True, False)]
    for t in threads:
        t.start()
    while len(asyncio.all_tasks(eng._loop)) < 2:
        time.sleep(0.01)
    eng.shutdown()
    for t in threads:
        t.join(5)
        assert not t.is_alive(), "a call still waits after shutdown"
    assert len(errors) == 2 and all("shut down while the call ran" in str(e) for e in errors), errors


def test_a_control_call_fails_at_once_when_the_scheduler_is_gone():
    eng = sglang.Engine(scheduler_entry=fake_scheduler.run_scheduler_process, model_path="tiny-qwen3-next")
    scheduler = eng._launched.processes[0]
    scheduler.kill()
    scheduler.join(5)
    start = time.monotonic()
    with pytest.raises(BackendDeadError):
        eng.flush_cache()  # (its reply would never come: it waited out the 30 s control timeout)
    assert time.monotonic() - start < 5
    eng.shutdown()


def test_real_scheduler_through_the_engine(tmp_path):
    # Also under SGLANG_CPROFILE_DIR: the scheduler process writes its profile when the engine stops it.
    with envs.SGLANG_CPROFILE_DIR.override(str(tmp_path)), pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path / "experts"))
        eng = sglang.Engine(
            model_path="tiny-qwen3-next", mamba_scheduler_strategy="extra_buffer_lazy", enable_return_routed_experts=True,
            expert_distribution_recorder_mode="stat",
        )  # fmt: skip
    with eng:
        out = eng.generate(input_ids=list(range(3, 40)), sampling_params=GREEDY, return_logprob=True)
        assert out["meta_info"]["completion_tokens"] == 6 and "routed_experts" not in out["meta_info"]
        # Routing replay (upstream's meta_info["routed_experts"]): base64 int32 [37 + 6 - 1, layers 4, top-2].
        routed = eng.generate(input_ids=list(range(3, 40)), sampling_params=GREEDY, return_routed_experts=True)
        routes = np.frombuffer(base64.b64decode(routed["meta_info"]["routed_experts"]), dtype="<i4")
        assert routes.shape == (42 * 4 * 2,) and routed["output_ids"] == out["output_ids"]
        chunks = list(eng.generate(input_ids=list(range(3, 40)), sampling_params=GREEDY, stream=True))
        assert chunks[-1]["output_ids"] == out["output_ids"], "greedy output is deterministic"
        # Upstream's Engine.score: the first greedy token's probability is its logprob's exp.
        first_id, first_lp = out["output_ids"][0], out["meta_info"]["output_token_logprobs"][0][0]
        (score,) = eng.score(query=list(range(3, 30)), items=[list(range(30, 40))], label_token_ids=[first_id, 7])
        assert abs(score[0] - math.exp(first_lp)) < 1e-6 and 0 < score[1] < 1
        # Upstream's expert distribution recorder: the routers' picks of the forwards run meanwhile.
        assert eng.start_expert_distribution_record().success
        eng.generate(input_ids=list(range(3, 20)), sampling_params=GREEDY)
        assert eng.stop_expert_distribution_record().success
        dumped = eng.dump_expert_distribution_record()
        count = torch.load(dumped.message, weights_only=True)["logical_count"]
        assert str(tmp_path / "experts") in dumped.message and count.sum().item() == (17 + 5) * 2 * 4  # (k 2, 4 layers)
        # Upstream's Engine.start_profile / stop_profile: a trace of the batches run meanwhile.
        with envs.SGLANG_TORCH_PROFILER_DIR.override(str(tmp_path)):
            assert eng.start_profile(output_dir="prof", profile_id="eng", with_stack=False).success
            with pytest.raises(RequestError) as e:
                eng.start_profile(output_dir="/etc")
            assert e.value.param == "output_dir"
        eng.generate(input_ids=list(range(3, 20)), sampling_params=GREEDY)
        stopped = eng.stop_profile()
        assert stopped.success and (tmp_path / "prof" / "eng-TP-0.trace.json.gz").stat().st_size > 0, stopped
        prompt = list(range(100, 300))
        outs = [eng.generate(input_ids=prompt, sampling_params=GREEDY, extra_key=key) for key in "aba"]
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        assert cached[0] == 0 and cached[1] == 0 and cached[2] > 0, cached
        with pytest.raises(RequestError, match="--enable-return-hidden-states"):
            eng.generate(input_ids=prompt, sampling_params=GREEDY, return_hidden_states=True)
        # Upstream's refit call (the same weights here: the outputs stay, the label and the cache change).
        assert eng.update_weights_from_disk("tiny-qwen3-next", weight_version="v2") == (
            True, "Succeeded to update model weights.", 0
        )  # fmt: skip
        again = eng.generate(input_ids=prompt, sampling_params=GREEDY, extra_key="a")
        assert again["output_ids"] == outs[2]["output_ids"] and again["meta_info"]["cached_tokens"] == 0
        # The swapped-in model's MoE layers record too (the same weights: the same routes).
        rerouted = eng.generate(input_ids=list(range(3, 40)), sampling_params=GREEDY, return_routed_experts=True)
        assert rerouted["meta_info"]["routed_experts"] == routed["meta_info"]["routed_experts"]
        assert again["meta_info"]["weight_version"] == "v2"
        with pytest.raises(RequestError, match="flush_cache must be a bool") as e:
            eng.update_weights_from_disk("tiny-qwen3-next", flush_cache="no")
        assert e.value.param == "flush_cache"
        with pytest.raises(TypeError, match="flush_cahce"):
            eng.update_weights_from_disk("tiny-qwen3-next", flush_cahce=False)
        # Upstream's in-place refit: B's tensors reach the spawned scheduler by file descriptor; then A's.
        path_b = noisy_checkpoint(resolve_model_path("tiny-qwen3-next"), tmp_path / "b")
        tensors_b = served_tensors(path_b)
        tensors_a = served_tensors(resolve_model_path("tiny-qwen3-next"))
        assert eng.update_weights_from_tensor(list(tensors_b.items())) == (
            True, f"Succeeded to update {len(tensors_b)} weight tensor(s) in place."
        )  # fmt: skip
        on_b = eng.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        assert on_b == ReferenceModel(path_b).greedy(prompt, GREEDY["max_new_tokens"])
        bucket = FlattenedTensorBucket(named_tensors=list(tensors_a.items()))
        flat = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        payload = MultiprocessingSerializer.serialize(flat, output_str=True)
        assert eng.update_weights_from_tensor([payload], load_format="flattened_bucket")[0]
        assert eng.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == outs[2]["output_ids"]
        with pytest.raises(RequestError, match="load_format") as e:
            eng.update_weights_from_tensor([], load_format="pt")
        assert e.value.param == "load_format"
        with pytest.raises(TypeError, match=r"named_tensors\[0\]"):
            eng.update_weights_from_tensor([("model.norm.weight", [1.0])])
        with pytest.raises(TypeError, match="serialized payloads"):
            eng.update_weights_from_tensor(list(tensors_a.items()), load_format="flattened_bucket")
        # Upstream's weight-update group: B's weights broadcast by a trainer, then A's.
        port = find_free_port()
        trainer = Broadcaster(port)
        try:
            joined = eng.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
            assert joined == (True, "Succeeded to join.")
            for tensors, want in [(tensors_b, on_b), (tensors_a, outs[2]["output_ids"])]:
                trainer.broadcast(list(tensors.items()))
                dtypes = [t.dtype for t in tensors.values()]  # torch dtypes, as upstream's Engine takes them
                shapes = [t.shape for t in tensors.values()]
                assert eng.update_weights_from_distributed(list(tensors), dtypes, shapes)[0]
                assert eng.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == want
            assert eng.destroy_weights_update_group()[0]
        finally:
            trainer.close()
        assert eng.get_weights_by_name("model.norm.weight", 2) == tensors_a["model.norm.weight"][:2].tolist()
        # Without --enable-memory-saver the memory stays, as upstream's does; the calls succeed.
        assert eng.release_memory_occupation(["kv_cache"]) == (
            True, "Nothing was released: start the server with --enable-memory-saver."
        )  # fmt: skip
        assert eng.resume_memory_occupation()[0]
        with pytest.raises(RequestError, match="tags"):
            eng.release_memory_occupation(["kv"])
        it = eng.generate(
            input_ids=[5, 6], sampling_params={"max_new_tokens": 3000, "ignore_eos": True}, stream=True
        )
        next(it)
        it.close()
        state = wait_idle(eng, timeout=20)
        assert state["mamba_usage"]["held_by_requests"] == 0 and state["token_usage"]["held_by_requests"] == 0
    (profile,) = tmp_path.glob("scheduler-*.prof")
    assert any(name == "event_loop" for _, _, name in pstats.Stats(str(profile)).stats)


def test_skip_tokenizer_init_serves_ids_without_text():
    # The fake scheduler's tokens, through the real detokenizer process with no tokenizer loaded.
    entry = fake_scheduler.run_scheduler_process
    with sglang.Engine(scheduler_entry=entry, model_path="tiny-qwen3-next", skip_tokenizer_init=True) as eng:
        assert eng.tokenizer_manager.tokenizer is None
        out = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, return_logprob=True)
        expected, prev = [], 7
        for pos in range(3, 9):
            prev = fake_scheduler.fake_token(prev, pos, 0, 512)
            expected.append(prev)
        assert set(out) == {"output_ids", "meta_info"} and out["output_ids"] == expected
        assert [e[2] for e in out["meta_info"]["output_token_logprobs"]] == [None] * 6
        with pytest.raises(RequestError, match="cannot accept text prompts") as e:
            eng.generate("Hello", GREEDY)
        assert e.value.param == "text"


def test_engine_refuses_a_transfer_backend_like_the_server(monkeypatch):
    # NIXL is a test dependency: hide it to see the refusal a machine without it gets.
    from sglang.srt.disaggregation import nixl_backend

    monkeypatch.setattr(nixl_backend, "nixl_module", lambda: None)
    with pytest.raises(ServerStartupError, match="--disaggregation-transfer-backend nixl: NIXL is not installed here"):
        sglang.Engine(
            scheduler_entry=fake_scheduler.run_scheduler_process,
            disaggregation_mode="prefill",
            disaggregation_transfer_backend="nixl",
        )


def test_a_slow_stream_reader_still_gets_the_last_tokens(engine):
    # The request finishes while the caller holds its first chunk; the stream used to end at once
    # (its requests were finished) without the tokens that had arrived meanwhile.
    it = engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, stream=True)
    chunks = [next(it)]
    time.sleep(6 * 0.02 + 0.5)  # six forwards of the fake scheduler's 20 ms, with room
    chunks += list(it)
    full = engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert len(chunks[0]["output_ids"]) < 6
    assert chunks[-1]["output_ids"] == full["output_ids"] and len(full["output_ids"]) == 6
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
