"""Write a tiny, random-weight, real-format Hugging Face checkpoint of a hybrid architecture.

    python -m sglang.tools.make_tiny_model --arch qwen3_next --out DIR [--seed 0] [--quantize fp8-block]
    python -m sglang.tools.make_tiny_model --arch nemotron_h --out DIR --quantize fp8-modelopt

The model is built with transformers' own classes from a fixed seed, so the same seed gives
bit-identical files. It is small (a 128-token forward takes milliseconds on a CPU) but complete:
several linear-attention layers and a full-attention layer, several heads, MoE where the architecture
has one, conv kernel 4, and weights large enough that the logits are far from uniform. The tokenizer is
a byte-level BPE trained on `data/tiny_corpus.txt`, with a ChatML chat template.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

CORPUS = Path(__file__).with_name("data") / "tiny_corpus.txt"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_ID, IM_START_ID, IM_END_ID = 0, 1, 2
VOCAB_SIZE = 512
MAX_POSITIONS = 4096
# Per architecture: (std of the body weights, gain of the output head). The body stays small so the
# residual stream is O(1) and the network amplifies float32 round-off little: the chunked kernels err
# by ~5e-7 relative, and with std 0.3 the oracle's own incremental path drifts from its full forward by
# 1e-4 in logprob. The head is scaled up instead, so logits are far from uniform (mean top probability
# ~0.15-0.2 of 512) while that drift stays below 1e-5 on thousands of scored tokens.
WEIGHT_SCALES = {
    "qwen3_next": (0.05, 5.0),
    "qwen3_5": (0.05, 5.0),
    "qwen3_5_moe": (0.05, 5.0),
    "nemotron_h": (0.1, 3.0),
    # The head gain is doubled against logits_scaling 2 (the logits are divided by it).
    "granitemoehybrid": (0.1, 6.0),
    # Halved against lm_head_multiplier 2.
    "falcon_h1": (0.1, 1.5),
    "bamba": (0.1, 3.0),
    "lfm2": (0.1, 3.0),
    "lfm2_moe": (0.1, 3.0),
}
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "granitemoehybrid", "falcon_h1", "bamba", "lfm2")
ARCHS += ("lfm2_moe",)


def tiny_config(arch: str):
    if arch not in ARCHS:
        raise ValueError(f"--arch must be one of {ARCHS}, got {arch!r}.")
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=WEIGHT_SCALES[arch][0],
        pad_token_id=PAD_ID,
        bos_token_id=None,
        eos_token_id=IM_END_ID,
        tie_word_embeddings=False,
    )
    gdn = dict(
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    moe = dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    )
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(**common, **gdn, **moe, intermediate_size=128)
    # Qwen3.5's published rotary: interleaved mRoPE over 3 axes (text puts one position on all three).
    rope = dict(rope_theta=10000.0, partial_rotary_factor=0.25, rope_type="default")
    rope.update(mrope_interleaved=True, mrope_section=[1, 1, 0])
    if arch == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**common, **gdn, intermediate_size=128, rope_parameters=rope)
    if arch == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(**common, **gdn, **moe, rope_parameters=rope)
    # Bamba's Mamba2 fields (Granite-4.0-H's and Bamba's configs): Nemotron-H's sizes and chunk.
    bamba_mamba = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4)
    bamba_mamba.update(mamba_expand=2, mamba_chunk_size=32)
    if arch == "granitemoehybrid":
        from transformers import GraniteMoeHybridConfig

        # Granite-4.0-H's scales, none of them 1, and an attention scale other than 1/sqrt(head_dim), so a
        # runtime that drops one differs from the oracle.
        scales = dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.125)
        return GraniteMoeHybridConfig(
            **common,
            **scales,
            logits_scaling=2.0,
            num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "mamba"],
            position_embedding_type="rope",
            intermediate_size=32,
            shared_intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            **bamba_mamba,
        )
    lfm2 = dict(num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3)
    if arch == "lfm2":
        from transformers import Lfm2Config

        # A bias in the short conv (LFM2 releases have none) so that a runtime that drops it differs.
        return Lfm2Config(
            **common,
            **lfm2,
            intermediate_size=192,  # auto-adjusted to 2/3 and a multiple of 32: 128
            block_multiple_of=32,
            conv_bias=True,
        )
    if arch == "lfm2_moe":
        from transformers import Lfm2MoeConfig

        return Lfm2MoeConfig(
            **common,
            **lfm2,
            num_dense_layers=1,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            routed_scaling_factor=1.5,
        )
    if arch == "bamba":
        from transformers import BambaConfig

        return BambaConfig(
            **common,
            num_hidden_layers=4,
            attn_layer_indices=[1, 3],
            intermediate_size=128,
            **bamba_mamba,
        )
    if arch == "falcon_h1":
        from transformers import FalconH1Config

        # Falcon-H1's muP multipliers, none of them 1 (a runtime that drops one differs from the oracle);
        # its Mamba2 output norm gated after (the published configs' mamba_norm_before_gate).
        mup = dict(embedding_multiplier=2.0, lm_head_multiplier=2.0, key_multiplier=0.5)
        mup.update(attention_in_multiplier=1.5, attention_out_multiplier=0.7, mlp_multipliers=[0.8, 1.3])
        mup.update(ssm_in_multiplier=1.2, ssm_out_multiplier=0.9, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05])
        return FalconH1Config(
            **common,
            **mup,
            num_hidden_layers=3,
            intermediate_size=96,
            mamba_d_ssm=128,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=32,
            mamba_rms_norm=True,
            mamba_norm_before_gate=True,
        )
    from transformers import NemotronHConfig

    return NemotronHConfig(
        **common,
        layers_block_type=[
            "linear_attention",
            "moe",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "mlp",
        ],
        intermediate_size=128,
        ssm_state_size=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        conv_kernel=4,
        expand=2,
        # Differs from GDN's 64 so that the cache chunk of the two presets differs.
        chunk_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
    )


def build_tokenizer(texts: list[str] | None = None, vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE trained on `texts` (default: the tiny corpus), ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is None:
        texts = [CORPUS.read_text(encoding="utf-8")]
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, IM_START_ID, IM_END_ID]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


def _log_uniform(n: int, low: float, high: float, gen: torch.Generator) -> torch.Tensor:
    """log(x) for x log-uniform in [low, high]."""
    return torch.rand(n, generator=gen) * (math.log(high) - math.log(low)) + math.log(low)


@torch.no_grad()
def _condition_weights(model: torch.nn.Module, arch: str, gen: torch.Generator) -> None:
    """Make the random model exercise every parameter and keep its recurrences well conditioned.

    Norm weights, biases and per-head vectors start at constants (0 or 1); they get small random offsets
    so that a runtime that ignores one of them differs from the oracle.

    The per-token log-decay of a linear layer is kept small: the default initialisation gives log-decays
    near -30, whose sums over a 64-token chunk (~-2000) leave float32 only ~1e-4 relative precision in
    exp(c_i - c_j), and exact comparisons drown in it.
    For Mamba2 this also keeps the time step above `time_step_min`: transformers clamps it there in its
    chunked scan but not in its single-token step, so a binding clamp would make the oracle's own
    incremental path disagree with its full forward.
    """
    model.lm_head.weight.mul_(WEIGHT_SCALES[arch][1])
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):  # a persistent buffer at zero: a runtime ignoring it would pass
            buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
    for name, p in model.named_parameters():
        if p.ndim == 1 and not name.endswith(("A_log", "dt_bias")):
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    for module in model.modules():
        kind = type(module).__name__
        if kind in ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"):
            # log-decay g = -exp(A_log) * softplus(a + dt_bias); a and b come from in_proj_ba (Qwen3.5:
            # in_proj_a and in_proj_b).
            for proj in ("in_proj_ba", "in_proj_a", "in_proj_b"):
                if hasattr(module, proj):
                    getattr(module, proj).weight.mul_(0.1)
            module.A_log.copy_(_log_uniform(module.num_v_heads, 0.005, 0.1, gen))
            module.dt_bias.copy_(1.0 + 0.1 * torch.randn(module.num_v_heads, generator=gen))
        elif kind in ("NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "FalconH1Mixer", "BambaMixer"):
            # log-decay dt * A with dt = softplus(dt_raw + dt_bias) and A = -exp(A_log).
            heads = module.num_heads
            module.in_proj.weight[-heads:].mul_(0.1)
            module.dt_bias.copy_(_inverse_softplus(_log_uniform(heads, 0.01, 0.1, gen).exp()))
            module.A_log.copy_(_log_uniform(heads, 0.5, 4.0, gen))


# Architectures whose checkpoints publish an MTP layer, with the config field that counts them.
MTP_ARCHS = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers"}
MTP_ARCHS["qwen3_5_moe"] = "mtp_num_hidden_layers"


@torch.no_grad()
def mtp_tensors(config, gen: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors in the published layout for `config` (names: `qwen3_next_mtp.py`): matrices
    N(0, std), norm weights (1 + w form) small offsets from 0, so a runtime that drops one differs."""
    from sglang.srt.models.qwen3_next_mtp import Qwen3NextMTP

    with torch.device("meta"):
        module = Qwen3NextMTP(config)
    renames = ((".experts.w13", ".experts.gate_up_proj"), (".experts.w2", ".experts.down_proj"))
    out = {}
    for name, param in module.named_parameters():
        scale = 0.1 if param.ndim == 1 else std
        for ours, theirs in renames:
            name = name.replace(ours, theirs)
        out["mtp." + name] = scale * torch.randn(param.shape, generator=gen)
    return out


