// The summaries of a segment-id call's ids that every CUDA kernel reads (common/mask.h
// kSegmentRecord chunk records, common/schedule.h SeqLayout::runs), computed on the device in one
// launch: one CTA per batch row, one thread per chunk of kSegmentChunk positions, block-wide scans
// for the reaches and the run count. XLA computes the same summaries with about a dozen small
// kernels, cumulative reductions among them, whose launches cost more than the attention kernel's
// own start-up on a 16k row.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "common/mask.h"
#include "common/schedule.h"
#include "cuda/segment_summaries.h"

namespace jax_flash::cuda {
namespace {

constexpr int kThreads = 1024;  // chunks per pass: kThreads * kSegmentChunk positions
constexpr int kWarps = kThreads / 32;
constexpr int kScratch = 2 * kWarps + 1;  // block_scan's shared memory

struct MinOp {
  __device__ int operator()(int a, int b) const { return a < b ? a : b; }
};
struct MaxOp {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};
struct AddOp {
  __device__ int operator()(int a, int b) const { return a + b; }
};

// Inclusive scan of x over the block's threads in thread order (kReverse: from the last thread
// down), combined with `carry` (the scan of the earlier passes); every thread gets its value, and
// `total` the scan over all threads with the carry. Each warp scans its lanes, warp 0 the warps'
// totals. `scratch` holds kScratch ints; the call begins and ends with a barrier, so consecutive
// scans may share it.
template <bool kReverse, class Op>
__device__ int block_scan(int x, int carry, Op op, int* scratch, int& total) {
  static_assert(kWarps == 32, "warp 0 scans one total a lane");
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  auto warp_scan = [&](int v) {
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int y = kReverse ? __shfl_down_sync(kAll, v, d) : __shfl_up_sync(kAll, v, d);
      if (kReverse ? lane + d < 32 : lane >= d) v = op(v, y);
    }
    return v;
  };
  x = warp_scan(x);
  __syncthreads();
  if (lane == (kReverse ? 0 : 31)) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const int s = warp_scan(scratch[lane]);
    const int earlier = kReverse ? __shfl_down_sync(kAll, s, 1) : __shfl_up_sync(kAll, s, 1);
    const bool first = kReverse ? lane == 31 : lane == 0;
    scratch[kWarps + lane] = first ? carry : op(carry, earlier);
    if (lane == (kReverse ? 0 : 31)) scratch[2 * kWarps] = op(carry, s);
  }
  __syncthreads();
  total = scratch[2 * kWarps];
  return op(scratch[kWarps + warp], x);
}

// What one thread learns of its chunk of ids.
struct ChunkSummary {
  int lo = INT_MAX, hi = INT_MIN;  // the chunk's (min, max) id
  uint32_t starts = 0;   // kRuns: bit i set where position i of the chunk (> 0) starts a query run
  bool differs = false;  // kRuns: a key id differs from the query id at the same position
};

