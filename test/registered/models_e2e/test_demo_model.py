"""The built-in demo model `tiny-qwen3-next-demo` (trained by `sglang.tools.train_tiny_model`, shipped with
the package): its weights still model the held-out text (a corrupted or swapped file is caught), and the
server's greedy completion equals transformers' under every mamba strategy and writes Python."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import pytest
import torch

import sglang
from sglang.srt.configs.presets import resolve_model_path
from sglang.test.ci_register import full_matrix, register_cpu_ci
from sglang.test.test_utils import looks_like_python
from sglang.tools.train_tiny_model import corpus_files, held_out_loss, read, token_stream

register_cpu_ci(est_time=65, suite="per-commit-cpu")

DEMO = "tiny-qwen3-next-demo"
PROMPT = "def fibonacci(n):"
# Held-out loss the shipped weights must stay under, in nats per token. An untrained model scores
# ln(2048) = 7.6 and one that learned only token frequencies ~5.5; the shipped one scores what
# training.json records (3.51 on Python 3.11.7, on modules it never saw). Damaged weights (a flipped or
# zeroed tensor, a truncated file, a random preset's weights) land far above 4.0, while another Python's
# version of the held-out modules moves the loss by a few hundredths.
MAX_HELD_OUT_LOSS = 4.0


@pytest.fixture(scope="module")
def demo_path() -> str:
    return resolve_model_path(DEMO)


@pytest.mark.skipif(
    not full_matrix(), reason="the shipped weights' held-out loss through transformers: in the nightly full matrix"
)
def test_the_shipped_weights_model_the_held_out_text(demo_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(demo_path)
    _, held = corpus_files()
    loss = held_out_loss(model, token_stream(tokenizer, read(held)))
    report = json.loads(Path(demo_path, "training.json").read_text())
    print(f"held-out loss {loss:.4f} nats/token (training.json: {report['held_out_loss']})")
    assert loss < MAX_HELD_OUT_LOSS
    if platform.python_version() == report["python"]:  # the very same held-out text
        assert math.isclose(loss, report["held_out_loss"], abs_tol=2e-3)


@pytest.fixture(scope="module")
def long_prompt() -> str:
    """Longer than the cache chunk (64 tokens), so a repeat can hit a checkpoint: the head of a held-out
    module, ending inside a function."""
    text = next(p for p in corpus_files()[1] if p.name == "heapq.py").read_text()
    return text[text.index("def heappush") :][:600]


@pytest.fixture(scope="module")
def hf_completion(demo_path, long_prompt) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(demo_path)(long_prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=48, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_the_demo_serves_python_under_every_strategy(strategy, hf_completion, long_prompt):
    engine = sglang.Engine(model_path=DEMO, mamba_scheduler_strategy=strategy)
    try:
        params = {"max_new_tokens": 48, "temperature": 0}
        first = engine.generate(long_prompt, params)
        again = engine.generate(long_prompt, params)  # a prefix hit
    finally:
        engine.shutdown()
    print(f"{strategy}: ...{long_prompt[-80:]}{first['text']}")
    assert first["output_ids"] == hf_completion  # both stop on the same eos ids, or at 48 tokens
    assert again["output_ids"] == first["output_ids"]
    if strategy != "no_buffer":  # no_buffer's only snapshot of a prompt is its full length: an exact
        # repeat cannot use it (bench_exact_repeat.py), the extra-buffer strategies' checkpoint can
        assert again["meta_info"]["cached_tokens"] > 0, "the repeat did not hit the prefix cache"
    assert looks_like_python(first["text"]), first["text"]


def test_the_chat_template_is_chatml(demo_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"


def test_the_training_command_is_deterministic_and_its_checkpoint_serves(tmp_path):
    """The script itself, cut short (20 files, 3 steps): a training report and a folder the server loads;
    run twice, bit-identical files (the second run in the nightly full matrix: ~10 s per commit)."""
    import hashlib
    import subprocess
    import sys

    def run(out: Path) -> dict[str, str]:
        cmd = [sys.executable, "-m", "sglang.tools.train_tiny_model", "--out", str(out), "--steps", "3",
               "--batch-size", "2", "--max-files", "20", "--mtp-steps", "2", "--mtp-batch-size", "2",
               "--mtp-windows", "4"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "training: 100%" in proc.stderr  # the progress bar
        return {
            f: hashlib.sha256((out / f).read_bytes()).hexdigest()
            for f in ("model.safetensors", "tokenizer.json")
        }

    first, second = tmp_path / "a", tmp_path / "b"
    files = run(first)
    if full_matrix():
        assert run(second) == files
    report = json.loads((first / "training.json").read_text())
    assert report["steps"] == 3 and report["train_files"] == 20 and report["held_out_loss"] > 0
    assert report["mtp"]["steps"] == 2 and report["mtp"]["held_out_loss_next_next_token"] > 0
    engine = sglang.Engine(model_path=str(first))
    try:
        assert len(engine.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0})["output_ids"]) == 4
    finally:
        engine.shutdown()
