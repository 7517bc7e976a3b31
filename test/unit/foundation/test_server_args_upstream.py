"""Every upstream SGLang flag is recognized (issue 60, item 1): each flag of upstream's current release is
known to the parser, and given, it either works, or parses and is refused with one ServerArgsError sentence
naming it; never argparse's "unrecognized arguments" (exit 2)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sglang.srt.server_args import ServerArgs, ServerArgsError, prepare_server_args
from sglang.srt.server_args_upstream import (
    add_upstream_cli_args,
    check_upstream_args,
    parse_spec,
    upstream_engine_kwargs,
    upstream_flags_markdown,
    upstream_table,
)
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")

# Upstream's flags, names only (upstream_flags.txt says from which releases): a new release's flags are one
# update of that list away.
UPSTREAM_FLAGS = [
    spec
    for line in (Path(__file__).parent / "upstream_flags.txt").read_text().splitlines()
    for spec in line.split("#", 1)[0].split()
]

PRESET = ["--model-path", "tiny-qwen3-next", "--device", "cpu"]
DOCS = Path(__file__).resolve().parents[3] / "docs" / "server.md"


def _parser(own: list[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for flag in own:
        parser.add_argument(flag, type=int, default=1)
    add_upstream_cli_args(parser)
    return parser


# prepare_server_args builds its parser per call (~13 ms with every upstream flag); the sweeps below parse
# ~900 command lines, so they share one parser and run the same three steps.
PARSER = _parser()


def _own_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return set(parser._option_string_actions)


# Entries whose flag the parser implements by now are skipped, as add_upstream_cli_args skips them.
OWN = _own_flags()


def _parse(argv: list[str]) -> ServerArgs:
    namespace = PARSER.parse_args(argv + PRESET)
    check_upstream_args(namespace)
    return ServerArgs.from_cli_args(namespace)


def _argv(name: str, arity: str, value: str = "2") -> list[str]:
    return {"": [name], "=": [name, value], "+": [name, value, value], "?": [name]}[arity]


def test_every_upstream_flag_is_known_to_the_parser():
    known = PARSER._option_string_actions
    missing = [spec for spec in UPSTREAM_FLAGS for name in parse_spec(spec)[0] if name not in known]
    assert not missing, f"upstream flags argparse would stop the start on: {missing}"


def test_table_entries_are_upstream_flags_as_upstream_takes_them():
    upstream = {name: parse_spec(spec)[1] for spec in UPSTREAM_FLAGS for name in parse_spec(spec)[0]}
    seen: set[str] = set()
    for entry in upstream_table():
        for name in entry.names:
            assert name in upstream, f"{name} is not an upstream flag"
            # The arity decides what argparse consumes after the flag: a wrong one eats the next flag.
            assert entry.arity == upstream[name], (
                f"{name}: table {entry.arity!r}, upstream {upstream[name]!r}"
            )
            assert name not in seen, f"{name} is in the table twice"
            seen.add(name)


def test_every_refused_flag_names_itself():
    checked = 0
    for entry in upstream_table():
        if entry.accepted is not None or any(name in OWN for name in entry.names):
            continue
        for name in entry.names:
            with pytest.raises(ServerArgsError) as e:
                _parse(_argv(name, entry.arity))
            message = str(e.value)
            assert message.startswith(f"{name} is not supported by this server: "), message
            assert message.endswith(".") and message.count(". ") == 0, f"not one sentence: {message}"
            checked += 1
    # 423 today; flags implemented later leave the sweep, but one that checks nothing proves nothing.
    assert checked > 200, checked


def test_every_accepted_flag_parses_and_other_values_are_refused():
    for entry in upstream_table():
        a = entry.accepted
        if a is None or any(name in OWN for name in entry.names):
            continue
        for name in entry.names:
            if a.values is None:
                _parse(_argv(name, entry.arity, "127.0.0.1:5000"))
                continue
            for value, sets in a.values.items():
                args = _parse(_argv(name, entry.arity, value))
                for field_name, field_value in sets.items():
                    assert getattr(args, field_name) == field_value, (name, value, field_name)
            with pytest.raises(ServerArgsError, match=f"^{name} 7 is not supported by this server: "):
                _parse(_argv(name, entry.arity, "7"))


@pytest.mark.parametrize(
    "argv, outcome",
    [
        (["--dp-size", "2"], {"dp_size": 2}),
        (["--ep-size", "2"], "refused"),
        (["--enable-hierarchical-cache"], {"enable_hierarchical_cache": True}),  # (issue 58)
        (
            ["--enable-hicache", "--hicache-ratio", "3"],
            {"enable_hierarchical_cache": True, "hicache_ratio": 3.0},
        ),
        (["--hicache-storage-backend", "mooncake"], "refused"),
        (["--quantization", "awq"], "refused"),  # (fp8 is implemented: test_fp8_checkpoints.py)
        (["--speculative-draft-load-format", "auto"], "refused"),
        (["--base-gpu-id", "0"], {}),
        (["--json-model-override-args", "{}"], {}),
        (["--enable-cache-report"], {}),
        (["--nnodes", "2"], "refused"),  # (without --dist-init-addr)
        (["--node-rank", "0"], {}),
        (["--dist-init-addr", "127.0.0.1:5000"], {"dist_init_addr": "127.0.0.1:5000"}),
        (["--pp-size", "2"], "refused"),
        (["--enable-lora-overlap-loading"], "refused"),
        (["--tokenizer-worker-num", "2"], "refused"),
        (["--model-loader-extra-config", "{}"], {}),
        (["--kv-events-config", "{}"], "refused"),
        (["--mamba-backend", "triton"], {}),
        (["--cuda-graph-max-bs-decode", "8"], {"cuda_graph_max_bs": 8}),
    ],
)
def test_issue_examples_no_longer_stop_argparse(argv, outcome):
    """The issue's sample of upstream flags, through prepare_server_args itself: before, each was
    argparse's SystemExit(2) "unrecognized arguments"."""
    if outcome == "refused":
        with pytest.raises(ServerArgsError, match=f"^{argv[0]} "):
            prepare_server_args(argv + PRESET)
        return
    args = prepare_server_args(argv + PRESET)
    for field_name, value in outcome.items():
        assert getattr(args, field_name) == value


