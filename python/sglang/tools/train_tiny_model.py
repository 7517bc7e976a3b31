"""Train the built-in demo model `tiny-qwen3-next-demo`: a small Qwen3-Next (Gated DeltaNet + full
attention + MoE, transformers' own classes) that writes readable Python, trained on a CPU in minutes.

    python -m sglang.tools.train_tiny_model --out python/sglang/tools/data/tiny-qwen3-next-demo

then trains its MTP layer (the NEXTN draft, `train_mtp.py`) with the base frozen; `--mtp-only` trains
just that layer on a trained checkpoint, leaving its base tensors as they are.

The text is the Python standard library's own modules (`*.py` under `sysconfig`'s stdlib folder, without
test suites, installed packages and the files a build writes for one installation):
it is on every machine that runs this project, it is real, varied, well-formed text in one language,
and the Python Software Foundation License allows redistributing works derived from it. A few modules
are held out (`HELD_OUT`) and never trained on; the loss on them is reported and kept with the weights
(`training.json`), and the tests check the shipped weights against it.

Deterministic: the same Python release, library versions (torch, transformers, tokenizers), CPU kind and
`--seed` give bit-identical files (the corpus is that Python's stdlib; torch runs with 2 threads).
`LICENSE-PSF.txt`, the stdlib's license, is copied next to the weights. The tokenizer is a byte-level BPE trained on the same text, with the ChatML template
of the random presets.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch

from sglang.tools.make_tiny_model import IM_END_ID, MAX_POSITIONS, PAD_ID, build_tokenizer, save_model
from sglang.tools.train_mtp import MTP_DEFAULTS, MTP_SEQ_LEN, train_mtp

# Modules present in every Python from 3.10 on, never trained on.
HELD_OUT = ("textwrap.py", "heapq.py", "bisect.py", "fnmatch.py", "colorsys.py", "shlex.py")
# Not trained on: test suites (huge, repetitive), installed packages, demos, Python 2 era code, codec
# tables, pydoc's English topic texts, and what the build writes for one installation (paths, flags).
SKIPPED_DIRS = {
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo", "lib2to3",
    "encodings", "pydoc_data",
}  # fmt: skip
SKIPPED_PREFIXES = ("_sysconfigdata", "config-")
VOCAB_SIZE = 2048
SEQ_LEN = 256
DEFAULTS = {"steps": 1200, "batch_size": 16, "lr": 3e-3, "seed": 0}


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of this Python's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if p.is_file() and _is_source(p.relative_to(root).parts))
    held = [p for p in files if p.name in HELD_OUT]
    if len(held) != len(HELD_OUT):
        raise SystemExit(f"The standard library at {root} lacks some of {HELD_OUT}.")
    return [p for p in files if p.name not in HELD_OUT], held


def _is_source(parts: tuple[str, ...]) -> bool:
    return not SKIPPED_DIRS.intersection(parts[:-1]) and not any(
        p.startswith(SKIPPED_PREFIXES) for p in parts
    )


def read(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def demo_config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=PAD_ID,
        bos_token_id=None,
        eos_token_id=IM_END_ID,
        tie_word_embeddings=False,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        initializer_range=0.02,
    )


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """The files' tokens, each file followed by <|endoftext|> (the model learns where a file ends)."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [PAD_ID]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor) -> float:
    """Mean next-token loss (nats) over all consecutive SEQ_LEN windows of the held-out text."""
    model.eval()
    n = (len(stream) - 1) // SEQ_LEN
    total = 0.0
    for i in range(n):
        window = stream[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1].unsqueeze(0)
        total += model(input_ids=window[:, :-1], labels=window[:, :-1]).loss.item()
    model.train()
    return total / n


