"""Expert instances: where hot experts get replicas, and how each source's pairs spread over an expert's instances.

Shapes: S source ranks, E experts, W EP ranks (S == W: source s is rank s), L = E / W experts owned per rank,
R replica slots per rank, I = L + R instance slots per rank.

Rank w owns experts [w * L, (w + 1) * L) (its first L slots) and may hold up to R replicas of other experts (its
last R slots). A placement is ``replicas_WR`` [W, R] int64: the expert in each replica slot, -1 for an empty slot.
A placement policy is any function ``(loads_WE, max_replicas) -> replicas_WR`` that is deterministic (every rank
calls it on the same all-gathered load matrix and must get the same placement), puts at most one instance of an
expert on a rank and no replica of an expert on its owner; :func:`place_hot_replicas` is the default.
"""

from __future__ import annotations

import torch

from lrmoe.functional._checks import check_at_least, check_in_range, check_int, check_tensor, checking, is_integer

__all__ = ["balanced_capacity", "instance_experts", "place_hot_replicas", "route_to_replicas"]


def _check_owned_blocks(n_exp: int, n_ranks: int, what: str) -> None:
    """W >= 1 ranks that own E / W experts each: E a positive multiple of W. ``what`` names the arguments E and W
    come from. An explicit error instead of the reshape's (``shape '[2, -1]' is invalid for input of size 3``) or
    a modulo by zero."""
    if n_ranks < 1 or n_exp < 1 or n_exp % n_ranks:
        raise ValueError(f"{what}: need W >= 1 ranks and E a positive multiple of W (rank w owns experts "
                         f"[w * E/W, (w + 1) * E/W)), got E={n_exp}, W={n_ranks}")


def route_to_replicas(counts_SE: torch.Tensor, capacity_EW: torch.Tensor) -> torch.Tensor:
    """Assign pairs (counts per source x expert) to expert instances with capacities.

    Rank w holds an instance of expert e iff capacity_EW[e, w] > 0. For every expert, independently:
    1. each source first keeps what fits on its own rank's instance: min(count, capacity of (e, s));
    2. the rest is laid out in source order against the remaining capacities in rank order, and source s
       sends to rank w the overlap of its interval with w's (a deterministic transport with no sort);
    3. if the expert's demand exceeds its total capacity, the excess goes to the instance with the largest
       capacity (the lowest rank among equals), which is then the only one over capacity. Every pair is
       always assigned. An expert with no instance at all (a capacity row of zeros) sends its excess to
       rank 0: giving every expert an instance is the caller's job (checked in checking mode only: a sync).

    Returns: split_SEW, int64, with split.sum(-1) == counts; split[s, e, w] > 0 only where capacity[e, w] > 0
    (given an instance per expert); split.sum(0) <= capacity whenever counts.sum(0) <= capacity.sum(1).
    """
    check_tensor("counts_SE", counts_SE, ndim=2, kind="int")
    check_tensor("capacity_EW", capacity_EW, ndim=2, kind="int")
    n_src, n_exp = counts_SE.shape
    if n_src < 1:
        raise ValueError(f"counts_SE must have at least one source (S >= 1), got shape {tuple(counts_SE.shape)}")
    if capacity_EW.shape[0] != n_exp:
        raise ValueError(
            f"capacity_EW must have E={n_exp} rows like counts_SE has columns, got shape {tuple(capacity_EW.shape)}"
        )
    n_ranks = capacity_EW.shape[1]
    if n_src != n_ranks:
        raise ValueError(
            f"counts_SE has {n_src} sources but capacity_EW has {n_ranks} ranks; source s is rank s, so they "
            "must be equal"
        )
    if checking():
        check_at_least("counts_SE", counts_SE, 0, "pairs per source and expert")
        check_at_least("capacity_EW", capacity_EW, 0, "rows per expert instance")
        homeless_E = (counts_SE.sum(0) > 0) & (capacity_EW <= 0).all(1)
        if homeless_E.any():
            raise ValueError(f"capacity_EW gives experts {homeless_E.nonzero().flatten().tolist()} no instance (a row "
                             "of zeros) but counts_SE routes pairs to them")

    counts_SE = counts_SE.long().clamp(min=0)
    cap_EW = capacity_EW.long().clamp(min=0)
    local_SE = torch.minimum(counts_SE, cap_EW.t())
    rest_SE = counts_SE - local_SE
    left_EW = cap_EW - local_SE.t()

    d_hi_SE = torch.cumsum(rest_SE, 0)
    d_lo_SE = d_hi_SE - rest_SE
    c_hi_EW = torch.cumsum(left_EW, 1)
    c_lo_EW = c_hi_EW - left_EW
    overlap_SEW = (
        torch.minimum(d_hi_SE.unsqueeze(-1), c_hi_EW.unsqueeze(0))
        - torch.maximum(d_lo_SE.unsqueeze(-1), c_lo_EW.unsqueeze(0))
    ).clamp(min=0)

    excess_SE = (d_hi_SE - torch.maximum(d_lo_SE, c_hi_EW[:, -1].unsqueeze(0))).clamp(min=0)
    biggest_EW = torch.nn.functional.one_hot(cap_EW.argmax(1), n_ranks)
    eye_SW = torch.eye(n_src, n_ranks, dtype=torch.int64, device=counts_SE.device)
    return (overlap_SEW + local_SE.unsqueeze(-1) * eye_SW.unsqueeze(1)
            + excess_SE.unsqueeze(-1) * biggest_EW.unsqueeze(0))


