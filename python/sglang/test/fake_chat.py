"""A tokenizer manager for the chat-path routes' unit tests (/v1/chat/completions, /v1/responses,
/v1/messages): a template that shows what it got, and a generation that answers with a given text,
whole or streamed two characters a chunk, with one-character logprob tokens."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace


class FakeTemplate:
    """A chat template that shows what it got: each message as <role>reasoning|content."""

    chat_template = "fake"

    def __init__(self):
        self.seen: list[dict] = []

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        self.seen.append({"messages": messages, **kwargs})
        text = "".join(f"<{m['role']}>{m.get('reasoning_content') or ''}|{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]  # (as FakeChatTokenizerManager.encode: a character a token)

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class FakeChatTokenizerManager:
    """Answers every request with `answer` (streamed two characters a chunk), recording the prompts."""

    def __init__(
        self, answer: str, finish: str = "stop", delay: float = 0.0, fail: Exception | None = None, matched=None
    ):
        """`fail`: raised before the first output (whole) or after the first chunk (streamed); `matched`:
        the finish reason's matched stop (a stop string, or a token id)."""
        self.tokenizer = FakeTemplate()
        self.limits = SimpleNamespace(context_len=1 << 20)
        self.lora = SimpleNamespace(split_model=lambda model: (model, None))
        self.answer, self.finish, self.delay, self.fail, self.matched = answer, finish, delay, fail, matched
        self.prompts: list[list[int]] = []
        self.params: list[dict] = []
        self.aborted = 0

    async def encode(self, text, param, add_special_tokens=True, truncate=False):
        return [ord(c) for c in text]

    async def generate_request(self, obj, request=None):
        self.prompts.append(obj.input_ids)
        self.params.append(obj.sampling_params)
        n = len(self.answer)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            cuts = list(range(2, n, 2)) + [n] if obj.stream else [n]
            for k, cut in enumerate(cuts):
                if self.fail is not None and (k == 1 or not obj.stream):
                    raise self.fail
                last = k == len(cuts) - 1
                meta = {"id": "x", "prompt_tokens": len(obj.input_ids), "completion_tokens": cut, "cached_tokens": 3,
                        "finish_reason": {"type": self.finish, "matched": self.matched} if last else None}  # fmt: skip
                if obj.return_logprob:
                    lo = 0 if not obj.stream else (cuts[k - 1] if k else 0)
                    meta["output_token_logprobs"] = [(-0.5, ord(c), c) for c in self.answer[lo:cut]]
                    meta["output_top_logprobs"] = [[(-0.5, ord(c), c)] for c in self.answer[lo:cut]]
                out = {"text": self.answer[:cut], "output_ids": [ord(c) for c in self.answer[:cut]], "meta_info": meta}
                if obj.return_prompt_token_ids:
                    out["prompt_token_ids"] = list(obj.input_ids)
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted += 1
            raise
