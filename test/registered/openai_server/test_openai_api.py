"""The OpenAI-compatible API through the official `openai` client, and the native routes, on a real
server (with an API key and metrics on)."""

from __future__ import annotations

import math
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import requests
from prometheus_client.parser import text_string_to_metric_families

from sglang.test.ci_register import register_cpu_ci
from sglang.test.kits.common import prompt_ids
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=30, suite="per-commit-cpu")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# Upstream's families (as prometheus_client's parser names them: counters without _total) and types.
UPSTREAM_TYPES = {
    "sglang:num_running_reqs": "gauge", "sglang:num_used_tokens": "gauge", "sglang:token_usage": "gauge",
    "sglang:gen_throughput": "gauge", "sglang:num_queue_reqs": "gauge", "sglang:num_grammar_queue_reqs": "gauge",
    "sglang:cache_hit_rate": "gauge", "sglang:prompt_tokens": "counter", "sglang:generation_tokens": "counter",
    "sglang:cached_tokens": "counter", "sglang:num_requests": "counter",
    "sglang:time_to_first_token_seconds": "histogram", "sglang:inter_token_latency_seconds": "histogram",
    "sglang:e2e_request_latency_seconds": "histogram", "sglang:queue_time_seconds": "histogram",
    "sglang:http_requests_active": "gauge", "sglang:weight_memory_usage_gb": "gauge",
    "sglang:kv_cache_memory_usage_gb": "gauge", "sglang:startup_time_seconds": "gauge",
    "sglang:scheduler_idle_seconds": "counter", "sglang:scheduler_process_cpu_seconds": "counter",
    "sglang:realtime_tokens": "counter", "sglang:process_cpu_seconds": "counter",
}  # fmt: skip


def metric_value(families: dict[str, Any], sample: str, missing: float | None = None, **labels: str) -> float:
    """The one sample named `sample` whose labels include `labels` (`missing` when there is none)."""
    name = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    found = [
        s.value
        for s in (families[name].samples if name in families else [])
        if s.name == sample and labels.items() <= s.labels.items()
    ]
    if not found and missing is not None:
        return missing
    assert len(found) == 1, (sample, labels, found)
    return found[0]


