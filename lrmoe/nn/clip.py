"""Gradient clipping over parameters on several device meshes.

FSDP2 beside expert parallelism puts the experts on a (dp, ep) mesh and the rest of the model on the flattened
dp * ep mesh; torch.nn.utils.clip_grad_norm_ then refuses ("All operands in aten.stack.default must have the same
mesh"), and clipping each mesh's parameters by its own norm is another operation. Here every mesh's norm is taken
over the whole (sharded) gradient, the norms combine into the global one, and every gradient is scaled by it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

__all__ = ["clip_grad_norm_"]


def _group_norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    """The norm of one mesh's gradients (a plain tensor on every rank), or of plain tensors."""
    sharded = isinstance(grads[0], DTensor)
    if norm_type == math.inf:
        # get_total_norm takes the inf norm of each tensor (each local shard), which fails on an empty one (a rank
        # holding no rows of a small parameter); a max over the non-empty ones (0 if none), reduced with max over
        # the mesh, instead.
        local_grads = [g.to_local() if sharded else g for g in grads]
        local = torch.stack([g.abs().amax() for g in local_grads if g.numel()]
                            or [local_grads[0].new_zeros(())]).amax()
        if not sharded:
            return local
        mesh = grads[0].device_mesh
        return DTensor.from_local(local, mesh, [Partial("max")] * mesh.ndim).full_tensor()
    norm = get_total_norm(grads, norm_type, foreach=foreach)
    return norm.full_tensor() if sharded else norm


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for parameters whose gradients are DTensors on different device meshes (and
    plain tensors): the total norm of all gradients, each DTensor's counted whole (its shards on every rank),
    and every gradient scaled by max_norm / (total + 1e-6) where that is below 1. Returns the total norm, the same
    on every rank of a mesh. Plain-tensor gradients count as this rank's own (as torch's function counts them).

    Collectives: one all-reduce per mesh, and the reduction of any Partial gradient first (``p.grad`` becomes the
    reduced DTensor, Replicate where it was Partial). norm_type: p > 0 or
    inf (ValueError otherwise). On plain tensors it is torch's function, except that the inf norm passes over empty
    gradients (torch's raises on them).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not (norm_type > 0):  # -inf (a min) and 0 (a count) do not combine over meshes as norms do
        raise ValueError(f"norm_type must be a p-norm order p > 0 or inf, got {norm_type}")
    if not params:
        return torch.tensor(0.0)
    for p in params:
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            # Unreduced (Partial) gradients, as tensor parallelism can leave them: reduced here, in place of the
            # gradient, as the norms below read each rank's values as the gradient's, and an in-place scale of a
            # Partial DTensor is not the same in every torch (2.11 scaled it wrong).
            reduced = [Replicate() if pl.is_partial() else pl for pl in p.grad.placements]
            p.grad = p.grad.redistribute(placements=reduced)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [_group_norm([p.grad for p in group], norm_type, foreach) for group in groups.values()]
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):  # host sync, only when asked for (as torch's)
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be clipped; "
            "pass error_if_nonfinite=False to scale by it anyway"
        )
    for group in groups.values():
        clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total
