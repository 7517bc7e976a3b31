"""Many concurrent chat conversations against a small mamba pool: cache hits (a shared system prompt,
multi-turn histories) compete with admission for slots and pages. Every request succeeds, the server
stays up, and nothing is held once idle and flushed. Bounded in time and count."""

from __future__ import annotations

import time
import unittest
from concurrent.futures import ThreadPoolExecutor

import requests

from sglang.test.ci_register import full_matrix, register_cpu_ci
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=35, suite="per-commit-cpu")

NUM_CLIENTS = 64
TURNS = 4
DEADLINE_S = 150.0
SYSTEM = "You are a terse assistant for a bounded pool test. " * 12


class _BoundedPoolLoad(ServerTestCase):
    strategy = ""

    @classmethod
    def setUpClass(cls) -> None:
        cls.server_args = [
            "--mamba-scheduler-strategy",
            cls.strategy,
            "--max-mamba-cache-size",
            "16",
            "--max-total-tokens",
            "16384",
        ]
        super().setUpClass()

    def conversation(self, i: int, deadline: float) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}]
        codes = []
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"client {i} turn {turn}: tell me more"})
            body = {"model": self.model, "messages": messages, "max_tokens": 24, "temperature": 0}
            r = requests.post(
                self.base_url + "/v1/chat/completions",
                json=body,
                timeout=max(1.0, deadline - time.monotonic()),
            )
            codes.append(r.status_code)
            if r.status_code != 200:
                break
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        return codes

    def test_concurrent_conversations_all_succeed(self):
        deadline = time.monotonic() + DEADLINE_S
        with ThreadPoolExecutor(NUM_CLIENTS) as pool:
            results = list(pool.map(lambda i: self.conversation(i, deadline), range(NUM_CLIENTS)))
        codes = [c for conv in results for c in conv]
        self.assertEqual(codes, [200] * NUM_CLIENTS * TURNS, f"non-200 answers: {sorted(set(codes))}")
        self.assertEqual(self.get("/health").status_code, 200)
        state = self.assert_idle_accounting()
        self.assertGreater(state["counters"]["num_cached_tokens_total"], 0, "the load must hit the cache")
        self.flush_cache()
        state = self.assert_idle_accounting()
        self.assertEqual(state["mamba_usage"]["free"], state["mamba_usage"]["total"])
        self.assertEqual(state["token_usage"]["free"], state["token_usage"]["total"])


class TestBoundedPoolLoadLazy(_BoundedPoolLoad):
    strategy = "extra_buffer_lazy"


# (Per commit the default strategy; extra_buffer's run in the nightly full matrix.)
@unittest.skipUnless(full_matrix(), "extra_buffer under the bounded load: in the nightly full matrix")
class TestBoundedPoolLoadExtraBuffer(_BoundedPoolLoad):
    strategy = "extra_buffer"


del _BoundedPoolLoad  # not a test of its own
