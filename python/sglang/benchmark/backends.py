"""One benchmark request against a server, per upstream bench_serving backend name:

- `sglang`: POST /generate (native; cumulative text chunks),
- `sglang-oai`: POST /v1/completions,
- `sglang-oai-chat`: POST /v1/chat/completions (the prompt as one user message).

Streaming by default: TTFT is the first chunk that carries text, ITL the gaps between later chunks,
per token.
Token counts and cached tokens are the server's own (`meta_info`, or `usage` through
`stream_options.include_usage`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sglang.benchmark.datasets import DatasetRow

BACKENDS = {"sglang": "/generate", "sglang-oai": "/v1/completions", "sglang-oai-chat": "/v1/chat/completions"}


@dataclass
class RequestOutput:
    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    generated_text: str = ""
    error: str = ""


@dataclass
class RequestSpec:
    backend: str
    url: str  # the base URL
    model: str
    stream: bool = True
    ignore_eos: bool = True
    tokenize_prompt: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


def request_body(spec: RequestSpec, row: DatasetRow, max_new_tokens: int) -> dict[str, Any]:
    if spec.backend == "sglang":
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": spec.ignore_eos}
        sampling.update(spec.extra_body.get("sampling_params", {}))
        body = {k: v for k, v in spec.extra_body.items() if k != "sampling_params"}
        prompt = {"input_ids": row.prompt_ids} if spec.tokenize_prompt else {"text": row.prompt}
        return {**body, **prompt, "sampling_params": sampling, "stream": spec.stream}
    body: dict[str, Any] = {
        "model": spec.model,
        "max_tokens": max_new_tokens,
        "temperature": 0.0,
        "ignore_eos": spec.ignore_eos,
        "stream": spec.stream,
    }
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.backend == "sglang-oai":
        body["prompt"] = row.prompt
    else:
        body["messages"] = [{"role": "user", "content": row.prompt}]
    return {**body, **spec.extra_body}


def _text_of(backend: str, chunk: dict) -> tuple[str, bool]:
    """(text this chunk adds or holds, whether it holds the whole text so far)."""
    if backend == "sglang":
        return chunk.get("text", ""), True
    choices = chunk.get("choices") or []
    if not choices:
        return "", False
    if backend == "sglang-oai":
        return choices[0].get("text") or "", False
    message = choices[0].get("delta") or choices[0].get("message") or {}
    return message.get("content") or "", False


def _counts(backend: str, chunk: dict, out: RequestOutput) -> None:
    if backend == "sglang":
        meta = chunk.get("meta_info") or {}
        out.prompt_len = meta.get("prompt_tokens", out.prompt_len)
        out.output_len = meta.get("completion_tokens", out.output_len)
        out.cached_tokens = meta.get("cached_tokens", out.cached_tokens)
        return
    usage = chunk.get("usage")
    if usage:
        out.prompt_len = usage.get("prompt_tokens", out.prompt_len)
        out.output_len = usage.get("completion_tokens", out.output_len)
        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0


async def send_request(
    session: aiohttp.ClientSession, spec: RequestSpec, row: DatasetRow, max_new_tokens: int | None = None
) -> RequestOutput:
    out = RequestOutput(prompt_len=row.prompt_len)
    body = request_body(spec, row, max_new_tokens or row.output_len)
    start = last = time.perf_counter()
    last_tokens = 0
    try:
        async with session.post(spec.url + BACKENDS[spec.backend], json=body, headers=spec.headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            if not spec.stream:
                chunk = await resp.json()
                out.generated_text = _text_of(spec.backend, chunk)[0]
                _counts(spec.backend, chunk, out)
                out.ttft = out.latency = time.perf_counter() - start
                out.success = True
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])[:500]
                    return out
                text, whole = _text_of(spec.backend, chunk)
                _counts(spec.backend, chunk, out)
                if (text != out.generated_text) if whole else text:
                    now = time.perf_counter()
                    if not out.ttft:
                        out.ttft = now - start
                    else:
                        # One ITL per token, as upstream: a chunk carrying n tokens (--stream-interval,
                        # text held back for a split UTF-8 character) splits its gap n ways. The OpenAI
                        # routes count tokens only at the end: one per chunk there.
                        n = max(1, out.output_len - last_tokens) if whole else 1
                        out.itl += [(now - last) / n] * n
                    last, last_tokens = now, out.output_len
                    out.generated_text = text if whole else out.generated_text + text
            out.latency = time.perf_counter() - start
            out.success = True
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out
