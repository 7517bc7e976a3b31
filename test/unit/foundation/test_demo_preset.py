"""The demo model is the default and resolves to the shipped folder; `looks_like_python`, which the demo
and README tests rely on, tells Python from prose and noise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import sglang
from sglang.srt.configs.presets import SHIPPED, is_preset, resolve_model_path
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import looks_like_python

register_cpu_ci(est_time=2, suite="per-commit-cpu")

ROOT = Path(sglang.__file__).resolve().parents[2]


def test_the_demo_is_the_default_model_and_ships_with_the_package():
    assert ServerArgs().model_path == "tiny-qwen3-next-demo" and is_preset("tiny-qwen3-next-demo")
    folder = Path(resolve_model_path("tiny-qwen3-next-demo"))
    assert folder == SHIPPED["tiny-qwen3-next-demo"]
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "training.json", "LICENSE-PSF.txt"} <= names
    # Every file of the folder is package data (a wheel carries it).
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"tools/data/tiny-qwen3-next-demo/\*"', pyproject)
    assert "tiny-qwen3-next-demo" in (ROOT / "Makefile").read_text()


@pytest.mark.parametrize(
    "text",
    [
        'def push(self, item):\n    """Add an item."""\n    self.items.append(item)\n    return None',
        "    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    ],
)
def test_python_looks_like_python(text):
    assert looks_like_python(text)


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris, and if you visit it you will see the Eiffel tower.",
        "La capitale de la France est Paris, et si vous la visitez vous verrez la tour Eiffel.",
        "フランスの首都はパリです。 エッフェル塔 があります。 とても きれい です。",
        "aaaa bbbb cccc dddd eeee",
        "\ufffdolday til1 be ay\ufffd h se \ufffd\ufffd\ufffdith token",
        "",
    ],
)
def test_prose_and_noise_do_not(text):
    assert not looks_like_python(text)
