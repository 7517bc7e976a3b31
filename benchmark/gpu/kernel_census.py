"""Kernels per decode step on the CUDA path, counted without a GPU: the model and its pools on torch's
`meta` device standing in for CUDA, with the kernels CUDA runs by default (Triton attention and
linear-attention decode, the CUDA-graph decode body); every aten op that runs a kernel (views left out)
and every Triton launch is counted over one decode step, by op and by the line of the runtime that
issued it. On CUDA each is about one launch: a CUDA graph replays them all, at ~2 us each at small
batches (benchmark/gpu/README.md), so this count is what fusion has to bring down.

    python benchmark/gpu/kernel_census.py                      # tiny-qwen3-next, bfloat16, batch 1
    python benchmark/gpu/kernel_census.py --model tiny-nemotron-h --batch 64 --top 30
    python benchmark/gpu/kernel_census.py --batch 1 8 64                 # a summary line per batch size
    python benchmark/gpu/kernel_census.py --env SGLANG_GPU_NORM_BACKEND=torch  # the norms' torch form
    python benchmark/gpu/kernel_census.py --quantization fp8 --override moe_intermediate_size=128 \
        --override shared_expert_intermediate_size=128   # FP8 at an expert width of whole scale blocks
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

import torch


class _OneLaunchStateCopy:
    """The GPU state-copy kernel's stand-in: one launch per op, as the Triton and CUDA ones take."""

    name = "one-launch"

    def __init__(self, launches) -> None:
        self.launches = launches

    def copy(self, src, dst, mask) -> None:
        self.launches.calls.append(("state_copy", {"meta"}))

    def clear(self, slots) -> None:
        self.launches.calls.append(("state_clear", {"meta"}))


def _fp8_as_on_cuda(launches) -> None:
    """FP8 laid out and run as on CUDA, on the meta device: FP8 linears (`Fp8BlockLinear` with the
    Triton block GEMM) and FP8 experts, the FP8 kernels' launches recorded."""
    from sglang.srt.layers import stacked_linears
    from sglang.srt.layers.quantization import fp8, fp8_kernel
    from sglang.srt.models import registry

    fp8_kernel.jit_for_env = launches
    fp8_kernel.triton_serves = lambda t: True
    fp8.fp8_block_kernel = stacked_linears.fp8_block_kernel = lambda device: fp8_kernel.w8a8_block_fp8_matmul
    registry.fp8_layout = lambda config, device: None if config is None else fp8.Fp8Layout(True, True)


