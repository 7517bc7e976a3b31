"""sgl-kernel's C++ rotary embedding (`sgl-kernel/csrc/rope_cpu.cpp`) against `RotaryEmbedding`'s torch
form: partial and full rotary, strided q (a view of a wider projection), large positions, GQA heads;
bad arguments refused; and Qwen3-Next's regrouped input projections split into the same q, k, v, z, b, a
as the checkpoint's per-key-head layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.models.qwen3_next import Qwen3NextGatedDeltaNet
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import max_abs

register_cpu_ci(est_time=2, suite="per-commit-cpu")

# Both compute the angle as float32 position x inv_freq; cos/sin from libm against torch's vectorised
# ones differ by an ulp or two: measured <= 2e-6 at positions up to 100k (angles of 1e5 rad). A wrong
# half, sign or pass-through channel is O(1).
TOL = 1e-5


@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 8), (64, 64), (256, 64)])
def test_op_matches_the_torch_form(ops, head_dim, rotary_dim):
    rope = RotaryEmbedding(head_dim, rotary_dim, 10000.0)
    g = torch.Generator().manual_seed(head_dim)
    positions = torch.tensor([0, 1, 17, 4095, 100_000])
    wide = torch.randn(5, 4, 2 * head_dim, generator=g)
    q = wide[..., :head_dim]  # strided: rows and heads of a wider projection, as Qwen3-Next's q and gate
    k = torch.randn(5, 2, head_dim, generator=g)
    want = rope(positions, q, k)
    rope.process_weights_after_loading()
    assert rope.cpu_ops is not None
    got = rope(positions, q, k)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and max_abs(a, b) < TOL


def test_bad_arguments_are_refused(ops):
    q, k, f = torch.zeros(3, 4, 16), torch.zeros(3, 2, 16), torch.zeros(4)
    with pytest.raises(RuntimeError, match="even"):
        ops.rotary_embedding(torch.arange(3), q, k, f, 7)
    with pytest.raises(RuntimeError, match="inv_freq"):
        ops.rotary_embedding(torch.arange(3), q, k, torch.zeros(3), 8)
    with pytest.raises(RuntimeError, match="tokens, heads"):
        ops.rotary_embedding(torch.arange(2), q, k, f, 8)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        ops.rotary_embedding(torch.arange(3), q.transpose(1, 2), k, f, 8)
    with envs.SGLANG_CPU_ROPE_BACKEND.override("torch"):
        rope = RotaryEmbedding(16, 8, 10000.0)
        rope.process_weights_after_loading()
    assert rope.cpu_ops is None
    passthrough = RotaryEmbedding(16, 0, 10000.0)  # no rotary channels: the torch form, not the op
    passthrough.process_weights_after_loading()
    assert passthrough.cpu_ops is None


def test_regrouped_projections_split_alike():
    cfg = SimpleNamespace(
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=8,
        linear_value_head_dim=4,
        hidden_size=32,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
    )
    layer = Qwen3NextGatedDeltaNet(cfg, 0)
    torch.nn.init.normal_(layer.in_proj_qkvz.weight)
    torch.nn.init.normal_(layer.in_proj_ba.weight)
    hidden = torch.randn(5, 32)

    def split():
        return layer._split_projections(layer.in_proj_qkvz(hidden), layer.in_proj_ba(hidden))

    before = split()
    layer.process_weights_after_loading()
    layer.process_weights_after_loading()  # once only: a second call must not permute the rows again
    after = split()
    for a, b in zip(after, before, strict=True):
        # The same dot products, permuted rows: float32 GEMM blocking may differ by an ulp.
        assert a.shape == b.shape and max_abs(a, b) < 1e-5
