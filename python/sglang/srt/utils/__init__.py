"""Helpers. `MultiprocessingSerializer` is importable from here, as upstream's clients import it (loaded
on first use: it imports torch)."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "MultiprocessingSerializer":
        from sglang.srt.utils.multiprocessing_serializer import MultiprocessingSerializer

        return MultiprocessingSerializer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
