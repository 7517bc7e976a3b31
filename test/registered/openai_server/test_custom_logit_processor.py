"""Custom logit processors on a real server (--enable-custom-logit-processor), as a client sends them: a
class defined in the client's own script (dill serializes it by value), `to_str()` as the request's
`custom_logit_processor`, its settings in `custom_params`; on /generate (one for all prompts, or per
prompt) and as OpenAI extra fields."""

from __future__ import annotations

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
from sglang.srt.utils.hf_transformers_utils import get_tokenizer
from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=15, suite="per-commit-cpu")

# A client script's class: defined in __main__, so that dill sends its code and not a module path.
CLIENT_SCRIPT = """
class CycleTokens(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list):
            cycle = params["cycle"]
            logits[row] = float("-inf")
            logits[row, cycle[len(params["__req__"].output_ids) % len(cycle)]] = 0.0
        return logits
"""


def client_processor() -> str:
    namespace = {"__name__": "__main__", "CustomLogitProcessor": CustomLogitProcessor}
    exec(CLIENT_SCRIPT, namespace)
    return namespace["CycleTokens"].to_str()


class TestCustomLogitProcessor(ServerTestCase):
    server_args = ["--enable-custom-logit-processor"]
    env = {"SGLANG_LOGIT_PROCESSOR_SECRET": ""}  # unsigned processors, whatever the environment says

    def test_a_client_class_steers_its_requests_only(self) -> None:
        payload = client_processor()
        params = {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True}
        params["custom_params"] = {"cycle": [40, 41, 42]}
        outs = self.generate(
            input_ids=[[5, 6, 7], [8, 9, 10]], sampling_params=params, custom_logit_processor=[payload, None]
        )
        self.assertEqual(outs[0]["output_ids"], [40, 41, 42, 40, 41, 42, 40])
        plain = self.generate(input_ids=[8, 9, 10], sampling_params={**params, "custom_params": None})
        self.assertEqual(outs[1]["output_ids"], plain["output_ids"])

    def test_openai_routes_take_the_extra_fields(self) -> None:
        body = {
            "model": "m", "prompt": "Hello", "max_tokens": 5, "temperature": 0,
            "custom_logit_processor": client_processor(), "custom_params": {"cycle": [300, 301]},
        }  # fmt: skip
        r = self.post("/v1/completions", body)
        self.assertEqual(r.status_code, 200, r.text)
        tokenizer = get_tokenizer(self.model)
        self.assertEqual(r.json()["choices"][0]["text"], tokenizer.decode([300, 301, 300, 301, 300]))

    def test_a_processor_that_does_not_load_is_a_400(self) -> None:
        r = self.post("/generate", {"input_ids": [5, 6], "custom_logit_processor": '{"callable": "zz"}'})
        self.assertEqual(r.status_code, 400, r.text)
        self.assertEqual(r.json()["error"]["param"], "custom_logit_processor")

    def test_the_start_warns_that_unsigned_processors_run_any_clients_code(self) -> None:
        # Started without SGLANG_LOGIT_PROCESSOR_SECRET, on loopback (another --host is refused at start).
        self.assertIn(
            "--enable-custom-logit-processor without SGLANG_LOGIT_PROCESSOR_SECRET", self.server.log_text()
        )
