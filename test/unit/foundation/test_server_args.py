"""ServerArgs: every flag parses, every refused combination fails with a sentence naming the flag,
`auto` resolves as documented, and the PD decode fallback applies."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs, ServerArgsError, prepare_server_args
from sglang.srt.server_args_checks import MAMBA_SCHEDULER_STRATEGY_CHOICES
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")


def test_every_design_flag_parses():
    args = prepare_server_args(
        [
            "--model-path", "tiny-nemotron-h",
            "--tokenizer-path", "tiny-nemotron-h",
            "--served-model-name", "tiny",
            "--context-length", "2048",
            "--dtype", "bfloat16",
            "--device", "cpu",
            "--random-seed", "7",
            "--host", "0.0.0.0",
            "--port", "31000",
            "--api-key", "sk-test",
            "--enable-metrics",
            "--log-level", "debug",
            "--mem-fraction-static", "0.5",
            "--max-running-requests", "12",
            "--max-total-tokens", "9000",
            "--max-prefill-tokens", "4096",
            "--chunked-prefill-size", "256",
            "--page-size", "16",
            "--kv-cache-dtype", "fp8_e4m3",
            "--disable-overlap-schedule",
            "--mamba-scheduler-strategy", "extra_buffer",
            "--mamba-track-interval", "64",
            "--max-mamba-cache-size", "40",
            "--mamba-full-memory-ratio", "0.5",
            "--mamba-ssm-dtype", "bfloat16",
            "--disaggregation-mode", "prefill",
            "--disaggregation-transfer-backend", "nixl",
            "--disaggregation-bootstrap-port", "9000",
            "--disaggregation-decode-extra-slots", "4",
            "--disaggregation-ib-device", "mlx5_0",
            "--attention-backend", "torch_native",
            "--triton-attention-num-kv-splits", "4",
        ]
    )  # fmt: skip
    assert (args.model_path, args.tokenizer_path, args.served_model_name) == ("tiny-nemotron-h",) * 2 + (
        "tiny",
    )
    assert (args.context_length, args.dtype, args.device, args.random_seed) == (2048, "bfloat16", "cpu", 7)
    assert (args.host, args.port, args.api_key, args.enable_metrics, args.log_level) == (
        "0.0.0.0", 31000, "sk-test", True, "debug"
    )  # fmt: skip
    assert (args.mem_fraction_static, args.max_running_requests, args.max_total_tokens) == (0.5, 12, 9000)
    assert (args.max_prefill_tokens, args.chunked_prefill_size, args.page_size) == (4096, 256, 16)
    assert args.kv_cache_dtype == "fp8_e4m3"
    assert args.model_config.kv_cache_torch_dtype == torch.float8_e4m3fn
    assert args.disable_overlap_schedule and not args.disable_radix_cache
    assert (args.mamba_scheduler_strategy, args.mamba_track_interval, args.max_mamba_cache_size) == (
        "extra_buffer", 64, 40
    )  # fmt: skip
    assert (args.mamba_full_memory_ratio, args.mamba_ssm_dtype) == (0.5, "bfloat16")
    assert (args.disaggregation_mode, args.disaggregation_transfer_backend) == ("prefill", "nixl")
    assert (args.disaggregation_bootstrap_port, args.disaggregation_decode_extra_slots) == (9000, 4)
    assert args.disaggregation_ib_device == "mlx5_0"
    assert (args.attention_backend, args.triton_attention_num_kv_splits) == ("torch_native", 4)
    assert args.mamba_cache_chunk_size == 32 and args.mamba_strategy.track_entries == 1


def test_defaults_match_sglang():
    args = prepare_server_args([])
    assert args.model_path == "tiny-qwen3-next-demo" and args.host == "127.0.0.1" and args.port == 30000
    assert args.page_size == 1 and args.max_prefill_tokens == 16384 and args.mamba_full_memory_ratio == 0.9
    assert args.mamba_track_interval == 256 and args.device == "cpu" and args.dtype == "auto"
    assert args.kv_cache_dtype == "auto" and args.model_config.kv_cache_torch_dtype == torch.float32
    assert args.disaggregation_mode == "null" and not args.enable_metrics
    assert args.enable_overlap_schedule and args.mamba_strategy.lazy


def test_radix_cache_strategy_is_the_same_flag():
    assert MAMBA_SCHEDULER_STRATEGY_CHOICES == ["auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"]
    a = prepare_server_args(["--mamba-radix-cache-strategy", "extra_buffer"])
    b = prepare_server_args(["--mamba-scheduler-strategy", "extra_buffer"])
    assert a.mamba_scheduler_strategy == b.mamba_scheduler_strategy == a.mamba_radix_cache_strategy


@pytest.mark.parametrize(
    "kwargs,expected,overlap",
    [
        ({}, "extra_buffer_lazy", True),
        ({"disable_overlap_schedule": True}, "extra_buffer", False),
        ({"disable_radix_cache": True}, "no_buffer", True),
    ],
)
def test_auto_strategy_resolution(kwargs, expected, overlap):
    args = ServerArgs(**kwargs)
    assert args.mamba_scheduler_strategy == expected
    assert args.enable_overlap_schedule == overlap
    assert args.mamba_strategy_reason.startswith(f"auto chose {expected}")


def test_strategy_resolves_once_into_the_slot_rules():
    lazy = ServerArgs(mamba_scheduler_strategy="extra_buffer_lazy").mamba_strategy
    assert (lazy.extra_buffer, lazy.lazy, lazy.track_entries) == (True, True, 0)
    assert (lazy.resident_slots_per_req, lazy.max_slots_per_req) == (1, 2)
    eb = ServerArgs(mamba_scheduler_strategy="extra_buffer").mamba_strategy
    assert (eb.extra_buffer, eb.lazy, eb.resident_slots_per_req) == (True, False, 3)
    no_radix = ServerArgs(mamba_scheduler_strategy="extra_buffer", disable_radix_cache=True)
    assert not no_radix.enable_mamba_extra_buffer() and no_radix.mamba_strategy.resident_slots_per_req == 1
    nb = ServerArgs(mamba_scheduler_strategy="no_buffer").mamba_strategy
    assert not nb.extra_buffer and nb.track_entries == 0 and nb.resident_slots_per_req == 1
    assert ServerArgs(page_size=128).mamba_strategy.cache_chunk_size == 128


def test_lazy_without_overlap_holds_one_slot_too():
    args = ServerArgs(mamba_scheduler_strategy="extra_buffer_lazy", disable_overlap_schedule=True)
    strategy = args.mamba_strategy
    assert strategy.extra_buffer and strategy.lazy and strategy.track_entries == 0
    assert strategy.resident_slots_per_req == 1


def test_defaults_are_aligned_to_the_cache_chunk():
    big_page = ServerArgs(model_path="tiny-qwen3-next", page_size=512)
    assert big_page.mamba_cache_chunk_size == 512
    assert big_page.mamba_track_interval == 512 and big_page.chunked_prefill_size == 2048
    assert ServerArgs(chunked_prefill_size=-1).chunked_prefill_enabled is False
    assert ServerArgs(chunked_prefill_size=0).chunked_prefill_size == -1
    # Unaligned sizes are fine when no checkpoint depends on them.
    assert (
        ServerArgs(mamba_scheduler_strategy="no_buffer", chunked_prefill_size=100).chunked_prefill_size == 100
    )
    assert ServerArgs(disable_radix_cache=True, mamba_track_interval=100).mamba_track_interval == 100
    # Upstream's Qwen3-Next tests track every 2 tokens with extra_buffer: any multiple of the page size.
    for strategy in ("extra_buffer", "extra_buffer_lazy"):
        assert ServerArgs(mamba_scheduler_strategy=strategy, mamba_track_interval=2).mamba_track_interval == 2
    assert ServerArgs(page_size=16, mamba_track_interval=48).mamba_track_interval == 48


REFUSED = [
    ({"mamba_scheduler_strategy": "no_buffer", "page_size": 16}, "no_buffer needs --page-size 1"),
    ({"mamba_scheduler_strategy": "extra_buffer", "chunked_prefill_size": 100}, "--chunked-prefill-size 100 must be a multiple of the mamba cache chunk size 64"),
    ({"mamba_scheduler_strategy": "extra_buffer_lazy", "page_size": 16, "mamba_track_interval": 100}, "--mamba-track-interval 100 must be a multiple of --page-size 16"),
    ({"model_path": "tiny-nemotron-h", "chunked_prefill_size": 48}, "--chunked-prefill-size 48 must be a multiple of the mamba cache chunk size 32"),
    ({"page_size": 128, "mamba_track_interval": 64}, "--mamba-track-interval 64 must be a multiple of --page-size 128"),
    ({"page_size": 48}, "--page-size 48 and the model's state chunk 64"),
    ({"page_size": 0}, "--page-size must be a positive integer"),
    ({"port": 0}, "--port must be between 1 and 65535"),
    ({"context_length": 100000}, "--context-length 100000 exceeds the model's max_position_embeddings"),
    ({"context_length": 0}, "--context-length must be a positive integer"),
    ({"tp_size": 0}, "--tp-size must be a positive integer"),
    ({"mem_fraction_static": 1.5}, "--mem-fraction-static must be between 0 and 1"),
    ({"max_running_requests": 0}, "--max-running-requests must be a positive integer"),
    ({"max_total_tokens": -3}, "--max-total-tokens must be a positive integer"),
    ({"max_mamba_cache_size": 0}, "--max-mamba-cache-size must be a positive integer"),
    ({"chunked_prefill_size": -5}, "--chunked-prefill-size must be positive, or -1"),
    ({"mamba_full_memory_ratio": 0}, "--mamba-full-memory-ratio must be positive"),
    ({"mamba_track_interval": 0}, "--mamba-track-interval must be a positive integer"),
    ({"stream_interval": 0}, "--stream-interval must be a positive integer"),
    ({"mamba_scheduler_strategy": "bogus"}, "--mamba-scheduler-strategy must be one of"),
    ({"dtype": "int8"}, "--dtype must be one of"),
    ({"mamba_ssm_dtype": "int8"}, "--mamba-ssm-dtype must be one of"),
    ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype must be one of"),
    ({"kv_cache_dtype": "fp4_e2m1"}, "--kv-cache-dtype fp4_e2m1 is not supported"),
    ({"disaggregation_mode": "both"}, "--disaggregation-mode must be one of"),
    ({"disaggregation_decode_extra_slots": -1}, "--disaggregation-decode-extra-slots must be 0 or more"),
    ({"model_path": "/nonexistent/model"}, "--model-path '/nonexistent/model' cannot be served"),
    ({"device": "cuda"}, "--device cuda was given, but no CUDA device is available"),
    ({"attention_backend": "flashinfer"}, "--attention-backend flashinfer is not supported by this server"),
    ({"attention_backend": "sdpa"}, "--attention-backend must be one of torch_native, triton"),
    ({"triton_attention_num_kv_splits": 0}, "--triton-attention-num-kv-splits must be a positive integer"),
    ({"bucket_time_to_first_token": [0.5, 0.1]}, "--bucket-time-to-first-token takes positive bounds in ascending order"),
    ({"bucket_e2e_request_latency": [0.0, 1.0]}, "--bucket-e2e-request-latency takes positive bounds"),
    ({"bucket_inter_token_latency": [0.1, 0.1]}, "--bucket-inter-token-latency takes positive bounds"),
    ({"response_store_max_mb": 0}, "--response-store-max-mb must be at least 1"),
    ({"enable_response_store": True, "disaggregation_mode": "prefill"}, "--enable-response-store is not supported with --disaggregation-mode"),
]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,message", REFUSED, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(REFUSED)]
)
def test_refused_combinations_name_the_flag(kwargs, message):
    with pytest.raises(ServerArgsError) as err:
        ServerArgs(**kwargs)
    text = str(err.value)
    assert message in text
    assert text.count(". ") == 0 and text.endswith("."), "one sentence"


def test_attention_backend_resolution(monkeypatch):
    """torch_native on CPU by default; triton on a CPU only under the interpreter (tests), else refused
    in one sentence; triton is the CUDA default (the device resolved as on a GPU machine)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert ServerArgs().attention_backend == "torch_native"
    with pytest.raises(ServerArgsError, match=r"^--attention-backend triton needs --device cuda .*\.$"):
        ServerArgs(attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ServerArgs(attention_backend="triton").attention_backend == "triton"
    args = ServerArgs()
    args.device, args.attention_backend = "cuda", None
    args._handle_attention_backend()
    assert args.attention_backend == "triton"


@pytest.mark.parametrize(
    "capability,refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)]
)
def test_fp8_e4m3_kv_needs_a_gpu_whose_triton_has_it(monkeypatch, capability, refused):
    """Triton compiles e4m3fn loads from compute capability 8.9 only: an older GPU is refused at start in
    one sentence, not at the first forward (the device resolved as on a GPU machine)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    for kv, may_refuse in [("fp8_e4m3", True), ("fp8_e5m2", False)]:
        args = ServerArgs(kv_cache_dtype=kv)
        args.device, args.attention_backend = "cuda", None
        if refused and may_refuse:
            with pytest.raises(ServerArgsError, match=r"^--kv-cache-dtype fp8_e4m3 needs a GPU .*\.$"):
                args._handle_attention_backend()
        else:
            args._handle_attention_backend()
            assert args.attention_backend == "triton"


@pytest.mark.parametrize(
    "memory_mib,chunk,graph_bs",
    [
        (15_360, 2048, 8),  # T4
        (24_564, 4096, 48),  # RTX 4090
        (40_960, 4096, 32),  # A100 40 GB
        (81_559, 8192, 256),  # H100 80 GB
        (143_771, 8192, 256),  # H200
        (183_359, 16384, 512),  # B200
        (None, 4096, 160),  # the memory could not be read
    ],
)
def test_cuda_defaults_follow_gpu_memory(monkeypatch, memory_mib, chunk, graph_bs):
    """On CUDA, --chunked-prefill-size and --cuda-graph-max-bs default to SGLang's values for the GPU's
    memory (the device resolved as on a GPU machine, its memory faked); CPU keeps 2048 and no graph size."""
    import sglang.srt.server_args as server_args_module

    monkeypatch.setattr(server_args_module, "gpu_memory_mib", lambda: memory_mib)
    args = ServerArgs()
    assert args.chunked_prefill_size == 2048 and args.cuda_graph_max_bs is None
    args.device, args.attention_backend = "cuda", "triton"  # as resolved on a GPU machine
    args.chunked_prefill_size = None
    args._handle_chunk_aligned_sizes(args._handle_gpu_memory_settings())
    assert args.chunked_prefill_size == chunk and args.cuda_graph_max_bs == graph_bs
    if memory_mib is None:
        assert args.mem_fraction_static is None  # the pool sizing's own default (0.85) then applies
    else:
        # All but the reserve: 512 + 1.5 per prefill token + 2 per graph size + 128 MiB, >= 10 GiB above 60.
        reserve = (1 - args.mem_fraction_static) * memory_mib
        floor = 10 * 1024 if memory_mib > 60 * 1024 else 0
        assert abs(reserve - max(640 + 1.5 * chunk + 2 * graph_bs, floor)) <= memory_mib * 0.0005 + 1e-6


def test_cuda_mem_fraction_default_follows_sglang():
    """SGLang's --mem-fraction-static on an H100 and an H200 (8,192-token chunks, 256 graph sizes), a
    chunk-free server reserving for its largest prefill, and a GPU too small for the reserve."""
    from sglang.srt.configs.gpu_memory_defaults import mem_fraction_static_default

    assert mem_fraction_static_default(81_559, 8192, 256) == 0.835
    assert mem_fraction_static_default(143_771, 8192, 256) == 0.907
    assert mem_fraction_static_default(143_771, 16384, 256) < mem_fraction_static_default(143_771, 8192, 0)
    assert mem_fraction_static_default(2_048, 2048, 8) is None


def test_cuda_mem_fraction_reserves_the_mtp_graphs(monkeypatch):
    """With EAGLE / NEXTN the reserve also holds the MTP layer's CUDA graphs (`mtp_graphs_bytes`), from the
    model's shapes: at Qwen3-Next-80B's (vocab 151,936, hidden 2,048, 10 experts of 512 and a shared one of
    512, bf16, k = 3) and an H200's 36 graph sizes up to 256, 832 MiB (upstream adds 2 GiB for EAGLE /
    NEXTN's draft and graphs, whatever the shapes); the server's fraction takes it beside the rest; none
    for NGRAM or without graphs."""
    import sglang.srt.server_args as server_args_module
    from sglang.srt.configs.gpu_memory_defaults import MtpGraphShapes, mtp_graphs_bytes
    from sglang.srt.configs.gpu_memory_defaults import mtp_graphs_reserve_mib as reserve_mib

    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8)]  # (their sum: 4,243)
    row = (8 * 2048 + 3 * (10 * 512 + 512)) * 2  # the MTP layer's activations per row: 66,560 bytes
    draft = 3 * 256 * 151_936 * (2 + 4) + 256 * row + 4243 * 3 * 8  # logits, layer, drafts: 717,262,280
    after = 4243 * (1 + 4) * 2048 * 2 + 256 * 4 * row  # g per decode and verify size, layer: 155,054,080
    shapes = MtpGraphShapes(151_936, 2048, 10 * 512 + 512, 2, 3, sizes)
    assert mtp_graphs_bytes(shapes) == draft + after == 872_316_360  # 831.9 MiB
    # Each term scales with its shape: twice the vocabulary adds the draft loop's logits once more.
    assert mtp_graphs_bytes(shapes._replace(vocab_size=2 * 151_936)) - mtp_graphs_bytes(shapes) == 700_121_088

    def on_cuda(**kwargs) -> ServerArgs:
        args = ServerArgs(model_path="tiny-qwen3-next", **kwargs)
        args.device, args.attention_backend = "cuda", "triton"  # as resolved on a GPU machine
        args.chunked_prefill_size = None
        args._handle_gpu_memory_settings()
        return args

    nextn = ServerArgs(model_path="tiny-qwen3-next", speculative_algorithm="NEXTN", cuda_graph_max_bs=256)
    cfg = nextn.model_config.arch.hf_config  # (an MoE MTP layer: 2 experts of 32 and a shared one of 32)
    tiny = MtpGraphShapes(cfg.vocab_size, cfg.hidden_size, 2 * 32 + 32, 4, 3, sizes)
    assert reserve_mib(nextn, 256) == mtp_graphs_bytes(tiny) / 2**20 > 0
    assert reserve_mib(nextn, 0) == 0  # (no graphs)
    assert reserve_mib(ServerArgs(model_path="tiny-qwen3-next", speculative_algorithm="NGRAM"), 256) == 0
    # The server's fraction: 4 GiB of MTP graphs move the reserve by 4 GiB (within the 3-decimal rounding).
    monkeypatch.setattr(server_args_module, "gpu_memory_mib", lambda: 81_559)
    plain = on_cuda()
    monkeypatch.setattr(server_args_module, "mtp_graphs_reserve_mib", lambda args, bs: 4096.0 * (bs == 256))
    spec = on_cuda(speculative_algorithm="NEXTN")
    assert abs((plain.mem_fraction_static - spec.mem_fraction_static) * 81_559 - 4096) <= 82


def test_cuda_memory_defaults_keep_given_flags_and_alignment(monkeypatch):
    """A given flag wins over the memory default, a given --cuda-graph-bs leaves --cuda-graph-max-bs
    unset, and the default prefill chunk is aligned to the cache chunk like any default."""
    import sglang.srt.server_args as server_args_module

    probes = []
    monkeypatch.setattr(server_args_module, "gpu_memory_mib", lambda: probes.append(1) or 81_559)

    def on_cuda(**kwargs) -> ServerArgs:
        args = ServerArgs(**kwargs)
        args.device = "cuda"
        args.attention_backend = kwargs.get("attention_backend", "triton")  # as resolved on a GPU machine
        args.chunked_prefill_size = kwargs.get("chunked_prefill_size")
        args._handle_chunk_aligned_sizes(args._handle_gpu_memory_settings())
        return args

    given = on_cuda(chunked_prefill_size=1024, cuda_graph_max_bs=24, mem_fraction_static=0.5)
    assert (given.chunked_prefill_size, given.cuda_graph_max_bs, given.mem_fraction_static) == (1024, 24, 0.5)
    assert probes == []
    listed = on_cuda(cuda_graph_bs=[1, 8])
    assert listed.cuda_graph_max_bs is None and listed.chunked_prefill_size == 8192
    # The graph reserve follows the captured sizes: 2 MiB x 8 listed (not 2 x 512 given beside them),
    # 2 x 256 by default, none with graphs off or with the torch attention (which captures none).
    both = on_cuda(cuda_graph_bs=[1, 8], cuda_graph_max_bs=512)
    graphs_off = [on_cuda(disable_cuda_graph=True), on_cuda(attention_backend="torch_native")]
    reserve = {  # MiB: 512 + 1.5 x 8192 + 128 = 12,928 and the graphs'
        name: round((1 - a.mem_fraction_static) * 81_559)
        for name, a in [("listed", listed), ("both", both), ("default", on_cuda()), ("off", graphs_off[0]),
                        ("torch attention", graphs_off[1])]
    }  # fmt: skip
    assert abs(reserve["listed"] - (12_928 + 16)) <= 41 and reserve["both"] == reserve["listed"]
    assert abs(reserve["default"] - (12_928 + 512)) <= 41
    assert abs(reserve["off"] - 12_928) <= 41 and reserve["torch attention"] == reserve["off"]
    # Chunked prefill off (0 or -1): the reserve is for the largest prefill, --max-prefill-tokens.
    for off in (0, -1):
        unchunked = on_cuda(chunked_prefill_size=off)
        assert unchunked.chunked_prefill_size == -1
        assert abs((1 - unchunked.mem_fraction_static) * 81_559 - (640 + 1.5 * 16384 + 512)) <= 41
    # A given chunk sizes the reserve; at 2,048 tokens it is under the 10 GiB floor of an 80 GiB GPU.
    only_chunk = on_cuda(chunked_prefill_size=2048)
    assert only_chunk.chunked_prefill_size == 2048 and only_chunk.mem_fraction_static == 0.874
    # A cache chunk of 3,000 tokens (page size) takes the largest multiple under the default: 6,000.
    monkeypatch.setattr(ServerArgs, "mamba_cache_chunk_size", 3000)
    assert on_cuda(mamba_scheduler_strategy="extra_buffer").chunked_prefill_size == 6000


def test_gpu_memory_probe(monkeypatch):
    """The probe asks nvidia-smi for the first visible device's total memory (MiB), without touching
    torch's CUDA state; where nvidia-smi fails it reads torch's device properties; where neither can,
    as on this CPU machine, None."""
    import subprocess
    from types import SimpleNamespace

    import sglang.srt.configs.gpu_memory_defaults as probe

    if not torch.cuda.is_available():
        assert probe.gpu_memory_mib() is None
    asked = []

    def smi(cmd, **kwargs):
        asked.append(cmd)
        if smi.fails:
            raise FileNotFoundError(cmd[0])
        return SimpleNamespace(stdout="143771\n")

    def properties(i):
        raise AssertionError("torch's CUDA state is touched although nvidia-smi answered")

    monkeypatch.setattr(subprocess, "run", smi)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    smi.fails = False
    assert probe.gpu_memory_mib() == 143771 and asked[-1][-2:] == ["-i", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert probe.gpu_memory_mib() == 143771 and asked[-1][-2:] == ["-i", "0"]
    smi.fails = True
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=(i + 77) * 2**30)
    )
    assert probe.gpu_memory_mib() == 80 * 1024


def test_pd_decode_turns_radix_off_and_falls_back_to_no_buffer(caplog):
    with caplog.at_level(logging.WARNING):
        args = ServerArgs(
            disaggregation_mode="decode", mamba_scheduler_strategy="extra_buffer_lazy", page_size=16
        )
    assert args.disable_radix_cache
    assert args.mamba_scheduler_strategy == "no_buffer" and not args.enable_mamba_extra_buffer()
    assert "falls back to no_buffer" in caplog.text and "radix cache is turned off" in caplog.text
    # The radix cache being off, no_buffer's page-size rule does not apply and overlap stays on.
    assert args.page_size == 16 and args.enable_overlap_schedule
    prefill = ServerArgs(disaggregation_mode="prefill", mamba_scheduler_strategy="extra_buffer")
    assert prefill.mamba_scheduler_strategy == "extra_buffer" and not prefill.disable_radix_cache


def test_server_args_pickle_for_subprocesses():
    import pickle

    args = ServerArgs(model_path="tiny-nemotron-h")
    assert args.model_config.arch.kernel_state_chunk == 32
    clone = pickle.loads(pickle.dumps(args))
    assert clone.mamba_scheduler_strategy == args.mamba_scheduler_strategy
    assert clone.mamba_cache_chunk_size == 32


def test_env_registry_override_reaches_subprocesses():
    var = envs.SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL
    assert var.get() == 0 and not var.is_set()
    code = "from sglang.srt.environ import envs; print(envs.SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL.get())"
    with var.override(2):
        assert var.get() == 2
        out = subprocess.check_output([sys.executable, "-c", code], text=True)
        assert out.strip() == "2"
    assert var.get() == 0 and "SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL" not in os.environ
    with envs.SGLANG_TEST_SKIP_DEFERRED_COW.override(True):
        assert envs.SGLANG_TEST_SKIP_DEFERRED_COW.get() is True
    os.environ["SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL"] = "often"
    try:
        with pytest.raises(ValueError, match="SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL='often'"):
            var.get()
    finally:
        del os.environ["SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL"]
    assert {v.name for v in envs.all()} >= {"SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL", "SGLANG_CACHE_DIR"}


def test_gc_threshold_sets_the_scheduler_processes_collector():
    """--gc-threshold (upstream's): 1 to 3 non-negative integers, applied where the scheduler process
    starts (`configure_subprocess` calls `apply_gc_threshold`; not called here: it also configures the
    process's logging, which would reach the later tests); anything else is refused naming the flag."""
    import gc
    import inspect

    from sglang.srt.utils.process import apply_gc_threshold, configure_subprocess

    args = prepare_server_args(["--gc-threshold", "5000", "20"])
    assert args.gc_threshold == [5000, 20]
    before = gc.get_threshold()
    try:
        apply_gc_threshold(args)
        assert gc.get_threshold() == (5000, 20, before[2])
        assert "apply_gc_threshold(server_args)" in inspect.getsource(configure_subprocess)
    finally:
        gc.set_threshold(*before)
    for bad in ([1, 2, 3, 4], [-1], []):
        with pytest.raises(ServerArgsError, match="^--gc-threshold takes 1 to 3 non-negative integers"):
            ServerArgs(model_path="tiny-qwen3-next", gc_threshold=bad)
