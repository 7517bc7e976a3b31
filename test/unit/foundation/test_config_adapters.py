"""The config adapters state layer ids, state shapes, slot bytes and the cache chunk of each preset."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.configs import hybrid_arch_config
from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.configs.nemotron_h import NemotronHArchConfig
from sglang.srt.configs.qwen3_next import Qwen3NextArchConfig
from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

# (full attention ids, linear ids, conv shape, SSM shape, kernel chunk, float32 bytes per slot)
# Qwen3-Next: conv_dim = 2 * (2 k-heads * 16) + 4 v-heads * 16 = 128; SSM (4 v-heads, 16, 16).
# Nemotron-H: conv_dim = 8 heads * 16 + 2 * (2 groups * 16) = 192; SSM (8 heads, 16 head_dim, 16 state).
EXPECTED = {
    "tiny-qwen3-next": ([3], [0, 1, 2], (128, 3), (4, 16, 16), 64, 3 * (128 * 3 * 4 + 4 * 16 * 16 * 4)),
    "tiny-nemotron-h": ([3], [0, 2, 4], (192, 3), (8, 16, 16), 32, 3 * (192 * 3 * 4 + 8 * 16 * 16 * 4)),
    # Qwen3.5 and Qwen3.5-MoE have Qwen3-Next's linear layers.
    "tiny-qwen3.5": ([3], [0, 1, 2], (128, 3), (4, 16, 16), 64, 3 * (128 * 3 * 4 + 4 * 16 * 16 * 4)),
    "tiny-qwen3.5-moe": ([3], [0, 1, 2], (128, 3), (4, 16, 16), 64, 3 * (128 * 3 * 4 + 4 * 16 * 16 * 4)),
    # Granite-4.0-H: Nemotron-H's Mamba2 sizes (8 heads of 16, 2 groups, state 16), attention at layer 1.
    "tiny-granite-4.0-h": ([1], [0, 2, 3], (192, 3), (8, 16, 16), 32, 3 * (192 * 3 * 4 + 8 * 16 * 16 * 4)),
    # Falcon-H1: every layer both; the Mamba2 mixers take ids 3..5 (d_ssm 128 = 8 heads of 16).
    "tiny-falcon-h1": ([0, 1, 2], [3, 4, 5], (192, 3), (8, 16, 16), 32, 3 * (192 * 3 * 4 + 8 * 16 * 16 * 4)),
    # Bamba: attention at attn_layer_indices [1, 3].
    "tiny-bamba": ([1, 3], [0, 2], (192, 3), (8, 16, 16), 32, 2 * (192 * 3 * 4 + 8 * 16 * 16 * 4)),
    # LFM2: the conv window of the hidden size (kernel 3); an 8-element SSM row nothing reads.
    "tiny-lfm2": ([2], [0, 1, 3], (64, 2), (1, 1, 8), 64, 3 * (64 * 2 * 4 + 8 * 4)),
    "tiny-lfm2-moe": ([2], [0, 1, 3], (64, 2), (1, 1, 8), 64, 3 * (64 * 2 * 4 + 8 * 4)),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_adapter_values(name):
    full, linear, conv, ssm, chunk, slot_bytes = EXPECTED[name]
    arch = hybrid_arch_config(load_hf_config(name))
    assert arch.full_attention_layer_ids == full
    assert arch.linear_layer_ids == linear
    assert arch.state_shape.conv == conv and arch.state_shape.temporal == ssm
    assert arch.kernel_state_chunk == chunk
    params = arch.mamba2_cache_params(torch.float32)
    assert params.dtype.conv == torch.float32 and params.dtype.temporal == torch.float32
    assert params.layers == tuple(linear)
    assert params.mamba_cache_per_req == slot_bytes == arch.mamba_cache_per_req()


@pytest.mark.parametrize("name", list(EXPECTED))
def test_adapter_shapes_match_the_oracle_cache(name, oracles):
    ref = oracles[name]
    cache = ref.cache_after(list(range(3, 40)), 37)
    for layer_id in ref.arch.linear_layer_ids:
        conv = cache.layers[ref.arch.model_layer_of(layer_id)].conv_states[0]
        ssm = cache.layers[ref.arch.model_layer_of(layer_id)].recurrent_states[0]
        assert (conv.shape[1], conv.shape[2] - 1) == ref.arch.state_shape.conv
        if ssm is not None:  # a short conv has none
            assert ssm[0].numel() == torch.Size(ref.arch.state_shape.temporal).numel()
    for st in ref.states_from_cache(cache).values():
        assert tuple(st.conv.shape) == ref.arch.state_shape.conv
        assert tuple(st.ssm.shape) == ref.arch.state_shape.temporal


def test_state_dtypes_follow_model_flag_env_and_config():
    arch = hybrid_arch_config(load_hf_config("tiny-nemotron-h"))
    bf16 = arch.mamba2_cache_params(torch.bfloat16)
    assert bf16.dtype.conv == torch.bfloat16 and bf16.dtype.temporal == torch.float32
    assert bf16.mamba_cache_per_req == 3 * (192 * 3 * 2 + 8 * 16 * 16 * 4)
    assert arch.mamba2_cache_params(torch.float32, "bfloat16").mamba_cache_per_req == 3 * (
        192 * 3 * 4 + 8 * 16 * 16 * 2
    )
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("float16"):
        assert arch.mamba2_cache_params(torch.float32).dtype.temporal == torch.float16
        # The flag wins over the environment.
        assert arch.mamba2_cache_params(torch.float32, "bfloat16").dtype.temporal == torch.bfloat16
    with envs.SGLANG_MAMBA_CONV_DTYPE.override("bfloat16"):
        assert arch.mamba2_cache_params(torch.float32).dtype.conv == torch.bfloat16


@pytest.mark.parametrize(
    "name,page,expected",
    [
        ("tiny-qwen3-next", 1, 64),
        ("tiny-nemotron-h", 1, 32),
        ("tiny-qwen3-next", 16, 64),
        ("tiny-nemotron-h", 16, 32),
        ("tiny-qwen3-next", 128, 128),
        ("tiny-nemotron-h", 128, 128),
    ],
)
def test_mamba_cache_chunk_size(name, page, expected):
    assert ServerArgs(model_path=name, page_size=page).mamba_cache_chunk_size == expected


def test_page_size_must_divide_or_be_divided_by_the_model_chunk():
    with pytest.raises(ServerArgsError, match="--page-size 48"):
        ServerArgs(model_path="tiny-nemotron-h", page_size=48)


def test_chunk_size_aliases_and_interval_only_configs():
    assert NemotronHArchConfig(SimpleNamespace(mamba_chunk_size=256)).kernel_state_chunk == 256
    assert NemotronHArchConfig(SimpleNamespace(chunk_size=128)).kernel_state_chunk == 128
    cfg = SimpleNamespace(num_hidden_layers=8, full_attention_interval=4, layer_types=None)
    assert Qwen3NextArchConfig(cfg).full_attention_layer_ids == [3, 7]
    assert Qwen3NextArchConfig(cfg).linear_layer_ids == [0, 1, 2, 4, 5, 6]
    pattern = SimpleNamespace(layers_block_type=None, hybrid_override_pattern="M-M*E")
    assert NemotronHArchConfig(pattern).mamba_layer_ids == [0, 2]


def test_model_type_fallback_and_text_config():
    """A config naming no architecture of ours is matched by `model_type`; a multimodal one is read
    through its `text_config`."""
    text = SimpleNamespace(layer_types=["linear_attention", "full_attention"], vocab_size=7)
    for model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        cfg = SimpleNamespace(architectures=None, model_type=model_type, **vars(text))
        assert type(hybrid_arch_config(cfg)).__name__ == "Qwen3_5ArchConfig"
    wrapped = SimpleNamespace(
        architectures=["Qwen3_5MoeForConditionalGeneration"], get_text_config=lambda: text
    )
    arch = hybrid_arch_config(wrapped)
    assert arch.hf_config is text and arch.top_config is wrapped and arch.full_attention_layer_ids == [1]
    # Qwen3.5's configs name the SSM state dtype as `mamba_ssm_dtype` (in `text_config`).
    assert arch.config_ssm_dtype is None
    text.mamba_ssm_dtype = "bfloat16"
    assert arch.config_ssm_dtype == "bfloat16"


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        hybrid_arch_config(SimpleNamespace(architectures=["LlamaForCausalLM"], model_type="llama"))


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoints_dtype_on_a_gpu():
    from sglang.srt.configs.model_config import ModelConfig, resolve_dtype

    # No GPU is needed: the dtype is resolved from the device name and the config alone.
    assert ModelConfig("tiny-qwen3-next", device="cpu").torch_dtype == torch.float32
    assert ModelConfig("tiny-qwen3-next", device="cuda").torch_dtype == torch.float32  # a float32 checkpoint
    assert ModelConfig("tiny-qwen3-next", dtype="bfloat16", device="cpu").torch_dtype == torch.bfloat16
    assert resolve_dtype("auto", "cuda", torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", "cuda", "float16") == torch.float16
    assert resolve_dtype("auto", "cuda", None) == torch.bfloat16  # the config names none
    assert resolve_dtype("auto", "cuda", torch.float64) == torch.bfloat16  # one the runtime does not serve
    assert resolve_dtype("auto", "cpu", torch.bfloat16) == torch.float32