def place_hot_replicas(loads_WE: torch.Tensor, max_replicas: int) -> torch.Tensor:
    """Default placement policy: the most loaded experts get extra instances on the least loaded ranks.

    Model: an expert's load spreads evenly over its instances, and a rank's load is the sum of its instances'
    shares. Greedily, W * R times: take the expert with the largest per-instance share that some rank can still
    take (a free slot, no instance of it yet); give it an instance on the least loaded such rank, if that rank's
    load plus the new share stays below the load of the most loaded rank already holding the expert (else the
    replica would not help, and nothing is placed). Ties go to the lower expert or rank index. float64 on the
    device, the same operations on every rank: the same placement everywhere. No host synchronisation.

    Returns: replicas_WR [W, R] int64, -1 in the slots left empty.
    """
    check_tensor("loads_WE", loads_WE, ndim=2, kind="int")
    max_replicas = check_int("max_replicas", max_replicas, min_value=0)
    n_ranks, n_exp = loads_WE.shape
    _check_owned_blocks(n_exp, n_ranks, "loads_WE [W, E]")
    if checking():
        check_at_least("loads_WE", loads_WE, 0, "pairs per rank and expert")
    device = loads_WE.device
    n_local = n_exp // n_ranks
    load_E = loads_WE.sum(0).double()
    expert_E = torch.arange(n_exp, device=device)
    rank_W = torch.arange(n_ranks, device=device)
    slot_R = torch.arange(max_replicas, device=device)
    hosts_EW = torch.nn.functional.one_hot(expert_E // n_local, n_ranks).bool()
    n_inst_E = torch.ones(n_exp, dtype=torch.float64, device=device)
    free_W = torch.full((n_ranks,), max_replicas, dtype=torch.int64, device=device)
    replicas_WR = torch.full((n_ranks, max_replicas), -1, dtype=torch.int64, device=device)
    # A fill, not torch.tensor(inf, device=...): that is a copy from host memory, which on CUDA waits for the stream.
    inf = torch.full((), float("inf"), dtype=torch.float64, device=device)
    ninf, none_open = -inf, torch.full((), -1.0, dtype=torch.float64, device=device)  # made once, not per step
    # A static number of small steps (W * R), so the loop unrolls into a compiled graph. Each step's masks are made
    # once and reused (every op is a kernel launch when the plan runs on a GPU).
    for _ in range(n_ranks * max_replicas):
        share_E = load_E / n_inst_E
        rank_load_W = (hosts_EW * share_E.unsqueeze(1)).sum(0)
        open_EW = ~hosts_EW & (free_W > 0).unsqueeze(0)
        # 0-d indices are taken with index_select, not indexing: indexing with a tensor is data-dependent for the
        # compiler, index_select is an ordinary op.
        hot = torch.where(open_EW.any(1), share_E, none_open).argmax().reshape(1)
        open_W = open_EW.index_select(0, hot).squeeze(0)
        target = torch.where(open_W, rank_load_W, inf).argmin().reshape(1)
        busiest = torch.where(hosts_EW.index_select(0, hot).squeeze(0), rank_load_W, ninf).max()
        new_load = (rank_load_W.index_select(0, target)
                    + load_E.index_select(0, hot) / (n_inst_E.index_select(0, hot) + 1))
        helps = (open_W.index_select(0, target) & (new_load < busiest)).squeeze(0)
        placed_E = (expert_E == hot) & helps  # the expert that gets an instance (none when it would not help)
        placed_W = (rank_W == target) & helps  # and the rank
        hosts_EW = hosts_EW | (placed_E.unsqueeze(1) & placed_W.unsqueeze(0))
        n_inst_E = n_inst_E + placed_E.double()
        slot = max_replicas - free_W.index_select(0, target)
        replicas_WR = torch.where(placed_W.unsqueeze(1) & (slot_R == slot).unsqueeze(0), hot, replicas_WR)
        free_W = free_W - placed_W.long()
    return replicas_WR


def instance_experts(replicas_WR: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[W, I] int64: the expert of every instance slot, the L owned experts first, then the replicas (-1 empty).

    ``num_experts`` E: a Python int, a positive multiple of W (replicas_WR's rows).
    """
    check_tensor("replicas_WR", replicas_WR, ndim=2, kind="int")
    if not is_integer(num_experts):
        raise TypeError(f"num_experts must be an int, got {type(num_experts).__name__}")
    num_experts = int(num_experts)
    n_ranks = replicas_WR.shape[0]
    _check_owned_blocks(num_experts, n_ranks, "num_experts E and replicas_WR [W, R]")
    owned_WL = torch.arange(num_experts, device=replicas_WR.device).view(n_ranks, -1)
    experts_WI = torch.cat([owned_WL, replicas_WR.long()], dim=1)
    if checking():
        check_in_range("replicas_WR", replicas_WR, -1, num_experts, "an expert id per replica slot, -1 empty")
        if experts_WI.device.type != "meta":  # a placement policy's contract: no expert twice on a rank
            sorted_WI = experts_WI.sort(1).values
            twice_W = ((sorted_WI[:, 1:] == sorted_WI[:, :-1]) & (sorted_WI[:, 1:] >= 0)).any(1)
            if twice_W.any():
                raise ValueError(f"replicas_WR puts an expert twice on ranks {twice_W.nonzero().flatten().tolist()} "
                                 "(a replica of an expert the rank owns, or two replicas of one expert)")
    return experts_WI


def balanced_capacity(loads_E: torch.Tensor, experts_WI: torch.Tensor) -> torch.Tensor:
    """[E, W] forward capacity of every instance: ceil(load / instances) where rank w holds expert e, else 0.

    With it, :func:`route_to_replicas` never overflows (total capacity >= load) and spreads each expert's pairs
    evenly over its instances, each source's own instance first.

    loads_E: [E] integer. experts_WI: [W, I] integer, as :func:`instance_experts` makes it (E a positive multiple
    of W, I >= E / W); its expert ids must be in [-1, E) (checked in checking mode only: a sync).
    """
    check_tensor("loads_E", loads_E, ndim=1, kind="int")
    check_tensor("experts_WI", experts_WI, ndim=2, kind="int")
    n_exp, n_ranks = loads_E.shape[0], experts_WI.shape[0]
    _check_owned_blocks(n_exp, n_ranks, "loads_E [E] and experts_WI [W, I]")
    if experts_WI.shape[1] < n_exp // n_ranks:
        raise ValueError(f"experts_WI has I={experts_WI.shape[1]} instance slots per rank, fewer than the "
                         f"E/W={n_exp // n_ranks} experts each rank owns (E={n_exp} from loads_E, W={n_ranks}); "
                         "loads_E and experts_WI must have the same E")
    if checking():
        check_at_least("loads_E", loads_E, 0, "pairs per expert")
        check_in_range("experts_WI", experts_WI, -1, n_exp, "an expert id per instance slot, -1 empty")
    valid_WI = experts_WI >= 0
    safe_WI = experts_WI.clamp(min=0)
    n_inst_E = torch.zeros(n_exp, dtype=torch.int64, device=loads_E.device).index_add_(
        0, safe_WI.reshape(-1), valid_WI.reshape(-1).long()
    )
    per_inst_E = torch.div(loads_E.long() + n_inst_E - 1, n_inst_E.clamp(min=1), rounding_mode="floor")
    flat_WI = safe_WI * n_ranks + torch.arange(n_ranks, device=loads_E.device).unsqueeze(1)
    value_WI = per_inst_E.index_select(0, safe_WI.reshape(-1)).view_as(safe_WI) * valid_WI
    cap = torch.zeros(n_exp * n_ranks, dtype=torch.int64, device=loads_E.device)
    return cap.index_add_(0, flat_WI.reshape(-1), value_WI.reshape(-1)).view(n_exp, n_ranks)
