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

# Upstream's flags: sglang 0.5.23 (PyPI, October 2026), every option string its ServerArgs.add_cli_args
# registers (the fields' flags and the manual ones). Marks: `=` one value, `+` a list, `?` an optional
# value, none a switch; aliases joined by `|`; a BooleanOptionalAction's `--no-` form is its own switch.
UPSTREAM_FLAGS = """
    --device= --base-gpu-id= --gpu-id-step= --random-seed= --mlx-enable-sampling --watchdog-timeout=
    --soft-watchdog-timeout= --sleep-on-idle --use-ray --numa-node+ --gc-threshold+
    --decoupled-spec-bind-endpoint= --decoupled-spec-connect-endpoints= --decoupled-spec-rank=
    --decoupled-spec-role= --disaggregation-mode= --disaggregation-decode-allocation-policy=
    --disaggregation-transfer-backend= --disaggregation-enable-kv-checksum --disaggregation-bootstrap-port=
    --disaggregation-ib-device= --disaggregation-decode-enable-radix-cache
    --disaggregation-decode-enable-offload-kvcache --disaggregation-decode-retraction-backup=
    --num-reserved-decode-tokens= --disaggregation-decode-extra-slots= --disaggregation-decode-polling-interval=
    --enable-pd-role-switch --optimistic-prefill-attempts= --encoder-only --language-only --language-model-only
    --encoder-transfer-backend= --encoder-urls+ --encoder-bootstrap-port= --encoder-register-urls+
    --enable-adaptive-dispatch-to-encoder --enable-pdmux --pdmux-config-path= --sm-group-num=
    --disaggregation-decode-host-receive-threshold= --enable-layerwise-nvtx-marker --enable-nccl-nvls
    --enable-symm-mem --disable-custom-all-reduce --enable-mscclpp --enable-torch-symm-mem
    --enable-scattered-sconv --pre-warm-nccl --boundary-reduction= --enable-quant-communications
    --enforce-disable-flashinfer-allreduce-fusion --flashinfer-allreduce-fusion-backend=
    --enable-aiter-allreduce-fusion --disable-aiter-allreduce-fusion-in-prefill
    --disable-aiter-allreduce-fusion-in-decode --enable-deterministic-inference --rl-on-policy-target=
    --dllm-algorithm= --dllm-algorithm-config= --dllm-fdfo --no-dllm-fdfo --enable-fp32-lm-head
    --enable-tf32-matmul --no-enable-tf32-matmul --enable-memory-saver --enable-weights-cpu-backup
    --enable-draft-weights-cpu-backup --enable-custom-logit-processor --enable-watermark --watermark-config=
    --enable-return-hidden-states --return-hidden-states-mode= --enable-return-aux-hidden-states
    --return-aux-hidden-state-layer-ids+ --enable-return-routed-experts --enable-return-indexer-topk
    --enable-encoder-swa-bounded-replay --enable-decoder-swa-bounded-replay
    --no-enable-decoder-swa-bounded-replay --sampling-mask-max-tokens= --disable-outlines-disk-cache
    --enable-mis --cuda-graph-config= --cuda-graph-backend-decode= --cuda-graph-backend-prefill=
    --cuda-graph-max-bs-decode= --cuda-graph-max-bs-prefill= --cuda-graph-max-seq-len-prefill=
    --cuda-graph-bs-decode+ --cuda-graph-bs-prefill+ --cuda-graph-prefill-max-context|--context-bucket=
    --disable-prefill-cuda-graph --disable-decode-cuda-graph --disable-cuda-graph-padding
    --enable-profile-cuda-graph --enable-cudagraph-gc --debug-cuda-graph --enable-torch-compile
    --enable-torch-compile-debug-mode --torch-compile-max-bs= --attention-backend= --decode-attention-backend=
    --enable-lean-attention --enable-nvidia-megakernel --enable-amd-monokernel --prefill-attention-backend=
    --prefill-kv-cache-dequant-dtype= --grammar-backend= --fp8-gemm-backend= --fp4-gemm-backend=
    --bf16-gemm-backend= --dsa-prefill-backend= --dsv4-prefill-backend= --dsa-triton-union=
    --dsa-decode-backend= --dsv4-attn-backend= --dsa-paged-mqa-logits-backend= --dsa-topk-backend=
    --disable-flashinfer-autotune --flashinfer-autotune-skip-ops+ --triton-attention-reduce-in-fp32
    --triton-attention-num-kv-splits= --triton-attention-split-tile-size= --flashinfer-mla-disable-ragged
    --enable-fused-qk-norm-rope --no-enable-fused-qk-norm-rope --enable-precise-embedding-interpolation
    --enable-deepseek-v4-fp4-indexer --enable-dsa-fused-indexer --no-enable-dsa-fused-indexer --mamba-backend=
    --mamba-ssm-dtype= --mamba-max-states-per-path= --enable-mamba-cache-stochastic-rounding
    --mamba-cache-philox-rounds= --mamba-radix-cache-strategy= --mamba-track-interval=
    --enable-int8-mamba-checkpoint --int8-mamba-ckpt-size= --linear-attn-backend= --linear-attn-decode-backend=
    --linear-attn-prefill-backend= --linear-attn-verify-backend= --enable-linear-replayssm
    --linear-replayssm-cache-len= --enable-linear-replayssm-spec --enable-fused-moe-sum-all-reduce
    --moe-a2a-backend= --enable-w4a4-mxfp4-megamoe --deepep-v2-mode= --moe-runner-backend=
    --flashinfer-mxfp4-moe-precision= --deepep-mode= --fuseep-mode= --deepep-dispatcher-output-dtype=
    --flashinfer-a2a-dispatch-type= --ep-num-redundant-experts= --ep-dispatch-algorithm= --init-expert-location=
    --enable-eplb --eplb-algorithm= --eplb-rebalance-num-iterations= --eplb-rebalance-layers-per-chunk=
    --eplb-min-rebalancing-utilization-threshold= --expert-distribution-recorder-mode=
    --expert-distribution-recorder-buffer-size= --expert-balancedness-report-mode= --deepep-config=
    --elastic-ep-backend= --enable-elastic-expert-backup --mooncake-ib-device= --enable-waterfill
    --elastic-ep-join-mode= --elastic-ep-scale-timeout= --disable-flashinfer-cutlass-moe-fp4-allgather
    --disable-shared-experts-fusion --enforce-shared-experts-fusion --enable-paged-experts
    --paged-experts-num-resident= --kt-weight-path= --kt-method= --kt-cpuinfer= --kt-threadpool-count=
    --kt-num-gpu-experts= --kt-max-deferred-experts-per-token= --cpu-offload-gb= --offload-group-size=
    --offload-num-in-group= --offload-prefetch-step= --offload-mode= --ple-offload-embedding
    --no-ple-offload-embedding --ple-offload-backend= --ple-offload-dir= --enable-two-batch-overlap
    --enable-single-batch-overlap --tbo-token-distribution-threshold= --enable-lora
    --enable-lora-overlap-loading --max-lora-rank= --lora-target-modules+ --lora-paths+ --max-loaded-loras=
    --max-loras-per-batch= --lora-eviction-policy= --lora-backend= --max-lora-chunk-size=
    --experts-shared-outer-loras --no-experts-shared-outer-loras --lora-use-virtual-experts
    --lora-strict-loading --no-lora-strict-loading --lora-drain-wait-threshold= --radix-eviction-policy=
    --radix-eviction-policy-config= --disable-radix-cache --enable-page-major-kv-layout --enable-unified-memory
    --enable-session-radix-cache --radix-cache-backend= --enable-hierarchical-cache|--enable-hicache
    --hicache-host-memory-mode= --hicache-ratio= --hicache-size= --hicache-host-memory-fraction=
    --hicache-write-policy= --hicache-io-backend= --hicache-mem-layout= --hicache-storage-backend=
    --hicache-storage-prefetch-policy= --hicache-storage-backend-extra-config=
    --hicache-storage-prefetch-retry-poll-interval= --hicache-storage-prefetch-retry-max-attempts=
    --enable-unified-cache-external-linker --unified-cache-external-linker-backend=
    --unified-cache-external-linker-config= --enable-linker-mla-dedup --enable-hisparse
    --hisparse-config|--hierarchical-sparse-attention-extra-config= --enable-lmcache --lmcache-config-file=
    --enable-flexkv --flexkv-config-file= --enable-multimodal --mm-attention-backend=
    --enable-broadcast-mm-inputs-process --enable-prefix-mm-cache --mm-enable-dp-encoder
    --no-mm-enable-dp-encoder --mm-process-config= --mm-processor-worker-num= --mm-io-worker-num=
    --allowed-media-domains+ --media-url-max-file-size-mb= --mm-preprocess-cache-size-mb=
    --trust-mm-content-hashes --limit-mm-data-per-request= --enable-mm-global-cache --image-processor-backend=
    --mm-global-cache-backend= --disable-fast-image-processor --mm-feature-transport= --model-path|--model=
    --load-format= --model-loader-extra-config= --trust-remote-code --context-length= --is-embedding --revision=
    --model-impl= --model-config-parser= --json-model-override-args= --dtype= --quantization=
    --quantization-param-path= --kv-cache-dtype= --qsa-indexer-dtype= --modelopt-quant=
    --modelopt-checkpoint-restore-path= --modelopt-checkpoint-save-path= --modelopt-export-path=
    --quantize-and-serve --rl-quant-profile= --startup-weight-load-mode= --custom-weight-loader+
    --weight-loader-disable-mmap --weight-loader-prefetch-checkpoints --weight-loader-prefetch-num-threads=
    --weight-loader-drop-cache-after-load --remote-instance-weight-loader-seed-instance-ip=
    --remote-instance-weight-loader-seed-instance-service-port=
    --remote-instance-weight-loader-send-weights-group-ports= --remote-instance-weight-loader-backend=
    --remote-instance-weight-loader-start-seed-via-transfer-engine --engine-info-bootstrap-port=
    --modelexpress-config= --download-dir= --model-checksum? --delete-ckpt-after-loading
    --decrypted-config-file= --decrypted-draft-config-file= --checkpoint-engine-wait-weights-before-ready
    --weight-cache-mode= --weight-cache-socket= --weight-cache-timeout= --log-level= --log-level-http=
    --log-requests --log-requests-level= --log-requests-format= --log-requests-target+
    --uvicorn-access-log-exclude-prefixes+ --crash-dump-folder= --show-time-cost --enable-metrics
    --smg-http-sidecar-port|--grpc-http-sidecar-port= --enable-mfu-metrics --enable-metrics-for-all-schedulers
    --load-snapshot-publish-interval= --tokenizer-metrics-custom-labels-header=
    --tokenizer-metrics-allowed-custom-labels+ --extra-metric-labels= --bucket-time-to-first-token+
    --bucket-inter-token-latency+ --bucket-e2e-request-latency+ --prompt-tokens-buckets+
    --generation-tokens-buckets+ --gc-warning-threshold-secs= --decode-log-interval=
    --enable-request-time-stats-logging --kv-events-config= --load-publish-endpoint=
    --enable-forward-pass-metrics --forward-pass-metrics-worker-id= --forward-pass-metrics-ipc-name=
    --enable-trace --trace-modules= --otlp-traces-endpoint= --otlp-service-name= --export-metrics-to-file
    --export-metrics-to-file-dir= --kv-canary= --kv-canary-sweep-interval= --debug-tensor-dump-output-folder=
    --debug-tensor-dump-layers+ --debug-tensor-dump-input-file= --forward-hooks= --msprobe-dump-config=
    --nccl-port= --dist-timeout= --dist-init-addr|--nccl-init-addr= --gated-launch-port= --nnodes= --node-rank=
    --tp-size|--tensor-parallel-size= --dcp-size|--decode-context-parallel-size=
    --pp-size|--pipeline-parallel-size= --pp-max-micro-batch-size= --pp-async-batch-depth=
    --dp-size|--data-parallel-size= --attn-dp-size|--attention-data-parallel-size= --load-balance-method=
    --attn-cp-size|--attention-context-parallel-size= --moe-dp-size|--moe-data-parallel-size= --dwdp-size=
    --dcp-comm-backend= --dcp-replicate-q-proj --no-dcp-replicate-q-proj --enable-prefill-cp --cp-strategy=
    --enable-dsa-cache-layer-split --enable-cp-decode-attn-tp --enable-kv-cache-sharding
    --enable-dp-attention-local-control-broadcast --enable-dp-lm-head --enable-tp-lm-head-all-to-all
    --no-enable-tp-lm-head-all-to-all --enable-attn-tp-input-scattered --enable-shared-experts-attn-tp
    --shared-experts-tp-size= --enable-dense-mlp-attn-tp --enable-layernorm-sp --enable-megamoe-for-layernorm-sp
    --disable-attn-tp-gather --enable-p2p-check --ep-size|--expert-parallel-size|--ep= --moe-dense-tp-size=
    --elastic-ep-join-rank-offset= --elastic-ep-initial-size= --max-ep-size= --mem-fraction-static=
    --max-running-requests= --max-queued-requests= --max-total-tokens= --chunked-prefill-size=
    --prefill-decode-interval= --prefill-decode-interval-min-bs= --enable-dynamic-chunking --max-prefill-tokens=
    --prefill-max-requests= --schedule-policy= --enable-priority-scheduling --disable-priority-preemption
    --default-priority-value= --abort-on-priority-when-disabled --schedule-low-priority-values-first
    --priority-scheduling-preemption-threshold= --retraction-policy= --schedule-conservativeness= --page-size=
    --c128-page-size= --swa-full-tokens-ratio= --swa-prefix-tails= --disable-hybrid-swa-memory
    --prefill-only-disable-kv-cache --disable-chunked-prefix-cache --disable-overlap-schedule
    --num-continuous-decode-steps= --scheduler-recv-interval= --enable-mixed-chunk --max-mamba-cache-size=
    --mamba-full-memory-ratio= --enable-prefill-delayer --prefill-delayer-max-delay-passes=
    --prefill-delayer-token-usage-low-watermark= --prefill-delayer-forward-passes-buckets+
    --prefill-delayer-wait-seconds-buckets+ --prefill-delayer-queue-min-ratio= --prefill-delayer-max-delay-ms=
    --min-free-slots-delay= --enable-response-store --tokenizer-path= --tokenizer-mode= --tokenizer-backend=
    --tokenizer-worker-num= --detokenizer-worker-num= --skip-tokenizer-init --host= --port= --fastapi-root-path=
    --enable-http-worker-reuseport --smg-grpc-mode --grpc-mode --grpc-port= --grpc-response-timeout-secs=
    --sidecar= --sidecar-args= --skip-server-warmup --warmups= --enable-http2 --http2-max-concurrent-streams=
    --http2-initial-connection-window-size= --ssl-keyfile= --ssl-certfile= --ssl-ca-certs=
    --ssl-keyfile-password= --enable-ssl-refresh --api-key= --admin-api-key= --served-model-name=
    --weight-version= --chat-template= --trust-request-chat-template --hf-chat-template-name=
    --completion-template= --file-storage-path= --enable-cache-report --return-input-ids --return-output-ids
    --default-chat-template-kwargs= --strip-thinking-cache --enable-strict-thinking --tool-server=
    --sampling-defaults= --asr-max-buffer-seconds= --asr-max-concurrent-sessions= --preferred-sampling-params=
    --allow-auto-truncate --stream-interval= --batch-notify-size= --stream-response-default-include-usage
    --incremental-streaming-output --enable-streaming-session --constrained-json-whitespace-pattern=
    --constrained-json-disable-any-whitespace --constrained-json-max-whitespace-cnt=
    --enable-dynamic-batch-tokenizer --dynamic-batch-tokenizer-batch-size=
    --dynamic-batch-tokenizer-batch-timeout= --enable-tokenizer-batch-encode --disable-tokenizer-batch-decode
    --speculative-algorithm= --uno-lora-path= --speculative-draft-model-path|--speculative-draft-model=
    --speculative-draft-model-revision= --speculative-draft-load-format= --speculative-num-steps=
    --speculative-eagle-topk= --speculative-num-draft-tokens= --speculative-dflash-block-size=
    --speculative-domino-candidate-pool-size= --speculative-dspark-block-size=
    --speculative-dspark-sps-table-path= --speculative-dspark-confidence-sts-path=
    --speculative-dspark-align-verify-tokens-to-graph-tier --speculative-accept-threshold-single=
    --speculative-accept-threshold-acc= --speculative-use-rejection-sampling
    --speculative-use-block-verification --speculative-token-map= --speculative-attention-mode=
    --speculative-draft-attention-backend= --speculative-dsa-topk-backend= --speculative-draft-kv-cache-dtype=
    --speculative-draft-window-size= --speculative-draft-sink-size= --speculative-moe-runner-backend=
    --speculative-moe-a2a-backend= --speculative-enable-w4a4-mxfp4-megamoe
    --no-speculative-enable-w4a4-mxfp4-megamoe --speculative-draft-model-quantization=
    --enable-multi-layer-eagle --speculative-adaptive --speculative-adaptive-config= --spec-trace-dir=
    --speculative-ngram-min-bfs-breadth= --speculative-ngram-max-bfs-breadth= --speculative-ngram-match-type=
    --speculative-ngram-max-trie-depth= --speculative-ngram-capacity= --speculative-ngram-external-corpus-path=
    --speculative-ngram-external-sam-budget= --speculative-ngram-external-corpus-max-tokens= --sampling-backend=
    --reasoning-parser= --tool-call-parser= --kv-canary-real-data= --config= --disable-cuda-graph
    --enable-dp-attention --monokernel-backend= --enable-flashinfer-allreduce-fusion
""".split()

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
        (["--enable-lora"], "refused"),
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
            "enable_lora": False,
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
    with pytest.raises(ServerArgsError, match="^--lora-paths is not supported by this server: "):
        upstream_engine_kwargs({"lora_paths": ["adapter"]})
    # A name upstream does not have either is left to ServerArgs (a TypeError, as before).
    assert upstream_engine_kwargs({"no_such_flag": 1}) == {"no_such_flag": 1}


def test_docs_list_the_upstream_flags_as_the_table_says():
    assert upstream_flags_markdown() in DOCS.read_text(), (
        "docs/server.md's 'Upstream flags' lists differ from the table: paste the output of "
        "python -c 'from sglang.srt.server_args_upstream import upstream_flags_markdown as m; print(m(), end=\"\")'"
    )
