"""Upstream's request deadlines and /pause_generation + /continue_generation on a real server, and the
flush refusal: deadlines answer 503 with upstream's messages; each pause mode holds generation and
continues it to a full answer; nothing is left held by a request afterwards.

One request runs at a time (--max-running-requests 1) and each step takes 20 ms or more, so a second
request waits and a long one runs for seconds.
"""

from __future__ import annotations

import threading
import time

import orjson
import requests

from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=25, suite="per-commit-cpu")

WAITING_TIMEOUT_S = 2.0
RUNNING_TIMEOUT_S = 4.0


def long_request(tokens: int = 3000, **kw) -> dict:
    return {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}, **kw}


class StreamReader(threading.Thread):
    """Reads a /generate stream, keeping each event with the time it arrived."""

    def __init__(self, base_url: str, body: dict):
        super().__init__(daemon=True)
        self.base_url, self.body = base_url, {**body, "stream": True}
        self.events: list[tuple[float, dict]] = []
        self.status: int | None = None

    def run(self) -> None:
        with requests.post(self.base_url + "/generate", json=self.body, stream=True, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    self.events.append((time.monotonic(), orjson.loads(line[6:])))

    def wait_events(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < n:
            assert time.monotonic() < deadline, f"only {len(self.events)} events"
            time.sleep(0.01)

    def tokens(self) -> int:
        return self.events[-1][1]["meta_info"]["completion_tokens"]


class TestGenerationControl(ServerTestCase):
    server_args = ["--mamba-scheduler-strategy", "extra_buffer_lazy", "--max-running-requests", "1"]
    env = {
        "SGLANG_TEST_FORWARD_DELAY_MS": "20",
        "SGLANG_REQ_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S),
        "SGLANG_REQ_RUNNING_TIMEOUT": str(RUNNING_TIMEOUT_S),
    }

    def setUp(self) -> None:
        self.wait_idle()

    def pause(self, mode: str) -> None:
        r = self.post("/pause_generation", {"mode": mode})
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json(), {"message": "Generation paused successfully.", "status": "ok"})

    def resume(self) -> None:
        r = self.post("/continue_generation", {})
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json(), {"message": "Generation continued successfully.", "status": "ok"})

    def test_deadlines_answer_503_and_release_everything(self) -> None:
        running = StreamReader(self.base_url, long_request())
        running.start()
        running.wait_events(2)
        waiting: dict[str, requests.Response] = {}
        chat = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        threads = [
            threading.Thread(target=lambda: waiting.update(native=self.post("/generate", long_request(4)))),
            threading.Thread(target=lambda: waiting.update(chat=self.post("/v1/chat/completions", chat))),
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        self.assertLess(time.monotonic() - t0, WAITING_TIMEOUT_S + 2.5)
        for name, r in waiting.items():
            self.assertEqual(r.status_code, 503, name)
            self.assertEqual(r.json()["error"]["message"], "Request waiting timeout reached.", name)
            # Upstream's fields at the top level, as its waiting-timeout kit counts errors (issue 60, item 5).
            top = r.json()
            self.assertEqual(
                (top["object"], top["code"], top["message"]),
                ("error", 503, "Request waiting timeout reached."),
            )
        running.join(30)
        self.assertEqual(running.status, 200)
        last = running.events[-1][1]
        self.assertEqual(last["error"]["message"], "Request running timeout reached.")
        self.assertEqual(last["error"]["code"], 503)
        self.assertEqual((last["object"], last["code"]), ("error", 503))  # a stream's error event too
        self.assertLess(running.events[-2][1]["meta_info"]["completion_tokens"], 3000)
        self.assert_idle_accounting()

    def hold_and_continue(self, mode: str) -> tuple[StreamReader, dict]:
        """A stream paused after a few tokens, a request sent while paused; both finish after continue."""
        stream = StreamReader(self.base_url, long_request(30))
        stream.start()
        stream.wait_events(5)
        self.pause(mode)
        paused_at = time.monotonic()
        late: dict[str, requests.Response] = {}
        sender = threading.Thread(target=lambda: late.update(r=self.post("/generate", long_request(3))))
        sender.start()
        time.sleep(0.8)
        state = self.internal_state()
        self.assertFalse(late, "a request sent while paused waits")
        during = [e for t, e in stream.events if t > paused_at + 0.2]
        self.assertLessEqual(len(during), 1, "no tokens while paused")
        self.resume()
        stream.join(30)
        sender.join(30)
        self.assertEqual(late["r"].json()["meta_info"]["completion_tokens"], 3)
        if mode != "abort":
            self.assertEqual(stream.tokens(), 30)
        self.assert_idle_accounting()
        return stream, state

    def test_pause_in_place_holds_and_continues(self) -> None:
        _, state = self.hold_and_continue("in_place")
        self.assertEqual(state["num_running_reqs"], 1)
        self.assertGreater(
            state["mamba_usage"]["held_by_requests"], 0, "in place: the request keeps its slots"
        )

    def test_pause_retract_frees_slots_and_continues(self) -> None:
        _, state = self.hold_and_continue("retract")
        self.assertEqual((state["num_running_reqs"], state["num_waiting_reqs"]), (0, 1))
        self.assertEqual(state["mamba_usage"]["held_by_requests"], 0)
        self.assertEqual(state["token_usage"]["held_by_requests"], 0)

    def test_pause_abort_ends_running_requests(self) -> None:
        stream, state = self.hold_and_continue("abort")
        self.assertEqual(stream.events[-1][1]["meta_info"]["finish_reason"]["type"], "abort")
        self.assertEqual(state["num_running_reqs"], 0)

    def test_pause_mode_is_checked(self) -> None:
        r = self.post("/pause_generation", {"mode": "sideways"})
        self.assertEqual(r.status_code, 400)
        self.assertEqual(r.json()["error"]["param"], "mode")

    def test_flush_refusal_is_one_sentence(self) -> None:
        stream = StreamReader(self.base_url, long_request(rid="flush-blocker"))
        stream.start()
        stream.wait_events(2)
        r = self.post("/flush_cache")
        self.assertEqual(r.status_code, 400)
        text = r.text.strip()
        self.assertEqual(text.count("flushed"), 1, text)
        self.assertTrue(text.endswith(".") and text.count(". ") == 0, text)
        self.assertEqual(self.post("/abort_request", {"rid": "flush-blocker"}).status_code, 200)
        stream.join(30)
        self.assert_idle_accounting()
