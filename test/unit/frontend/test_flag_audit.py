"""No flag without an effect: every flag of `python -m sglang.launch_server --help` is read by the
runtime, or refused at startup with one sentence naming it, or logged at startup as having no effect.
A new flag that is none of these fails here until it is given an effect or a reason."""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sglang
from sglang.srt.entrypoints import process_launcher
from sglang.srt.entrypoints.process_launcher import (
    ServerStartupError,
    check_flag_support,
    log_no_effect_flags,
)
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=11, suite="per-commit-cpu")

PACKAGE = Path(sglang.__file__).parent

# Refused at startup (ServerArgsError or ServerStartupError): a value that asks for the missing feature.
REFUSED = {
    "enable_dp_attention": True,
    "disaggregation_transfer_backend": "ascend",  # (nixl is refused only where it is not installed)
    "grammar_backend": "outlines",
}
# Accepted for compatibility and logged as having no effect.
NO_EFFECT = {
    "trust_remote_code": True,
    "enable_torch_compile": True,
    "torch_compile_max_bs": 16,
    "constrained_json_whitespace_pattern": r"[\n\t ]*",
    "collect_tokens_histogram": True,
    "speculative_ngram_min_bfs_breadth": 2,
    "speculative_ngram_max_bfs_breadth": 4,
}
# Read through a value ServerArgs derives from them rather than by their own name.
DERIVED = {
    "context_length": "context_len",
    "disable_overlap_schedule": "enable_overlap_schedule",
    "disable_cuda_graph": "cuda_graph_enabled",
    "max_request_body_size": "request_body_limit",
}


def help_flags() -> dict[str, str]:
    """Flag -> dest, for every flag that `--help` lists."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return {opt: a.dest for a in parser._actions if a.dest != "help" for opt in a.option_strings}


def runtime_sources() -> str:
    files = [f for f in PACKAGE.rglob("*.py") if "test" not in f.relative_to(PACKAGE).parts]
    return "\n".join(f.read_text() for f in files if f.name != "server_args.py")


def test_help_lists_the_flags_the_audit_knows():
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    listed = set(re.findall(r"(--[a-z][a-z0-9-]+)", out.stdout)) - {"--help"}
    assert listed == set(help_flags())


def test_every_flag_is_read_refused_or_logged_as_without_effect():
    sources = runtime_sources()
    dests = set(help_flags().values())
    assert set(REFUSED) | set(NO_EFFECT) | set(DERIVED) <= dests
    assert set(NO_EFFECT) == set(process_launcher.NO_EFFECT_FLAGS)
    unread = [
        dest
        for dest in sorted(dests - set(REFUSED) - set(NO_EFFECT))
        if not re.search(rf"\.{DERIVED.get(dest, dest)}\b", sources)
    ]
    assert not unread, f"flags nothing reads (give them an effect, or refuse or log them): {unread}"


@pytest.mark.parametrize("dest", sorted(REFUSED))
def test_a_refused_flag_stops_the_start_with_one_sentence_naming_it(dest):
    flag = "--" + dest.replace("_", "-")
    try:
        args = ServerArgs(**{dest: REFUSED[dest]})
    except ServerArgsError as e:
        message = str(e)
    else:
        with pytest.raises(ServerStartupError) as e:
            check_flag_support(args)
        message = str(e.value)
    assert message.startswith(flag) and message.endswith(".") and ". " not in message, message


def test_defaults_are_not_refused_and_log_nothing(caplog):
    args = ServerArgs()
    with caplog.at_level(logging.WARNING):
        check_flag_support(args)
        log_no_effect_flags(args)
    assert not caplog.records


def test_a_flag_without_effect_is_logged_once_with_the_reason(caplog):
    with caplog.at_level(logging.WARNING, logger=process_launcher.__name__):
        log_no_effect_flags(ServerArgs(**NO_EFFECT))
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == (
        "--trust-remote-code has no effect: models run on this runtime's own implementations and "
        "tokenizers load from local files, so no code from a checkpoint is ever run."
    )
    flags = ["--" + name.replace("_", "-") for name in NO_EFFECT]
    assert [m.split(" has no effect: ")[0] for m in messages] == flags
    assert all(m.endswith(".") for m in messages)


def test_a_refused_transfer_backend_fails_the_command_line_in_one_sentence():
    """End to end, through `python -m sglang.launch_server` (its error line and exit code, before any
    process starts), with a backend neither this server nor upstream has (refused wherever this runs,
    NIXL installed or not; upstream's own other values are refused earlier, by ServerArgs, each with its
    reason: test_server_args_upstream.py)."""
    backend = "rdma"
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--disaggregation-mode", "prefill",
         "--disaggregation-transfer-backend", backend],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: --disaggregation-transfer-backend {backend}: this server moves KV and state with mooncake "
        "or nixl only; use --disaggregation-transfer-backend mooncake."
    ], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_disaggregation_on_a_gpu_starts_and_other_devices_are_refused_in_one_sentence():
    args = ServerArgs()
    args.disaggregation_mode, args.device = "decode", "cuda"  # as resolved on a GPU machine
    check_flag_support(args)  # CUDA pools: registered directly, or staged through host buffers
    args.device = "xpu"
    with pytest.raises(ServerStartupError) as e:
        check_flag_support(args)
    message = str(e.value)
    assert message.startswith("--disaggregation-mode decode with --device xpu: KV and state transfer")
    assert message.endswith(".") and ". " not in message
