"""Typed registry of the `SGLANG_*` environment variables the runtime reads.

Every variable is declared once here with its type and default, and read through `envs.NAME.get()`.
Tests change one with `with envs.NAME.override(value): ...`, which writes `os.environ` so that
subprocesses started inside the block (scheduler, server) see the same value.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class EnvVar(Generic[T]):
    """One environment variable with a type and a default."""

    def __init__(self, default: T, doc: str = ""):
        self.default = default
        self.doc = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, objtype: type | None = None) -> EnvVar[T]:
        return self

    def parse(self, raw: str) -> T:
        raise NotImplementedError

    def format(self, value: T) -> str:
        return str(value)

    def is_set(self) -> bool:
        return self.name in os.environ

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"Environment variable {self.name}={raw!r} is invalid: {e}") from None

    def set(self, value: T | None) -> None:
        if value is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.format(value)

    @contextmanager
    def override(self, value: T | None) -> Iterator[None]:
        old = os.environ.get(self.name)
        self.set(value)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(self.name, None)
            else:
                os.environ[self.name] = old


class EnvBool(EnvVar[bool]):
    def parse(self, raw: str) -> bool:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError("expected a boolean (1/0, true/false)")

    def format(self, value: bool) -> str:
        return "1" if value else "0"


class EnvInt(EnvVar[int]):
    def parse(self, raw: str) -> int:
        return int(raw.strip())


class EnvFloat(EnvVar[float]):
    def parse(self, raw: str) -> float:
        return float(raw.strip())


class EnvStr(EnvVar[str]):
    def parse(self, raw: str) -> str:
        return raw


class EnvOptStr(EnvVar["str | None"]):
    def parse(self, raw: str) -> str | None:
        return raw or None


class Envs:
    # Paths
    SGLANG_CACHE_DIR = EnvOptStr(None, "Where tiny presets are generated (default ~/.cache/sglang).")
    SGLANG_CPROFILE_DIR = EnvOptStr(None, "Write a cProfile of the scheduler process here (utils/host_profile.py).")
    # /start_profile (managers/profile_request.py): where traces go; an output_dir must be inside it.
    SGLANG_TORCH_PROFILER_DIR = EnvStr("/tmp", "Where /start_profile writes traces (output_dir: inside it).")
    # Log each Triton kernel a process uses for the first time, compiled or loaded from the disk cache
    # (utils/triton_first_use.py; benchmark/bench_server_startup.py counts those after ready).
    SGLANG_LOG_TRITON_FIRST_USE = EnvBool(False, "Log each Triton kernel's first use in a process.")
    SGLANG_PROFILE_WITH_STACK = EnvBool(True, "/start_profile's with_stack where the request does not say.")
    SGLANG_PROFILE_RECORD_SHAPES = EnvBool(False, "/start_profile's record_shapes where the request does not say.")
    SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR = EnvStr("/tmp", "Where /dump_expert_distribution_record writes.")
    SGLANG_PROFILE_MAX_STEPS = EnvInt(2_000, "The most batches one profile traces (it grows in memory with each).")
    SGLANG_MAX_THINK_TOKENS = EnvInt(-1, "--enable-strict-thinking's thinking budget where a request sets none (-1: none).")
    # Sessions (managers/session_controller.py): what all open sessions may hold in the HTTP process.
    SGLANG_MAX_OPEN_SESSIONS = EnvInt(1_024, "The most sessions open at once (/open_session).")
    SGLANG_SESSION_MAX_REQUESTS = EnvInt(65_536, "The most requests all open sessions keep.")
    SGLANG_SESSION_MAX_TOKENS = EnvInt(1 << 24, "The most token ids all open sessions keep (4 bytes each).")
    SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR = EnvStr(
        "/tmp/hicache", "The disk tier of --hicache-storage-backend file (mem_cache/disk_tier.py)."
    )
    SGLANG_HICACHE_FILE_BACKEND_MAX_GB = EnvFloat(
        16.0, "The most GB the disk tier of --hicache-storage-backend file keeps; LRU entries go past it."
    )
    SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE = EnvStr(
        "1Gi", "The free space the disk tier never takes its filesystem below (10G, 1Gi, bytes; 0: no floor)."
    )
    # Upstream's file backend's names (mem_cache/disk_budget.py, tree_cache_factory._file_storage).
    SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE = EnvOptStr(
        None, "Upstream's budget of the disk tier (200G, 1Gi, bytes; 0: no cap); instead of ..._MAX_GB."
    )
    SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO = EnvFloat(
        0.9, "Past the disk tier's budget, LRU entries go until it holds this share of it, the write included."
    )
    SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE = EnvBool(
        False, "Upstream's lookup cache; accepted: the disk tier's index is always in memory."
    )
    SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL = EnvFloat(
        5.0, "Upstream's lookup cache's TTL; accepted: a file lost is noticed at its read."
    )

    # Loading: threads that read the checkpoint ahead of the loader (models/checkpoint_reader.py).
    SGLANG_WEIGHT_READ_THREADS = EnvInt(8, "Threads reading checkpoint shards ahead of the loader; 1: serial.")
    # The shape warm-up before ready (entrypoints/server_warmup.py): auto = on CUDA, where kernels compile.
    SGLANG_SHAPE_WARMUP = EnvStr("auto", "Shape warm-up before ready: auto (on CUDA), on or off.")

    # Mamba state dtypes (upstream names). --mamba-ssm-dtype writes SGLANG_MAMBA_SSM_DTYPE.
    SGLANG_MAMBA_CONV_DTYPE = EnvOptStr(None, "Conv state dtype; default: the model dtype.")
    SGLANG_MAMBA_SSM_DTYPE = EnvOptStr(None, "SSM state dtype; default: model config, else float32.")

    # State-copy ops of MambaPool (copy, clear, decode track copy): auto picks the fastest one that runs
    # per device (state_copy/__init__.py: CPU cpp, else torch; CUDA cuda where its build is cached, else
    # triton, else cuda, else torch); a name forces it.
    SGLANG_MAMBA_STATE_COPY_BACKEND = EnvStr(
        "auto", "State-copy implementation: auto, torch, cpp, triton or cuda (docs/state_management.md)."
    )

    # Decode step of the Gated DeltaNet / Mamba2 layers (conv update included): auto = the Triton kernels
    # in place on the pool on CUDA, the C++ ops on CPU (SGLANG_CPU_LINEAR_ATTN_BACKEND), else the torch
    # step; torch forces the torch step (debugging); triton forces the kernels (on CPU they need
    # TRITON_INTERPRET=1, for tests).
    SGLANG_GDN_DECODE_BACKEND = EnvStr("auto", "Gated DeltaNet decode step: auto, torch or triton.")
    SGLANG_MAMBA2_DECODE_BACKEND = EnvStr("auto", "Mamba2 decode step: auto, torch or triton.")
    # Extend (prefill) of the Gated DeltaNet layers: auto = flash-linear-attention's chunked kernels over
    # the whole variable-length batch on CUDA where FLA is installed, else the per-request torch form (or
    # the C++ op on CPU); torch forces that; fla requires FLA; torch_varlen runs the batched path with
    # FLA's torch twin (tests).
    SGLANG_GDN_EXTEND_BACKEND = EnvStr("auto", "Gated DeltaNet extend: auto, torch, fla or torch_varlen.")
    # The same for the Mamba2 layers' SSD (FLA's simple-GLA kernels; auto only where the model's chunk
    # size is a multiple of FLA's 64).
    SGLANG_MAMBA2_EXTEND_BACKEND = EnvStr("auto", "Mamba2 extend: auto, torch, fla or torch_varlen.")
    # CPU ops of the linear-attention layers (conv, GDN and Mamba2, decode and extend): auto = the
    # sgl-kernel C++ ops where built, else torch; torch forces the torch path; cpp requires the C++ ops.
    SGLANG_CPU_LINEAR_ATTN_BACKEND = EnvStr("auto", "CPU linear-attention ops: auto, torch or cpp.")
    # CPU decode of the full-attention layers: auto = the sgl-kernel C++ op that reads the paged KV in place
    # where built, else SDPA over a gathered copy; torch forces SDPA; cpp requires the C++ op.
    SGLANG_CPU_ATTN_BACKEND = EnvStr("auto", "CPU full-attention decode: auto, torch or cpp.")
    # CPU routed experts of small MoE layers at decode sizes, with the layer's shared expert, and the top-k
    # routing: auto = the sgl-kernel C++ ops where built (and the experts small enough, `moe/experts.py`),
    # else torch's grouped GEMMs and routing ops; torch forces those.
    SGLANG_CPU_MOE_BACKEND = EnvStr("auto", "CPU MoE experts and routing: auto, torch or cpp.")
    # CPU RMSNorms (plain and gated) of float32 activations: auto = one sgl-kernel C++ call where built,
    # else the torch ops; torch forces those.
    SGLANG_CPU_NORM_BACKEND = EnvStr("auto", "CPU RMSNorm: auto, torch or cpp.")
    # RMSNorms on a GPU: auto = one Triton kernel per norm (layers/rmsnorm_triton.py) for weights on
    # CUDA; torch forces the torch ops; triton forces the kernel on any device (on CPU it needs
    # TRITON_INTERPRET=1, for tests).
    SGLANG_GPU_NORM_BACKEND = EnvStr("auto", "GPU RMSNorm: auto, torch or triton.")
    # Rotary embedding of q and k on a GPU, the same choices: one Triton launch (layers/rotary_triton.py).
    SGLANG_GPU_ROPE_BACKEND = EnvStr("auto", "GPU rotary embedding: auto, torch or triton.")
    # Elementwise steps outside the MoE on a GPU: auto = one Triton launch each on CUDA (Qwen3-Next's
    # attention output gate, `out * sigmoid(gate)`: layers/attention/triton_ops/output_gate.py).
    SGLANG_GPU_ELEMENTWISE_BACKEND = EnvStr("auto", "GPU elementwise steps: auto, torch or triton.")
    # MoE on a GPU, the same choices: Qwen3-Next's softmax top-k in one Triton launch
    # (layers/moe/routing_triton.py) and the token bookkeeping around the grouped GEMMs in three
    # (layers/moe/dispatch_triton.py); auto on CUDA also runs the bf16 / fp16 experts' GEMMs of decode
    # batches (up to 256 tokens) as fused Triton grouped GEMMs (layers/moe/fused_moe_triton.py; faster
    # there on an H200, slower at prefill chunks); triton: the same on any device; triton_fused: the
    # fused GEMMs at every size; triton_grouped: the grouped_mm GEMMs at every size (the old default).
    SGLANG_GPU_MOE_BACKEND = EnvStr(
        "auto", "GPU MoE routing and dispatch: auto, torch, triton, triton_fused or triton_grouped."
    )
    # Linears of one input as one GEMM where they stack (layers/stacked_linears.py): Qwen3-Next's GDN input
    # projections, and its MoE router with the shared expert's gate where the fused GEMMs run that expert
    # (layers/moe/shared_routing.py: one routing launch appends it). False: each its own GEMM (timing).
    SGLANG_STACK_LINEARS = EnvBool(True, "Run linears of one input as one GEMM where they stack.")
    # `python -m sglang.launch_server` spawns its children before it checks the flags (entrypoints/
    # prestart.py, which reads this from os.environ itself: it runs before this module is imported).
    SGLANG_PRESTART_CHILDREN = EnvBool(True, "Spawn the server's children before the flags' checks.")
    # Extend (prefill) attention of the Triton backend on CUDA: auto = torch's FlashAttention-2 varlen
    # kernel where it applies (layers/attention/flash_extend.py), else the Triton kernel; triton: always
    # the Triton kernel; flash: required (a GPU without it is a startup error).
    SGLANG_EXTEND_ATTENTION_BACKEND = EnvStr("auto", "Extend attention on CUDA: auto, triton or flash.")
    # The dense block-FP8 GEMM on CUDA: auto / triton = the Triton kernel (layers/quantization/fp8_kernel.py);
    # cublas = torch._scaled_mm with block-wise scales where it runs (fp8_scaled_mm.py; probed at load).
    SGLANG_FP8_GEMM_BACKEND = EnvStr("auto", "Block-FP8 dense GEMM on CUDA: auto, triton or cublas.")
    # Routed experts of a block-FP8 checkpoint (or --quantization fp8): auto = kept FP8 on CUDA (1 byte a
    # weight, `fused_moe_fp8_triton.py`), dequantized at load elsewhere; fp8 keeps them FP8 on any device
    # (on CPU the kernels' torch twin runs them: tests); dequantize dequantizes them everywhere.
    SGLANG_FP8_EXPERTS = EnvStr("auto", "Block-FP8 routed experts: auto, fp8 or dequantize.")
    # The quantizable linears of such a checkpoint: auto = `Fp8BlockLinear`s on CUDA (the block GEMM),
    # dequantized at load elsewhere; fp8 keeps them FP8 on any device (on CPU each forward dequantizes
    # the weight: tests of CUDA's layout, its stacks and the FP8 shared expert); dequantize everywhere.
    SGLANG_FP8_LINEARS = EnvStr("auto", "Block-FP8 linears: auto, fp8 or dequantize.")
    # CPU rotary embedding of float32 q/k: auto = one sgl-kernel C++ call where built, else the torch ops.
    SGLANG_CPU_ROPE_BACKEND = EnvStr("auto", "CPU rotary embedding: auto, torch or cpp.")
    # CPU sampling of float32 logits (with or without top-k / top-p / min-p cuts): auto = one sgl-kernel
    # C++ call where built, else the torch ops (`layers/sampler.py`).
    SGLANG_CPU_SAMPLING_BACKEND = EnvStr("auto", "CPU sampling: auto, torch or cpp.")
    # Input logprobs: the logits and log_softmax of this many positions at a time (upstream's name and
    # default; upstream chunks only with SGLANG_ENABLE_LOGITS_PROCESSER_CHUNK, here always).
    SGLANG_LOGITS_PROCESSER_CHUNK_SIZE = EnvInt(2048, "Input logprobs: positions whose logits exist at once.")
    # CPU decode: each decoder block (its norm, mixer or MoE and residual add) as one sgl-kernel call
    # (`layers/decode_blocks.py`) where every part of it would run its own C++ op; 0 calls the parts one
    # by one (the same arithmetic, for debugging and A/B runs).
    SGLANG_CPU_DECODE_BLOCKS = EnvBool(True, "CPU decode: each decoder block as one sgl-kernel call.")
    # The forward stream on CPU runs on the scheduler thread (`forward_worker.py`); set, on a thread of its
    # own as on CUDA (the overlap-race tests hold that thread to keep a batch in flight).
    SGLANG_CPU_FORWARD_THREAD = EnvBool(
        False, "On CPU, run the forward stream on a thread of its own, not on the scheduler thread."
    )

    # The sgl-kernel CPU ops' baseline (SSE2) twins instead of their AVX2 + FMA ones, to test the code a
    # CPU without AVX2 runs (read by the C++ ops at every call).
    SGLANG_TEST_CPU_OPS_BASELINE = EnvBool(False, "Run the CPU ops' baseline twins, not the AVX2 ones.")

    # Fault injection for extra_buffer_lazy: 1 = the first allocation try at a decode track boundary
    # fails (evict-and-retry then runs for real); 2 = the retry fails as well (the snapshot is skipped).
    SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL = EnvInt(0, "Lazy snapshot-slot allocation failure injection (0/1/2).")
    # Negative controls: switch a cache path off so that the test of that path must fail.
    SGLANG_TEST_SKIP_DEFERRED_COW = EnvBool(
        False, "Do not copy the checkpoint into the running slot on a hit."
    )
    SGLANG_TEST_SKIP_DEFERRED_CLEAR = EnvBool(False, "Do not zero a fresh running slot before its extend.")
    SGLANG_TEST_SKIP_LAZY_SNAPSHOT_WRITE = EnvBool(
        False, "extra_buffer_lazy: hand decode snapshot slots to the tree without writing the state into them."
    )
    SGLANG_TEST_COW_ON_SCHEDULER_THREAD = EnvBool(
        False, "Run deferred clear/copy on the scheduler thread instead of the forward stream."
    )
    SGLANG_TEST_SKIP_CACHE_HIT_ASSERT = EnvBool(False, "Kits do not require every prompt to hit.")
    SGLANG_TEST_FORWARD_DELAY_MS = EnvFloat(0.0, "Sleep this long in the forward worker before each batch.")
    # The decode fast path off (`DecodeFastPath`: the decode set's certificates, the rows cache, the KV and
    # token logs): every decode step selects, builds and commits in full, so the tests can check that
    # the fast path changes no output (test/unit/scheduler/test_decode_fast_path_off.py).
    SGLANG_TEST_DISABLE_DECODE_FAST_PATH = EnvBool(
        False, "Run every decode step without the decode fast path's caches and logs."
    )

    # Constrained decoding (upstream's name; seconds): a grammar still compiling after this long ends its
    # request with a 400 (its compile thread finishes it and is free again then).
    SGLANG_GRAMMAR_TIMEOUT = EnvFloat(300.0, "Abort a request whose grammar compiles longer than this.")
    # Seconds of the scheduler thread a request's grammar accept, mask fill and stop_regex search may take
    # for one token, and all requests' together per step (constrained/output_check_budget.py has the
    # rule): over them the costliest requests end with a 400 (0 or less: no limit). Sane checks take
    # microseconds.
    SGLANG_OUTPUT_CHECK_BUDGET_PER_REQ = EnvFloat(
        0.05, "A request whose grammar and stop_regex checks take longer for one token ends with a 400."
    )
    SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP = EnvFloat(
        0.2, "All requests' grammar and stop_regex checks per step: over it the costliest ones end."
    )
    # Custom logit processors (upstream's name): with a secret set, `CustomLogitProcessor.to_str()` signs
    # its payload (HMAC-SHA256) and the scheduler loads only payloads signed with the same secret.
    SGLANG_LOGIT_PROCESSOR_SECRET = EnvStr("", "Sign and require signed custom logit processor payloads.")

    # Media (this server's): the decoded bytes the images and videos being decoded at once may hold, over
    # all requests (multimodal/media_pool.py, docs/multimodal.md).
    SGLANG_MEDIA_MEMORY_MB = EnvInt(2048, "MiB of decoded images and video frames in flight, all requests.")

    # Request deadlines (upstream names; seconds, 0 or less = off): a request still waiting, or still
    # running after its first forward, past its limit is aborted with HTTP 503.
    SGLANG_REQ_WAITING_TIMEOUT = EnvFloat(-1.0, "Abort requests that waited this long for admission.")
    SGLANG_REQ_RUNNING_TIMEOUT = EnvFloat(-1.0, "Abort requests running this long since their first forward.")

    # Prefill/decode disaggregation (upstream names; seconds). The prefill server waits this long for a
    # decode server to send a room's destination; the decode server waits this long for the transfer.
    SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT = EnvFloat(
        300.0, "Prefill side: abort a request whose decode server sent no destination in this time."
    )
    SGLANG_DISAGGREGATION_WAITING_TIMEOUT = EnvFloat(
        300.0, "Decode side: abort a request whose prefill server transferred nothing in this time."
    )
    SGLANG_DISAGGREGATION_STAGING = EnvBool(
        False, "Both PD servers: stage KV and state through host buffers (tests the staged path on CPU)."
    )
    # The staged path's buffers (upstream's names; MiB, fractions allowed): the most one request moves
    # through a staging range at once (the prefill server's whole buffer), and the decode server's buffer.
    SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB = EnvFloat(
        256.0, "Both PD servers: the staging chunk, the prefill server's staging buffer (MiB)."
    )
    SGLANG_DISAGG_STAGING_POOL_SIZE_MB = EnvFloat(
        1024.0, "Decode side: the staging buffer shared by the transfers in flight (MiB)."
    )
    SGLANG_TEST_DISAGGREGATION_FAIL_TRANSFER = EnvOptStr(
        None, "Prefill side: the transfer of each request whose rid starts with this fails (fault injection)."
    )
    SGLANG_TEST_DISAGGREGATION_ZERO_DRAFT_STASH = EnvBool(
        False, "Prefill side: the MTP draft state sent with each first token is zeros (a test's negative control)."
    )
    # The secret both PD servers sign their control messages with (HMAC-SHA256); without it a server
    # on a non-loopback --host refuses to start unless told its network is isolated.
    SGLANG_DISAGGREGATION_SECRET = EnvStr("", "Sign PD control messages and drop unsigned ones (both servers).")
    SGLANG_DISAGGREGATION_ALLOW_UNAUTHENTICATED = EnvBool(
        False, "Start a PD server on a non-loopback --host without SGLANG_DISAGGREGATION_SECRET."
    )
    SGLANG_DISAGGREGATION_MAX_UNMATCHED_ROOMS = EnvInt(
        1024, "Prefill side: destinations held at once for requests this server has not received yet."
    )

    # HTTP: a client gets this long to send a request head or the next piece of a body.
    SGLANG_HTTP_READ_TIMEOUT = EnvFloat(
        30.0, "Seconds before a stalled or idle-before-request connection closes."
    )

    # EAGLE / NEXTN: a draft batch with a sampling request replays the greedy draft-loop CUDA graph
    # (`speculative/mtp_graphs.py`) unless this is set; then it runs the eager loop, whose sampled drafts
    # are accepted more often at high temperatures (docs/server.md, "CUDA graphs" of EAGLE / NEXTN).
    SGLANG_MTP_EAGER_SAMPLED_DRAFTS = EnvBool(
        False, "NEXTN: draft batches with a sampling request run the eager loop (sampled drafts), not a graph."
    )

    # Checks
    # Off in production (the walk over every page and node is long with large pools); the test
    # suite turns it on (test/conftest.py). Without it, going idle runs the O(1) count check.
    SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE = EnvBool(
        False, "Run the full check_integrity() walk when the scheduler goes idle."
    )

    # Tensor parallelism: the ranks take one sampled token per row (upstream's name; on by itself where a
    # grammar or a custom logit processor acts, as those run on each rank's own).
    SYNC_TOKEN_IDS_ACROSS_TP = EnvBool(False, "TP ranks all-reduce each step's sampled tokens (MIN).")
    # Off in production (one all-reduce per step); the test suite turns it on (test/conftest.py).
    SGLANG_ENABLE_STRICT_TP_TOKEN_CHECK = EnvBool(
        False, "TP ranks compare each step's sampled tokens and all stop, naming the row, where they differ."
    )

    def all(self) -> list[EnvVar]:
        return [v for v in vars(type(self)).values() if isinstance(v, EnvVar)]


envs = Envs()

# The variables every TP rank of one server must read alike: `TpBroadcast.check_same_flags` compares them
# across the nodes at start, with the flags, and refuses to start naming the first that differs. Each is
# read by every rank on its own and decides a collective, or something the ranks' schedulers must decide
# alike (a finish, an admission, a timeout): with other values on two nodes the ranks' batches part and
# their next collective hangs. The others are left out on purpose: paths, threads, warm-up, the
# checkpoint reader; the kernel choices (the model's collectives give every rank the same logits:
# ParallelLMHead gathers them); the settings only TP rank 0 acts on (SGLANG_GRAMMAR_TIMEOUT and
# SGLANG_REQ_*_TIMEOUT: rank 0 decides, the tick applies it everywhere; the HTTP server; the PD channel and
# SGLANG_DISAGGREGATION_SECRET); and what the ranks already agree on where it differs (the disk tier's
# hits, a PD transfer's failure, SGLANG_TEST_DISAGGREGATION_FAIL_TRANSFER).
SAME_ON_EVERY_TP_RANK: tuple[EnvVar, ...] = (
    # FinishChecker.check_finished ends the costliest requests over these on each rank (the ranks agree on
    # the measured costs, not on the budget): the finishes part and precheck's all-reduce hangs.
    envs.SGLANG_OUTPUT_CHECK_BUDGET_PER_REQ,
    envs.SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP,
    # model_runner.agree_on_tokens: whether each step's device all-reduce of the sampled tokens runs.
    envs.SYNC_TOKEN_IDS_ACROSS_TP,
    envs.SGLANG_ENABLE_STRICT_TP_TOKEN_CHECK,
    # The idle check's `TpBroadcast.agree` of the scheduler states (a gather) runs where it is set.
    envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE,
    # Input logprobs: one lm_head all-gather per chunk of positions, so the chunk sets how many run.
    envs.SGLANG_LOGITS_PROCESSER_CHUNK_SIZE,
    # CPU sampling is each rank's own (from the same gathered logits and seeds): the C++ and torch forms
    # may round a CDF apart and take another token.
    envs.SGLANG_CPU_SAMPLING_BACKEND,
    # NEXTN: sampled drafts (eager) or greedy ones (graph) on each rank: the drafts, and so the accepted
    # lengths, part.
    envs.SGLANG_MTP_EAGER_SAMPLED_DRAFTS,
    # The state pools' dtypes (as --mamba-ssm-dtype, a flag compared already): their sizes, so the pools'
    # slot counts, and the PD layout follow them.
    envs.SGLANG_MAMBA_CONV_DTYPE,
    envs.SGLANG_MAMBA_SSM_DTYPE,
    # PD: every rank expires rooms against rank 0's clock with its own timeout, holds unmatched
    # destinations up to its own bound, and (staged) admits a request only where its staging buffer has
    # a range, moving it in chunks of its own size (`PdRanks.written_everywhere` counts chunks).
    envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT,
    envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT,
    envs.SGLANG_DISAGGREGATION_MAX_UNMATCHED_ROOMS,
    envs.SGLANG_DISAGGREGATION_STAGING,
    envs.SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB,
    envs.SGLANG_DISAGG_STAGING_POOL_SIZE_MB,
    # A custom logit processor loads only where its payload's signature matches: the ranks agree on the
    # outcome (`load_processor_agreed`), but every such request would be refused. A secret: compared,
    # never shown (SECRET_ENV_NAMES).
    envs.SGLANG_LOGIT_PROCESSOR_SECRET,
    # Fault injection: the lazy snapshot slots' allocations fail on the ranks where it is set, and their
    # trees part.
    envs.SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL,
)
# Of those, the ones an error names without their values.
SECRET_ENV_NAMES = frozenset({"SGLANG_LOGIT_PROCESSOR_SECRET"})


def tp_env_values() -> dict[str, object]:
    """This process's value of each SAME_ON_EVERY_TP_RANK variable (the raw string where it does not
    parse: a rank must not fail alone before the comparison; a secret as its SHA-256)."""
    import hashlib

    out: dict[str, object] = {}
    for var in SAME_ON_EVERY_TP_RANK:
        try:
            value: object = var.get()
        except ValueError:
            value = os.environ.get(var.name)
        if var.name in SECRET_ENV_NAMES:
            value = hashlib.sha256(str(value).encode()).hexdigest()
        out[var.name] = value
    return out
