"""Per-block timeline of the decode call's TMA split pass and merge pass, in a scratch copy of the
kernels and of tools/decode_check.cu.

Copies cpp/ and tools/decode_check.cu into DEST and adds marks to the copies of
cpp/cuda/decode_tma.cuh and cpp/cuda/decode_merge.cuh: for every split-pass block, %globaltimer
(ns, comparable across SMs) at entry and after its epilogue, and clock64 (cycles of its SM) at
entry, when the queries are in shared memory, when math warp 0 finds each of the first 12 key
tiles landed, and around the epilogue; for every merge block, %globaltimer at entry, when its
wait for the split pass returns and when it is done. After each `--bench` row the copy's driver
prints, for the last launch of that row: the spread of the blocks' entries, the mean cycles of
each phase, the mean interval between landed tiles, the split pass's span, and, relative to the
last split block's end, when the last merge block entered, when the merge blocks got past their
wait (first and last) and when the last finished, with the mean and longest time a merge block
took from its wait to its end. The marks cost a few stores per
block; the traced build's timings are not the kernels' timings.

The patches are plain text replacements: when the kernels change, the script stops with the text
it could not find.

Usage: python3 tools/decode_cta_trace.py DEST, then in DEST
  nvcc -std=c++17 -O3 -I cpp -gencode=arch=compute_90a,code=sm_90a -DJAX_FLASH_BUILT_SM90A=1
       tools/decode_check.cu cpp/cuda/decode.cu cpp/cuda/sm90_host.cu -o decode_trace
and on an sm_90 GPU: ./decode_trace --bench 1 8192
"""

from instrumented_copy import append, patch, scratch_copy

# Split-pass slots per block (kSlots): 0 globaltimer at entry, 1 clock64 at entry, 2 SM id,
# 3..14 clock64 when tile 0..11 was found landed, 15 clock64 before the epilogue, 16 after it,
# 17 globaltimer after it, 18 tiles, 19 clock64 with the queries in shared memory.
# Merge slots per block: 0 globaltimer past the wait, 1 globaltimer at the end, 2 at entry.
MARKS = """
#define DEC_TRACE_BLOCKS 4096
#define DEC_SLOTS 24
__device__ unsigned long long g_dec_trace[DEC_TRACE_BLOCKS * DEC_SLOTS];
__device__ unsigned long long g_merge_trace[DEC_TRACE_BLOCKS * 3];
__device__ __forceinline__ unsigned long long dec_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define DEC_PUT(i, v)                                                                  \\
  do {                                                                                 \\
    if (blockIdx.x < DEC_TRACE_BLOCKS) g_dec_trace[blockIdx.x * DEC_SLOTS + (i)] = (v); \\
  } while (0)
#define DEC_MARK(i) DEC_PUT(i, clock64())
#define MERGE_PUT(i, v)                                                                \\
  do {                                                                                 \\
    if (blockIdx.x < DEC_TRACE_BLOCKS) g_merge_trace[blockIdx.x * 3 + (i)] = (v);       \\
  } while (0)
"""

# The merge pass's lse store, the last thing its second (live) pass does.
LSE_STORE = (
    "      if (col == 0) static_cast<S*>(p.lse)[row] = none ? neg_inf : m + simt::log_full(sum);\n"
)

MERGE_PATCHES = [
    (
        "namespace jax_flash::cuda::decode {\n",
        "namespace jax_flash::cuda::decode {\n" + MARKS,
    ),
    (
        "#pragma unroll 1\n  for (int round = kFirstRound; round < 2; ++round) {\n",
        "  if (threadIdx.x == 0) MERGE_PUT(2, dec_globaltimer());\n"
        "#pragma unroll 1\n  for (int round = kFirstRound; round < 2; ++round) {\n",
    ),
    (
        "    if (live) wait_for_primary();\n",
        "    if (live) wait_for_primary();\n"
        "    if (live && threadIdx.x == 0) MERGE_PUT(0, dec_globaltimer());\n",
    ),
    (
        LSE_STORE,
        LSE_STORE + "      if (threadIdx.x == 0) MERGE_PUT(1, dec_globaltimer());\n",
    ),
]

TMA_PATCHES = [
    (
        "  const BlockWork w = block_work<Tr>(p, a);\n",
        "  if (tid == 0) {\n"
        "    DEC_PUT(0, dec_globaltimer());\n"
        "    DEC_MARK(1);\n"
        "    unsigned sm;\n"
        '    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));\n'
        "    DEC_PUT(2, sm);\n"
        "    for (int z = 3; z < DEC_SLOTS; ++z) DEC_PUT(z, 0);\n"
        "  }\n"
        "  const BlockWork w = block_work<Tr>(p, a);\n",
    ),
    (
        "  sm90::named_barrier_sync(kMathBarrier, Tr::kNThreads);\n\n  WarpState<Tr> st;",
        "  sm90::named_barrier_sync(kMathBarrier, Tr::kNThreads);\n"
        "  if (tid == 0) DEC_MARK(19);\n\n  WarpState<Tr> st;",
    ),
    (
        "      mbar_wait(full0 + 8 * stage, phase);\n",
        "      mbar_wait(full0 + 8 * stage, phase);\n"
        "      if (tid == 0 && t < 12) DEC_MARK(3 + t);\n",
    ),
    (
        "  st.finish(p, a, w, smem_stats, reinterpret_cast<float*>(ring), tid,\n"
        "            [] { sm90::named_barrier_sync(kMathBarrier, Tr::kNThreads); });\n",
        "  if (tid == 0) {\n    DEC_MARK(15);\n    DEC_PUT(18, n_tiles);\n  }\n"
        "  st.finish(p, a, w, smem_stats, reinterpret_cast<float*>(ring), tid,\n"
        "            [] { sm90::named_barrier_sync(kMathBarrier, Tr::kNThreads); });\n"
        "  if (tid == 0) {\n    DEC_MARK(16);\n    DEC_PUT(17, dec_globaltimer());\n  }\n",
    ),
]

