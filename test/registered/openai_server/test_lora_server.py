"""LoRA adapters on a real server, through upstream's API (docs/lora.md):

- /generate's `lora_path` (an adapter's name; one per prompt of a batch), the OpenAI routes' `model` as
  "base:adapter" or the adapter's name, and their `lora_path`; each answer is the merged checkpoint's
  under the transformers oracle, a base-model request's the base model's;
- /v1/models lists the adapters; an unknown adapter is a 400 naming lora_path;
- /load_lora_adapter serves a new adapter at once, refuses a name already loaded and a folder that is
  not an adapter (400, error_message); /unload_lora_adapter removes the name (its requests are then a 400);
- the prefix cache keeps each adapter's prompts apart from the base model's.
The outputs on every architecture: test/unit/lora/test_lora_outputs.py."""

from __future__ import annotations

import math
from pathlib import Path

from sglang.test.ci_register import register_cpu_ci
from sglang.test.reference import ReferenceModel
from sglang.test.test_utils import ServerTestCase
from sglang.tools.make_tiny_lora import make_tiny_lora, merge_lora

register_cpu_ci(est_time=25, suite="per-commit-cpu")

PROMPT = [(7 * i + 5) % 400 + 5 for i in range(40)]
PARAMS = {"max_new_tokens": 6, "temperature": 0}


class TestLoRAServer(ServerTestCase):
    server_args = ["--context-length", "512"]

    @classmethod
    def prepare(cls, folder: Path) -> None:
        cls.adapters = {name: make_tiny_lora(cls.model, folder / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}
        cls.server_args = [*cls.server_args, "--lora-paths", f"a={cls.adapters['a']}"]
        cls.oracles = {None: ReferenceModel(cls.model)}
        for name, path in cls.adapters.items():
            cls.oracles[name] = ReferenceModel(str(merge_lora(cls.model, path, folder / f"{name}-merged")))

    def generate(self, lora_path, ids=PROMPT, status=200) -> dict:
        r = self.post("/generate", {"input_ids": ids, "sampling_params": PARAMS, "lora_path": lora_path})
        self.assertEqual(r.status_code, status, r.text)
        return r.json()

    def test_generate_and_the_openai_routes_run_the_named_adapter(self):
        outs = self.post("/generate", {"input_ids": [PROMPT, PROMPT], "sampling_params": PARAMS,
                                       "lora_path": ["a", None]}).json()  # fmt: skip
        for out, name in zip(outs, ["a", None], strict=True):
            self.assertEqual(out["output_ids"], self.oracles[name].greedy(PROMPT, 6))
        self.assertNotEqual(outs[0]["output_ids"], outs[1]["output_ids"])
        text_a = outs[0]["text"]
        for body in ({"model": f"{self.model}:a"}, {"model": "a"}, {"model": self.model, "lora_path": "a"}):
            r = self.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **body})
            self.assertEqual(r.status_code, 200, r.text)
            self.assertEqual(r.json()["choices"][0]["text"], text_a, body)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        by_model = self.post("/v1/chat/completions", {**chat, "model": f"{self.model}:a"}).json()
        by_field = self.post("/v1/chat/completions", {**chat, "lora_path": "a"}).json()
        base = self.post("/v1/chat/completions", chat).json()
        self.assertEqual(by_model["choices"][0]["message"], by_field["choices"][0]["message"])
        self.assertEqual(by_model["model"], f"{self.model}:a")  # (echoed, as upstream)
        ids = {m["id"]: m for m in self.get("/v1/models").json()["data"]}
        self.assertEqual(ids["a"]["parent"], self.model)
        self.assertEqual(ids["a"]["root"], str(self.adapters["a"]))
        self.assertIsNotNone(base["choices"][0]["message"]["content"])

    def test_an_unknown_adapter_is_a_400_naming_the_field(self):
        body = self.generate("nope", status=400)
        self.assertEqual(body["error"]["param"], "lora_path")
        self.assertIn("lora_path names LoRA adapter 'nope', which is not loaded", body["error"]["message"])
        r = self.post("/v1/completions", {"prompt": "x", "model": f"{self.model}:nope", "max_tokens": 2})
        self.assertEqual(r.status_code, 400, r.text)
        r = self.post("/v1/completions", {"prompt": "x", "model": f"{self.model}:", "max_tokens": 2})
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "model"), r.text)

    def test_adapters_load_and_unload_while_serving(self):
        path = str(self.adapters["b"])
        r = self.post("/load_lora_adapter", {"lora_name": "b", "lora_path": path})
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json()["loaded_adapters"], {"a": str(self.adapters["a"]), "b": path})
        self.assertEqual(self.generate("b")["output_ids"], self.oracles["b"].greedy(PROMPT, 6))
        again = self.post("/load_lora_adapter", {"lora_name": "b", "lora_path": path})
        self.assertEqual(again.status_code, 400)
        self.assertIn("already loaded", again.json()["error_message"])
        bad = self.post("/load_lora_adapter", {"lora_name": "c", "lora_path": str(self.workdir)})
        self.assertEqual(bad.status_code, 400)
        self.assertIn("adapter_config.json", bad.json()["error_message"])
        gone = self.post("/unload_lora_adapter", {"lora_name": "b"})
        self.assertEqual(gone.status_code, 200, gone.text)
        self.assertNotIn("b", gone.json()["loaded_adapters"])
        self.generate("b", status=400)
        self.assertEqual(self.post("/unload_lora_adapter", {"lora_name": "b"}).status_code, 400)
        self.assert_idle_accounting()

    def test_the_prefix_cache_keeps_an_adapters_prompts_apart(self):
        ids = [(11 * i + 3) % 400 + 5 for i in range(96)]
        first = self.generate("a", ids)
        base = self.generate(None, ids)
        self.assertEqual(base["meta_info"]["cached_tokens"], 0)
        self.assertEqual(base["output_ids"], self.oracles[None].greedy(ids, 6))
        again = self.generate("a", ids)
        self.assertGreater(again["meta_info"]["cached_tokens"], 0)
        self.assertEqual(again["output_ids"], first["output_ids"])

    def test_score_runs_the_adapter_its_model_names(self):
        """Review: /v1/score took no adapter from `model` (the base model's scores, the adapter's name)."""
        labels = [5, 17, 100]

        def score(model: str) -> list[float]:
            r = self.post("/v1/score", {"model": model, "query": PROMPT[:30], "items": [PROMPT[30:]],
                                        "label_token_ids": labels})  # fmt: skip
            self.assertEqual(r.status_code, 200, r.text)
            return r.json()["scores"][0]

        adapted, base = score(f"{self.model}:a"), score(self.model)
        self.assertNotEqual(adapted, base)
        out = self.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1},
                                      "return_logprob": True, "token_ids_logprob": labels, "lora_path": "a"}).json()
        want = {e[1]: math.exp(e[0]) for e in out["meta_info"]["output_token_ids_logprobs"][0]}
        for p, label in zip(adapted, labels, strict=True):
            self.assertLess(abs(p - want[label]), 1e-4 * want[label])  # (float32, other batch shapes)
        for name in ("a", f"{self.model}:a"):  # (/v1/models/{model} takes the names the routes take)
            self.assertEqual(self.get(f"/v1/models/{name}").json()["id"], "a")
        self.assertEqual(self.get(f"/v1/models/{self.model}:nope").status_code, 404)
        r = self.post("/v1/score", {"model": f"{self.model}:nope", "query": PROMPT, "items": [[5]],
                                    "label_token_ids": labels})  # fmt: skip
        self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, "model"), r.text)
