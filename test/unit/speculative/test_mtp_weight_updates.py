"""The MTP draft layer (EAGLE / NEXTN) under the RL routes, by its parameters (no forward here; the
drafts themselves, bit for bit a fresh server's, and the demo model's acceptance: the nightly file):
/update_weights_from_tensor writes the checkpoint's `mtp.*` tensors into it, with the model's tensors
or not at all; load_format "direct" and /get_weights_by_name name its parameters `mtp.<its own name>`;
/update_weights_from_disk loads the new checkpoint's MTP layer and swaps it in with the model (the draft
runner then reads the new one), or refuses a checkpoint without one; /release_memory_occupation frees
its weights too and resuming brings them back."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.speculative.mtp_draft import MtpDraftRunner
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, noisy_checkpoint
from sglang.test.mtp_weight_checks import checkpoint_tensors, draft_params, without_mtp

register_cpu_ci(est_time=4, suite="per-commit-cpu")

QWEN = "tiny-qwen3-next"


def nextn_runner(path: str, **kw):
    return make_runner(path, speculative_algorithm="NEXTN", **kw)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def checkpoint_b(preset_paths, tmp_path_factory):
    """tiny-qwen3-next with noise on every weight, its MTP layer's included, and that model's layer."""
    path = noisy_checkpoint(preset_paths[QWEN], tmp_path_factory.mktemp("mtp") / "b")
    return path, draft_params(nextn_runner(path))


def test_mtp_tensors_update_the_draft_layer(checkpoint_b):
    """Checkpoint B's tensors, the MTP layer's among the model's in one update, write B's MTP layer.
    (Before, the `mtp.*` names came back as ignored, which the reply named, and the layer stayed A's.)"""
    path, mtp_b = checkpoint_b
    runner = nextn_runner(QWEN)
    new = checkpoint_tensors(path)
    assert runner.update_weights_from_tensor([*new.items(), ("mtp.not_a_weight", torch.zeros(2))]) == [
        "mtp.not_a_weight"
    ]
    assert same(draft_params(runner), mtp_b)
    name = "mtp.fc.weight"  # (the checkpoint's name is the parameter's: get_weights_by_name reads it)
    assert runner.get_weights_by_name(name, 2) == new[name][:2].tolist()


def test_the_model_and_mtp_layer_are_written_together_or_not_at_all(checkpoint_b):
    runner = nextn_runner(QWEN)
    model_before = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
    mtp_before = draft_params(runner)
    new = checkpoint_tensors(checkpoint_b[0])
    mtp = [(n, t) for n, t in new.items() if n.startswith("mtp.")]
    model = [(n, t) for n, t in new.items() if not n.startswith("mtp.")]

    def other_rank_failed():  # (the TP ranks' vote, cast once every tensor has fitted)
        raise ValueError("rank 1: a tensor does not fit")

    for named, before_copy, match in [
        ([*mtp, ("model.norm.weight", torch.zeros(3))], None, "model.norm.weight has shape"),
        ([("mtp.norm.weight", torch.zeros(3)), *model], None, "mtp.norm.weight has shape"),
        ([("mtp.norm.weight", new["mtp.norm.weight"].to(torch.int8)), *model], None, "int8"),
        (mtp, other_rank_failed, "rank 1"),
        (list(new.items()), other_rank_failed, "rank 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            runner.update_weights_from_tensor(named, before_copy=before_copy)
        assert all(torch.equal(p, model_before[n]) for n, p in runner.model.named_parameters())
        assert same(draft_params(runner), mtp_before)
    votes = []  # the MTP layer's tensors alone, one vote that passes: written
    assert runner.update_weights_from_tensor(mtp, None, lambda: votes.append(1)) == []
    assert votes == [1] and same(draft_params(runner), checkpoint_b[1])


def test_direct_names_and_get_weights_by_name(checkpoint_b):
    """load_format "direct" takes the MTP layer's own names under `mtp.` (what /get_weights_by_name
    reads); a server without NEXTN has no MTP layer and names them as ignored."""
    runner = nextn_runner(QWEN)
    mtp_b = checkpoint_b[1]
    named = [("mtp." + n, t) for n, t in mtp_b.items()]
    assert "mtp.layers.0.mlp.experts.w13" in dict(named)  # (the fused experts: not a checkpoint name)
    assert runner.update_weights_from_tensor(named, "direct") == []
    assert same(draft_params(runner), mtp_b)
    w13 = mtp_b["layers.0.mlp.experts.w13"]
    assert runner.get_weights_by_name("mtp.layers.0.mlp.experts.w13", 1) == w13[:1].tolist()
    with pytest.raises(ValueError, match=r"no parameter 'mtp.fc.weights' \(close: mtp.fc.weight"):
        runner.get_weights_by_name("mtp.fc.weights")
    assert make_runner(QWEN).update_weights_from_tensor(named[:1], "direct") == [named[0][0]]


def test_a_disk_update_swaps_in_the_new_mtp_layer(checkpoint_b, tmp_path):
    """The draft runner made before the swap (as the server's is) reads B's MTP layer after it. (Before,
    the new model came with the old MTP layer, and the draft runner kept its first one.)"""
    path, mtp_b = checkpoint_b
    runner = nextn_runner(QWEN)
    draft = MtpDraftRunner(runner)
    runner.swap_model(runner.load_like_current(path))
    assert draft.mtp is runner.draft_model and same(draft_params(runner), mtp_b)
    # A checkpoint saved without its MTP layer is refused in one sentence, the serving layers kept.
    no_mtp = without_mtp(path, tmp_path / "no_mtp")
    serving = runner.model, runner.draft_model
    with pytest.raises(ValueError, match=r"^it has no MTP layer \(no mtp\.\* tensors\), which"):
        runner.load_like_current(no_mtp)
    assert (runner.model, runner.draft_model) == serving
    assert make_runner(QWEN).load_like_current(no_mtp).draft_model is None  # (no NEXTN: it serves)


@pytest.mark.parametrize("cpu_backup", [True, False])
def test_release_and_resume_cover_the_mtp_layer(checkpoint_b, cpu_backup):
    """Released weights free the MTP layer's bytes too (before, they stayed held); resumed, its values
    come back from the host copy, or (no copy) from an update that sends them, as an RL loop does."""
    runner = nextn_runner(QWEN, enable_weights_cpu_backup=cpu_backup)
    before = draft_params(runner)

    def draft_bytes() -> int:
        return sum(p.untyped_storage().nbytes() for p in runner.draft_model.parameters())

    held = draft_bytes()  # (the parameters' storages: on CPU the experts' also hold the fused shared expert)
    assert held >= sum(t.numel() * t.element_size() for t in before.values()) > 0
    runner.memory_occupation.release(["weights"])
    assert draft_bytes() == 0
    with pytest.raises(ValueError, match="released"):
        runner.get_weights_by_name("mtp.fc.weight")
    runner.memory_occupation.resume(["weights"])
    assert draft_bytes() == held
    if cpu_backup:
        assert same(draft_params(runner), before)
    else:
        assert runner.update_weights_from_tensor(list(checkpoint_tensors(checkpoint_b[0]).items())) == []
        assert same(draft_params(runner), checkpoint_b[1])
