"""SGLang-compatible serving runtime for hybrid (recurrent + full-attention) models."""

from __future__ import annotations

from typing import Any

from sglang.version import __version__

__all__ = ["Engine", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import sglang` stays cheap (no torch, no transformers) until the Engine is used.
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
