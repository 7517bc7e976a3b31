"""--enable-priority-scheduling on a real server (one running request at a time: --max-running-requests 1):

- a waiting request of higher priority runs before an earlier one of lower priority, and one that
  outranks the running request by no more than the threshold (10) waits for it;
- one that outranks it by more preempts it: the running request is retracted, the preferred one runs
  and ends first, and the retracted one then completes with exactly the tokens it makes alone (greedy);
- `priority` on the OpenAI routes is the same field.
The rule itself: test/unit/scheduler/test_priority_scheduling.py.
"""

from __future__ import annotations

import threading
import time

from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=30, suite="per-commit-cpu")


class TestPriorityScheduling(ServerTestCase):
    server_args = ["--enable-priority-scheduling", "--max-running-requests", "1", "--context-length", "512"]

    def counters(self) -> dict:
        return self.internal_state()["counters"]

    def start(self, name: str, priority: int | None, tokens: int, done: dict, **extra) -> threading.Thread:
        body = {"input_ids": [5, 6, 7, 8 + len(name)], "priority": priority,
                "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}, **extra}  # fmt: skip

        def run():
            r = self.post("/generate", body)
            done[name] = (time.monotonic(), r.status_code, r.json())

        t = threading.Thread(target=run)
        t.start()
        return t

    def wait_running(self, n: int = 1, waiting: int = 0) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            s = self.internal_state()
            if s["num_running_reqs"] == n and s["num_waiting_reqs"] >= waiting:
                return
            time.sleep(0.01)
        self.fail(f"not {n} running and {waiting} waiting: {s}")

    def test_a_waiting_request_of_higher_priority_runs_first_and_a_close_one_does_not_preempt(self):
        before = self.counters()
        done: dict = {}
        threads = [self.start("long", 5, 250, done)]
        self.wait_running()
        threads.append(self.start("low", 0, 8, done))
        self.wait_running(1, 1)  # ("low" waits before "high" comes)
        threads.append(self.start("high", 15, 8, done))  # (15 - 5 = 5: not above the threshold of 10)
        for t in threads:
            t.join(120)
        self.assertTrue(all(code == 200 for _, code, _ in done.values()), done)
        self.assertLess(done["long"][0], done["high"][0])
        self.assertLess(done["high"][0], done["low"][0])
        self.assertEqual(self.counters()["num_preemptions_total"], before["num_preemptions_total"])
        self.assert_idle_accounting()

    def test_a_request_that_outranks_the_running_one_by_more_preempts_it_and_both_are_exact(self):
        alone: dict = {}
        self.start("victim", 0, 200, alone).join(120)
        before = self.counters()
        done: dict = {}
        threads = [self.start("victim", 0, 200, done)]
        self.wait_running()
        time.sleep(0.05)  # (some of its tokens made: it prefills again from its prefix)
        threads.append(self.start("urgent", 50, 8, done))
        for t in threads:
            t.join(120)
        self.assertTrue(all(code == 200 for _, code, _ in done.values()), done)
        self.assertLess(done["urgent"][0], done["victim"][0])
        after = self.counters()
        self.assertGreaterEqual(after["num_preemptions_total"], before["num_preemptions_total"] + 1)
        self.assertGreaterEqual(after["num_retractions_total"], before["num_retractions_total"] + 1)
        self.assertEqual(done["victim"][2]["output_ids"], alone["victim"][2]["output_ids"])
        self.assertEqual(done["urgent"][2]["meta_info"]["completion_tokens"], 8)
        self.assert_idle_accounting()

    def test_priority_is_an_openai_field_too_and_must_be_an_integer(self):
        r = self.post("/v1/completions", {"prompt": "def f(", "max_tokens": 3, "priority": 7})
        self.assertEqual(r.status_code, 200, r.text)
        r = self.post("/generate", {"input_ids": [5, 6], "priority": "high"})
        self.assertEqual(r.status_code, 400, r.text)
        self.assertIn("priority must be an integer", r.text)
        for loose in (True, "7", 3.0):  # (pydantic would take them as integers; /generate does not)
            r = self.post("/v1/completions", {"prompt": "def f(", "max_tokens": 3, "priority": loose})
            self.assertEqual(r.status_code, 400, (loose, r.text))
