"""Clients that misbehave or go away do not hurt the server or anyone else.

- 50 streaming clients that disconnect mid-stream: every request is aborted, nothing leaks. Half use
  the native /generate stream, half the OpenAI chat stream. Each asks for 3000 tokens with a slowed
  forward (20 ms per step), so only aborts can make the server idle within the time bound.
- Uploads dropped mid-body are not server errors (499 in the metrics, no traceback), and half-open
  ones are closed after the read timeout (408).
- A 10 MB prompt (the body limit is raised to let it in) is tokenized off the event loop: /health and a
  concurrent stream keep answering while it is processed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time

import requests

from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=35, suite="per-commit-cpu")

NUM_CLIENTS = 50
MAX_TOKENS = 3000
STEP_MS = 20
READ_TIMEOUT_S = 1.5
NUM_UPLOADS = 50


class TestClientDisconnect(ServerTestCase):
    server_args = [
        "--mamba-scheduler-strategy",
        "extra_buffer_lazy",
        "--enable-metrics",
        "--max-request-body-size",
        str(32 << 20),
    ]
    env = {"SGLANG_TEST_FORWARD_DELAY_MS": str(STEP_MS), "SGLANG_HTTP_READ_TIMEOUT": str(READ_TIMEOUT_S)}

    def metric(self, name: str, labels: str = "") -> float:
        """The sum over the series of `name` whose labels contain `labels` (one per endpoint and method)."""
        lines = self.get("/metrics").text.splitlines()
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(name + "{") and labels in x)

    def responses(self, status: int) -> float:
        return self.metric("sglang:http_responses_total", f'status_code="{status}"')

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

    def test_dropped_and_half_open_uploads(self) -> None:
        dropped_before, stalled_before = self.responses(499), self.responses(408)
        head = (
            (
                b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n"
            )
            + b'{"text": "'
            + b"x" * 100
        )
        half_open = []
        for i in range(2 * NUM_UPLOADS):
            s = socket.create_connection(("127.0.0.1", self.server.port), timeout=10)
            s.sendall(head)
            if i % 2:
                half_open.append(s)
            else:
                s.close()  # gone mid-body
        t0 = time.monotonic()
        answers = []
        for s in half_open:
            data = b""
            while chunk := s.recv(65536):  # until the server closes the connection
                data += chunk
            answers.append(data.split(b" ", 2)[1])
            s.close()
        self.assertLess(time.monotonic() - t0, READ_TIMEOUT_S + 5, "half-open uploads are closed")
        self.assertEqual(answers, [b"408"] * NUM_UPLOADS)
        deadline = time.monotonic() + 10
        while self.responses(499) - dropped_before < NUM_UPLOADS and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertEqual(self.responses(499) - dropped_before, NUM_UPLOADS)
        self.assertEqual(self.responses(408) - stalled_before, NUM_UPLOADS)
        self.assertEqual(self.responses(500), 0)
        log = self.server.log_text()
        self.assertNotIn("Traceback", log)
        self.assertNotIn("Request failed", log)

    def test_a_huge_prompt_does_not_stall_anyone_else(self) -> None:
        """Measured on a 2-core box: before, /health took 13.8 s and the stream stalled 13.9 s; after,
        /health answers in ~3 ms (max < 60 ms) and stream gaps stay ~25 ms (max < 90 ms). The bounds
        below leave room for a loaded CI machine while catching any stall of the loop."""
        self.wait_idle()
        health: list[tuple[float, float]] = []
        stop = threading.Event()

        def poll() -> None:
            with requests.Session() as session:
                while not stop.is_set():
                    t = time.perf_counter()
                    self.assertEqual(session.get(self.base_url + "/health", timeout=30).status_code, 200)
                    health.append((t, time.perf_counter() - t))
                    time.sleep(0.02)

        arrivals: list[float] = []
        last: list[bytes] = []

        def stream() -> None:
            body = {
                "input_ids": [5, 6, 7],
                "stream": True,
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
            }
            with requests.post(self.base_url + "/generate", json=body, stream=True, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        arrivals.append(time.perf_counter())
                        last[:] = [line]

        poller, streamer = threading.Thread(target=poll), threading.Thread(target=stream)
        poller.start()
        streamer.start()
        while len(arrivals) < 10:
            time.sleep(0.01)
        prompt = "hello world, this is a test of tokenization. " * (10_000_000 // 46)
        t0 = time.perf_counter()
        r = requests.post(self.base_url + "/generate", json={"text": prompt}, timeout=120)
        t1 = time.perf_counter()
        streamer.join(60)
        stop.set()
        poller.join(30)
        self.assertEqual(r.status_code, 400)
        self.assertEqual(r.json()["error"]["code"], "context_length_exceeded")
        during = [latency for t, latency in health if t0 <= t <= t1]
        self.assertGreater(len(during), 0)
        self.assertLess(statistics.median(during), 0.1, during)
        self.assertLess(max(during), 1.0, during)
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        self.assertEqual(json.loads(last[0][6:])["meta_info"]["completion_tokens"], 200)
        self.assertLess(max(gaps), 1.0, "the concurrent stream keeps its pace")
