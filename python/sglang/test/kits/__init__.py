"""Reusable test kits (mixins for `sglang.test.test_utils.ServerTestCase`), as upstream has them."""

from sglang.test.kits.kl_divergence_kit import KLDivergenceMixin, KLStats
from sglang.test.kits.prefix_cache_branching_kit import PrefixCacheBranchingMixin
from sglang.test.kits.reference_match_kit import ReferenceMatchMixin

__all__ = ["KLDivergenceMixin", "KLStats", "PrefixCacheBranchingMixin", "ReferenceMatchMixin"]
