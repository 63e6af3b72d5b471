"""Per-turn trace of the wgmma forward's key-block loop, in a scratch copy of the kernel and driver.

Copies cpp/ and tools/wgmma_check.cu into DEST and adds clock64 marks, taken by thread 0 of each
consumer warpgroup, to every iteration of the steady-state key-block loop of the copy of
cpp/cuda/fwd_wgmma.cuh (the loop that issues QK^T of block i and P V of block i - 1 in one turn).
The copy's driver prints, after every timed cell, per consumer warpgroup and over the iterations
of the last launch's first CTAs, the mean cycles of each step of an iteration:
  k wait    waiting for K of block i to land;
  turn      waiting for the warpgroup's turn (ping-pong; 0 where the head dim takes no turns);
  qk+v      issuing QK^T, rescaling O, waiting for V of block i - 1;
  pv+hand   issuing P V and handing the turn on;
  s wait    waiting for S (QK^T) to complete;
  softmax   masking and the online softmax of block i;
  pv wait   waiting for P V of block i - 1 to complete;
  convert   P to 16 bits and the loop's own instructions, up to the next iteration.
This is where a loop that executes the same instructions as another spends its extra time
(docs/PERF_LOG.md, the forward beside FlashAttention-3's under Nsight Compute). The marks cost a
few stores per iteration; the traced build's timings are not the kernel's.

With the persistent forward (rows of at most 2048 keys) a CTA runs many tiles and its slots hold
its last tile's iterations: trace such cells with JAX_FLASH_FWD_PERSISTENT=0.

The patches are plain text replacements of the kernel's source: when the kernel changes, the
script stops with the text it could not find.

Usage: python3 tools/fwd_turn_trace.py DEST, then in DEST
  nvcc -std=c++17 -O3 -I cpp -gencode=arch=compute_90a,code=sm_90a -DJAX_FLASH_BUILT_SM90A=1
       tools/wgmma_check.cu cpp/cuda/fwd_wgmma.cu cpp/cuda/sm90_host.cu -o fwd_turns
and on an sm_90 GPU: ./fwd_turns --time
"""

from instrumented_copy import instrument_forward

# Slots: [CTA < FWD_TURN_CTAS][consumer warpgroup < 4][iteration < FWD_TURN_STEPS][mark < 8].
MARKS = """
#define FWD_TURN_CTAS 512
#define FWD_TURN_STEPS 64
__device__ unsigned long long g_fwd_turn[FWD_TURN_CTAS * 4 * FWD_TURN_STEPS * 8];
#define FWD_TURN_MARK(k)                                                                     \\
  do {                                                                                       \\
    if (tid == 0 && blockIdx.x < FWD_TURN_CTAS && it < FWD_TURN_STEPS) {                     \\
      g_fwd_turn[((blockIdx.x * 4 + cw) * FWD_TURN_STEPS + it) * 8 + (k)] = clock64();       \\
    }                                                                                        \\
  } while (0)
"""

KERNEL_PATCHES = [
    (
        "          for (; next >= wg_first; ++it) {\n            nb = next;\n",
        "          for (; next >= wg_first; ++it) {\n            nb = next;\n"
        "            FWD_TURN_MARK(0);\n",
    ),
    (
        "            mbar_wait(bars.k_full(stage), phase_of(it));\n"
        "            turn_begin(false);\n",
        "            mbar_wait(bars.k_full(stage), phase_of(it));\n"
        "            FWD_TURN_MARK(1);\n"
        "            turn_begin(false);\n"
        "            FWD_TURN_MARK(2);\n",
    ),
    (
        "            mbar_wait(bars.v_full(prev), phase_of(it - 1));\n"
        "            wgmma_fence();\n"
        "            issue_pv<Tr>(o, p, v_desc(prev));\n"
        "            wgmma_commit();\n"
        "            turn_end(false);\n",
        "            mbar_wait(bars.v_full(prev), phase_of(it - 1));\n"
        "            FWD_TURN_MARK(3);\n"
        "            wgmma_fence();\n"
        "            issue_pv<Tr>(o, p, v_desc(prev));\n"
        "            wgmma_commit();\n"
        "            turn_end(false);\n"
        "            FWD_TURN_MARK(4);\n",
    ),
    (
        "            wgmma_wait<1>();  // S of block it is complete;",
        "            wgmma_wait<1>();\n"
        "            FWD_TURN_MARK(5);  // S of block it is complete;",
    ),
    (
        "            softmax_block(nb * kBlockN, mixed);\n            wgmma_wait<0>();\n",
        "            softmax_block(nb * kBlockN, mixed);\n            FWD_TURN_MARK(6);\n"
        "            wgmma_wait<0>();\n            FWD_TURN_MARK(7);\n",
    ),
]

DUMP = r"""
#include <algorithm>
#include <cstdio>
#include <vector>

// Step means per consumer warpgroup over the recorded iterations of the last launch; clears the
// trace. An iteration counts when all its marks and the next iteration's first are recorded.
void fwd_turn_dump(const char* label) {
  using jax_flash::cuda::sm90::g_fwd_turn;
  constexpr int kSteps = FWD_TURN_STEPS;
  std::vector<unsigned long long> h(size_t{FWD_TURN_CTAS} * 4 * kSteps * 8);
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyFromSymbol(h.data(), g_fwd_turn, h.size() * 8) != cudaSuccess) {
    std::printf("turns %s: copy failed\n", label);
    return;
  }
  static const char* const kNames[8] = {"k wait",  "turn",    "qk+v",    "pv+hand",
                                        "s wait",  "softmax", "pv wait", "convert"};
  for (int cw = 0; cw < 4; ++cw) {
    double sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    long n = 0;
    for (int b = 0; b < FWD_TURN_CTAS; ++b) {
      const unsigned long long* row = &h[(static_cast<size_t>(b) * 4 + cw) * kSteps * 8];
      for (int it = 0; it + 1 < kSteps; ++it) {
        const unsigned long long* t = row + it * 8;
        const unsigned long long next = row[(it + 1) * 8];
        bool ok = next > t[7];
        for (int k = 0; k < 8 && ok; ++k) ok = t[k] != 0 && (k == 0 || t[k] >= t[k - 1]);
        if (!ok) continue;
        for (int k = 0; k < 7; ++k) sum[k] += double(t[k + 1] - t[k]);
        sum[7] += double(next - t[7]);
        ++n;
      }
    }
    if (n == 0) continue;
    double total = 0;
    for (double v : sum) total += v;
    std::printf("turns %-34s wg %d iterations %ld | cycles/iteration %.0f:", label, cw, n,
                total / n);
    for (int k = 0; k < 8; ++k) std::printf(" %s %.0f", kNames[k], sum[k] / n);
    std::printf("\n");
  }
  std::fill(h.begin(), h.end(), 0ull);
  cudaMemcpyToSymbol(g_fwd_turn, h.data(), h.size() * 8);
}
"""


def main() -> None:
    instrument_forward(__doc__.splitlines()[0], MARKS, KERNEL_PATCHES, DUMP, "fwd_turn_dump")


if __name__ == "__main__":
    main()
