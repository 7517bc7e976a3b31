"""The weights fingerprint a PD server sends with its pool layout (`weights_fingerprint.py`): equal for the
same checkpoint, different for another checkpoint of the same config and shapes (another seed of the
preset), different after a weight update applied to one model only and equal again once the other gets the
same update; refreshed by the PD queues when the scheduler's weights change (after a tensor update, only
the tensors it wrote are read again; after a failed write too). Moved values and structured changes
count, and so do the model's config (not its folder) and the float8 KV scales. The server's fingerprint is
the meta digest and the sum of its TP ranks' shares (`weights_total`), compared by `weights_mismatch`
whatever the two servers' --tp-size / --ep-size (`test_weights_fingerprint_tp.py` runs the ranks). The
refusal names what differs: a conv-state dtype difference its own variable."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.disaggregation.destination import malformed_layout
from sglang.srt.disaggregation.pd_ranks import check_targets
from sglang.srt.disaggregation.transfer import PoolLayout
from sglang.srt.disaggregation.weights_fingerprint import (
    weights_fingerprint,
    weights_mismatch,
    weights_share,
    weights_total,
    with_weights,
)
from sglang.srt.managers.scheduler_components.scheduler_update_weights_mixin import (
    SchedulerUpdateWeightsMixin,
)
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool
from sglang.srt.models.registry import load_model
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import served_tensors
from sglang.test.pd_checkpoints import other_seed_checkpoint
from sglang.test.pd_fakes import decode_queue, prefill_queue

register_cpu_ci(est_time=9, suite="per-commit-cpu")

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


def holding(t: torch.Tensor) -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.register_buffer("w", t)
    return holder


def test_moved_rows_columns_or_experts_differ():
    """Values moved within a tensor change the fingerprint: each element is keyed by its position before it
    is mixed. Tensors over two chunks of the CPU's 1 MiB and past many 4 KiB rows (the old grid's): rows
    swapped, columns swapped (each row keeps its sum), two experts of a stacked [E, R, H] tensor swapped
    (each expert keeps its sums), and two whole chunks swapped."""
    torch.manual_seed(0)
    w = torch.randn(8, 1024)  # 32 KiB: 8 rows of 4 KiB
    experts = torch.randn(4, 64, 1024, dtype=torch.bfloat16)  # 512 KiB, an expert 128 KiB
    chunks = torch.randn(2, 1 << 17, dtype=torch.float64)  # two chunks of 1 MiB
    for t, moved in (
        (w, w[[1, 0, *range(2, 8)]]),
        (w, w[:, [1, 0, *range(2, 1024)]]),
        (w, w[:, [*range(512), *range(768, 1024), *range(512, 768)]]),
        (experts, experts[[0, 2, 1, 3]]),
        (chunks, chunks[[1, 0]]),
    ):
        assert not torch.equal(moved, t)
        assert weights_fingerprint(holding(moved.contiguous())) != weights_fingerprint(holding(t.clone()))


def test_structured_changes_do_not_cancel():
    """Review finding: the old linear sums modulo 2**64 cancelled two sign flips of float32 values in the
    high halves of words of equal grid parity, and +d / -d / -d / +d on a rectangle of words: equal
    fingerprints for different weights. Mixed elements are summed now."""
    torch.manual_seed(0)
    w = torch.randn(8, 1024)
    before = weights_fingerprint(holding(w.clone()))
    flipped = w.clone().view(-1)
    flipped[1] *= -1  # the high half of word 0 and of word 2 * 512 + 2: same row / column parities
    flipped[2 * (2 * 512 + 2) + 1] *= -1
    assert weights_fingerprint(holding(flipped.view(8, 1024))) != before
    b = torch.randn(8, 1024).to(torch.bfloat16)
    grid = b.clone().view(-1).view(torch.int64).view(-1, 512)
    d = 1 << 16  # one ulp of the word's second bfloat16
    grid[0, 0] += d
    grid[0, 1] -= d
    grid[1, 0] -= d
    grid[1, 1] += d
    assert weights_fingerprint(holding(grid.view(-1).view(torch.bfloat16).view(8, 1024))) != weights_fingerprint(
        holding(b)
    )


def test_the_sum_is_the_documented_integer_function_whatever_the_chunk(monkeypatch):
    """The share is a function of the elements' bits, their positions and the tensor's name in 64-bit
    integer arithmetic (as docs/disaggregation.md states, so any device computes the same): checked
    against Python integers for int64 and bfloat16 elements (zero-extended bits), with chunks of 2**17
    elements and of 3, zero-extended by an unsigned copy or by a mask; the tensors' sums add up into one."""
    from sglang.srt.disaggregation import weights_fingerprint as module

    mask = (1 << 64) - 1

    def mix(x: int) -> int:  # SplitMix64's finalizer
        x ^= x >> 30
        x = x * 0xBF58476D1CE4E5B9 & mask
        x ^= x >> 27
        x = x * 0x94D049BB133111EB & mask
        return x ^ (x >> 31)

    def expected(name: str, bits: list[int]) -> int:
        key = module.name_key(f"0:{name}")
        return sum(mix((b + i * 0x9E3779B97F4A7C15 + key) & mask) for i, b in enumerate(bits)) & mask

    words = torch.tensor([0, 1, -1, -(1 << 63), 0x0123456789ABCDEF, 7, -12345], dtype=torch.int64)
    halves = torch.tensor([[-1.5, 2.0, 0.0], [3.25, -0.0, 1e-3]], dtype=torch.bfloat16)
    holder = torch.nn.Module()
    holder.register_buffer("words", words)
    holder.register_buffer("halves", halves)
    want = (expected("words", [int(w) & mask for w in words])
            + expected("halves", [int(h) & 0xFFFF for h in halves.view(torch.int16).flatten()])) & mask  # fmt: skip
    got = module.weights_share(holder)[1]
    monkeypatch.setitem(module.CHUNK_ELEMENTS, "cpu", 3)
    assert got == want == module.weights_share(holder)[1]
    # A device that cannot copy uint16 into int64 (zero-extending) sign-extends and masks: the same sum.
    assert module._copies_unsigned("cpu")
    monkeypatch.setattr(module, "_copies_unsigned", lambda device_type: False)
    assert module.weights_share(holder)[1] == want


