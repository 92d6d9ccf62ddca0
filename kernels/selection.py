"""Selection within quotas: the Triton kernels behind ``lrmoe::select_within_quota``.

Shapes: P pairs, G groups, R = max_rows (the static size of the compact buffer).

Both modes select in the group order: pairs by group ascending, pair id within (a stable argsort of the group ids,
which a caller such as the MoE layer already has from its forward dispatch and passes in; otherwise one int32 sort).
Per mode (docs/design.md, 'The five primitives'):

"top" (one launch given the group order, when run eagerly): ``_top_kernel``, one program per group, each first
planning all groups (``_plan_block``: per group, start and size by a 16-ary search over the group ids read through
the group order, or read from the group ends when the caller gives them (HAS_ENDS: the MoE layer has them from its
dispatch), take = min(max(quota, 0), size), the cumulative ends; program 0 writes the counts/offsets clipped
to R), then over its members in the group order: the take-th largest score key as a threshold by radix select
(four 256-bin histograms, 8 bits at a time from the top, no sort by score), then one pass that keeps every key
above it and, of the keys equal to it, the lowest pair ids, and writes them in pair-id order. A group of up to
2,048 members is loaded once; a larger one is read once per pass (5 passes). Further programs fill the rows after
the last kept pair with padding (-1, 0). With more groups than one plan step (BLOCK_G), and under torch.compile,
``_plan_kernel`` plans first, in its own launch, and ``_top_kernel`` reads its arrays (see Helpers below).

"sample" (given the group order and a bound <= SORT_MAX on the group sizes, step 1 is instead ``_plan_kernel``
on the group order, then ``_group_sort_kernel``: each group sorted by (score descending, pair id) in one
program's registers, in the smallest power-of-two block from SORT_MIN up that holds it, the same order without a
global sort):
1. ``_group_keys_kernel`` (grid over max(P, R)): one int64 sort key per pair, ``group << 32 | descending score
   bits``, and the output buffers filled with padding (-1, 0) in the same launch; a stable radix sort of the keys
   (CUB on CUDA): group ascending, score descending, ties to the lower pair id (the order of the reference's two
   stable argsorts, in one sort); ``_plan_kernel`` (one program: the plan above, written out for the next two).
2. ``_sample_probabilities_kernel`` (one program per group, over its members in that score order): the
   inclusion probabilities of the reference's ``probabilities``, op for op in fp64: finite weights, the segmented
   suffix sums by the same Hillis-Steele rounds restricted to the group (rounds with distance >= the group size
   add nothing, so the additions and their order are the reference's), the capped count m and the scale. A hot
   group is one program's work (log2(size) passes over it).
3. ``_compact_kernel`` (grid over P, group order): the group's cumulative inclusion probabilities from the running
   sum over all groups (torch.cumsum, as the reference takes it), then slot and keep test (systematic sampling),
   with the reference's fp64 arithmetic so the result is bit-identical.

Helpers (@triton.jit functions called by the kernels) take loaded values, never a tensor's pointer whose loads
decide where a kernel stores: under torch.compile the kernels are traced through torch.library.wrap_triton, and
Inductor finds the tensors a kernel writes by walking back from each store's address through the kernel's TTIR,
in which a helper call stands for all of its arguments; a pointer passed to a helper on that path would count as
written, and the compiled graph would copy that input and write it back (tests/ops/kernel_writes.py). The one
exception is "top"'s in-kernel plan, whose searches must read the group ids and order: traced for torch.compile,
``select_top`` always takes the PLANNED path, whose TTIR holds no such call (a constexpr branch).

Score keys: NaN counts as +inf (as in the reference), -0.0 as +0.0 (equal floats must tie, to go to the lower pair
id), then the usual monotone map of the fp32 bit pattern to a signed int (flip the magnitude bits of negatives),
negated for descending order and shifted into [0, 2^32).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .launch import interpreting, known_empty, launch, tracing

__all__ = [
    "SORT_MAX", "compact", "group_score_order", "plan_groups", "sample_probabilities", "score_order", "select_top",
]

BLOCK = 1024  # elements per program of the elementwise kernels: memory-bound, 4 warps, 8 elements a thread
# Groups per step of the plan (it loops over larger G); small under the interpreter, so that the tests' few groups
# take several steps.
BLOCK_G = 16 if interpreting() else 256
SORT_MAX = 8192  # largest group one program sorts in registers ("sample" given a bound on the group sizes)
# Smallest block of that sort (a group is sorted in the smallest power-of-two block from here up that holds it).
# Small under the interpreter, so the tests' groups take several blocks.
SORT_MIN = 4 if interpreting() else 256
# Members per step of a "top" program (a group up to this size is counted in registers). Small under the
# interpreter, so the tests' groups take both paths.
TOP_BLOCK = 16 if interpreting() else 2048


@triton.jit
def _group_keys_kernel(scores_ptr, gids_ptr, keys_ptr, pair_ids_ptr, weights_ptr, P, R, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_p = i < P
    key = tl.load(gids_ptr + i, mask=in_p, other=0).to(tl.int64) << 32
    s = tl.load(scores_ptr + i, mask=in_p, other=0.0).to(tl.float32)
    s = tl.where(s != s, float("inf"), s)  # NaN -> +inf
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0: equal scores must give equal keys
    bits = s.to(tl.int32, bitcast=True)
    asc = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed int order == float order
    desc = -asc - 1  # == ~asc: descending, no overflow
    key = key + (desc.to(tl.int64) + 2147483647 + 1)  # into [0, 2^32), below the group bits
    tl.store(keys_ptr + i, key, mask=in_p)
    in_r = i < R
    tl.store(pair_ids_ptr + i, tl.full((BLOCK,), -1, tl.int64), mask=in_r)
    tl.store(weights_ptr + i, tl.zeros((BLOCK,), tl.float32), mask=in_r)


@triton.jit
def _lower_bound(gids_ptr, order_ptr, n, target, n_steps, PROBES: tl.constexpr):
    """First position i in [0, n) with gids[order[i]] >= target (n if none), for a vector of targets, where
    gids[order[.]] is non-decreasing. A PROBES-ary search: each step reads PROBES - 1 positions of every target's
    interval at once, so ~log_PROBES(n) steps of two dependent loads (L2-resident ids)."""
    lo = tl.zeros_like(target).to(tl.int64)
    hi = lo + n
    j = tl.arange(0, PROBES)[None, :].to(tl.int64) + 1
    use = j < PROBES
    for _ in range(n_steps):
        width = (hi - lo)[:, None]
        pos = lo[:, None] + (width * j) // PROBES  # in [lo, hi) for j < PROBES
        ok = use & (width > 0)
        pair = tl.load(order_ptr + pos, mask=ok, other=0)
        below = ok & (tl.load(gids_ptr + pair, mask=ok, other=0).to(tl.int64) < target[:, None])
        c = tl.sum(below.to(tl.int64), 1)  # probes below the target: a prefix of them (non-decreasing ids)
        first_not = tl.min(tl.where(ok & ~below, pos, hi[:, None]), 1)
        last_below = tl.max(tl.where(below, pos, lo[:, None] - 1), 1)
        lo = tl.where(c > 0, last_below + 1, lo)
        hi = first_not
    return lo


@triton.jit
def _plan_block(gids_ptr, order_ptr, quotas_ptr, ends_ptr, g, carry, P, G, n_steps, PROBES: tl.constexpr,
                HAS_ENDS: tl.constexpr):
    """Groups g (a block of group ids, made by the caller, so that _plan_kernel's store addresses do not come out
    of this call: module docstring, Helpers): (in range, start, size, take, base), given ``carry`` = the takes of
    all earlier groups. Start and end of every group read from the given group ends (HAS_ENDS), else found by
    searches over the group ids read through the order."""
    in_g = g < G
    g64 = g.to(tl.int64)
    if HAS_ENDS:
        end = tl.load(ends_ptr + g, mask=in_g, other=0).to(tl.int64)
        start = tl.load(ends_ptr + g - 1, mask=in_g & (g > 0), other=0).to(tl.int64)
        size = end - start
    else:
        start = _lower_bound(gids_ptr, order_ptr, P, g64, n_steps, PROBES)
        size = _lower_bound(gids_ptr, order_ptr, P, g64 + 1, n_steps, PROBES) - start
    quota = tl.load(quotas_ptr + g, mask=in_g, other=0).to(tl.int64)
    take = tl.where(in_g, tl.minimum(tl.maximum(quota, 0), size), 0)
    base = tl.cumsum(take, 0) - take + carry
    return in_g, start, size, take, base


@triton.jit
def _plan_kernel(
    gids_ptr, order_ptr, quotas_ptr, ends_ptr, starts_ptr, sizes_ptr, takes_ptr, bases_ptr, counts_ptr, offsets_ptr,
    P, G, R, n_steps, BLOCK_G: tl.constexpr, PROBES: tl.constexpr, HAS_ENDS: tl.constexpr,
):
    # One program: G is small (experts or instances) and every group's end needs the takes of all before it.
    carry = tl.zeros((), tl.int64)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        in_g, start, size, take, base = _plan_block(gids_ptr, order_ptr, quotas_ptr, ends_ptr, g, carry, P, G,
                                                    n_steps, PROBES, HAS_ENDS)
        offsets = tl.minimum(base + take, R)
        tl.store(starts_ptr + g, start, mask=in_g)
        tl.store(sizes_ptr + g, size, mask=in_g)
        tl.store(takes_ptr + g, take, mask=in_g)
        tl.store(bases_ptr + g, base, mask=in_g)
        tl.store(counts_ptr + g, (offsets - tl.minimum(base, R)).to(tl.int32), mask=in_g)
        tl.store(offsets_ptr + g, offsets.to(tl.int32), mask=in_g)
        carry += tl.sum(take, 0)


@triton.jit
def _compact_kernel(
    order_ptr, gids_ptr, starts_ptr, sizes_ptr, takes_ptr, bases_ptr, p_ptr, cum_ptr, u_ptr,
    pair_ids_ptr, weights_ptr, P, R, BLOCK: tl.constexpr,
):
    # Mode "sample", every position of the group order: the reference's arithmetic, op for op in fp64: the
    # group's inclusive cumulative p from the running sum over all groups (``_segment_cumsum``: minus the running
    # sum before the group's first member), its last value pinned to the quota, the others clamped, then point
    # m = slot hits the pair iff ceil(lo - u) < ceil(hi - u).
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_p = i < P
    pair = tl.load(order_ptr + i, mask=in_p, other=0)
    g = tl.load(gids_ptr + pair, mask=in_p, other=0).to(tl.int64)
    start = tl.load(starts_ptr + g, mask=in_p, other=0)
    take = tl.load(takes_ptr + g, mask=in_p, other=0)
    rank = i - start
    size = tl.load(sizes_ptr + g, mask=in_p, other=0)
    p = tl.load(p_ptr + pair, mask=in_p, other=1.0)
    first = tl.load(order_ptr + start, mask=in_p, other=0)
    before = tl.load(cum_ptr + start, mask=in_p, other=0.0) - tl.load(p_ptr + first, mask=in_p, other=0.0)
    cum_hi = tl.load(cum_ptr + i, mask=in_p, other=0.0) - before
    # The interval starts where the previous member's (same arithmetic, same clamps) ends; the group's first at 0.
    cum_prev = tl.load(cum_ptr + i - 1, mask=in_p & (rank > 0), other=0.0) - before
    u = tl.load(u_ptr + g, mask=in_p, other=0.5)  # fp64, clamped by the launcher
    take_d = take.to(tl.float64)
    cum_lo = tl.where(rank == 0, 0.0, tl.minimum(tl.maximum(cum_prev, 0.0), take_d))
    cum_hi = tl.where(rank == size - 1, take_d, tl.minimum(tl.maximum(cum_hi, 0.0), take_d))
    slot = tl.math.ceil(cum_lo - u).to(tl.int64)
    kept = (tl.math.ceil(cum_hi - u).to(tl.int64) > slot) & (slot < take)
    w = (1.0 / p).to(tl.float32)
    dest = tl.load(bases_ptr + g, mask=in_p, other=0) + slot
    kept = in_p & kept & (dest < R)
    tl.store(pair_ids_ptr + dest, pair, mask=kept)
    tl.store(weights_ptr + dest, w, mask=kept)


@triton.jit
def _score_key(score):
    """Unsigned order key in [0, 2^32) of fp32 scores: NaN as +inf, -0.0 as +0.0 (equal scores tie), larger score,
    larger key."""
    s = score.to(tl.float32)
    s = tl.where(s != s, float("inf"), s)
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    asc = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed int order == float order
    return asc.to(tl.int64) + 2147483648


@triton.jit
def _digit_histogram(key, cand, shift):
    """Counts of the 8-bit digit (key >> shift) & 255 over the candidates: [256] int32."""
    return tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=cand)


@triton.jit
def _radix_step(hist, need, prefix):
    """One radix-select step: the digit b holding the need-th largest candidate (the candidates are the keys that
    start with ``prefix``). Returns (need among the keys that start with prefix.b, prefix.b)."""
    ge = tl.cumsum(hist, 0, reverse=True)  # candidates with digit >= b
    b = tl.sum((ge >= need).to(tl.int32), 0) - 1  # ge is non-increasing and ge[0] >= need
    above = tl.sum(tl.where(tl.arange(0, 256) == b, ge - hist, 0), 0)  # candidates with digit > b
    return need - above, (prefix << 8) | b.to(tl.int64)


@triton.jit
def _write_kept(pair, key, ok, thresh, ties_kept, ties_before, kept_before, base, pair_ids_ptr, weights_ptr, R,
                BLOCK: tl.constexpr):
    """One block of a group in pair-id order: keep keys above the threshold and the first ``ties_kept`` keys equal
    to it (counting the ``ties_before`` of earlier blocks), write them after the ``kept_before`` already written.
    Returns the updated (ties_before, kept_before)."""
    tie = (ok & (key == thresh)).to(tl.int64)
    tie_rank = ties_before + tl.cumsum(tie, 0) - tie
    keep = ((ok & (key > thresh)) | ((tie > 0) & (tie_rank < ties_kept))).to(tl.int64)
    dest = base + kept_before + tl.cumsum(keep, 0) - keep
    out = (keep > 0) & (dest < R)
    tl.store(pair_ids_ptr + dest, pair, mask=out)
    tl.store(weights_ptr + dest, tl.full((BLOCK,), 1.0, tl.float32), mask=out)
    return ties_before + tl.sum(tie, 0), kept_before + tl.sum(keep, 0)


@triton.jit
def _top_kernel(
    scores_ptr, gids_ptr, order_ptr, quotas_ptr, ends_ptr, counts_ptr, offsets_ptr, pair_ids_ptr, weights_ptr, P, G,
    R, n_steps, starts_ptr, sizes_ptr, takes_ptr, bases_ptr, PLANNED: tl.constexpr, BLOCK_G: tl.constexpr,
    PROBES: tl.constexpr, BLOCK: tl.constexpr, FILL_BLOCK: tl.constexpr, HAS_ENDS: tl.constexpr,
):
    # The whole of mode "top" in one launch. Every program first plans all groups (the searches are tiny and
    # L2-resident, so doing them in every program costs what one plan kernel costs, and saves its launch); program 0
    # writes the counts and offsets. With PLANNED (more groups than BLOCK_G: planning all of them in every program
    # would cost G^2; or traced for torch.compile, module docstring) the plan comes from _plan_kernel's arrays
    # instead. Programs 0..G-1 then take one group each, over its members in pair-id order (the group order): the
    # take-th largest score key T by radix select, 8 bits at a time from the top (4 histograms of the keys that share
    # the digits found so far); what is left of the count at the last digit is how many keys == T to keep, the lowest
    # pair ids. Then one pass keeps every key > T and those ties, writing them in pair-id order at the group's base.
    # A group of at most BLOCK members is loaded once and counted in registers; a larger one is re-read per pass.
    # Programs G.. fill the rows after the last group's kept pairs with padding (-1, 0).
    pid = tl.program_id(0)
    carry = tl.zeros((), tl.int64)
    start = tl.zeros((), tl.int64)
    size = tl.zeros((), tl.int64)
    take = tl.zeros((), tl.int64)
    base = tl.zeros((), tl.int64)
    if PLANNED:
        carry += tl.load(bases_ptr + G - 1) + tl.load(takes_ptr + G - 1)
        if pid < G:
            start += tl.load(starts_ptr + pid)
            size += tl.load(sizes_ptr + pid)
            take += tl.load(takes_ptr + pid)
            base += tl.load(bases_ptr + pid)
    else:  # G <= BLOCK_G: one step of the plan
        g = tl.arange(0, BLOCK_G)
        in_g, starts, sizes, takes, bases = _plan_block(gids_ptr, order_ptr, quotas_ptr, ends_ptr, g, carry, P, G,
                                                        n_steps, PROBES, HAS_ENDS)
        offsets = tl.minimum(bases + takes, R)
        write = in_g & (pid == 0)
        tl.store(counts_ptr + g, (offsets - tl.minimum(bases, R)).to(tl.int32), mask=write)
        tl.store(offsets_ptr + g, offsets.to(tl.int32), mask=write)
        mine = g == pid
        start += tl.sum(tl.where(mine, starts, 0), 0)
        size += tl.sum(tl.where(mine, sizes, 0), 0)
        take += tl.sum(tl.where(mine, takes, 0), 0)
        base += tl.sum(tl.where(mine, bases, 0), 0)
        carry += tl.sum(takes, 0)
    g = pid
    if g >= G:
        i = (g - G).to(tl.int64) * FILL_BLOCK + tl.arange(0, FILL_BLOCK)
        pad = (i >= carry) & (i < R)
        tl.store(pair_ids_ptr + i, tl.full((FILL_BLOCK,), -1, tl.int64), mask=pad)
        tl.store(weights_ptr + i, tl.zeros((FILL_BLOCK,), tl.float32), mask=pad)
    else:
        offs = tl.arange(0, BLOCK)
        zero = tl.zeros((), tl.int64)
        if take > 0:
            need = take
            thresh = zero
            if size <= BLOCK:
                ok = offs < size
                pair = tl.load(order_ptr + start + offs, mask=ok, other=0)
                key = _score_key(tl.load(scores_ptr + pair, mask=ok, other=0.0))
                for i in range(4):  # digits from the top; an ascending loop (no negative step in compiled Triton)
                    shift = 24 - 8 * i
                    hist = _digit_histogram(key, ok & ((key >> (shift + 8)) == thresh), shift)
                    need, thresh = _radix_step(hist, need, thresh)
                _write_kept(pair, key, ok, thresh, need, zero, zero, base, pair_ids_ptr, weights_ptr, R, BLOCK)
            else:
                for i in range(4):
                    shift = 24 - 8 * i
                    hist = tl.zeros((256,), tl.int32)
                    for j0 in range(0, size, BLOCK):
                        ok = j0 + offs < size
                        pair = tl.load(order_ptr + start + j0 + offs, mask=ok, other=0)
                        key = _score_key(tl.load(scores_ptr + pair, mask=ok, other=0.0))
                        hist += _digit_histogram(key, ok & ((key >> (shift + 8)) == thresh), shift)
                    need, thresh = _radix_step(hist, need, thresh)
                ties_before = zero
                kept_before = zero
                for j0 in range(0, size, BLOCK):
                    ok = j0 + offs < size
                    pair = tl.load(order_ptr + start + j0 + offs, mask=ok, other=0)
                    key = _score_key(tl.load(scores_ptr + pair, mask=ok, other=0.0))
                    ties_before, kept_before = _write_kept(pair, key, ok, thresh, need, ties_before, kept_before,
                                                           base, pair_ids_ptr, weights_ptr, R, BLOCK)


@triton.jit
def _group_sort_kernel(
    scores_ptr, order_ptr, starts_ptr, sizes_ptr, by_score_ptr, pair_ids_ptr, weights_ptr, G, R,
    SORT_MIN: tl.constexpr, LEVELS: tl.constexpr, FILL_BLOCK: tl.constexpr,
):
    # Programs 0..G-1: one group each, members taken in the group order (pair id ascending), sorted in registers
    # by (score descending, NaN as +inf, -0.0 as +0.0; then pair id ascending) -- the order of the global int64
    # key sort, without it. The caller guarantees every group fits the largest block, SORT_MIN << (LEVELS - 1).
    # Each group is sorted in the smallest of the blocks SORT_MIN << level that holds it, a branch on its size:
    # the bound the caller knows (the MoE layer's token count) is many times a typical group (16x at E = 128,
    # k = 8), and a sort's cost grows with its block. Programs G..: padding (-1, 0) over the whole output buffer,
    # which the compaction then overwrites with the kept rows.
    g = tl.program_id(0)
    if g >= G:
        i = (g - G).to(tl.int64) * FILL_BLOCK + tl.arange(0, FILL_BLOCK)
        tl.store(pair_ids_ptr + i, tl.full((FILL_BLOCK,), -1, tl.int64), mask=i < R)
        tl.store(weights_ptr + i, tl.zeros((FILL_BLOCK,), tl.float32), mask=i < R)
    else:
        start = tl.load(starts_ptr + g)
        size = tl.load(sizes_ptr + g)
        for level in tl.static_range(LEVELS):
            # This level's sizes: (half its block, its block]; the first takes every size up to its block, the
            # last every size above half of its block.
            lo = -1 if level == 0 else (SORT_MIN << level) // 2
            hi = 2147483647 if level == LEVELS - 1 else SORT_MIN << level
            if (size > lo) & (size <= hi):
                j = tl.arange(0, SORT_MIN << level)
                ok = j < size
                pair = tl.load(order_ptr + start + j, mask=ok, other=0)
                pos = _by_score_positions(tl.load(scores_ptr + pair, mask=ok, other=0.0), ok, j)
                first = tl.load(order_ptr + start + pos, mask=ok, other=0)
                tl.store(by_score_ptr + start + j, first, mask=ok)


@triton.jit
def _by_score_positions(scores, ok, j):
    """The positions j (in the group order) of a group's scores, sorted by score descending (NaN as +inf, -0.0 as
    +0.0), ties by position. Lanes that are not ok sort last."""
    # Score descending, shifted into [-2^31, 2^31) so that << 32 keeps the order in signed int64; then the
    # position in the group order (pair id ascending).
    desc = 2147483647 - _score_key(scores)
    key = tl.where(ok, (desc << 32) | j.to(tl.int64), 9223372036854775807)
    return tl.sort(key, 0) & 4294967295


@triton.jit
def _split_inf(w):
    """(weight is +inf, finite weight: +inf as 0)."""
    is_inf = w == float("inf")
    return is_inf, tl.where(is_inf, 0.0, w)


@triton.jit
def _sample_probabilities_kernel(
    w_ptr, order_ptr, starts_ptr, sizes_ptr, takes_ptr, tail_a_ptr, tail_b_ptr, p_ptr, BLOCK: tl.constexpr,
):
    # One program per group, over its members in score order (+inf first, then weight descending, ties to the
    # lower pair id): the reference's ``probabilities``, op for op in fp64, so the result is bit-identical.
    g = tl.program_id(0)
    start = tl.load(starts_ptr + g)
    size = tl.load(sizes_ptr + g)
    take = tl.load(takes_ptr + g)
    offs = tl.arange(0, BLOCK)

    # Finite weights (+inf -> 0) into the scan buffer; count the infinite ones (they come first).
    n_inf = tl.sum(tl.zeros((BLOCK,), tl.int64), 0)
    for j0 in range(0, size, BLOCK):
        j = j0 + offs  # one block of the group in score order (positions j, pair ids)
        ok = j < size
        pair = tl.load(order_ptr + start + j, mask=ok, other=0)
        is_inf, wf = _split_inf(tl.load(w_ptr + pair, mask=ok, other=0.0))
        n_inf += tl.sum((ok & is_inf).to(tl.int64), 0)
        tl.store(tail_a_ptr + start + j, wf, mask=ok)

    # tail(r) = sum of the finite weights from rank r to the group's end: the reference's segmented
    # Hillis-Steele scan (out[i] += out[i + d] while i + d is in the group, d = 1, 2, 4, ...), whose rounds with
    # d >= size add nothing, so one group's scan is the same additions in the same order.
    src = tail_a_ptr
    dst = tail_b_ptr
    d = 1
    while d < size:
        tl.debug_barrier()  # this round reads what the previous one wrote
        for j0 in range(0, size, BLOCK):
            j = j0 + offs
            ok = j < size
            has = ok & (j + d < size)
            a = tl.load(src + start + j, mask=ok, other=0.0)
            b = tl.load(src + start + j + d, mask=has, other=0.0)
            tl.store(dst + start + j, tl.where(has, a + b, a), mask=ok)
        tmp = src
        src = dst
        dst = tmp
        d *= 2
    tl.debug_barrier()

    # m: the in-quota finite pairs that do not "fit" ((q - r) w_r > tail(r)), capped at p = 1.
    q = tl.maximum(take - n_inf, 0)
    room = q < size - n_inf
    m = tl.sum(tl.zeros((BLOCK,), tl.int64), 0)
    for j0 in range(0, size, BLOCK):
        j = j0 + offs  # one block of the group in score order (positions j, pair ids)
        ok = j < size
        pair = tl.load(order_ptr + start + j, mask=ok, other=0)
        is_inf, wf = _split_inf(tl.load(w_ptr + pair, mask=ok, other=0.0))
        tail = tl.load(src + start + j, mask=ok, other=0.0)
        rf = j - n_inf
        fits = room & ((q - rf).to(tl.float64) * wf <= tail)
        m += tl.sum((ok & ~is_inf & (rf < q) & ~fits).to(tl.int64), 0)
    at_m = n_inf + m  # the first fitting rank (finite: the infinite pairs come first)
    tail_m = tl.load(src + start + at_m, mask=at_m < size, other=0.0)
    left = (q - m).to(tl.float64)
    scale = left / tl.maximum(tail_m, 2.2250738585072014e-308)  # float64 tiny
    uniform = left / tl.maximum(size - n_inf - m, 1).to(tl.float64)
    for j0 in range(0, size, BLOCK):
        j = j0 + offs  # one block of the group in score order (positions j, pair ids)
        ok = j < size
        pair = tl.load(order_ptr + start + j, mask=ok, other=0)
        is_inf, wf = _split_inf(tl.load(w_ptr + pair, mask=ok, other=0.0))
        rf = j - n_inf
        free = tl.where(tail_m > 0, tl.minimum(scale * wf, 1.0), uniform)
        p = tl.where(is_inf, (j < take).to(tl.float64), tl.where(rf < m, 1.0, free))
        tl.store(p_ptr + pair, p, mask=ok)


def sample_probabilities(w_P: torch.Tensor, order_P: torch.Tensor, plan: dict[str, torch.Tensor]) -> torch.Tensor:
    """[P] fp64 inclusion probabilities in pair order (the reference's ``probabilities``, bit for bit), from the
    fp64 weights of ``lrmoe.ops.selection.sample_weights`` in pair order (computed by PyTorch: its CPU sqrt is not
    always correctly rounded, Triton's is, so the weights are not recomputed here), the score order of
    ``score_order`` and its plan. One program per group; scratch of 2 * P fp64."""
    P, G = w_P.shape[0], plan["starts"].shape[0]
    p_P = torch.empty(P, dtype=torch.float64, device=w_P.device)
    if known_empty(P, G):
        return p_P
    scratch = torch.empty(2, P, dtype=torch.float64, device=w_P.device)
    launch(_sample_probabilities_kernel, (G,))(
        w_P, order_P, plan["starts"], plan["sizes"], plan["takes"], scratch[0], scratch[1], p_P,
        BLOCK=BLOCK, num_warps=4,
    )
    return p_P


def group_score_order(
    scores_P: torch.Tensor, order_P: torch.Tensor, plan: dict[str, torch.Tensor], max_rows: int, max_group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``score_order``'s result (by-score order, pair_ids [R] of -1, weights [R] of 0) without a global sort:
    each group's members, in the group order, sorted in one program's registers. Every group must have at most
    ``max_group_size`` <= SORT_MAX members (not checked: a sync)."""
    device = order_P.device
    P, G = order_P.shape[0], plan["starts"].shape[0]
    by_score_P = torch.empty(P, dtype=torch.int64, device=device)
    pair_ids_R = torch.empty(max_rows, dtype=torch.int64, device=device)
    weights_R = torch.empty(max_rows, dtype=torch.float32, device=device)
    sort_block = triton.next_power_of_2(max(max_group_size, 2))
    sort_min = min(SORT_MIN, sort_block)
    if G + max_rows > 0:
        launch(_group_sort_kernel, (G + triton.cdiv(max_rows, BLOCK),))(
            scores_P, order_P, plan["starts"], plan["sizes"], by_score_P, pair_ids_R, weights_R, G, max_rows,
            SORT_MIN=sort_min, LEVELS=(sort_block // sort_min).bit_length(), FILL_BLOCK=BLOCK,
            num_warps=min(16, max(4, sort_block // 256)),
        )
    return by_score_P, pair_ids_R, weights_R


def score_order(
    scores_P: torch.Tensor, group_ids_P: torch.Tensor, max_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [P] int64, pair_ids [R] int64 of -1, weights [R] fp32 of 0): pairs by group
    ascending, score descending (NaN as +inf), ties to the lower pair id (one stable sort of int64 keys), and the
    output buffers filled with padding in the same launch as the keys."""
    device = group_ids_P.device
    P = group_ids_P.shape[0]
    keys_P = torch.empty(P, dtype=torch.int64, device=device)
    pair_ids_R = torch.empty(max_rows, dtype=torch.int64, device=device)
    weights_R = torch.empty(max_rows, dtype=torch.float32, device=device)
    n = torch.sym_max(P, max_rows)  # no Python max: max_rows may be an unbacked SymInt under compile
    if not known_empty(n):
        launch(_group_keys_kernel, (triton.cdiv(n, BLOCK),))(
            scores_P, group_ids_P, keys_P, pair_ids_R, weights_R, P, max_rows, BLOCK=BLOCK, num_warps=4,
        )
    return torch.sort(keys_P, stable=True)[1], pair_ids_R, weights_R


def _search_steps(P: int) -> int:
    """Steps of the 16-ary search over P positions: each cuts an interval to at most 1/16 of it (rounded up)."""
    return (P.bit_length() + 3) // 4 + 2


def plan_groups(
    group_ids_P: torch.Tensor, order_P: torch.Tensor, quotas_G: torch.Tensor, max_rows: int,
    ends_G: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per group: starts, sizes, takes, bases (int64: first position in ``order_P``, members, kept, first buffer
    row) and counts, offsets (int32, clipped to max_rows), from the group ids and an order that sorts them by
    group first (the group order or the score order): one program. ``ends_G``, when given, are the groups'
    cumulative sizes (each group's end in any such order), read instead of searched. Separate tensors: the op
    returns two of them."""
    device = quotas_G.device
    G, P = quotas_G.shape[0], group_ids_P.shape[0]
    plan = {name: torch.empty(G, dtype=torch.int64, device=device) for name in ("starts", "sizes", "takes", "bases")}
    plan |= {name: torch.empty(G, dtype=torch.int32, device=device) for name in ("counts", "offsets")}
    if G > 0:
        launch(_plan_kernel, (1,))(
            group_ids_P, order_P, quotas_G, quotas_G if ends_G is None else ends_G, plan["starts"], plan["sizes"],
            plan["takes"], plan["bases"], plan["counts"], plan["offsets"], P, G, max_rows, _search_steps(P),
            # 8 warps: at 4, ptxas spills the [256, 16] int64 probes of a full plan step (255 registers, 256 bytes
            # of stack for sm_90; tests/kernels/sm90_compile.py --resources).
            BLOCK_G=min(BLOCK_G, triton.next_power_of_2(G)), PROBES=16, num_warps=8, HAS_ENDS=ends_G is not None,
        )
    return plan


def select_top(
    scores_P: torch.Tensor, group_ids_P: torch.Tensor, order_P: torch.Tensor, quotas_G: torch.Tensor, max_rows: int,
    ends_G: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mode "top" from the group order (group ascending, pair id within): (pair_ids [R], weights [R], counts [G],
    offsets [G]), every group's kept pairs in pair-id order and padding after them, in one launch (one program per
    group and programs filling the padding, each planning all groups first) when G fits one plan step (BLOCK_G),
    else (and when traced for torch.compile) the plan kernel and then that kernel reading its plan."""
    device = order_P.device
    G, P = quotas_G.shape[0], order_P.shape[0]
    pair_ids_R = torch.empty(max_rows, dtype=torch.int64, device=device)
    weights_R = torch.empty(max_rows, dtype=torch.float32, device=device)
    counts_G = torch.empty(G, dtype=torch.int32, device=device)
    offsets_G = torch.empty(G, dtype=torch.int32, device=device)
    if G == 0:
        return pair_ids_R.fill_(-1), weights_R.zero_(), counts_G, offsets_G
    # Planned in its own launch: more groups than one step, or traced for torch.compile (module docstring, Helpers).
    planned = G > BLOCK_G or tracing()
    plan = plan_groups(group_ids_P, order_P, quotas_G, max_rows, ends_G) if planned else None
    if planned:
        counts_G, offsets_G = plan["counts"], plan["offsets"]
    stats = [plan[k] for k in ("starts", "sizes", "takes", "bases")] if planned else [counts_G] * 4  # unread
    launch(_top_kernel, (G + triton.cdiv(max_rows, BLOCK),))(
        scores_P, group_ids_P, order_P, quotas_G, quotas_G if ends_G is None else ends_G, counts_G, offsets_G,
        pair_ids_R, weights_R, P, G, max_rows, _search_steps(P), *stats, PLANNED=planned,
        BLOCK_G=min(BLOCK_G, triton.next_power_of_2(G)), PROBES=16, BLOCK=TOP_BLOCK, FILL_BLOCK=BLOCK, num_warps=8,
        HAS_ENDS=ends_G is not None,
    )
    return pair_ids_R, weights_R, counts_G, offsets_G


def compact(
    order_P: torch.Tensor,
    group_ids_P: torch.Tensor,
    plan: dict[str, torch.Tensor],
    pair_ids_R: torch.Tensor,
    weights_R: torch.Tensor,
    *,
    p_P: torch.Tensor,
    cum_P: torch.Tensor,
    uniform_G: torch.Tensor,
    u_margin: float,
) -> None:
    """Mode "sample": write the kept pairs into pair_ids_R / weights_R (in place), from the group order, fp64 p in
    pair order, the inclusive cumulative sum of p in the group order over all groups, and the uniforms per group
    (any float dtype, read as fp64 and clamped to [u_margin, 1 - u_margin] here, G values)."""
    P = order_P.shape[0]
    if known_empty(P):
        return
    uniform_G = uniform_G.double().clamp(u_margin, 1.0 - u_margin)
    launch(_compact_kernel, (triton.cdiv(P, BLOCK),))(
        order_P, group_ids_P, plan["starts"], plan["sizes"], plan["takes"], plan["bases"], p_P, cum_P, uniform_G,
        pair_ids_R, weights_R, P, pair_ids_R.shape[0], BLOCK=BLOCK, num_warps=4,
    )