def test_upstream_names_of_our_flags_set_our_fields():
    args = _parse(["--cuda-graph-bs-decode", "1", "2", "4", "--tensor-parallel-size", "1"])
    assert (args.cuda_graph_bs, args.tp_size) == ([1, 2, 4], 1)
    assert _parse(["--disable-decode-cuda-graph"]).disable_cuda_graph
    assert _parse(["--cuda-graph-backend-decode", "disabled"]).disable_cuda_graph
    assert not _parse(["--cuda-graph-backend-decode", "full"]).disable_cuda_graph
    # An alias never resets the default its flag gives.
    assert _parse([]).cuda_graph_max_bs is None and not _parse([]).disable_cuda_graph


def test_a_flag_implemented_later_is_not_shadowed_by_the_table():
    """Whoever implements an upstream flag adds it to the parser; the table's entry steps aside and its
    other names become aliases of the new flag."""
    parser = _parser(own=["--pp-size"])
    namespace = parser.parse_args(["--pipeline-parallel-size", "4"] + PRESET)
    check_upstream_args(namespace)
    assert namespace.pp_size == 4
    namespace = parser.parse_args(["--pp-size", "2"] + PRESET)
    check_upstream_args(namespace)
    assert namespace.pp_size == 2


def test_engine_takes_upstream_keywords_through_the_same_table():
    kwargs = upstream_engine_kwargs(
        {
            "model_path": "tiny-qwen3-next",
            "pp_size": 1,
            "enable_cache_report": True,
            "enable_eplb": False,
            "json_model_override_args": {},
            "cuda_graph_max_bs_decode": 8,
            "mamba_radix_cache_strategy": "no_buffer",
        }
    )
    assert kwargs == {
        "model_path": "tiny-qwen3-next",
        "cuda_graph_max_bs": 8,
        "mamba_scheduler_strategy": "no_buffer",
    }
    with pytest.raises(ServerArgsError, match="^--pp-size 2 is not supported by this server: "):
        upstream_engine_kwargs({"pp_size": 2})
    with pytest.raises(ServerArgsError, match="^--lora-drain-wait-threshold is not supported by this server: "):
        upstream_engine_kwargs({"lora_drain_wait_threshold": 3})
    # A name upstream does not have either is left to ServerArgs (a TypeError, as before).
    assert upstream_engine_kwargs({"no_such_flag": 1}) == {"no_such_flag": 1}


def test_docs_list_the_upstream_flags_as_the_table_says():
    assert upstream_flags_markdown() in DOCS.read_text(), (
        "docs/server.md's 'Upstream flags' lists differ from the table: paste the output of "
        "python -c 'from sglang.srt.server_args_upstream import upstream_flags_markdown as m; print(m(), end=\"\")'"
    )


def test_the_flag_list_holds_the_pd_flags_rl_frameworks_pass():
    """The list is what the sweeps above check; the four PD flags of older releases stay in it (issue:
    `--disaggregation-decode-tp 2` stopped the start with "unrecognized arguments")."""
    names = {name for spec in UPSTREAM_FLAGS for name in parse_spec(spec)[0]}
    for flag in ("tp", "dp", "enable-fake-auto"):
        assert f"--disaggregation-decode-{flag}" in names
    assert "--disaggregation-prefill-pp" in names and len(names) > 550


