"""Shared fixtures: the tiny presets and their transformers oracles, generated once per session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The full accounting walk whenever a scheduler goes idle, in-process and in every server the tests
# start (production runs the O(1) count check instead).
os.environ.setdefault("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "1")
# Under TP the ranks compare every step's sampled tokens (`model_runner.agree_on_tokens`).
os.environ.setdefault("SGLANG_ENABLE_STRICT_TP_TOKEN_CHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang.srt.configs.presets import PRESETS  # noqa: E402

# Two cores: one torch thread per process keeps parallel server/worker processes from thrashing.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Every random preset (`configs/presets.py`), generated once per session.
PRESET_NAMES = list(PRESETS)


@pytest.fixture(scope="session")
def preset_paths() -> dict[str, str]:
    from sglang.srt.configs.presets import resolve_model_path

    return {name: resolve_model_path(name) for name in PRESET_NAMES}


class _Oracles(dict):
    def __missing__(self, name: str):
        from sglang.test.reference import OracleMismatch, ReferenceModel

        try:
            self[name] = ReferenceModel(name)
        except OracleMismatch as e:  # an older transformers (the GPU machine's 5.17): no oracle here
            pytest.skip(str(e))
        return self[name]


@pytest.fixture(scope="session")
def oracles() -> dict:
    """oracles[preset] is the transformers reference model of the preset, built once per session."""
    return _Oracles()
