"""What this server does with each upstream SGLang flag it does not implement (data for
`server_args_upstream.py`, which explains the rules).

A flag is written as upstream spells it, its aliases joined by `|`, and a mark for what it takes:
nothing (a switch), `=` (one value), `+` (a list of values) or `?` (an optional value).
"""

from __future__ import annotations

from dataclasses import dataclass

# ---- refused, by theme: "<flag> is not supported by this server: <reason>." -----------------------

THEMES: dict[str, str] = {
    "parallel": "this kind of parallelism is not built (tensor, expert and data parallelism are: --tp-size, "
    "--ep-size, --dp-size, with --nnodes for more nodes; docs/parallelism.md); leave it out",
    "comm": "it tunes a communication path between GPUs that this server does not have (its ranks talk "
    "through torch.distributed's NCCL or gloo collectives); leave it out",
    "moe": "expert load balancing, all-to-all backends and other MoE kernels are not built (issue 55); --ep-size "
    "distributes the experts and the MoE layers run this server's own fused kernels, so leave it out",
    "quant": "only FP8 weights are served (block-wise and NVIDIA ModelOpt FP8 checkpoints as published, or "
    "--quantization fp8 at load; nothing is quantized with ModelOpt here); use --kv-cache-dtype for an FP8 KV "
    "cache",
    "lora": "this LoRA option is not built (adapters are served with --enable-lora, --lora-paths, "
    "--max-lora-rank, --lora-target-modules, --max-loras-per-batch, --max-loaded-loras and "
    "--lora-eviction-policy: docs/lora.md); leave it out",
    "hicache": "of the hierarchical cache, the host-memory tier and the file storage backend are built "
    "(--enable-hierarchical-cache, --hicache-ratio, --hicache-size, --hicache-write-policy, "
    "--hicache-storage-backend file: docs/state_management.md); no external KV-cache tier or other cache "
    "layout, so leave it out",
    "spec": "speculative decoding here is NGRAM, or EAGLE / NEXTN from the checkpoint's own MTP layers "
    "(one chain of drafts); leave it out",
    "ngram": "this server's NGRAM drafter has no such setting; tune it with "
    "--speculative-ngram-min-match-window-size, --speculative-ngram-max-match-window-size, "
    "--speculative-ngram-branch-length and --speculative-ngram-capacity",
    "mm": "images and video are served on Qwen3.5 vision-language checkpoints with this server's own "
    "processing, which has no such setting (docs/multimodal.md; audio and separate encoder servers are "
    "not built); leave it out",
    "hardware": "only NVIDIA CUDA GPUs and the CPU are supported (no AMD ROCm, Ascend NPU, Intel XPU, Apple "
    "MLX or Ray backend); choose between them with --device",
    "kernels": "this server picks its kernels per layer type itself (Triton on CUDA, with torch's "
    "FlashAttention-2 for prefill attention where it applies, SGLANG_EXTEND_ATTENTION_BACKEND=triton "
    "keeping the Triton kernel; torch or C++ on CPU) and has no such flag; choose the attention kernels "
    "with --attention-backend",
    "graphs": "CUDA graphs are captured for decode and speculative verify forwards (and NEXTN's draft loops, "
    "argmax drafts for every request, and MTP layer after them) only; configure them "
    "with --cuda-graph-max-bs, --cuda-graph-bs and --disable-cuda-graph",
    "model": "checkpoints load as they are, from a local Hugging Face folder of safetensors files or a "
    "built-in preset; prepare the folder (config.json, weights) instead",
    "offload": "offloading weights to host memory or disk is not supported; use a GPU that holds the "
    "weights, or a smaller checkpoint",
    "sched": "the scheduler has no such setting; it is configured by --schedule-policy, "
    "--max-running-requests, --chunked-prefill-size, --max-prefill-tokens and --mamba-scheduler-strategy "
    "(docs/server.md)",
    "serving": "the HTTP front end has no such option (docs/server.md lists its flags); leave it out",
    "observability": "this observability option is not built; use --enable-metrics (/metrics, with "
    "upstream's metric names: docs/server.md), --log-level, --log-requests and --decode-log-interval",
    "pd": "this part of prefill/decode disaggregation is not built (issue 56); docs/disaggregation.md lists "
    "the disaggregation flags that work",
    "features": "this feature is not available in this server; leave it out (docs/server.md lists what "
    "requests may ask for)",
    "dllm": "diffusion language models are not supported; this server serves causal hybrid Mamba / "
    "linear-attention models",
}

