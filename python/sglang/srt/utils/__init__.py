"""Helpers. `MultiprocessingSerializer` and `init_custom_process_group` are importable from here, as
upstream's clients import them (loaded on first use: they import torch)."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "MultiprocessingSerializer":
        from sglang.srt.utils.multiprocessing_serializer import MultiprocessingSerializer

        return MultiprocessingSerializer
    if name == "init_custom_process_group":
        from sglang.srt.utils.custom_process_group import init_custom_process_group

        return init_custom_process_group
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
