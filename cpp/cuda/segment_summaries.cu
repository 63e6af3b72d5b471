// The summaries of a segment-id call's ids that every CUDA kernel reads (common/mask.h
// kSegmentRecord chunk records, common/schedule.h SeqLayout::runs), computed on the device in one
// launch: one CTA per batch row, one thread per chunk of kSegmentChunk positions (staged through
// shared memory), block-wide scans for the reaches and the run count. XLA computes the same
// summaries with about a dozen small kernels, cumulative reductions among them, whose launches cost
// more than the attention kernel's own start-up on a 16k row.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "common/mask.h"
#include "common/schedule.h"
#include "cuda/grid_dependency.cuh"
#include "cuda/segment_summaries.h"

namespace jax_flash::cuda {
namespace {

// Chunks per pass: kThreads * kSegmentChunk positions. 512 threads leave a thread the registers
// for its 16 staging loads in flight (1024 threads, 64 registers each, spilled them).
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kScratch = 2 * kWarps + 1;  // block_scan's shared memory

struct MinOp {
  static constexpr int kIdentity = INT_MAX;
  __device__ int operator()(int a, int b) const { return a < b ? a : b; }
};
struct MaxOp {
  static constexpr int kIdentity = INT_MIN;
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};
struct AddOp {
  static constexpr int kIdentity = 0;
  __device__ int operator()(int a, int b) const { return a + b; }
};

// Inclusive scan of x over the block's threads in thread order (kReverse: from the last thread
// down), combined with `carry` (the scan of the earlier passes); every thread gets its value, and
// `total` the scan over all threads with the carry. Each warp scans its lanes, warp 0 the warps'
// totals. `scratch` holds kScratch ints; the call begins and ends with a barrier, so consecutive
// scans may share it.
template <bool kReverse, class Op>
__device__ int block_scan(int x, int carry, Op op, int* scratch, int& total) {
  static_assert(kWarps <= 32, "warp 0 scans one total a lane");
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
    // Lanes past the warps hold the identity.
    const int s = warp_scan(lane < kWarps ? scratch[lane] : Op::kIdentity);
    const int earlier = kReverse ? __shfl_down_sync(kAll, s, 1) : __shfl_up_sync(kAll, s, 1);
    const bool first = kReverse ? lane == kWarps - 1 : lane == 0;
    if (lane < kWarps) scratch[kWarps + lane] = first ? carry : op(carry, earlier);
    if (lane == (kReverse ? 0 : kWarps - 1)) scratch[2 * kWarps] = op(carry, s);
  }
  __syncthreads();
  total = scratch[2 * kWarps];
  return op(scratch[kWarps + warp], x);
}

// What one thread learns of its chunk of ids.
struct ChunkSummary {
  int lo = INT_MAX, hi = INT_MIN;      // the chunk's (min, max) id
  int q_lo = INT_MAX, q_hi = INT_MIN;  // kRuns: the same of the query ids
  uint32_t starts = 0;   // kRuns: bit i set where position i of the chunk (> 0) starts a query run
  bool differs = false;  // kRuns: a key id differs from the query id at a position the lane staged
};

// Each warp stages its 32 chunks of ids in its own kWarpSmemWords of shared memory: loaded 32
// positions at a time (one 128-byte line an instruction), stored with one pad word after every
// chunk, so that the lanes then read their own chunks (17 words apart) without bank conflicts and
// each thread works on its 16 ids alone. On an H200 a 16k row took ~20 us with each thread reading
// its own chunk from global memory (16 dependent loads, 64 bytes apart across the warp) and ~13 us
// with the warp reducing each 32 positions by shuffles (the instructions of 32 warps on one SM).
constexpr int kChunkWords = kSegmentChunk + 1;
constexpr int kWarpSmemWords = 32 * kChunkWords;

// Positions [base, base + 512) of `ids` (clamped to the row: positions past its end repeat the
// last id, before its start the first) into the warp's buffer `buf`. kCompare: whether any of
// them inside the row differs from what `buf` held at the same position (the key ids staged
// before the query ids).
template <bool kCompare>
__device__ __forceinline__ bool stage_warp(const int32_t* ids, int seqlen, int base, int32_t* buf) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const bool inside_row = base >= 0 && base + 32 * kSegmentChunk <= seqlen;
  int32_t v[kSegmentChunk];
#pragma unroll
  for (int i = 0; i < kSegmentChunk; ++i) {
    const int pos = base + 32 * i + lane;
    v[i] = ids[inside_row ? pos : (pos < 0 ? 0 : (pos < seqlen ? pos : seqlen - 1))];
  }
  __syncwarp();  // the lanes' reads of the previous contents are done
  bool differs = false;
#pragma unroll
  for (int i = 0; i < kSegmentChunk; ++i) {
    const int local = 32 * i + lane;
    int32_t& slot = buf[local + local / kSegmentChunk];
    if (kCompare) differs |= (base + local < seqlen) & (slot != v[i]);
    slot = v[i];
  }
  __syncwarp();
  return differs;
}

