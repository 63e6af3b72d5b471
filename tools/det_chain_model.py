"""A discrete-event model of the deterministic backward's turn chain and launch order, with no GPU.

CTA (unit u, sequence b, key tile j) computes its pairs (T each) over the query tiles it visits and
stages each dQ_m in its one buffer; its writer warp takes the buffer, waits for tile m's turn (the
key tile before it in the order has passed it), issues the reduction (the buffer is read after
`read`, the reduction complete after `hop`) and passes the turn. The consumers stage the next pair
only once the buffer is free. CTAs start in grid order on `sms` SMs as SMs free up; the grid walks
`group` units at a time, level by level (LaunchOrder).

Orders (`mode`):
- "default": no turns; each unit's key tiles first to first (the heaviest first when causal).
- "desc": the deterministic order as built: key tiles descending in each tile's order and in the
  launch (each unit's tiles last to first), query tiles ascending in each CTA.
- "asc": a variant (not built): key tiles ascending in the order and the launch, query tiles
  descending in each CTA, so the heaviest key tiles launch first as in the default order.
Causal calls: key tile j's first query tile is j * ratio (ratio = key tile / query tile rows).

    python3 tools/det_chain_model.py            # the tables of docs/PERF_LOG.md
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    name: str
    units: int  # kv heads (the wgmma backward's units)
    seqs: int
    key_tiles: int  # per sequence
    query_tiles: int  # per sequence
    pair_us: float
    causal: bool = False
    ratio: int = 1  # causal: query tiles per key tile


def makespan(
    cell: Cell,
    mode: str,
    group: int,
    hop_us: float,
    read_us: float = 0.4,
    sms: int = 132,
    launch_us: float = 0.5,
) -> float:
    """The modelled time of one backward launch, in microseconds."""
    n, per_unit = cell.key_tiles, cell.seqs * cell.key_tiles
    order = []
    for first in range(0, cell.units, group):
        members = range(first, min(cell.units, first + group))
        for level in range(per_unit):
            tile = per_unit - 1 - level if mode == "desc" else level
            order.extend((u, tile // n, tile % n) for u in members)
    # A CTA's predecessor in every tile's order has a lower grid index in both deterministic
    # orders, so it has been simulated by the time its successor is.
    passed: dict[tuple[int, int, int, int], float] = {}
    heap = [(0.0, s) for s in range(sms)]
    heapq.heapify(heap)
    end_all = 0.0
    for u, b, j in order:
        free_at, sm = heapq.heappop(heap)
        consumers = buffer_free = writer = done = free_at + launch_us
        tiles = range(j * cell.ratio if cell.causal else 0, cell.query_tiles)
        for m in reversed(tiles) if mode == "asc" else tiles:
            consumers = max(consumers + cell.pair_us, buffer_free)  # staged once it is free
            hi = min(n - 1, m // cell.ratio) if cell.causal else n - 1
            turn = 0.0
            if mode == "desc" and j + 1 <= hi:
                turn = passed[(u, b, j + 1, m)]
            elif mode == "asc" and j >= 1:
                turn = passed[(u, b, j - 1, m)]
            issue = max(consumers, writer, turn)
            buffer_free = writer = issue + read_us
            done = issue + hop_us
            passed[(u, b, j, m)] = done
        end = max(consumers, done)
        end_all = max(end_all, end)
        heapq.heappush(heap, (end, sm))
    return end_all


# The driver's B=4 S=4096 and B=1 S=16384 cells (bf16, H = 2048 / head_dim) on 132 SMs, pair
# times from the default backward's rates; the launch group the causal calls get today.
CELLS = [
    (Cell("head_dim 128, 4 x 4k", 16, 4, 32, 52, 3.1), 1),
    (Cell("head_dim 256, 4 x 4k", 8, 4, 64, 64, 2.6), 1),
    (Cell("head_dim 128, 1 x 16k", 16, 1, 128, 205, 3.1), 1),
    (Cell("head_dim 128, 4 x 4k causal", 16, 4, 32, 64, 2.6, True, 2), 8),
    (Cell("head_dim 256, 4 x 4k causal", 8, 4, 64, 64, 2.6, True, 1), 4),
    (Cell("head_dim 128, 1 x 16k causal", 16, 1, 128, 256, 2.6, True, 2), 8),
]


def main() -> None:
    for cell, group in CELLS:
        for hop_us in (0.8, 2.5):
            base = makespan(cell, "default", group, hop_us)
            row = [f"{cell.name}, hop {hop_us} us: default {base:.0f} us"]
            for mode, g in (
                ("desc", group),
                ("desc", cell.units),
                ("asc", group),
                ("asc", cell.units),
            ):
                det = makespan(cell, mode, g, hop_us)
                row.append(f"{mode} group {g} {100 * (det / base - 1):+.1f}%")
            print("; ".join(row))


if __name__ == "__main__":
    main()
