"""Upstream's front-end flags on one real server, over HTTPS (`server_args_frontend.py`):

- `--ssl-keyfile` / `--ssl-certfile`: the server speaks TLS with that certificate (verified by the client);
- `--chat-template FILE.jinja`: /v1/chat/completions renders that template, not the checkpoint's;
- `--default-chat-template-kwargs`: its variables reach the template; a request's chat_template_kwargs win,
  key by key;
- `--preferred-sampling-params`: fields a request leaves unset take its values (a max_new_tokens of its is
  a default, cut to the context), a request's own win; /get_model_info shows them;
- `--stream-response-default-include-usage`: a stream ends with a usage event without stream_options;
- `--allow-auto-truncate`: a prompt over the limit (token ids, text, chat) keeps its first tokens;
- `--abort-on-priority-when-disabled` (no priority scheduling here): a request naming a priority gets 503;
- `--max-queued-requests 1` with `--max-running-requests 1`: a request beyond the one waiting gets 503
  "The request queue is full.", the others are served, and nothing is left held;
- `--log-requests --log-requests-level 1 --log-requests-format json`: a JSON line when a request arrives
  (its sampling parameters, not its text) and one when it finishes;
- `--uvicorn-access-log-exclude-prefixes /health /get_model`: no access line for those paths.

The start-time refusals (one sentence naming the flag) are in test/unit/foundation/test_server_args_frontend.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=25, suite="per-commit-cpu")

# Roles in markers, and the `greeting` variable (--default-chat-template-kwargs) after the messages.
TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
    "{% if greeting is defined %}[{{ greeting }}]{% endif %}{% if add_generation_prompt %}<<assistant>>{% endif %}"
)
PREFERRED = {"max_new_tokens": 5, "ignore_eos": True}


class TestFrontendFlags(ServerTestCase):
    server_args = [
        "--chat-template", "WORKDIR/template.jinja",
        "--default-chat-template-kwargs", json.dumps({"greeting": "hello there, friend"}),
        "--preferred-sampling-params", json.dumps(PREFERRED),
        "--stream-response-default-include-usage",
        "--max-running-requests", "1", "--max-queued-requests", "1", "--abort-on-priority-when-disabled",
        "--allow-auto-truncate", "--context-length", "512",  # (the long prompts below: ~510 tokens)
        "--ssl-keyfile", "WORKDIR/key.pem", "--ssl-certfile", "WORKDIR/cert.pem",
        "--log-requests", "--log-requests-level", "1", "--log-requests-format", "json",
        "--uvicorn-access-log-exclude-prefixes", "/health", "/get_model",
    ]  # fmt: skip

    @classmethod
    def prepare(cls, folder: Path) -> None:
        (folder / "template.jinja").write_text(TEMPLATE)
        openssl = shutil.which("openssl")
        assert openssl, "the test makes its certificate with the openssl command"
        subprocess.run(
            [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(folder / "key.pem"),
             "-out", str(folder / "cert.pem")],
            check=True, capture_output=True,
        )  # fmt: skip
        cls.server_args = [a.replace("WORKDIR", str(folder)) for a in cls.server_args]

    def prompt_tokens(self, text: str) -> int:
        r = self.post("/tokenize", {"prompt": text, "add_special_tokens": False})
        self.assertEqual(r.status_code, 200, r.text)
        return r.json()["count"]

    def chat_prompt_tokens(self, **extra) -> int:
        body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 2, **extra}
        r = self.post("/v1/chat/completions", body)
        self.assertEqual(r.status_code, 200, r.text)
        return r.json()["usage"]["prompt_tokens"]

    def test_https_with_the_given_certificate(self):
        self.assertTrue(self.base_url.startswith("https://"))
        self.assertEqual(requests.get(self.base_url + "/health", verify=self.server.verify, timeout=10).status_code, 200)
        with self.assertRaises(requests.exceptions.SSLError):  # (the certificate is not a trusted CA's)
            requests.get(self.base_url + "/health", timeout=10)
        with self.assertRaises(requests.exceptions.ConnectionError):  # (no plain HTTP on the port)
            requests.get(self.base_url.replace("https", "http") + "/health", timeout=10)

    def test_the_chat_template_file_and_its_default_variables_render_the_prompt(self):
        def rendered(greeting: str) -> int:
            return self.prompt_tokens(f"<<user>>Say something.\n[{greeting}]<<assistant>>")

        default, own = rendered("hello there, friend"), rendered("yo")
        self.assertNotEqual(default, own)  # (so that the counts below tell the two apart)
        self.assertEqual(self.chat_prompt_tokens(), default)
        self.assertEqual(self.chat_prompt_tokens(chat_template_kwargs={"greeting": "yo"}), own)
        # A request's other variables leave the default in place (key by key).
        self.assertEqual(self.chat_prompt_tokens(chat_template_kwargs={"unused": 1}), default)

    def test_preferred_sampling_params_fill_what_a_request_leaves_unset(self):
        info = self.get("/get_model_info").json()
        self.assertEqual(info["preferred_sampling_params"], PREFERRED)
        out = self.generate(input_ids=[5, 6, 7, 8])
        self.assertEqual(out["meta_info"]["completion_tokens"], PREFERRED["max_new_tokens"])
        out = self.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 7})
        self.assertEqual(out["meta_info"]["completion_tokens"], 7)
        # Near the context's end the preferred max_new_tokens is cut to fit, not refused.
        room = 3
        self.assertGreaterEqual(info["max_req_input_len"], info["context_length"] - room)
        out = self.generate(input_ids=[5] * (info["context_length"] - room))
        self.assertEqual(out["meta_info"]["completion_tokens"], room)

    def test_a_stream_ends_with_its_usage_without_stream_options(self):
        body = {"prompt": "def f(", "max_tokens": 4, "stream": True, "ignore_eos": True}
        r = self.post("/v1/completions", body, stream=True)
        self.assertEqual(r.status_code, 200, r.text)
        events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
        self.assertEqual(events[-1]["choices"], [])
        self.assertEqual(events[-1]["usage"]["completion_tokens"], 4)
        self.assertTrue(all("usage" not in e or e["usage"] is None for e in events[:-1]))

    def test_a_request_beyond_the_queue_bound_gets_503_and_nothing_is_left_held(self):
        # One runs (--max-running-requests 1), one waits (--max-queued-requests 1): sent together, the
        # others find the queue full. (They reach the scheduler within milliseconds; each runs
        # 200 tokens, tens of milliseconds on this model, so the queue stays full while they arrive.)
        # Every other one streams: its refusal comes before its first chunk, so it is a 503 too.
        def send(i: int) -> tuple[bool, requests.Response]:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                    "stream": i % 2 == 1}  # fmt: skip
            return body["stream"], self.post("/generate", body)

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(send, range(8)))
        full = [r for _, r in replies if r.status_code == 503]
        served = [(streamed, r) for streamed, r in replies if r.status_code == 200]
        self.assertEqual(len(full) + len(served), 8, [r.text for _, r in replies])
        self.assertGreaterEqual(len(full), 1, "no request found the queue full")
        # (at least the first: the 8 may reach the scheduler in one message, before any of them runs)
        self.assertGreaterEqual(len(served), 1, "the request that found room is served")
        self.assertTrue(all("The request queue is full." in r.text for r in full), full[0].text)
        for streamed, r in served:
            if streamed:
                chunks = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
                meta = json.loads(chunks[-1])["meta_info"]
            else:
                meta = r.json()["meta_info"]
            self.assertEqual(meta["completion_tokens"], 200)
        self.assert_idle_accounting()

    def test_a_priority_without_priority_scheduling_is_refused_with_503(self):
        r = self.post("/generate", {"input_ids": [5, 6], "priority": 3, "sampling_params": {"max_new_tokens": 2}})
        self.assertEqual(r.status_code, 503, r.text)
        self.assertIn("Using priority is disabled for this server.", r.text)
        self.assertEqual(self.generate(input_ids=[5, 6], priority=None)["meta_info"]["completion_tokens"], 5)

    def test_a_prompt_over_the_limit_keeps_its_first_tokens(self):
        info = self.get("/get_model_info").json()
        limit = info["max_req_input_len"]
        ids = [5 + i % 50 for i in range(limit + 40)]
        out = self.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
        self.assertEqual(out["meta_info"]["prompt_tokens"], limit)
        alone = self.generate(input_ids=ids[:limit], sampling_params={"max_new_tokens": 1, "temperature": 0})
        self.assertEqual(out["output_ids"], alone["output_ids"])  # (the same first tokens: the end dropped)
        text = "word " * (limit + 100)
        out = self.generate(text=text, sampling_params={"max_new_tokens": 1})
        self.assertEqual(out["meta_info"]["prompt_tokens"], limit)
        r = self.post("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 50})
        self.assertEqual(r.status_code, 200, r.text)  # (max_tokens lowered to the room the cut leaves)
        usage = r.json()["usage"]
        self.assertEqual(usage["prompt_tokens"], limit)
        self.assertLessEqual(usage["completion_tokens"], info["context_length"] - limit)
        # Review: echo gave the whole prompt where the model ran its first `limit` tokens.
        for prompt in (text, ids):
            r = self.post("/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0})
            self.assertEqual(r.status_code, 200, r.text)
            lp = r.json()["choices"][0]["logprobs"]
            self.assertEqual(len(lp["tokens"]), limit)
            self.assertEqual(r.json()["choices"][0]["text"], self.post("/detokenize", {
                "tokens": (ids[:limit] if prompt is ids else self.post("/tokenize", {"prompt": text}).json()["tokens"][:limit]),
                "skip_special_tokens": False}).json()["text"])  # fmt: skip

    def test_the_request_log_has_a_json_line_at_arrival_and_at_finish(self):
        # (logit_bias: int keys, which orjson refused, a 500; log_metrics false: logged all the same)
        params = {"max_new_tokens": 3, "temperature": 0.5, "logit_bias": {"5": 1.0}}
        body = {"text": "A secret prompt", "rid": "logged-1", "sampling_params": params, "log_metrics": False}
        self.assertEqual(self.post("/generate", body).status_code, 200)
        lines = [line[line.index("{"):] for line in self.server.log_text().splitlines() if '"logged-1"' in line]
        events = {e["event"]: e for e in map(json.loads, lines)}
        received, finished = events["request.received"], events["request.finished"]
        self.assertEqual(received["sampling_params"]["temperature"], 0.5)
        self.assertEqual(received["sampling_params"]["logit_bias"], {"5": 1.0})
        self.assertNotIn("text", received)  # (level 1: no input or output)
        self.assertEqual((finished["completion_tokens"], finished["finish_reason"]["type"]), (3, "length"))
        self.assertNotIn("secret", self.server.log_text())

    def test_the_access_log_leaves_out_the_excluded_paths(self):
        for path in ("/health", "/get_model_info", "/v1/models"):
            self.assertEqual(self.get(path).status_code, 200)
        log = self.server.log_text()
        self.assertIn('"GET /v1/models HTTP/1.1" 200', log)
        self.assertNotIn("GET /health", log)
        self.assertNotIn("GET /get_model_info", log)

    def test_configure_logging_raises_the_level_at_run_time(self):
        """Upstream's /configure_logging: at level 3 the prompt's text is logged; back to 1 it is not."""
        try:
            self.assertEqual(self.post("/configure_logging", {"log_requests_level": 3}).status_code, 200)
            self.post("/generate", {"text": "A plain prompt", "rid": "logged-3", "sampling_params": {"max_new_tokens": 2}})
        finally:
            self.post("/configure_logging", {"log_requests_level": 1})
        lines = [line[line.index("{"):] for line in self.server.log_text().splitlines() if '"logged-3"' in line]
        received = next(e for e in map(json.loads, lines) if e["event"] == "request.received")
        self.assertEqual(received["text"], "A plain prompt")
        refused = self.post("/configure_logging", {"crash_dump_folder": "/tmp/x"})
        self.assertEqual((refused.status_code, refused.json()["error"]["param"]), (400, "crash_dump_folder"))
