r"""Which rank owns which parameter: greedy longest-processing-time (LPT) bin packing on per-parameter cost.

Each trainable parameter is owned, whole, by one rank, which runs the optimizer on it and holds its state.
Matrix parameters are packed by the optimizer's own cost (FLOPs of one step on the full matrix):

- Muon: Newton–Schulz on an ``(m, n)`` piece with ``s = min(m, n)``, ``l = max(m, n)`` costs per iteration
  ``2 s^2 l`` (``X X^T``) ``+ 2 s^3`` (``A^2``) ``+ 2 s^2 l`` (``B X``), so ``steps * (4 s^2 l + 2 s^3)``
  (Megatron-Core balances on the same ``l s^2`` term).
- MOP: an SVD of the piece, about ``14 l s^2`` (Golub & Van Loan, Table 8.6.1: R-SVD, U and V wanted).
- Shampoo: factor updates ``2 m n (m + n)`` plus eigendecompositions / inverse roots ``~10 (m^3 + n^3)``
  plus preconditioning ``2 m n (m + n)``. SOAP: the same plus projecting the gradient and the update into and
  out of the eigenbasis, another ``4 m n (m + n)``.

Then AdamW-routed parameters (embeddings, head, norms, biases) are packed by optimizer-state bytes onto the
ranks' state loads: their compute is negligible, their memory (an embedding's two fp32 moments) is not.

Ties are broken by parameter index and then by rank, so every rank computes the same assignment, and the same
parameter list always gives the same assignment (stable across runs and restarts).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from matrixopt.optim.layout import matrix_pieces

NS_STEPS = 5  # Muon's default; the ratio between parameters, not the absolute number, drives the packing


def muon_cost(m: int, n: int) -> float:
    s, l = min(m, n), max(m, n)
    return NS_STEPS * (4 * s * s * l + 2 * s**3)


def mop_cost(m: int, n: int) -> float:
    s, l = min(m, n), max(m, n)
    return 14 * l * s * s


def shampoo_cost(m: int, n: int) -> float:
    return 4 * m * n * (m + n) + 10 * (m**3 + n**3)


def soap_cost(m: int, n: int) -> float:
    return shampoo_cost(m, n) + 4 * m * n * (m + n)


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
    costs); ``state_imbalance`` likewise for bytes."""

    owner: tuple[int, ...]
    compute: tuple[float, ...]
    state_bytes: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        return _imbalance(self.compute)

    @property
    def state_imbalance(self) -> float:
        return _imbalance(self.state_bytes)

    def summary(self) -> str:
        world = len(self.compute)
        counts = [self.owner.count(r) for r in range(world)]
        return (f"layerwise ownership over {world} ranks: params per rank {counts}, matrix cost imbalance "
                f"{self.imbalance:.3f} (max/mean), state imbalance {self.state_imbalance:.3f}")


def _imbalance(loads: Sequence[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def lpt(costs: Sequence[float], world_size: int, loads: Sequence[float] | None = None) -> tuple[list[int], list[float]]:
    """Greedy LPT: items in decreasing cost (ties: lower index first) each go to the least-loaded rank (ties:
    lower rank). ``loads``: starting load per rank. Returns (owner per item, final loads)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = list(loads) if loads is not None else [0.0] * world_size
    heap = [(load[r], r) for r in range(world_size)]
    heapq.heapify(heap)
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        l, r = heapq.heappop(heap)
        owner[i] = r
        load[r] = l + costs[i]
        heapq.heappush(heap, (load[r], r))
    return owner, load


def assign(params: Sequence[Tensor], is_matrix: Sequence[bool], world_size: int,
           cost: Callable[[int, int], float], state_bytes: Callable[[Tensor, bool], int]) -> Assignment:
    """Owner rank of each parameter: matrix parameters by LPT on ``cost`` of their pieces, then AdamW parameters
    by LPT on ``state_bytes(p, is_matrix)`` starting from the bytes each rank holds for its matrices."""
    mat = [i for i, m in enumerate(is_matrix) if m]
    rest = [i for i, m in enumerate(is_matrix) if not m]
    owner = [0] * len(params)
    mat_owner, compute = lpt([matrix_cost(params[i], cost) for i in mat], world_size)
    bytes_ = [0] * world_size
    for i, r in zip(mat, mat_owner):
        owner[i] = r
        bytes_[r] += state_bytes(params[i], True)
    rest_owner, loads = lpt([float(state_bytes(params[i], False)) for i in rest], world_size, bytes_)
    for i, r in zip(rest, rest_owner):
        owner[i] = r
    return Assignment(tuple(owner), tuple(compute), tuple(int(x) for x in loads))
