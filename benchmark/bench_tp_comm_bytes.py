"""Bytes a tensor-parallel rank sends through its TP group per decode step (issue 54, "Measured"): the
formula for a config, at TP 2 / 4 / 8 for the published Qwen3-Next-80B-A3B config, checked against a
counted decode step of a tiny preset on 2 gloo ranks (every all_reduce / all_gather of the TP group).

    python benchmark/bench_tp_comm_bytes.py [--batch 1 8 64]

Per decode step of B tokens (activations replicated on every rank, as the model side of this server runs
tensor parallelism): one all-reduce of [B, hidden] after the vocabulary-parallel embedding, one after each
layer's mixer (o_proj / out_proj, row-parallel) and one after each layer's MLP or MoE block (the routed
experts and the shared expert summed first, so one per block); one all-gather of the logits, each rank
putting in [B, vocab / tp]. A ring all-reduce of S bytes sends 2 (tp - 1) / tp x S per rank, a ring
all-gather (tp - 1) x its part: the "wire" columns.
"""

from __future__ import annotations

import argparse
import json
import runpy
from pathlib import Path

from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.configs.presets import resolve_model_path
from sglang.test.multi_rank import run_ranks
from sglang.test.tp_model_checks import count_decode_collectives

ROOT = Path(__file__).resolve().parents[1]


def decode_collectives(config, tp: int, batch: int, itemsize: int) -> dict[str, list[int]]:
    """The formula (module docstring): each call's bytes, by kind."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers, vocab = text.hidden_size, text.num_hidden_layers, text.vocab_size
    row = batch * hidden * itemsize
    padded_vocab = -(-vocab // tp) * tp
    return {
        "all_reduce": [row] * (1 + 2 * layers),
        "all_gather": [batch * padded_vocab // tp * itemsize],
    }


def wire(calls: dict[str, list[int]], tp: int) -> int:
    """Bytes one rank sends for these calls with ring collectives."""
    return int(sum(calls["all_reduce"]) * 2 * (tp - 1) / tp + sum(calls["all_gather"]) * (tp - 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    args = p.parse_args()

    # The check: a counted decode step on 2 ranks equals the formula, call by call.
    # (Qwen3.5-MoE with --ep-size 2: expert parallelism adds no collective.)
    for preset, ep in (("tiny-qwen3-next", 1), ("tiny-qwen3.5", 1), ("tiny-qwen3.5-moe", 2)):
        counted = run_ranks(count_decode_collectives, 2, preset, 3, ep)
        want = decode_collectives(load_hf_config(resolve_model_path(preset)), 2, 3, 4)  # float32
        for got in counted:
            assert got == want, (preset, got, want)
        print(f"{preset}, TP 2, EP {ep}, 3 requests: counted == formula ({len(want['all_reduce'])} all-reduces "
              f"of {want['all_reduce'][0]} B, 1 all-gather of {want['all_gather'][0]} B per rank)")  # fmt: skip

    real = runpy.run_path(str(ROOT / "test/unit/mem_cache/real_model_configs.py"))
    folder = Path("/tmp/qwen3-next-80b-config")
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(real["QWEN3_NEXT_80B_A3B_INSTRUCT"]))
    config = load_hf_config(str(folder))
    print("\nQwen3-Next-80B-A3B, bf16 activations, per rank per decode step:")
    print(
        "| TP | batch | all-reduces | all-reduced bytes | logits all-gather (own part) | wire bytes sent (ring) |"
    )
    print("|---|---|---|---|---|---|")
    for tp in (2, 4, 8):
        for b in args.batch:
            calls = decode_collectives(config, tp, b, 2)
            print(f"| {tp} | {b} | {len(calls['all_reduce'])} | {sum(calls['all_reduce']):,} | "
                  f"{sum(calls['all_gather']):,} | {wire(calls, tp):,} |")  # fmt: skip


if __name__ == "__main__":
    main()