def train(
    out: Path,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    max_files: int | None = None,
    command: str = "",
    mtp_args: dict | None = None,
) -> dict:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, GenerationConfig

    start = time.monotonic()
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    train_files, held_files = corpus_files()
    train_files = train_files[:max_files]
    train_texts, held_texts = read(train_files), read(held_files)
    tokenizer = build_tokenizer(train_texts, VOCAB_SIZE)
    train_ids, held_ids = token_stream(tokenizer, train_texts), token_stream(tokenizer, held_texts)

    model = AutoModelForCausalLM.from_config(demo_config(), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:  # linear warmup, cosine down to a tenth
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(seed)
    bar = tqdm(range(steps), desc="training", unit="step")
    loss_ema = None
    for _ in bar:
        starts = torch.randint(0, len(train_ids) - SEQ_LEN - 1, (batch_size,), generator=gen)
        batch = torch.stack([train_ids[s : s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{loss_ema:.3f}")

    held = held_out_loss(model, held_ids)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out)
    config_path = out / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["full_attention_interval"] = 4  # as the random presets: SGLang-style loaders read the interval
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(eos_token_id=[IM_END_ID, PAD_ID], pad_token_id=PAD_ID, do_sample=False).save_pretrained(
        out
    )
    tokenizer.save_pretrained(out)
    # The text it learned from is the PSF's: its license asks for the notice to travel with derived works.
    license_file = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if license_file.is_file():
        shutil.copyfile(license_file, out / "LICENSE-PSF.txt")
    (out / "model.safetensors").chmod(0o644)
    report = {
        "command": command,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": SEQ_LEN,
        "lr": lr,
        "parameters": params,
        "train_files": len(train_files),
        "train_tokens": len(train_ids),
        "held_out_files": [p.name for p in held_files],
        "held_out_tokens": len(held_ids),
        "final_train_loss_ema": round(loss_ema, 4),
        "held_out_loss": round(held, 4),
        "held_out_perplexity": round(math.exp(held), 2),
        "minutes": round((time.monotonic() - start) / 60, 1),  # the whole run: tokenizer, training, eval
    }
    report["mtp"] = train_mtp(out, train_ids, held_ids, MTP_SEQ_LEN, **_mtp_args(mtp_args), seed=seed)
    (out / "model.safetensors").chmod(0o644)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _mtp_args(given: dict | None) -> dict:
    args = {**MTP_DEFAULTS, **(given or {})}
    keys = ("steps", "batch_size", "lr", "windows")
    return {key: args[f"mtp_{key}"] for key in keys}


def train_mtp_only(out: Path, seed: int, mtp_args: dict | None = None, command: str = "") -> dict:
    """Train the MTP layer of the trained checkpoint in `out` on the same text (its own tokenizer),
    and add it to `out`'s training.json."""
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    train_files, held_files = corpus_files()
    tokenizer = AutoTokenizer.from_pretrained(out)
    train_ids = token_stream(tokenizer, read(train_files))
    held_ids = token_stream(tokenizer, read(held_files))
    entry = train_mtp(out, train_ids, held_ids, MTP_SEQ_LEN, **_mtp_args(mtp_args), seed=seed)
    entry["command"] = command
    path = out / "training.json"
    report = json.loads(path.read_text())
    report["mtp"] = entry
    path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True, help="Folder to write the checkpoint into.")
    for name, value in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    for name, value in MTP_DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument(
        "--max-files", type=int, default=None, help="Train on the first N files only (tests)."
    )
    parser.add_argument(
        "--mtp-only", action="store_true", help="Train only the MTP layer of the checkpoint at --out."
    )
    args = parser.parse_args(argv)
    command = "python -m sglang.tools.train_tiny_model " + " ".join(sys.argv[1:] if argv is None else argv)
    mtp_args = {name: getattr(args, name) for name in MTP_DEFAULTS}
    if args.mtp_only:
        mtp = train_mtp_only(Path(args.out), args.seed, mtp_args, command)["mtp"]
        print(
            f"Trained the MTP layer ({mtp['parameters']:,} parameters) in {mtp['minutes']} min: held-out "
            f"next-next-token loss {mtp['held_out_loss_next_next_token']}; wrote {args.out}"
        )
        return
    report = train(
        Path(args.out), args.steps, args.batch_size, args.lr, args.seed, args.max_files, command, mtp_args
    )
    print(
        f"Trained {report['parameters']:,} parameters on {report['train_tokens']:,} tokens in "
        f"{report['minutes']} min: held-out loss {report['held_out_loss']} nats/token "
        f"(perplexity {report['held_out_perplexity']}); wrote {args.out}"
    )


if __name__ == "__main__":
    main()
