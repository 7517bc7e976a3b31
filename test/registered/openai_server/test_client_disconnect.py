"""50 streaming clients that disconnect mid-stream: every request is aborted, nothing leaks.

Half use the native /generate stream, half the OpenAI chat stream. Each asks for 3000 tokens with a
slowed forward (20 ms per step), so only aborts can make the server idle within the time bound.
"""

from __future__ import annotations

import asyncio
import json
import time

from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=20, suite="per-commit-cpu")

NUM_CLIENTS = 50
MAX_TOKENS = 3000
STEP_MS = 20


class TestClientDisconnect(ServerTestCase):
    server_args = ["--mamba-scheduler-strategy", "extra_buffer_lazy", "--enable-metrics"]
    env = {"SGLANG_TEST_FORWARD_DELAY_MS": str(STEP_MS)}

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def client(self, i: int) -> int:
        if i % 2:
            path = "/generate"
            body = {
                "input_ids": [5 + i, 6, 7],
                "stream": True,
                "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True},
            }
        else:
            path = "/v1/chat/completions"
            body = {
                "model": self.model,
                "messages": [{"role": "user", "content": f"client {i}"}],
                "max_tokens": MAX_TOKENS,
                "stream": True,
                "ignore_eos": True,
            }
        payload = json.dumps(body).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", self.server.port)
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        events = 0
        status = (await reader.readline()).split()[1]
        assert status == b"200", status
        while events < 3:
            line = await asyncio.wait_for(reader.readline(), 60)
            assert line, "the stream ended before the client left"
            events += line.startswith(b"data: ")
        # Leave mid-stream: close the connection without reading the rest.
        writer.close()
        await writer.wait_closed()
        return events

    def test_disconnected_streams_are_aborted(self) -> None:
        start_state = self.wait_idle()
        aborted_before = self.metric("sglang:num_aborted_requests_total")

        async def run() -> list[int]:
            return await asyncio.gather(*(self.client(i) for i in range(NUM_CLIENTS)))

        t0 = time.monotonic()
        self.assertEqual(asyncio.run(run()), [3] * NUM_CLIENTS)
        state = self.assert_idle_accounting()
        elapsed = time.monotonic() - t0
        # Finishing instead of aborting would take MAX_TOKENS steps of STEP_MS each.
        self.assertLess(elapsed, MAX_TOKENS * STEP_MS / 1000 / 2)
        self.assertEqual(self.metric("sglang:num_aborted_requests_total") - aborted_before, NUM_CLIENTS)
        generated = (
            state["counters"]["num_generation_tokens_total"]
            - start_state["counters"]["num_generation_tokens_total"]
        )
        self.assertLess(generated, NUM_CLIENTS * MAX_TOKENS // 4)
        # A client leaving is not a server error.
        self.assertNotIn("Traceback", self.server.log_text())
        # And the server still serves.
        out = self.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
        self.assertEqual(out["meta_info"]["completion_tokens"], 2)
