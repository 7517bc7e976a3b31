#!/usr/bin/env bash
# Everything a session lent the GPU test machine should run, in one device `run` call (carry `.whl`, made by
# `../shared/gpu/fetch-offline-wheels.sh fla-core==0.6.0` beforehand): the wheels, the GPU tests (marked
# `gpu`), the kernel and engine benchmarks. Logs and JSON go to $OUT (default /tmp/gpu-out).
#   bash benchmark/gpu/run_gpu_checks.sh            # tests and benchmarks, ~8 min
#   bash benchmark/gpu/run_gpu_checks.sh tests      # only the GPU tests
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD/python SGLANG_CACHE_DIR=$PWD/.sgcache PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" > "$OUT/versions.txt" 2>&1
python3 -m pytest -q -m gpu -p no:cacheprovider test/unit > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests: exit $?" | tee -a "$OUT/summary.txt"
tail -5 "$OUT/gpu-tests.log"
[ "${1:-all}" = tests ] && exit 0
timeout 240 python3 benchmark/gpu/bench_kernels.py --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
echo "bench_kernels: exit $?" | tee -a "$OUT/summary.txt"
timeout 120 python3 benchmark/bench_sampler.py --device cuda --reps 9 > "$OUT/sampler.log" 2>&1
echo "bench_sampler: exit $?" | tee -a "$OUT/summary.txt"
timeout 300 python3 benchmark/gpu/bench_engine_vs_hf.py --out "$OUT/engine_vs_hf.json" > "$OUT/engine_vs_hf.log" 2>&1
echo "bench_engine_vs_hf: exit $?" | tee -a "$OUT/summary.txt"
cat "$OUT/sampler.log"
cat "$OUT/kernels.log" "$OUT/engine_vs_hf.log" | grep '^{' || true
