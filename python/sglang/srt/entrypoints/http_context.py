"""What the HTTP routes share: the server's arguments, its TokenizerManager and the OpenAI handlers.

`create_app` keeps one `ServerContext` on `app.state`; a route takes it as a parameter annotated
`Server` (a FastAPI dependency), so the routers are plain module-level `APIRouter`s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from sglang.srt.entrypoints.anthropic.serving import AnthropicServing
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.entrypoints.openai.serving_responses import OpenAIServingResponses
from sglang.srt.entrypoints.openai.serving_score import OpenAIServingScore
from sglang.srt.entrypoints.openai.serving_tokenize import OpenAIServingTokenize
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.metrics.collector import MetricsCollector


@dataclass
class ServerContext:
    server_args: Any
    tm: TokenizerManager
    model_info: dict[str, Any]
    chat: OpenAIServingChat
    completions: OpenAIServingCompletion
    tokenize: OpenAIServingTokenize
    metrics: MetricsCollector | None
    responses: OpenAIServingResponses
    anthropic: AnthropicServing
    score: OpenAIServingScore

    @property
    def model_name(self) -> str:
        return self.server_args.served_model_name


def server_context(request: Request) -> ServerContext:
    return request.app.state.server


Server = Annotated[ServerContext, Depends(server_context)]
