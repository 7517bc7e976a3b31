"""The MTP layer after a graph-shaped verify that replayed the target's graph (`speculative/mtp_graphs.py`,
`MtpForwardGraphs`) against the eager layer, in the graphs' CPU form: the verify's attention is Triton's
extend kernel, interpreted (the torch-native one sizes itself from host lists): 43 s measured on two
shared cores, ~13 s of it the recapture after the release. The decode's twin is per-commit
(`test_mtp_graphs.py`)."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.mtp_checks import assert_mtp_layer_graphs_match

register_cpu_ci(est_time=45, suite="nightly-cpu")


def test_the_mtp_layer_after_a_replayed_verify_is_the_eager_one(monkeypatch):
    """Three requests (bucket 4: one padded request of 4 positions): the stash rows at the accepted
    positions and the KV the MTP layer writes are the eager layer's (`assert_mtp_layer_graphs_match`).
    Released with the target's graphs, the MTP layer's attention backend keeps no metadata of the last
    capture (a verify's `extend_start_loc`, in the MTP graphs' pool); captured again, it has it again."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run = assert_mtp_layer_graphs_match("verify", "cpu")
    assert run.draft.forward_graphs.verify_replays == 4
    backend = run.draft.attn.full_attn_backend
    assert backend.extend_start_loc is not None
    run.runner.graph_runner.release()
    assert backend.extend_start_loc is None
    run.runner.graph_runner.recapture()
    assert backend.extend_start_loc is not None
