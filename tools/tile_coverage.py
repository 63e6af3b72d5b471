"""How much of a forward's tensor-core work lands on visible scores, for a tiling and a band.

A query tile of BM rows visits every key block of BN keys that any of its rows can see, and each
consumer warpgroup (64 rows) computes the whole block. This prints, for one dense sequence of S
tokens (queries and keys aligned, as in the benchmark grid), the share of computed scores that are
visible:
- tile: every warpgroup computes every block of its tile's range (the plain scheme);
- warpgroup blocks: a warpgroup skips the blocks its own 64 rows do not reach;
- warpgroup halves: it also skips the 64-key halves of a block that its rows do not reach.
A rate counted on visible pairs can at most reach the share times the rate of a tile of visible
scores, before the per-tile costs of masking and start-up. Which keys a row sees comes from
jax_flash.reference.band_mask (jax_flash installed).

It also prints a turn model of the tiles' time, for tiles that start at row 0 and for tiles that
end at the last row (JAX_FLASH_FWD_ALIGN_END: the first tile starts whole warpgroups before row
0): a tile costs one fixed unit, plus, for each key block that any of its warpgroups computes,
max(n * g, g + s) for the n warpgroups that compute it (warpgroup block skipping), g being one
warpgroup's two GEMMs on a block and s its softmax: alone, a warpgroup cannot overlap the two.

Usage: python tools/tile_coverage.py --seqlen 1024 --causal --block-m 192 --block-n 128
       python tools/tile_coverage.py --seqlen 16384 --causal --left 1023 --block-m 128 --block-n 128
"""

from __future__ import annotations

import argparse

import numpy as np

from jax_flash.reference import band_mask

WARPGROUP_ROWS = 64


def _row_ranges(seqlen: int, left: int | None, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each query row's visible keys [lo, hi), from the library's own band rule (a band's rows see
    a contiguous key range)."""
    mask = np.asarray(band_mask(seqlen, seqlen, causal=causal, window=(left, None)))
    count = mask.sum(axis=1)
    lo = np.where(count > 0, mask.argmax(axis=1), 0)
    return lo, lo + count


def coverage(
    seqlen: int, block_m: int, block_n: int, left: int | None, causal: bool
) -> dict[str, float]:
    lo, hi = _row_ranges(seqlen, left, causal)

    def seen(r0: int, r1: int, k0: int, k1: int) -> int:
        return int(np.maximum(0, np.minimum(hi[r0:r1], k1) - np.maximum(lo[r0:r1], k0)).sum())

    visible = 0
    computed = {"tile": 0, "warpgroup blocks": 0, "warpgroup halves": 0}
    for m0 in range(0, seqlen, block_m):
        m1 = min(seqlen, m0 + block_m)
        key_lo, key_hi = int(lo[m0:m1].min()), int(hi[m0:m1].max())
        for n0 in range(key_lo // block_n * block_n, key_hi, block_n):
            n1 = min(seqlen, n0 + block_n)
            for w0 in range(m0, m1, WARPGROUP_ROWS):
                w1 = min(m1, w0 + WARPGROUP_ROWS)
                block_seen = seen(w0, w1, n0, n1)
                visible += block_seen
                computed["tile"] += (w1 - w0) * (n1 - n0)
                if block_seen:
                    computed["warpgroup blocks"] += (w1 - w0) * (n1 - n0)
                for h0 in range(n0, n1, 64):
                    h1 = min(n1, h0 + 64)
                    if seen(w0, w1, h0, h1):
                        computed["warpgroup halves"] += (w1 - w0) * (h1 - h0)
    return {name: visible / work for name, work in computed.items()}


def turn_model(
    seqlen: int,
    block_m: int,
    block_n: int,
    left: int | None,
    causal: bool,
    align_end: bool,
    softmax: float = 1.0,
) -> float:
    """The tiles' time in units of one warpgroup's two GEMMs on a block (module docstring)."""
    lo, hi = _row_ranges(seqlen, left, causal)
    shift = 0
    if align_end:
        shift = (block_m - seqlen % block_m) % block_m // WARPGROUP_ROWS * WARPGROUP_ROWS
    total = 0.0
    for m0 in range(-shift, seqlen, block_m):
        blocks: dict[int, int] = {}
        for w0 in range(max(m0, 0), min(seqlen, m0 + block_m), WARPGROUP_ROWS):
            w1 = min(seqlen, m0 + block_m, w0 + WARPGROUP_ROWS)
            if w1 <= w0 or int(hi[w0:w1].max()) <= int(lo[w0:w1].min()):
                continue
            first = int(lo[w0:w1].min()) // block_n
            last = (int(hi[w0:w1].max()) + block_n - 1) // block_n
            for b in range(first, last):
                blocks[b] = blocks.get(b, 0) + 1
        total += 1.0 + sum(max(n, 1.0 + softmax) for n in blocks.values())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, required=True)
    parser.add_argument("--block-m", type=int, required=True, help="query rows a tile")
    parser.add_argument("--block-n", type=int, required=True, help="keys a block")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--left", type=int, help="left window bound (keys before the diagonal)")
    args = parser.parse_args()
    if args.block_m % WARPGROUP_ROWS:
        parser.error(f"--block-m must be a multiple of {WARPGROUP_ROWS}")
    for name, share in coverage(
        args.seqlen, args.block_m, args.block_n, args.left, args.causal
    ).items():
        print(f"{name:18s} {share:.4f} of computed scores visible")
    plain, aligned = (
        turn_model(args.seqlen, args.block_m, args.block_n, args.left, args.causal, a)
        for a in (False, True)
    )
    print(f"turn model: tiles from row 0 {plain:.0f}, ending at the last row {aligned:.0f}")


if __name__ == "__main__":
    main()
