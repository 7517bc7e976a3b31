"""The weights fingerprint a PD server sends with its pool layout (`weights_fingerprint.py`): equal for the
same checkpoint, different for another checkpoint of the same config and shapes (another seed of the
preset), different after a weight update applied to one model only and equal again once the other gets the
same update; refreshed by the PD queues when the scheduler's weights change. The refusal names what
differs, and a conv-state dtype difference names its own variable."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.disaggregation.transfer import PoolLayout
from sglang.srt.disaggregation.weights_fingerprint import weights_fingerprint, with_weights
from sglang.srt.managers.scheduler_components.scheduler_update_weights_mixin import (
    SchedulerUpdateWeightsMixin,
)
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool
from sglang.srt.models.registry import load_model
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import served_tensors
from sglang.test.pd_checkpoints import other_seed_checkpoint
from sglang.test.pd_fakes import decode_queue, prefill_queue

register_cpu_ci(est_time=8, suite="per-commit-cpu")

PRESET = "tiny-qwen3-next"


def load(path: str) -> torch.nn.Module:
    return load_model(load_hf_config(path), path, torch.float32, "cpu")


@pytest.fixture(scope="module")
def paths(preset_paths):
    return preset_paths[PRESET], other_seed_checkpoint(PRESET, seed=1)


def test_the_same_checkpoint_loaded_twice_has_one_fingerprint(paths):
    a = weights_fingerprint(load(paths[0]))
    assert a == weights_fingerprint(load(paths[0]))
    # Integer sums: the thread count (the reduction's order) changes nothing.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert weights_fingerprint(load(paths[0])) == a
    finally:
        torch.set_num_threads(threads)


def test_another_seed_of_the_same_preset_differs(paths):
    a, b = load(paths[0]), load(paths[1])
    configs = [json.loads((Path(p) / "config.json").read_text()) for p in paths]
    assert configs[0] == configs[1]
    shapes = {n: (t.shape, t.dtype) for n, t in a.state_dict().items()}
    assert {n: (t.shape, t.dtype) for n, t in b.state_dict().items()} == shapes
    assert weights_fingerprint(a) != weights_fingerprint(b)


def test_an_update_on_one_side_differs_and_the_same_update_on_both_is_equal(paths):
    prefill, decode = load(paths[0]), load(paths[0])
    new = served_tensors(paths[1])
    names = sorted(new)
    # An RL step's size: one tensor, one element, one bit of its float32 (its lowest).
    name = names[len(names) // 2]
    nudged = new[name].clone()
    nudged.view(torch.int32).view(-1)[7] ^= 1
    for model in (prefill, decode):
        assert weights_fingerprint(model) == weights_fingerprint(prefill)
    decode.load_weights([(name, nudged)], update=True)
    assert weights_fingerprint(decode) != weights_fingerprint(prefill)
    prefill.load_weights([(name, nudged)], update=True)
    assert weights_fingerprint(decode) == weights_fingerprint(prefill)
    # The whole other checkpoint sent to both in two buckets each, in other orders.
    decode.load_weights([(n, new[n]) for n in names[::2]], update=True)
    decode.load_weights([(n, new[n]) for n in names[1::2]], update=True)
    assert weights_fingerprint(decode) != weights_fingerprint(prefill)
    prefill.load_weights([(n, new[n]) for n in reversed(names)], update=True)
    assert weights_fingerprint(decode) == weights_fingerprint(prefill) == weights_fingerprint(load(paths[1]))


def test_permuted_rows_or_columns_differ():
    """A plain sum of the bits would not see values moved within a tensor (rows of experts or heads in
    another order): the fingerprint weighs rows and columns by their index."""
    base = torch.nn.Linear(6, 4, bias=False)
    before = weights_fingerprint(base)
    for perm in (lambda w: w[[1, 0, 2, 3]], lambda w: w[:, [0, 1, 2, 3, 5, 4]]):
        moved = torch.nn.Linear(6, 4, bias=False)
        with torch.no_grad():
            moved.weight.copy_(perm(base.weight))
        assert weights_fingerprint(moved) != before
    bf16 = torch.nn.Linear(6, 4, bias=False).to(torch.bfloat16)
    assert weights_fingerprint(bf16) == weights_fingerprint(bf16)


def test_every_byte_counts_whatever_the_dtype_or_alignment():
    """Tensors whose bytes are no whole number of int64 words, views that start off an 8-byte boundary,
    float8 and bool: a change to their last byte, or any value, changes the fingerprint."""
    buffer = torch.zeros(64, dtype=torch.bfloat16)
    cases = [
        torch.arange(5, dtype=torch.bfloat16),  # 10 bytes: a word and two more
        buffer[1:6],  # starts 2 bytes into its storage
        torch.ones(9).to(torch.float8_e4m3fn),
        torch.tensor([True, False, True]),
        torch.arange(2 * 512 + 3, dtype=torch.int64),  # two grid rows and three words past them
    ]
    for t in cases:
        holder = torch.nn.Module()
        holder.register_buffer("w", t)
        before = weights_fingerprint(holder)
        assert weights_fingerprint(holder) == before
        raw = t.view(-1).view(torch.uint8) if t.dtype != torch.bool else t.view(torch.uint8)
        raw[-1] ^= 1
        assert weights_fingerprint(holder) != before, t.dtype


def test_equal_values_stored_in_another_order_are_equal():
    """The CPU stores MoE experts transposed (`experts.py`'s C++ op), a GPU does not: equal values."""
    w = torch.randn(4, 24, 16)
    fingerprints = []
    for stored in (w.clone(), w.transpose(1, 2).contiguous().transpose(1, 2)):
        holder = torch.nn.Module()
        holder.register_buffer("experts", stored)
        fingerprints.append(weights_fingerprint(holder))
    assert fingerprints[0] == fingerprints[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_copy_has_the_cpu_fingerprint(paths):
    """Integer sums do not depend on the reduction's order: the same values on a GPU (its reductions,
    its thread blocks) fingerprint as on the CPU, in float32 and in bfloat16."""
    for dtype in (torch.float32, torch.bfloat16):
        cpu = load_model(load_hf_config(paths[0]), paths[0], dtype, "cpu")
        gpu = load_model(load_hf_config(paths[0]), paths[0], dtype, "cuda")
        assert gpu.state_dict().keys() == cpu.state_dict().keys()
        assert all(torch.equal(t.cpu(), cpu.state_dict()[n]) for n, t in gpu.state_dict().items())
        assert weights_fingerprint(gpu) == weights_fingerprint(cpu), dtype


def small_layout(conv: torch.dtype = torch.bfloat16, ssm: torch.dtype = torch.float32) -> PoolLayout:
    kv = MHATokenToKVPool(16, 1, torch.float32, head_num=2, head_dim=4, layer_ids=[0])
    params = Mamba2CacheParams(
        shape=Mamba2StateShape(conv=(6, 3), temporal=(2, 4, 4), conv_kernel=4),
        dtype=Mamba2StateDType(conv=conv, temporal=ssm),
        layers=(1,),
    )
    return PoolLayout.of(kv, MambaPool(2, params))


def test_a_refusal_names_the_checkpoints_and_the_routes():
    layout = small_layout()
    prefill = replace(layout, weights_digest="aaaa", weights_source="model /ckpt/a, weight version default")
    decode = replace(layout, weights_digest="bbbb", weights_source="model /ckpt/b, weight version step-3")
    message = prefill.mismatch(decode)
    for part in ("/ckpt/a", "/ckpt/b", "step-3", "aaaa", "bbbb", "--model-path", "/update_weights_from_tensor"):
        assert part in message, message
    assert prefill.mismatch(PoolLayout.from_dict(prefill.to_dict())) is None


def test_a_conv_state_dtype_difference_names_its_variable():
    """The conv state's dtype is SGLANG_MAMBA_CONV_DTYPE's (default: the model's), not --mamba-ssm-dtype's,
    which the refusal named before."""
    conv = small_layout(conv=torch.bfloat16).mismatch(small_layout(conv=torch.float16))
    assert "SGLANG_MAMBA_CONV_DTYPE" in conv and "--mamba-ssm-dtype" not in conv, conv
    ssm = small_layout(ssm=torch.bfloat16).mismatch(small_layout(ssm=torch.float16))
    assert "--mamba-ssm-dtype" in ssm and "SGLANG_MAMBA_CONV_DTYPE" not in ssm, ssm


def test_a_weight_update_refreshes_both_queues_layouts(paths):
    """The scheduler's weight updates (`_weights_changed`, after every route's success) refingerprint the
    PD queue's weights: the layout the decode server sends, and the layouts the prefill server checks."""
    model = load(paths[0])
    runner = SimpleNamespace(model=model, draft_model=None, dtype=torch.float32)
    args = SimpleNamespace(quantization=None, weight_version="default", model_path=PRESET)
    for make in (prefill_queue, decode_queue):
        sched = SimpleNamespace(server_args=args, model_runner=runner, tree_cache=None)
        q = make(sched)
        q.layout = with_weights(small_layout(), sched, PRESET)
        q.layouts = [q.layout]
        before = q.layout.weights_digest
        model.load_weights([(n, t) for n, t in served_tensors(paths[1]).items()], update=True)
        owner = SimpleNamespace(
            tree_cache=SimpleNamespace(weights_changed=lambda: None), server_args=args, disagg=q
        )
        SchedulerUpdateWeightsMixin._weights_changed(owner, "step-1", paths[1])
        assert q.layout.weights_digest not in ("", before)
        assert f"model {paths[1]}, weight version step-1" == q.layout.weights_source
        theirs = q.layouts[0] if make is prefill_queue else PoolLayout.from_dict(q.rank_targets[0]["layout"])
        assert theirs == q.layout
        model.load_weights(list(served_tensors(paths[0]).items()), update=True)  # (back, for the next)
        args.weight_version = "default"


def test_resumed_weights_are_fingerprinted_again():
    """/resume_memory_occupation of the weights: without --enable-weights-cpu-backup they hold no values
    until an update writes them, so a PD server fingerprints them again (and the pair refuses until both
    hold the same); resuming only the KV cache does not."""
    calls = []

    class Memory:
        released = {"weights", "kv_cache"}

        def resume(self, tags):
            self.released -= set(tags)

    owner = SimpleNamespace(
        model_runner=SimpleNamespace(memory_occupation=Memory()),
        disagg=SimpleNamespace(weights_changed=lambda: calls.append("refingerprinted")),
        _agree=lambda error: error,
        send_to_tokenizer=lambda out: calls.append(out.success),
    )
    SchedulerUpdateWeightsMixin.resume_memory_occupation(owner, SimpleNamespace(tags=["kv_cache"]))
    assert calls == [True]
    SchedulerUpdateWeightsMixin.resume_memory_occupation(owner, SimpleNamespace(tags=["weights"]))
    assert calls == [True, "refingerprinted", True]


def test_a_fingerprint_that_fails_refuses_rather_than_crashes(monkeypatch):
    """A fingerprint that raises (no memory for a copy, after an update that succeeded) must neither stop
    the scheduler nor match anything: the server's pair refuses."""
    from sglang.srt.disaggregation import weights_fingerprint as module

    def fail(*models):
        raise torch.OutOfMemoryError("no memory for a copy")

    monkeypatch.setattr(module, "weights_fingerprint", fail)
    runner = SimpleNamespace(model=None, draft_model=None, dtype=torch.float32)
    sched = SimpleNamespace(server_args=SimpleNamespace(quantization=None, weight_version="v"), model_runner=runner)
    a, b = (with_weights(small_layout(), sched, PRESET) for _ in range(2))
    assert a.weights_digest.startswith("not computed (OutOfMemoryError")
    assert "the weights' values differ" in a.mismatch(b)
