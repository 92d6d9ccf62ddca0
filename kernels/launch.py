"""How the launchers start a kernel: directly, or, while torch.compile traces an op into them, as a graph node.

Every launcher in this package starts its kernels with ``launch(kernel, grid)(*args)``. Called eagerly that is
``kernel[grid](*args)``. Inside ``traced()`` (lrmoe.ops enters it when AOTAutograd decomposes a CUDA call of an op
into its launcher, see lrmoe.ops._kernels.inline_when_compiled) it goes through ``torch.library.wrap_triton``, so
the compiled graph holds the kernel itself and Inductor launches it with its own launcher: no custom-op dispatch
and no Python launcher at run time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["launch", "traced"]

_state = threading.local()


@contextlib.contextmanager
def traced() -> Iterator[None]:
    """Launches inside this block are recorded through wrap_triton instead of run."""
    before = getattr(_state, "traced", False)
    _state.traced = True
    try:
        yield
    finally:
        _state.traced = before


def launch(kernel: Any, grid: Any) -> Callable[..., Any]:
    """``kernel[grid]``, or its traceable form inside ``traced()``."""
    if getattr(_state, "traced", False):
        return torch.library.wrap_triton(kernel)[grid]
    return kernel[grid]
