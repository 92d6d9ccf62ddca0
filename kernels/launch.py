"""How the launchers start a kernel: directly, or, while torch.compile traces an op into them, as a graph node.

Every launcher in this package starts its kernels with ``launch(kernel, grid)(*args)``. Called eagerly that is
``kernel[grid](*args)``. Inside ``traced()`` (lrmoe.ops enters it when AOTAutograd decomposes a CUDA call of an op
into its launcher, see lrmoe.ops._kernels.inline_when_compiled) it goes through ``torch.library.wrap_triton``, so
the compiled graph holds the kernel itself and Inductor launches it with its own launcher: no custom-op dispatch
and no Python launcher at run time.

``interpreting()`` is the one place that says whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1:
CPU tensors, Python speed; how the tests run without a GPU). Launchers ask it to pick small blocks and to accept
CPU tensors. It is read once, at import, as triton.jit reads it when the kernels are defined: the interpreter is on
for the whole process or off. Set TRITON_INTERPRET before importing this package (tests/conftest.py does, on a
machine without a GPU).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["as_interpreted", "interpreting", "known_empty", "launch", "traced", "tracing"]

_state = threading.local()
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Whether the launchers run their kernels in Triton's interpreter (see the module docstring)."""
    return getattr(_state, "interpret", _INTERPRET)


@contextlib.contextmanager
def as_interpreted(on: bool) -> Iterator[None]:
    """Launchers inside this block choose blocks, flags and device checks as if the interpreter were ``on``; the
    kernels themselves stay as defined. For tests/kernels/sm90_compile.py, which records launches on CPU tensors
    (``on=True`` passes the device checks) and compiles the GPU's choices (``on=False``)."""
    before = getattr(_state, "interpret", None)
    _state.interpret = on
    try:
        yield
    finally:
        if before is None:
            del _state.interpret
        else:
            _state.interpret = before


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
