"""lrmoe: demand-side load re-calibration for Mixture-of-Experts training.

Exact forward for every routed token-expert pair; a backward that keeps, per expert, only the pairs with the
largest contribution to the expert's weight update, within planned quotas. See docs/overview.md.
"""

from lrmoe import functional, memory, nn, ops
from lrmoe.functional._checks import checks

__version__ = "0.1.0"
__all__ = ["__version__", "checks", "functional", "memory", "nn", "ops"]
