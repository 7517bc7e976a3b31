"""Malformed requests get HTTP 400 with an OpenAI-style error naming the field (413 for a body over the
limit); afterwards the server answers normally and, once idle, no slot is held by a request. Fields
upstream's /generate accepts are accepted here too."""

from __future__ import annotations

import json
import socket

from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=18, suite="per-commit-cpu")

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
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (
        CHAT,
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": None}]},
        "messages[1].content",
    ),
    (CHAT, chat(stop_regex="(unclosed"), "stop_regex"),
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
    (CHAT, chat(stream="maybe"), "stream"),  # ("yes" is true in pydantic's lax mode, as upstream)
    (CHAT, chat(stop=[""]), "stop"),
    (CHAT, chat(seed=-1), "seed"),
    (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"function": {"name": "g"}}),
        "tool_choice",
    ),
    (CHAT, chat(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
    (CHAT, chat(frequency_penalty=2.5), "frequency_penalty"),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty"),
    (CHAT, chat(logit_bias={"99999": 5}), "logit_bias"),
    (CHAT, chat(logit_bias={"5": "up"}), "logit_bias.5"),
    (COMP, {"model": "m"}, "prompt"),
    (COMP, {"prompt": 12}, "prompt"),
    (COMP, {"prompt": []}, "prompt"),
    (COMP, {"prompt": [1, 99999]}, "prompt"),
    (COMP, {"prompt": [5] * 5000}, "prompt"),
    (COMP, {"prompt": "hello " * 5000}, "prompt"),
    (COMP, {"prompt": "x", "logprobs": 100}, "logprobs"),
    (COMP, {"prompt": "x", "echo": True}, "echo"),
    (COMP, {"prompt": "x", "stop_regex": ["["]}, "stop_regex"),
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
    (GEN, {"text": "a", "lora_path": "my-adapter"}, "lora_path"),
    (GEN, {"text": "a", "sampling_params": {"stop_regex": "(a"}}, "sampling_params.stop_regex"),
    (GEN, {"text": "a", "sampling_params": {"logit_bias": {"-3": 1}}}, "sampling_params.logit_bias"),
    (GEN, {"input_ids": [5], "return_logprob": True, "token_ids_logprob": [5, -1]}, "token_ids_logprob"),
    # 64 prompts x n=64 would start 4096 sequences at once.
    (
        GEN,
        {"input_ids": [[5, 6]] * 64, "sampling_params": {"n": 64, "max_new_tokens": 1}},
        "sampling_params.n",
    ),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
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

    def test_fields_upstream_accepts_are_accepted(self) -> None:
        out = self.generate(
            text="hi",
            sampling_params={"max_new_tokens": 2, "ignore_eos": True},
            lora_path="",
            return_hidden_states=False,
            stream_options={"include_usage": True},
            bootstrap_host="10.0.0.1",
            bootstrap_port=8998,
            bootstrap_room=7,
            log_metrics=True,
            no_logs=False,
            return_entropy=False,
            some_future_field={"x": 1},
        )
        self.assertEqual(out["meta_info"]["completion_tokens"], 2)

    def test_penalties_and_logit_bias_are_applied(self) -> None:
        # Upstream's penalty fields on both routes (their rules: test/unit/scheduler/test_penalties.py).
        forced = self.generate(
            input_ids=[5, 6, 7],
            sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {"42": 100}},
        )
        self.assertEqual(forced["output_ids"], [42] * 4)
        body = chat(max_tokens=4, temperature=0, frequency_penalty=1.5, presence_penalty=0.5,
                    repetition_penalty=1.2, logit_bias={"42": 2.5})  # fmt: skip
        r = self.post(CHAT, body)
        self.assertEqual(r.status_code, 200, r.text)
        self.assertGreater(r.json()["usage"]["completion_tokens"], 0)
        self.assert_idle_accounting()

    def test_token_ids_logprob_in_meta_info(self) -> None:
        # upstream's token_ids_logprob (the values against the oracle: test/unit/scheduler/test_request_semantics.py)
        greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
        first = self.generate(input_ids=[5, 6, 7], sampling_params=greedy)["output_ids"][0]
        out = self.generate(
            input_ids=[5, 6, 7], sampling_params=greedy, return_logprob=True, logprob_start_len=0,
            token_ids_logprob=[first, 3], return_text_in_logprobs=True,
        )  # fmt: skip
        meta = out["meta_info"]
        chosen, inputs = meta["output_token_ids_logprobs"], meta["input_token_ids_logprobs"]
        self.assertEqual(len(chosen), 3)
        self.assertEqual([[e[1] for e in step] for step in chosen], [[first, 3]] * 3)
        self.assertTrue(all(isinstance(e[2], str) for step in chosen for e in step))
        self.assertAlmostEqual(chosen[0][0][0], meta["output_token_logprobs"][0][0], places=5)
        self.assertEqual(inputs[0], None)  # the first input token has no logprob
        self.assertEqual(len(inputs), 3)
        plain = self.generate(input_ids=[5, 6, 7], sampling_params=greedy, return_logprob=True)["meta_info"]
        self.assertNotIn("output_token_ids_logprobs", plain)

    def test_no_stop_trim_keeps_the_stop_tokens_text(self) -> None:
        greedy = {"temperature": 0, "ignore_eos": True, "skip_special_tokens": False}

        def text(max_new: int, **params) -> str:
            body = {"input_ids": [5, 6, 7], "sampling_params": {**greedy, "max_new_tokens": max_new, **params}}
            return self.post("/generate", body).json()["text"]

        ids = self.generate(input_ids=[5, 6, 7], sampling_params={**greedy, "max_new_tokens": 6})["output_ids"]
        plain = [text(n) for n in range(7)]
        # A stop token that shows in the text (so that keeping it is visible), first met at position k.
        k = next(i for i in range(1, 6) if ids[i] not in ids[:i] and plain[i + 1] != plain[i])
        self.assertEqual(text(6, stop_token_ids=[ids[k]]), plain[k])
        self.assertEqual(text(6, stop_token_ids=[ids[k]], no_stop_trim=True), plain[k + 1])

    def test_a_body_over_the_limit_gets_413_before_it_is_sent(self) -> None:
        limit = self.get("/get_server_info").json()["max_request_body_size"]
        with socket.create_connection(("127.0.0.1", self.server.port), timeout=10) as s:
            s.sendall(
                f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {limit + 1}\r\n\r\n".encode()
            )
            raw = b""
            while chunk := s.recv(65536):  # the server closes the connection after its answer
                raw += chunk
            head, _, body = raw.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 413"), head)
        message = json.loads(body)["error"]["message"]
        self.assertIn(f"limit of {limit} bytes", message)
        self.assertIn("--max-request-body-size", message)
        # Just under the limit the body is read, and refused for what it says.
        r = self.post("/v1/completions", {"prompt": "x" * (limit - 100)})
        self.assertEqual(r.status_code, 400, r.text[:200])
        self.assertEqual(r.json()["error"]["code"], "context_length_exceeded")
        self.assert_idle_accounting()
