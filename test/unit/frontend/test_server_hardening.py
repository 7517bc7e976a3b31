"""Server arguments a user or an operator relies on: secrets never leave the process, a tokenizer path
that is not a local tokenizer fails in one sentence, the request limits have their documented defaults,
and /get_server_info reports the cache chunk size and strategy actually in use."""

from __future__ import annotations

import orjson
import pytest

from sglang.srt.entrypoints.server_info import build_server_info
from sglang.srt.server_args import REDACTED, ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

MODEL_INFO = {"max_running_requests": 400, "context_len": 4096}


def test_the_api_key_is_never_printed_or_returned():
    args = ServerArgs(api_key="s3cret")
    assert "s3cret" not in repr(args) and "s3cret" not in str(args)
    assert args.public_dict()["api_key"] == REDACTED
    info = build_server_info(args, MODEL_INFO, {})
    assert b"s3cret" not in orjson.dumps(info)
    assert info["api_key"] == REDACTED
    assert ServerArgs().public_dict()["api_key"] is None, "an unset secret reads as unset"
    assert args.api_key == "s3cret", "the server itself still has it"


def test_server_info_reports_the_resolved_cache_chunk_and_limits():
    args = ServerArgs(page_size=128, mamba_scheduler_strategy="extra_buffer", disable_overlap_schedule=True)
    info = build_server_info(args, MODEL_INFO, {})
    # tiny-qwen3-next's kernel chunk is 64; with 128-token pages checkpoints sit every 128 tokens.
    assert info["mamba_cache_chunk_size"] == 128
    assert info["mamba_scheduler_strategy"] == info["mamba_radix_cache_strategy"] == "extra_buffer"
    auto = build_server_info(ServerArgs(), MODEL_INFO, {})
    assert auto["mamba_scheduler_strategy"] == "extra_buffer_lazy", "auto is shown resolved"
    assert auto["mamba_cache_chunk_size"] == 64
    assert auto["max_request_body_size"] == (1 << 20) + 64 * 4096
    assert auto["max_samples_per_request"] == 4096  # (400 running requests: the default, 4,096)


def test_request_limits_are_flags():
    args = ServerArgs(max_request_body_size=12345, max_samples_per_request=7)
    info = build_server_info(args, MODEL_INFO, {})
    assert (info["max_request_body_size"], info["max_samples_per_request"]) == (12345, 7)
    with pytest.raises(ServerArgsError, match="--max-request-body-size must be a positive integer"):
        ServerArgs(max_request_body_size=0)
    with pytest.raises(ServerArgsError, match="--max-samples-per-request must be a positive integer"):
        ServerArgs(max_samples_per_request=-1)


def test_a_tokenizer_path_that_is_not_a_local_tokenizer_fails_in_one_sentence(tmp_path):
    with pytest.raises(ServerArgsError) as e:
        ServerArgs(tokenizer_path="/nonexistent/tok")
    assert str(e.value).startswith("--tokenizer-path '/nonexistent/tok' is not a folder")
    with pytest.raises(ServerArgsError, match="has no tokenizer files"):
        ServerArgs(tokenizer_path=str(tmp_path))