def census(
    model: str, batch: int, dtype: str, env: dict | None = None, quantization: str | None = None
) -> tuple[Counter, Counter, Counter, Counter]:
    """(ops by name, ops by runtime line, Triton launches by kernel, and the ops outside the CUDA graph's
    body by runtime line) of one decode step of `batch`, run as the engine runs it (the forward worker,
    its input ids placeholders for the previous step's tokens), with CUDA's default kernels unless
    `env` overrides a choice. Outside the body each op is a launch of its own on every step."""
    from sglang.test.device_audit import CUDA_DEFAULT_ENV, DeviceAudit, OpCensus, RecordedLaunches

    os.environ.update({**CUDA_DEFAULT_ENV, **(env or {})})
    launches = RecordedLaunches()
    for module, name, value in launches.patches():
        setattr(module, name, value)
    if quantization:
        _fp8_as_on_cuda(launches)

    from sglang.srt.environ import envs
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.srt.model_executor.forward_worker import ForwardWorker, LaunchedBatch, placeholders
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs
    from sglang.test.runner_driver import Extend, RunnerDriver

    args = ServerArgs(
        model_path=model, dtype=dtype, attention_backend="triton", page_size=16, max_total_tokens=16384,
        max_mamba_cache_size=3 * batch + 8, max_running_requests=batch, mamba_scheduler_strategy="extra_buffer",
        quantization=quantization,
    )  # fmt: skip
    args.device = "meta"  # after validation, which accepts only the devices users may name
    with DeviceAudit(), envs.SGLANG_MAMBA_STATE_COPY_BACKEND.override("torch"):
        runner = ModelRunner(args)
        runner.mamba_pool.state_copier._impl = _OneLaunchStateCopy(launches)
        # The captured body, run eagerly (no GPU here), its ops marked.
        graphs = runner.graph_runner = CudaGraphRunner(runner, [batch], use_graphs=False)
        body, in_body = graphs._body, []
        from sglang.srt.utils.graph_capture import graph_body

        def marked_body(fb):
            in_body.append(True)
            try:
                with graph_body():  # (the body as a capture runs it)
                    return body(fb)
            finally:
                in_body.pop()

        graphs._body = marked_body
        driver = RunnerDriver(runner)
        worker = ForwardWorker(runner, future_size=2 * batch, inline=True)
        reqs = [driver.new_request() for _ in range(batch)]
        driver.extend([Extend(r, [5] * 32) for r in reqs], return_logprob=False)
        fb = driver.decode_batch(reqs, input_ids=list(placeholders(range(batch))), return_logprob=False)
        launches.calls.clear()
        with OpCensus(in_body=in_body) as ops:
            step = LaunchedBatch(fb, future_slots=range(batch, 2 * batch), has_placeholders=True)
            worker._run_batch(step)
    device_ops = [(name, where, inside) for name, where, inside in ops.ops if where != "?"]
    return (
        Counter(name for name, _, _ in device_ops),
        Counter(where for _, where, _ in device_ops),
        Counter(name for name, _ in launches.calls),
        Counter(where for _, where, inside in device_ops if not inside),
    )


def _variant(preset: str, overrides: dict[str, str]) -> str:
    """A random checkpoint of `preset`'s architecture with `overrides` (JSON values) on its config."""
    import atexit
    import shutil
    import tempfile

    from sglang.srt.configs.presets import PRESETS
    from sglang.tools.make_tiny_model import make_tiny_model

    out = tempfile.mkdtemp(prefix="census-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return str(make_tiny_model(PRESETS[preset], out, overrides={k: json.loads(v) for k, v in overrides.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen3-next")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="one JSON line per size; details: the first")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE over the CUDA defaults")
    parser.add_argument("--quantization", choices=["fp8"], help="FP8 as CUDA runs it (quantized at load)")
    parser.add_argument(
        "--override", action="append", default=[],
        help="KEY=VALUE (a JSON value) on the preset's config: a variant written to a temporary folder",
    )  # fmt: skip
    args = parser.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    if args.override:
        args.model = _variant(args.model, dict(kv.split("=", 1) for kv in args.override))
    runs = [(batch, census(args.model, batch, args.dtype, env, args.quantization)) for batch in args.batch]
    for batch, (by_op, _, triton, outside) in runs:
        total = sum(by_op.values()) + sum(triton.values())
        print(json.dumps({"model": args.model, "batch": batch, "dtype": args.dtype, "env": env,
                          "quantization": args.quantization, "kernels": total,
                          "aten": sum(by_op.values()), "triton": sum(triton.values()),
                          "outside_graph": sum(outside.values()), "triton_by_kernel": dict(triton)}))  # fmt: skip
    by_op, by_line, triton, outside = runs[0][1]
    print("\nby aten op:")
    for name, n in by_op.most_common(args.top):
        print(f"  {n:5d}  {name}")
    print("\nby runtime line:")
    for where, n in by_line.most_common(args.top):
        print(f"  {n:5d}  {where}")
    print("\noutside the CUDA graph's body (eager at every step; besides the replay, the static inputs' load")
    print("and the result copy):")
    for where, n in outside.most_common():
        print(f"  {n:5d}  {where}")
    print("\nTriton launches:")
    for name, n in triton.most_common():
        print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
