"""LFM2 (`Lfm2ForCausalLM`) and LFM2-MoE (`Lfm2MoeForCausalLM`): short-conv layers (a gated depthwise
conv whose state is its last K-1 inputs: `conv_L_cache - 1` columns) and full attention at the config's
`layer_types` ("conv" / "full_attention"), each followed by a SwiGLU MLP (LFM2-MoE: after its first
`num_dense_layers`, a MoE)."""

from __future__ import annotations

from sglang.srt.configs.hybrid_arch import HybridArchConfig, register_hybrid_arch
from sglang.srt.configs.mamba_utils import Mamba2StateShape
from sglang.srt.distributed import get_tensor_model_parallel_world_size

# Every position has a conv state, so any chunk serves; GDN's keeps the cache lattice of the tests.
SHORT_CONV_STATE_CHUNK = 64


@register_hybrid_arch
class Lfm2ArchConfig(HybridArchConfig):
    architectures = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")
    model_types = ("lfm2", "lfm2_moe")
    linear_kind = "short_conv"

    @property
    def layer_types(self) -> list[str]:
        cfg = self.hf_config
        types = getattr(cfg, "layer_types", None)
        if not types:  # as transformers: every layer attention unless `full_attn_idxs` says which
            n = cfg.num_hidden_layers
            attention = set(range(n) if cfg.full_attn_idxs is None else cfg.full_attn_idxs)
            types = ["full_attention" if i in attention else "conv" for i in range(n)]
        return ["linear_attention" if t == "conv" else "full_attention" for t in types]

    @property
    def kernel_state_chunk(self) -> int:
        return SHORT_CONV_STATE_CHUNK

    @property
    def state_shape(self) -> Mamba2StateShape:
        """The conv window (hidden_size channels); the SSM part is a row nothing reads, so that every pool
        operation (copies, snapshots, transfers) stays the Mamba2 one. 8 elements, not 1: the state
        copier moves rows in the widest word that divides every row (8 float32 or bfloat16 elements are
        a multiple of 16 bytes; a 1-element row would cut the conv rows' copies to 4- or 2-byte words).
        Under tensor parallelism a rank holds its block of the channels (`Lfm2ShortConv`)."""
        cfg = self.hf_config
        tp = get_tensor_model_parallel_world_size()
        if cfg.hidden_size % tp:
            raise ValueError(f"--tp-size {tp} does not divide LFM2's {cfg.hidden_size} short-conv channels.")
        return Mamba2StateShape.create(
            intermediate_size=cfg.hidden_size // tp,
            n_groups=0,
            num_heads=1,
            head_dim=1,
            state_size=8,
            conv_kernel=cfg.conv_L_cache,
            tp_world_size=1,  # the sizes above are this rank's already
        )

    def state_units(self, tp_size: int, tp_rank: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Rank r's block of the channels; the SSM row (nothing reads it) is one unit every rank holds."""
        h = self.hf_config.hidden_size
        if h % tp_size:
            raise ValueError(f"--tp-size {tp_size} does not divide LFM2's {h} short-conv channels.")
        return [(tp_rank * h // tp_size, h // tp_size)], [(0, 1)]