// The chunks of a warp's threads, chunk0 + lane for lane 0..31 (chunks outside [0, chunks) keep
// the identity (INT_MAX, INT_MIN), which widens no range). The warp reads its 32 * kSegmentChunk
// positions 32 at a time, lane l position 32i + l in step i, so that each load instruction is one
// 128-byte line: steps i covers chunks 2i (lanes 0-15) and 2i + 1 (lanes 16-31), reduced across
// the half-warps and handed to lanes 2i and 2i + 1. One chunk a thread read by the thread itself
// (16 loads 64 bytes apart across the warp) took ~20 us for a 16k row on an H200 SM.
template <bool kRuns>
__device__ ChunkSummary summarize_chunks(const int32_t* ids, const int32_t* q_ids, int64_t seqlen,
                                         int64_t chunks, int64_t chunk0) {
  static_assert(kSegmentChunk == 16, "a step reads two chunks");
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t base = chunk0 * kSegmentChunk;
  auto clamp = [&](int64_t pos) { return pos < 0 ? 0 : (pos < seqlen ? pos : seqlen - 1); };
  ChunkSummary mine;
  // The query id before the warp's first position (the first position itself at the row start,
  // which then starts no run).
  int32_t prev = kRuns ? q_ids[clamp(base - 1)] : 0;
  // Every load first, so that the warp waits for memory once: the loop below would otherwise issue
  // each step's load after the previous step's shuffles.
  int32_t id_of[16], qid_of[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    id_of[i] = ids[clamp(base + 32 * i + lane)];
    if (kRuns) qid_of[i] = q_ids[clamp(base + 32 * i + lane)];
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int64_t pos = base + 32 * i + lane;
    const int32_t id = id_of[i];
    int lo = id, hi = id;
#pragma unroll
    for (int d = 1; d < 16; d *= 2) {
      lo = min(lo, __shfl_xor_sync(kAll, lo, d));
      hi = max(hi, __shfl_xor_sync(kAll, hi, d));
    }
    const int half = (lane & 1) * 16;  // the half-warp that holds lane 2i + (lane & 1)'s chunk
    lo = __shfl_sync(kAll, lo, half);
    hi = __shfl_sync(kAll, hi, half);
    const bool owner = lane / 2 == i;
    if (owner) {
      mine.lo = lo;
      mine.hi = hi;
    }
    if (kRuns) {
      const int32_t qid = qid_of[i];
      const int32_t up = __shfl_up_sync(kAll, qid, 1);
      const int32_t before = lane == 0 ? prev : up;
      prev = __shfl_sync(kAll, qid, 31);
      const bool inside = pos < seqlen;
      const uint32_t start = __ballot_sync(kAll, inside && qid != before);
      const uint32_t differ = __ballot_sync(kAll, inside && qid != id);
      if (owner) {
        mine.starts = (start >> half) & 0xffffu;
        mine.differs = ((differ >> half) & 0xffffu) != 0u;
      }
    }
  }
  const int64_t c = chunk0 + lane;
  if (c < 0 || c >= chunks) mine = ChunkSummary{};
  return mine;
}

