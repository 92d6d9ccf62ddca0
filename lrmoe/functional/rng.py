"""Counter-based uniforms: the sampling draws of a layer as a pure function of (seed, step, stream, index).

Shapes: N draws.

A layer that draws its sampling uniforms from the global RNG cannot resume exactly from a checkpoint unless every
rank also saves and restores that RNG's state. Drawing them instead from a hash of a seed and a step counter, two
integer tensors that live in the layer's state (so checkpoints carry them), makes a resumed run draw what the
continued run would have drawn, on every rank and under torch.compile (plain integer tensor arithmetic: no
generator object, no host synchronisation, the values never specialise a compiled graph).

The hash is Chris Wellons' "lowbias32" integer finaliser applied in a chain over 32-bit words. Every product is
formed in int64 from a 32-bit value and a 16-bit half of the constant, so no intermediate overflows int64 (signed
overflow is undefined in C++, where the CPU kernels run), and the result is the same on every device.
"""

from __future__ import annotations

import torch

__all__ = ["counter_uniform"]

_MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B


def _mul32(x: torch.Tensor, const: int) -> torch.Tensor:
    """(x * const) mod 2**32 for x in [0, 2**32), without an int64 overflow: the constant in two 16-bit halves."""
    lo = x * (const & 0xFFFF)
    hi = ((x * (const >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values (logical shifts: the values are non-negative)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, step: torch.Tensor, n: int, *, stream: int = 0) -> torch.Tensor:
    """[n] fp32 uniforms in [0, 1), a pure function of (seed, step, stream, index).

    Args:
        seed: 0-d int64 tensor (any value; both 32-bit halves are used).
        step: 0-d int64 tensor, a counter the caller advances once per draw (its low 32 bits are used: a stream
            repeats after 2**32 steps).
        n: number of draws (a Python int: the output's static size).
        stream: a Python int separating independent draws of one step (e.g. an expert-parallel rank).

    The draws have 24 random bits (every fp32 in [0, 1) with that spacing), on the device of ``seed``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative Python int, got {n!r}")
    if not isinstance(stream, int) or isinstance(stream, bool) or stream < 0:
        raise ValueError(f"stream must be a non-negative Python int, got {stream!r}")
    for name, t in (("seed", seed), ("step", step)):
        if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.dtype != torch.int64:
            raise TypeError(f"{name} must be a 0-d int64 tensor, got "
                            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                            f"{' ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}")
    seed_lo = seed & _MASK32
    seed_hi = (seed >> 32) & _MASK32
    key = _hash32(seed_lo ^ _hash32(seed_hi ^ _hash32((step & _MASK32) ^ _hash32(seed.new_tensor(stream & _MASK32)))))
    index_N = torch.arange(n, device=seed.device, dtype=torch.int64)
    h_N = _hash32(_hash32(index_N ^ key) ^ _hash32(key ^ 0x9E3779B9))
    return (h_N >> 8).float() * (1.0 / (1 << 24))
