"""The command line of `ServerArgs` (`python -m sglang.launch_server --help`): every flag, by group, with
SGLang's names and our help texts. Defaults come from the dataclass's fields, so they are written once;
`ServerArgs.add_cli_args` calls this, and `prepare_server_args` adds upstream's other flags after it
(`server_args_upstream`)."""

from __future__ import annotations

import argparse
from typing import Any

from sglang.srt.function_call.function_call_parser import PARSERS as TOOL_CALL_PARSERS
from sglang.srt.parser.reasoning_parser import FORMATS as REASONING_FORMATS
from sglang.srt.server_args_checks import (
    ATTENTION_BACKEND_CHOICES,
    DEVICE_CHOICES,
    DISAGGREGATION_MODES,
    DTYPE_ALIASES,
    DTYPE_CHOICES,
    GRAMMAR_BACKEND_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    LOG_LEVELS,
    MAMBA_SCHEDULER_STRATEGY_CHOICES,
    NGRAM_MATCH_TYPES,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
)
from sglang.srt.server_args_frontend import add_frontend_cli_args
from sglang.srt.server_args_hicache import add_hicache_cli_args
from sglang.srt.server_args_lora import add_lora_cli_args
from sglang.srt.server_args_media import add_media_cli_args
from sglang.srt.server_args_parallel import add_parallel_cli_args
from sglang.srt.server_args_priority import add_priority_cli_args


