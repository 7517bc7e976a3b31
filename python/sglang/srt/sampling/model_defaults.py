"""A checkpoint's recommended sampling settings (`generation_config.json`), which chat requests that leave
them unset take under `--sampling-defaults model` (upstream's default)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The generation_config keys upstream takes, by our sampling_params name.
_KEYS = ("temperature", "top_p", "top_k", "min_p")


def model_sampling_defaults(model_path: str) -> dict[str, Any]:
    """The sampling_params a chat request gets for the fields it leaves unset: the keys of `_KEYS` that
    the checkpoint's generation_config.json sets (transformers' own defaults do not count; `top_k` 0 is
    its "off", ours -1). Its `repetition_penalty`, which this server does not support, is left out
    with a warning, so that it never turns every request into an error."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    out = {k: config[k] for k in _KEYS if config.get(k) is not None}
    if out.get("top_k") == 0:
        out["top_k"] = -1
    penalty = config.get("repetition_penalty")
    if penalty not in (None, 1, 1.0):
        logger.warning(
            "The model's generation_config.json sets repetition_penalty %s, which this server does not "
            "support; chat requests do not get it.",
            penalty,
        )
    return out
