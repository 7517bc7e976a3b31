"""The body of upstream's /start_profile (and `Engine.start_profile`'s arguments) as a checked
`ProfileReq`: the scheduler's profiler (`scheduler_profiler.py`) runs only what passes here.

Upstream's fields: `output_dir`, `start_step`, `num_steps`, `activities` (CPU, GPU, MEM, CUDA_PROFILER),
`with_stack`, `record_shapes`, `profile_by_stage`, `profile_prefix`, `profile_id`, `merge_profiles`. Where
upstream writes a trace wherever a client names, here `output_dir` must be inside
SGLANG_TORCH_PROFILER_DIR (default /tmp; a relative one is taken inside it), and `num_steps` is at most
SGLANG_PROFILE_MAX_STEPS: a client of a server without an admin key could otherwise fill any folder the
server may write, or profile until its memory is gone. Each refusal is a 400 naming the field.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import ProfileReq
from sglang.srt.managers.request_validation import RequestError

ACTIVITIES = ("CPU", "GPU", "MEM", "CUDA_PROFILER")
CUDA_ONLY = ("MEM", "CUDA_PROFILER")
FIELDS = (
    "output_dir", "start_step", "num_steps", "activities", "with_stack", "record_shapes", "profile_by_stage",
    "profile_prefix", "profile_id", "merge_profiles", "profile_stages",
)  # fmt: skip
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def profile_root() -> str:
    """SGLANG_TORCH_PROFILER_DIR, resolved (a ValueError naming it where it is not a usable folder name)."""
    raw = envs.SGLANG_TORCH_PROFILER_DIR.get()
    if not raw:
        raise ValueError("Environment variable SGLANG_TORCH_PROFILER_DIR is empty; name a folder for traces.")
    return os.path.realpath(raw)


def check_profile_settings() -> None:
    """The profiling variables, read once at start (a ValueError naming the one that is wrong)."""
    profile_root()
    envs.SGLANG_PROFILE_WITH_STACK.get()
    envs.SGLANG_PROFILE_RECORD_SHAPES.get()
    if envs.SGLANG_PROFILE_MAX_STEPS.get() < 1:
        raise ValueError("Environment variable SGLANG_PROFILE_MAX_STEPS must be at least 1.")


def _flag(data: dict, name: str, default: bool) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}.", name)
    return value


def _count(data: dict, name: str, low: int, high: int) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer from {low} to {high}, got {value!r}.", name)
    return value


def _name(data: dict, name: str) -> str | None:
    value = data.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not _NAME.fullmatch(value) or value in (".", ".."):
        raise RequestError(
            f"{name} must be 1 to 64 letters, digits, '.', '_' or '-' (it is part of a file name), got {value!r}.",
            name,
        )
    return value


def _output_dir(data: dict, root: str) -> str:
    value = data.get("output_dir")
    if value is None or value == "":
        return root
    if not isinstance(value, str) or "\0" in value:
        raise RequestError(f"output_dir must be a folder name, got {value!r}.", "output_dir")
    path = os.path.realpath(os.path.join(root, value))  # (an absolute value replaces the root)
    if path != root and not path.startswith(root.rstrip(os.sep) + os.sep):
        raise RequestError(
            f"output_dir must be inside SGLANG_TORCH_PROFILER_DIR ({root}), got {value!r}; set that "
            "variable on the server to write traces elsewhere.",
            "output_dir",
        )
    return path


def _activities(data: dict, cuda: bool) -> tuple[str, ...]:
    value = data.get("activities")
    if value is None:
        return ("CPU", "GPU")
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise RequestError(f"activities must be a non-empty list of {', '.join(ACTIVITIES)}.", "activities")
    for a in value:
        if a not in ACTIVITIES:
            refusal = " (ROCm's tracer is not built here)" if a == "RPD" else ""
            raise RequestError(
                f"activities: {a!r} is not one of {', '.join(ACTIVITIES)}{refusal}.", "activities"
            )
        if a in CUDA_ONLY and not cuda:
            raise RequestError(
                f"activities: {a} needs a CUDA device, and this server runs on the CPU.", "activities"
            )
    return tuple(dict.fromkeys(value))


def parse_profile_request(data: Any, cuda: bool, ranks: int) -> ProfileReq:
    """A /start_profile body (a JSON object, or None for no body) as a `ProfileReq`; `cuda`: the server's
    device is CUDA; `ranks`: its scheduler processes (TP x DP), each writing its own trace."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise RequestError("The body must be a JSON object of /start_profile's fields.", None)
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise RequestError(
            f"{unknown[0]} is not a field of /start_profile ({', '.join(FIELDS)}).", unknown[0]
        )
    max_steps = envs.SGLANG_PROFILE_MAX_STEPS.get()
    req = ProfileReq(
        output_dir=_output_dir(data, profile_root()),
        start_step=_count(data, "start_step", 0, 1 << 62),
        num_steps=_count(data, "num_steps", 1, max_steps),
        activities=_activities(data, cuda),
        with_stack=_flag(data, "with_stack", envs.SGLANG_PROFILE_WITH_STACK.get()),
        record_shapes=_flag(data, "record_shapes", envs.SGLANG_PROFILE_RECORD_SHAPES.get()),
        profile_by_stage=_flag(data, "profile_by_stage", False),
        profile_id=_name(data, "profile_id") or f"{time.time():.6f}",
        profile_prefix=_name(data, "profile_prefix"),
    )
    if req.profile_by_stage and req.num_steps is None:
        raise RequestError(
            "profile_by_stage needs num_steps (the batches to trace of each stage).", "num_steps"
        )
    if req.profile_by_stage and req.start_step is not None:
        raise RequestError(
            "start_step does not go with profile_by_stage (it starts at the next prefill).", "start_step"
        )
    if _flag(data, "merge_profiles", False) and ranks > 1:
        raise RequestError(
            "merge_profiles is not supported here: each of the server's ranks writes its own trace "
            "(<profile_id>-TP-<rank>...); open them side by side in Perfetto.",
            "merge_profiles",
        )
    stages = data.get("profile_stages")
    if stages is not None:
        if (
            not req.profile_by_stage
            or not isinstance(stages, list)
            or not stages
            or not all(isinstance(x, str) and x in ("prefill", "decode") for x in stages)
        ):
            raise RequestError(
                "profile_stages must name prefill, decode or both, with profile_by_stage.", "profile_stages"
            )
        req.stages = tuple(s for name, s in (("prefill", "EXTEND"), ("decode", "DECODE")) if name in stages)
    return req
