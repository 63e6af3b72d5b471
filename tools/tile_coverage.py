"""How much of a forward's tensor-core work lands on visible scores, for a tiling and a band.

A query tile of BM rows visits every key block of BN keys that any of its rows can see, and each
consumer warpgroup (64 rows) computes the whole block. This prints, for one dense sequence of S
tokens (queries and keys aligned, as in the benchmark grid), the share of computed scores that are
visible:
- tile: every warpgroup computes every block of its tile's range (the plain scheme);
- warpgroup blocks: a warpgroup skips the blocks its own 64 rows do not reach;
- warpgroup halves: it also skips the 64-key halves of a block that its rows do not reach.
A rate counted on visible pairs can at most reach the share times the rate of a tile of visible
scores, before the per-tile costs of masking and start-up.

Usage: python tools/tile_coverage.py --seqlen 1024 --causal --block-m 192 --block-n 128
       python tools/tile_coverage.py --seqlen 16384 --causal --left 1023 --block-m 128 --block-n 128
"""

from __future__ import annotations

import argparse

WARPGROUP_ROWS = 64


def _visible(rows: range, keys: range, left: int | None, causal: bool) -> int:
    """Visible (query, key) pairs of rows x keys: key j is visible to query i iff j <= i (causal)
    and j >= i - left (a left window bound)."""
    total = 0
    for i in rows:
        lo = keys.start if left is None else max(keys.start, i - left)
        hi = min(keys.stop, i + 1) if causal else keys.stop
        total += max(0, hi - lo)
    return total


def coverage(
    seqlen: int, block_m: int, block_n: int, left: int | None, causal: bool
) -> dict[str, float]:
    visible = 0
    computed = {"tile": 0, "warpgroup blocks": 0, "warpgroup halves": 0}
    for m0 in range(0, seqlen, block_m):
        m1 = min(seqlen, m0 + block_m)
        key_lo = 0 if left is None else max(0, m0 - left)
        key_hi = m1 if causal else seqlen
        for n0 in range(key_lo // block_n * block_n, key_hi, block_n):
            n1 = min(seqlen, n0 + block_n)
            for w0 in range(m0, m1, WARPGROUP_ROWS):
                wg = range(w0, min(m1, w0 + WARPGROUP_ROWS))
                seen = _visible(wg, range(n0, n1), left, causal)
                visible += seen
                computed["tile"] += len(wg) * (n1 - n0)
                if seen:
                    computed["warpgroup blocks"] += len(wg) * (n1 - n0)
                for h0 in range(n0, n1, 64):
                    h1 = min(n1, h0 + 64)
                    if _visible(wg, range(h0, h1), left, causal):
                        computed["warpgroup halves"] += len(wg) * (h1 - h0)
    return {name: visible / work for name, work in computed.items()}


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


if __name__ == "__main__":
    main()
