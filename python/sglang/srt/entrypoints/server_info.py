"""The /get_server_info body (the route's and `Engine.get_server_info`'s)."""

from __future__ import annotations

from typing import Any

from sglang.srt.managers.request_validation import max_samples_per_request
from sglang.srt.server_args import ServerArgs
from sglang.version import __version__


def build_server_info(
    server_args: ServerArgs, model_info: dict[str, Any], state: dict[str, Any], tm: Any = None
) -> dict:
    """The /get_server_info body: every server arg (secrets redacted) and the resolved values derived
    from them, the scheduler's limits and its live state. `tm`: the tokenizer manager whose limits it
    reports (its fan-out bound: None, no bound, in an Engine); without one, the flags' values."""
    info = server_args.public_dict()
    info["mamba_radix_cache_strategy"] = server_args.mamba_radix_cache_strategy
    info["mamba_cache_chunk_size"] = server_args.mamba_cache_chunk_size
    info["max_request_body_size"] = server_args.request_body_limit
    info.update(model_info)
    if tm is not None:
        info["max_samples_per_request"] = tm.max_samples_per_request
    else:
        info["max_samples_per_request"] = max_samples_per_request(
            server_args.max_samples_per_request, model_info["max_running_requests"]
        )
    info["internal_states"] = [state]
    info["version"] = __version__
    return info
