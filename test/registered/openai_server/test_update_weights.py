"""Upstream's RL refit routes on a real server: /update_weights_from_disk, /update_weights_from_tensor,
the weight-update group's (/init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group), /update_weight_version and /get_weight_version, with
meta_info.weight_version in every reply.

Two checkpoints of one network: A (the preset) and B (A's weights plus seeded noise), each with its
transformers oracle. Greedy outputs match A's oracle before an update and B's after; the prefix cache
(KV and recurrent states A computed) is emptied with the swap; a request running when the update comes
finishes with A while new requests wait for B; after a retract pause, a paused request continues on B
from where it was; an in-place pause refuses a flushing update; a bad update is refused with the old
weights still serving. Each step of the model takes 20 ms or more, so long requests run for a while.
The server runs with --admin-api-key only, as an RL trainer's may: the management routes take that key,
generation is open.
"""

from __future__ import annotations

import base64
import os
import pickle
import threading
import time
from pathlib import Path

import orjson
import requests
import torch

from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import noisy_checkpoint, served_tensors
from sglang.test.reference import ReferenceModel
from sglang.test.test_utils import ServerTestCase, find_free_port
from sglang.test.weight_broadcaster import Broadcaster

register_cpu_ci(est_time=45, suite="per-commit-cpu")

