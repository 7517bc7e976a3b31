"""A checkpoint's recommended sampling settings (`generation_config.json`), which chat requests that leave
them unset take under `--sampling-defaults model` (upstream's default)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from sglang.srt.sampling.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

# The generation_config keys upstream takes, by our sampling_params name.
_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model_path: str) -> dict[str, Any]:
    """The sampling_params a chat request gets for the fields it leaves unset: the keys of `_KEYS` that
    the checkpoint's generation_config.json sets (transformers' own defaults do not count; `top_k` 0 is
    its "off", ours -1). A value no request could send is left out with a warning, so that it never
    turns every request into an error."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        logger.warning("The model's generation_config.json cannot be read (%s); no sampling defaults.", e)
        return {}
    out = {}
    for key in _KEYS:
        value = config.get(key)
        if value is None:
            continue
        if key == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)
        if key == "top_k" and value == 0:
            value = -1
        try:
            SamplingParams.from_dict({key: value})
        except (SamplingParamsError, TypeError) as e:
            # A value no request could send would make every chat that leaves the field unset fail.
            logger.warning("The model's generation_config.json %s %r is left out: %s", key, value, e)
            continue
        out[key] = value
    return out
