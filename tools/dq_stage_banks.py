"""Shared-memory banks of the wgmma backward's dQ staging, and where each element ends up.

A consumer warpgroup stages its dQ_i accumulators (64 query rows x kCols float32 columns, the
m64nNk16 accumulator layout: lane 4g + t of warp w holds row 16w + g + 8r, columns 8i + 2t + e
as element 4i + 2r + e) in 32-column boxes of 64 128-byte rows with the 128-byte swizzle, which
TMA reductions then add into dq_accum. This models, address by address, two ways of writing them
(`stage_dq_boxes` in `cpp/cuda/bwd_wgmma_dq.cuh` writes the first at head_dim 64 and 128, the
second at 256; `JAX_FLASH_BWD_DQ_STSM` chooses per head_dim):
- natural: dq_accum in the natural column order, one 8-byte store a column pair;
- stmatrix: dq_accum with each aligned group of 8 columns holding its even columns first, one
  stmatrix.x4 a group of 8 columns;
and prints the shared-memory wavefronts each store instruction needs against the ideal, after
checking that every element reaches its own (row, column) of dq_accum through the box's swizzle
and that the convert kernel's interleave restores the natural order. A 4-byte access of a whole
warp needs one wavefront per 128 distinct bytes of a bank row; an 8-byte access is served by
half-warps; stmatrix writes one 8-row matrix (128 bytes) a wavefront when its rows hit different
chunks.

Usage: python tools/dq_stage_banks.py [--cols 64]
"""

from __future__ import annotations

import argparse
from collections import Counter


def dq_accum_position(col: int) -> int:
    """Where column col is stored when each aligned group of 8 holds its even columns first."""
    return (col & ~7) | ((col & 1) << 2) | ((col & 7) >> 1)


def natural(cols: int) -> tuple[dict[int, tuple[int, int]], list[tuple[int, int]]]:
    """(smem byte -> (row, col), [(wavefronts, ideal)] per store instruction) of 8-byte stores."""
    smem, cost = {}, []
    for warp in range(4):
        for r in range(2):
            for i in range(cols // 8):
                wavefronts = 0
                for half in range(2):
                    banks = Counter()
                    for lane in range(16 * half, 16 * half + 16):
                        g, t = lane // 4, lane % 4
                        row = warp * 16 + g + 8 * r
                        chunk = (2 * (i % 4) + t // 2) ^ g
                        base = (i // 4) * 8192 + row * 128 + chunk * 16 + (t % 2) * 8
                        for e in range(2):
                            smem[base + 4 * e] = (row, 8 * i + 2 * t + e)
                            banks[(base + 4 * e) % 128 // 4] += 1
                    wavefronts += max(banks.values())
                cost.append((wavefronts, 2))
    return smem, cost


def stmatrix(cols: int) -> tuple[dict[int, tuple[int, int]], list[tuple[int, int]]]:
    """The same for one stmatrix.x4 a group of 8 columns."""
    smem, cost = {}, []
    for warp in range(4):
        for i in range(cols // 8):
            # Lane 8m + j gives the address of row j of matrix m = 2r + e.
            row_addr = {}
            for lane in range(32):
                m, j = lane // 8, lane % 8
                row = warp * 16 + 8 * (m // 2) + j
                chunk = (2 * (i % 4) + m % 2) ^ j
                row_addr[m, j] = (i // 4) * 8192 + row * 128 + chunk * 16
            wavefronts = 0
            for m in range(4):
                banks = Counter()
                for j in range(8):
                    for word in range(4):
                        banks[(row_addr[m, j] + 4 * word) % 128 // 4] += 1
                wavefronts += max(banks.values())
            cost.append((wavefronts, 4))
            # Lane 4g + t's register m goes to row g of matrix m, bytes 4t..4t+3.
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for m in range(4):
                    r, e = m // 2, m % 2
                    smem[row_addr[m, g] + 4 * t] = (warp * 16 + g + 8 * r, 8 * i + 2 * t + e)
    return smem, cost


def check_reduction(smem: dict[int, tuple[int, int]], position) -> None:
    """Each staged element, read back through the box's swizzle (physical chunk = logical chunk ^
    row % 8), lands at (its row, position(its column)) of dq_accum."""
    for addr, (row, col) in smem.items():
        box, rest = divmod(addr, 8192)
        box_row, within = divmod(rest, 128)
        logical = (within // 16) ^ (box_row % 8)
        stored = 32 * box + 4 * logical + within % 16 // 4
        assert (box_row, stored) == (row, position(col)), (addr, row, col, box_row, stored)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cols", type=int, default=64, help="dQ columns a warpgroup stages")
    cols = parser.parse_args().cols
    assert cols % 32 == 0
    for name, layout, position in (
        ("natural", natural, lambda c: c),
        ("stmatrix", stmatrix, dq_accum_position),
    ):
        smem, cost = layout(cols)
        assert len(smem) == 64 * cols, "every element staged once"
        check_reduction(smem, position)
        used = sum(w for w, _ in cost) // 4
        ideal = sum(i for _, i in cost) // 4
        print(
            f"{name:9s}: {len(cost) // 4} store instructions a warp, {used} wavefronts "
            f"(ideal {ideal}); every element reaches its place in dq_accum"
        )
    # The convert kernel reads positions 8k..8k+3 (even) and 8k+4..8k+7 (odd) and writes column
    # 8k + 2u from even[u], 8k + 2u + 1 from odd[u].
    for col in range(cols):
        k, u, e = col // 8, col % 8 // 2, col % 2
        assert dq_accum_position(col) == 8 * k + 4 * e + u
    print("convert: the interleave of the two halves of each 8-column group restores the order")


if __name__ == "__main__":
    main()
