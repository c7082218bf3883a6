r"""Which rank owns which parameter: greedy longest-processing-time (LPT) bin packing on per-parameter cost.

Each trainable parameter is owned, whole, by one rank, which runs the optimizer on it and holds its state.
Matrix parameters are packed by the optimizer's own cost, FLOPs of one step on the full matrix from the shared
cost model (:func:`matrixopt.distributed.cost.matrix_step_flops`; Muon's at its default 5 steps: the ratio between
parameters, not the absolute number, drives the packing):

- Muon: Newton–Schulz on an ``(m, n)`` piece as Muon computes it by default
  (:func:`matrixopt.linalg.ortho.newton_schulz_flops`): the standard form, ``steps * (4 s^2 l + 2 s^3)`` with
  ``s = min(m, n)``, ``l = max(m, n)`` (Megatron-Core balances on the same ``l s^2`` term), for near-square
  pieces; the Gram form, which needs about 40% fewer for pieces 3-4 times longer than wide, for the others.
- MOP: an SVD of the piece, about ``14 l s^2`` (Golub & Van Loan, Table 8.6.1: R-SVD, U and V wanted).
- Shampoo: factor updates ``2 m n (m + n)`` plus eigendecompositions / inverse roots ``~10 (m^3 + n^3)``
  plus preconditioning ``2 m n (m + n)``. SOAP: the same plus projecting the gradient and the update into and
  out of the eigenbasis, another ``4 m n (m + n)``.

Then AdamW-routed parameters (embeddings, head, norms, biases) are packed by optimizer-state bytes onto the
ranks' state loads: their compute is negligible, their memory (an embedding's two fp32 moments) is not.

Last, :func:`rebalance_state` moves and swaps parameters between ranks to lower the largest per-rank state,
never raising any rank's cost above LPT's maximum times ``1 + cost_tolerance`` (``COST_TOLERANCE`` = 2% by
default): cost alone cannot tell a QKV weight (three square pieces) from MLP matrices of a similar Newton–Schulz
cost and a different state, and placing the embedding after the matrices cannot undo that. GPT 1.3B (24 x 2048,
tied 50304-token embedding, fp32, QKV split in three) on 2 ranks: LPT alone leaves one rank 0.569 of the
single-process state; rebalanced with no slack it stays there (no move or swap keeps the cost), with 2% slack it
ends at 0.501 and a matrix cost imbalance of 1.000 (``tests/distributed/test_layerwise.py``). At 4 ranks 2% is not
enough (0.357, as LPT alone); 3% gives 0.278 at a cost imbalance of 1.021. A whole-owned embedding bounds its owner
from below.

Parameters owned within a smaller group (expert parallelism's blocks, owned among the ranks holding the same
experts: :class:`~matrixopt.distributed.layerwise.Blocks`) are packed first, over that group; each rank's share
then starts the packing of the others over every rank (``base_compute``, ``base_state``), so the totals even out.

Ties are broken by parameter index and then by rank, so every rank computes the same assignment, and the same
parameter list always gives the same assignment (stable across runs and restarts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from matrixopt.distributed.cost import NS_STEPS, matrix_step_flops
from matrixopt.optim.layout import lpt, matrix_pieces

COST_TOLERANCE = 0.02  # rebalancing the state may raise the largest per-rank cost this much above LPT's (relative)


def muon_cost(m: int, n: int) -> float:
    return matrix_step_flops("muon", m, n, NS_STEPS)


def mop_cost(m: int, n: int) -> float:
    return matrix_step_flops("mop", m, n)


def shampoo_cost(m: int, n: int) -> float:
    return matrix_step_flops("shampoo", m, n)


def soap_cost(m: int, n: int) -> float:
    return matrix_step_flops("soap", m, n)


MATRIX_COSTS: dict[str, Callable[[int, int], float]] = {
    "muon": muon_cost,
    "mop": mop_cost,
    "shampoo": shampoo_cost,
    "soap": soap_cost,
}
"""Cost of one optimizer step on one ``(m, n)`` matrix piece, by registered optimizer name. Add an entry for
an optimizer you register, or pass ``cost=`` to :func:`matrixopt.distributed.layerwise`."""


def matrix_cost(param: Tensor, cost: Callable[[int, int], float]) -> float:
    """Sum of ``cost(m, n)`` over the matrix pieces of ``param`` (fused splits, stacked experts, conv kernels)."""
    total = 0.0
    for piece in matrix_pieces(param, param.detach()):
        m, n = piece.shape[-2:]
        batch = piece.numel() // (m * n)
        total += batch * cost(m, n)
    return total


@dataclass(frozen=True)
class Assignment:
    """``owner[i]``: the rank owning parameter i. ``compute[r]`` / ``state_bytes[r]``: rank r's matrix cost and
    optimizer-state bytes. ``imbalance``: max / mean of ``compute`` (1.0 is perfect; 1.0 too when nothing
    costs); ``state_imbalance`` likewise for bytes. ``state_share``: the largest rank's fraction of all the
    state, i.e. its state over the single-process optimizer's (``1 / world_size`` is perfect)."""

    owner: tuple[int, ...]
    compute: tuple[float, ...]
    state_bytes: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        return _imbalance(self.compute)

    @property
    def state_imbalance(self) -> float:
        return _imbalance(self.state_bytes)

    @property
    def state_share(self) -> float:
        total = sum(self.state_bytes)
        return max(self.state_bytes) / total if total > 0 else 1.0 / len(self.state_bytes)

    def summary(self) -> str:
        world = len(self.compute)
        counts = [self.owner.count(r) for r in range(world)]
        state = ", ".join(f"{b / 2**20:.1f}" for b in self.state_bytes)
        return (f"layerwise ownership over {world} ranks: params per rank {counts}, matrix cost imbalance "
                f"{self.imbalance:.3f} (max/mean), optimizer state per rank [{state}] MiB, state imbalance "
                f"{self.state_imbalance:.3f} (max/mean; largest rank holds {self.state_share:.3f} of the total)")