// The chunks chunk0 + lane of a warp (chunks outside [0, chunks) keep the identity (INT_MAX,
// INT_MIN), which widens no range). kRuns: `q_ids` are staged after `ids` (the same length).
template <bool kRuns>
__device__ ChunkSummary summarize_chunks(const int32_t* ids, const int32_t* q_ids, int seqlen,
                                         int chunks, int chunk0, int32_t* buf) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int base = chunk0 * kSegmentChunk;
  ChunkSummary mine;
  stage_warp<false>(ids, seqlen, base, buf);
#pragma unroll
  for (int k = 0; k < kSegmentChunk; ++k) {
    const int32_t id = buf[kChunkWords * lane + k];
    mine.lo = min(mine.lo, id);
    mine.hi = max(mine.hi, id);
  }
  if (kRuns) {
    // The query id before the chunk's first position: the previous lane's last, for lane 0 the
    // one before the warp's positions (the first position itself at the row start, which then
    // starts no run).
    const int before = base - 1;
    const int32_t first_prev = q_ids[before < 0 ? 0 : (before < seqlen ? before : seqlen - 1)];
    // differs is the lane's over the positions it staged, not its chunk's: only the row's OR is
    // used.
    mine.differs = stage_warp<true>(q_ids, seqlen, base, buf);
    int32_t prev = lane == 0 ? first_prev : buf[kChunkWords * lane - 2];
    const int pos0 = (chunk0 + lane) * kSegmentChunk;
#pragma unroll
    for (int k = 0; k < kSegmentChunk; ++k) {
      const int32_t q = buf[kChunkWords * lane + k];
      const bool inside = pos0 + k < seqlen;
      mine.starts |= static_cast<uint32_t>(inside & (q != prev)) << k;
      mine.q_lo = min(mine.q_lo, q);
      mine.q_hi = max(mine.q_hi, q);
      prev = q;
    }
  }
  // A lane past the row's chunks keeps its differs: the positions it staged are not its chunk's.
  const int c = chunk0 + lane;
  if (c < 0 || c >= chunks) {
    const bool differs = mine.differs;
    mine = ChunkSummary{};
    mine.differs = differs;
  }
  return mine;
}