def sse_events(resp: requests.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            payload = line[len(b"data: ") :]
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


class TestOpenAIServer(ServerTestCase):
    server_args = [
        "--mamba-scheduler-strategy", "extra_buffer_lazy", "--enable-metrics", "--reasoning-parser", "qwen3",
        "--tool-call-parser", "qwen25", "--constrained-json-disable-any-whitespace",
        "--enable-return-hidden-states", "--enable-response-store", "--enable-strict-thinking",
    ]  # fmt: skip
    api_key = "sk-test-key"

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.client = openai.OpenAI(base_url=cls.base_url + "/v1", api_key=cls.api_key)

    def chat(self, **kw):
        return self.client.chat.completions.create(model=self.model, messages=MESSAGES, **kw)

    def test_chat_non_stream_and_stream_agree(self) -> None:
        full = self.chat(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        choice = full.choices[0]
        self.assertEqual(choice.finish_reason, "length")
        self.assertEqual(full.usage.completion_tokens, 8)
        self.assertEqual(full.usage.total_tokens, full.usage.prompt_tokens + 8)
        stream = self.chat(
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, choice.message.content)
        self.assertEqual([c.choices[0].finish_reason for c in chunks if c.choices][-1], "length")
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, 8)

    def test_reasoning_parser_splits_an_opened_think_block(self) -> None:
        # The tiny preset's template opens no think block: an assistant message "<think>" continued
        # does, so the answer (no "</think>" from a random model) is all reasoning; separate_reasoning
        # false gives the text as generated. (The parser's rules: test/unit/frontend/test_reasoning_parser.py)
        messages = MESSAGES + [{"role": "assistant", "content": "<think>\n"}]
        kw = dict(model=self.model, messages=messages, max_tokens=6, temperature=0)
        extra = {"ignore_eos": True, "continue_final_message": True}
        raw = self.client.chat.completions.create(**kw, extra_body={**extra, "separate_reasoning": False})
        text = raw.choices[0].message.content
        self.assertTrue(text)
        split = self.client.chat.completions.create(**kw, extra_body=extra).choices[0].message
        self.assertEqual((split.reasoning_content, split.content), (text, None))
        chunks = list(self.client.chat.completions.create(**kw, extra_body=extra, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        self.assertEqual("".join(getattr(d, "reasoning_content", None) or "" for d in deltas), text)
        self.assertEqual("".join(d.content or "" for d in deltas), "")
        plain = self.chat(max_tokens=6, temperature=0, extra_body={"ignore_eos": True}).choices[0].message
        self.assertIsNone(getattr(plain, "reasoning_content", None))  # no think block: all content
        self.assertTrue(plain.content)

    def test_a_grammar_applies_after_the_reasoning_the_answer_starts_in(self) -> None:
        """With --reasoning-parser the answer of an open think block thinks first and its regex applies
        after `</think>` (before, the regex held from the first token: the digits landed in
        reasoning_content and content stayed empty); --enable-strict-thinking's budget (upstream's
        custom_params.thinking_budget) ends a random model's thinking, which never would."""
        messages = MESSAGES + [{"role": "assistant", "content": "<think>\n"}]
        extra = {"continue_final_message": True, "regex": "[0-9]{4}", "custom_params": {"thinking_budget": 3}}
        message = self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=30, temperature=0, extra_body=extra
        ).choices[0].message
        self.assertRegex(message.content, r"^[0-9]{4}$")
        self.assertTrue(message.reasoning_content)

    def test_a_thinking_budget_then_a_regex_on_generate(self) -> None:
        """/generate's require_reasoning and max_thinking_tokens (this server: --reasoning-parser qwen3
        --enable-strict-thinking): 4 thinking tokens, the forced </think> (6 tokens in the tiny
        tokenizer), then the regex; without require_reasoning the regex holds from the first token."""
        end = self.post("/tokenize", {"prompt": "</think>", "add_special_tokens": False}).json()["tokens"]
        params = {"max_new_tokens": 40, "temperature": 0.7, "sampling_seed": 3, "regex": "[0-9]{4}"}
        body = {"input_ids": [5, 6, 7], "sampling_params": params}
        out = self.generate(**body, require_reasoning=True, max_thinking_tokens=4)
        ids = out["output_ids"]
        self.assertEqual(ids[4 : 4 + len(end)], end)
        self.assertRegex(out["text"], r"</think>[0-9]{4}$")
        self.assertEqual(out["meta_info"]["finish_reason"]["type"], "stop")
        self.assertRegex(self.generate(**body)["text"], r"^[0-9]{4}$")
        for extra, param in [({"max_thinking_tokens": -1}, "max_thinking_tokens"),
                             ({"require_reasoning": "yes"}, "require_reasoning"),
                             ({"max_thinking_tokens": 3}, "max_thinking_tokens")]:  # fmt: skip
            r = self.post("/generate", {**body, **extra})
            self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, param))

    def test_token_in_token_out(self) -> None:
        """Upstream's TITO extensions, as RL rollouts read them: a chat choice's prompt_token_ids (sent
        back as input_ids they give the same answer), response_token_ids (the ids of meta_info's output
        logprobs, one per completion token); /generate's prompt_token_ids on the reply and every chunk;
        a stream that asks for them is a 400 naming the field."""
        body = {"model": self.model, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True,
                "return_token_ids": True, "return_meta_info": True, "ignore_eos": True}  # fmt: skip
        choice = self.post("/v1/chat/completions", body).json()["choices"][0]
        meta, ids = choice["meta_info"], choice["response_token_ids"]
        self.assertEqual(ids, [entry[1] for entry in meta["output_token_logprobs"]])
        self.assertEqual((len(ids), meta["completion_tokens"]), (5, 5))
        again = self.post("/v1/chat/completions", {**body, "input_ids": choice["prompt_token_ids"]}).json()
        self.assertEqual(again["choices"][0]["response_token_ids"], ids)
        self.assertEqual(again["usage"]["prompt_tokens"], len(choice["prompt_token_ids"]))
        r = self.post("/v1/chat/completions", {**body, "stream": True})
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "return_token_ids"))
        native = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}, "return_prompt_token_ids": True}
        self.assertEqual(self.generate(**native)["prompt_token_ids"], [5, 6, 7])
        chunks = sse_events(self.post("/generate", {**native, "stream": True}, stream=True))[:-1]
        self.assertTrue(chunks and all(c["prompt_token_ids"] == [5, 6, 7] for c in chunks))
        self.assertNotIn("prompt_token_ids", self.generate(input_ids=[5, 6, 7]))
        # /v1/completions' return_token_ids: whole, and streamed (the new ids in each chunk, the prompt's
        # in each choice's first), n = 2.
        body = {"model": self.model, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "n": 2,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        whole = self.post("/v1/completions", body).json()["choices"]
        self.assertEqual([c["prompt_token_ids"] for c in whole], [[5, 6, 7]] * 2)
        self.assertEqual(whole[0]["token_ids"], self.generate(input_ids=[5, 6, 7], sampling_params={
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True})["output_ids"])  # fmt: skip
        events = sse_events(self.post("/v1/completions", {**body, "stream": True}, stream=True))[:-1]
        for i in range(2):
            mine = [c for e in events for c in e["choices"] if c["index"] == i]
            self.assertEqual(sum((c.get("token_ids") or [] for c in mine), []), whole[i]["token_ids"])
            self.assertEqual([c["prompt_token_ids"] for c in mine if "prompt_token_ids" in c], [[5, 6, 7]])

    def test_a_chat_with_tools_answers(self) -> None:
        # The tiny model calls nothing: the answer is content (the parsing of calls, whole and streamed:
        # test/unit/frontend/test_tool_call_parser.py).
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        for choice in ("auto", "none"):
            out = self.chat(max_tokens=4, temperature=0, tools=tools, tool_choice=choice, extra_body={"ignore_eos": True})
            self.assertEqual(out.choices[0].finish_reason, "length")
            self.assertTrue(out.choices[0].message.content)
            self.assertFalse(out.choices[0].message.tool_calls)

    def test_completions_non_stream_and_stream_agree(self) -> None:
        ids = prompt_ids(30, 1)
        full = self.client.completions.create(model=self.model, prompt=ids, max_tokens=6, temperature=0)
        self.assertEqual(full.usage.prompt_tokens, 30)
        stream = self.client.completions.create(
            model=self.model, prompt=ids, max_tokens=6, temperature=0, stream=True
        )
        text = "".join(c.choices[0].text for c in stream)
        self.assertEqual(text, full.choices[0].text)

    def test_chat_logprobs(self) -> None:
        out = self.chat(
            max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}
        )
        content = out.choices[0].logprobs.content
        self.assertEqual(len(content), out.usage.completion_tokens)
        for tok in content:
            self.assertLessEqual(tok.logprob, 0.0)
            self.assertEqual(len(tok.top_logprobs), 3)
            tops = [t.logprob for t in tok.top_logprobs]
            self.assertEqual(tops, sorted(tops, reverse=True))
            # Greedy: the chosen token is the most likely one.
            self.assertAlmostEqual(tok.logprob, tops[0], places=5)

    def test_completion_logprobs(self) -> None:
        out = self.client.completions.create(
            model=self.model, prompt="Hello", max_tokens=4, temperature=0, logprobs=2
        )
        lp = out.choices[0].logprobs
        self.assertEqual(len(lp.tokens), out.usage.completion_tokens)
        self.assertEqual(len(lp.token_logprobs), len(lp.tokens))
        self.assertEqual(lp.text_offset, sorted(lp.text_offset))
        self.assertTrue(all(len(t) <= 2 for t in lp.top_logprobs))

    def test_cached_tokens_on_repeated_prefix(self) -> None:
        self.flush_cache()
        ids = prompt_ids(200, 2)
        first = self.client.completions.create(model=self.model, prompt=ids, max_tokens=2, temperature=0)
        self.assertEqual(first.usage.prompt_tokens_details.cached_tokens, 0)
        second = self.client.completions.create(
            model=self.model, prompt=ids + [7, 8], max_tokens=2, temperature=0
        )
        cached = second.usage.prompt_tokens_details.cached_tokens
        self.assertGreater(cached, 0)
        self.assertLessEqual(cached, 200)

        # Upstream's cache namespaces: another tenant's salt (or key) hits nothing of this prefix; its own
        # does, once it has run.
        def cached_for(**extra) -> int:
            out = self.client.completions.create(
                model=self.model, prompt=ids + [7, 8], max_tokens=2, temperature=0, extra_body=extra
            )
            return out.usage.prompt_tokens_details.cached_tokens

        self.assertEqual(cached_for(cache_salt="tenant-b"), 0)
        self.assertEqual(cached_for(cache_salt="tenant-b", extra_key="x"), 0)
        self.assertGreater(cached_for(cache_salt="tenant-b"), 0)

    def test_n_and_stop(self) -> None:
        out = self.chat(max_tokens=4, n=2, temperature=0)
        self.assertEqual([c.index for c in out.choices], [0, 1])
        base = self.client.completions.create(
            model=self.model,
            prompt="Once",
            max_tokens=16,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        tokens = base.choices[0].logprobs.tokens
        # A token from the middle with plain printable text makes a stop string the output surely holds.
        k, stop = next(
            (k, t) for k, t in enumerate(tokens) if k >= 2 and t.strip().isascii() and t.strip().isalnum()
        )
        stopped = self.client.completions.create(
            model=self.model,
            prompt="Once",
            max_tokens=16,
            temperature=0,
            stop=[stop.strip()],
            extra_body={"ignore_eos": True},
        )
        self.assertEqual(stopped.choices[0].finish_reason, "stop")
        text = base.choices[0].text
        self.assertEqual(stopped.choices[0].text, text[: text.index(stop.strip())])

    def test_seed_makes_sampling_reproducible(self) -> None:
        a = self.chat(max_tokens=8, temperature=1.0, seed=42)
        b = self.chat(max_tokens=8, temperature=1.0, seed=42)
        self.assertEqual(a.choices[0].message.content, b.choices[0].message.content)

    def test_models_and_model_info(self) -> None:
        self.assertEqual([m.id for m in self.client.models.list()], [self.model])
        self.assertEqual(self.client.models.retrieve(self.model).id, self.model)  # (upstream's /v1/models/{model})
        with self.assertRaises(openai.NotFoundError):
            self.client.models.retrieve("no-such-model")
        info = self.get("/get_model_info").json()
        self.assertEqual((info["model_path"], info["vocab_size"]), (self.model, 512))

    def test_api_key_is_required_except_for_health(self) -> None:
        self.assertEqual(requests.get(self.base_url + "/health", timeout=10).status_code, 200)
        for path in ("/get_server_info", "/v1/models", "/metrics"):
            r = requests.get(self.base_url + path, timeout=10)
            self.assertEqual(r.status_code, 401, path)
            self.assertEqual(r.json()["error"]["code"], "invalid_api_key")
        bad = openai.OpenAI(base_url=self.base_url + "/v1", api_key="wrong")
        with self.assertRaises(openai.AuthenticationError):
            bad.models.list()

    def test_a_session_turn_is_the_whole_prompt_served_from_the_cache(self) -> None:
        """Upstream's sessions over HTTP: a turn that names the earlier one is served as its whole prompt
        (input, outputs, new ids: the same tokens and logprobs as that prompt sent at once) and reuses the
        earlier turn's cached state: all of its 76 positions but its last output, which never ran through
        the model (every strategy keeps a finished request's state at its end)."""
        sid = self.post("/open_session", {"capacity_of_str_len": 1000}).json()
        self.assertEqual(self.post("/open_session", {"session_id": sid}).status_code, 400)
        r = self.post("/open_session", {"streaming": True})
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "streaming"))
        greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        prompt = [10 + (i * 7) % 300 for i in range(70)]  # (no cached prefix from other tests)
        rid = f"turn-{uuid.uuid4().hex}"
        first = self.generate(input_ids=prompt, sampling_params=greedy, rid=rid, session_params={"id": sid})
        new = {"input_ids": [5, 6, 7], "sampling_params": greedy, "return_logprob": True}
        turn = self.generate(**new, session_params={"id": sid, "rid": rid})
        whole = self.generate(**{**new, "input_ids": prompt + first["output_ids"] + [5, 6, 7]})
        self.assertEqual(turn["output_ids"], whole["output_ids"])
        # 1e-4: the project's float32 bound between a cache hit and a cold prefill (the two may hit the
        # cache at different boundaries).
        for (a, _, _), (b, _, _) in zip(turn["meta_info"]["output_token_logprobs"], whole["meta_info"]["output_token_logprobs"], strict=True):  # fmt: skip
            self.assertAlmostEqual(a, b, delta=1e-4)
        self.assertEqual(turn["meta_info"]["prompt_tokens"], 70 + 6 + 3)
        self.assertEqual(turn["meta_info"]["cached_tokens"], 70 + 6 - 1)
        self.assertEqual(self.post("/close_session", {"session_id": sid}).status_code, 200)
        r = self.post("/generate", {**new, "session_params": {"id": sid, "rid": rid}})
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "session_params.id"))

    def test_native_generate_batch_and_stream(self) -> None:
        # ignore_eos (both requests): at the default temperature an unseeded request draws from the
        # server's generator, whose state depends on every request and batch before it, and the random
        # model may sample its EOS early (the stream ended after 3 of 4 tokens in one CI run).
        outs = self.generate(
            text=["Hi", "Hello there"], sampling_params={"max_new_tokens": 3, "ignore_eos": True}
        )
        self.assertEqual([o["meta_info"]["completion_tokens"] for o in outs], [3, 3])
        r = self.post(
            "/generate",
            {
                "input_ids": [5, 6, 7],
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                "stream": True,
            },
            stream=True,
        )
        events = sse_events(r)
        self.assertEqual(events[-1], "[DONE]")
        texts = [e["text"] for e in events[:-1]]
        self.assertTrue(all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)), texts)
        self.assertEqual(events[-2]["meta_info"]["completion_tokens"], 4)

    def test_abort_request_route(self) -> None:
        result = {}

        def run() -> None:
            body = {
                "input_ids": [5, 6],
                "rid": "abort-me",
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            }
            result["out"] = self.post("/generate", body).json()

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 30
        while self.internal_state()["num_running_reqs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.post("/abort_request", {"rid": "abort-me"}).status_code, 200)
        t.join(60)
        self.assertEqual(result["out"]["meta_info"]["finish_reason"]["type"], "abort")
        self.assertLess(result["out"]["meta_info"]["completion_tokens"], 3000)

    def test_startup_log_names_strategy_pools_and_slots(self) -> None:
        self.assertRegex(
            self.server.log_text(),
            r"--mamba-scheduler-strategy extra_buffer_lazy .*token pool \d+ tokens, mamba pool \d+ slots, "
            r"\d+ resident mamba slots per running request, max running requests \d+ \(derived, keeping 2 "
            r"mamba slots per request for the radix cache\)",
        )

    def test_health_generate_server_info_and_metrics(self) -> None:
        self.assertEqual(self.get("/health_generate").status_code, 200)
        info = self.get("/get_server_info").json()
        self.assertEqual(info["mamba_scheduler_strategy"], "extra_buffer_lazy")
        self.assertIn("mamba_usage", info["internal_states"][0])
        metrics = self.get("/metrics").text
        for name in (
            "sglang:num_requests_total",
            "sglang:prompt_tokens_total",
            "sglang:generation_tokens_total",
            "sglang:cache_hit_rate",
            "sglang:mamba_usage",
            "sglang:mamba_lazy_alloc_failures_total",
        ):
            self.assertIn(name, metrics)
        responses = {f.name: f for f in text_string_to_metric_families(metrics)}["sglang:http_responses"]
        ok = [s for s in responses.samples if s.labels["status_code"] == "200" and s.labels["model_name"] == self.model]
        self.assertTrue(ok, responses.samples)
        self.assert_idle_accounting()

    def scrape(self) -> dict[str, Any]:
        return {f.name: f for f in text_string_to_metric_families(self.get("/metrics").text)}

    def test_metrics_upstream_families(self) -> None:
        # Upstream's families (issue 60, item 3) on this server, read with prometheus_client's parser:
        # each present with upstream's type, and the request counts moved by exactly this traffic
        # (the class's tests run one at a time; /health_generate is not counted).
        before = self.scrape()
        # The same 300-token prompt k times: the later prefills hit the cache (a 40-token one left no
        # mamba state to reuse); 47 decode steps each close a --decode-log-interval window.
        prompt, k, n = prompt_ids(300, seed=60), 3, 48
        for _ in range(k):
            body = {
                "input_ids": prompt,
                "stream": True,
                "sampling_params": {"max_new_tokens": n, "ignore_eos": True},
            }
            self.assertEqual(sse_events(self.post("/generate", body, stream=True))[-1], "[DONE]")
        after = self.scrape()

        def delta(sample: str, **labels: str) -> float:
            return metric_value(after, sample, **labels) - metric_value(before, sample, **labels, missing=0.0)

        model = {"model_name": self.model}
        self.assertEqual(delta("sglang:num_requests_total", **model), k)
        self.assertEqual(delta("sglang:generation_tokens_total", **model), k * n)
        self.assertEqual(delta("sglang:prompt_tokens_total", **model), k * len(prompt))
        self.assertGreater(delta("sglang:cached_tokens_total", cache_source="device"), 0)
        self.assertEqual(delta("sglang:time_to_first_token_seconds_count", **model), k)
        # One token a message (--stream-interval 1): every token after each request's first.
        self.assertEqual(delta("sglang:inter_token_latency_seconds_count", **model), k * (n - 1))
        self.assertEqual(delta("sglang:e2e_request_latency_seconds_count", **model), k)
        self.assertEqual(delta("sglang:queue_time_seconds_count", **model), k)
        self.assertEqual(delta("sglang:realtime_tokens_total", mode="decode"), k * (n - 1))
        self.assertEqual(delta("sglang:http_requests_total", endpoint="/generate", method="POST"), k)
        # The scrape itself is the one request in flight.
        self.assertEqual(
            metric_value(after, "sglang:http_requests_active", endpoint="/metrics", method="GET"), 1
        )
        for sample, labels in [
            ("sglang:gen_throughput", model),
            ("sglang:cache_hit_rate", model),
            ("sglang:max_total_num_tokens", model),
            ("sglang:inter_token_latency_seconds_sum", model),
            ("sglang:queue_time_seconds_sum", model),
            ("sglang:weight_memory_usage_gb", model),
            ("sglang:kv_cache_memory_usage_gb", model),
            ("sglang:startup_time_seconds", {"phase": "load_weight"}),
            ("sglang:startup_time_seconds", {"phase": "kv_cache_allocation"}),
            ("sglang:startup_time_seconds", {"phase": "scheduler_e2e"}),
            ("sglang:scheduler_idle_seconds_total", model),
            ("sglang:scheduler_process_cpu_seconds_total", model),
            ("sglang:process_cpu_seconds_total", {"component": "tokenizer"}),
            ("sglang:realtime_tokens_total", {"mode": "prefill_compute"}),
            ("sglang:realtime_tokens_total", {"mode": "prefill_cache"}),
        ]:
            self.assertGreater(metric_value(after, sample, **labels), 0, (sample, labels))
        for name, kind in UPSTREAM_TYPES.items():
            self.assertEqual(after[name].type, kind, name)
        for gauge in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_grammar_queue_reqs"):
            self.assertEqual(metric_value(after, gauge, **model), 0)  # idle again
        self.assertEqual(metric_value(after, "sglang:num_used_tokens", **model), 0)

    def test_api_key_is_never_echoed(self) -> None:
        info = self.get("/get_server_info")
        self.assertNotIn(self.api_key, info.text)
        self.assertEqual(info.json()["api_key"], "<redacted>")
        self.assertNotIn(self.api_key, self.get("/metrics").text)
        self.assertNotIn(self.api_key, self.server.log_text())

    def test_stop_regex_on_every_route(self) -> None:
        base = (
            self.client.completions.create(
                model=self.model, prompt="Once", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )
        # A character from the middle of the output: a pattern the output surely matches there.
        char = next(c for c in base[len(base) // 3 :] if c.isascii() and c.isalnum())
        pattern = f"[{char}]"
        stopped = self.client.completions.create(
            model=self.model,
            prompt="Once",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True, "stop_regex": pattern},
        ).choices[0]
        self.assertEqual(stopped.finish_reason, "stop")
        self.assertEqual(stopped.matched_stop, pattern, "upstream reports the pattern")
        self.assertTrue(base.startswith(stopped.text) and len(stopped.text) < len(base))
        self.assertIsNotNone(re.search(pattern, stopped.text), "upstream keeps the matched text")
        native = self.generate(
            text="Once",
            sampling_params={
                "max_new_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "stop_regex": [pattern],
            },
        )
        self.assertEqual(native["meta_info"]["finish_reason"], {"type": "stop", "matched": pattern})
        self.assertEqual(native["text"], stopped.text)
        chat = self.chat(
            max_tokens=32, temperature=0, extra_body={"ignore_eos": True, "stop_regex": "[A-Za-z0-9]"}
        )
        self.assertEqual(chat.choices[0].finish_reason, "stop")
        self.assertEqual(chat.choices[0].matched_stop, "[A-Za-z0-9]")

    def test_hidden_states_on_the_native_and_openai_routes(self) -> None:
        """Upstream's shapes: meta_info.hidden_states is the prompt's [prompt, hidden] then one [hidden]
        per output token fed back; an OpenAI choice carries the last position's."""
        params = {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": params}
        meta = self.post("/generate", {**body, "return_hidden_states": True}).json()["meta_info"]
        prompt, *steps = meta["hidden_states"]
        width = len(prompt[0])
        self.assertEqual((len(prompt), len(steps)), (4, 4))
        self.assertTrue(all(len(row) == width for row in prompt + steps))
        self.assertNotIn("hidden_states", self.post("/generate", body).json()["meta_info"])
        extra = {"return_hidden_states": True, "ignore_eos": True}
        comp = self.client.completions.create(
            model=self.model, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0, extra_body=extra
        )
        self.assertEqual(comp.choices[0].model_extra["hidden_states"], steps[-1])
        chunks = list(self.client.completions.create(
            model=self.model, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0, extra_body=extra, stream=True
        ))  # fmt: skip
        # As upstream: one more chunk after the finishing one, with the hidden states and no reason.
        finishing, after = [c.choices[0] for c in chunks if c.choices][-2:]
        self.assertEqual((finishing.finish_reason, after.finish_reason), ("length", None))
        self.assertEqual(after.model_extra["hidden_states"], steps[-1])
        chat = list(self.client.chat.completions.create(
            model=self.model, messages=MESSAGES, max_tokens=3, temperature=0, extra_body=extra, stream=True
        ))  # fmt: skip
        finishing, after = [c.choices[0] for c in chat if c.choices][-2:]
        self.assertEqual((finishing.finish_reason, after.finish_reason), ("length", None))
        self.assertEqual(len(after.delta.model_extra["hidden_states"]), width)

    def test_chat_errors_keep_their_words(self) -> None:
        r = self.post(
            "/v1/chat/completions",
            {"model": self.model, "messages": MESSAGES, "response_format": {"type": "yaml"}},
        )
        self.assertEqual(r.status_code, 400)
        err = r.json()["error"]
        self.assertEqual(err["param"], "response_format")
        self.assertIn("response_format type 'yaml' is not one of", err["message"])

    def test_structured_outputs_on_every_route(self) -> None:
        """A JSON schema (OpenAI's response_format), a regex and an EBNF grammar hold the output to their
        language on the chat, completions and native routes, streamed or not; a bad one is a 400. (The
        server runs with --constrained-json-disable-any-whitespace: with free whitespace the demo model
        writes newlines after the first key until max_tokens, which the schema allows.)"""
        schema = {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Lyon"]}, "sure": {"type": "boolean"}},
            "required": ["city", "sure"],
            "additionalProperties": False,
        }
        rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        chat = self.chat(max_tokens=64, temperature=0, response_format=rf)
        self.assertEqual(chat.choices[0].finish_reason, "stop")
        answer = orjson.loads(chat.choices[0].message.content)
        self.assertIn(answer["city"], ("Paris", "Lyon"))
        self.assertIsInstance(answer["sure"], bool)
        streamed = self.chat(max_tokens=64, temperature=0, response_format=rf, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        self.assertEqual(text, chat.choices[0].message.content)
        comp = self.client.completions.create(
            model=self.model, prompt="def f(x):", max_tokens=16, temperature=0, extra_body={"regex": "yes|no"}
        )
        self.assertIn(comp.choices[0].text, ("yes", "no"))
        self.assertEqual(comp.choices[0].finish_reason, "stop")
        body = {"text": "x = ", "sampling_params": {"max_new_tokens": 8, "ebnf": 'root ::= [0-9] [0-9]'}}
        out = self.post("/generate", body).json()
        self.assertRegex(out["text"], r"^[0-9]{2}$")
        self.assertEqual(out["meta_info"]["finish_reason"]["type"], "stop")
        # A forced tool call (a named function: exactly one call, its parameters by their schema).
        params = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
        params["additionalProperties"] = False
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        chat = self.chat(max_tokens=64, temperature=0, tools=tools, tool_choice=named)
        (call,) = chat.choices[0].message.tool_calls
        self.assertEqual(chat.choices[0].finish_reason, "tool_calls")
        self.assertEqual(call.function.name, "get_weather")
        self.assertIn(orjson.loads(call.function.arguments)["unit"], ("c", "f"))
        # Grammars xgrammar refuses (the scheduler parses them): a 400 naming the field they came from.
        bad_tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
        chat = {"model": self.model, "messages": MESSAGES}
        for route, bad, param in [
            ("/generate", {"text": "x", "sampling_params": {"regex": "("}}, "regex"),
            ("/v1/completions", {"model": self.model, "prompt": "x", "ebnf": "root ::= y"}, "ebnf"),
            ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": {"type": "nonsense"}}}}, "response_format"),
            ("/v1/chat/completions", {**chat, "tools": bad_tools, "tool_choice": "required"}, "tools"),
        ]:  # fmt: skip
            r = self.post(route, bad)
            self.assertEqual(r.status_code, 400, r.text)
            self.assertEqual(r.json()["error"]["param"], param)
            self.assertIn("could not be compiled", r.json()["error"]["message"])
        # upstream's "any JSON value"
        any_json = {"max_new_tokens": 24, "json_schema": "$$ANY$$"}
        out = self.post("/generate", {"text": "x = ", "sampling_params": any_json})
        self.assertEqual(out.status_code, 200, out.text)

    def test_responses_api(self) -> None:
        """/v1/responses through the openai client: the answer chat gives the same conversation, whole and
        streamed; a chained turn (previous_response_id) is the replayed conversation (same prompt, same
        greedy answer); stored responses are retrieved, listed and deleted; a bad grammar names text.format.
        (The rules: test/unit/frontend/test_responses_api.py.)"""
        greedy = {"max_output_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
        first = self.client.responses.create(model=self.model, input=MESSAGES, **greedy)
        chat = self.chat(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        self.assertEqual(first.output_text, chat.choices[0].message.content)
        self.assertEqual((first.status, first.incomplete_details.reason), ("incomplete", "max_output_tokens"))
        self.assertEqual(first.usage.input_tokens, chat.usage.prompt_tokens)
        events = list(self.client.responses.create(model=self.model, input=MESSAGES, stream=True, **greedy))
        self.assertEqual(events[-1].type, "response.incomplete")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        self.assertEqual((text, events[-1].response.output_text), (first.output_text, first.output_text))
        turn = [{"role": "user", "content": "And of Italy?"}]
        chained = self.client.responses.create(
            model=self.model, input=turn, previous_response_id=first.id, **greedy
        )
        replay = MESSAGES + [{"role": "assistant", "content": first.output_text}] + turn
        replayed = self.client.responses.create(model=self.model, input=replay, store=False, **greedy)
        self.assertEqual(chained.usage.input_tokens, replayed.usage.input_tokens)
        self.assertEqual(chained.output_text, replayed.output_text)
        self.assertEqual(self.client.responses.retrieve(first.id).output_text, first.output_text)
        r = requests.get(f"{self.base_url}/v1/responses/{chained.id}/input_items?limit=abc", headers=self.headers())
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "limit"), r.text)
        items = self.client.responses.input_items.list(chained.id)
        self.assertEqual([i.content[0].text for i in items.data], ["And of Italy?"])
        self.client.responses.delete(chained.id)
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.retrieve(chained.id)
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.retrieve(replayed.id)  # store: false
        bad = {"type": "json_schema", "name": "n", "schema": {"type": "nonsense"}}
        r = self.post("/v1/responses", {"model": self.model, "input": "x", "text": {"format": bad}})
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "text.format"), r.text)
        long = " ".join(f"w{i}" for i in range(40_000))  # past the context length
        r = self.post("/v1/responses", {"model": self.model, "input": long})
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "input"), r.text)

    def test_anthropic_messages_api(self) -> None:
        """/v1/messages through the anthropic client (its key as x-api-key): the answer chat gives the same
        conversation, whole and streamed; count_tokens counts the prompt; a stop sequence; errors in
        Anthropic's shape. (The rules: test/unit/frontend/test_anthropic_api.py.)"""
        client = anthropic.Anthropic(base_url=self.base_url, api_key=self.api_key)
        greedy = {"model": self.model, "max_tokens": 6, "messages": MESSAGES,
                  "extra_body": {"temperature": 0, "ignore_eos": True}}  # fmt: skip
        whole = client.messages.create(**greedy)
        chat = self.chat(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        self.assertEqual((whole.content[0].text, whole.stop_reason), (chat.choices[0].message.content, "max_tokens"))
        usage = whole.usage
        self.assertEqual(usage.input_tokens + usage.cache_read_input_tokens, chat.usage.prompt_tokens)
        with client.messages.stream(**greedy) as stream:
            streamed = stream.get_final_message()
        self.assertEqual((streamed.content[0].text, streamed.stop_reason), (whole.content[0].text, "max_tokens"))
        counted = client.messages.count_tokens(model=self.model, messages=MESSAGES)
        self.assertEqual(counted.input_tokens, chat.usage.prompt_tokens)
        stop = whole.content[0].text[2:4]  # (greedy: the same text comes again and stops there)
        stopped = client.messages.create(**{**greedy, "max_tokens": 6}, stop_sequences=[stop])
        self.assertEqual((stopped.stop_reason, stopped.stop_sequence), ("stop_sequence", stop))
        with self.assertRaises(anthropic.BadRequestError) as e:
            client.messages.create(model=self.model, max_tokens=4, messages=[{"role": "system", "content": "x"}])
        self.assertEqual(e.exception.body["error"]["type"], "invalid_request_error")
        with self.assertRaises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=self.base_url, api_key="wrong").messages.create(**greedy)

    def test_score_api(self) -> None:
        """Upstream's /v1/score: each label token's probability after query + item, as /generate's
        logprobs give it; renormalized over the labels with apply_softmax; item_first swaps the two; a
        batch scores as its items alone."""
        query, items = prompt_ids(20, 3), [prompt_ids(6, 4), prompt_ids(9, 5)]
        labels = [5, 17, 100]

        def score(**kw) -> list[list[float]]:
            body = {"model": self.model, "query": query, "items": items, "label_token_ids": labels, **kw}
            r = self.post("/v1/score", body)
            self.assertEqual(r.status_code, 200, r.text)
            self.assertEqual(r.json()["object"], "scoring")
            return r.json()["scores"]

        # Alone or in a batch, from the prefix cache or not: the same up to float32 rounding (batch shapes
        # and cache hits change the sums' order; 1e-4 relative is far above that, far below a wrong token).
        close = lambda a, b: all(abs(x - y) <= 1e-4 * max(x, y) for x, y in zip(a, b, strict=True))  # noqa: E731
        plain = score()
        for item, row in zip(items, plain, strict=True):
            out = self.post("/generate", {"input_ids": query + item, "return_logprob": True,
                                          "token_ids_logprob": labels, "sampling_params": {"max_new_tokens": 1}}).json()
            want = {e[1]: math.exp(e[0]) for e in out["meta_info"]["output_token_ids_logprobs"][0]}
            self.assertTrue(close(row, [want[label] for label in labels]), (row, want))
        soft = score(apply_softmax=True)
        for p_row, s_row in zip(plain, soft, strict=True):
            self.assertAlmostEqual(sum(s_row), 1.0, places=6)
            self.assertAlmostEqual(s_row[0] / s_row[1], p_row[0] / p_row[1], places=4)
        self.assertTrue(close(score(items=items[:1])[0], plain[0]))
        swapped = self.post("/v1/score", {"query": items[0], "items": [query], "label_token_ids": labels}).json()
        self.assertTrue(close(score(item_first=True)[0], swapped["scores"][0]))
        # Review: a prompt past the input limit is refused, never cut (--allow-auto-truncate would score
        # another position); the messages name this API's fields.
        limit = self.get("/get_model_info").json()["max_req_input_len"]
        r = self.post("/v1/score", {"query": [5] * limit, "items": [[6]], "label_token_ids": labels})
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "items[0]"), r.text)
        r = self.post("/v1/score", {"query": query, "items": items, "label_token_ids": [-1]})
        self.assertNotIn("token_ids_logprob", r.json()["error"]["message"])
        for bad, param in (({"items": ["text"]}, "items"), ({"label_token_ids": []}, "label_token_ids"),
                           ({"label_token_ids": [10**9]}, "label_token_ids"),
                           ({"label_token_ids": list(range(5, 30))}, "label_token_ids")):  # fmt: skip
            r = self.post("/v1/score", {"query": query, "items": items, "label_token_ids": labels, **bad})
            self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, param), r.text)

    def test_completions_echo(self) -> None:
        """echo (as lm-eval's loglikelihood asks: max_tokens 0, logprobs 1): the prompt's text comes first,
        with its tokens' logprobs (the first has none) as /generate's input logprobs give them; streamed
        the same; a token-id prompt echoes its decoded text."""
        prompt = "def add(a, b):\n    return"
        kw = {"model": self.model, "prompt": prompt, "temperature": 0}
        scored = self.client.completions.create(**kw, max_tokens=0, echo=True, logprobs=1)
        choice = scored.choices[0]
        self.assertEqual(choice.text, prompt)
        lp = choice.logprobs
        self.assertIsNone(lp.token_logprobs[0])
        self.assertEqual("".join(lp.tokens), prompt)
        self.assertEqual(lp.text_offset, [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))])
        native = self.post("/generate", {"text": prompt, "return_logprob": True, "logprob_start_len": 0,
                                         "sampling_params": {"max_new_tokens": 0}}).json()  # fmt: skip
        want = [e[0] for e in native["meta_info"]["input_token_logprobs"]]
        self.assertEqual(len(want), len(lp.token_logprobs))
        for got, ref in zip(lp.token_logprobs[1:], want[1:], strict=True):
            self.assertAlmostEqual(got, ref, places=4)  # (float32: the same path, maybe another batch)
        self.assertIsNone(lp.top_logprobs[0])  # (no prediction for the first token: null, as OpenAI)
        self.assertTrue(all(lp.top_logprobs[1:]))
        plain = self.client.completions.create(**kw, max_tokens=4).choices[0].text
        echoed = self.client.completions.create(**kw, max_tokens=4, echo=True, logprobs=0)
        self.assertEqual(echoed.choices[0].text, prompt + plain)
        n_prompt = len(lp.tokens)  # (the answer's tokens begin where the prompt's text ends)
        self.assertEqual(echoed.choices[0].logprobs.text_offset[n_prompt], len(prompt))
        wide = "你好 é world"  # (characters split across tokens: the tokens' texts are longer than it)
        out = self.client.completions.create(model=self.model, prompt=wide, max_tokens=2, echo=True, logprobs=0)
        lp_wide = out.choices[0].logprobs
        first_answer = len(self.post("/tokenize", {"prompt": wide}).json()["tokens"])
        self.assertEqual(lp_wide.text_offset[first_answer], len(wide))
        streamed = "".join(c.choices[0].text for c in self.client.completions.create(**kw, max_tokens=4, echo=True,
                                                                                   stream=True))  # fmt: skip
        self.assertEqual(streamed, prompt + plain)
        prompts = ["x = 1\n", "import os\n"]
        batch = self.client.completions.create(model=self.model, prompt=prompts, n=2, max_tokens=2, echo=True,
                                               temperature=1, seed=3)  # fmt: skip
        self.assertEqual(len(batch.choices), 4)
        for c in batch.choices:  # (a prompt's n samples follow each other)
            self.assertTrue(c.text.startswith(prompts[c.index // 2]), (c.index, c.text))
        ids = prompt_ids(12, 9)
        by_ids = self.client.completions.create(model=self.model, prompt=ids, max_tokens=0, echo=True)
        self.assertEqual(by_ids.choices[0].text, self.post("/detokenize", {"tokens": ids}).json()["text"])

    def test_profile_routes(self) -> None:
        """Upstream's /start_profile and /stop_profile (admin routes: the API key here), a trace of the
        batches asked for in the server's SGLANG_TORCH_PROFILER_DIR (/tmp), refusals naming the field."""
        name = f"sglang-test-profile-{uuid.uuid4().hex}"
        folder = Path("/tmp") / name
        try:
            assert requests.post(self.base_url + "/start_profile", json={}, timeout=30).status_code == 401
            refused = self.post("/start_profile", {"output_dir": "/etc"})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "output_dir"
            body = {"output_dir": name, "num_steps": 2, "with_stack": False, "profile_id": "e2e"}
            started = self.post("/start_profile", body)
            assert started.status_code == 200 and started.text == "Start profiling.\n"
            again = self.post("/start_profile", {"output_dir": name})
            assert again.status_code == 400 and "already in progress" in again.text
            self.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4}}).raise_for_status()
            assert (folder / "e2e-TP-0.trace.json.gz").stat().st_size > 0  # (stopped itself at 2 batches)
            stop = requests.get(self.base_url + "/stop_profile", headers=self.headers(), timeout=30)
            assert stop.status_code == 400 and "not in progress" in stop.text
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def test_load_routes(self) -> None:
        """Upstream's /get_load (what sglang-router's load-aware policies poll) and /v1/loads on the real
        server: one replica, idle between tests (nothing running or waiting)."""
        (load,) = self.get("/get_load").json()
        assert load["dp_rank"] == 0 and load["num_reqs"] == 0 and load["num_tokens"] == 0, load
        report = self.get("/v1/loads?include=all").json()
        (core,) = report["loads"]
        assert report["dp_rank_count"] == 1 and core["num_total_tokens"] > 0 and "memory" in core
        text = self.get("/v1/loads?format=prometheus").text
        assert 'sglang_num_total_tokens{dp_rank="0"}' in text

    def test_freeze_gc(self) -> None:
        """Upstream's /freeze_gc (an admin route: the API key here) answers, and the server serves on."""
        reply = self.post("/freeze_gc")
        assert reply.status_code == 200 and reply.text == "Garbage collection frozen.\n", reply.text
        out = self.generate(text="Hi", sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        assert len(out["output_ids"]) == 3