def test_every_byte_counts_whatever_the_dtype_or_alignment():
    """Tensors whose bytes are no whole number of int64 words, views that start off an 8-byte boundary,
    float8, bool and 16-byte complex elements (taken as bytes): a change to their last byte, or any value,
    changes the fingerprint."""
    buffer = torch.zeros(64, dtype=torch.bfloat16)
    cases = [
        torch.arange(5, dtype=torch.bfloat16),  # 10 bytes: a word and two more
        buffer[1:6],  # starts 2 bytes into its storage
        torch.ones(9).to(torch.float8_e4m3fn),
        torch.tensor([True, False, True]),
        torch.arange((1 << 17) + 3, dtype=torch.int64),  # a CPU chunk (1 MiB) and three elements past it
        torch.ones(3, dtype=torch.complex128),
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


class OnCpu(torch.nn.Module):
    """A model's config and state dict, copied to the CPU (a copy of the module itself would copy the op
    handles some modules hold)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.config = model.config
        self.tensors = {n: t.detach().cpu() for n, t in model.state_dict().items()}

    def state_dict(self, *args, **kwargs) -> dict:
        return dict(self.tensors)


def test_a_cpu_copy_of_float8_weights_has_their_fingerprint(preset_paths, monkeypatch):
    """The GPU test's fp8 case below, on the CPU: float8 experts and their scales (SGLANG_FP8_EXPERTS fp8)
    copied tensor by tensor into another module fingerprint alike."""
    from sglang.srt.layers.quantization import set_online_quantization

    monkeypatch.setenv("SGLANG_FP8_EXPERTS", "fp8")
    path = preset_paths["tiny-qwen3.5-moe"]
    config = load_hf_config(path)
    set_online_quantization(config, "fp8")
    model = load_model(config, path, torch.bfloat16, "cpu")
    assert any(t.dtype == torch.float8_e4m3fn for t in model.state_dict().values())
    assert weights_fingerprint(OnCpu(model)) == weights_fingerprint(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "preset, quantization", [(PRESET, None), ("tiny-qwen3.5-moe", None), (PRESET, "fp8")]
)
def test_a_gpu_copy_has_the_cpu_fingerprint(preset_paths, preset, quantization):
    """Integer operations whose sum does not depend on its order: the same values on a GPU (its
    reductions, its 64 MiB chunks) fingerprint as on the CPU, in float32 and in bfloat16, MoE experts
    included (the CPU stores them transposed). With --quantization fp8 the GPU holds float8 weights and
    their scales (the CPU's linears stay unquantized, so the two loads differ): two GPU loads are equal,
    and the GPU model's tensors copied to the CPU have the GPU's fingerprint."""
    from sglang.srt.layers.quantization import set_online_quantization

    path = preset_paths[preset]

    def on(device: str, dtype: torch.dtype) -> torch.nn.Module:
        config = load_hf_config(path)
        set_online_quantization(config, quantization)
        return load_model(config, path, dtype, device)

    for dtype in (torch.float32, torch.bfloat16) if quantization is None else (torch.bfloat16,):
        gpu = on("cuda", dtype)
        if quantization is None:
            cpu = on("cpu", dtype)
            assert gpu.state_dict().keys() == cpu.state_dict().keys()
            assert all(torch.equal(t.cpu(), cpu.state_dict()[n]) for n, t in gpu.state_dict().items())
        else:
            assert any(t.dtype == torch.float8_e4m3fn for t in gpu.state_dict().values())
            assert weights_fingerprint(on("cuda", dtype)) == weights_fingerprint(gpu)
            cpu = OnCpu(gpu)
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
    prefill = replace(layout, weights_digest="a" * 16, weights_share=1, weights_source="model /ckpt/a, weight version default")
    decode = replace(layout, weights_digest="b" * 16, weights_share=1, weights_source="model /ckpt/b, weight version step-3")
    assert prefill.mismatch(decode) is None  # (the values are compared over every rank: weights_mismatch)
    message = weights_mismatch([prefill], [decode])
    for part in ("/ckpt/a", "/ckpt/b", "step-3", "a" * 16 + "0" * 15 + "1", "b" * 16, "--model-path",
                 "/update_weights_from_tensor"):  # fmt: skip
        assert part in message, message
    assert message.startswith("the weights' values differ"), message
    assert weights_mismatch([prefill], [PoolLayout.from_dict(prefill.to_dict())]) is None


def test_a_server_fingerprint_is_its_meta_digest_and_the_sum_of_its_ranks_shares():
    """Servers sharded differently compare by the sum of their ranks' shares (mod 2**64) under one meta
    digest; the per-rank layout check compares no values, nor --ep-size (which the layout carries again,
    for the held sums: `test_held_sums_compare_rank_by_rank_at_the_same_sizes`). A rank whose fingerprint
    failed, or ranks that disagree on the meta digest, match nothing."""
    layout = replace(small_layout(), weights_digest="0123456789abcdef")
    big = (1 << 64) - 5
    one = [replace(layout, weights_share=(big + 7) & ((1 << 64) - 1))]
    two = [replace(layout, weights_share=big), replace(layout, weights_share=7)]
    four = [replace(layout, weights_share=s) for s in (1, 2, 3, 1)]
    assert weights_total(one) == weights_total(two) == "0123456789abcdef" + "0000000000000002"
    assert weights_mismatch(two, one) is None and weights_mismatch(one, two) is None
    assert weights_total(four) == "0123456789abcdef0000000000000007"
    assert "values differ" in weights_mismatch(two, four) and weights_total(four) in weights_mismatch(two, four)
    assert layout.mismatch(replace(layout, ep_size=2)) is None
    failed = [two[0], replace(two[1], weights_digest="not computed (OutOfMemoryError, 1234abcd)")]
    assert weights_total(failed) not in (weights_total(two), weights_total(one))
    assert weights_mismatch(failed, failed[::-1]) is not None
    # check_targets (the prefill server's check of a destination) compares the totals.
    dst = {"layout": one[0].to_dict()}
    assert check_targets(one, dst) is None
    problem = check_targets(one, {"layout": replace(one[0], weights_share=3).to_dict()})
    assert problem is not None and "values differ" in problem


def test_held_sums_compare_rank_by_rank_at_the_same_sizes():
    """Review R1 finding 2: a replicated tensor one rank alone got wrong (rank 1's payload of
    /update_weights_from_tensor) counts on rank 0 only, so the totals are equal; each rank's held sum
    (its copies included) differs. At the same --tp-size and --ep-size the held sums compare rank by
    rank and the refusal names the rank; at another --tp-size or --ep-size only the totals compare (the
    documented limit: such a pair is accepted)."""
    layout = replace(small_layout(), weights_digest="0123456789abcdef", ep_size=2)
    good = [replace(layout, weights_share=s, weights_held=h) for s, h in ((5, 5), (6, 9))]
    bad = [good[0], replace(good[1], weights_held=10)]  # (rank 1's copy of a replicated tensor changed)
    assert weights_total(good) == weights_total(bad)
    assert weights_mismatch(good, [PoolLayout.from_dict(g.to_dict()) for g in good]) is None
    for a, b in ((good, bad), (bad, good)):
        message = weights_mismatch(a, b)
        assert message is not None and message.startswith("the weights' values differ"), message
        assert message.endswith("(TP rank 1)") and "TP rank 1 holds" in message, message
    assert check_targets(good, {"ranks": [{"layout": b.to_dict()} for b in bad]}).endswith("(TP rank 1)")
    # Another --ep-size, another --tp-size (the same total on one rank): not compared.
    assert weights_mismatch(good, [replace(b, ep_size=1) for b in bad]) is None
    one = [replace(layout, weights_share=11, weights_held=11)]
    assert weights_total(one) == weights_total(bad) and weights_mismatch(one, bad) is None


def test_a_layouts_share_from_the_network_is_bounded():
    """`weights_share` comes from the decode server's destination: an integer in [0, 2**64), which the
    channel's JSON (orjson) carries whole (a larger one parses as a float, refused)."""
    import orjson

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63

    layout = small_layout().to_dict()
    for share in (0, (1 << 64) - 1):
        assert malformed_layout(layout | {"weights_share": share}, is_int) is None
    for share in (1 << 64, -1, True, "1", 1.0, None):
        assert "weights_share" in malformed_layout(layout | {"weights_share": share}, is_int), share
    sent = orjson.loads(orjson.dumps(layout | {"weights_share": (1 << 64) - 1}))
    assert sent["weights_share"] == (1 << 64) - 1 and malformed_layout(sent, is_int) is None
    too_big = orjson.loads(orjson.dumps(layout).replace(b'"weights_share":0', b'"weights_share":%d' % (1 << 64)))
    assert "weights_share" in malformed_layout(too_big, is_int)


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
    args = SimpleNamespace(quantization=None, weight_version="default", model_path=PRESET, ep_size=3)
    for make in (prefill_queue, decode_queue):
        sched = SimpleNamespace(server_args=args, model_runner=runner, tree_cache=None)
        q = make(sched)
        q.layout = with_weights(small_layout(), sched, PRESET)
        # (one rank: it holds what it counts; the --ep-size rides along for the rank-by-rank comparison)
        assert q.layout.weights_held == q.layout.weights_share != 0 and q.layout.ep_size == 3
        q.layouts = [q.layout]
        before = weights_total([q.layout])
        model.load_weights([(n, t) for n, t in served_tensors(paths[1]).items()], update=True)
        owner = SimpleNamespace(
            tree_cache=SimpleNamespace(weights_changed=lambda: None), server_args=args, disagg=q
        )
        SchedulerUpdateWeightsMixin._weights_changed(owner, "step-1", paths[1])
        assert weights_total([q.layout]) != before and q.layout.weights_digest
        assert q.layout.weights_held == q.layout.weights_share and q.layout.ep_size == 3
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
        disagg=SimpleNamespace(weights_changed=lambda full: calls.append(f"refingerprinted, full {full}")),
        _agree=lambda error: error,
        send_to_tokenizer=lambda out: calls.append(out.success),
    )
    SchedulerUpdateWeightsMixin.resume_memory_occupation(owner, SimpleNamespace(tags=["kv_cache"]))
    assert calls == [True]
    SchedulerUpdateWeightsMixin.resume_memory_occupation(owner, SimpleNamespace(tags=["weights"]))
    assert calls == [True, "refingerprinted, full True", True]


def test_a_fingerprint_that_fails_refuses_rather_than_crashes(monkeypatch):
    """A fingerprint that raises (no memory for a copy, after an update that succeeded) must neither stop
    the scheduler nor match anything: the server's pair refuses."""
    from sglang.srt.disaggregation import weights_fingerprint as module

    def fail(*models, **options):
        raise torch.OutOfMemoryError("no memory for a copy")

    monkeypatch.setattr(module, "weights_share", fail)
    runner = SimpleNamespace(model=None, draft_model=None, dtype=torch.float32)
    sched = SimpleNamespace(server_args=SimpleNamespace(quantization=None, weight_version="v"), model_runner=runner)
    a, b = (with_weights(small_layout(), sched, PRESET) for _ in range(2))
    assert a.weights_digest.startswith("not computed (OutOfMemoryError")
    assert "the weights' values differ" in weights_mismatch([a], [b])


def test_float8_kv_scales_count_where_the_pool_is_float8(paths):
    """Review finding: the float8 KV cache scales (numbers on the attention layers, not in the state dict)
    were not fingerprinted, so an update of one `...self_attn.k_scale` on one server served wrong tokens.
    The scales the runner resolves count; a pool that is not float8 uses none (1.0), nor do they count."""
    from sglang.srt.layers.attention.kv_scales import resolve_kv_scales
    from sglang.srt.layers.radix_attention import RadixAttention

    model = load(paths[0])
    owner = next(n for n, m in model.named_modules() if isinstance(m, RadixAttention)).rpartition(".")[0]
    args = SimpleNamespace(quantization=None, weight_version="v")
    digests = {}
    for kv_dtype in (torch.float8_e4m3fn, torch.float32):
        runner = SimpleNamespace(model=model, draft_model=None, dtype=torch.float32)
        runner._kv_scales = lambda kv_dtype=kv_dtype: resolve_kv_scales([model], kv_dtype, warn=False)
        sched = SimpleNamespace(server_args=args, model_runner=runner)
        for scale in (1.0, 4.0):
            assert model.load_weights([(owner + ".k_scale", torch.tensor(scale))], update=True) == []
            digests[kv_dtype, scale] = with_weights(small_layout(), sched, PRESET).weights_digest
    assert digests[torch.float8_e4m3fn, 1.0] != digests[torch.float8_e4m3fn, 4.0]
    assert digests[torch.float32, 1.0] == digests[torch.float32, 4.0]


def test_after_an_update_only_the_tensors_written_are_read_again(paths, monkeypatch):
    """An RL refit sends hundreds of buckets: after each, the cached fingerprint reads only the tensors the
    loader noted as written (`models/weight_writes.py`) and equals a full one; a write with load_format
    "direct" (`ModelRunner.update_weights_from_tensor`) is noted too."""
    from sglang.srt.disaggregation import weights_fingerprint as module
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.models.weight_writes import last_write_into

    model = load(paths[0])
    full = weights_fingerprint(model)
    read = []
    sum_of = module._tensor_sums
    monkeypatch.setattr(module, "_tensor_sums", lambda t, *a: read.append(t.shape) or sum_of(t, *a))
    assert weights_fingerprint(model, cached=True) == full and read == []
    new = served_tensors(paths[1])
    name = next(n for n in sorted(new) if n.endswith("o_proj.weight"))
    model.load_weights([(name, new[name])], update=True)
    cached = weights_fingerprint(model, cached=True)
    assert read == [new[name].shape]
    assert cached == weights_fingerprint(model) != full
    params = dict(model.named_parameters())
    runner = SimpleNamespace(device="cpu", served_parameters=lambda: params)
    direct = next(n for n in params if n.endswith("o_proj.weight"))
    before = last_write_into(params[direct])
    ModelRunner.update_weights_from_tensor(runner, [(direct, torch.zeros_like(params[direct]))], "direct")
    assert last_write_into(params[direct]) > before
    read.clear()
    assert weights_fingerprint(model, cached=True) == weights_fingerprint(model) != cached
    assert read[0] == params[direct].shape and len(read) == 1 + len(model.state_dict())


def test_a_write_that_fails_after_the_vote_refingerprints():
    """Review finding: a write that raised once every rank had voted to copy (some tensors copied) replied
    'not updated' and kept the old fingerprint. Every rank refreshes then (the refresh is a collective
    under TP: every rank reaches it, failed or not); a write refused before the vote copied nothing."""
    from sglang.srt.managers.scheduler_components.weight_update import RankVote

    def write(named, load_format, before_copy):
        if named == "late":
            before_copy()
        raise RuntimeError("the copy failed")

    calls = []
    owner = SimpleNamespace(
        _weights_held=lambda flush_cache: None,
        model_runner=SimpleNamespace(update_weights_from_tensor=write),
        _weights_changed=lambda version, model_path=None: calls.append(version),
    )
    for when, refreshed in (("early", []), ("late", [None])):
        calls.clear()
        ok, message = SchedulerUpdateWeightsMixin.write_weights(owner, when, None, True, RankVote(lambda e: e))
        assert not ok and "the copy failed" in message and calls == refreshed, when


def test_the_config_counts_but_not_where_it_was_read_from(paths, tmp_path):
    """Two copies of one checkpoint in other folders are equal (the config's _name_or_path differs); a
    config that computes otherwise with the same weights (rope theta, eps) differs."""
    copy = tmp_path / "copy"
    shutil.copytree(paths[0], copy)
    a, b = load(paths[0]), load(str(copy))
    assert a.config._name_or_path != b.config._name_or_path
    assert weights_fingerprint(a) == weights_fingerprint(b)
    b.config.rms_norm_eps *= 10
    assert weights_fingerprint(a) != weights_fingerprint(b)


def test_sharded_shares_sum_to_the_whole_tensors_fingerprint():
    """The ranks' shares of hand-sharded tensors (no process group: `weights_share`'s `tp_rank`) sum to
    the share of the whole tensors at one rank, under one meta digest, at TP 4: a vocabulary padded to a
    multiple of 4 (its padding rows skipped), KV heads in 2 parts (each held by 2 ranks), an FP8 weight
    and its block scales (`in_blocks`), stacked experts over EP 2 with their gate | up rows over the 2
    ranks holding each expert, Mamba2-like rows and a vector given as spans that overlap between ranks
    (`SpanShard`: a replicated group), a replicated norm, in float32, bfloat16 and float8. One bit of an
    element a lower rank does not hold, flipped on its rank, changes the sum to the whole's with it
    flipped; one of a copy changes that rank's held sum and not its share."""
    from sglang.srt.layers.attention.mamba.mamba2_shards import SpanShard
    from sglang.srt.layers.linear import DimShard

    tp, mask = 4, (1 << 64) - 1
    g = torch.Generator().manual_seed(3)
    spans = (((0, 2), (6, 2)), ((2, 2), (6, 2)), ((4, 2), (8, 2)), ((0, 2), (8, 2)))  # (rows 0-1: ranks 0, 3)
    tensors = {
        "embed": (torch.randn(10, 8, generator=g), (DimShard(0, (10,), 4, (0, 1, 2, 3), pad=2),)),
        "k_proj": (torch.randn(4, 8, generator=g).to(torch.bfloat16), (DimShard(0, (4,), 2, (0, 0, 1, 1)),)),
        "fp8": (torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn), (DimShard(0, (8,), 4, (0, 1, 2, 3)),)),
        "fp8_scale": (torch.rand(4, 8, generator=g), (DimShard(0, (8,), 4, (0, 1, 2, 3)).in_blocks(2),)),
        "w13": (torch.randn(4, 8, 6, generator=g),
                (DimShard(0, (4,), 2, (0, 1, 0, 1)), DimShard(1, (4, 4), 2, (0, 0, 1, 1)))),
        "conv": (torch.randn(10, 1, 4, generator=g), (SpanShard(0, (10,), 4, (0, 1, 2, 3), 0, spans),)),
        "conv_bias": (torch.randn(10, generator=g), (SpanShard(0, (10,), 4, (0, 1, 2, 3), 0, spans),)),
        "norm": (torch.randn(8, generator=g), ()),
    }  # fmt: skip

    def held(full: torch.Tensor, shards: tuple, r: int) -> torch.Tensor:
        for s in shards:
            if s.pad:
                full = torch.cat([full, full.new_zeros((s.pad, *full.shape[1:]))])
            full = full.index_select(s.dim, s.positions(s.part_of_rank[r]))
        return full

    def holder(r: int | None, flipped: tuple[str, tuple[int, ...]] | None = None) -> torch.nn.Module:
        module = torch.nn.Module()
        for name, (full, shards) in tensors.items():
            t = full.clone() if r is None else held(full, shards, r).clone()
            if r is not None:
                t.tp_shards = shards
            if flipped is not None and flipped[0] == name:
                t.view(-1).view(torch.uint8)[_flat(t, flipped[1]) * t.element_size()] ^= 1  # (its lowest byte)
            module.register_buffer(name, t)
        return module

    whole = weights_share(holder(None))
    parts = [weights_share(holder(r), tp_rank=r) for r in range(tp)]
    assert {p[0] for p in parts} == {whole[0]}
    assert sum(p[1] for p in parts) & mask == whole[1]
    # Rank 2's first conv row is full row 4 (its own); flipped there, and in the whole tensor.
    flipped = [weights_share(holder(r, ("conv", (0, 0, 0)) if r == 2 else None), tp_rank=r)[1] for r in range(tp)]
    assert sum(flipped) & mask == weights_share(holder(None, ("conv", (4, 0, 0))))[1] != whole[1]
    # The held sums (every element a rank holds, copies included; not the padding): rank 0's is its share;
    # a bit flipped in a copy (the replicated norm, rank 3's conv rows 0-1 and bias entries 0-1, held by
    # rank 0 too) changes that rank's held sum only, and one in a padding row neither sum.
    assert parts[0][1] == parts[0][2] and all(p[1] != p[2] for p in parts[1:])
    copies = ((1, "norm", (3,)), (3, "conv", (1, 0, 2)), (3, "conv_bias", (0,)))
    for r, name, index in (*copies, (3, "embed", (2, 0))):  # (rank 3's embed rows 1-2: padding)
        changed = weights_share(holder(r, (name, index)), tp_rank=r)
        assert changed[1] == parts[r][1], (name, index)
        assert (changed[2] == parts[r][2]) == (name == "embed"), (name, index)


def _flat(t: torch.Tensor, index: tuple[int, ...]) -> int:
    """The flat (row-major) position of `index` in `t`."""
    flat = 0
    for i, n in zip(index, t.shape, strict=True):
        flat = flat * n + i
    return flat