// One batch row. Positions past a row's end repeat its last id (which widens no range), as the
// Python definition pads.
__global__ void __launch_bounds__(kThreads) segment_summaries_kernel(const SegmentSummaryParams p) {
  // The wgmma forward's segment-id kernel, launched next as this grid's programmatic dependent,
  // may start its CTAs on the other SMs now; they wait for this grid's end before reading.
  allow_dependents();
  __shared__ int scratch[kScratch];
  __shared__ int32_t staged[kWarps * kWarpSmemWords];
  int32_t* const buf = staged + (threadIdx.x / 32) * kWarpSmemWords;
  const int64_t b = blockIdx.x;
  const int32_t* const q_ids = p.q_ids + b * p.seqlen_q;
  const int32_t* const kv_ids = p.kv_ids + b * p.seqlen_k;
  int32_t* const q_rec = p.q_ranges + b * segment_chunks(p.seqlen_q) * kSegmentRecord;
  int32_t* const kv_rec = p.kv_ranges + b * segment_chunks(p.seqlen_k) * kSegmentRecord;
  const bool runs = p.runs != nullptr;
  int32_t* const run_row = runs ? p.runs + b * p.runs_per_row : nullptr;

  // Key ids, first to last: each chunk's (min, max) and the prefix reach. With runs (seqlen_q ==
  // seqlen_k), also where the query ids' runs start and whether the key ids differ from them.
  // Positions fit an int (segment_summaries checks), so the index math is 32-bit.
  const int seqlen_q = static_cast<int>(p.seqlen_q), seqlen_k = static_cast<int>(p.seqlen_k);
  const int kv_chunks = static_cast<int>(segment_chunks(seqlen_k));
  int reach_lo = INT_MAX, reach_hi = INT_MIN, run_count = 0;
  bool differs = false;
  for (int c0 = 0; c0 < kv_chunks; c0 += kThreads) {
    const int c = c0 + static_cast<int>(threadIdx.x);
    const int warp0 = c - static_cast<int>(threadIdx.x % 32);
    const ChunkSummary cs =
        runs ? summarize_chunks<true>(kv_ids, q_ids, seqlen_k, kv_chunks, warp0, buf)
             : summarize_chunks<false>(kv_ids, q_ids, seqlen_k, kv_chunks, warp0, buf);
    const int lo = cs.lo, hi = cs.hi;
    uint32_t starts = cs.starts;  // bit i: position 16c + i (> 0) starts a run of the query ids
    differs = differs || cs.differs;
    int all_lo, all_hi, all_runs;
    const int pre_lo = block_scan<false>(lo, reach_lo, MinOp{}, scratch, all_lo);
    const int pre_hi = block_scan<false>(hi, reach_hi, MaxOp{}, scratch, all_hi);
    if (c < kv_chunks) {
      *reinterpret_cast<int4*>(kv_rec + c * kSegmentRecord) = make_int4(lo, hi, pre_lo, pre_hi);
      // With runs the query chunks are the key chunks: their (min, max) now, the reaches below.
      if (runs) *reinterpret_cast<int2*>(q_rec + c * kSegmentRecord) = make_int2(cs.q_lo, cs.q_hi);
    }
    reach_lo = all_lo;
    reach_hi = all_hi;
    if (runs) {
      const int mine = __popc(starts);
      // Run index of this chunk's first start: 1 + the starts before it.
      int after = block_scan<false>(mine, run_count, AddOp{}, scratch, all_runs) - mine + 1;
      for (; starts != 0u; starts &= starts - 1u, ++after) {
        if (after < p.runs_per_row) {
          run_row[after] = c * kSegmentChunk + __ffs(starts) - 1;
        }
      }
      run_count = all_runs;
    }
  }

  // Query ids: each chunk's (min, max) (already written with runs), then last to first the
  // suffix reach from those records.
  const int q_chunks = static_cast<int>(segment_chunks(seqlen_q));
  if (!runs) {
    for (int c0 = 0; c0 < q_chunks; c0 += kThreads) {
      const int c = c0 + static_cast<int>(threadIdx.x);
      const ChunkSummary cs = summarize_chunks<false>(q_ids, q_ids, seqlen_q, q_chunks,
                                                      c - static_cast<int>(threadIdx.x % 32), buf);
      if (c < q_chunks) {
        *reinterpret_cast<int2*>(q_rec + c * kSegmentRecord) = make_int2(cs.lo, cs.hi);
      }
    }
  }
  __syncthreads();  // the records written above, by any thread, are read below
  reach_lo = INT_MAX;
  reach_hi = INT_MIN;
  for (int top = q_chunks; top > 0; top -= kThreads) {
    const int c = top - kThreads + static_cast<int>(threadIdx.x);
    int lo = INT_MAX, hi = INT_MIN;
    if (c >= 0) {
      const int2 rec = *reinterpret_cast<const int2*>(q_rec + c * kSegmentRecord);
      lo = rec.x;
      hi = rec.y;
    }
    int all_lo, all_hi;
    const int suf_lo = block_scan<true>(lo, reach_lo, MinOp{}, scratch, all_lo);
    const int suf_hi = block_scan<true>(hi, reach_hi, MaxOp{}, scratch, all_hi);
    if (c >= 0) {
      *reinterpret_cast<int2*>(q_rec + c * kSegmentRecord + 2) = make_int2(suf_lo, suf_hi);
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
    if (j >= count && j > 0) run_row[j] = seqlen_q;
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
  // Positions are ints in the kernel, with room for a warp's 512 past the end.
  constexpr int64_t kMaxLen = INT_MAX - 32 * kSegmentChunk * kWarps;
  if (p.batch < 0 || p.seqlen_q < 1 || p.seqlen_k < 1 || p.batch > INT_MAX ||
      p.seqlen_q > kMaxLen || p.seqlen_k > kMaxLen) {
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
