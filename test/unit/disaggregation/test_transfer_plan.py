"""What a PD transfer moves, checked without a transfer engine: the descriptors of one request copy
exactly its tokens' K/V and its running slot's state rows between two pools of different page layouts;
batches stay within Mooncake's 2,048-descriptor limit; mismatched layouts are refused; the router's
bootstrap fields are validated."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.disaggregation.transfer import (
    MAX_DESCRIPTORS_PER_BATCH,
    MooncakeTransferEngine,
    PoolLayout,
    TransferError,
    token_runs,
    transfer_descriptors,
)
from sglang.srt.managers.request_validation import RequestError, bootstrap_info
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

LAYERS = [0, 3]  # full-attention layer ids
LINEAR = [1, 2, 4]


def make_pools(tokens: int, page: int, slots: int, fill: float | None):
    kv = MHATokenToKVPool(tokens, page, torch.float32, head_num=2, head_dim=4, layer_ids=LAYERS)
    params = Mamba2CacheParams(
        shape=Mamba2StateShape(conv=(6, 3), temporal=(2, 4, 4), conv_kernel=4),
        dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
        layers=tuple(LINEAR),
    )
    mp = MambaPool(slots, params)
    gen = torch.Generator().manual_seed(0)
    for buf in kv.k_buffer + kv.v_buffer + [mp.conv_state, mp.ssm_state]:
        if fill is None:
            buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
        else:
            buf.fill_(fill)
    return kv, mp


def apply(descriptors):
    """What the transfer engine does: copy `n` bytes from each source address to its destination."""
    for src, dst, n in descriptors:
        ctypes.memmove(dst, src, n)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    src_page=st.sampled_from([1, 4, 16]),
    dst_page=st.sampled_from([1, 8]),
    seed=st.integers(0, 2**16),
    src_slot=st.integers(1, 5),
    dst_slot=st.integers(1, 7),
)
def test_descriptors_move_exactly_one_requests_kv_and_state(n, src_page, dst_page, seed, src_slot, dst_slot):
    src_kv, src_mp = make_pools(64, src_page, 5, fill=None)
    dst_kv, dst_mp = make_pools(96, dst_page, 7, fill=float("nan"))  # poisoned: a missed byte shows
    rng = torch.Generator().manual_seed(seed)
    src_tokens = (torch.randperm(64, generator=rng)[:n] + src_page).tolist()  # real slots, past page 0
    if seed % 2:
        src_tokens.sort()  # runs of consecutive slots merge
    dst_tokens = (torch.randperm(96, generator=rng)[:n] + dst_page).tolist()
    src, dst = PoolLayout.of(src_kv, src_mp), PoolLayout.of(dst_kv, dst_mp)
    assert src.mismatch(dst) is None
    apply(transfer_descriptors(src, dst, src_tokens, dst_tokens, src_slot, dst_slot))

    for i in range(len(LAYERS)):
        for s_buf, d_buf in (
            (src_kv.k_buffer[i], dst_kv.k_buffer[i]),
            (src_kv.v_buffer[i], dst_kv.v_buffer[i]),
        ):
            assert torch.equal(d_buf[dst_tokens], s_buf[src_tokens])
            untouched = torch.ones(d_buf.shape[0], dtype=torch.bool)
            untouched[dst_tokens] = False
            assert d_buf[untouched].isnan().all()
    for s_buf, d_buf in ((src_mp.conv_state, dst_mp.conv_state), (src_mp.ssm_state, dst_mp.ssm_state)):
        assert torch.equal(d_buf[:, dst_slot], s_buf[:, src_slot])
        others = [s for s in range(d_buf.shape[1]) if s != dst_slot]
        assert d_buf[:, others].float().isnan().all()


def test_consecutive_slots_on_both_sides_are_one_descriptor_per_buffer():
    assert token_runs([5, 6, 7, 20, 21], [0, 1, 2, 3, 9]) == [(5, 0, 3), (20, 3, 1), (21, 9, 1)]
    kv, mp = make_pools(64, 16, 4, fill=0.0)
    layout = PoolLayout.of(kv, mp)
    descs = transfer_descriptors(layout, layout, list(range(16, 48)), list(range(32, 64)), 1, 2)
    # 2 layers x (K, V) x one run, then conv and SSM of 3 linear layers.
    assert len(descs) == 4 + 6
    assert descs[0][2] == 32 * layout.kv_bytes_per_token


class FakeEngine:
    def __init__(self, fail_at: int | None = None):
        self.batches: list[int] = []
        self.fail_at = fail_at

    def batch_transfer_sync_write(self, session, srcs, dsts, lens):
        assert len(srcs) == len(dsts) == len(lens)
        self.batches.append(len(srcs))
        return -1 if len(self.batches) == self.fail_at else 0


def test_writes_are_chunked_below_mooncakes_descriptor_limit():
    engine = MooncakeTransferEngine.__new__(MooncakeTransferEngine)
    engine.engine = FakeEngine()
    engine.write("peer:1", [(i, i, 1) for i in range(5000)])
    assert engine.engine.batches == [1024] * 4 + [904]
    # (2,048 is Mooncake's TCP limit per batch; two prefill ranks writing into one decode rank at once
    # overflowed its queue with batches of ~1,900 under load: combo_sweep_pd's tp2_to_1+falcon)
    assert max(engine.engine.batches) <= MAX_DESCRIPTORS_PER_BATCH <= 1024

    engine.engine = FakeEngine(fail_at=2)
    with pytest.raises(TransferError, match="failed"):
        engine.write("peer:1", [(i, i, 1) for i in range(5000)])


def test_layouts_of_different_models_are_refused():
    kv, mp = make_pools(64, 16, 4, fill=0.0)
    other_kv = MHATokenToKVPool(64, 16, torch.float32, head_num=4, head_dim=4, layer_ids=LAYERS)
    message = PoolLayout.of(kv, mp).mismatch(PoolLayout.of(other_kv, mp))
    assert message is not None and "KV layouts differ" in message
    layout = PoolLayout.of(kv, mp)
    assert PoolLayout.from_dict(layout.to_dict()) == layout


def test_kv_cache_dtypes_of_the_same_size_are_refused():
    """bfloat16 and float16 KV (or the two float8s) have the same bytes per token: the layouts name the
    dtype, so a prefill server and a decode server started with different --kv-cache-dtype refuse."""
    _, mp = make_pools(64, 16, 4, fill=0.0)
    pools = {
        dtype: MHATokenToKVPool(64, 16, dtype, head_num=2, head_dim=4, layer_ids=LAYERS)
        for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
    }
    layouts = {dtype: PoolLayout.of(kv, mp) for dtype, kv in pools.items()}
    for a, b in [(torch.bfloat16, torch.float16), (torch.float8_e4m3fn, torch.float8_e5m2)]:
        assert layouts[a].kv_bytes_per_token == layouts[b].kv_bytes_per_token
        message = layouts[a].mismatch(layouts[b])
        assert message is not None and "--kv-cache-dtype" in message
    assert layouts[torch.float8_e5m2].mismatch(PoolLayout.of(pools[torch.float8_e5m2], mp)) is None


def test_a_float8_and_a_16_bit_kv_cache_are_refused_naming_the_flag():
    """float8 against bfloat16 KV also differs in bytes per token: the refusal still names
    --kv-cache-dtype (it said only that the KV layouts differ, which the PD sweep's kv_fp8_mismatch
    pair got as its 500), both ways."""
    _, mp = make_pools(64, 16, 4, fill=0.0)
    bf16, fp8 = (
        PoolLayout.of(MHATokenToKVPool(64, 16, dtype, head_num=2, head_dim=4, layer_ids=LAYERS), mp)
        for dtype in (torch.bfloat16, torch.float8_e4m3fn)
    )
    assert bf16.kv_bytes_per_token != fp8.kv_bytes_per_token
    for a, b in [(bf16, fp8), (fp8, bf16)]:
        message = a.mismatch(b)
        assert message is not None and "--kv-cache-dtype" in message, message


@pytest.mark.parametrize(
    "host, port, room, field",
    [
        ("h", 8998, -1, "bootstrap_room"),
        ("h", 8998, True, "bootstrap_room"),
        ("h", 8998, "7", "bootstrap_room"),
        (None, 8998, 7, "bootstrap_host"),
        ("h", 70000, 7, "bootstrap_port"),
        ("h", "8998", 7, "bootstrap_port"),
    ],
)
def test_bad_bootstrap_fields_name_the_field(host, port, room, field):
    with pytest.raises(RequestError) as e:
        bootstrap_info(host, port, room)
    assert e.value.param == field


def test_bootstrap_fields_make_a_room():
    assert bootstrap_info(None, None, None) is None
    info = bootstrap_info("10.0.0.1", None, 2848527443091318016)
    assert (info.host, info.port, info.room) == ("10.0.0.1", None, "2848527443091318016")


def test_state_dtypes_of_the_same_size_are_refused_naming_the_flag():
    """A bfloat16 and a float16 SSM state (--mamba-ssm-dtype on one side only) weigh alike per slot: the
    layouts name the state dtypes, so the pair is refused naming the flag. Before, the decode server took
    the prefill server's bfloat16 bits as float16 and decoded other tokens (the PD sweep's
    ssm_dtype_mismatch pair served)."""
    kv, _ = make_pools(64, 16, 4, fill=0.0)
    layouts = {}
    for dtype in (torch.bfloat16, torch.float16):
        params = Mamba2CacheParams(
            shape=Mamba2StateShape(conv=(6, 3), temporal=(2, 4, 4), conv_kernel=4),
            dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=dtype),
            layers=tuple(LINEAR),
        )
        layouts[dtype] = PoolLayout.of(kv, MambaPool(4, params))
    bf16, fp16 = layouts[torch.bfloat16], layouts[torch.float16]
    assert bf16.state_slot_bytes == fp16.state_slot_bytes
    for a, b in [(bf16, fp16), (fp16, bf16)]:
        message = a.mismatch(b)
        assert message is not None and "--mamba-ssm-dtype" in message, message
    assert bf16.mismatch(PoolLayout.from_dict(bf16.to_dict())) is None


def test_pools_filled_by_other_weights_are_refused_naming_the_flags():
    """Online FP8 (--quantization fp8) or another --dtype on one server only: the pools may match, but the
    decode server would continue the prefill server's KV and state with other weights, answering neither
    server's tokens (the PD sweep's quant_fp8 on the prefill side only was served so). The layouts name
    the weights; a --dtype change, which changes the KV dtype too, is named as such."""
    kv, mp = make_pools(64, 16, 4, fill=0.0)
    plain = replace(PoolLayout.of(kv, mp), weights="--dtype torch.float32, --quantization none")
    fp8 = replace(plain, weights="--dtype torch.float32, --quantization fp8")
    bf16 = replace(plain, weights="--dtype torch.bfloat16, --quantization none", kv_dtype="torch.bfloat16")
    for a, b in [(plain, fp8), (fp8, plain), (plain, bf16)]:
        message = a.mismatch(b)
        assert message is not None and "--dtype" in message and "--quantization" in message, message
    assert "--kv-cache-dtype" not in plain.mismatch(bf16)
    assert plain.mismatch(PoolLayout.from_dict(plain.to_dict())) is None
