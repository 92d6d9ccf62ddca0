"""Modules (and, later, parallel styles): the only place with module state, collectives and DTensor."""

from lrmoe.nn.lrmoe import LRMoE, LRMoEStats, SwiGLUExperts

__all__ = ["LRMoE", "LRMoEStats", "SwiGLUExperts"]