DUMP = r"""
#include <algorithm>
#include <cstdio>
#include <set>
#include <vector>

// The last launch's timeline (see tools/decode_cta_trace.py); clears the trace.
void decode_trace_dump(long long splits) {
  using jax_flash::cuda::decode::g_dec_trace;
  using jax_flash::cuda::decode::g_merge_trace;
  std::vector<unsigned long long> h(DEC_TRACE_BLOCKS * DEC_SLOTS), g(DEC_TRACE_BLOCKS * 3);
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyFromSymbol(h.data(), g_dec_trace, h.size() * 8) != cudaSuccess ||
      cudaMemcpyFromSymbol(g.data(), g_merge_trace, g.size() * 8) != cudaSuccess) {
    std::printf("    trace: copy failed\n");
    return;
  }
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  const double ns_per_cycle = clock_khz > 0 ? 1e6 / clock_khz : 0.0;
  int n = 0;
  double q = 0, first = 0, gap = 0, epi = 0, total = 0, tiles = 0;
  int gaps = 0;
  unsigned long long entry_min = ~0ull, entry_max = 0, exit_max = 0;
  std::set<unsigned long long> sms;
  for (int b = 0; b < DEC_TRACE_BLOCKS; ++b) {
    const unsigned long long* t = &h[b * DEC_SLOTS];
    if (t[0] == 0 || t[17] == 0 || t[18] == 0 || t[3] == 0) continue;
    ++n;
    sms.insert(t[2]);
    entry_min = std::min(entry_min, t[0]);
    entry_max = std::max(entry_max, t[0]);
    exit_max = std::max(exit_max, t[17]);
    q += double(t[19] - t[1]);
    first += double(t[3] - t[1]);
    const int landed = static_cast<int>(std::min<unsigned long long>(t[18], 12));
    if (landed > 1) {
      gap += double(t[3 + landed - 1] - t[3]) / (landed - 1);
      ++gaps;
    }
    epi += double(t[16] - t[15]);
    total += double(t[16] - t[1]);
    tiles += double(t[18]);
  }
  if (n == 0) {
    std::printf("    trace: no traced split block\n");
    return;
  }
  unsigned long long merge_wait_min = ~0ull, merge_wait_max = 0, merge_end_max = 0;
  unsigned long long merge_entry_max = 0;
  double merge_run = 0, merge_run_max = 0;
  int merges = 0;
  for (int b = 0; b < DEC_TRACE_BLOCKS; ++b) {
    const unsigned long long* m = &g[3 * b];
    if (m[0] == 0 || m[1] == 0 || m[2] == 0) continue;
    ++merges;
    merge_wait_min = std::min(merge_wait_min, m[0]);
    merge_wait_max = std::max(merge_wait_max, m[0]);
    merge_end_max = std::max(merge_end_max, m[1]);
    merge_entry_max = std::max(merge_entry_max, m[2]);
    merge_run += double(m[1] - m[0]);
    merge_run_max = std::max(merge_run_max, double(m[1] - m[0]));
  }
  std::printf(
      "    trace splits=%lld: %d blocks on %zu SMs, %.1f tiles each | entries spread %.0f ns | "
      "cycles a block: queries in smem %.0f, tile 0 landed %.0f, then a tile every %.0f, "
      "epilogue %.0f, total %.0f (%.0f ns) | split span %.0f ns",
      splits, n, sms.size(), tiles / n, double(entry_max - entry_min), q / n, first / n,
      gaps ? gap / gaps : 0.0, epi / n, total / n, total / n * ns_per_cycle,
      double(exit_max - entry_min));
  if (merges > 0) {
    std::printf(" | merge (%d blocks): last entered %+.0f ns, past its wait %+.0f..%+.0f ns, done "
                "%+.0f ns after the last split block; wait to done %.0f ns mean, %.0f max",
                merges, double(static_cast<long long>(merge_entry_max - exit_max)),
                double(static_cast<long long>(merge_wait_min - exit_max)),
                double(static_cast<long long>(merge_wait_max - exit_max)),
                double(static_cast<long long>(merge_end_max - exit_max)), merge_run / merges,
                merge_run_max);
  }
  std::printf("\n");
  std::fill(h.begin(), h.end(), 0ull);
  std::fill(g.begin(), g.end(), 0ull);
  cudaMemcpyToSymbol(g_dec_trace, h.data(), h.size() * 8);
  cudaMemcpyToSymbol(g_merge_trace, g.data(), g.size() * 8);
}
"""

DRIVER_PATCHES = [
    ("namespace {", "void decode_trace_dump(long long splits);\nnamespace {"),
    (
        "              bytes / t / 1e12);\n",
        "              bytes / t / 1e12);\n"
        "          decode_trace_dump(static_cast<long long>(splits));\n",
    ),
]


def main() -> None:
    dest = scratch_copy(__doc__.splitlines()[0], ("decode_check.cu", "cuda_check.h"))
    patch(dest / "cpp/cuda/decode_merge.cuh", MERGE_PATCHES)
    patch(dest / "cpp/cuda/decode_tma.cuh", TMA_PATCHES)
    append(dest / "cpp/cuda/decode.cu", DUMP)
    patch(dest / "tools/decode_check.cu", DRIVER_PATCHES)
    print(f"instrumented copy in {dest}")


if __name__ == "__main__":
    main()
