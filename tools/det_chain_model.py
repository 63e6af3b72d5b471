"""A discrete-event model of the deterministic backward's turn chain on equal-work (unmasked)
calls: what the launch order costs, with no GPU.

CTA (unit u, sequence b, key tile j) computes its pairs m = 0..M-1 (T each) and stages each dQ_m
in its one buffer; its writer warp takes the buffer, waits for tile m's turn (key tile j + 1 has
passed it), issues the reduction (the buffer is read after `rho`, the reduction complete after
`r`) and passes the turn. The consumers stage pair m + 1 only once the buffer is free. CTAs start
in grid order on S SMs as SMs free up; the grid walks `group` units at a time, level by level
(LaunchOrder), each unit's tiles last to first in the deterministic order.

    python3 tools/det_chain_model.py            # the table of docs/PERF_LOG.md
"""

from __future__ import annotations

import heapq


def makespan(
    units: int,
    seqs: int,
    key_tiles: int,
    query_tiles: int,
    pair_us: float,
    hop_us: float,
    read_us: float,
    sms: int,
    deterministic: bool,
    group: int,
    launch_us: float = 0.5,
) -> float:
    """The modelled time of one backward launch, in microseconds."""
    per_unit = seqs * key_tiles
    order = []
    for first in range(0, units, group):
        members = range(first, min(units, first + group))
        for level in range(per_unit):
            tile = per_unit - 1 - level if deterministic else level
            order.extend((u, tile // key_tiles, tile % key_tiles) for u in members)
    # In the deterministic order a CTA's predecessor (key tile j + 1) has a lower grid index, so
    # it has been simulated by the time its successor is.
    passed: dict[tuple[int, int, int, int], float] = {}
    heap = [(0.0, s) for s in range(sms)]
    heapq.heapify(heap)
    end_all = 0.0
    for u, b, j in order:
        free_at, sm = heapq.heappop(heap)
        consumers = buffer_free = writer = free_at + launch_us
        done = consumers
        for m in range(query_tiles):
            consumers = max(consumers + pair_us, buffer_free)  # staged once the buffer is free
            turn = 0.0
            if deterministic and j + 1 < key_tiles:
                turn = passed[(u, b, j + 1, m)]
            issue = max(consumers, writer, turn)
            buffer_free = writer = issue + read_us
            done = issue + hop_us
            passed[(u, b, j, m)] = done
        end = max(consumers, done)
        end_all = max(end_all, end)
        heapq.heappush(heap, (end, sm))
    return end_all


def main() -> None:
    # (name, units = kv heads, sequences, key tiles, query tiles, pair time in us): the driver's
    # B=4 S=4096 and B=1 S=16384 cells on 132 SMs; pair times from its default rates.
    cells = [
        ("head_dim 128, 4 x 4k", 16, 4, 32, 52, 3.1),
        ("head_dim 256, 4 x 4k", 8, 4, 64, 64, 2.6),
        ("head_dim 128, 1 x 16k", 16, 1, 128, 205, 3.1),
    ]
    for name, units, seqs, key_tiles, query_tiles, pair_us in cells:
        for hop_us in (0.8, 1.5, 2.5):
            base = makespan(
                units, seqs, key_tiles, query_tiles, pair_us, hop_us, 0.4, 132, False, 1
            )
            row = [f"{name}, hop {hop_us} us: default {base:.0f} us"]
            for group in (1, 4, 16):
                det = makespan(
                    units,
                    seqs,
                    key_tiles,
                    query_tiles,
                    pair_us,
                    hop_us,
                    0.4,
                    132,
                    True,
                    min(group, units),
                )
                row.append(f"deterministic, group {group}: {100 * (det / base - 1):+.1f}%")
            print("; ".join(row))


if __name__ == "__main__":
    main()
