"""Multi-process harness for the expert-parallel tests: gloo CPU process groups of W ranks (NCCL, one GPU per rank,
where a test asks for it).

Importable by name from the tests in this folder (pytest puts the folder on sys.path, and spawned children
inherit the parent's sys.path, so they find both this module and the test module whose function they run).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode


def _worker(rank, world_size, store, fn, args, backend="gloo", timeout_s=120):
    torch.set_num_threads(1)
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=device_id)
    fn(rank, world_size, *args)  # an exception here reaches mp.spawn, which reports it and stops the others
    # Success: leave together, then skip interpreter teardown. A rank that exits while a peer still tears down its
    # gloo connections (or Python finalisation destroying gloo's threads in an arbitrary order) occasionally
    # aborts with "terminate called without an active exception" after every check has passed.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size, fn, *args, backend="gloo", timeout_s=120):
    """Run fn(rank, world_size, *args) in world_size spawned processes joined in one process group: gloo, or
    ``backend="nccl"`` with rank r on GPU r. ``timeout_s``: the process group's timeout, after which a rank left
    waiting in a collective raises (a test of a step that once hung passes a short one, to fail fast)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "store"), fn, args, backend, timeout_s),
                 nprocs=world_size, join=True)


class RecordCalls(TorchDispatchMode):
    """``record(args)`` of every call of the op ``op`` run under it, in order, in ``calls``."""

    op = None

    def __init__(self):
        super().__init__()
        self.calls = []

    def record(self, args):
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.calls.append(self.record(args))
        return func(*args, **(kwargs or {}))


class RecordBmm(RecordCalls):
    """The first operand's shape of every aten.bmm."""

    op = torch.ops.aten.bmm.default

    def record(self, args):
        return tuple(args[0].shape)


class RecordAllToAll(RecordCalls):
    """(send splits, receive splits, bytes per row) of every all-to-all (the functional collective op), in order."""

    op = torch.ops._c10d_functional.all_to_all_single.default

    def record(self, args):
        payload, recv, send = args[0], args[1], args[2]
        return list(send), list(recv), math.prod(payload.shape[1:]) * payload.element_size()

    def messages(self):
        """The calls as messages: a call of 4 bytes per row right after a call with the same split sizes carries
        that call's per-row scalars (||phi||^2 or a row index, sent beside the rows), so the two are one message of
        rows + 4 bytes."""
        merged = []
        for send, recv, row_bytes in self.calls:
            if merged and row_bytes == 4 and merged[-1][:2] == (send, recv) and not merged[-1][3]:
                merged[-1] = (send, recv, merged[-1][2] + 4, True)
            else:
                merged.append((send, recv, row_bytes, False))
        return [(send, recv, row_bytes) for send, recv, row_bytes, _ in merged]
