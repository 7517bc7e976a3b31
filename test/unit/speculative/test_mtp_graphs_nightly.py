"""The MTP layer after a graph-shaped verify that replayed the target's graph (`speculative/mtp_graphs.py`,
`MtpForwardGraphs`) against the eager layer, in the graphs' CPU form: the verify's attention is Triton's
extend kernel, interpreted (the torch-native one sizes itself from host lists), ~12 s. The decode's twin
is per-commit (`test_mtp_graphs.py`)."""

from __future__ import annotations

import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.mtp_checks import mtp_after_forward_run

register_cpu_ci(est_time=20, suite="nightly-cpu")


def test_the_mtp_layer_after_a_replayed_verify_is_the_eager_one(monkeypatch):
    """Three requests (bucket 4: one padded request of 4 positions): the stash rows at the accepted
    positions and the KV the MTP layer writes are the eager layer's (1e-5: padded rows only change the
    matmuls' float32 blocking; a padded position writing a real slot, or stale hidden rows, moves them by
    O(1))."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tok_g, stash_g, kv_g, replays = mtp_after_forward_run("verify", graphs=True)
    tok_e, stash_e, kv_e, _ = mtp_after_forward_run("verify", graphs=False)
    assert replays == 4
    assert tok_g == tok_e
    torch.testing.assert_close(stash_g, stash_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_g[:, :, 1:], kv_e[:, :, 1:], rtol=1e-5, atol=1e-5)  # (slot 0: padding's)
