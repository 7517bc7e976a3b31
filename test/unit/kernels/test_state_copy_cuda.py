"""sgl-kernel's CUDA state-copy kernel, compiled for sm_90 by nvcc (the torch binding needs a CUDA torch,
so CI compiles the kernel source itself), and, on a GPU, every GPU implementation against the oracle."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from sglang.srt.mem_cache.state_copy import StateCopier
from sglang.srt.utils import sgl_kernel
from sglang.test.ci_register import register_cpu_ci
from sglang.test.state_copy_checks import (
    assert_same,
    disjoint_rows,
    expected_clear,
    expected_copy,
    make_states,
    poison,
)

register_cpu_ci(est_time=4, suite="per-commit-cpu")


def test_cuda_kernel_compiles_for_sm90(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    out = tmp_path / "state_copy_cuda.o"
    cmd = [
        nvcc,
        "-c",
        "-arch=sm_90",
        "-std=c++17",
        "-O3",
        str(sgl_kernel.SOURCE_DIR / "state_copy_cuda.cu"),
        "-o",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("impl", ["triton", "cuda", "torch"])
@pytest.mark.parametrize("n", [1, 8, 64, 256])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16)], ids=str)
def test_gpu_impls_match_the_oracle(impl, n, dtypes):
    num_slots = 2 * n + 3
    for shape in ("tiny", "odd"):
        states = make_states(num_slots, shape, dtypes, device="cuda", seed=n)
        src, dst = disjoint_rows(n, num_slots, seed=n)
        poison(states, dst + [0])
        want = expected_copy(states, src, dst)
        copier = StateCopier(states, impl)
        copier.copy(src, dst)
        assert_same(states, want)
        clear = [s for s in dst if s != 0] + [0, -1]
        want = expected_clear(states, clear)
        copier.clear(torch.tensor(clear, device="cuda"))
        assert_same(states, want)
        running, track = disjoint_rows(n, num_slots, seed=n + 1)
        mask = [i % 3 != 1 for i in range(n)]
        poison(states, track + [0])
        want = expected_copy(states, running, track, mask)
        copier.track_copy(
            torch.tensor(running, device="cuda"),
            torch.tensor(track, device="cuda"),
            torch.tensor(mask, device="cuda"),
        )
        assert_same(states, want)


@pytest.mark.gpu
@gpu
def test_auto_picks_the_built_cuda_op_else_triton():
    from sglang.srt.utils.sgl_kernel import is_built

    want = "cuda" if is_built("cuda") else "triton"
    assert StateCopier(make_states(8, "tiny", device="cuda")).impl == want