// One batch row. Positions past a row's end repeat its last id (which widens no range), as the
// Python definition pads.
__global__ void __launch_bounds__(kThreads) segment_summaries_kernel(const SegmentSummaryParams p) {
  __shared__ int scratch[kScratch];
  const int64_t b = blockIdx.x;
  const int32_t* const q_ids = p.q_ids + b * p.seqlen_q;
  const int32_t* const kv_ids = p.kv_ids + b * p.seqlen_k;
  int32_t* const q_rec = p.q_ranges + b * segment_chunks(p.seqlen_q) * kSegmentRecord;
  int32_t* const kv_rec = p.kv_ranges + b * segment_chunks(p.seqlen_k) * kSegmentRecord;
  const bool runs = p.runs != nullptr;
  int32_t* const run_row = runs ? p.runs + b * p.runs_per_row : nullptr;

  // Key ids, first to last: each chunk's (min, max) and the prefix reach. With runs (seqlen_q ==
  // seqlen_k), also where the query ids' runs start and whether the key ids differ from them.
  const int64_t kv_chunks = segment_chunks(p.seqlen_k);
  int reach_lo = INT_MAX, reach_hi = INT_MIN, run_count = 0;
  bool differs = false;
  for (int64_t c0 = 0; c0 < kv_chunks; c0 += kThreads) {
    const int64_t c = c0 + threadIdx.x;
    const int64_t warp0 = c - static_cast<int64_t>(threadIdx.x % 32);
    const ChunkSummary cs =
        runs ? summarize_chunks<true>(kv_ids, q_ids, p.seqlen_k, kv_chunks, warp0)
             : summarize_chunks<false>(kv_ids, q_ids, p.seqlen_k, kv_chunks, warp0);
    const int lo = cs.lo, hi = cs.hi;
    uint32_t starts = cs.starts;  // bit i: position 16c + i (> 0) starts a run of the query ids
    differs = differs || cs.differs;
    int all_lo, all_hi, all_runs;
    const int pre_lo = block_scan<false>(lo, reach_lo, MinOp{}, scratch, all_lo);
    const int pre_hi = block_scan<false>(hi, reach_hi, MaxOp{}, scratch, all_hi);
    if (c < kv_chunks) {
      *reinterpret_cast<int4*>(kv_rec + c * kSegmentRecord) = make_int4(lo, hi, pre_lo, pre_hi);
    }
    reach_lo = all_lo;
    reach_hi = all_hi;
    if (runs) {
      const int mine = __popc(starts);
      // Run index of this chunk's first start: 1 + the starts before it.
      int after = block_scan<false>(mine, run_count, AddOp{}, scratch, all_runs) - mine + 1;
      for (; starts != 0u; starts &= starts - 1u, ++after) {
        if (after < p.runs_per_row) {
          run_row[after] = static_cast<int32_t>(c * kSegmentChunk + __ffs(starts) - 1);
        }
      }
      run_count = all_runs;
    }
  }

  // Query ids, last to first: each chunk's (min, max) and the suffix reach.
  const int64_t q_chunks = segment_chunks(p.seqlen_q);
  reach_lo = INT_MAX;
  reach_hi = INT_MIN;
  for (int64_t top = q_chunks; top > 0; top -= kThreads) {
    const int64_t c = top - kThreads + static_cast<int64_t>(threadIdx.x);
    const ChunkSummary cs = summarize_chunks<false>(q_ids, q_ids, p.seqlen_q, q_chunks,
                                                    c - static_cast<int64_t>(threadIdx.x % 32));
    const int lo = cs.lo, hi = cs.hi;
    int all_lo, all_hi;
    const int suf_lo = block_scan<true>(lo, reach_lo, MinOp{}, scratch, all_lo);
    const int suf_hi = block_scan<true>(hi, reach_hi, MaxOp{}, scratch, all_hi);
    if (c >= 0) {
      *reinterpret_cast<int4*>(q_rec + c * kSegmentRecord) = make_int4(lo, hi, suf_lo, suf_hi);
    }
    reach_lo = all_lo;
    reach_hi = all_hi;
  }

  if (!runs) return;
  const bool any_differs = __syncthreads_or(differs) != 0;
  // Run j's first position for the runs the row has, seqlen past them; then entry 0: whether the
  // row's runs are documents (every id one run, at most runs_per_row runs, equal key ids). The
  // starts written above are visible to the block after the barrier.
  const int count = run_count + 1;
  const int r = static_cast<int>(p.runs_per_row);
  for (int j = static_cast<int>(threadIdx.x); j < r; j += kThreads) {
    if (j >= count && j > 0) run_row[j] = static_cast<int32_t>(p.seqlen_q);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    const int known = count < r ? count : r;
    int32_t id = 0;
    if (lane < known) id = q_ids[lane == 0 ? 0 : run_row[lane]];
    bool repeated = false;
    for (int other = 0; other < known; ++other) {
      const int32_t o = __shfl_sync(0xffffffffu, id, other);
      repeated = repeated || (lane < known && other != lane && o == id);
    }
    const bool documents = count <= r && __ballot_sync(0xffffffffu, repeated) == 0u && !any_differs;
    if (lane == 0) run_row[0] = documents ? 1 : 0;
  }
}

}  // namespace

cudaError_t segment_summaries(const SegmentSummaryParams& p, cudaStream_t stream) {
  if (p.batch < 0 || p.seqlen_q < 1 || p.seqlen_k < 1 || p.batch > INT_MAX) {
    return p.batch == 0 ? cudaSuccess : cudaErrorInvalidValue;
  }
  if (p.runs != nullptr &&
      (p.seqlen_q != p.seqlen_k || p.runs_per_row < 1 || p.runs_per_row > kMaxRunsPerRow)) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  segment_summaries_kernel<<<static_cast<unsigned>(p.batch), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda
