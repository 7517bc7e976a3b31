"""The prompts of a benchmark run, with upstream bench_serving's dataset names and flags.

- `random`: prompts of random tokens, input and output lengths drawn uniformly from
  [len * random_range_ratio, len].
- `generated-shared-prefix`: `gsp_num_groups` system prompts of `gsp_system_prompt_len` tokens, each
  followed by `gsp_prompts_per_group` questions of `gsp_question_len` tokens; the requests of all groups
  are interleaved, so a group's prefix is shared by requests that are in flight together.
- `sharegpt`: the first human/gpt turn pair of each conversation of a local ShareGPT JSON file
  (`--dataset-path`; nothing is downloaded).

Every prompt carries its token ids, so that `--tokenize-prompt` can send them as they are.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ["random", "generated-shared-prefix", "sharegpt"]
# ShareGPT pairs with a prompt or an answer shorter than this many tokens are skipped (too little to
# measure).
SHAREGPT_MIN_LEN = 4
MIN_WORD_TOKENS = 16


class DatasetError(ValueError):
    """A dataset flag that cannot work; the message names the flag."""


@dataclass
class DatasetRow:
    prompt: str
    prompt_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def sample_requests(args: Any, tokenizer: Any, max_input_len: int) -> list[DatasetRow]:
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        rows = _random_rows(args, tokenizer, rng)
    elif args.dataset_name == "generated-shared-prefix":
        rows = _shared_prefix_rows(args, tokenizer, rng)
    else:
        rows = _sharegpt_rows(args, tokenizer, rng, max_input_len)
    too_long = [r.prompt_len for r in rows if r.prompt_len > max_input_len]
    if too_long:
        raise DatasetError(
            f"--dataset-name {args.dataset_name} makes prompts of up to {max(too_long)} tokens, more than the "
            f"server's limit of {max_input_len}; use shorter lengths."
        )
    return rows


def _vocab(tokenizer: Any) -> list[int]:
    """Token ids to draw random prompts from: whole words (" word"), whose text tokenizes back into the
    same ids, so a text prompt has the length asked for (random byte pieces re-tokenize into ~1.5x as
    many tokens); any non-special token if the vocabulary has too few words."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(len(tokenizer)) if i not in special]
    words = []
    for i in ids:
        text = tokenizer.decode([i])
        if text.startswith(" ") and text[1:].isascii() and text[1:].isalpha():
            words.append(i)
    return words if len(words) >= MIN_WORD_TOKENS else ids


def _random_ids(rng: random.Random, vocab: list[int], n: int) -> list[int]:
    return [vocab[rng.randrange(len(vocab))] for _ in range(n)]


def _row(tokenizer: Any, ids: list[int], output_len: int) -> DatasetRow:
    return DatasetRow(tokenizer.decode(ids), ids, output_len)


def _random_rows(args: Any, tokenizer: Any, rng: random.Random) -> list[DatasetRow]:
    vocab = _vocab(tokenizer)
    ratio = args.random_range_ratio

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * ratio)), n)

    return [
        _row(
            tokenizer, _random_ids(rng, vocab, length(args.random_input_len)), length(args.random_output_len)
        )
        for _ in range(args.num_prompts)
    ]


def _shared_prefix_rows(args: Any, tokenizer: Any, rng: random.Random) -> list[DatasetRow]:
    vocab = _vocab(tokenizer)
    groups = []
    for _ in range(args.gsp_num_groups):
        system = _random_ids(rng, vocab, args.gsp_system_prompt_len)
        groups.append(
            [
                system + _random_ids(rng, vocab, args.gsp_question_len)
                for _ in range(args.gsp_prompts_per_group)
            ]
        )
    # Question k of every group, then question k + 1: each group's prefix is hit while it is still warm.
    return [
        _row(tokenizer, group[k], args.gsp_output_len)
        for k in range(args.gsp_prompts_per_group)
        for group in groups
    ]


def _sharegpt_rows(args: Any, tokenizer: Any, rng: random.Random, max_input_len: int) -> list[DatasetRow]:
    if not args.dataset_path:
        raise DatasetError("--dataset-name sharegpt needs --dataset-path (a local ShareGPT JSON file).")
    path = Path(args.dataset_path)
    try:
        conversations = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"--dataset-path {str(path)!r} is not a readable JSON file: {e}") from None
    pairs = []
    for conv in conversations if isinstance(conversations, list) else []:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if isinstance(turns, list) and len(turns) >= 2:
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    rng.shuffle(pairs)
    rows = []
    for prompt, answer in pairs:
        if len(rows) == args.num_prompts:
            break
        ids = tokenizer.encode(prompt)
        output_len = args.sharegpt_output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if len(ids) < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN or len(ids) > max_input_len:
            continue
        rows.append(DatasetRow(prompt, ids, output_len))
    if not rows:
        raise DatasetError(f"--dataset-path {str(path)!r} has no usable human/gpt conversation pairs.")
    return rows
