"""``no_host_sync()``: the GPU tests' check that a step never waits on the device, in a module of its own so tests
in any folder can import it by a name no other folder's conftest.py shadows."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside the block, any host synchronisation raises (``torch.cuda.set_sync_debug_mode("error")``); the mode is
    restored however the block ends. Synchronises first, so that work queued before the block cannot make a call
    inside it wait. Call the code once before the block: lazy initialisation, kernel compilation and autotuning may
    synchronise."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
