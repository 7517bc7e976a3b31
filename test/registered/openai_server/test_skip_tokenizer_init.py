"""--skip-tokenizer-init on a real server, as RL trainers run upstream's: a checkpoint folder with no
tokenizer files at all, prompts as input_ids, replies as output_ids without "text".

Greedy outputs match the transformers oracle token for token; logprobs come without text; streaming
and batches work; stop token ids (and the config's end-of-sequence ids) end a request; everything that
needs a tokenizer is a 400 naming its field (text prompts with upstream's message, stop strings, stop
regexes, grammars, return_text_in_logprobs, the OpenAI routes, /tokenize and /detokenize), and leaves
nothing held.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import requests

from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.server_args_checks import TOKENIZER_FILES
from sglang.test.ci_register import register_cpu_ci
from sglang.test.reference import ReferenceModel
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=30, suite="per-commit-cpu")

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 300, 2, 17, 99, 100]]
NEW_TOKENS = 8


def tokenizer_free_copy(preset: str, dst: Path) -> str:
    """The preset's checkpoint without its tokenizer and chat template."""
    src = Path(resolve_model_path(preset))
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in TOKENIZER_FILES and f.name != "chat_template.jinja":
            shutil.copy(f, dst / f.name)
    return str(dst)


class TestSkipTokenizerInit(ServerTestCase):
    server_args = ["--skip-tokenizer-init", "--mamba-scheduler-strategy", "extra_buffer_lazy"]

    @classmethod
    def prepare(cls, folder: Path) -> None:
        cls.model = tokenizer_free_copy("tiny-qwen3-next", folder / "model")
        assert not any((Path(cls.model) / name).exists() for name in TOKENIZER_FILES)
        cls.oracle = ReferenceModel(cls.model)

    def setUp(self) -> None:
        self.wait_idle()

    def tearDown(self) -> None:
        state = self.wait_idle()  # a refused request leaves nothing held
        self.assertEqual(state["num_running_reqs"], 0)

    def greedy(self, ids: list[int], **extra) -> dict:
        return self.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
            **extra,
        )

    def test_greedy_outputs_match_the_oracle_without_text(self) -> None:
        out = self.greedy(PROMPTS[0], return_logprob=True, top_logprobs_num=2)
        self.assertEqual(set(out), {"output_ids", "meta_info"})  # upstream's shape: no "text"
        self.assertEqual(out["output_ids"], self.oracle.greedy(PROMPTS[0], NEW_TOKENS))
        meta = out["meta_info"]
        self.assertEqual((meta["prompt_tokens"], meta["completion_tokens"]), (5, NEW_TOKENS))
        self.assertEqual([e[1] for e in meta["output_token_logprobs"]], out["output_ids"])
        self.assertTrue(all(e[2] is None for e in meta["output_token_logprobs"]))
        self.assertTrue(all(len(top) == 2 for top in meta["output_top_logprobs"]))
        self.assertEqual(self.get("/health_generate").status_code, 200)

    def test_a_batch_gets_one_reply_per_prompt(self) -> None:
        outs = self.greedy(PROMPTS)
        expected = [self.oracle.greedy(p, NEW_TOKENS) for p in PROMPTS]
        self.assertEqual([o["output_ids"] for o in outs], expected)
        self.assertTrue(all("text" not in o for o in outs))

    def test_streaming_sends_output_ids_as_upstream(self) -> None:
        body = {
            "input_ids": PROMPTS[1],
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        chunks = []
        with requests.post(self.base_url + "/generate", json=body, stream=True, timeout=120) as r:
            self.assertEqual(r.status_code, 200)
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunks.append(orjson.loads(line[6:]))
        self.assertGreater(len(chunks), 1)
        self.assertTrue(all("text" not in c for c in chunks))
        # Cumulative, as the text is without --skip-tokenizer-init: each chunk extends the one before.
        ids = [c["output_ids"] for c in chunks]
        self.assertTrue(all(b[: len(a)] == a for a, b in zip(ids, ids[1:], strict=False)))
        self.assertEqual(ids[-1], self.oracle.greedy(PROMPTS[1], NEW_TOKENS))

    def test_a_stop_token_id_ends_the_request(self) -> None:
        expected = self.oracle.greedy(PROMPTS[0], NEW_TOKENS)
        stop = expected[3]
        cut = expected.index(stop) + 1
        out = self.generate(
            input_ids=PROMPTS[0],
            sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0, "stop_token_ids": [stop]},
        )
        self.assertEqual(out["output_ids"], expected[:cut])
        self.assertEqual(out["meta_info"]["finish_reason"], {"type": "stop", "matched": stop})

    def test_what_needs_a_tokenizer_is_a_400_naming_its_field(self) -> None:
        cases = [
            ({"text": "Hello"}, "text", "cannot accept text prompts"),
            ({"sampling_params": {"stop": ["ab"]}}, "sampling_params.stop", "stop is unavailable"),
            ({"sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex", "stop_regex is"),
            ({"sampling_params": {"regex": "[ab]+"}}, "sampling_params.regex", "regex is unavailable"),
            (
                {"sampling_params": {"json_schema": '{"type": "object"}'}},
                "sampling_params.json_schema",
                "json_schema is unavailable",
            ),
            (
                {"return_logprob": True, "return_text_in_logprobs": True},
                "return_text_in_logprobs",
                "no tokenizer to decode",
            ),
        ]
        for body, param, message in cases:
            body = {"input_ids": PROMPTS[0], **body}
            if "text" in body:
                del body["input_ids"]
            r = self.post("/generate", body)
            self.assertEqual(r.status_code, 400, (body, r.text))
            err = r.json()["error"]
            self.assertEqual(err["param"], param, body)
            self.assertIn(message, err["message"])

    def test_the_openai_routes_are_a_400_naming_the_prompt(self) -> None:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for route, body, param in [
            ("/v1/chat/completions", chat, "messages"),
            ("/v1/completions", {"model": "m", "prompt": [5, 6, 7]}, "prompt"),
            # upstream's /tokenize and /detokenize (issue 60, item 4): a tokenizer is what they do
            ("/tokenize", {"prompt": "hi"}, "prompt"),
            ("/detokenize", {"tokens": [5, 6, 7]}, "tokens"),
        ]:
            r = self.post(route, body)
            self.assertEqual(r.status_code, 400, r.text)
            err = r.json()["error"]
            self.assertEqual(err["param"], param)
            self.assertIn("--skip-tokenizer-init", err["message"])
            self.assertIn(route, err["message"])