REFUSED: dict[str, str] = {
    "parallel": """
        --dcp-size|--decode-context-parallel-size= --pp-max-micro-batch-size= --pp-async-batch-depth=
        --dcp-comm-backend= --dcp-replicate-q-proj
        --enable-prefill-cp|--enable-prefill-context-parallel
        --enable-dsa-prefill-context-parallel|--enable-nsa-prefill-context-parallel
        --cp-strategy|--prefill-cp-mode|--dsa-prefill-cp-mode|--nsa-prefill-cp-mode=
        --enable-dsa-cache-layer-split --enable-cp-decode-attn-tp --enable-kv-cache-sharding
        --enable-dp-attention-local-control-broadcast --enable-dp-lm-head --enable-tp-lm-head-all-to-all
        --enable-attn-tp-input-scattered --enable-shared-experts-attn-tp --shared-experts-tp-size=
        --enable-dense-mlp-attn-tp --enable-layernorm-sp --enable-megamoe-for-layernorm-sp --moe-dense-tp-size=
        --gated-launch-port=
    """,
    "comm": """
        --enable-nccl-nvls --enable-symm-mem --enable-mscclpp --enable-torch-symm-mem --pre-warm-nccl
        --boundary-reduction= --enable-quant-communications --flashinfer-allreduce-fusion-backend=
        --enable-aiter-allreduce-fusion --enable-flashinfer-allreduce-fusion --enable-fused-moe-sum-all-reduce
        --enable-scattered-sconv
    """,
    "moe": """
        --moe-a2a-backend= --enable-w4a4-mxfp4-megamoe --deepep-v2-mode= --flashinfer-mxfp4-moe-precision=
        --deepep-mode= --deepep-dispatcher-output-dtype= --flashinfer-a2a-dispatch-type=
        --ep-num-redundant-experts= --ep-dispatch-algorithm= --init-expert-location= --enable-eplb
        --eplb-algorithm= --eplb-rebalance-num-iterations= --eplb-rebalance-layers-per-chunk=
        --eplb-min-rebalancing-utilization-threshold=
        --expert-balancedness-report-mode= --deepep-config=
        --elastic-ep-backend= --enable-elastic-expert-backup --mooncake-ib-device= --enable-waterfill
        --elastic-ep-join-mode= --elastic-ep-scale-timeout= --elastic-ep-join-rank-offset=
        --elastic-ep-initial-size= --max-ep-size= --disable-shared-experts-fusion --enforce-shared-experts-fusion
        --enable-paged-experts --paged-experts-num-resident= --kt-weight-path= --kt-method= --kt-cpuinfer=
        --kt-threadpool-count= --kt-num-gpu-experts= --kt-max-deferred-experts-per-token=
        --enable-two-batch-overlap --enable-single-batch-overlap --tbo-token-distribution-threshold=
        --elastic-ep-rejoin --enable-expert-distribution-metrics
    """,
    "quant": """
        --quantization= --quantization-param-path= --qsa-indexer-dtype= --modelopt-quant=
        --modelopt-checkpoint-restore-path= --modelopt-checkpoint-save-path= --modelopt-export-path=
        --quantize-and-serve --rl-quant-profile= --prefill-kv-cache-dequant-dtype= --enable-int8-mamba-checkpoint
        --int8-mamba-ckpt-size= --speculative-draft-model-quantization=
    """,
    "lora": """
        --enable-lora-overlap-loading --experts-shared-outer-loras --lora-use-virtual-experts
        --lora-drain-wait-threshold= --uno-lora-path= --no-lora-strict-loading
    """,
    "hicache": """
        --enable-hierarchical-cache|--enable-hicache --hicache-host-memory-mode= --hicache-ratio= --hicache-size=
        --hicache-host-memory-fraction= --hicache-write-policy= --hicache-io-backend= --hicache-mem-layout=
        --hicache-storage-backend= --hicache-storage-prefetch-policy= --hicache-storage-backend-extra-config=
        --hicache-storage-prefetch-retry-poll-interval= --hicache-storage-prefetch-retry-max-attempts=
        --enable-unified-cache-external-linker --unified-cache-external-linker-backend=
        --unified-cache-external-linker-config= --enable-linker-mla-dedup --enable-hisparse
        --hisparse-config|--hierarchical-sparse-attention-extra-config= --enable-lmcache --lmcache-config-file=
        --enable-flexkv --flexkv-config-file= --radix-cache-backend= --enable-page-major-kv-layout
        --enable-unified-memory --enable-session-radix-cache --disaggregation-decode-enable-offload-kvcache
    """,
    "spec": """
        --speculative-draft-model-revision= --speculative-draft-load-format=
        --speculative-dflash-block-size= --speculative-domino-candidate-pool-size= --speculative-dspark-block-size=
        --speculative-dspark-sps-table-path= --speculative-dspark-confidence-sts-path=
        --speculative-dspark-align-verify-tokens-to-graph-tier --speculative-accept-threshold-single=
        --speculative-accept-threshold-acc= --speculative-use-rejection-sampling
        --speculative-use-block-verification --speculative-token-map= --speculative-attention-mode=
        --speculative-draft-attention-backend= --speculative-dsa-topk-backend= --speculative-draft-kv-cache-dtype=
        --speculative-draft-window-size|--speculative-dflash-draft-window-size= --speculative-draft-sink-size=
        --speculative-moe-runner-backend=
        --speculative-moe-a2a-backend= --speculative-enable-w4a4-mxfp4-megamoe --enable-multi-layer-eagle
        --speculative-adaptive --speculative-adaptive-config= --spec-trace-dir= --enable-draft-weights-cpu-backup
        --decrypted-draft-config-file= --decoupled-spec-bind-endpoint= --decoupled-spec-connect-endpoints=
        --decoupled-spec-rank= --decoupled-spec-role= --enable-return-aux-hidden-states
        --return-aux-hidden-state-layer-ids+ --speculative-skip-dp-mlp-sync
    """,
    "ngram": """
        --speculative-ngram-max-trie-depth= --speculative-ngram-external-corpus-path=
        --speculative-ngram-external-sam-budget= --speculative-ngram-external-corpus-max-tokens=
    """,
    "mm": """
        --mm-attention-backend= --enable-broadcast-mm-inputs-process --enable-prefix-mm-cache
        --mm-enable-dp-encoder --mm-process-config= --mm-processor-worker-num= --mm-io-worker-num=
        --mm-preprocess-cache-size-mb= --trust-mm-content-hashes --enable-mm-global-cache
        --image-processor-backend=
        --mm-global-cache-backend= --mm-feature-transport= --encoder-only --language-only --encoder-transfer-backend=
        --encoder-urls+ --encoder-bootstrap-port= --encoder-register-urls+ --enable-adaptive-dispatch-to-encoder
        --enable-encoder-swa-bounded-replay --enable-precise-embedding-interpolation --asr-max-buffer-seconds=
        --asr-max-concurrent-sessions= --keep-mm-feature-on-device
    """,
    "hardware": """
        --mlx-enable-sampling --use-ray --numa-node+ --enable-amd-monokernel --monokernel-backend= --fuseep-mode=
        --msprobe-dump-config=
    """,
    "kernels": """
        --decode-attention-backend= --prefill-attention-backend= --enable-lean-attention --enable-nvidia-megakernel
        --dsa-prefill-backend|--nsa-prefill-backend= --dsv4-prefill-backend= --dsa-triton-union=
        --dsa-decode-backend|--nsa-decode-backend= --dsv4-attn-backend=
        --dsa-paged-mqa-logits-backend= --dsa-topk-backend= --flashinfer-autotune-skip-ops+
        --triton-attention-reduce-in-fp32 --triton-attention-split-tile-size= --flashinfer-mla-disable-ragged
        --enable-fused-qk-norm-rope --no-enable-fused-qk-norm-rope --enable-deepseek-v4-fp4-indexer
        --enable-dsa-fused-indexer --enable-fp32-lm-head --enable-tf32-matmul --mamba-max-states-per-path=
        --enable-mamba-cache-stochastic-rounding --mamba-cache-philox-rounds= --enable-linear-replayssm
        --linear-replayssm-cache-len= --enable-linear-replayssm-spec|--enable-gdn-replayssm-spec
        --enable-decoder-swa-bounded-replay
    """,
    "graphs": """
        --cuda-graph-config= --cuda-graph-max-bs-prefill|--piecewise-cuda-graph-max-tokens=
        --cuda-graph-max-seq-len-prefill= --cuda-graph-bs-prefill|--piecewise-cuda-graph-tokens+
        --cuda-graph-tc-compiler|--piecewise-cuda-graph-compiler= --enable-breakable-cuda-graph
        --enforce-piecewise-cuda-graph
        --cuda-graph-prefill-max-context|--context-bucket= --disable-cuda-graph-padding --enable-profile-cuda-graph
        --enable-cudagraph-gc --debug-cuda-graph --enable-torch-compile-debug-mode
    """,
    "model": """
        --is-embedding --revision= --model-config-parser= --startup-weight-load-mode= --custom-weight-loader+
        --weight-loader-disable-mmap --weight-loader-prefetch-checkpoints --weight-loader-prefetch-num-threads=
        --weight-loader-drop-cache-after-load --remote-instance-weight-loader-seed-instance-ip=
        --remote-instance-weight-loader-seed-instance-service-port=
        --remote-instance-weight-loader-send-weights-group-ports= --remote-instance-weight-loader-backend=
        --remote-instance-weight-loader-start-seed-via-transfer-engine --engine-info-bootstrap-port=
        --modelexpress-config= --download-dir= --model-checksum? --delete-ckpt-after-loading
        --decrypted-config-file= --checkpoint-engine-wait-weights-before-ready --weight-cache-mode=
        --weight-cache-socket= --weight-cache-timeout=
    """,
    "offload": """
        --cpu-offload-gb= --offload-group-size= --offload-num-in-group= --offload-prefetch-step= --offload-mode=
        --ple-offload-embedding --ple-offload-backend= --ple-offload-dir=
    """,
    "sched": """
        --prefill-decode-interval= --prefill-decode-interval-min-bs= --enable-dynamic-chunking
        --prefill-max-requests= --retraction-policy= --schedule-conservativeness=
        --c128-page-size= --swa-full-tokens-ratio= --swa-prefix-tails= --prefill-only-disable-kv-cache
        --num-continuous-decode-steps= --scheduler-recv-interval= --enable-prefill-delayer
        --prefill-delayer-max-delay-passes= --prefill-delayer-token-usage-low-watermark=
        --prefill-delayer-forward-passes-buckets+ --prefill-delayer-wait-seconds-buckets+
        --prefill-delayer-queue-min-ratio= --prefill-delayer-max-delay-ms= --min-free-slots-delay=
        --radix-eviction-policy-config= --soft-watchdog-timeout=
    """,
    "serving": """
        --tokenizer-backend= --fastapi-root-path= --enable-http-worker-reuseport
        --smg-grpc-mode --grpc-mode --grpc-port= --grpc-response-timeout-secs= --sidecar= --sidecar-args=
        --smg-http-sidecar-port|--grpc-http-sidecar-port= --warmups= --enable-http2 --http2-max-concurrent-streams=
        --http2-initial-connection-window-size= --enable-ssl-refresh --trust-request-chat-template
        --hf-chat-template-name= --completion-template= --file-storage-path= --return-input-ids --return-output-ids
        --strip-thinking-cache --tool-server= --batch-notify-size=
        --incremental-streaming-output|--stream-output --enable-streaming-session --constrained-json-max-whitespace-cnt=
        --enable-dynamic-batch-tokenizer --dynamic-batch-tokenizer-batch-size= --dynamic-batch-tokenizer-batch-timeout=
        --enable-tokenizer-batch-encode --disable-tokenizer-batch-decode --config=
    """,
    "observability": """
        --log-level-http= --log-requests-target+
        --crash-dump-folder= --show-time-cost --enable-mfu-metrics
        --enable-metrics-for-all-schedulers --load-snapshot-publish-interval= --tokenizer-metrics-custom-labels-header=
        --tokenizer-metrics-allowed-custom-labels+ --extra-metric-labels=
        --enable-request-time-stats-logging
        --kv-events-config= --load-publish-endpoint= --enable-forward-pass-metrics --forward-pass-metrics-worker-id=
        --forward-pass-metrics-ipc-name= --enable-trace --trace-modules= --otlp-traces-endpoint= --otlp-service-name=
        --export-metrics-to-file --export-metrics-to-file-dir= --kv-canary= --kv-canary-sweep-interval=
        --kv-canary-real-data= --debug-tensor-dump-output-folder= --debug-tensor-dump-layers+
        --debug-tensor-dump-input-file= --forward-hooks= --enable-layerwise-nvtx-marker
    """,
    "pd": """
        --disaggregation-decode-allocation-policy= --disaggregation-enable-kv-checksum
        --disaggregation-decode-retraction-backup=
        --num-reserved-decode-tokens= --disaggregation-decode-polling-interval= --enable-pd-role-switch
        --optimistic-prefill-attempts= --enable-pdmux --pdmux-config-path= --sm-group-num=
        --disaggregation-decode-host-receive-threshold= --disaggregation-decode-enable-fake-auto
    """,
    "features": """
        --enable-deterministic-inference --rl-on-policy-target= --enable-watermark --watermark-config=
        --return-hidden-states-mode= --enable-return-indexer-topk --sampling-mask-max-tokens= --enable-mis
    """,
    "dllm": "--dllm-algorithm= --dllm-algorithm-config= --dllm-fdfo",
}