def add_random_mtp(folder: Path, config, seed: int, std: float) -> None:
    """Write random MTP tensors into `folder`'s model.safetensors beside the base model's (unchanged)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors.update(mtp_tensors(config, torch.Generator().manual_seed(seed), std))
    save_file(tensors, path, metadata={"format": "pt"})


def save_model(model: torch.nn.Module, out: Path) -> None:
    """`model.save_pretrained(out)` in this process whatever torch.distributed says. transformers writes
    only from rank 0 of an initialized process group (`should_save_on_this_rank`), but a preset or a test's
    checkpoint is this process's own file: rank 1 of a TP test that generated a preset found no config.json
    in its own folder."""
    model.should_save_on_this_rank = lambda is_main_process: True
    try:
        model.save_pretrained(out)
    finally:
        del model.should_save_on_this_rank


def make_tiny_model(
    arch: str, out: str | Path, seed: int = 0, overrides: dict | None = None, quantize: str | None = None
) -> Path:
    """`overrides`: config fields set on the preset's config (a test's variant: another MoE, say).
    `quantize` "fp8-block": written in the published block-FP8 format (`quantize_fp8.py`); "fp8-modelopt":
    in NVIDIA ModelOpt's FP8 format, as the Nemotron FP8 releases (`quantize_modelopt.py`)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _condition_weights(model, arch, torch.Generator().manual_seed(seed + 1))
    save_model(model, out)

    config_path = out / "config.json"
    cfg = json.loads(config_path.read_text())
    if arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        # transformers writes only layer_types; SGLang-style loaders also read the interval.
        cfg["full_attention_interval"] = 4
    if arch in MTP_ARCHS:
        # The published MTP layer (`models/qwen3_next_mtp.py`), which transformers has no class for; an
        # FP8 twin carries it quantized as the model (`quantize_fp8`: `mtp.fc` kept, as Qwen's releases).
        cfg[MTP_ARCHS[arch]] = 1
        add_random_mtp(out, model.config, seed + 2, WEIGHT_SCALES[arch][0])
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    GenerationConfig(eos_token_id=[IM_END_ID, PAD_ID], pad_token_id=PAD_ID, do_sample=False).save_pretrained(
        out
    )
    build_tokenizer().save_pretrained(out)
    if quantize == "fp8-block":
        from sglang.tools.quantize_fp8 import quantize_checkpoint

        quantize_checkpoint(out)
    elif quantize == "fp8-modelopt":
        from sglang.tools.quantize_modelopt import quantize_checkpoint_modelopt

        quantize_checkpoint_modelopt(out)
    elif quantize is not None:
        raise ValueError(f"--quantize must be fp8-block or fp8-modelopt, got {quantize!r}.")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--arch", required=True, choices=ARCHS)
    parser.add_argument("--out", required=True, help="Folder to write the checkpoint into.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quantize",
        choices=["fp8-block", "fp8-modelopt"],
        help="Write it as the published block-FP8 checkpoints are, or as NVIDIA ModelOpt's FP8 ones.",
    )
    args = parser.parse_args(argv)
    path = make_tiny_model(args.arch, args.out, args.seed, quantize=args.quantize)
    print(f"Wrote a tiny {args.arch} checkpoint to {path}")


if __name__ == "__main__":
    main()
