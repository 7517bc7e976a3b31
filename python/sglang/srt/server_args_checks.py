"""The checks `ServerArgs` runs on construction: each refuses a flag value, or a combination, that cannot
work with `ServerArgsError`, one sentence naming the flag. (Resolution, where flags change one another,
stays in `ServerArgs`.)"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sglang.srt.configs.presets import is_preset
from sglang.srt.environ import envs
from sglang.srt.function_call.function_call_parser import PARSERS as TOOL_CALL_PARSERS
from sglang.srt.managers.profile_request import check_profile_settings
from sglang.srt.parser.reasoning_parser import FORMATS as REASONING_FORMATS
from sglang.srt.speculative.draft_layers import (
    DEFAULT_MTP_STEPS,
    MTP_ALGORITHMS,
    MTP_ARCHITECTURES,
    num_mtp_layers,
)

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

MAMBA_SCHEDULER_STRATEGY_CHOICES = ["auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"]
DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]
# Upstream's other names of two of them (`ServerArgs.__post_init__` resolves them).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
KV_CACHE_DTYPE_CHOICES = ["auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16"]
DEVICE_CHOICES = ["auto", "cpu", "cuda"]
# None: triton on CUDA, torch_native on CPU (`ServerArgs._handle_attention_backend`).
ATTENTION_BACKEND_CHOICES = ["torch_native", "triton"]
# The values of these flags upstream takes (sglang 0.5.23, and main's newer ones) that this server does
# not: each is refused in one sentence saying why and what to use (`check_upstream_values`), where
# argparse's choices stopped the start with "invalid choice" (exit 2).
UPSTREAM_KV_CACHE_DTYPES = {
    "fp4_e2m1": "block-scaled MXFP4",
    "mxfp8": "block-scaled MXFP8",
    "nvfp4": "NVFP4 (FP4 E2M1 with FP8 block scales)",
    "fp4_mx_block16": "FP4 E2M1 with 16-value MX blocks",
}
UPSTREAM_ATTENTION_BACKENDS = (
    "flex_attention dsa nsa qsa dsv4 compressed cutlass_mla fa3 fa4 flashinfer flashmla trtllm_mla cutedsl_mla "
    "tokenspeed_mla trtllm_mha dual_chunk_flash_attn hpc_ops minicpm_flashattn minicpm_flashinfer aiter wave "
    "intel_amx ascend intel_xpu mlu llada2_cfg_flashinfer"
).split()
# Upstream's other devices (its --device takes any name) and transfer backends, and why each is refused.
UPSTREAM_DEVICES = {
    "npu": "Ascend NPUs",
    "xpu": "Intel GPUs",
    "hpu": "Intel Gaudi",
    "musa": "Moore Threads GPUs",
    "mps": "Apple silicon",
}
UPSTREAM_TRANSFER_BACKENDS = {
    "ascend": "it moves KV between Ascend NPUs, which this server does not run on",
    "mori": "it is AMD's ROCm transfer engine, and this server runs on NVIDIA CUDA GPUs and the CPU",
    "fake": "it is upstream's benchmark mode that moves no KV, which is not built here",
}
UPSTREAM_SCHEDULE_POLICIES = {
    "dfs-weight": "it orders by the radix tree's depth-first weights, which this scheduler does not keep",
    "priority": "requests are ordered by their priority with --enable-priority-scheduling here (and "
    "--schedule-policy fcfs or lof)",
    "routing-key": "requests carry no routing key here",
    "hrrn": "it is not implemented here",
    "shortest-prefill-first": "it is not implemented here",
}
# What `--reasoning-parser auto` / `--tool-call-parser auto` resolve to (upstream detects them from the
# chat template), by the checkpoint's architecture: the parsers this server has for the models it serves.
AUTO_PARSERS: dict[str, dict[str, str]] = {
    "Qwen3NextForCausalLM": {"--reasoning-parser": "qwen3", "--tool-call-parser": "qwen25"},
    "Qwen3_5ForConditionalGeneration": {"--reasoning-parser": "qwen3", "--tool-call-parser": "qwen3_coder"},
    "NemotronHForCausalLM": {"--reasoning-parser": "nemotron_3"},
}
# Upstream's choices; outlines and llguidance are refused (`check_basic_flags`).
GRAMMAR_BACKEND_CHOICES = ["xgrammar", "outlines", "llguidance", "none"]
DISAGGREGATION_MODES = ["null", "prefill", "decode"]
LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
SCHEDULE_POLICIES = ["fcfs", "lpm", "random", "lof"]
# Upstream's algorithms; NGRAM, and EAGLE / NEXTN from the checkpoint's MTP layers, run here; EAGLE3,
# STANDALONE, DFLASH and DSPARK need a separate draft model (`check_speculative_flags`).
SPECULATIVE_ALGORITHMS = ["NGRAM", "EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "DFLASH", "DSPARK"]
NGRAM_MATCH_TYPES = ["BFS", "PROB"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ServerArgsError(ValueError):
    """A flag or a combination of flags that cannot work; the message names the flag."""


def check_basic_flags(args: ServerArgs) -> None:
    _choice("--dtype", args.dtype, DTYPE_CHOICES)
    resolve_upstream_values(args)
    check_upstream_values(args)
    _choice("--kv-cache-dtype", args.kv_cache_dtype, KV_CACHE_DTYPE_CHOICES)
    _choice("--device", args.device, DEVICE_CHOICES)
    if args.attention_backend is not None:
        _choice("--attention-backend", args.attention_backend, ATTENTION_BACKEND_CHOICES)
    _positive("--triton-attention-num-kv-splits", args.triton_attention_num_kv_splits)
    _choice("--log-level", args.log_level, LOG_LEVELS)
    _choice("--schedule-policy", args.schedule_policy, SCHEDULE_POLICIES)
    if args.gc_threshold is not None and not (
        1 <= len(args.gc_threshold) <= 3 and all(isinstance(t, int) and t >= 0 for t in args.gc_threshold)
    ):
        raise ServerArgsError(
            f"--gc-threshold takes 1 to 3 non-negative integers (gc.set_threshold's), not {args.gc_threshold}."
        )
    _choice("--mamba-scheduler-strategy", args.mamba_scheduler_strategy, MAMBA_SCHEDULER_STRATEGY_CHOICES)
    _choice("--disaggregation-mode", args.disaggregation_mode, DISAGGREGATION_MODES)
    if args.disaggregation_decode_tp is not None:
        _positive("--disaggregation-decode-tp", args.disaggregation_decode_tp)
    if args.mamba_ssm_dtype is not None:
        _choice("--mamba-ssm-dtype", args.mamba_ssm_dtype, ["float32", "bfloat16", "float16"])
    if args.reasoning_parser is not None:
        _choice("--reasoning-parser", args.reasoning_parser, ["auto", *sorted(REASONING_FORMATS)])
    if args.enable_strict_thinking and args.reasoning_parser is None:
        raise ServerArgsError("--enable-strict-thinking needs --reasoning-parser (the think markers it enforces).")
    if args.tool_call_parser is not None:
        _choice("--tool-call-parser", args.tool_call_parser, ["auto", *sorted(TOOL_CALL_PARSERS)])
    _choice("--grammar-backend", args.grammar_backend, GRAMMAR_BACKEND_CHOICES)
    _choice("--log-requests-level", args.log_requests_level, [0, 1, 2, 3])
    _choice("--log-requests-format", args.log_requests_format, ["text", "json"])
    _choice("SGLANG_SHAPE_WARMUP", envs.SGLANG_SHAPE_WARMUP.get(), ["auto", "on", "off"])
    try:
        _positive("SGLANG_MEDIA_MEMORY_MB", envs.SGLANG_MEDIA_MEMORY_MB.get())
        check_profile_settings()
    except ValueError as e:  # not an integer: the registry's sentence names the variable
        raise ServerArgsError(str(e)) from None
    if args.grammar_backend in ("outlines", "llguidance"):
        raise ServerArgsError(
            f"--grammar-backend {args.grammar_backend} is not supported (only xgrammar is installed with "
            "this server); use xgrammar, or none to refuse constrained requests."
        )
    if args.enable_return_routed_experts and (args.enable_hierarchical_cache or args.disaggregation_mode != "null"):
        raise ServerArgsError(
            "--enable-return-routed-experts is not supported with --enable-hierarchical-cache or "
            "--disaggregation-mode (a position's routing stays with its KV slot on this server's device)."
        )
    if args.expert_distribution_recorder_mode in ("per_pass", "per_token"):
        raise ServerArgsError(
            f"--expert-distribution-recorder-mode {args.expert_distribution_recorder_mode} is not built here: "
            "use stat (each forward's tokens per layer and expert), or return_routed_experts for each token's experts."
        )
    if args.expert_distribution_recorder_mode is not None:
        _choice("--expert-distribution-recorder-mode", args.expert_distribution_recorder_mode, ["stat", "stat_approx"])
    size = args.expert_distribution_recorder_buffer_size
    if size is not None and (size == 0 or size < -1):
        raise ServerArgsError(f"--expert-distribution-recorder-buffer-size must be -1 or at least 1, got {size}.")
    if not 0 < args.port < 65536:
        raise ServerArgsError(f"--port must be between 1 and 65535, got {args.port}.")
    if args.admin_api_key and args.admin_api_key == args.api_key:
        raise ServerArgsError("--admin-api-key must differ from --api-key (else every user is an admin).")
    check_custom_logit_processor_exposure(args)
    _positive("--page-size", args.page_size)
    _positive("--max-prefill-tokens", args.max_prefill_tokens)
    _positive("--stream-interval", args.stream_interval)
    _positive("--decode-log-interval", args.decode_log_interval)
    for flag, value in [
        ("--max-running-requests", args.max_running_requests),
        ("--max-total-tokens", args.max_total_tokens),
        ("--max-mamba-cache-size", args.max_mamba_cache_size),
        ("--mamba-track-interval", args.mamba_track_interval),
        ("--context-length", args.context_length),
        ("--max-request-body-size", args.max_request_body_size),
        ("--max-samples-per-request", args.max_samples_per_request),
        ("--max-logprobs", args.max_logprobs),
        ("--max-logprob-entries-per-request", args.max_logprob_entries_per_request),
        ("--max-hidden-state-floats-per-request", args.max_hidden_state_floats_per_request),
        ("--cuda-graph-max-bs", args.cuda_graph_max_bs),
        *[("--cuda-graph-bs", bs) for bs in args.cuda_graph_bs or []],
    ]:
        if value is not None:
            _positive(flag, value)
    if args.chunked_prefill_size is not None and args.chunked_prefill_size < -1:
        raise ServerArgsError(
            f"--chunked-prefill-size must be positive, or -1 to disable chunked prefill, "
            f"got {args.chunked_prefill_size}."
        )
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static < 1:
        raise ServerArgsError(
            f"--mem-fraction-static must be between 0 and 1, got {args.mem_fraction_static}."
        )
    if not args.mamba_full_memory_ratio > 0:
        raise ServerArgsError(
            f"--mamba-full-memory-ratio must be positive, got {args.mamba_full_memory_ratio}."
        )
    check_speculative_flags(args)
    if args.disaggregation_decode_extra_slots is not None and args.disaggregation_decode_extra_slots < 0:
        raise ServerArgsError(
            "--disaggregation-decode-extra-slots must be 0 or more, "
            f"got {args.disaggregation_decode_extra_slots}."
        )


def resolve_upstream_values(args: ServerArgs) -> None:
    """Upstream's spellings of what this server does: --disaggregation-transfer-backend mooncake_tcp is
    Mooncake over TCP (upstream drops --disaggregation-ib-device with it too), --device cuda:0 is cuda."""
    if args.disaggregation_transfer_backend == "mooncake_tcp":
        if args.disaggregation_ib_device:
            logger.warning(
                "--disaggregation-ib-device %s is not used: --disaggregation-transfer-backend mooncake_tcp "
                "moves the bytes over TCP, as upstream.",
                args.disaggregation_ib_device,
            )
        args.disaggregation_transfer_backend, args.disaggregation_ib_device = "mooncake", None
    device, _, index = str(args.device).partition(":")
    if index:
        if index != "0":
            raise ServerArgsError(
                f"--device {args.device} is not supported by this server: rank i of a node runs on the "
                "i-th GPU CUDA_VISIBLE_DEVICES shows; set it, and pass the device without an index."
            )
        args.device = device


def check_upstream_values(args: ServerArgs) -> None:
    """Upstream's values of --kv-cache-dtype, --attention-backend, --schedule-policy, --device and
    --disaggregation-transfer-backend that this server lacks, refused in one sentence naming the flag."""
    if args.device in UPSTREAM_DEVICES:
        raise ServerArgsError(
            f"--device {args.device} is not supported by this server: it runs on NVIDIA CUDA GPUs and the "
            f"CPU only, not on {UPSTREAM_DEVICES[args.device]}; use --device cuda or cpu."
        )
    backend = args.disaggregation_transfer_backend
    if backend in UPSTREAM_TRANSFER_BACKENDS:
        raise ServerArgsError(
            f"--disaggregation-transfer-backend {backend} is not supported by this server: "
            f"{UPSTREAM_TRANSFER_BACKENDS[backend]}; use mooncake (over TCP, or RDMA with "
            "--disaggregation-ib-device; mooncake_tcp is TCP) or nixl."
        )
    kv = args.kv_cache_dtype
    if kv in UPSTREAM_KV_CACHE_DTYPES:
        raise ServerArgsError(
            f"--kv-cache-dtype {kv} is not supported by this server: its {UPSTREAM_KV_CACHE_DTYPES[kv]} "
            "format needs kernels this runtime does not have; use fp8_e4m3, fp8_e5m2 or bf16."
        )
    if args.attention_backend in UPSTREAM_ATTENTION_BACKENDS:
        raise ServerArgsError(
            f"--attention-backend {args.attention_backend} is not supported by this server: full attention "
            "runs on its own triton kernels (CUDA) or torch_native (torch SDPA), and the linear-attention "
            "layers on their own kernels; use triton or torch_native, or leave it out."
        )
    policy = args.schedule_policy
    if policy in UPSTREAM_SCHEDULE_POLICIES:
        raise ServerArgsError(
            f"--schedule-policy {policy} is not supported by this server: {UPSTREAM_SCHEDULE_POLICIES[policy]}; "
            f"use {', '.join(SCHEDULE_POLICIES[:-1])} or {SCHEDULE_POLICIES[-1]}."
        )


def resolve_auto_parsers(args: ServerArgs) -> None:
    """--reasoning-parser auto / --tool-call-parser auto: the model's parser (AUTO_PARSERS), or one
    sentence naming the flag where this server knows none for it."""
    for flag, field in (
        ("--reasoning-parser", "reasoning_parser"),
        ("--tool-call-parser", "tool_call_parser"),
    ):
        if getattr(args, field) != "auto":
            continue
        arch = args.model_config.arch.architecture
        name = AUTO_PARSERS.get(arch, {}).get(flag)
        if name is None:
            choices = sorted(REASONING_FORMATS if field == "reasoning_parser" else TOOL_CALL_PARSERS)
            raise ServerArgsError(
                f"{flag} auto knows no parser for {arch} here; give one of {', '.join(choices)}, or leave "
                "the flag out."
            )
        logger.info("%s auto: %s (%s)", flag, name, arch)
        setattr(args, field, name)


def check_speculative_flags(args: ServerArgs) -> None:
    algo = args.speculative_algorithm
    if algo is None:
        return
    _choice("--speculative-algorithm", algo, SPECULATIVE_ALGORITHMS)
    if algo in MTP_ALGORITHMS:
        check_mtp_flags(args)
        return
    if algo != "NGRAM":
        raise ServerArgsError(
            f"--speculative-algorithm {algo} needs a separate draft model, which this runtime does not run; "
            "use NEXTN (the checkpoint's own MTP layers) or NGRAM (drafts from an n-gram cache)."
        )
    _choice("--speculative-ngram-match-type", args.speculative_ngram_match_type, NGRAM_MATCH_TYPES)
    if args.speculative_ngram_match_type != "BFS":
        raise ServerArgsError(
            "--speculative-ngram-match-type PROB is not supported: drafts are one chain, the most recent "
            "continuation of the longest matching suffix (BFS)."
        )
    for flag, value in [
        ("--speculative-num-draft-tokens", args.speculative_num_draft_tokens),
        ("--speculative-ngram-min-match-window-size", args.speculative_ngram_min_match_window_size),
        ("--speculative-ngram-max-match-window-size", args.speculative_ngram_max_match_window_size),
        ("--speculative-ngram-min-bfs-breadth", args.speculative_ngram_min_bfs_breadth),
        ("--speculative-ngram-max-bfs-breadth", args.speculative_ngram_max_bfs_breadth),
        ("--speculative-ngram-branch-length", args.speculative_ngram_branch_length),
        ("--speculative-ngram-capacity", args.speculative_ngram_capacity),
    ]:
        if value is not None:
            _positive(flag, value)
    lo, hi = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
    if lo > hi:
        raise ServerArgsError(
            f"--speculative-ngram-min-match-window-size {lo} exceeds "
            f"--speculative-ngram-max-match-window-size {hi}."
        )


def check_mtp_flags(args: ServerArgs) -> None:
    """EAGLE / NEXTN: one chain of drafts from the checkpoint's own MTP layers (`speculative/`); the
    defaults are filled in later (`ServerArgs._handle_speculative`)."""
    algo, topk = args.speculative_algorithm, args.speculative_eagle_topk
    steps = DEFAULT_MTP_STEPS if args.speculative_num_steps is None else args.speculative_num_steps
    _positive("--speculative-num-steps", steps)
    if topk not in (None, 1):
        raise ServerArgsError(
            f"--speculative-eagle-topk {topk} is not supported: drafts are one chain (topk 1), the only tree "
            "whose recurrent state per position the verify keeps exact."
        )
    if args.speculative_num_draft_tokens not in (None, steps + 1):
        raise ServerArgsError(
            f"--speculative-num-draft-tokens {args.speculative_num_draft_tokens} must be "
            f"--speculative-num-steps + 1 = {steps + 1} with --speculative-eagle-topk 1."
        )
    if args.speculative_draft_model_path not in (None, args.model_path):
        raise ServerArgsError(
            f"--speculative-draft-model-path {args.speculative_draft_model_path} is not supported: "
            f"--speculative-algorithm {algo} drafts with the MTP layers of --model-path itself."
        )
    hf_config = args.model_config.hf_config
    archs = getattr(hf_config, "architectures", None) or []
    if not set(archs) & set(MTP_ARCHITECTURES) or num_mtp_layers(hf_config) < 1:
        raise ServerArgsError(
            f"--speculative-algorithm {algo} drafts with the checkpoint's MTP layers, and {args.model_path} "
            "has none (its config states no num_nextn_predict_layers / mtp_num_hidden_layers, or its "
            "architecture has no MTP layer here); use --speculative-algorithm NGRAM."
        )


def pd_decode_track_interval(args: ServerArgs) -> int | None:
    """The default --mamba-track-interval of a PD decode server with its radix cache under extra_buffer
    and pages above 1: one page (or the fewest pages a verify's drafts need). It never has the state at
    a page boundary inside a prompt (the prefill server computed it), so it snapshots at every page it
    decodes across, into its track slots, and a finished turn that does not end on a page leaves its
    last page boundary in the tree. Not under lazy, where every snapshot would be a tree checkpoint of
    its own (docs/disaggregation.md). None: the usual default."""
    page = args.page_size
    if args.disaggregation_mode != "decode" or page == 1 or not args.enable_mamba_extra_buffer():
        return None
    if args.mamba_strategy.lazy:
        return None
    n = max(page, args.speculative_num_draft_tokens or 1) if args.speculative_algorithm else page
    return -(-n // page) * page


def check_speculative_track_interval(args: ServerArgs) -> None:
    """A verify adds at most --speculative-num-draft-tokens tokens, so with an interval at least that
    long it crosses at most one track boundary (upstream's rule)."""
    n = args.speculative_num_draft_tokens
    if args.speculative_algorithm is None or not args.enable_mamba_extra_buffer():
        return
    if args.mamba_track_interval < n:
        raise ServerArgsError(
            f"--mamba-track-interval {args.mamba_track_interval} must be at least "
            f"--speculative-num-draft-tokens {n} with --mamba-scheduler-strategy "
            f"{args.mamba_scheduler_strategy}."
        )


def check_model(args: ServerArgs) -> None:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ServerArgsError("--device cuda was given, but no CUDA device is available.")
    try:
        arch = args.model_config.arch
    except (ValueError, OSError) as e:
        raise ServerArgsError(f"--model-path {args.model_path!r} cannot be served: {e}") from None
    limit = arch.max_position_embeddings
    if args.context_length is not None and args.context_length > limit:
        raise ServerArgsError(
            f"--context-length {args.context_length} exceeds the model's max_position_embeddings ({limit})."
        )


def check_tokenizer(args: ServerArgs) -> None:
    """Only local folders (or presets) are served, so a path that is not one fails here, in one
    sentence, instead of in every process that loads the tokenizer."""
    if args.skip_tokenizer_init or is_preset(args.tokenizer_path):
        return
    flag = "--tokenizer-path" if args.tokenizer_path != args.model_path else "--model-path"
    folder = Path(args.tokenizer_path)
    if not folder.is_dir():
        raise ServerArgsError(
            f"{flag} {args.tokenizer_path!r} is not a folder; give a local tokenizer folder or a "
            "built-in preset (nothing is downloaded from a hub)."
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ServerArgsError(
            f"{flag} {args.tokenizer_path!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})."
        )


def check_custom_logit_processor_exposure(args: ServerArgs) -> None:
    """An unsigned custom logit processor is code the scheduler runs: from this machine only, unless the
    operator says otherwise."""
    if not args.enable_custom_logit_processor or envs.SGLANG_LOGIT_PROCESSOR_SECRET.get():
        return
    if not args.allow_unsigned_custom_logit_processor and not _is_loopback(args.host):
        raise ServerArgsError(
            f"--enable-custom-logit-processor on --host {args.host} runs code any client sends: set "
            "SGLANG_LOGIT_PROCESSOR_SECRET (clients sign with it), serve on a loopback --host, or pass "
            "--allow-unsigned-custom-logit-processor."
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, which may resolve to any interface


def _choice(flag: str, value: Any, choices: list[Any]) -> None:
    if value not in choices:
        raise ServerArgsError(f"{flag} must be one of {', '.join(map(str, choices))}, got {value!r}.")


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise ServerArgsError(f"{flag} must be a positive integer, got {value}.")
