"""Malformed requests get HTTP 400 with an OpenAI-style error naming the field (413 for a body over the
limit); afterwards the server answers normally and, once idle, no slot is held by a request. Fields
upstream's /generate accepts are accepted here too."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time

import orjson

from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=30, suite="per-commit-cpu")

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
    (CHAT, chat(stop=[f"s{i}" for i in range(257)]), "stop"),  # (bounds: constrained/stop_strings.py)
    (COMP, {"prompt": "x", "stop": ["x" * 1025]}, "stop"),
    (GEN, {"text": "a", "sampling_params": {"stop": ["y" * 1000] * 17}}, "sampling_params.stop"),
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
    # The security review's rows 6 and 8 (issue 51): 5,000 nested groups (a RecursionError, a 500), a
    # 689 KB pattern (compiled 10.8 s on the event loop), a repeat that unrolled to 4 GB, a json_schema
    # nested 600 deep (held a compile thread 35-39 s).
    (
        GEN,
        {"text": "a", "sampling_params": {"stop_regex": "(" * 5000 + "a" + ")" * 5000}},
        "sampling_params.stop_regex",
    ),
    (
        COMP,
        {"prompt": "x", "stop_regex": ["(" * 90 + "a" + ")" * 90] * 2 + ["(" * 1000 + ")" * 1000]},
        "stop_regex",
    ),
    (
        GEN,
        {"text": "a", "sampling_params": {"stop_regex": "|".join(f"x{i}" for i in range(100_000))}},
        "sampling_params.stop_regex",
    ),
    (GEN, {"text": "a", "sampling_params": {"stop_regex": "a{4294967294}"}}, "sampling_params.stop_regex"),
    (
        GEN,
        {
            "text": "a",
            "sampling_params": {"json_schema": '{"type": "array", "items": ' * 600 + "{}" + "}" * 600},
        },
        "sampling_params.json_schema",
    ),
    (GEN, {"text": "a", "sampling_params": {"logit_bias": {"-3": 1}}}, "sampling_params.logit_bias"),
    (GEN, {"input_ids": [5], "return_logprob": True, "token_ids_logprob": [5, -1]}, "token_ids_logprob"),
    # 65 prompts x n=64 would start 4,160 sequences at once, 4,097 prompts 4,097: past
    # --max-samples-per-request's default (4,096 here), named by what to lower (issue 60, item 7).
    (
        GEN,
        {"input_ids": [[5, 6]] * 65, "sampling_params": {"n": 64, "max_new_tokens": 1}},
        "sampling_params.n",
    ),
    (GEN, {"input_ids": [[5]] * 4097, "sampling_params": {"max_new_tokens": 1}}, "input_ids"),
    # A stop token id below 0 (one beyond the vocabulary is accepted: issue 60, item 6).
    (GEN, {"text": "a", "sampling_params": {"stop_token_ids": [7, -1]}}, "sampling_params.stop_token_ids"),
    (CHAT, chat(stop_token_ids=[-3]), "stop_token_ids"),
    # Logprob amplification (issue 51, finding 4): the review's 4,000 ids with the vocabulary as top
    # logprobs from position 0; more ids than --max-logprobs; four samples of top 20 over 4,000 positions.
    (GEN, {"input_ids": [5] * 4000, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2048},
     "top_logprobs_num"),
    (GEN, {"input_ids": [5], "return_logprob": True, "token_ids_logprob": list(range(21))}, "token_ids_logprob"),
    (GEN, {"input_ids": [5] * 4000, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 20,
           "sampling_params": {"n": 4, "max_new_tokens": 1}}, "logprob_start_len"),
    (COMP, {"prompt": [5], "logprobs": 5, "n": 64, "max_tokens": 1000}, "logprobs"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/abort_request", {"nothing": 1}, "rid"),
    # A preset name made the scheduler generate that preset into its cache before refusing it (finding 10).
    ("/update_weights_from_disk", {"model_path": "tiny-nemotron-h"}, "model_path"),
    # upstream's /tokenize and /detokenize (issue 60, item 4)
    ("/tokenize", {"prompt": 12}, "prompt"),
    ("/v1/tokenize", {"model": "m"}, "prompt"),
    ("/detokenize", {"tokens": [[5], [6, -1]]}, "tokens[1]"),
]


def entries_of(positions: list) -> list:
    """A meta_info list's [logprob, id, text] entries in order (top lists' positions flattened, the
    null of a position without any skipped)."""
    out = []
    for p in positions:
        out.extend(p if p and isinstance(p[0], list) else [p] if p else [])
    return out


class TestMalformedRequests(ServerTestCase):
    # 256 running requests, as a GPU server may run: the fan-out bound was a quarter of them (64).
    server_args = ["--mamba-scheduler-strategy", "extra_buffer_lazy", "--max-running-requests", "256"]

    def test_malformed_requests_get_400_naming_the_field(self) -> None:
        self.assertGreaterEqual(len({json.dumps(c[1], default=str) for c in CASES}), 25)
        for route, body, param in CASES:
            with self.subTest(route=route, body=str(body)[:80]):
                if isinstance(body, bytes):
                    r = self.post(route, data=body, headers={"Content-Type": "application/json"})
                else:
                    r = self.post(route, body)
                self.assertEqual(r.status_code, 400, r.text[:300])
                body = r.json()
                err = body["error"]
                self.assertEqual(err["type"], "invalid_request_error")
                self.assertEqual(err["param"], param, err)
                self.assertTrue(err["message"].endswith("."), err)
                # Upstream's ErrorResponse at the top level (issue 60, item 5): `code` is the status.
                self.assertEqual((body["object"], body["code"], body["param"]), ("error", 400, param), body)
                self.assertEqual((body["message"], body["type"]), (err["message"], err["type"]), body)
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

    def test_stop_token_ids_outside_the_vocabulary_change_nothing(self) -> None:
        """Upstream accepts them (they can never be sampled) and its JSON-constrained kit sends one; they
        were a 400 here (issue 60, item 6). With min_new_tokens the request's stop ids are banned from the
        logits, where such an id would index past the vocabulary."""
        vocab = self.get("/get_server_info").json()["vocab_size"]
        greedy = {"max_new_tokens": 6, "min_new_tokens": 3, "temperature": 0}
        plain = self.generate(input_ids=[5, 6, 7], sampling_params=greedy)
        out = self.generate(input_ids=[5, 6, 7], sampling_params={**greedy, "stop_token_ids": [vocab, 10**12]})
        self.assertEqual(out["output_ids"], plain["output_ids"])
        body = chat(max_tokens=5, temperature=0, min_tokens=2)
        replies = [self.post(CHAT, {**body, **extra}) for extra in ({}, {"stop_token_ids": [vocab + 5]})]
        self.assertEqual([r.status_code for r in replies], [200, 200], replies[1].text)
        contents = [r.json()["choices"][0]["message"]["content"] for r in replies]
        self.assertEqual(contents[1], contents[0])
        self.assert_idle_accounting()

    def beside_a_bystander(self, body: dict, small: dict, pause: float = 0.0) -> tuple[dict, list[float]]:
        """POSTs `body` to /generate on a thread while `small` is generated again and again beside it (`pause`
        s between), until that reply is in: its {"status", "outs"} (the JSON when 200, else the text) and
        the bystander's latencies in s, at least one."""
        result: dict = {}

        def send() -> None:
            r = self.post(GEN, body)
            result["status"], result["outs"] = r.status_code, r.json() if r.status_code == 200 else r.text

        thread = threading.Thread(target=send)
        thread.start()
        latencies = []
        while thread.is_alive() or not latencies:
            start = time.perf_counter()
            self.generate(**small)
            latencies.append(time.perf_counter() - start)
            if pause:
                time.sleep(pause)
        thread.join()
        return result, latencies

    def test_a_batch_of_400_prompts_beside_a_bystander(self) -> None:
        """Upstream's radix-cache kit posts one /generate with 400 prompts; past the old fan-out bound
        (max(64, max running / 4)) it was a 400 (issue 60, item 7)."""
        batch = {"input_ids": [[5 + i % 300, 6 + i % 7] for i in range(400)],
                 "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}  # fmt: skip
        small = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        result, latencies = self.beside_a_bystander(batch, small)
        self.assertEqual(result["status"], 200, result["outs"])
        self.assertEqual(len(result["outs"]), 400)
        self.assertTrue(all(o["meta_info"]["completion_tokens"] == 2 for o in result["outs"]))
        # Measured on a loaded 2-core host: the batch took 0.1-0.3 s and the bystander's 4 tokens at most
        # 0.3 s beside it (4,096 prompts: 2.3-2.9 s, and 2.0-3.3 s queued behind them); 3 s leaves room
        # for a slower host.
        self.assertLess(max(latencies), 3.0, latencies)
        self.assert_idle_accounting()

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

    def test_tokenize_and_detokenize_as_upstream(self) -> None:
        """upstream's /tokenize and /detokenize (issue 60, item 4): the ids /generate takes for the same
        text, its context length as max_model_len, and the text back."""
        text = "Hello world, how are you?"
        r = self.post("/tokenize", {"model": "m", "prompt": text})
        self.assertEqual(r.status_code, 200, r.text)
        out = r.json()
        self.assertEqual(set(out), {"tokens", "count", "max_model_len"})
        self.assertEqual(out["count"], len(out["tokens"]))
        self.assertEqual(out["max_model_len"], self.get("/get_model_info").json()["context_length"])
        gen = self.generate(
            text=text, sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0
        )
        self.assertEqual([e[1] for e in gen["meta_info"]["input_token_logprobs"]], out["tokens"])
        both = self.post("/v1/tokenize", {"prompt": [text, "bye"]}).json()
        self.assertEqual(both["tokens"][0], out["tokens"])
        self.assertEqual(both["count"], [len(t) for t in both["tokens"]])
        back = self.post("/detokenize", {"tokens": both["tokens"]})
        self.assertEqual(back.status_code, 200, back.text)
        self.assertEqual(back.json(), {"text": [text, "bye"]})

    def test_an_ambiguous_ebnf_gets_a_400_naming_ebnf(self) -> None:
        """The security review's row 3: an ambiguous grammar fed long space tokens, whose accept and mask
        fill grow to seconds a token (the server stalled, then its watchdog shut it down), ends once one
        token's checks are over SGLANG_OUTPUT_CHECK_BUDGET_PER_REQ (a bystander's delay is measured in
        test/unit/scheduler/test_output_check_budget.py)."""
        from sglang.srt.configs.presets import resolve_model_path
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer

        tok = get_tokenizer(resolve_model_path(self.model))
        spaces = [i for i in range(2048) if tok.decode([i]) and not tok.decode([i]).strip(" ")]
        space = max(spaces, key=lambda i: len(tok.decode([i])))
        params = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0, "logit_bias": {str(space): 100}}
        ebnf = 'root ::= s\ns ::= s s | s s s | " " | ""'
        start = time.monotonic()
        r = self.post(GEN, {"text": "x", "sampling_params": {**params, "ebnf": ebnf}})
        self.assertEqual(r.status_code, 400, r.text[:300])
        self.assertEqual(r.json()["error"]["param"], "ebnf")
        self.assertIn("SGLANG_OUTPUT_CHECK_BUDGET_PER_REQ", r.json()["error"]["message"])
        # (about 10 tokens of growing cost at the 50 ms default; without the budget, minutes)
        self.assertLess(time.monotonic() - start, 20)
        self.assert_idle_accounting()

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

    def test_a_duplicate_rid_across_a_pause_gives_one_400_and_one_answer(self) -> None:
        """Both requests waited at the pause past the rid's first look: one was aborted, the other hung
        until its client gave up (issue 51, finding 10)."""
        self.assertEqual(self.post("/pause_generation", {"mode": "abort"}).status_code, 200)
        params = {"max_new_tokens": 4, "ignore_eos": True}
        body = {"input_ids": [5, 6, 7], "rid": "victim-1", "sampling_params": params}
        replies: list = []

        def send() -> None:
            replies.append(self.post(GEN, body, timeout=30))

        threads = [threading.Thread(target=send) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # both wait at the pause
        self.assertEqual(self.post("/continue_generation", {}).status_code, 200)
        start = time.monotonic()
        for t in threads:
            t.join(30)
        took = time.monotonic() - start
        self.assertEqual(sorted(r.status_code for r in replies), [200, 400], [r.text for r in replies])
        refused = next(r for r in replies if r.status_code == 400).json()["error"]
        self.assertEqual(refused["param"], "rid")
        answer = next(r for r in replies if r.status_code == 200).json()
        self.assertEqual(answer["meta_info"]["completion_tokens"], 4)
        self.assertLess(took, 5.0)  # 4 tokens take well under a second here; the other used to hang
        self.assert_idle_accounting()

    def test_an_amplifying_tensor_payload_is_refused_at_once(self) -> None:
        """The review's 2,179-byte /update_weights_from_tensor body (_codecs.encode "hex" chained 21 times)
        took the scheduler to 3.9 GB and held a bystander 11.8 s (issue 51, finding 6)."""
        enc, s = b"c_codecs\nencode\n", lambda b: b"X" + len(b).to_bytes(4, "little") + b
        prog = enc * 22 + s(b"A" * 1024) + s(b"latin1") + b"\x86R" + (s(b"hex") + b"\x86R") * 21
        payload = base64.b64encode(b"\x80\x02" + prog + b".").decode()
        start = time.monotonic()
        r = self.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
        took = time.monotonic() - start
        self.assertEqual(r.status_code, 400, r.text)
        self.assertIn("_codecs.encode", r.json()["message"])
        # The refusal is a few ms of unpickling; 2 s leaves room for the update's hold and a loaded host.
        self.assertLess(took, 2.0)
        start = time.monotonic()
        self.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        self.assertLess(time.monotonic() - start, 2.0)  # a bystander right after: served as usual

    def test_a_tensor_class_called_with_a_size_is_refused_at_once(self) -> None:
        """The review's second round: `torch.Tensor(2**28)` (31 bytes) and `UntypedStorage(2**30)` (48,
        the start of its 668-byte flattened_bucket) each allocated 1 GiB in the scheduler."""
        for payload, load_format in [
            (b"\x80\x02ctorch\nTensor\nJ\x00\x00\x00\x10\x85R.", None),
            (b"\x80\x02ctorch.storage\nUntypedStorage\nJ\x00\x00\x00\x40\x85R.", "flattened_bucket"),
        ]:
            body = {"serialized_named_tensors": [base64.b64encode(payload).decode()], "load_format": load_format}
            start = time.monotonic()
            r = self.post("/update_weights_from_tensor", body)
            took = time.monotonic() - start
            self.assertEqual(r.status_code, 400, r.text)
            self.assertIn("which a payload may only name", r.json()["message"])
            self.assertLess(took, 2.0)  # as above: the refusal itself is under a millisecond
        start = time.monotonic()
        self.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        self.assertLess(time.monotonic() - start, 2.0)  # a bystander right after: served as usual

    def test_a_maximal_logprob_request_beside_a_bystander(self) -> None:
        """The largest request --max-logprob-entries-per-request admits here (three samples of top 20 over
        4,000 input positions: 252,060 entries, a ~10 MB reply) while another client generates."""
        big = {"input_ids": [5 + i % 400 for i in range(4000)], "return_logprob": True, "logprob_start_len": 0,
               "top_logprobs_num": 20, "return_text_in_logprobs": True,
               "sampling_params": {"n": 3, "max_new_tokens": 1}}  # fmt: skip
        small = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
        self.generate(**small)  # (warm)
        result, latencies = self.beside_a_bystander(big, small, pause=0.1)
        self.assertEqual(result["status"], 200, result["outs"])
        tops = [out["meta_info"]["input_top_logprobs"] for out in result["outs"]]
        self.assertEqual([len(t) for t in tops], [4000] * 3)
        self.assertEqual(len(tops[0][1]), 20)
        # Measured on a loaded 2-core host: the bystander's 8 tokens took 1.2-3.3 s beside this request
        # (0.3 s beside the same prompts without logprobs; 0.04-0.08 s alone); the review's request, which
        # any client could send before the bounds, held it 46 s. 6 s leaves room for a slower host.
        self.assertLess(max(latencies), 6.0, latencies)
        self.assert_idle_accounting()

    def test_a_logprob_stream_is_linear_and_its_deltas_are_the_reply(self) -> None:
        """A 40-token stream with top 5 logprobs over a 500-token prompt: each chunk carries its new
        logprobs only (input ones once), so the bytes streamed stay near the reply's."""
        body = {"input_ids": [5 + i % 300 for i in range(500)], "return_logprob": True, "logprob_start_len": 0,
                "top_logprobs_num": 5, "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        whole = self.post(GEN, body)
        self.assertEqual(whole.status_code, 200, whole.text)
        reply = whole.json()
        with self.post(GEN, {**body, "stream": True}, stream=True) as r:
            raw = r.content
        chunks = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
        self.assertGreater(len(chunks), 10)  # (one per token or so: else the stream shows nothing)
        # The chunks' own text, ids and counts (~0.3 KB each) come on top of the reply's lists, which
        # are sent once: 1.5x leaves room for them (the cumulative chunks were ~30x the reply here).
        self.assertLess(len(raw), 1.5 * len(whole.content), (len(raw), len(whole.content)))
        self.assertEqual(chunks[-1]["output_ids"], reply["output_ids"])
        for name in ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs"):
            joined = [entry for chunk in chunks for entry in chunk["meta_info"][name]]
            want = reply["meta_info"][name]
            self.assertEqual(len(joined), len(want), name)
            for got, exp in zip(entries_of(joined), entries_of(want), strict=True):
                self.assertEqual(got[1], exp[1], name)
                if exp[0] is not None:
                    self.assertAlmostEqual(got[0], exp[0], places=4, msg=name)
        # The OpenAI stream (per-token logprobs, as OpenAI streams them) still agrees with its reply.
        comp = {"model": "m", "prompt": body["input_ids"][:50], "max_tokens": 6, "temperature": 0, "logprobs": 3,
                "ignore_eos": True}  # fmt: skip
        full = self.post(COMP, comp).json()["choices"][0]["logprobs"]
        with self.post(COMP, {**comp, "stream": True}, stream=True) as r:
            events = [orjson.loads(x[6:]) for x in r.content.split(b"\n") if x.startswith(b"data: {")]
        streamed = [lp for e in events for c in e["choices"] if c.get("logprobs") for lp in c["logprobs"]["token_logprobs"]]
        self.assertEqual(len(streamed), len(full["token_logprobs"]))
        for got, exp in zip(streamed, full["token_logprobs"], strict=True):
            self.assertAlmostEqual(got, exp, places=4)