@pytest.mark.parametrize("tp", ["1", "2", "8"])
def test_disaggregation_decode_tp_is_recorded(tp):
    """Prefill side: the decode servers' --tp-size, any positive size (each destination carries its own
    rank count, which may differ from the prefill server's --tp-size)."""
    argv = ["--disaggregation-mode", "prefill", "--disaggregation-decode-tp", tp] + PRESET
    assert prepare_server_args(argv).disaggregation_decode_tp == int(tp)
    assert prepare_server_args(PRESET).disaggregation_decode_tp is None
    assert upstream_engine_kwargs({"disaggregation_decode_tp": int(tp)}) == {
        "disaggregation_decode_tp": int(tp)
    }


def test_disaggregation_decode_tp_must_be_positive():
    with pytest.raises(
        ServerArgsError, match="^--disaggregation-decode-tp must be a positive integer, got 0"
    ):
        prepare_server_args(["--disaggregation-decode-tp", "0"] + PRESET)


@pytest.mark.parametrize(
    "flag, reason",
    [
        ("--disaggregation-decode-dp", "this part of prefill/decode disaggregation is not built"),
        ("--disaggregation-prefill-pp", "this kind of parallelism is not built"),
    ],
)
def test_pd_sizes_of_one_are_accepted_and_others_refused(flag, reason):
    prepare_server_args([flag, "1"] + PRESET)
    with pytest.raises(ServerArgsError) as e:
        prepare_server_args([flag, "2"] + PRESET)
    text = str(e.value)
    assert text.startswith(f"{flag} 2 is not supported by this server: {reason}"), text
    assert f"{flag} 1 is accepted" in text and text.count(". ") == 0
    with pytest.raises(ServerArgsError, match=f"^{flag} 4 is not supported"):
        upstream_engine_kwargs({flag[2:].replace("-", "_"): 4})


def test_fake_auto_decode_is_refused_in_a_sentence():
    with pytest.raises(ServerArgsError) as e:
        prepare_server_args(["--disaggregation-decode-enable-fake-auto"] + PRESET)
    assert str(e.value).startswith(
        "--disaggregation-decode-enable-fake-auto is not supported by this server: upstream's fake KV transfer"
    )


def test_mooncake_tcp_is_mooncake_over_tcp():
    """Upstream's mooncake_tcp forces Mooncake's TCP transport and drops --disaggregation-ib-device; here
    Mooncake runs over TCP whenever no IB device is given, so the value maps to that."""
    args = prepare_server_args(["--disaggregation-transfer-backend", "mooncake_tcp"] + PRESET)
    assert (args.disaggregation_transfer_backend, args.disaggregation_ib_device) == ("mooncake", None)
    argv = ["--disaggregation-transfer-backend", "mooncake_tcp", "--disaggregation-ib-device", "mlx5_0"]
    args = prepare_server_args(argv + PRESET)
    assert (args.disaggregation_transfer_backend, args.disaggregation_ib_device) == ("mooncake", None)
    args = prepare_server_args(["--disaggregation-ib-device", "mlx5_0"] + PRESET)
    assert (args.disaggregation_transfer_backend, args.disaggregation_ib_device) == ("mooncake", "mlx5_0")


# Upstream's values this server does not take, each refused in one sentence naming the flag and the
# value: before, argparse's "invalid choice" (exit 2) for --device and --speculative-algorithm, and for
# the transfer backends a startup error without the reason.
REFUSED_VALUES = (
    [("--disaggregation-transfer-backend", v, "use mooncake") for v in ("ascend", "fake", "mori")]
    + [("--device", v, "use --device cuda or cpu") for v in ("npu", "xpu", "hpu", "musa", "mps")]
    + [("--device", "cuda:1", "CUDA_VISIBLE_DEVICES")]
    + [("--speculative-algorithm", v, "use NEXTN") for v in ("DFLASH", "DSPARK", "EAGLE3", "STANDALONE")]
    + [("--attention-backend", "llada2_cfg_flashinfer", "use triton or torch_native")]
)


@pytest.mark.parametrize(
    "flag, value, instead", REFUSED_VALUES, ids=[f"{f}={v}" for f, v, _ in REFUSED_VALUES]
)
def test_upstream_values_are_refused_naming_flag_and_value(flag, value, instead):
    argv = [flag, value, "--model-path", "tiny-qwen3-next"] + (
        [] if flag == "--device" else ["--device", "cpu"]
    )
    with pytest.raises(ServerArgsError) as e:
        prepare_server_args(argv)
    text = str(e.value)
    assert text.startswith(f"{flag} {value} "), text
    assert instead in text and text.endswith(".") and text.count(". ") == 0, text


def test_upstream_spellings_of_our_values():
    assert prepare_server_args(["--log-level", "WARNING"] + PRESET).log_level == "warning"
    argv = ["--model-path", "tiny-qwen3-next", "--device", "cpu:0"]
    assert prepare_server_args(argv).device == "cpu"
