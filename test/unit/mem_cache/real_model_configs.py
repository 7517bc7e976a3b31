"""The config.json of real hybrid checkpoints, as published on Hugging Face, for the memory planner's
tests at real size (`test_memory_planning.py`). Architecture fields only matter to the planner; each
dict keeps the published ones, and says where they came from."""

from __future__ import annotations

import copy

# Qwen/Qwen3-Next-80B-A3B-Instruct-FP8: the published config.json, as a model report of the downloaded
# checkpoint prints it (public repository file found with the search tool; its "完整配置" section:
# transformers 5.7's Qwen3NextConfig, hence `rope_parameters` and `dtype`). Its
# `modules_to_not_convert` lists, for each of the 48 layers, the norms and, for Gated DeltaNet layers,
# A_log / conv1d / dt_bias / in_proj_ba / norm, for attention layers q_norm / k_norm, plus mlp.gate and
# mlp.shared_expert_gate, then lm_head and the MTP head's modules: the list below is generated in that
# published order instead of spelled out (566 entries).
_QWEN3_NEXT_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def _qwen3_next_not_converted() -> list[str]:
    names = ["lm_head"]
    for i in range(48):
        p = f"model.layers.{i}"
        names.append(f"{p}.input_layernorm")
        if _QWEN3_NEXT_LAYER_TYPES[i % 4] == "linear_attention":
            names += [f"{p}.linear_attn.{m}" for m in ("A_log", "conv1d", "dt_bias", "in_proj_ba", "norm")]
        names += [f"{p}.mlp.gate", f"{p}.mlp.shared_expert_gate", f"{p}.post_attention_layernorm"]
        if _QWEN3_NEXT_LAYER_TYPES[i % 4] == "full_attention":
            names += [f"{p}.self_attn.k_norm", f"{p}.self_attn.q_norm"]
    names += ["mtp.fc"]
    names += [
        f"mtp.layers.0.{m}"
        for m in ("input_layernorm", "mlp.gate", "mlp.shared_expert_gate", "post_attention_layernorm")
    ]
    names += ["mtp.layers.0.self_attn.k_norm", "mtp.layers.0.self_attn.q_norm"]
    names += ["mtp.norm", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden"]
    return names


QWEN3_NEXT_80B_A3B_INSTRUCT_FP8 = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "layer_types": _QWEN3_NEXT_LAYER_TYPES * 12,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "pad_token_id": None,
    "partial_rotary_factor": 0.25,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "modules_to_not_convert": _qwen3_next_not_converted(),
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Qwen/Qwen3-Next-80B-A3B-Instruct (bfloat16): the same architecture fields (the FP8 model card says the
# FP8 release mirrors the BF16 one; a stored copy of the bf16 config.json found with the search tool
# agrees on every field it shows: full_attention_interval 4, head_dim 256, hidden_size 2048,
# intermediate_size 5120, the linear heads, max_position_embeddings, moe_intermediate_size 512), without
# quantization_config.
QWEN3_NEXT_80B_A3B_INSTRUCT = {
    k: copy.deepcopy(v) for k, v in QWEN3_NEXT_80B_A3B_INSTRUCT_FP8.items() if k != "quantization_config"
}
QWEN3_NEXT_80B_A3B_INSTRUCT["full_attention_interval"] = 4

# Qwen/Qwen3.5-27B: its config.json was not among the stored sources. The text model's fields come from
# two public descriptions of the published checkpoint found with the search tool: THUDM/slime
# scripts/models/qwen3.5-27B.sh (64 layers, hidden 5120, FFN 17408, 24 query heads, 4 KV groups,
# kv-channels 256, rotary 0.25, rope base 10,000,000, vocabulary 248,320, untied embeddings, gated
# attention output) and a GGUF-derived Qwen35Config of the shipping 27B (full_attention_interval 4, 48
# value / 16 key linear heads, 128-wide linear heads). The layout is transformers' Qwen3_5Config
# (multimodal: the language model under text_config, which this server serves); the vision tower's
# fields are the published 27B's (depth 27, hidden 1152, 16 heads, out_hidden_size 5120) and are not
# loaded here. mrope_section [11, 11, 10] and the 4-wide conv are the Qwen3.5 family's; the text config's
# max_position_embeddings is the family's 262,144. Cross-check: a write-up of Qwen3.6-27B (the same
# architecture and model_type, eadst.com/blog/325) reads from its config.json 64 layers, 48 linear and 16
# full attention, 262,144 positions, rope_theta 10,000,000, and from its safetensors index 55.56 GB of
# bf16 weights with the vision tower and the MTP head (the planner counts 53.8 GB: the language model).
QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "dtype": "bfloat16",
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "layer_types": _QWEN3_NEXT_LAYER_TYPES * 16,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "num_attention_heads": 24,
        "num_hidden_layers": 64,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "num_heads": 16,
        "intermediate_size": 4304,
        "out_hidden_size": 5120,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "num_position_embeddings": 2304,
    },
}

