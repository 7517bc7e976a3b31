"""Model config adapters. Importing the package registers every supported architecture."""

from sglang.srt.configs import bamba, falcon_h1, granitemoehybrid, lfm2, nemotron_h, qwen3_5, qwen3_next  # noqa: F401
from sglang.srt.configs.hybrid_arch import HybridArchConfig, hybrid_arch_config  # noqa: F401
