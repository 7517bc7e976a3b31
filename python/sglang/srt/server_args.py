"""`ServerArgs`: every command-line flag, with SGLang's names and defaults, parsed in one place.

Construction validates and resolves the arguments (`__post_init__`): a combination that cannot work
raises `ServerArgsError` with one sentence naming the flag. Derived values are properties.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
from dataclasses import dataclass, field
from functools import cached_property

from sglang.srt.configs.gpu_memory_defaults import (
    gpu_memory_defaults,
    gpu_memory_mib,
    mem_fraction_static_default,
    mtp_graphs_reserve_mib,
)
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.quantization import check_quantization_flag, set_online_quantization
from sglang.srt.mem_cache.mamba_strategy import MambaStrategy
from sglang.srt.server_args_checks import (
    DTYPE_ALIASES,
    ServerArgsError,
    check_basic_flags,
    check_model,
    check_speculative_track_interval,
    check_tokenizer,
    pd_decode_track_interval,
    resolve_auto_parsers,
)
from sglang.srt.server_args_cli import add_cli_args
from sglang.srt.server_args_frontend import FrontendArgs, check_frontend_flags
from sglang.srt.server_args_hicache import HiCacheArgs, check_hicache_flags
from sglang.srt.server_args_lora import LoRAArgs, check_lora_flags
from sglang.srt.server_args_mamba import resolve_mamba_strategy, resolve_pd_decode_cache
from sglang.srt.server_args_media import check_media_flags
from sglang.srt.server_args_parallel import check_parallel_flags
from sglang.srt.server_args_priority import PriorityArgs, check_priority_flags
from sglang.srt.server_args_upstream import add_upstream_cli_args, check_upstream_args
from sglang.srt.speculative.draft_layers import DEFAULT_MTP_STEPS, MTP_ALGORITHMS

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "tiny-qwen3-next-demo"
DEFAULT_TRACK_INTERVAL = 256
DEFAULT_CHUNKED_PREFILL_SIZE = 2048
# Fields whose value is a secret: never returned, logged or printed (see `public_dict`).
SECRET = {"secret": True}
REDACTED = "<redacted>"
# Default request body limit: room for one prompt of the whole context, JSON-escaped (a token is a few
# bytes of text or one integer id), plus the rest of the body.
BODY_BYTES_PER_CONTEXT_TOKEN = 64
BODY_BYTES_BASE = 1 << 20


@dataclass
class ServerArgs(HiCacheArgs, FrontendArgs, PriorityArgs, LoRAArgs):  # (fields of server_args_{hicache,frontend,priority,lora})
    # Model and tokenizer
    model_path: str = DEFAULT_MODEL
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    context_length: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False
    random_seed: int | None = None
    weight_version: str = "default"
    # /release_memory_occupation frees the weights', pools' and graphs' memory (model_executor/
    # memory_occupation.py); the weights' values survive it only with the CPU backup.
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False

    # HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = field(default=None, metadata=SECRET)
    # The management routes' key (utils/auth.py): with it, those routes refuse the user key.
    admin_api_key: str | None = field(default=None, metadata=SECRET)
    enable_metrics: bool = False
    log_level: str = "info"
    log_requests: bool = False
    log_requests_level: int = 2  # upstream's 0-3 (`managers/request_log.py`)
    log_requests_format: str = "text"  # or "json"
    # Upstream's "Decode batch." log line every this many decode batches (`batch_stats_log.py`).
    decode_log_interval: int = 40
    skip_server_warmup: bool = False
    # None: derived from the context length (`request_body_limit`).
    max_request_body_size: int | None = None
    # None: 4,096, or the max running requests where more (`request_validation`).
    max_samples_per_request: int | None = None
    # vLLM's --max-logprobs: most top_logprobs_num / token_ids_logprob ids per position (`logprob_limits`).
    max_logprobs: int = 20
    # Most logprob entries one request may ask for, over its samples (`logprob_limits`).
    max_logprob_entries_per_request: int = 1 << 18
    # Most hidden-state floats one request may ask for (return_hidden_states), over its samples.
    max_hidden_state_floats_per_request: int = 1 << 22
    # Where a chat request's unset sampling fields come from: "model" (the checkpoint's
    # generation_config.json, upstream's default) or "openai" (the API's own defaults).
    sampling_defaults: str = "model"
    # Chat answers' reasoning into `reasoning_content` (parser/reasoning_parser.py).
    reasoning_parser: str | None = None
    # With it: a request that requires reasoning may not end or call a tool while thinking, and its thinking
    # budget is enforced (constrained/reasoning_grammar.py).
    enable_strict_thinking: bool = False
    # Chat answers' tool calls into `tool_calls` (function_call/function_call_parser.py).
    tool_call_parser: str | None = None
    # Constrained decoding (sglang/srt/constrained/): json_schema, regex, ebnf and structural_tag requests.
    grammar_backend: str = "xgrammar"
    # Requests may ask for their positions' final hidden states (return_hidden_states).
    enable_return_hidden_states: bool = False
    # Requests may ask for the experts their positions were routed to (model_executor/routed_experts.py).
    enable_return_routed_experts: bool = False
    # Upstream's expert distribution recorder (model_executor/expert_distribution.py): "stat" or "stat_approx".
    expert_distribution_recorder_mode: str | None = None
    expert_distribution_recorder_buffer_size: int | None = None  # steps kept (None: 1,000; -1: one sum)
    # Requests may carry a custom logit processor (sampling/custom_logit_processor.py): its code runs here.
    enable_custom_logit_processor: bool = False
    # Unsigned ones (no SGLANG_LOGIT_PROCESSOR_SECRET) from beyond this machine: refused at start unless set.
    allow_unsigned_custom_logit_processor: bool = False
    constrained_json_whitespace_pattern: str | None = None
    constrained_json_disable_any_whitespace: bool = False

    # Memory and scheduling
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    max_prefill_tokens: int = 16384
    # None: 2048 on CPU, on CUDA SGLang's for the GPU's memory (`_handle_gpu_memory_settings`), rounded
    # to the mamba cache chunk; -1 (or 0): chunked prefill off.
    chunked_prefill_size: int | None = None
    page_size: int = 1
    # "auto": the model's dtype; see KV_CACHE_DTYPE_CHOICES.
    kv_cache_dtype: str = "auto"
    # "fp8": an unquantized checkpoint's linears quantized block-wise at load (layers/quantization);
    # "modelopt" / "modelopt_fp8": the checkpoint must be NVIDIA ModelOpt FP8 (`modelopt.py`).
    quantization: str | None = None
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    # The running requests' decode step rides in each prefill batch (managers/scheduler_components/mixed_chunk.py).
    enable_mixed_chunk: bool = False
    stream_interval: int = 1
    watchdog_timeout: float = 300.0
    # The scheduler process's `gc.set_threshold` (1 to 3 generation thresholds); None: Python's.
    gc_threshold: list[int] | None = None

    # Parallelism (`server_args_parallel.py`, docs/parallelism.md)
    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    load_balance_method: str = "round_robin"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: int | None = None
    enable_dp_attention: bool = False

    # Kernels. None: triton on CUDA, torch_native on CPU.
    attention_backend: str | None = None
    triton_attention_num_kv_splits: int = 8
    disable_cuda_graph: bool = False
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    # None: on CUDA SGLang's for the GPU's memory (160 where unknown), never above the running cap;
    # `cuda_graph_bs` (sizes to capture) overrides it.
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] | None = None

    # Mamba state cache
    max_mamba_cache_size: int | None = None
    mamba_ssm_dtype: str | None = None
    mamba_full_memory_ratio: float = 0.9
    mamba_scheduler_strategy: str = "auto"
    # None: 256, rounded up to a multiple of the mamba cache chunk.
    mamba_track_interval: int | None = None

    # Prefill / decode disaggregation
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_decode_extra_slots: int | None = None
    # Decode side: keep finished requests' KV and state in a radix cache and tell the prefill server how
    # much of a prompt it holds, so only the rest moves (upstream's flag; off by default, as upstream).
    disaggregation_decode_enable_radix_cache: bool = False
    disaggregation_ib_device: str | None = None
    # Prefill side: the decode servers' --tp-size, as upstream's RL frameworks pass it (optional here: each
    # destination carries its own rank count; recorded for the prefill side to check a destination against).
    disaggregation_decode_tp: int | None = None
    # Decode side: the prefill servers (host[:port] or IP network) a request's bootstrap_host may name;
    # None: loopback only.
    disaggregation_prefill_allowlist: list[str] | None = None

    # Media (`server_args_media.py`, docs/multimodal.md): what image_data may make the server read.
    allowed_local_media_path: str | None = None
    # None: server_args_media.DEFAULT_MEDIA_LIMITS (resolved to a dict by `check_media_flags`).
    limit_mm_data_per_request: dict | None = None
    allowed_media_domains: list[str] | None = None
    media_url_max_file_size_mb: int = 64
    disable_media_url_fetch: bool = False

    # Speculative decoding (`speculative/`): NGRAM drafts, or EAGLE / NEXTN drafts of the checkpoint's
    # MTP layers, verified by the model in one forward.
    speculative_algorithm: str | None = None
    # EAGLE / NEXTN: draft steps per verify (None: DEFAULT_MTP_STEPS), drafts per step (None: 1), the
    # draft's weights (None: the model's own MTP layers).
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_draft_model_path: str | None = None
    # Tokens per request in a verify forward: its newest token and up to this many minus one drafts.
    # None: --speculative-ngram-max-match-window-size, as upstream.
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_branch_length: int = 18
    speculative_ngram_capacity: int = 10_000_000

    # Filled by __post_init__: why `auto` resolved as it did (logged, shown in /get_server_info).
    mamba_strategy_reason: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        check_basic_flags(self)
        check_parallel_flags(self)
        check_media_flags(self)
        check_frontend_flags(self)
        check_priority_flags(self)
        refused = check_quantization_flag(self.quantization)
        if refused:
            raise ServerArgsError(refused)
        if self.device == "auto":
            self.device = _auto_device()
        if self.random_seed is None:
            self.random_seed = random.randint(0, 2**30)
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        check_model(self)
        check_tokenizer(self)
        resolve_auto_parsers(self)
        self._handle_attention_backend()
        resolve_pd_decode_cache(self)
        self._handle_speculative()
        resolve_mamba_strategy(self)
        check_hicache_flags(self)
        # Resolved once; components read it, not the flags (`mem_cache/mamba_strategy.py`).
        self.mamba_strategy = MambaStrategy.resolve(
            self.mamba_scheduler_strategy,
            radix_cache=not self.disable_radix_cache,
            overlap=self.enable_overlap_schedule,
            cache_chunk_size=self.mamba_cache_chunk_size,
        )
        self._handle_chunk_aligned_sizes(self._handle_gpu_memory_settings())
        check_speculative_track_interval(self)
        check_lora_flags(self)

    def public_dict(self) -> dict:
        """Every field, with secrets redacted: what /get_server_info returns and what a log may show."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = REDACTED if f.metadata.get("secret") and value is not None else value
        return out

    def __repr__(self) -> str:
        fields_ = ", ".join(f"{k}={v!r}" for k, v in self.public_dict().items())
        return f"ServerArgs({fields_})"

    # ---- derived values --------------------------------------------------------------------------

    @cached_property
    def model_config(self) -> ModelConfig:
        config = ModelConfig(self.model_path, self.context_length, self.dtype, self.device, self.kv_cache_dtype)
        if self.quantization is not None:
            set_online_quantization(config.hf_config, self.quantization)
        return config

    @property
    def mamba_radix_cache_strategy(self) -> str:
        """Upstream's newer name for the same setting."""
        return self.mamba_scheduler_strategy

    @property
    def enable_overlap_schedule(self) -> bool:
        return not self.disable_overlap_schedule

    def enable_mamba_extra_buffer(self) -> bool:
        return self.mamba_strategy.extra_buffer

    @property
    def mamba_cache_chunk_size(self) -> int:
        """Where checkpoints may sit: max(model kernel chunk, page size); one divides the other when
        checkpoints are taken at all (not with the radix cache disabled)."""
        chunk = self.model_config.arch.kernel_state_chunk
        big, small = max(chunk, self.page_size), min(chunk, self.page_size)
        if big % small != 0 and not self.disable_radix_cache:
            raise ServerArgsError(
                f"--page-size {self.page_size} and the model's state chunk {chunk} must divide one another."
            )
        return big

    @property
    def request_body_limit(self) -> int:
        """Bytes a request body may have (HTTP 413 above)."""
        if self.max_request_body_size is not None:
            return self.max_request_body_size
        return BODY_BYTES_BASE + BODY_BYTES_PER_CONTEXT_TOKEN * self.model_config.context_len

    @property
    def cuda_graph_enabled(self) -> bool:
        """Decode replays CUDA graphs: on CUDA, unless --disable-cuda-graph, with the Triton attention
        (the torch-native one sizes its decode from host lengths, which a graph would freeze)."""
        return self.device == "cuda" and not self.disable_cuda_graph and self.attention_backend == "triton"

    @property
    def watchdog_seconds(self) -> float | None:
        """--watchdog-timeout as the scheduler and the health check use it: None when off (0 or less)."""
        return self.watchdog_timeout if self.watchdog_timeout and self.watchdog_timeout > 0 else None

    @property
    def tp_size_per_node(self) -> int:
        """Tensor-parallel ranks (scheduler processes) each node runs."""
        return self.tp_size // self.nnodes

    @property
    def chunked_prefill_enabled(self) -> bool:
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0

    # ---- validation and resolution ------------------------------------------------------------

    def _handle_attention_backend(self) -> None:
        """Full attention: our Triton kernels on CUDA, torch's SDPA on CPU; Triton on a CPU only for
        tests, under TRITON_INTERPRET=1."""
        if self.attention_backend is None:
            self.attention_backend = "triton" if self.device == "cuda" else "torch_native"
        if self.attention_backend != "triton":
            return
        if self.device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise ServerArgsError(
                "--attention-backend triton needs --device cuda (on a CPU its kernels run only under "
                "TRITON_INTERPRET=1, for tests); use --attention-backend torch_native."
            )
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise ServerArgsError(
                f"--attention-backend triton needs the triton package, which cannot be imported ({e})."
            ) from None
        if self.device == "cuda" and self.kv_cache_dtype == "fp8_e4m3":
            import torch

            # Triton has e4m3fn (`fp8e4nv`) from compute capability 8.9 (Ada, Hopper); e5m2 from 8.0.
            major, minor = torch.cuda.get_device_capability()
            if (major, minor) < (8, 9):
                raise ServerArgsError(
                    "--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer with the "
                    f"triton attention backend (this one is {major}.{minor}); use fp8_e5m2 or bf16."
                )

    def _handle_speculative(self) -> None:
        """NGRAM verifies on the scheduler's host results, so it runs without the overlap schedule (as
        upstream's); its draft count defaults to the longest match window. Neither it nor PD mixes
        decode steps into prefill batches (`--enable-mixed-chunk` off with a log line, as upstream)."""
        if self.enable_mixed_chunk and self.speculative_algorithm is not None:
            logger.warning("Mixed chunked prefill is disabled because of using speculative decoding.")
            self.enable_mixed_chunk = False
        if self.enable_mixed_chunk and self.disaggregation_mode != "null":
            logger.warning("Mixed chunked prefill is disabled on a --disaggregation-mode server.")
            self.enable_mixed_chunk = False
        if self.speculative_algorithm is None:
            return
        if self.speculative_algorithm in MTP_ALGORITHMS:
            # One chain of drafts (topk 1): the newest token and one per draft step.
            if self.speculative_num_steps is None:
                self.speculative_num_steps = DEFAULT_MTP_STEPS
            if self.speculative_eagle_topk is None:
                self.speculative_eagle_topk = 1
            if self.speculative_num_draft_tokens is None:
                self.speculative_num_draft_tokens = self.speculative_num_steps + 1
            if self.speculative_draft_model_path is None:
                self.speculative_draft_model_path = self.model_path
        if self.speculative_num_draft_tokens is None:
            self.speculative_num_draft_tokens = self.speculative_ngram_max_match_window_size
        if self.enable_overlap_schedule:
            algo = self.speculative_algorithm
            logger.info("--speculative-algorithm %s runs without the overlap schedule.", algo)
            self.disable_overlap_schedule = True

    def _handle_gpu_memory_settings(self) -> int:
        """On CUDA, SGLang's GPU-memory defaults (`configs/gpu_memory_defaults.py`) for what is not given:
        sets `--cuda-graph-max-bs` (unless `--cuda-graph-bs` lists the sizes) and `--mem-fraction-static`,
        and returns the default `--chunked-prefill-size` (which `_handle_chunk_aligned_sizes` aligns and
        takes where the flag is not given); elsewhere returns DEFAULT_CHUNKED_PREFILL_SIZE."""
        wants_graph_bs = self.cuda_graph_max_bs is None and not self.cuda_graph_bs
        given = self.chunked_prefill_size is not None and self.mem_fraction_static is not None
        if self.device != "cuda" or (given and not wants_graph_bs):
            return DEFAULT_CHUNKED_PREFILL_SIZE
        memory = gpu_memory_mib()
        defaults = gpu_memory_defaults(memory)
        if wants_graph_bs:
            self.cuda_graph_max_bs = defaults.cuda_graph_max_bs
        if self.mem_fraction_static is None and memory is not None:
            chunk = self.chunked_prefill_size
            chunk = defaults.chunked_prefill_size if chunk is None else chunk
            prefill_tokens = chunk if chunk > 0 else self.max_prefill_tokens  # 0 and -1: no chunking
            # The graphs captured: the listed sizes where given (they win over the largest size).
            graph_bs = max(self.cuda_graph_bs) if self.cuda_graph_bs else self.cuda_graph_max_bs
            graph_bs = graph_bs if self.cuda_graph_enabled else 0
            mtp = mtp_graphs_reserve_mib(self, graph_bs)  # (EAGLE / NEXTN: the MTP layer's graphs)
            self.mem_fraction_static = mem_fraction_static_default(memory, prefill_tokens, graph_bs, mtp)
        logger.info(
            "GPU memory %s: defaults --chunked-prefill-size %d, --cuda-graph-max-bs %d, --mem-fraction-static "
            "%s (SGLang's for this memory; given flags win).",
            "unknown" if memory is None else f"{memory / 1024:.1f} GiB", defaults.chunked_prefill_size,
            defaults.cuda_graph_max_bs, self.mem_fraction_static,
        )  # fmt: skip
        return defaults.chunked_prefill_size

    def _handle_chunk_aligned_sizes(self, default_chunked_prefill_size: int) -> None:
        """Prefill chunks of the extra-buffer modes must be multiples of the cache chunk C: a prompt's
        chunks then keep the snapshot lattice of its first extend. Their decode track interval must be a
        multiple of the page size (upstream's rule), so that a decode snapshot ends on a page; it need not
        be one of C, since an extend from any hit snapshots on its own lattice (see mamba_tracking)."""
        c = self.mamba_cache_chunk_size
        aligned = self.enable_mamba_extra_buffer()
        if self.chunked_prefill_size == 0:
            self.chunked_prefill_size = -1
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = max(c, default_chunked_prefill_size // c * c)
        elif aligned and self.chunked_prefill_size > 0 and self.chunked_prefill_size % c:
            raise ServerArgsError(
                f"--chunked-prefill-size {self.chunked_prefill_size} must be a multiple of the mamba cache "
                f"chunk size {c} with --mamba-scheduler-strategy {self.mamba_scheduler_strategy}."
            )
        if self.mamba_track_interval is None:
            self.mamba_track_interval = pd_decode_track_interval(self) or -(-DEFAULT_TRACK_INTERVAL // c) * c
        elif aligned and self.mamba_track_interval % self.page_size:
            raise ServerArgsError(
                f"--mamba-track-interval {self.mamba_track_interval} must be a multiple of --page-size "
                f"{self.page_size} with --mamba-scheduler-strategy {self.mamba_scheduler_strategy}."
            )

    # ---- argparse --------------------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_cli_args(parser, ServerArgs.__dataclass_fields__)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls) if f.init and f.name != "mamba_strategy_reason"}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def __getstate__(self) -> dict:
        # The model config (HF config object) is rebuilt where it is needed.
        state = dict(self.__dict__)
        state.pop("model_config", None)
        return state


def prepare_server_args(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    add_upstream_cli_args(parser)
    args = parser.parse_args(argv)
    check_upstream_args(args)
    return ServerArgs.from_cli_args(args)


def _auto_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
