"""Per-CTA phase trace of the wgmma forward, in a scratch copy of the kernel and its driver.

Copies cpp/ and tools/wgmma_check.cu into DEST and adds clock64 marks to the copy of
cpp/cuda/fwd_wgmma.cuh: kernel entry (and the SM), the producer's first K load issued, the first
K tile landed in consumer warpgroup 0, the end of its key-block loop (and the blocks it visited),
and the end of its epilogue. The copy's driver prints, after every timed cell, the mean of each
phase over the last launch's CTAs (cycles), a least-squares fit of a CTA's cycles against the
blocks it visited, and the mean idle gap between consecutive CTAs on an SM. The marks cost a few
stores per CTA; the timings of the traced build are not the kernel's timings.

The marks are per CTA: with the persistent forward (on by default for rows of at most 2048 keys)
a CTA runs many tiles and its marks are those of its last tile, so trace such cells with
JAX_FLASH_FWD_PERSISTENT=0. Consumer warpgroup 0's marks; with the warpgroup block skip its first
block need not be the tile's.

The patches are plain text replacements of the kernel's source: when the kernel changes, the
script stops with the text it could not find.

Usage: python3 tools/fwd_cta_trace.py DEST, then in DEST
  nvcc -std=c++17 -O3 -I cpp -gencode=arch=compute_90a,code=sm_90a -DJAX_FLASH_BUILT_SM90A=1
       tools/wgmma_check.cu cpp/cuda/fwd_wgmma.cu cpp/cuda/sm90_host.cu -o fwd_trace
and on an sm_90 GPU: ./fwd_trace --order
"""

from instrumented_copy import instrument_forward

# Slots per CTA: 0 entry, 1 SM id, 2 first K issued, 3 first K landed (warpgroup 1, thread 128),
# 4 loop end, 5 epilogue end, 6 blocks visited.
MARKS = """
#define FWD_TRACE_SLOTS 8192
__device__ unsigned long long g_fwd_trace[FWD_TRACE_SLOTS * 8];
#define FWD_PUT(i, v)                                                         \\
  do {                                                                        \\
    if (blockIdx.x < FWD_TRACE_SLOTS) g_fwd_trace[blockIdx.x * 8 + (i)] = (v); \\
  } while (0)
#define FWD_MARK(i) FWD_PUT(i, clock64())
"""

KERNEL_PATCHES = [
    (
        "  // ------------------------------------------------------------------ which tile\n",
        "  if (threadIdx.x == 0) {\n"
        "    FWD_MARK(0);\n"
        "    unsigned sm;\n"
        '    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));\n'
        "    FWD_PUT(1, sm);\n"
        "    for (int z = 2; z < 8; ++z) FWD_PUT(z, 0);\n"
        "  }\n"
        "  // ------------------------------------------------------------------ which tile\n",
    ),
    (
        "            if (ring + it >= kStages) mbar_wait(bars.k_empty(stage), empty_parity);\n"
        "            load_k(stage, n0, kv_head);",
        "            if (ring + it >= kStages) mbar_wait(bars.k_empty(stage), empty_parity);\n"
        "            if (it == 0) FWD_MARK(2);\n"
        "            load_k(stage, n0, kv_head);",
    ),
    (
        "            mbar_wait(bars.k_full(s0), phase_of(lead));\n",
        "            mbar_wait(bars.k_full(s0), phase_of(lead));\n"
        "            if (threadIdx.x == 128) FWD_MARK(3);\n",
    ),
    (
        "          {\n            const int last = stage_of(it - 1);",
        "          if (threadIdx.x == 128) {\n            FWD_MARK(4);\n"
        "            FWD_PUT(6, it);\n          }\n"
        "          {\n            const int last = stage_of(it - 1);",
    ),
    (
        "          if (row + 8 * r < len_q) lse_row[row + 8 * r] = lse[r];\n        }\n      }\n",
        "          if (row + 8 * r < len_q) lse_row[row + 8 * r] = lse[r];\n        }\n      }\n"
        "      if (threadIdx.x == 128) FWD_MARK(5);\n",
    ),
]

DUMP = r"""
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

// Phase means over the CTAs of the last launch that visited a key block; clears the trace.
void fwd_trace_dump(const char* label) {
  using jax_flash::cuda::sm90::g_fwd_trace;
  std::vector<unsigned long long> h(FWD_TRACE_SLOTS * 8);
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyFromSymbol(h.data(), g_fwd_trace, h.size() * 8) != cudaSuccess) {
    std::printf("trace %s: copy failed\n", label);
    return;
  }
  int n = 0;
  // Sums over the CTAs; total and blocks are also the fit's sums of y and x.
  double issue = 0, landed = 0, loop = 0, epi = 0, total = 0, blocks = 0, sxx = 0, sxy = 0;
  std::vector<std::vector<std::pair<unsigned long long, unsigned long long>>> per_sm(1024);
  for (int b = 0; b < FWD_TRACE_SLOTS; ++b) {
    const unsigned long long* t = &h[b * 8];
    if (t[0] == 0 || t[3] == 0 || t[4] == 0 || t[5] == 0) continue;
    ++n;
    const double d = double(t[5] - t[0]);
    issue += double(t[2] - t[0]);
    landed += double(t[3] - t[0]);
    loop += double(t[4] - t[3]);
    epi += double(t[5] - t[4]);
    total += d;
    blocks += double(t[6]);
    sxx += double(t[6]) * double(t[6]);
    sxy += double(t[6]) * d;
    if (t[1] < per_sm.size()) per_sm[t[1]].push_back({t[0], t[5]});
  }
  if (n == 0) {
    std::printf("trace %s: no CTA visited a key block\n", label);
    return;
  }
  const double den = n * sxx - blocks * blocks;
  const double slope = den != 0 ? (n * sxy - blocks * total) / den : 0.0;
  const double intercept = (total - slope * blocks) / n;
  double gaps = 0;
  int ngaps = 0;
  for (auto& v : per_sm) {
    std::sort(v.begin(), v.end());
    for (size_t i = 1; i < v.size(); ++i) {
      gaps += double(static_cast<long long>(v[i].first - v[i - 1].second));
      ++ngaps;
    }
  }
  std::printf(
      "trace %-34s ctas %d blocks/cta %.2f | cycles/cta: first K issued %.0f, first K landed "
      "%.0f, loop %.0f (%.0f/block), epilogue %.0f, total %.0f | fit %.0f + %.0f/block | mean "
      "gap between CTAs on an SM %.0f\n",
      label, n, blocks / n, issue / n, landed / n, loop / n, loop / blocks, epi / n, total / n,
      intercept, slope, ngaps ? gaps / ngaps : 0.0);
  std::fill(h.begin(), h.end(), 0ull);
  cudaMemcpyToSymbol(g_fwd_trace, h.data(), h.size() * 8);
}
"""


def main() -> None:
    instrument_forward(__doc__.splitlines()[0], MARKS, KERNEL_PATCHES, DUMP, "fwd_trace_dump")


if __name__ == "__main__":
    main()
