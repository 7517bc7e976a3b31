"""The decode server's request pool under prefill/decode disaggregation.

`HybridMambaDecodeReqToTokenPool` (upstream PR #22462): the decode server pre-allocates destinations
(request row and running slot) for transfers in flight beyond the running cap, `pre_alloc_size` extra
rows. Its mamba pool holds what all those rows can: `(size + pre_alloc_size) * max_slots_per_req`, raised
above a smaller `--max-mamba-cache-size` with a warning that names both numbers (a lazy request's
borrowed snapshot slot included).
"""

from __future__ import annotations

import logging

from sglang.srt.configs.mamba_utils import Mamba2CacheParams
from sglang.srt.mem_cache.mamba_strategy import MambaStrategy
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

logger = logging.getLogger(__name__)


def default_decode_extra_slots(max_running_requests: int) -> int:
    """Upstream's default for --disaggregation-decode-extra-slots: request rows for transfers in flight
    beyond the running cap, twice the cap when it is small."""
    return 2 * max_running_requests if max_running_requests <= 32 else 0


class HybridMambaDecodeReqToTokenPool(HybridReqToTokenPool):
    def __init__(
        self,
        size: int,
        pre_alloc_size: int,
        max_mamba_cache_size: int | None,
        max_context_len: int,
        cache_params: Mamba2CacheParams,
        strategy: MambaStrategy,
        device: str = "cpu",
        verify_shape: tuple[int, int] = (0, 0),
    ):
        self.pre_alloc_size = pre_alloc_size
        self.slots_per_req = strategy.max_slots_per_req
        self.max_slots_needed = (size + pre_alloc_size) * self.slots_per_req
        if max_mamba_cache_size is None:
            mamba_size = self.max_slots_needed
        else:
            mamba_size = max(max_mamba_cache_size, self.max_slots_needed)
            if mamba_size > max_mamba_cache_size:
                logger.warning(
                    "The decode server raises --max-mamba-cache-size from %d to %d: %d request rows "
                    "(%d running + %d pre-allocated) need %d slot(s) each.",
                    max_mamba_cache_size, mamba_size, size + pre_alloc_size, size, pre_alloc_size,
                    self.slots_per_req,
                )  # fmt: skip
        self.mamba_spec_state_size = size + pre_alloc_size
        super().__init__(
            size + pre_alloc_size, mamba_size, max_context_len, cache_params, strategy, device, verify_shape
        )