# Where a flag's own sentence says more than its theme's.
SPECIFIC: dict[str, str] = {
    "--config": "options are not read from a file; pass them on the command line",
    "--hf-chat-template-name": "the chat template is the checkpoint's, or a Jinja file's (--chat-template)",
    "--revision": "checkpoints are never downloaded; pass the folder of the revision you want as --model-path",
    "--download-dir": "checkpoints are never downloaded; pass a local folder as --model-path",
    "--enable-ssl-refresh": "certificates are read at start (--ssl-keyfile, --ssl-certfile); restart the server "
    "to take new ones",
    "--is-embedding": "embedding models are not served; this server serves generation models",
    "--gated-launch-port": "there is no gated start; start the server when it may take the GPU's memory",
    "--tokenizer-backend": "the tokenizer is Hugging Face's fast tokenizer from the checkpoint folder",
    "--disaggregation-decode-enable-fake-auto": "upstream's fake KV transfer (a decode server that serves "
    "requests without a prefill server, on KV it never receives, for benchmarks) is not built; pair the "
    "decode server with a prefill server (docs/disaggregation.md)",
}


# ---- accepted: the flag (or the values listed) asks for what this server does already --------------


@dataclass(frozen=True)
class Accepted:
    """`values` None: any value (or a switch); else the values accepted, each with the ServerArgs fields
    it sets (most set none). `kind` says how a value is compared: "int", "json" or "str". Other values
    are refused with `instead` (a theme or a sentence)."""

    spec: str
    why: str
    values: dict[str, dict] | None = None
    kind: str = "str"
    instead: str = ""