# nvidia/NVIDIA-Nemotron-Nano-9B-v2: the architecture fields as a public test suite of a memory
# estimator records them from the published config.json (found with the search tool: 56 layers, hidden
# 4480, intermediate 15680, 40 heads, 8 KV heads, head_dim 128, vocabulary 131,072, the
# hybrid_override_pattern below, ssm_state_size 128, conv_kernel 4, 8 groups, 128 Mamba heads of 80);
# the same numbers as the Nemotron Nano 2 report's (27 Mamba, 4 attention, 25 MLP layers). Not in that
# source, so the Nemotron-H family's published defaults: chunk_size 128, mamba_hidden_act silu,
# mlp_hidden_act relu2, use_conv_bias true, no other biases, layer_norm_epsilon 1e-5, 131,072 positions.
NEMOTRON_NANO_9B_V2 = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "attention_bias": False,
    "chunk_size": 128,
    "conv_kernel": 4,
    "dtype": "bfloat16",
    "head_dim": 128,
    "hidden_size": 4480,
    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "intermediate_size": 15680,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 80,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "mamba_proj_bias": False,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "n_groups": 8,
    "num_attention_heads": 40,
    "num_hidden_layers": 56,
    "num_key_value_heads": 8,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "use_bias": False,
    "use_conv_bias": True,
    "vocab_size": 131072,
}

# nvidia/Nemotron-H-8B-Base-8K: the published config.json as a public test suite of a model bridge records
# it in full (found with the search tool; the same pattern, sizes and vocabulary as two other public
# records of it): 52 layers = 24 Mamba2 ("M"), 4 attention ("*"), 24 MLP ("-") with squared ReLU; hidden
# 4096, MLP 21504, 32 query / 8 KV heads of 128, 128 Mamba heads of 64, state 128, 8 groups. Read by
# benchmark/gpu/real_shapes.py (the real-shape slices), which keeps every per-layer shape and cuts layers.
NEMOTRON_H_8B_BASE_8K = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_head_dim": 128,
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "eos_token_id": 2,
    "expand": 2,
    "hidden_act": "relu2",
    "hidden_dropout": 0.0,
    "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "initializer_range": 0.02,
    "intermediate_size": 21504,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "mamba_proj_bias": False,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "n_groups": 8,
    "num_attention_heads": 32,
    "num_hidden_layers": 52,
    "num_key_value_heads": 8,
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rms_norm_eps": 1e-05,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}

# Qwen/Qwen3.5-35B-A3B: its config.json was not among the stored sources. The text model's fields come
# from THUDM/slime scripts/models/qwen3.5-35B-A3B.sh (found with the search tool: 40 layers, hidden 2048,
# 16 query heads, 2 KV groups, kv-channels 256, rotary 0.25, rope base 10,000,000, vocabulary 248,320,
# untied embeddings, gated attention output, 256 experts top-8 of width 512, a 512-wide gated shared
# expert, linear attention every 4th layer full, 16 key / 32 value linear heads of 128, conv 4); the
# layout (multimodal, the language model under text_config) and the family's fields (mRoPE [11, 11, 10]
# interleaved, 262,144 positions, norm eps 1e-6) as for QWEN3_5_27B above. The vision tower is not
# loaded here and not recorded.
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "dtype": "bfloat16",
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "layer_types": _QWEN3_NEXT_LAYER_TYPES * 10,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    },
}
