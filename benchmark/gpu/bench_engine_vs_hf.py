"""The engine against Hugging Face `generate` on a GPU, same random checkpoint, in one run:

    python benchmark/gpu/bench_engine_vs_hf.py                       # on the GPU machine, ~2 min
    python benchmark/gpu/bench_engine_vs_hf.py --device cpu --small  # a CPU check of the script

The checkpoint: a random Qwen3-Next of ~150M parameters (hidden 1,024, 8 layers = 6 Gated DeltaNet + 2
attention, 16 experts top-2), bfloat16, written once with transformers' own classes (the shape of the
facts file's measurement, where the project served 0.47x of HF). Workload: 64 prompts x (256 input +
128 output) tokens, greedy with `ignore_eos`, all sent at once; HF generates them as one batch. Engine
runs: CUDA graphs on and off (`--disable-cuda-graph`). Prints output tok/s and the engine's speed over
HF's (HF time / engine time), medians of `--reps` runs, HF and engine alternating.
`--batch-log`: the engine logs upstream's "Prefill batch." lines and a "Decode batch." line every 16
decode batches (their generation throughput: how far decode is from the step time alone).
Each row also splits the engine's last timed run by the scheduler's `loop_times` (get_internal_state,
`scheduler_components/loop_times.py`): its loop's seconds waiting for messages (`idle`: requests on
their way from the tokenizer, or nothing to do), taking them in, building, launching, waiting for
results and processing them, the forward stream's host time, the batches by kind, and `untimed`, the
wall time left (the loop's untimed bits, and the idle poll in progress when the run starts, up to 50 ms,
which counts before it). The detokenizer's and tokenizer's work after the last result is in `idle`.
`--host-profile`: the CUDA-graph run only, its scheduler process under cProfile (SGLANG_CPROFILE_DIR),
and the functions with the most own time printed after it (the times are inflated by the profiling).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from sglang.srt.environ import envs
from sglang.srt.managers.scheduler_components.loop_times import PARTS
from sglang.srt.utils.host_profile import top_rows

_T0 = time.perf_counter()


def progress(what: str) -> None:
    """A timestamped line on stderr, so a run stopped at its time limit shows where the time went."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {what}", file=sys.stderr, flush=True)


def write_checkpoint(out: Path, small: bool) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    from sglang.tools.make_tiny_model import build_tokenizer

    width = (
        dict(hidden_size=128, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32) if small else {}
    )
    fields = dict(
        vocab_size=2048,
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        num_hidden_layers=8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        num_experts=16,
        num_experts_per_tok=2,
        intermediate_size=1024,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    config = Qwen3NextConfig(**{**fields, **width})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["full_attention_interval"] = 4
    (out / "config.json").write_text(json.dumps(cfg))
    build_tokenizer().save_pretrained(out)
    return out


class Hf:
    def __init__(self, path: Path, device: str, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.device = device
        self.params = sum(p.numel() for p in self.model.parameters())

    def generate(self, prompts: list[list[int]], out_len: int) -> None:
        with torch.no_grad():
            self.model.generate(
                torch.tensor(prompts, device=self.device),
                attention_mask=torch.ones(
                    len(prompts), len(prompts[0]), dtype=torch.long, device=self.device
                ),
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                do_sample=False,
            )
        if self.device == "cuda":
            torch.cuda.synchronize()


class Eng:
    def __init__(self, path: Path, device: str, dtype: str, batch_log: bool = False, **kwargs):
        from sglang import Engine

        logs = dict(log_level="info", decode_log_interval=16) if batch_log else dict(log_level="warning")
        self.engine = Engine(model_path=str(path), device=device, dtype=dtype, **logs, **kwargs)

    def generate(self, prompts: list[list[int]], out_len: int) -> None:
        sampling = {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0}
        outs = self.engine.generate(input_ids=prompts, sampling_params=sampling)
        assert all(len(o["output_ids"]) == out_len for o in outs)

    def flush(self) -> None:
        assert self.engine.flush_cache().success

    def loop_times(self) -> dict:
        return self.engine.get_internal_state()["loop_times"]


def loop_split(before: dict, after: dict, wall: float) -> dict:
    """`loop_times` over one run (after - before), and the wall time its parts leave untimed."""
    delta = {k: round(after[k] - before[k], 4) for k in after}
    delta["untimed"] = round(wall - sum(delta[k] for k in PARTS), 4)
    return delta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a narrow model and few prompts (CPU check)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--host-profile", action="store_true", help="profile the scheduler (graphs run only)")
    parser.add_argument("--batch-log", action="store_true", help="the engine's prefill / decode batch lines")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    n, in_len, out_len = (4, 32, 8) if args.small else (64, 256, 128)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 2000) for _ in range(in_len)] for _ in range(n)]
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp), args.small)
        progress("checkpoint written")
        hf = Hf(path, args.device, getattr(torch, dtype))
        progress("HF model loaded")
        runs = {"engine, CUDA graphs": {}, "engine, no CUDA graph": {"disable_cuda_graph": True}}
        if args.device != "cuda":
            runs = {"engine": {}}
        if args.host_profile:
            runs = dict(list(runs.items())[:1])
        for name, kwargs in runs.items():
            with envs.SGLANG_CPROFILE_DIR.override(str(Path(tmp) / "prof") if args.host_profile else None):
                eng = Eng(path, args.device, dtype, args.batch_log, **kwargs)
            progress(f"{name}: started")
            try:
                hf.generate(prompts, out_len)  # warm-up
                progress("HF warm-up done")
                eng.generate(prompts, out_len)
                progress(f"{name}: warm-up done")
                hf_t, eng_t = [], []
                for _ in range(args.reps):
                    t = time.perf_counter()
                    hf.generate(prompts, out_len)
                    hf_t.append(time.perf_counter() - t)
                    eng.flush()
                    before = eng.loop_times()
                    t = time.perf_counter()
                    eng.generate(prompts, out_len)
                    eng_t.append(time.perf_counter() - t)
                    split = loop_split(before, eng.loop_times(), eng_t[-1])
                    progress(f"HF {hf_t[-1]:.2f} s, {name} {eng_t[-1]:.2f} s; engine loop: {split}")
            finally:
                eng.engine.shutdown()
            tokens = n * out_len
            rows.append({
                "run": name, "params_M": round(hf.params / 1e6, 1), "workload": f"{n} x ({in_len} + {out_len})",
                "hf_tok_per_s": round(tokens / statistics.median(hf_t), 1),
                "engine_tok_per_s": round(tokens / statistics.median(eng_t), 1),
                "engine_over_hf": round(statistics.median(h / e for h, e in zip(hf_t, eng_t, strict=True)), 2),
                "engine_loop_seconds_last_run": split,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        for profile in (Path(tmp) / "prof").glob("*.prof"):
            print(f"{profile.name}, by own time:\n" + "".join(f"    {r}\n" for r in top_rows(profile, 30)))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