_ONE = {"1": {}}
_GPU = "choose the GPUs with CUDA_VISIBLE_DEVICES (rank i of a node runs on the i-th GPU it shows)"
_SIZE_ONE = "1 is the only size this kind of parallelism has here"
_NO_COMM = "it turns off a communication path this server does not have (its ranks use torch.distributed's collectives)"

ACCEPTED: list[Accepted] = [
    Accepted(
        "--enable-multimodal",
        "a checkpoint with a vision tower (Qwen3.5's) takes images and video already (docs/multimodal.md)",
    ),
    Accepted(
        "--enable-cache-report", "every reply's usage carries prompt_tokens_details.cached_tokens already"
    ),
    Accepted(
        "--base-gpu-id=",
        "rank i of a node runs on the i-th GPU CUDA_VISIBLE_DEVICES shows",
        {"0": {}},
        "int",
        _GPU,
    ),
    Accepted("--gpu-id-step=", "rank i of a node runs on GPU i", _ONE, "int", _GPU),
    Accepted("--pp-size|--pipeline-parallel-size=", _SIZE_ONE, _ONE, "int", "parallel"),
    Accepted("--attn-dp-size|--attention-data-parallel-size=", _SIZE_ONE, _ONE, "int", "parallel"),
    Accepted("--attn-cp-size|--attention-context-parallel-size=", _SIZE_ONE, _ONE, "int", "parallel"),
    Accepted("--moe-dp-size|--moe-data-parallel-size=", _SIZE_ONE, _ONE, "int", "parallel"),
    Accepted("--dwdp-size=", _SIZE_ONE, _ONE, "int", "parallel"),
    Accepted(
        "--nccl-port=",
        "the ranks of one node meet on a free local port the server picks (--dist-init-addr sets one)",
    ),
    Accepted(
        "--tokenizer-worker-num=",
        "one tokenizer process, as upstream's default",
        _ONE,
        "int",
        "more tokenizer workers are not built, and one tokenizer process serves every request",
    ),
    Accepted(
        "--detokenizer-worker-num=",
        "one detokenizer process, as upstream's default",
        _ONE,
        "int",
        "more detokenizer workers are not built, and one detokenizer process serves every request",
    ),
    Accepted(
        "--json-model-override-args=",
        "an empty object overrides nothing",
        {"{}": {}},
        "json",
        "the model's config is read as it is, so edit the checkpoint's config.json instead",
    ),
    Accepted(
        "--model-loader-extra-config=", "an empty object configures nothing", {"{}": {}}, "json", "model"
    ),
    Accepted(
        "--load-format=",
        "checkpoints load from safetensors files, which is what auto picks for them",
        {"auto": {}, "safetensors": {}},
        instead="model",
    ),
    Accepted(
        "--model-impl=",
        "the model classes are this server's own",
        {"auto": {}, "sglang": {}},
        instead="model",
    ),
    Accepted(
        "--tokenizer-mode=", "the fast tokenizer is loaded, as auto does", {"auto": {}}, instead="serving"
    ),
    Accepted(
        "--mamba-backend=", "the Mamba2 layers run Triton kernels on CUDA", {"triton": {}}, instead="kernels"
    ),
    *(
        Accepted(
            f"--linear-attn{part}-backend=",
            "the linear-attention layers run Triton kernels on CUDA",
            {"triton": {}},
            instead="kernels",
        )
        for part in ("", "-decode", "-prefill", "-verify")
    ),
    Accepted(
        "--sampling-backend=",
        "sampling runs in torch and this server's own ops, not FlashInfer",
        {"pytorch": {}},
        instead="kernels",
    ),
    *(
        Accepted(
            f"--{name}=",
            "auto leaves the choice to the server, which has one implementation",
            {"auto": {}},
            instead=theme,
        )
        for name, theme in [
            ("moe-runner-backend", "moe"),
            ("fp8-gemm-backend", "quant"),
            ("fp4-gemm-backend", "quant"),
            ("bf16-gemm-backend", "kernels"),
        ]
    ),
    Accepted(
        "--radix-eviction-policy=",
        "the prefix cache evicts the least recently used first",
        {"lru": {}},
        instead="sched",
    ),
    Accepted(
        "--cuda-graph-backend-decode=",
        "full is how decode graphs are captured here; disabled is --disable-cuda-graph",
        {"full": {}, "disabled": {"disable_cuda_graph": True}},
        instead="graphs",
    ),
    Accepted(
        "--cuda-graph-backend-prefill=",
        "no prefill forward is captured in a CUDA graph here",
        {"disabled": {}},
        instead="graphs",
    ),
    Accepted("--disable-prefill-cuda-graph", "no prefill forward is captured in a CUDA graph here"),
    Accepted("--disable-piecewise-cuda-graph", "no prefill forward is captured in a CUDA graph here"),
    Accepted(
        "--sleep-on-idle",
        "an idle scheduler already waits in its socket's poll (woken by a request, or every 50 ms for its "
        "timers) and spins nowhere",
    ),
    Accepted("--prefill-round-robin-balance", "upstream deprecated it, and it does nothing there either"),
    Accepted(
        "--disaggregation-decode-dp=",
        "a decode server here is one data-parallel replica of --tp-size ranks",
        _ONE,
        "int",
        "pd",
    ),
    Accepted(
        "--disaggregation-prefill-pp=",
        "a prefill server here is one pipeline stage (no pipeline parallelism)",
        _ONE,
        "int",
        "parallel",
    ),
    Accepted(
        "--language-model-only", "only the language model of a vision-language checkpoint is served here"
    ),
    Accepted("--disable-custom-all-reduce", _NO_COMM),
    Accepted("--enforce-disable-flashinfer-allreduce-fusion", _NO_COMM),
    Accepted("--disable-aiter-allreduce-fusion-in-prefill", _NO_COMM),
    Accepted("--disable-aiter-allreduce-fusion-in-decode", _NO_COMM),
    Accepted("--disable-flashinfer-cutlass-moe-fp4-allgather", _NO_COMM),
    Accepted("--disable-attn-tp-gather", _NO_COMM),
    Accepted("--enable-p2p-check", "NCCL checks peer-to-peer access itself"),
    Accepted("--lora-strict-loading", "an adapter with a module this server cannot serve is refused already"),
    Accepted(
        "--max-lora-chunk-size=",
        "it tunes upstream's csgmv kernel; this server's LoRA runs its own matmuls",
        {"16": {}, "32": {}, "64": {}, "128": {}},
        "int",
        "lora",
    ),
    Accepted("--disable-flashinfer-autotune", "FlashInfer is not used, so nothing is autotuned by it"),
    Accepted("--disable-outlines-disk-cache", "outlines is not used (--grammar-backend xgrammar)"),
    Accepted("--disable-fast-image-processor", "no image processor is loaded (text-only serving)"),
    Accepted(
        "--disable-chunked-prefix-cache",
        "the chunked prefix cache is an MLA path, and no MLA model is served",
    ),
    Accepted("--disable-hybrid-swa-memory", "no sliding-window-attention model is served"),
    Accepted("--no-enable-tf32-matmul", "float32 matmuls keep torch's default, TF32 off"),
    *(
        Accepted(f"--no-{name}", "it turns off a feature this server does not have")
        for name in [
            "dllm-fdfo",
            "enable-decoder-swa-bounded-replay",
            "enable-dsa-fused-indexer",
            "ple-offload-embedding",
            "experts-shared-outer-loras",
            "mm-enable-dp-encoder",
            "dcp-replicate-q-proj",
            "enable-tp-lm-head-all-to-all",
            "speculative-enable-w4a4-mxfp4-megamoe",
        ]
    ),
]

# Upstream's names for flags this server has under another name: registered as aliases of ours.
ALIASES: dict[str, str] = {
    "--tensor-parallel-size": "--tp-size",
    "--cuda-graph-max-bs-decode": "--cuda-graph-max-bs",
    "--cuda-graph-bs-decode": "--cuda-graph-bs",
    "--disable-decode-cuda-graph": "--disable-cuda-graph",
}
