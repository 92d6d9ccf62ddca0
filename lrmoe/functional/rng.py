"""Keyed uniforms: the sampling draws of a step as a pure function of that step's routing.

Shapes: T tokens, K top-k, N draws.

Selection "sample" needs one uniform per pair group per step. Drawn from the global RNG, a run resumed from a
checkpoint would draw other values than the continued run (unless every rank also saved and restored its RNG
state), and a torch.Generator cannot enter a torch.compile graph. Drawn instead from a hash of the step's own
routing (every pair's expert, by position), the uniforms are a function of the model and the batch: a resumed
run, an activation-checkpoint recompute and a compiled graph draw exactly what the continued, plain or eager run
draws, with no state to save, no generator and no host synchronisation. Different layers, steps and
expert-parallel ranks route differently, so their keys differ; ``stream`` separates draws that share one routing.
The key reads the integer expert ids, not the gates: a compiled router's gates may differ from the eager ones in
the last bit, and the draws must not.

The mixer is Chris Wellons' "lowbias32" integer finaliser. A routing's key is the sum of one round of it over
every pair's (position, expert) word; draw i of a key is one round over i times an odd multiplier taken from the
key, plus the key. One round per element, not a chain: under torch.compile Inductor inlines each round into
its consumer, and a value read twice per round (as every xorshift-multiply round reads it) doubles the expression
at each round (on the CPU, compiling two chained rounds took 10 s and three 40 s). Every product is
formed in int64 from factors small enough not to overflow (signed overflow is undefined in C++, where the CPU
kernels run), so every device computes the same bits.
"""

from __future__ import annotations

import torch

from lrmoe.functional._checks import check_tensor

__all__ = ["block_routing_keys", "keyed_uniform", "routing_key", "sampling_uniforms"]

_MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B
_GOLDEN = 0x9E3779B9  # odd: a multiplier that spreads consecutive expert ids over the 32-bit words


def _mul32(x: torch.Tensor | int, const: int) -> torch.Tensor | int:
    """(x * const) mod 2**32 for x in [0, 2**32), without an int64 overflow: the constant in two 16-bit halves."""
    lo = x * (const & 0xFFFF)
    hi = ((x * (const >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _hash32(x: torch.Tensor | int) -> torch.Tensor | int:
    """One lowbias32 round on int64 tensors holding values in [0, 2**32) (the shifts are then logical), or on a
    Python int in that range (stream salts, folded into the graph as constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 16)


def routing_key(expert_ids_TK: torch.Tensor) -> torch.Tensor:
    """0-d int64 in [0, 2**32): the sum mod 2**32 of one hash round per pair over the word (position xor expert *
    golden) (an integer sum: exact, whatever order a kernel adds in; any changed pair changes its term)."""
    expert_P = expert_ids_TK.reshape(-1).long() & _MASK32
    index_P = torch.arange(expert_P.shape[0], device=expert_P.device, dtype=torch.int64)  # < 2**31 pairs
    # The position enters through xor only: Inductor folds arithmetic on an arange into its index expressions,
    # which Triton evaluates in int32 (a constant of 2**31 or more there fails to compile).
    return _hash32(index_P ^ _mul32(expert_P, _GOLDEN)).sum() & _MASK32


def block_routing_keys(expert_ids_P: torch.Tensor, num_experts: int, blocks: int) -> torch.Tensor:
    """[blocks] int64: key b is ``routing_key`` of the pairs routed to block b, the experts [b * E/B, (b + 1) *
    E/B), in their order, with expert ids relative to the block (expert - b * E/B): the key that the expert-parallel
    rank holding block b's experts computes from the pairs it receives, when it receives them in that order.

    Args:
        expert_ids_P: integer expert of every pair, any shape (read flat), ordered by block: every pair of a block
            before any pair of a later one, as rows sorted by expert are. Not checked (that reads the values).
        num_experts: E, a Python int >= 1.
        blocks: B, a Python int >= 1 dividing E.
    """
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts must be a Python int >= 1, got {num_experts!r}")
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1 or num_experts % blocks:
        raise ValueError(f"blocks must be a Python int >= 1 dividing num_experts={num_experts}, got {blocks!r}")
    check_tensor("expert_ids_P", expert_ids_P, kind="int")
    expert_P = expert_ids_P.reshape(-1).long()
    per_block = num_experts // blocks
    block_P = expert_P // per_block
    # Each pair's position within its block: its index less the block's start (the pairs of earlier blocks).
    count_B = torch.zeros(blocks, dtype=torch.int64, device=expert_P.device).scatter_add_(
        0, block_P, torch.ones_like(block_P))
    start_B = count_B.cumsum(0) - count_B
    index_P = torch.arange(expert_P.shape[0], device=expert_P.device, dtype=torch.int64)  # < 2**31 pairs
    position_P = index_P - start_B[block_P]
    local_P = (expert_P - block_P * per_block) & _MASK32
    # routing_key's term of every pair, summed per block (an integer sum, exact in any order).
    term_P = _hash32(position_P ^ _mul32(local_P, _GOLDEN))
    return torch.zeros(blocks, dtype=torch.int64, device=expert_P.device).scatter_add_(0, block_P, term_P) & _MASK32


def keyed_uniform(key: torch.Tensor, n: int, *, stream: int = 0) -> torch.Tensor:
    """[n] fp32 uniforms in [0, 1) with 24 random bits, a pure function of (key, stream, index), on key's device.

    Args:
        key: 0-d int64 tensor: ``routing_key``'s, or any int64 that is itself a hash (the key is not mixed
            again: draws of neighbouring plain integers such as 0, 1, 2 correlate slightly, |r| ~ 0.02).
        n: number of draws (a Python int below 2**31: the output's static size). Draw i does not depend on n.
        stream: a Python int >= 0 separating independent draws of one key (an expert-parallel rank).
    """
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 2**31:
        raise ValueError(f"n must be a Python int in [0, 2**31), got {n!r}")
    if not isinstance(stream, int) or isinstance(stream, bool) or stream < 0:
        raise ValueError(f"stream must be a non-negative Python int, got {stream!r}")
    if not isinstance(key, torch.Tensor) or key.dim() != 0 or key.dtype != torch.int64:
        raise TypeError(f"key must be a 0-d int64 tensor, got "
                        f"{tuple(key.shape) if isinstance(key, torch.Tensor) else type(key).__name__}"
                        f"{' ' + str(key.dtype) if isinstance(key, torch.Tensor) else ''}")
    salt = _hash32(_hash32(stream & _MASK32) ^ (stream >> 32 & _MASK32) ^ 0x85EBCA6B)
    k = (key & _MASK32) ^ _mul32((key >> 32) & _MASK32, _GOLDEN) ^ salt
    index_N = torch.arange(n, device=key.device, dtype=torch.int64)
    h_N = _hash32((((index_N * (k | 1)) & _MASK32) + k) & _MASK32)  # index < 2**31, multiplier < 2**32: no overflow
    return (h_N >> 8).float() * (1.0 / (1 << 24))


def sampling_uniforms(expert_ids_TK: torch.Tensor, n: int, *, stream: int = 0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """[n] fp32 sampling uniforms for one step: ``torch.rand`` from ``generator`` when one is given, else
    ``keyed_uniform(routing_key(expert_ids_TK), n, stream=stream)``."""
    if generator is not None:
        return torch.rand(n, generator=generator, device=expert_ids_TK.device)
    return keyed_uniform(routing_key(expert_ids_TK), n, stream=stream)
