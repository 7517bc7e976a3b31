"""Malformed requests get HTTP 400 with an OpenAI-style error naming the field; afterwards the server
answers normally and, once idle, no slot is held by a request."""

from __future__ import annotations

import json

from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=15, suite="per-commit-cpu")

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
GEN = "/generate"
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"model": "m", "messages": MSG, **kw}


# (route, body: dict or raw bytes, the `param` the error must name; None where no field is at fault)
CASES = [
    (CHAT, b'{"messages": [', None),
    (CHAT, b"[1, 2]", None),
    (CHAT, {"model": "m"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
    ),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_tokens=-3), "max_tokens"),
    (CHAT, chat(max_tokens="ten"), "max_tokens"),
    (CHAT, chat(max_tokens=100_000), "max_tokens"),
    (CHAT, chat(temperature=-0.5), "temperature"),
    (CHAT, chat(top_p=0), "top_p"),
    (CHAT, chat(top_p=1.5), "top_p"),
    (CHAT, chat(top_k=0), "top_k"),
    (CHAT, chat(n=1000), "n"),
    (CHAT, chat(top_logprobs=3), "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    (CHAT, chat(stream="yes"), "stream"),
    (CHAT, chat(stop=[""]), "stop"),
    (CHAT, chat(seed=-1), "seed"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (CHAT, chat(frequency_penalty=0.5), "frequency_penalty"),
    (COMP, {"model": "m"}, "prompt"),
    (COMP, {"prompt": 12}, "prompt"),
    (COMP, {"prompt": []}, "prompt"),
    (COMP, {"prompt": [1, 99999]}, "prompt"),
    (COMP, {"prompt": [5] * 5000}, "prompt"),
    (COMP, {"prompt": "hello " * 5000}, "prompt"),
    (COMP, {"prompt": "x", "logprobs": 100}, "logprobs"),
    (COMP, {"prompt": "x", "echo": True}, "echo"),
    (GEN, b"{not json}", None),
    (GEN, {"sampling_params": {"max_new_tokens": 2}}, "text"),
    (GEN, {"text": "a", "input_ids": [1]}, "text"),
    (GEN, {"input_ids": []}, "input_ids"),
    (GEN, {"input_ids": [1, -5]}, "input_ids"),
    (GEN, {"text": "a", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    (GEN, {"text": "a", "sampling_params": {"max_new_tokens": 100_000}}, "sampling_params.max_new_tokens"),
    (
        GEN,
        {"text": "a", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
        "sampling_params.min_new_tokens",
    ),
    (GEN, {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 1_000_000}, "logprob_start_len"),
    (GEN, {"text": ["a", "b"], "sampling_params": [{}, {}, {}]}, "sampling_params"),
    (GEN, {"text": "a", "image_data": "x.png"}, "image_data"),
    ("/abort_request", {"nothing": 1}, "rid"),
]


class TestMalformedRequests(ServerTestCase):
    server_args = ["--mamba-scheduler-strategy", "extra_buffer_lazy"]

    def test_malformed_requests_get_400_naming_the_field(self) -> None:
        self.assertGreaterEqual(len({json.dumps(c[1], default=str) for c in CASES}), 25)
        for route, body, param in CASES:
            with self.subTest(route=route, body=str(body)[:80]):
                if isinstance(body, bytes):
                    r = self.post(route, data=body, headers={"Content-Type": "application/json"})
                else:
                    r = self.post(route, body)
                self.assertEqual(r.status_code, 400, r.text[:300])
                err = r.json()["error"]
                self.assertEqual(err["type"], "invalid_request_error")
                self.assertEqual(err["param"], param, err)
                self.assertTrue(err["message"].endswith("."), err)
                if param is not None:
                    # The message names the field (its last part, as "max_tokens" or "role").
                    self.assertIn(param.split(".")[-1].split("[")[0], err["message"], err)
        # The server is still fine: it answers, and nothing is left held by a request.
        out = self.generate(text="still alive?", sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        self.assertEqual(out["meta_info"]["completion_tokens"], 4)
        self.assertEqual(self.get("/health").status_code, 200)
        self.assert_idle_accounting()
