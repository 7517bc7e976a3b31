"""Model tests run torch with one intra-op thread: the tiny presets' ops are too small to gain from a
second one, and when another process keeps a core busy, two OpenMP workers wait on each other (a 512-token
prefill measured 25 ms with one thread and 1-7 s with two on a loaded 2-core machine)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