def _imbalance(loads: Sequence[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def assign(params: Sequence[Tensor], is_matrix: Sequence[bool], world_size: int,
           cost: Callable[[int, int], float], state_bytes: Callable[[Tensor, bool], int],
           cost_tolerance: float = COST_TOLERANCE, base_compute: Sequence[float] | None = None,
           base_state: Sequence[int] | None = None) -> Assignment:
    """Owner rank of each parameter: matrix parameters by LPT on ``cost`` of their pieces, then AdamW parameters
    by LPT on ``state_bytes(p, is_matrix)`` starting from the bytes each rank holds for its matrices, then
    :func:`rebalance_state` with every rank's cost capped at ``(1 + cost_tolerance)`` times LPT's maximum.

    ``base_compute``, ``base_state``: the cost and state bytes each rank already carries (e.g. expert stacks
    owned within a smaller group), which the packing starts from; the returned loads include them."""
    if cost_tolerance < 0:
        raise ValueError(f"cost_tolerance must be >= 0, got {cost_tolerance}")
    base_compute = list(base_compute) if base_compute is not None else [0.0] * world_size
    base_state = list(base_state) if base_state is not None else [0] * world_size
    if len(base_compute) != world_size or len(base_state) != world_size:
        raise ValueError(f"base_compute and base_state need one entry per rank ({world_size}), got "
                         f"{len(base_compute)} and {len(base_state)}")
    costs = [matrix_cost(p, cost) if m else 0.0 for p, m in zip(params, is_matrix)]
    sizes = [int(state_bytes(p, m)) for p, m in zip(params, is_matrix)]
    mat = [i for i, m in enumerate(is_matrix) if m]
    rest = [i for i, m in enumerate(is_matrix) if not m]
    owner = [0] * len(params)
    mat_owner, compute = lpt([costs[i] for i in mat], world_size, base_compute)
    bytes_ = list(base_state)
    for i, r in zip(mat, mat_owner):
        owner[i] = r
        bytes_[r] += sizes[i]
    rest_owner, _ = lpt([float(sizes[i]) for i in rest], world_size, bytes_)
    for i, r in zip(rest, rest_owner):
        owner[i] = r
    base = (base_compute, base_state)
    owner = rebalance_state(owner, costs, sizes, world_size, (1 + cost_tolerance) * max(compute), *base)
    return Assignment(tuple(owner), *_loads(owner, costs, sizes, world_size, *base))


def _loads(owner: Sequence[int], costs: Sequence[float], sizes: Sequence[int], world_size: int,
           base_compute: Sequence[float] | None = None,
           base_state: Sequence[int] | None = None) -> tuple[tuple[float, ...], tuple[int, ...]]:
    compute = list(base_compute) if base_compute is not None else [0.0] * world_size
    state = list(base_state) if base_state is not None else [0] * world_size
    for r, c, s in zip(owner, costs, sizes):
        compute[r] += c
        state[r] += s
    return tuple(compute), tuple(state)


def rebalance_state(owner: Sequence[int], costs: Sequence[float], sizes: Sequence[int], world_size: int,
                    cost_cap: float, base_compute: Sequence[float] | None = None,
                    base_state: Sequence[int] | None = None) -> list[int]:
    """Lower the largest per-rank state by moving or swapping items between ranks, keeping every rank's cost at
    most ``cost_cap``. Returns the new owner of each item. ``base_compute``, ``base_state``: per-rank loads that
    no item carries (they stay where they are).

    LPT packs the matrices by cost alone, so equal-cost matrices of different sizes (a fused QKV's three
    ``(d, d)`` pieces against one ``(4d, d)`` MLP matrix: same Muon cost, 3/4 of the state) fall on ranks by index,
    and the AdamW items (at 1.3B on 2 ranks the embedding's moments are a third of a rank's matrix state) are
    placed around them afterwards.
    Repeatedly, the rank ``a`` with the most state (lowest rank on ties) hands some ``d`` bytes to a rank ``b``
    with less: it moves one item to ``b`` or swaps one item with one of ``b``'s, choosing the exchange that
    leaves ``max(S_a - d, S_b + d)`` smallest (ties: smaller cost maximum of the two, then lower ``b``, then
    lower item indices). Only ``0 < d < S_a - S_b`` is allowed, so both ranks end below ``a``'s old state: the
    count of ranks at the maximum (then the maximum) strictly falls and the search ends. It stops when no such
    exchange exists. Items of the same (cost, bytes) are interchangeable, so one (the lowest index) of each kind
    per rank is tried, which keeps a step to ``O(kinds^2 * world_size)``.

    Everything is integer bytes and float costs summed in a fixed order: every rank computes the same owners.
    """
    owner = list(owner)
    compute, state = map(list, _loads(owner, costs, sizes, world_size, base_compute, base_state))
    while True:
        a = max(range(world_size), key=lambda r: (state[r], -r))
        kinds: list[dict[tuple[float, int], int]] = [{} for _ in range(world_size)]  # (cost, bytes) -> lowest index
        for i in reversed(range(len(owner))):
            kinds[owner[i]][(costs[i], sizes[i])] = i
        reps = [sorted(k.values()) for k in kinds]
        best, best_key = None, None
        for b in range(world_size):
            gap = state[a] - state[b]
            if gap <= 0:  # b == a too
                continue
            for i in reps[a]:
                for j in [None, *reps[b]]:  # None: move i to b, else swap i and j
                    cj, sj = (0.0, 0) if j is None else (costs[j], sizes[j])
                    d = sizes[i] - sj
                    ca, cb = compute[a] - costs[i] + cj, compute[b] + costs[i] - cj
                    if not 0 < d < gap or ca > cost_cap or cb > cost_cap:
                        continue
                    key = (max(state[a] - d, state[b] + d), max(ca, cb), b, i, -1 if j is None else j)
                    if best_key is None or key < best_key:
                        best, best_key = (b, i, j, ca, cb, d), key
        if best is None:
            return owner
        b, i, j, ca, cb, d = best
        owner[i] = b
        if j is not None:
            owner[j] = a
        compute[a], compute[b] = ca, cb
        state[a], state[b] = state[a] - d, state[b] + d