def add_cli_args(parser: argparse.ArgumentParser, fields: dict[str, Any]) -> None:
    """Every flag of `ServerArgs` (its dataclass `fields` give the defaults), by group, with SGLang's names."""
    d = fields

    def default(name: str):
        return d[name].default

    g = parser.add_argument_group("model and tokenizer")
    g.add_argument(
        "--model-path",
        "--model",
        default=default("model_path"),
        help="An HF-format checkpoint folder, or a built-in preset: tiny-qwen3-next-demo (the default: a "
        "small trained model that writes Python), tiny-qwen3-next, tiny-nemotron-h, tiny-qwen3.5, "
        "tiny-qwen3.5-moe, tiny-granite-4.0-h, tiny-falcon-h1, tiny-bamba, tiny-lfm2, tiny-lfm2-moe "
        "(random test fixtures).",
    )
    g.add_argument("--tokenizer-path", default=None)
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--context-length", type=int, default=None)
    # The flags below list their values in --help; a value upstream takes and this server lacks is
    # refused by `check_basic_flags` in a sentence saying why, not by argparse.
    g.add_argument("--dtype", default="auto", metavar=_listed(DTYPE_CHOICES + list(DTYPE_ALIASES)))
    g.add_argument("--device", default="auto", metavar=_listed(DEVICE_CHOICES))
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Accepted for compatibility; no effect (no code from a checkpoint is ever run).",
    )
    g.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="Serve without a tokenizer (none is loaded, and the model folder needs none): prompts are "
        "input_ids, replies carry output_ids without text; what needs a tokenizer is refused with 400.",
    )
    g.add_argument("--random-seed", type=int, default=None)
    g.add_argument(
        "--weight-version",
        default=default("weight_version"),
        help="The label of the weights served, in every reply's meta_info.weight_version; "
        "/update_weights_from_disk and /update_weight_version change it.",
    )
    g.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="Let /release_memory_occupation free the memory of the weights, the KV and state pools and "
        "the CUDA graphs (for a trainer on the same GPU) until /resume_memory_occupation; off, those "
        "calls keep the memory, as upstream's do without this flag.",
    )
    g.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="Keep a host copy of the weights while /release_memory_occupation has freed them, and put "
        "it back on resume; off, resumed weights hold no values until a weight update writes them.",
    )

    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default=default("host"))
    g.add_argument("--port", type=int, default=default("port"))
    g.add_argument("--api-key", default=None, help="Bearer token checked on every route but /health.")
    g.add_argument(
        "--admin-api-key",
        default=None,
        help="Bearer token of the management routes (weight updates and reads, memory release and "
        "resume, pause and continue, abort, flush, weight version; upstream's): set, they refuse "
        "--api-key and take this one only; unset, they take --api-key as every route does.",
    )
    g.add_argument("--enable-metrics", action="store_true")
    # Any case, as upstream (it looks the name up upper-cased).
    g.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    g.add_argument(
        "--log-requests",
        action="store_true",
        help="Log each request when it arrives and when it ends (and HTTP access lines); see --log-requests-level.",
    )
    g.add_argument(
        "--log-requests-level",
        type=int,
        default=default("log_requests_level"),
        help="0: metadata; 1: and sampling parameters; 2: and the first 2,048 characters of input and output; 3: all.",
    )
    g.add_argument("--log-requests-format", default=default("log_requests_format"), choices=["text", "json"])
    g.add_argument(
        "--decode-log-interval",
        type=int,
        default=default("decode_log_interval"),
        help="Log a 'Decode batch.' line (running requests, token and mamba slot usage, generation "
        "throughput) every this many decode batches; every prefill batch logs a 'Prefill batch.' line.",
    )
    g.add_argument(
        "--skip-server-warmup",
        action="store_true",
        help="Serve without the warm-up request (one short generation before the port listens, which "
        "compiles and autotunes the GPU kernels at start rather than in the first user's request).",
    )
    g.add_argument(
        "--max-request-body-size",
        type=int,
        default=None,
        help="Largest request body in bytes (HTTP 413 above); default: 1 MiB + 64 bytes per context token.",
    )
    g.add_argument(
        "--max-samples-per-request",
        type=int,
        default=None,
        help="Most sequences one request may start (prompts x n; n itself is at most 64); default: 4096, or "
        "the max running requests where more.",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=default("max_logprobs"),
        help="Most top logprobs (top_logprobs_num, OpenAI's top_logprobs / logprobs) and most "
        "token_ids_logprob ids a request may ask for at one position (vLLM's flag); more gets 400.",
    )
    g.add_argument(
        "--max-logprob-entries-per-request",
        type=int,
        default=default("max_logprob_entries_per_request"),
        help="Most logprob entries one request may ask for, summed over its samples: input positions "
        "from logprob_start_len x (1 + top logprobs + token_ids_logprob ids), plus max_new_tokens x "
        "(top logprobs + ids); more gets 400.",
    )
    g.add_argument(
        "--max-hidden-state-floats-per-request",
        type=int,
        default=default("max_hidden_state_floats_per_request"),
        help="Most hidden-state floats one request may ask for with return_hidden_states, summed over "
        "its samples: (input positions + max_new_tokens) x the model's hidden size; more gets 400.",
    )
    g.add_argument(
        "--sampling-defaults",
        default=default("sampling_defaults"),
        choices=["openai", "model"],
        help="model: a chat request's unset temperature / top_p / top_k / min_p / repetition_penalty come "
        "from the checkpoint's generation_config.json, as upstream; openai: the API's defaults (1.0, 1.0, "
        "off, 0, 1.0).",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        metavar=_listed(["auto", *sorted(REASONING_FORMATS)]),
        help="Split a chat answer's reasoning (<think> ... </think>) into reasoning_content, whole or as "
        "it streams (upstream's flag: qwen3 for Qwen3 / Qwen3-Next / Qwen3.5, nemotron_3 (alias nano_v3) "
        "for Nemotron 3, qwen3-thinking for thinking-only checkpoints, deepseek-r1; auto: the model's).",
    )
    g.add_argument(
        "--enable-strict-thinking",
        action="store_true",
        help="Upstream's: while a request thinks (its answer starts in the reasoning) it may not end or call "
        "a tool, and its thinking budget (max_thinking_tokens, custom_params.thinking_budget, "
        "SGLANG_MAX_THINK_TOKENS) forces the end of the reasoning; needs --reasoning-parser.",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        metavar=_listed(["auto", *sorted(TOOL_CALL_PARSERS)]),
        help="Parse a chat answer's tool calls (<tool_call>...</tool_call>) into tool_calls (upstream's "
        "flag): qwen25 (alias qwen) for Qwen2.5 / Qwen3 / Qwen3-Next's JSON calls, qwen3_coder for "
        "Qwen3-Coder / Qwen3.5's XML calls; auto: the model's.",
    )
    g.add_argument(
        "--enable-return-hidden-states",
        action="store_true",
        help="Let requests ask for the final hidden states (the lm_head's input) of their positions "
        "(return_hidden_states); off, such a request is a 400. A request that asks recomputes its "
        "prompt rather than reuse the prefix cache.",
    )
    g.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="Let requests ask for the experts each MoE layer routed their positions to "
        "(return_routed_experts: meta_info['routed_experts'], base64 int32 [positions, layers, top_k], "
        "upstream's format, for RL routing replay); off, such a request is a 400.",
    )
    g.add_argument(
        "--expert-distribution-recorder-mode",
        default=None,
        help="stat (or stat_approx, the same here): /start_expert_distribution_record and "
        "/dump_expert_distribution_record record and write each MoE layer's tokens per expert, per forward.",
    )
    g.add_argument(
        "--expert-distribution-recorder-buffer-size",
        type=int,
        default=None,
        help="The forwards the expert distribution keeps (default 1000); -1: every one, summed.",
    )
    g.add_argument(
        "--enable-custom-logit-processor",
        action="store_true",
        help="Let requests carry a custom logit processor (custom_logit_processor, made by "
        "CustomLogitProcessor.to_str()); the scheduler runs its code, so enable it only for trusted "
        "clients, or set SGLANG_LOGIT_PROCESSOR_SECRET (then only processors signed with it load). "
        "Without the secret the start warns, and is refused on a --host other than loopback unless "
        "--allow-unsigned-custom-logit-processor. Off, such a request is a 400.",
    )
    g.add_argument(
        "--allow-unsigned-custom-logit-processor",
        action="store_true",
        help="Serve --enable-custom-logit-processor without SGLANG_LOGIT_PROCESSOR_SECRET on a --host "
        "other than loopback: every client that reaches the port can then run code in the server.",
    )
    g.add_argument(
        "--grammar-backend",
        default=default("grammar_backend"),
        choices=GRAMMAR_BACKEND_CHOICES,
        help="Constrained decoding of json_schema / regex / ebnf / structural_tag requests (and the "
        "OpenAI response_format): xgrammar, or none (such requests are refused with 400). Upstream's "
        "outlines and llguidance are not installed here: the server refuses to start with them.",
    )
    g.add_argument(
        "--constrained-json-whitespace-pattern",
        default=None,
        help="Accepted for compatibility; no effect (upstream reads it for outlines only).",
    )
    g.add_argument(
        "--constrained-json-disable-any-whitespace",
        action="store_true",
        help="A json_schema's output has no free whitespace between its tokens (xgrammar's "
        "any_whitespace=False: one space after ':' and ',' only).",
    )

    g = parser.add_argument_group("memory and scheduling")
    g.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="Fraction of the device's memory for weights and caches. Default on CUDA SGLang's for the GPU "
        "(all but a reserve for activations and graphs: 0.907 on an H200), on CPU 0.02 of RAM.",
    )
    g.add_argument("--max-running-requests", type=int, default=None)
    g.add_argument("--max-total-tokens", type=int, default=None)
    g.add_argument("--max-prefill-tokens", type=int, default=default("max_prefill_tokens"))
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="Most prompt tokens per prefill forward; -1 disables chunked prefill. Default 2048 on CPU; on "
        "CUDA SGLang's by GPU memory (8192 on an H100 or H200).",
    )
    g.add_argument("--page-size", type=int, default=default("page_size"))
    g.add_argument(
        "--kv-cache-dtype",
        default=default("kv_cache_dtype"),
        metavar=_listed(KV_CACHE_DTYPE_CHOICES),
        help="The full-attention layers' KV cache dtype: auto (the model's), bf16 / bfloat16, fp8_e4m3 or "
        "fp8_e5m2 (stored as x / scale with the checkpoint's per-layer k_scale / v_scale, 1.0 with a "
        "warning where it has none, as upstream). Attention reads the stored values converted "
        "(docs/server.md). Upstream's FP4 and MXFP8 formats are not supported.",
    )
    g.add_argument(
        "--quantization",
        default=None,
        help="fp8: quantize an unquantized checkpoint's linear weights to block-wise FP8 as they load "
        "([128, 128] blocks, e4m3, as the published FP8 checkpoints; on CPU they serve dequantized; refused "
        "on a ModelOpt checkpoint). "
        "modelopt / modelopt_fp8: the checkpoint is NVIDIA ModelOpt FP8 (the Nemotron FP8 releases; refused "
        "on any other). FP8 checkpoints need no flag. Other methods are refused.",
    )
    g.add_argument(
        "--schedule-policy",
        default="fcfs",
        metavar=_listed(SCHEDULE_POLICIES),
        help="The waiting requests' order: fcfs (arrival), lpm (longest cached prefix first), random, or "
        "lof (largest max_new_tokens first), as upstream.",
    )
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument("--disable-overlap-schedule", action="store_true")
    g.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        help="Run the running requests' decode step inside each prefill batch (one token each), so a long "
        "prompt's chunks do not stall them. Off with speculative decoding and PD disaggregation.",
    )
    g.add_argument("--stream-interval", type=int, default=default("stream_interval"))
    g.add_argument(
        "--watchdog-timeout",
        type=float,
        default=default("watchdog_timeout"),
        help="Seconds a forward may take, and the scheduler may stay silent, before the stall is "
        "reported and the server exits with status 1; 0 or less: off.",
    )
    g.add_argument(
        "--gc-threshold",
        type=int,
        nargs="+",
        default=None,
        help="The scheduler process's garbage-collection thresholds (gc.set_threshold: 1 to 3 integers, "
        "generation 0 first); default Python's.",
    )

    add_parallel_cli_args(parser, default)
    add_media_cli_args(parser, default)
    add_frontend_cli_args(parser)
    add_priority_cli_args(parser)
    add_lora_cli_args(parser)

    g = parser.add_argument_group("kernels")
    g.add_argument(
        "--attention-backend",
        default=None,
        metavar=_listed(ATTENTION_BACKEND_CHOICES),
        help="Full-attention kernels: triton (the default on CUDA) or torch_native (torch SDPA, the "
        "default on CPU).",
    )
    g.add_argument(
        "--triton-attention-num-kv-splits",
        type=int,
        default=default("triton_attention_num_kv_splits"),
        help="Splits of each request's key range in the Triton decode attention (run in parallel).",
    )
    g.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="Run every decode eagerly (CUDA graphs are captured only on CUDA, with --attention-backend triton).",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="Largest decode batch replayed from a CUDA graph; default SGLang's by GPU memory (256 on an H100 "
        "or H200), never above the running cap.",
    )
    g.add_argument(
        "--cuda-graph-bs",
        type=int,
        nargs="+",
        default=None,
        help="The decode batch sizes to capture (instead of the sizes up to the max).",
    )
    g.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="Accepted for compatibility; no effect: the forward runs eagerly (torch.compile is not "
        "built; its CPU measurement is in benchmark/README.md).",
    )
    g.add_argument(
        "--torch-compile-max-bs",
        type=int,
        default=default("torch_compile_max_bs"),
        help="Accepted for compatibility; no effect (torch.compile is not used).",
    )

    g = parser.add_argument_group("mamba state cache")
    g.add_argument("--max-mamba-cache-size", type=int, default=None)
    g.add_argument("--mamba-ssm-dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--mamba-full-memory-ratio", type=float, default=default("mamba_full_memory_ratio"))
    g.add_argument(
        "--mamba-scheduler-strategy",
        "--mamba-radix-cache-strategy",
        dest="mamba_scheduler_strategy",
        default="auto",
        choices=MAMBA_SCHEDULER_STRATEGY_CHOICES,
    )
    g.add_argument("--mamba-track-interval", type=int, default=None)
    add_hicache_cli_args(parser)

    g = parser.add_argument_group(
        "prefill/decode disaggregation",
        "A prefill and a decode server behind sglang-router's PD mode: docs/disaggregation.md.",
    )
    g.add_argument("--disaggregation-mode", default="null", choices=DISAGGREGATION_MODES)
    g.add_argument("--disaggregation-transfer-backend", default=default("disaggregation_transfer_backend"))
    g.add_argument(
        "--disaggregation-bootstrap-port", type=int, default=default("disaggregation_bootstrap_port")
    )
    g.add_argument("--disaggregation-decode-extra-slots", type=int, default=None)
    g.add_argument(
        "--disaggregation-decode-enable-radix-cache",
        action="store_true",
        help="Decode side: keep finished requests' KV and state in a radix cache; the prefill server then "
        "transfers only the part of a prompt the decode server does not hold.",
    )
    g.add_argument("--disaggregation-ib-device", default=None)
    g.add_argument(
        "--disaggregation-decode-tp",
        type=int,
        default=None,
        metavar="N",
        help="Prefill side: the decode servers' --tp-size (upstream's flag; optional, since each decode "
        "server's destination carries its own size, which may differ from this server's).",
    )
    g.add_argument(
        "--disaggregation-prefill-allowlist",
        nargs="+",
        default=None,
        metavar="HOST[:PORT]",
        help="Decode side: the prefill servers a request's bootstrap_host may name (host, host:port, "
        "[IPv6]:port or an IP network such as 10.0.0.0/24, space- or comma-separated; hosts as the "
        "router's prefill URLs write them). Others are refused with a 400. Default: loopback only.",
    )

    g = parser.add_argument_group(
        "speculative decoding",
        "NGRAM: drafts from an n-gram cache of every prompt and output seen, verified by the model in "
        "one forward per step; greedy and seeded outputs are the same tokens as without it. Runs without "
        "the overlap schedule; a request with a logit penalty gets no drafts.",
    )
    g.add_argument("--speculative-algorithm", default=None, choices=SPECULATIVE_ALGORITHMS)
    g.add_argument(
        "--speculative-num-steps",
        type=int,
        default=None,
        help="EAGLE / NEXTN: draft steps of the MTP layer per verify (default 3).",
    )
    g.add_argument(
        "--speculative-eagle-topk",
        type=int,
        default=None,
        help="EAGLE / NEXTN: drafts per step; only 1 (one chain) is supported.",
    )
    g.add_argument(
        "--speculative-draft-model-path",
        "--speculative-draft-model",
        default=None,
        help="EAGLE / NEXTN: the draft's weights; only the model itself (its MTP layers), the default.",
    )
    g.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="Tokens per request in a verify forward (its newest token and up to this many minus one "
        "drafts); default --speculative-ngram-max-match-window-size (NGRAM), --speculative-num-steps + 1 "
        "(EAGLE / NEXTN).",
    )
    for name in ("min-match-window-size", "max-match-window-size", "branch-length", "capacity"):
        field_name = "speculative_ngram_" + name.replace("-", "_")
        g.add_argument(f"--speculative-ngram-{name}", type=int, default=default(field_name))
    for name in ("min-bfs-breadth", "max-bfs-breadth"):
        g.add_argument(
            f"--speculative-ngram-{name}",
            type=int,
            default=default("speculative_ngram_" + name.replace("-", "_")),
            help="Accepted for compatibility; no effect (drafts are one chain: breadth 1).",
        )
    g.add_argument(
        "--speculative-ngram-match-type",
        default=default("speculative_ngram_match_type"),
        choices=NGRAM_MATCH_TYPES,
    )


def _listed(values: list[str]) -> str:
    return "{" + ",".join(values) + "}"