PROMPT = [5, 6, 7, 8, 9, 10, 11]
LONG_PROMPT = list(range(20, 60))
CACHED_PROMPT = list(range(100, 250))  # past the first cache chunk (64 tokens): a snapshot is kept
NEW_TOKENS = 8
LONG_TOKENS = 40
ADMIN_KEY = "sk-admin-test"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class StreamReader(threading.Thread):
    def __init__(self, base_url: str, body: dict):
        super().__init__(daemon=True)
        self.base_url, self.body = base_url, {**body, "stream": True}
        self.events: list[dict] = []
        self.done_at: float | None = None

    def run(self) -> None:
        with requests.post(self.base_url + "/generate", json=self.body, stream=True, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    self.events.append(orjson.loads(line[6:]))
        self.done_at = time.monotonic()

    def wait_events(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < n:
            assert time.monotonic() < deadline, f"only {len(self.events)} events"
            time.sleep(0.01)


class Call(threading.Thread):
    """A POST in the background, keeping its reply and when it came."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.reply: requests.Response | None = None
        self.done_at: float | None = None
        self.start()

    def run(self) -> None:
        self.reply = requests.post(self.url, json=self.body, headers=ADMIN, timeout=120)
        self.done_at = time.monotonic()


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class TestUpdateWeights(ServerTestCase):
    server_args = ["--mamba-scheduler-strategy", "extra_buffer_lazy", "--weight-version", "base"]
    server_args += ["--enable-memory-saver", "--admin-api-key", ADMIN_KEY]
    env = {"SGLANG_TEST_FORWARD_DELAY_MS": "20"}

    @classmethod
    def headers(cls) -> dict[str, str]:
        return ADMIN

    @classmethod
    def prepare(cls, folder: Path) -> None:
        cls.path_a = resolve_model_path(cls.model)
        cls.path_b = noisy_checkpoint(cls.path_a, folder / "b")
        cls.oracle_a, cls.oracle_b = ReferenceModel(cls.path_a), ReferenceModel(cls.path_b)
        assert cls.oracle_a.greedy(PROMPT, NEW_TOKENS) != cls.oracle_b.greedy(PROMPT, NEW_TOKENS)

    def setUp(self) -> None:
        self.wait_idle()

    def tearDown(self) -> None:
        self.post("/continue_generation", {})
        r = self.update(self.path_a, weight_version="base")  # the next test starts on A
        self.assertEqual(r.status_code, 200, r.text)
        state = self.wait_idle()
        self.assertEqual(state["mamba_usage"]["held_by_requests"], 0)

    def update(self, path: str, **fields) -> requests.Response:
        return self.post("/update_weights_from_disk", {"model_path": path, **fields})

    def greedy(self, ids: list[int], n: int = NEW_TOKENS) -> dict:
        body = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        return self.generate(input_ids=ids, sampling_params=body)

    def long_stream(self) -> StreamReader:
        body = {"max_new_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}
        reader = StreamReader(self.base_url, {"input_ids": LONG_PROMPT, "sampling_params": body})
        reader.start()
        return reader

    def test_management_routes_take_the_admin_key_and_generation_is_open(self) -> None:
        for path in [
            "/update_weights_from_disk",
            "/pause_generation",
            "/flush_cache",
            "/get_weights_by_name",
        ]:
            r = requests.post(self.base_url + path, json={}, timeout=30)
            self.assertEqual((r.status_code, r.json()["error"]["code"]), (401, "invalid_api_key"), path)
        self.assertEqual(
            requests.post(self.base_url + "/flush_cache", headers=ADMIN, timeout=30).status_code, 200
        )
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        self.assertEqual(requests.post(self.base_url + "/generate", json=body, timeout=60).status_code, 200)

    def test_a_preset_name_is_refused_before_anything_is_generated(self) -> None:
        """It made the scheduler generate the preset into its cache (minutes of CPU) before refusing it."""
        start = time.monotonic()
        r = self.update("tiny-nemotron-h")
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "model_path"), r.text)
        self.assertIn("preset", r.json()["error"]["message"])
        self.assertLess(time.monotonic() - start, 2.0)  # a parse error; generating took minutes

    def test_an_update_swaps_the_weights_flushes_the_cache_and_labels_replies(self) -> None:
        out = self.greedy(CACHED_PROMPT)
        self.assertEqual(out["output_ids"], self.oracle_a.greedy(CACHED_PROMPT, NEW_TOKENS))
        self.assertEqual(out["meta_info"]["weight_version"], "base")
        self.assertGreater(self.greedy(CACHED_PROMPT)["meta_info"]["cached_tokens"], 0)

        r = self.update(self.path_b, weight_version="step-1")
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json(), {"success": True, "message": "Succeeded to update model weights.",
                                    "num_paused_requests": 0})  # fmt: skip
        self.assertEqual(self.get("/get_weight_version").json(), {"weight_version": "step-1"})
        info = self.get("/get_model_info").json()
        self.assertEqual((info["model_path"], info["weight_version"]), (self.path_b, "step-1"))

        out = self.greedy(CACHED_PROMPT)
        self.assertEqual(out["output_ids"], self.oracle_b.greedy(CACHED_PROMPT, NEW_TOKENS))
        self.assertEqual(out["meta_info"]["cached_tokens"], 0)  # A's prefix and states are gone
        self.assertEqual(out["meta_info"]["weight_version"], "step-1")

    def test_running_requests_finish_on_the_old_weights_while_new_ones_wait(self) -> None:
        running = self.long_stream()
        running.wait_events(2)
        update = Call(self.base_url + "/update_weights_from_disk", {"model_path": self.path_b})
        time.sleep(0.4)  # the update holds new requests from here on (the running one has 0.7 s or more)
        greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        waiting = Call(self.base_url + "/generate", {"input_ids": PROMPT, "sampling_params": greedy})
        for t in (update, waiting):
            t.join(60)
        running.join(60)
        self.assertEqual(update.reply.status_code, 200, update.reply.text)
        self.assertLess(running.done_at, update.done_at)
        self.assertEqual(running.events[-1]["output_ids"], self.oracle_a.greedy(LONG_PROMPT, LONG_TOKENS))
        self.assertEqual(waiting.reply.json()["output_ids"], self.oracle_b.greedy(PROMPT, NEW_TOKENS))

    def test_after_a_retract_pause_a_request_continues_on_the_new_weights(self) -> None:
        running = self.long_stream()
        running.wait_events(3)
        self.assertEqual(self.post("/pause_generation", {"mode": "retract"}).status_code, 200)
        seen = len(running.events[-1]["output_ids"])
        r = self.update(self.path_b)
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json()["num_paused_requests"], 1)
        self.assertEqual(self.post("/continue_generation", {}).status_code, 200)
        running.join(60)
        ids = running.events[-1]["output_ids"]
        self.assertEqual(len(ids), LONG_TOKENS)
        # A's tokens up to where it was retracted, then B's greedy continuation of them (greedy decoding
        # is consistent with its prefix, so the first token that differs from A's may be taken as that
        # point even where B's first token agrees with A's).
        old = self.oracle_a.greedy(LONG_PROMPT, LONG_TOKENS)
        k = next((i for i, (a, b) in enumerate(zip(ids, old, strict=True)) if a != b), LONG_TOKENS)
        self.assertGreaterEqual(k, seen)
        self.assertLess(k, LONG_TOKENS, "B's tokens differ from A's somewhere")
        self.assertEqual(ids[k:], self.oracle_b.greedy(LONG_PROMPT + ids[:k], LONG_TOKENS - k))

    def test_a_pause_while_the_update_waits_lets_it_go_at_once(self) -> None:
        running = self.long_stream()
        running.wait_events(2)
        update = Call(self.base_url + "/update_weights_from_disk", {"model_path": self.path_b})
        time.sleep(0.3)
        self.assertIsNone(update.reply, "it waits for the running request")
        self.assertEqual(self.post("/pause_generation", {"mode": "retract"}).status_code, 200)
        update.join(60)
        self.assertEqual(update.reply.status_code, 200, update.reply.text)
        self.assertEqual(update.reply.json()["num_paused_requests"], 1)
        self.assertIsNone(running.done_at, "the update did not wait for the paused request")
        self.assertEqual(self.post("/continue_generation", {}).status_code, 200)
        running.join(60)
        self.assertEqual(len(running.events[-1]["output_ids"]), LONG_TOKENS)

    def test_an_in_place_pause_refuses_a_flushing_update(self) -> None:
        running = self.long_stream()
        running.wait_events(2)
        self.assertEqual(self.post("/pause_generation", {"mode": "in_place"}).status_code, 200)
        r = self.update(self.path_b)
        self.assertEqual(r.status_code, 400, r.text)
        self.assertFalse(r.json()["success"])
        self.assertIn("1 request(s) hold KV and state", r.json()["message"])
        r = self.update(self.path_b, flush_cache=False, keep_pause=True)  # its state stays, B goes on
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(self.post("/continue_generation", {}).status_code, 200)
        running.join(60)
        self.assertEqual(len(running.events[-1]["output_ids"]), LONG_TOKENS)
        self.wait_idle()
        self.flush_cache()
        self.assertEqual(self.greedy(PROMPT)["output_ids"], self.oracle_b.greedy(PROMPT, NEW_TOKENS))

    def test_a_bad_update_is_refused_and_the_old_weights_keep_serving(self) -> None:
        for body, param in [
            ({}, "model_path"),
            ({"model_path": self.path_b, "load_format": "pt"}, "load_format"),
            ({"model_path": self.path_b, "flush_cache": "yes"}, "flush_cache"),
            ({"model_path": self.path_b, "token_step": 1.5}, "token_step"),
        ]:
            r = self.post("/update_weights_from_disk", body)
            self.assertEqual(r.status_code, 400, r.text)
            self.assertEqual(r.json()["error"]["param"], param)
        other = resolve_model_path("tiny-nemotron-h")
        for path, words in [
            (str(self.workdir / "missing"), "no config.json"),
            (other, "its architecture is 'NemotronHForCausalLM'"),
        ]:
            r = self.update(path, weight_version="never")
            self.assertEqual(r.status_code, 400, r.text)
            self.assertFalse(r.json()["success"])
            self.assertIn(words, r.json()["message"])
        out = self.greedy(PROMPT)
        self.assertEqual(out["output_ids"], self.oracle_a.greedy(PROMPT, NEW_TOKENS))
        self.assertEqual(out["meta_info"]["weight_version"], "base")

    def test_update_weights_from_tensor_writes_them_in_place(self) -> None:
        """Upstream's /update_weights_from_tensor from another process: the tensors by value (a file
        descriptor reaches only a process the sender started), base64 in JSON, in two buckets."""
        tensors = served_tensors(self.path_b)
        names = sorted(tensors)
        self.greedy(CACHED_PROMPT)
        buckets = [(names[::2], None, None), (names[1::2], "step-2", "flattened_bucket")]
        for part, version, load_format in buckets:
            named = [(n, tensors[n]) for n in part]
            if load_format == "flattened_bucket":  # upstream's FlattenedTensorBucket, one tensor for all
                bucket = FlattenedTensorBucket(named_tensors=named)
                named = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
            payload = base64.b64encode(pickle.dumps(named)).decode()
            body = {"serialized_named_tensors": [payload], "weight_version": version}
            body["load_format"] = load_format
            r = self.post("/update_weights_from_tensor", body)
            self.assertEqual(r.status_code, 200, r.text)
            want = f"Succeeded to update {len(part)} weight tensor(s) in place."
            self.assertEqual(r.json(), {"success": True, "message": want})
        out = self.greedy(CACHED_PROMPT)
        self.assertEqual(out["output_ids"], self.oracle_b.greedy(CACHED_PROMPT, NEW_TOKENS))
        self.assertEqual(out["meta_info"]["cached_tokens"], 0)
        self.assertEqual(out["meta_info"]["weight_version"], "step-2")
        # Upstream's /get_weights_by_name reads them back (the norm is served as the checkpoint has it).
        r = self.post("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 5})
        self.assertEqual(r.json(), tensors["model.norm.weight"][:5].float().tolist())
        r = self.post("/get_weights_by_name", {"name": "model.norm.weights"})
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "name"))
        self.assertIn("close: model.norm.weight", r.json()["error"]["message"])

    def test_a_bad_tensor_update_is_refused_and_the_old_weights_keep_serving(self) -> None:
        good = base64.b64encode(pickle.dumps([("model.norm.weight", torch.zeros(3))])).decode()
        for body, param in [
            ({}, "serialized_named_tensors"),
            ({"serialized_named_tensors": [b"x".hex(), 3]}, "serialized_named_tensors"),
            ({"serialized_named_tensors": [good], "load_format": "pt"}, "load_format"),
            ({"serialized_named_tensors": [good], "flush_cache": "yes"}, "flush_cache"),
        ]:
            r = self.post("/update_weights_from_tensor", body)
            self.assertEqual(r.status_code, 400, r.text)
            self.assertEqual(r.json()["error"]["param"], param)
        zeros = [("model.norm.weight", torch.zeros(16))]
        by_handle = MultiprocessingSerializer.serialize(zeros, output_str=True)
        for payload, words in [
            (good, "model.norm.weight has shape (3,)"),
            (by_handle, "shared memory of the sender"),
            (base64.b64encode(pickle.dumps([("w", _Evil())])).decode(), "posix.system"),
        ]:
            r = self.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
            self.assertEqual(r.status_code, 400, r.text)
            self.assertFalse(r.json()["success"])
            self.assertIn(words, r.json()["message"])
        self.assertEqual(self.greedy(PROMPT)["output_ids"], self.oracle_a.greedy(PROMPT, NEW_TOKENS))

    def test_weights_broadcast_over_a_weight_update_group(self) -> None:
        """Upstream's /init_weights_update_group, /update_weights_from_distributed and
        /destroy_weights_update_group, with a trainer (rank 0 of a gloo group) in a process of its own."""
        port = find_free_port()
        join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        for fields, param in [
            ({"rank_offset": 0}, "rank_offset"),
            ({"master_port": 0}, "master_port"),
            ({"backend": "mpi"}, "backend"),
            ({"world_size": "2"}, "world_size"),
        ]:
            r = self.post("/init_weights_update_group", {**join, **fields})
            self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, param), r.text)
        r = self.post("/init_weights_update_group", join)  # nccl, upstream's default
        self.assertEqual(r.status_code, 400, r.text)
        self.assertIn("backend gloo", r.json()["message"])
        trainer = Broadcaster(port)
        try:
            r = self.post("/init_weights_update_group", {**join, "backend": "gloo"})
            self.assertEqual(r.json(), {"success": True, "message": "Succeeded to join."})
            self.assertEqual(trainer.wait(), "joined")
            tensors = served_tensors(self.path_b)
            names = sorted(tensors)
            body = {"names": names, "dtypes": [str(tensors[n].dtype) for n in names],
                    "shapes": [list(tensors[n].shape) for n in names]}  # fmt: skip
            for fields, param in [
                ({"names": []}, "names"),
                ({"dtypes": ["int8"] * len(names)}, "dtypes"),
                ({"shapes": body["shapes"][1:]}, "shapes"),
                ({"load_format": "direct"}, "load_format"),
            ]:
                r = self.post("/update_weights_from_distributed", {**body, **fields})
                self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, param), r.text)
            trainer.broadcast([(n, tensors[n]) for n in names])
            r = self.post("/update_weights_from_distributed", {**body, "weight_version": "step-3"})
            want = f"Succeeded to update {len(names)} weight tensor(s) in place."
            self.assertEqual((r.status_code, r.json()), (200, {"success": True, "message": want}))
            self.assertEqual(trainer.wait(), "sent")
            out = self.greedy(PROMPT)
            self.assertEqual(out["output_ids"], self.oracle_b.greedy(PROMPT, NEW_TOKENS))
            self.assertEqual(out["meta_info"]["weight_version"], "step-3")
            r = self.post("/destroy_weights_update_group", {})
            self.assertEqual((r.status_code, r.json()["success"]), (200, True))
            r = self.post("/destroy_weights_update_group", {"group_name": "weight_update_group"})
            self.assertEqual(r.status_code, 400)
            self.assertIn("no weight-update group", r.json()["message"])
        finally:
            trainer.close()

    def test_memory_released_around_a_weight_update(self) -> None:
        """Upstream's colocated RL loop: release everything, (train), resume the weights, write them with
        /update_weights_from_tensor, resume the cache; a request sent meanwhile waits, then runs."""
        running = self.long_stream()
        running.wait_events(2)
        r = self.post("/release_memory_occupation", {})
        self.assertEqual(r.status_code, 400, r.text)
        self.assertIn("1 request(s) are running or waiting", r.json()["message"])
        running.join(60)
        r = self.post("/release_memory_occupation", {"tags": ["weights", "nothing"]})
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "tags"))

        r = self.post("/release_memory_occupation", {})
        want = "Released the memory of weights, kv_cache, cuda_graph."
        self.assertEqual((r.status_code, r.json()), (200, {"success": True, "message": want}))
        state = self.get("/get_server_info").json()["internal_states"][0]
        self.assertEqual(state["memory_released"], ["cuda_graph", "kv_cache", "weights"])
        greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        waiting = Call(self.base_url + "/generate", {"input_ids": PROMPT, "sampling_params": greedy})
        r = self.post("/resume_memory_occupation", {"tags": ["weights"]})
        self.assertEqual(r.json()["message"], "Resumed weights; cuda_graph, kv_cache still released.")
        tensors = served_tensors(self.path_a)
        names = sorted(tensors)
        for part in (names[::2], names[1::2]):  # (each body within --max-request-body-size)
            payload = base64.b64encode(pickle.dumps([(n, tensors[n]) for n in part])).decode()
            r = self.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
            self.assertEqual(r.status_code, 200, r.text)
        time.sleep(0.3)
        self.assertIsNone(waiting.reply, "it waits while the cache is released")
        r = requests.get(
            self.base_url + "/resume_memory_occupation", headers=ADMIN, timeout=60
        )  # no body: all
        want = "Resumed weights, kv_cache, cuda_graph."
        self.assertEqual((r.status_code, r.json()["message"]), (200, want))
        waiting.join(60)
        self.assertEqual(waiting.reply.json()["output_ids"], self.oracle_a.greedy(PROMPT, NEW_TOKENS))

    def test_update_weight_version_relabels_replies(self) -> None:
        r = self.post("/update_weight_version", {"new_version": "v9", "abort_all_requests": False})
        want = {"success": True, "message": "Weight version updated to v9.", "new_version": "v9"}
        self.assertEqual(r.json(), want)
        self.assertEqual(self.greedy(PROMPT)["meta_info"]["weight_version"], "v9")
        r = self.post("/update_weight_version", {"new_version": ""})
        self.assertEqual(r.status_code, 400)
        self.assertEqual(r.json()["error"]["param"], "new_version")
