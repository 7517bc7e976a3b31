#!/usr/bin/env bash
# What a session lent the GPU test machine runs there, in device `run` calls (carry `.whl`, made by
# `../shared/gpu/fetch-offline-wheels.sh fla-core==0.6.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2`
# beforehand): the wheels, the GPU tests (marked `gpu`, in eight groups at once: the tests use small fixed
# pools, so they share the GPU; then PD's alone), then the benchmarks one at a time. Logs come back under
# $OUT (default /tmp/gpu-out): summary.txt, and logs.tar.gz holding tests-GROUP.log and bench.log (one file:
# the device tool brings back at most 8). PD's pairs need the router and the staged ones Mooncake: also
# carry what benchmark/gpu/fetch_router_wheel.sh and benchmark/gpu/fetch_mooncake_wheel.sh put in .whl/.
#   bash benchmark/gpu/run_gpu_checks.sh tests                # the GPU tests, ~5 min
#   bash benchmark/gpu/run_gpu_checks.sh engine_vs_hf decode_step kernels state_copy sampler   # ~9 min
#   (engine_profile: bench_engine_vs_hf's graphs run under cProfile, the top host functions of every thread;
#   ngram: bench_speculative_ngram.py on the 147M checkpoint, 64 requests, NGRAM against plain decoding;
#   mtp: bench_speculative_mtp.py, NEXTN against plain decoding and the MTP layer's graphs on vs off;
#   fp8_gemm: bench_fp8_gemm.py, the block-FP8 GEMM and FP8 experts at the 80B's shapes against bf16, with
#   the sweep of their tile tables; their GPU tests run in the `kernels` group)
# A device call runs 10 minutes at most and a session has 15 minutes of device time, starts included: pick.
# Measured on an H200 (2026-11-26), a fresh machine: building the sgl-kernel CPU ops 58 s; flash-linear-
# attention autotunes each kernel at its first shapes (FLA_CACHE_RESULTS keeps the results on that machine
# only): one 80B-shape GDN test > 45 s, HF `generate`'s warm-up ~50 s. The groups took: matrix-qwen 65 s,
# matrix-nemo 23 s, model 70 s, kernels over 180 s (stopped there); decode_step ~60 s, and over 80 s
# after the tests on a fresh machine (2026-11-27: FLA autotunes its shapes).
# TEST_LIMIT (default 330) bounds each test group, in seconds; PYTEST_ARGS replaces the gpu tests' targets.
# GPU_DEADLINE_S (seconds from the start; none by default) cuts each later step's limit to the time left and
# skips a step with under 20 s left, so one device call of a known length brings back everything it ran.
# Triton's cache is .gpu-cache/triton: flash-linear-attention keeps its autotuning results there (a JSON
# of a few hundred bytes per kernel and shapes). The script seeds it from benchmark/gpu/fla-autotune.tar.gz
# (committed: the results of the last GPU session, ~15 KB; AUTOTUNE_SEED names another), keeping any
# result already there, and on exit packs every result into $OUT/fla-autotune.tar.gz; a session copies that
# over the committed seed. Each kernel then compiles its tuned config only instead of timing every config
# (a fresh machine's FLA group took 183 s, with the results 29 s). The results' key is Triton's version and
# target, the kernel's source and its shapes: H100 and H200 share them. Compiled kernels stay behind.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=$PWD/.gpu-cache/triton
SEED=${AUTOTUNE_SEED:-$(cd "$(dirname "$0")" && pwd)/fla-autotune.tar.gz}
if [ -f "$SEED" ]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar -xzf "$SEED" -C "$TRITON_CACHE_DIR" --skip-old-files
fi
save_autotune() {  # one file, sorted, no owners or times: the device tool brings back at most 8 files
  [ -d "$TRITON_CACHE_DIR" ] || return 0
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 | sort -z |
    tar --null -T - --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - | gzip -n9 > "$OUT/fla-autotune.tar.gz")
  echo "autotune results saved: $(tar -tzf "$OUT/fla-autotune.tar.gz" | grep -c 'autotune.json$')" >> "$OUT/summary.txt"
}
pack_logs() {  # every log in one file beside summary.txt (the device tool brings back at most 8 files)
  local logs
  logs=$(cd "$OUT" && ls -- *.log 2>/dev/null) || return 0
  (cd "$OUT" && tar -czf logs.tar.gz $logs && rm -f $logs)
}
trap 'save_autotune; pack_logs' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
mkdir -p .site
for t in .whl/*.tar.xz; do  # (sglang-router, stripped to fit: benchmark/gpu/fetch_router_wheel.sh)
  [ -e "$t" ] && { tar -xJf "$t" -C .site || echo "unpacking $t failed (exit $?)" >> "$OUT/summary.txt"; }
done
export PYTHONPATH=$PWD/.site:$PWD/python SGLANG_CACHE_DIR=$PWD/.sgcache PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  >> "$OUT/summary.txt" 2>&1
steps=" ${*:-tests} "
limit_for() {  # wanted limit -> the limit the deadline leaves (0: skip)
  local want=$1 left
  if [ -n "${GPU_DEADLINE_S:-}" ]; then
    left=$((GPU_DEADLINE_S - SECONDS - 30))  # (a group may run 20 s past its limit: -k 20)
    ((left < want)) && want=$left
  fi
  ((want < 20)) && want=0
  echo "$want"
}

group() {  # name, pytest targets...
  local name=$1 limit
  shift
  limit=$(limit_for "${TEST_LIMIT:-330}")
  ((limit == 0)) && { echo "tests $name: skipped (deadline)" >> "$OUT/summary.txt"; return; }
  # SIGINT at the limit (then SIGKILL 20 s later): pytest stops as at ^C and still prints the failures, the
  # summary and the durations (under timeout's default SIGTERM it dies printing nothing). -v names each
  # test as it finishes, so a group cut short still says which ran.
  # (-o faulthandler_timeout: a test running over 120 s has every thread's stack dumped, once)
  timeout -s INT -k 20 "$limit" python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short \
    -o faulthandler_timeout=120 --durations=8 "$@" > "$OUT/tests-$name.log" 2>&1
  echo "tests $name: exit $? ($(tail -1 "$OUT/tests-$name.log"))" >> "$OUT/summary.txt"
  grep -E '^(FAILED|ERROR) ' "$OUT/tests-$name.log" | cut -c1-400 | head -40 >> "$OUT/summary.txt"
}

if [[ $steps == *" tests "* ]] && [ -n "${PYTEST_ARGS:-}" ]; then
  group custom $PYTEST_ARGS
elif [[ $steps == *" tests "* ]]; then
  # The CUDA ops' build first (the state-copy tests load it; the CPU ops are not needed on CUDA).
  MAX_JOBS=16 python3 -c "from sglang.srt.utils import sgl_kernel as k; print(k.load_extension('cuda')[1] or 'sgl-kernel CUDA ops ready')" \
    2>&1 | tail -2 >> "$OUT/summary.txt"
  # FLA's tests in one group, in order: they share FLA's autotuning results (by shape, layout, dtype).
  group kernels-fla test/unit/kernels/test_gdn_varlen.py test/unit/kernels/test_ssd_varlen.py \
    test/unit/kernels/test_fla_chunks.py &
  group kernels test/unit/kernels --ignore test/unit/kernels/test_gdn_varlen.py \
    --ignore test/unit/kernels/test_ssd_varlen.py --ignore test/unit/kernels/test_fla_chunks.py &
  group matrix-qwen test/unit/scheduler/test_strategy_matrix.py -k qwen &
  group matrix-nemo test/unit/scheduler/test_strategy_matrix.py -k nemotron &
  group model test/unit/model/test_cuda_graph_runner.py test/unit/model/test_kv_cache_dtype.py \
    test/unit/model/test_device_clean.py test/unit/scheduler/test_speculative_ngram.py \
    test/unit/speculative/test_speculative_mtp.py test/unit/speculative/test_mtp_graphs.py \
    test/unit/model/test_kv_cache_scales.py \
    test/unit/scheduler/test_decode_rows_cache.py test/unit/model/test_modelopt_fp8.py &
  # Request features on CUDA (grammar masks, hidden states from graph replays, graphs captured again
  # after a weight update, weights written in place under them, memory released and resumed, NEXTN's MTP
  # layer and its graphs through a weights release), the kernel timer, and the profiler's and expert
# distribution's CUDA paths.
  group features test/unit/scheduler/test_constrained_decoding.py test/unit/scheduler/test_hidden_states.py \
    test/unit/scheduler/test_update_weights.py test/unit/scheduler/test_update_weights_from_tensor.py \
    test/unit/model/test_memory_occupation.py test/registered/bench/test_gpu_bench_scripts.py \
    test/unit/speculative/test_mtp_weight_updates_nightly.py test/unit/scheduler/test_mixed_chunk.py \
    test/unit/scheduler/test_routed_experts.py test/unit/scheduler/test_expert_distribution.py \
    test/unit/scheduler/test_profiler.py &
  # The engine again with the Triton state-copy kernels forced (auto picks the CUDA op, built above).
  SGLANG_MAMBA_STATE_COPY_BACKEND=triton group copy-triton test/unit/scheduler/test_strategy_matrix.py \
    test/unit/model/test_cuda_graph_runner.py &
  # The host tier's CUDA path: copies on the copy stream through pinned staging into pageable host pools,
  # and an engine host hit under the overlap schedule and write_back against a cold run.
  group hicache test/unit/mem_cache/test_hicache_copies.py test/unit/mem_cache/test_hicache_gpu.py &
  wait
  # PD between two servers' CUDA pools on this one GPU (staged; direct where Mooncake moves GPU memory),
  # alone: each server has fixed pools of a few MB (--max-total-tokens, --max-mamba-cache-size); and the
  # staging packer's float8 KV rows on the copy stream (milliseconds); the PD weights fingerprint on CUDA
  # against the CPU's (float32, bfloat16, MoE experts, --quantization fp8).
  group pd test/registered/disaggregation/test_pd_gpu.py test/unit/disaggregation/test_staging.py \
    test/unit/disaggregation/test_weights_fingerprint.py
fi
bench() {  # limit, name, command...
  local limit name=$2
  [[ $steps == *" $name "* ]] || return 0
  limit=$(limit_for "$1")
  shift 2
  ((limit == 0)) && { echo "bench $name: skipped (deadline)" >> "$OUT/summary.txt"; return; }
  # GPU_DRY_RUN=1: each chosen step's limit and command only (a CPU check of the script's plan).
  [ -n "${GPU_DRY_RUN:-}" ] && { echo "bench $name: would run ${limit} s: $*" >> "$OUT/summary.txt"; return; }
  echo "=== $name" >> "$OUT/bench.log"
  # (^C: a traceback says where the main thread was; 10 s before it, every thread's stack: stack_dump/)
  PYTHONPATH=$PWD/benchmark/gpu/stack_dump:$PYTHONPATH SGLANG_DUMP_STACKS_AFTER_S=$((limit > 30 ? limit - 10 : 0)) \
    timeout -s INT -k 20 "$limit" "$@" >> "$OUT/bench.log" 2>&1
  echo "bench $name: exit $?" >> "$OUT/summary.txt"
}
bench 150 decode_step python3 benchmark/gpu/bench_decode_step.py
bench 270 engine_vs_hf python3 benchmark/gpu/bench_engine_vs_hf.py --reps 2 --batch-log
bench 150 kernels python3 benchmark/gpu/bench_kernels.py --reps 10 --kernels --sweep
bench 150 engine_profile python3 benchmark/gpu/bench_engine_vs_hf.py --reps 1 --host-profile
bench 150 ngram python3 benchmark/bench_speculative_ngram.py --model-path 147m --prompts 64 --reps 2
# mtp: NEXTN on the demo model against plain decoding, and its MTP layer's CUDA graphs (draft loop and
# after each forward) on vs off (mtp_graphs_speedup; not yet run on a GPU)
bench 150 mtp python3 benchmark/bench_speculative_mtp.py --device cuda --reps 2
# pd_gpu (issue 56's measurement): PD on CUDA pools (one GPU, staged unless Mooncake's CUDA build is
# here) against a single server: TTFT / ITL, throughput, bytes and milliseconds each request's transfer took
bench 150 pd_gpu python3 benchmark/bench_pd.py --device cuda --preset tiny-qwen3-next --num-prompts 8
bench 45 state_copy python3 benchmark/bench_state_copy.py --device cuda --seconds 0.1
bench 40 sampler python3 benchmark/bench_sampler.py --device cuda --reps 5
bench 180 fp8_gemm python3 benchmark/gpu/bench_fp8_gemm.py --reps 10 --sweep
# tune_moe (issue 55): the fused bf16 MoE GEMMs' tiles timed at the 80B's and the 35B-A3B's expert shapes
# (benchmark/gpu/tune_fused_moe.py, ~2 min on an H200 on 2026-11-30); its JSON files come back in
# $OUT/moe-configs.tar.gz (copy them into python/sglang/srt/layers/moe/configs/) and are put there on
# this machine too, so that `moe` (bench_kernels.py --moe: the fused GEMMs vs the grouped_mm path at the
# 80B's shapes, with the floor) runs with them:
#   bash benchmark/gpu/run_gpu_checks.sh tune_moe moe
bench 240 tune_moe python3 benchmark/gpu/tune_fused_moe.py --out "$OUT/moe-configs"
if [ -d "$OUT/moe-configs" ]; then
  cp "$OUT"/moe-configs/*.json python/sglang/srt/layers/moe/configs/ 2>/dev/null
  tar -czf "$OUT/moe-configs.tar.gz" -C "$OUT/moe-configs" . && rm -rf "$OUT/moe-configs"
fi
bench 90 moe python3 benchmark/gpu/bench_kernels.py --moe --reps 10
# attention (issue 55): extend attention at the 80B's heads, 8k tokens without and after 24k cached keys,
# the Triton kernel vs torch's FlashAttention-2 varlen kernel (flash_extend.py), with TFLOP/s
bench 90 attention python3 benchmark/gpu/bench_kernels.py --attention --reps 10
# real_80b / real_nemotron / real_35b (issue 55, item 1): bench_real_shapes.py, one slice each (Qwen3-Next-80B
# 4 of 48 layers, 14.4 GB; Nemotron-H-8B 13 of 52, 5.7 GB; Qwen3.5-35B-A3B 4 of 40, 8.8 GB), written on the
# GPU into .gpu-cache/slices (kept for the next call on a warm machine), decode at batch 1/8/64/256 and
# prefill at 8k/32k against their floors, the full models by layer count. Not yet run on a GPU: the 80B
# step is sized at ~3 min (writing 14.4 GB, loading, graph capture, 4 batches, 2 prefills):
#   OUT=$OUT GPU_DEADLINE_S=570 bash benchmark/gpu/run_gpu_checks.sh real_80b real_35b real_nemotron
REAL="python3 benchmark/gpu/bench_real_shapes.py --ckpt-dir .gpu-cache/slices --models"
bench 200 real_80b $REAL qwen3-next-80b --kernel-table
# real_80b_verify (issue 57): the same slice's decode steps and a speculative verify of 4 positions (the
# target's verify rows and graphs, as NEXTN with 3 drafts runs them) at batch 1 and 8: verify / decode
bench 150 real_80b_verify $REAL qwen3-next-80b --verify-width 4 --batches 1,8 --prefill 8192
# real_80b_fp8 (issue 53's target: FP8 decode at batch 64 / 256 at least 1.6x bf16's tokens/s): the same
# bf16 slice quantized at load (--quantization fp8: block FP8 weights, the FP8 experts), the same rows
bench 200 real_80b_fp8 $REAL qwen3-next-80b --quantization fp8
# real_80b_unstacked: real_80b with SGLANG_STACK_LINEARS=0 (the router and the shared gate, the GDN's two
# input projections, each its own GEMM again: 7 launches more per MoE + GDN layer), after real_80b in the
# same call, so that the decode rows' ratio is the stacking's (~40 s with the slice written)
bench 120 real_80b_unstacked env SGLANG_STACK_LINEARS=0 $REAL qwen3-next-80b
bench 170 real_35b $REAL qwen3.5-35b-a3b
bench 150 real_nemotron $REAL nemotron-h-8b
# serving_80b (issue 55, item 5): bench_serving_strategies.py, the three strategies' servers on the 80B slice
# in rotated order over 2 rounds, caches warm; a call of its own (6 server starts of ~40 s).
bench 540 serving_80b python3 benchmark/gpu/bench_serving_strategies.py --slice qwen3-next-80b \
  --ckpt-dir .gpu-cache/slices --rounds 2
# warm_start / warm_start_80b (issue 55, item 4): bench_server_startup.py starts a server, prints its time
# to healthy and where it went (weights, pools, graphs, warm-up request, shape warm-up), then runs
# bench_serving twice (same requests, cache flushed, no bench warm-up): each run's throughput and the
# kernels Triton compiled during it (new cache entries; the goal: none, and first / second within 5 %).
# warm_start uses the 147M checkpoint (~2 min on a fresh machine, not yet run), written first if absent,
# inside the step's limit; warm_start_80b the 14.4 GB slice that real_80b leaves in .gpu-cache/slices
# (goal: healthy within 30 s): without it the summary says "skipped (no slice)".
STARTUP="python3 benchmark/bench_server_startup.py --reps 1 --serving-runs 2 --"
BIG147=/tmp/sglang-bench-147m
WRITE147="[ -f $BIG147/config.json ] || python3 -c 'import sys; sys.path.insert(0, \"benchmark/gpu\"); \
from pathlib import Path; from bench_engine_vs_hf import write_checkpoint; \
write_checkpoint(Path(\"$BIG147\"), small=False)'"
bench 150 warm_start bash -c "$WRITE147 && exec $STARTUP --model-path $BIG147 --device cuda --dtype bfloat16"
SLICE80=.gpu-cache/slices/qwen3-next-80b
if [ -f $SLICE80/config.json ] || [ -n "${GPU_DRY_RUN:-}" ]; then  # (the dry run: its plan, slice or not)
  bench 200 warm_start_80b $STARTUP --model-path $SLICE80 --device cuda
  [ -n "${GPU_DRY_RUN:-}" ] && [ ! -f $SLICE80/config.json ] && [[ $steps == *" warm_start_80b "* ]] &&
    echo "bench warm_start_80b: (skipped unless real_80b has written $SLICE80 by then)" >> "$OUT/summary.txt"
elif [[ $steps == *" warm_start_80b "* ]]; then
  echo "bench warm_start_80b: skipped (no slice: real_80b writes $SLICE80, in this call or an earlier one)" \
    >> "$OUT/summary.txt"
fi
grep -h '^last start\|^serving run\|^first / second\|^time to healthy' "$OUT/bench.log" >> "$OUT/summary.txt" 2>/dev/null
if [ -f "$OUT/bench.log" ]; then grep '^{\|^|' "$OUT/bench.log" >> "$OUT/summary.txt"; fi
