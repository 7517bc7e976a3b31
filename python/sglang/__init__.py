"""SGLang-compatible serving runtime for hybrid (recurrent + full-attention) models."""

from sglang.version import __version__

__all__ = ["__version__"]
