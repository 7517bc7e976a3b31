"""Loading Hugging Face artifacts, in one place: only local folders (or built-in presets), never a hub."""

from __future__ import annotations

from typing import Any


def get_tokenizer(tokenizer_path: str) -> Any:
    from transformers import AutoTokenizer

    from sglang.srt.configs.presets import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(tokenizer_path), local_files_only=True)
