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

__all__ = ["known_empty", "launch", "traced", "tracing"]

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


def tracing() -> bool:
    """Whether launches are being recorded for torch.compile (inside ``traced()``) rather than run."""
    return getattr(_state, "traced", False)


def known_empty(*sizes: Any) -> bool:
    """Whether one of ``sizes`` is certainly 0, for a launcher's early return. Traced under torch.compile, a row
    count received from other ranks (expert parallelism) is an unbacked SymInt, whose value no test may depend on
    (the compile fails on a data-dependent guard): it counts as not known to be empty, the launch goes ahead, and at
    run time a size of 0 gives an empty grid, which launches nothing."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return any(guard_or_false(n == 0) for n in sizes)


def launch(kernel: Any, grid: Any) -> Callable[..., Any]:
    """``kernel[grid]``, or its traceable form inside ``traced()``."""
    if tracing():
        return torch.library.wrap_triton(kernel)[grid]
    return kernel[grid]
