"""The Mamba2 fields Granite-4.0-H and Falcon-H1 configs share with transformers' Bamba: `mamba_n_heads`,
`mamba_d_head` ("auto": the intermediate size over the heads), `mamba_n_groups`, `mamba_d_state`,
`mamba_d_conv`, `mamba_chunk_size` and `time_step_limit` (a lower bound on the time step; an upper one is
refused: the Mamba2 kernels here clamp from below only)."""

from __future__ import annotations

import math
from typing import Any

from sglang.srt.configs.hybrid_arch import HybridArchConfig
from sglang.srt.configs.mamba_utils import Mamba2StateShape
from sglang.srt.layers.attention.mamba.mamba2_shards import Mamba2Shards


def mamba2_rank_state_shape(
    num_heads: int, head_dim: int, n_groups: int, state_size: int, conv_kernel: int
) -> Mamba2StateShape:
    """The recurrent state of a Mamba2 layer this TP rank's pool holds (`Mamba2Shards`): its heads' SSM
    states; conv rows [its x | its groups' B | its groups' C] (one group per rank where the groups are
    replicated, not all of them)."""
    shards = Mamba2Shards.for_this_rank(num_heads, head_dim, n_groups, state_size)
    return Mamba2StateShape.create(
        intermediate_size=shards.local_intermediate,
        n_groups=shards.local_groups,
        num_heads=shards.local_heads,
        head_dim=head_dim,
        state_size=state_size,
        conv_kernel=conv_kernel,
        tp_world_size=1,  # the sizes above are this rank's already
    )


def mamba2_state_units(
    num_heads: int, head_dim: int, n_groups: int, state_size: int, tp_size: int, tp_rank: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """A Mamba2 layer's conv channels (of TP 1's [x | B | C]) and SSM heads that TP rank `tp_rank` of
    `tp_size` holds (`HybridArchConfig.state_units`), by `Mamba2Shards`, the layer's own rule."""
    shards = Mamba2Shards(num_heads, head_dim, n_groups, state_size, tp_size, tp_rank)
    shards.check()
    return shards.conv_spans(), shards.head_spans()


class BambaFieldsArchConfig(HybridArchConfig):
    def __init__(self, hf_config: Any):
        super().__init__(hf_config)
        upper = self.time_step_limit[1]
        if upper != math.inf:
            raise ValueError(f"A Mamba2 time_step_limit with an upper bound ({upper}) is not supported.")

    @property
    def time_step_limit(self) -> tuple[float, float]:
        limit = getattr(self.hf_config, "time_step_limit", None) or (0.0, math.inf)
        return float(limit[0]), float(limit[1])

    @property
    def mamba_intermediate_size(self) -> int:
        cfg = self.hf_config
        return int(cfg.mamba_expand * cfg.hidden_size)

    @property
    def mamba_head_dim(self) -> int:
        d = self.hf_config.mamba_d_head
        return self.mamba_intermediate_size // self.hf_config.mamba_n_heads if d in (None, "auto") else int(d)

    @property
    def kernel_state_chunk(self) -> int:
        return int(self.hf_config.mamba_chunk_size)

    @property
    def state_shape(self) -> Mamba2StateShape:
        """This TP rank's (`mamba2_rank_state_shape`)."""
        cfg = self.hf_config
        return mamba2_rank_state_shape(
            cfg.mamba_n_heads, self.mamba_head_dim, cfg.mamba_n_groups, cfg.mamba_d_state, cfg.mamba_d_conv
        )

    def state_units(self, tp_size: int, tp_rank: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        cfg = self.hf_config
        return mamba2_state_units(
            cfg.mamba_n_heads, self.mamba_head_dim, cfg.mamba_n_groups, cfg.mamba_d_state, tp_size, tp_rank
        )

    def mamba_mixer_args(self) -> dict[str, Any]:
        """The `Mamba2Mixer` keyword arguments these fields give (a model adds its norm and biases)."""
        cfg = self.hf_config
        return dict(
            num_heads=cfg.mamba_n_heads,
            head_dim=self.mamba_head_dim,
            n_groups=cfg.mamba_n_groups,
            state_size=cfg.mamba_d_state,
            conv_kernel=cfg.mamba_d_conv,
            conv_bias=cfg.mamba_conv_bias,
            proj_bias=cfg.mamba_proj_bias,
            eps=cfg.rms_norm_eps,
            time_step_min=self.time_step_limit[0],
        )
