// The CPU FlashAttention kernels, written once and compiled once per instruction set.
//
// This header is deliberately not include-guarded: each kernels_<isa>.cc includes it inside its
// own namespace (jax_flash::cpu::<isa>) after defining there
//   VF, VD          GCC/Clang vector types of float and double, one register wide,
//   Madd(a, b, c)   a * b + c on VF and VD, fused where the instruction set allows,
//   ConvertHalves   n f16 values to float, with conversion instructions where there are some,
//   kMicroRows      rows of the register-blocked micro-kernel, sized to the register file,
// and, on x86, under a target pragma, so every function below (templates included) is generated
// for that instruction set. kernels_common.h has everything it needs from outside.
//
// The algorithm is FlashAttention-2 (Dao, 2023) laid out for a CPU:
//  * A "row" is one (query position, query head) pair of a GQA group: row r of kv head hk is
//    position r / G of query head hk * G + r % G, with G = heads_q / heads_kv. The query heads that
//    share a K/V head share every K/V tile a task loads, and one-token decoding with GQA still
//    fills the vector lanes.
//  * The forward pass and the dQ pass keep their tiles transposed, with rows along the vector
//    lanes: S^T = K Q^T, O^T += V^T P^T, dQ^T += K^T dS^T. The online-softmax state of a row
//    (running max, running sum, rescale factor) then lives in one lane, the softmax is element-wise
//    across vectors, and head_dim is only ever a loop bound, never a vector width.
//  * The dK/dV pass runs untransposed, with keys along the lanes: S = Q K^T, dP = dO V^T,
//    dV += P^T dO, dK += dS^T Q (head_dim zero-padded to whole vectors in the Q and dO rows). Its
//    K^T and V^T are packed once per task, so each row tile only needs plain row copies.
//  * Every product is one register-blocked micro-kernel (kMicroRows x 2 vectors of accumulators,
//    A broadcast from a tile in place, B streamed as vectors).
//  * Causal masks are bottom-right aligned; tiles wholly in the future are never visited and only
//    tiles that straddle the diagonal are masked element-wise.
//  * The backward pass is two passes that each own their outputs (dK/dV per key block, dQ per row
//    block), so it needs no atomics and is deterministic. Both recompute P = exp(S - lse).
//
// Memory: XLA's FFI offers no scratch allocator for CPU custom calls, so each task allocates one
// small heap buffer (a few tiles: O(tile * head_dim)) that it reuses for all its tiles. When there
// are too few blocks to occupy the thread pool (decoding, short key sequences), the inner loop is
// split and the pieces' partial results go to one per-call buffer of O(splits * tile * head_dim)
// per block, combined in a fixed order. Nothing is O(seqlen^2).

template <class T>
struct VecOf;
template <>
struct VecOf<float> {
  using V = VF;
  using I = int32_t __attribute__((vector_size(sizeof(VF))));
};
template <>
struct VecOf<double> {
  using V = VD;
};

template <class T>
using Vec = typename VecOf<T>::V;
template <class T>
inline constexpr int64_t kLanes = static_cast<int64_t>(sizeof(Vec<T>) / sizeof(T));

template <class T>
inline Vec<T> LoadVec(const T* p) {
  Vec<T> v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

template <class T>
inline void StoreVec(T* p, const Vec<T>& v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

template <class T, size_t... kI>
inline Vec<T> SplatImpl(T s, std::index_sequence<kI...>) {
  return Vec<T>{((void)kI, s)...};
}

template <class T>
inline Vec<T> Splat(T s) {
  return SplatImpl<T>(s, std::make_index_sequence<kLanes<T>>());
}

inline VF Max(const VF& a, const VF& b) { return a > b ? a : b; }
inline VD Max(const VD& a, const VD& b) { return a > b ? a : b; }

// e^x, vectorised: x = n ln2 + r with n an integer and |r| <= ln2 / 2, e^r from a degree-6
// polynomial (fitted for this kernel; relative error below 4e-9, far under float's half ulp), and
// 2^n built in the exponent bits. Results below float's normal range, and e^-inf, are 0: in the
// softmax such terms are under 2^-126 times the row maximum's term of 1, so dropping them is below
// rounding, and no subnormal is ever produced (they are slow, and flushed under FTZ anyway).
inline VF Exp(const VF& x) {
  const VF lo = Splat(-87.33654f);  // ln(2^-126)
  const VF hi = Splat(88.0f);
  // 1.5 * 2^23: adding it rounds to the nearest integer, which then sits in the low mantissa bits.
  const VF shifter = Splat(12582912.0f);
  VF xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const VF t = Madd(xc, Splat(1.44269504088896341f), shifter);
  const VF n = t - shifter;
  // ln2 split in two so that n * ln2_hi is exact for |n| <= 128.
  VF r = Madd(n, Splat(-0.693359375f), xc);
  r = Madd(n, Splat(2.12194440054690583e-4f), r);
  VF q = Splat(0.0013751408499531048f);
  q = Madd(q, r, Splat(0.008368921813208977f));
  q = Madd(q, r, Splat(0.0416695336804848f));
  q = Madd(q, r, Splat(0.16666518414500084f));
  q = Madd(q, r, Splat(0.4999998859081215f));
  const VF p = Madd(q, r * r, r + Splat(1.0f));
  using VI = VecOf<float>::I;
  VI bits;
  __builtin_memcpy(&bits, &t, sizeof(bits));
  VI shifter_bits;
  __builtin_memcpy(&shifter_bits, &shifter, sizeof(shifter_bits));
  const VI scale_bits = (bits - shifter_bits + 127) << 23;
  VF scale;
  __builtin_memcpy(&scale, &scale_bits, sizeof(scale));
  return x < lo ? Splat(0.0f) : p * scale;
}

// float64 keeps the exact library exponential.
inline VD Exp(const VD& x) {
  VD y;
  for (int64_t i = 0; i < kLanes<double>; ++i) y[i] = std::exp(x[i]);
  return y;
}

// ---------------------------------------------------------------------------------------------
// Register-blocked GEMM: C[M x N] (op)= sum_k A(m, k) B[k][0:N], with A(m, k) = a[m * a_rs + k *
// a_cs] broadcast from a tile used in place (either orientation), B and C row-major and N a whole
// number of vectors.

enum class Update {
  kOverwrite,   // C = A B
  kAccumulate,  // C += A B
  kRescale,     // C = C * col_scale + A B: the online-softmax rescale of O, fused
};

// Two vectors of columns: kMicroRows x 2 accumulators, two B vectors and one broadcast fill the
// register file without spilling.
inline constexpr int kMicroVecs = 2;

template <class T>
using MicroFn = void (*)(int64_t, const T*, int64_t, int64_t, const T*, int64_t, T*, int64_t,
                         const T*);

template <class T, Update kUpdate, int kRows, int kVecs>
void MicroTile(int64_t kc, const T* a, int64_t a_rs, int64_t a_cs, const T* b, int64_t ldb, T* c,
               int64_t ldc, const T* col_scale) {
  constexpr int64_t kL = kLanes<T>;
  Vec<T> acc[kRows][kVecs];
#pragma GCC unroll 8
  for (int m = 0; m < kRows; ++m) {
#pragma GCC unroll 2
    for (int v = 0; v < kVecs; ++v) acc[m][v] = Splat(T(0));
  }
  for (int64_t k = 0; k < kc; ++k) {
    Vec<T> bv[kVecs];
#pragma GCC unroll 2
    for (int v = 0; v < kVecs; ++v) bv[v] = LoadVec(b + v * kL);
#pragma GCC unroll 8
    for (int m = 0; m < kRows; ++m) {
      const Vec<T> av = Splat(a[m * a_rs]);
#pragma GCC unroll 2
      for (int v = 0; v < kVecs; ++v) acc[m][v] = Madd(av, bv[v], acc[m][v]);
    }
    a += a_cs;
    b += ldb;
  }
#pragma GCC unroll 8
  for (int m = 0; m < kRows; ++m) {
#pragma GCC unroll 2
    for (int v = 0; v < kVecs; ++v) {
      T* cp = c + m * ldc + v * kL;
      if constexpr (kUpdate == Update::kOverwrite) {
        StoreVec(cp, acc[m][v]);
      } else if constexpr (kUpdate == Update::kAccumulate) {
        StoreVec(cp, LoadVec(cp) + acc[m][v]);
      } else {
        StoreVec(cp, Madd(LoadVec(cp), LoadVec(col_scale + v * kL), acc[m][v]));
      }
    }
  }
}

template <class T, Update kUpdate, int kVecs, size_t... kR>
constexpr std::array<MicroFn<T>, sizeof...(kR)> MicroRowTable(std::index_sequence<kR...>) {
  return {&MicroTile<T, kUpdate, static_cast<int>(kR) + 1, kVecs>...};
}

template <class T, Update kUpdate>
void Gemm(int64_t m_total, int64_t n_total, int64_t kc, const T* a, int64_t a_rs, int64_t a_cs,
          const T* b, int64_t ldb, T* c, int64_t ldc, const T* col_scale = nullptr) {
  constexpr int64_t kL = kLanes<T>;
  static_assert(kMicroVecs == 2, "the table below lists one row per vector count");
  // [vectors - 1][rows - 1]: edge tiles still run fully unrolled kernels.
  static constexpr std::array<MicroFn<T>, kMicroRows> kTable[kMicroVecs] = {
      MicroRowTable<T, kUpdate, 1>(std::make_index_sequence<kMicroRows>()),
      MicroRowTable<T, kUpdate, 2>(std::make_index_sequence<kMicroRows>()),
  };
  // Columns outer: one column block's B panel stays in L1 while the A strips stream past.
  for (int64_t n0 = 0; n0 < n_total; n0 += kMicroVecs * kL) {
    const int64_t vecs = std::min<int64_t>(kMicroVecs, (n_total - n0) / kL);
    const T* scale = kUpdate == Update::kRescale ? col_scale + n0 : nullptr;
    for (int64_t m0 = 0; m0 < m_total; m0 += kMicroRows) {
      const int64_t rows = std::min<int64_t>(kMicroRows, m_total - m0);
      kTable[vecs - 1][rows - 1](kc, a + m0 * a_rs, a_rs, a_cs, b + n0, ldb, c + m0 * ldc + n0, ldc,
                                 scale);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Shapes, tiles, schedules and workspaces.

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// Tile sizes. 64 x 64 keeps a task's tiles (16 KiB each in float32 at head_dim 64) in L2 and the
// micro-kernel's B panels in L1; larger tiles measured no faster and leave fewer tasks.
inline constexpr int64_t kRowTile = 64;  // rows per tile: the vector dimension of fwd / dQ
inline constexpr int64_t kKeyTile = 64;  // keys per tile: the vector dimension of dK / dV
template <class T>
inline constexpr bool kTilesFit =
    kRowTile % (kMicroVecs * kLanes<T>) == 0 && kKeyTile % (kMicroVecs * kLanes<T>) == 0;
static_assert(kTilesFit<float> && kTilesFit<double>, "tiles must be whole micro-tiles");

struct Shape {
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  bool causal;

  int64_t Group() const { return heads_q / heads_kv; }
  int64_t Rows() const { return seqlen_q * Group(); }
  int64_t Position(int64_t row) const { return row / Group(); }
  // Query position i sees key j iff j <= i + CausalShift().
  int64_t CausalShift() const { return seqlen_k - seqlen_q; }
  // Exclusive end of the keys that rows [0, row_end) can see.
  int64_t KeyEnd(int64_t row_end) const {
    if (!causal) return seqlen_k;
    return std::clamp<int64_t>(Position(row_end - 1) + 1 + CausalShift(), 0, seqlen_k);
  }
  // First row that sees key j.
  int64_t FirstRow(int64_t key) const {
    if (!causal) return 0;
    return std::clamp<int64_t>(key - CausalShift(), 0, seqlen_q) * Group();
  }
  // True when some key of [key0, key0 + keys) is in the future of some row of [r0, ...): only
  // such tiles need element-wise masking.
  bool Straddles(int64_t r0, int64_t key0, int64_t keys) const {
    return causal && key0 + keys - 1 > Position(r0) + CausalShift();
  }
  // Offsets of row r of a group: into [batch, seqlen_q, heads_q, head_dim] from the group's first
  // element, and into [batch, heads_q, seqlen_q] from the group's first statistic.
  int64_t RowOffset(int64_t r) const {
    const int64_t i = Position(r);
    return (i * heads_q + (r - i * Group())) * head_dim;
  }
  int64_t StatOffset(int64_t r) const {
    const int64_t i = Position(r);
    return (r - i * Group()) * seqlen_q + i;
  }
};

// P is FwdParams or BwdParams, which name their sizes alike.
template <class P>
inline Shape MakeShape(const P& p) {
  return {p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim, p.causal};
}

// Element offsets of one (batch, kv head) group in each tensor.
struct GroupOffsets {
  int64_t rows;   // (b, position 0, first query head of the group, 0) in Q / O / dO / dQ
  int64_t stats;  // (b, first query head of the group, position 0) in lse / delta
  int64_t keys;   // (b, key 0, hk, 0) in K / V / dK / dV

  GroupOffsets(const Shape& s, int64_t b, int64_t hk)
      : rows((b * s.seqlen_q * s.heads_q + hk * s.Group()) * s.head_dim),
        stats((b * s.heads_q + hk * s.Group()) * s.seqlen_q),
        keys((b * s.seqlen_k * s.heads_kv + hk) * s.head_dim) {}
};

// The tasks of one pass: for every (batch, kv head), `blocks` outer blocks that each own their
// outputs, each cut into `splits` contiguous pieces of its inner loop.
struct Schedule {
  int64_t heads;   // batch * heads_kv
  int64_t blocks;  // outer blocks per (batch, kv head)
  int64_t splits;  // pieces per block; > 1 only when blocks alone cannot occupy the pool

  Schedule(int64_t heads_, int64_t blocks_, int64_t inner_tiles) : heads(heads_), blocks(blocks_) {
    // 16 tasks keep a small pool busy with slack for uneven tasks; a piece keeps at least 4 tiles
    // so that combining the partial results stays cheap next to computing them.
    constexpr int64_t kMinTasks = 16;
    constexpr int64_t kMinTilesPerSplit = 4;
    const int64_t outer = heads * blocks;
    splits = outer >= kMinTasks ? 1
                                : std::max<int64_t>(1, std::min(CeilDiv(kMinTasks, outer),
                                                                inner_tiles / kMinTilesPerSplit));
  }
  int64_t Outer() const { return heads * blocks; }
  int64_t Tasks() const { return Outer() * splits; }

  struct Task {
    int64_t b, hk, block, split, outer;
  };
  // With a causal mask the cost of a block grows (or shrinks) with its index, so the task order
  // alternates cheap and expensive blocks: any contiguous share of the task range that a thread
  // pool hands one thread then carries about the same work.
  Task Decode(int64_t t, int64_t heads_kv) const {
    const int64_t outer = t / splits;
    const int64_t bh = outer / blocks;
    const int64_t i = outer - bh * blocks;
    const int64_t block = i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
    return {bh / heads_kv, bh % heads_kv, block, t - outer * splits, bh * blocks + block};
  }
  // The part of inner tiles [begin, end) that piece `split` covers.
  std::pair<int64_t, int64_t> Piece(int64_t split, int64_t begin, int64_t end) const {
    const int64_t per = CeilDiv(end - begin, splits);
    return {std::min(begin + split * per, end), std::min(begin + (split + 1) * per, end)};
  }
  // Index of a task's partial result: the pieces of one block are adjacent, in piece order.
  int64_t Slot(const Task& task) const { return task.outer * splits + task.split; }
};

// One heap buffer per task, carved into 64-byte aligned arrays of the given sizes, handed out in
// order by Next().
template <class T>
class Workspace {
 public:
  explicit Workspace(std::initializer_list<int64_t> sizes) {
    int64_t total = 0;
    for (int64_t size : sizes)
      offsets_.push_back(std::exchange(total, total + RoundUp(size, kAlign)));
    buffer_.resize(static_cast<size_t>(total + kAlign));
    const auto address = reinterpret_cast<uintptr_t>(buffer_.data());
    const uintptr_t aligned = (address + kAlign * sizeof(T) - 1) & ~(kAlign * sizeof(T) - 1);
    base_ = buffer_.data() + (aligned - address) / sizeof(T);
  }
  T* Next() { return base_ + offsets_.at(next_++); }

 private:
  static constexpr int64_t kAlign = 64 / static_cast<int64_t>(sizeof(T));  // in elements
  std::vector<T> buffer_;
  std::vector<int64_t> offsets_;
  T* base_ = nullptr;
  size_t next_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Packing: tensors to tiles in the compute type.

// n contiguous elements to the compute type.
template <class T, class S>
void LoadRow(const S* src, int64_t n, T* dst) {
  if constexpr (std::is_same_v<T, S>) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
  } else if constexpr (std::is_same_v<S, Half>) {
    ConvertHalves(src, n, dst);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = Load<T>(src + i);
  }
}

// Rows [r0, r0 + rows) of a group, transposed into dst[d][r] and multiplied by `scale`; lanes
// [rows, padded) are zeroed so that they stay finite.
template <class T, class S>
void PackRowsTransposed(const S* base, const Shape& shape, int64_t r0, int64_t rows, int64_t padded,
                        T scale, T* dst, int64_t ld) {
  const int64_t d_dim = shape.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    const S* src = base + shape.RowOffset(r0 + r);
    for (int64_t d = 0; d < d_dim; ++d) dst[d * ld + r] = Load<T>(src + d) * scale;
  }
  for (int64_t d = 0; d < d_dim; ++d) std::fill(dst + d * ld + rows, dst + d * ld + padded, T(0));
}

// Rows [r0, r0 + rows) of a group, row-major into dst[r][d], multiplied by `scale`, head_dim
// zero-padded to ld.
template <class T, class S>
void PackRows(const S* base, const Shape& shape, int64_t r0, int64_t rows, T scale, T* dst,
              int64_t ld) {
  const int64_t d_dim = shape.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    T* out = dst + r * ld;
    LoadRow(base + shape.RowOffset(r0 + r), d_dim, out);
    for (int64_t d = 0; d < d_dim; ++d) out[d] *= scale;
    std::fill(out + d_dim, out + ld, T(0));
  }
}

// A K or V tile [keys, head_dim] as a dense array. Consecutive keys are heads_kv * head_dim
// elements apart in the tensor, often a multiple of 4 KiB, which would put the micro-kernel's
// broadcast streams in the same few L1 sets; the copy (a conversion for f16/bf16) is cheap next
// to the tile's arithmetic.
template <class T, class S>
const T* CopyKeyTile(const S* src, int64_t src_ld, int64_t keys, int64_t d_dim, T* dst) {
  for (int64_t j = 0; j < keys; ++j) LoadRow(src + j * src_ld, d_dim, dst + j * d_dim);
  return dst;
}

// A K or V tile [keys, head_dim] transposed into dst[d][j]; keys [keys, padded) are zeroed.
template <class T, class S>
void PackKeysTransposed(const S* src, int64_t src_ld, int64_t keys, int64_t padded, int64_t d_dim,
                        T* dst, int64_t ld) {
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t d = 0; d < d_dim; ++d) dst[d * ld + j] = Load<T>(src + j * src_ld + d);
  }
  for (int64_t d = 0; d < d_dim; ++d) std::fill(dst + d * ld + keys, dst + d * ld + padded, T(0));
}

// ---------------------------------------------------------------------------------------------
// Causal masks (bottom-right aligned).

// S^T[j][r] = -inf where key key0 + j is in the future of row r0 + r.
template <class T>
void MaskTransposed(const Shape& shape, int64_t r0, int64_t key0, int64_t keys, int64_t padded,
                    T* st, int64_t ld) {
  for (int64_t j = 0; j < keys; ++j) {
    // Positions below key - shift cannot see the key; in rows, that is (key - shift) * G.
    const int64_t first_seen = (key0 + j - shape.CausalShift()) * shape.Group() - r0;
    T* row = st + j * ld;
    std::fill(row, row + std::clamp<int64_t>(first_seen, 0, padded),
              -std::numeric_limits<T>::infinity());
  }
}

// S[r][j] = -inf where key key0 + j is in the future of row r0 + r.
template <class T>
void MaskRows(const Shape& shape, int64_t r0, int64_t rows, int64_t key0, int64_t padded, T* s,
              int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t first_hidden = shape.Position(r0 + r) + shape.CausalShift() + 1 - key0;
    T* row = s + r * ld;
    std::fill(row + std::clamp<int64_t>(first_hidden, 0, padded), row + padded,
              -std::numeric_limits<T>::infinity());
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.

// The online-softmax state of a row tile over the keys seen so far: O^T[d][r] unnormalised, and
// per row the running max and sum. One per task, or one per piece of a split block.
template <class T>
struct SoftmaxState {
  T* ot;
  T* max;
  T* sum;

  static int64_t Size(int64_t d_dim) { return (d_dim + 2) * kRowTile; }
  SoftmaxState(T* buffer, int64_t d_dim)
      : ot(buffer), max(buffer + d_dim * kRowTile), sum(max + kRowTile) {}
};

// Runs key tiles [tile_begin, tile_end) (clipped to the keys these rows see) through the online
// softmax of rows [r0, r0 + rows), starting from an empty state.
template <class T, class S>
void ForwardRows(const FwdParams& p, const Shape& shape, const GroupOffsets& at, int64_t r0,
                 int64_t rows, int64_t tile_begin, int64_t tile_end, SoftmaxState<T> state) {
  constexpr int64_t kL = kLanes<T>;
  constexpr int64_t ld = kRowTile;
  constexpr T kInf = std::numeric_limits<T>::infinity();
  const int64_t d_dim = shape.head_dim;
  const int64_t padded = RoundUp(rows, kL);
  const int64_t key_begin = tile_begin * kKeyTile;
  const int64_t key_end = std::min(tile_end * kKeyTile, shape.KeyEnd(r0 + rows));
  std::fill(state.ot, state.ot + d_dim * ld, T(0));
  std::fill(state.max, state.max + ld, -kInf);
  std::fill(state.sum, state.sum + ld, T(0));
  if (key_begin >= key_end) return;

  const int64_t kv_ld = shape.heads_kv * d_dim;
  const S* k_base = static_cast<const S*>(p.k) + at.keys;
  const S* v_base = static_cast<const S*>(p.v) + at.keys;
  Workspace<T> ws({d_dim * ld, kKeyTile * ld, ld, kKeyTile * d_dim, kKeyTile * d_dim});
  T* qt = ws.Next();
  T* st = ws.Next();
  T* rescale = ws.Next();
  T* k_tile = ws.Next();
  T* v_tile = ws.Next();
  PackRowsTransposed(static_cast<const S*>(p.q) + at.rows, shape, r0, rows, padded,
                     static_cast<T>(p.softmax_scale), qt, ld);

  for (int64_t key0 = key_begin; key0 < key_end; key0 += kKeyTile) {
    const int64_t keys = std::min(kKeyTile, key_end - key0);
    const T* kt = CopyKeyTile(k_base + key0 * kv_ld, kv_ld, keys, d_dim, k_tile);
    const T* vt = CopyKeyTile(v_base + key0 * kv_ld, kv_ld, keys, d_dim, v_tile);

    Gemm<T, Update::kOverwrite>(keys, padded, d_dim, kt, d_dim, 1, qt, ld, st, ld);
    if (shape.Straddles(r0, key0, keys)) MaskTransposed(shape, r0, key0, keys, padded, st, ld);

    // A row that has seen only masked keys keeps max = -inf. Its subtraction point is clamped to
    // 0 so that exp gives 0 rather than NaN, and its rescale exp(-inf - finite) is 0.
    for (int64_t c = 0; c < padded; c += kL) {
      const Vec<T> old_max = LoadVec(state.max + c);
      Vec<T> new_max = old_max;
      for (int64_t j = 0; j < keys; ++j) new_max = Max(new_max, LoadVec(st + j * ld + c));
      const Vec<T> pivot = new_max == Splat(-kInf) ? Splat(T(0)) : new_max;
      const Vec<T> alpha = Exp(old_max - pivot);
      Vec<T> sum = Splat(T(0));
      for (int64_t j = 0; j < keys; ++j) {
        const Vec<T> e = Exp(LoadVec(st + j * ld + c) - pivot);
        StoreVec(st + j * ld + c, e);
        sum += e;
      }
      StoreVec(state.sum + c, Madd(LoadVec(state.sum + c), alpha, sum));
      StoreVec(state.max + c, new_max);
      StoreVec(rescale + c, alpha);
    }
    Gemm<T, Update::kRescale>(d_dim, padded, keys, vt, 1, d_dim, st, ld, state.ot, ld, rescale);
  }
}

// Writes O = O^T / sum and lse = max + log(sum) for rows [r0, r0 + rows); a row with sum = 0 saw
// no key and gets O = 0, lse = -inf. lse is evaluated in double so that the stored value carries a
// single rounding; when one key dominates a row, log(sum) vanishes and lse is exactly the row
// max, consistent with the scores the backward pass recomputes.
template <class T, class S>
void WriteForward(const FwdParams& p, const Shape& shape, const GroupOffsets& at, int64_t r0,
                  int64_t rows, const T* ot, const double* max, const double* sum) {
  S* o_base = static_cast<S*>(p.o) + at.rows;
  T* lse_base = static_cast<T*>(p.lse) + at.stats;
  for (int64_t r = 0; r < rows; ++r) {
    S* out = o_base + shape.RowOffset(r0 + r);
    const T inv = sum[r] > 0 ? static_cast<T>(1.0 / sum[r]) : T(0);
    for (int64_t d = 0; d < shape.head_dim; ++d) Store(out + d, ot[d * kRowTile + r] * inv);
    lse_base[shape.StatOffset(r0 + r)] = sum[r] > 0 ? static_cast<T>(max[r] + std::log(sum[r]))
                                                    : -std::numeric_limits<T>::infinity();
  }
}

template <class T, class S>
void Forward(const FwdParams& p, const ParallelFor& parallel_for) {
  const Shape shape = MakeShape(p);
  const int64_t d_dim = shape.head_dim;
  const int64_t row_total = shape.Rows();
  const int64_t key_tiles = CeilDiv(shape.seqlen_k, kKeyTile);
  const Schedule sched(shape.batch * shape.heads_kv, CeilDiv(row_total, kRowTile), key_tiles);
  const int64_t state_size = SoftmaxState<T>::Size(d_dim);
  // Partial states of split blocks, [outer block][piece]; see the note at the top.
  std::vector<T> partials(sched.splits > 1 ? sched.Tasks() * state_size : 0);

  parallel_for(sched.Tasks(), [&](int64_t t) {
    const Schedule::Task task = sched.Decode(t, shape.heads_kv);
    const GroupOffsets at(shape, task.b, task.hk);
    const int64_t r0 = task.block * kRowTile;
    const int64_t rows = std::min(kRowTile, row_total - r0);
    const auto [tile_begin, tile_end] =
        sched.Piece(task.split, 0, CeilDiv(shape.KeyEnd(r0 + rows), kKeyTile));
    if (sched.splits > 1) {
      T* state = partials.data() + sched.Slot(task) * state_size;
      ForwardRows<T, S>(p, shape, at, r0, rows, tile_begin, tile_end, {state, d_dim});
      return;
    }
    std::vector<T> state(static_cast<size_t>(state_size));
    const SoftmaxState<T> st(state.data(), d_dim);
    ForwardRows<T, S>(p, shape, at, r0, rows, tile_begin, tile_end, st);
    double max[kRowTile], sum[kRowTile];
    for (int64_t r = 0; r < rows; ++r) {
      max[r] = st.max[r];
      sum[r] = st.sum[r];
    }
    WriteForward<T, S>(p, shape, at, r0, rows, st.ot, max, sum);
  });
  if (sched.splits == 1) return;

  // Merge the pieces of each block in piece order: rescale every piece to the overall max.
  parallel_for(sched.Outer(), [&](int64_t outer) {
    const Schedule::Task task = sched.Decode(outer * sched.splits, shape.heads_kv);
    const GroupOffsets at(shape, task.b, task.hk);
    const int64_t r0 = task.block * kRowTile;
    const int64_t rows = std::min(kRowTile, row_total - r0);
    T* first = partials.data() + sched.Slot(task) * state_size;
    std::vector<T> ot(static_cast<size_t>(d_dim * kRowTile), T(0));
    double max[kRowTile], sum[kRowTile], weight[kRowTile];
    for (int64_t r = 0; r < rows; ++r) {
      max[r] = -std::numeric_limits<double>::infinity();
      sum[r] = 0;
    }
    for (int64_t s = 0; s < sched.splits; ++s) {
      const SoftmaxState<T> piece(first + s * state_size, d_dim);
      for (int64_t r = 0; r < rows; ++r) max[r] = std::max<double>(max[r], piece.max[r]);
    }
    for (int64_t s = 0; s < sched.splits; ++s) {
      const SoftmaxState<T> piece(first + s * state_size, d_dim);
      for (int64_t r = 0; r < rows; ++r) {
        // A piece that saw nothing (max -inf) weighs 0; so does every piece of a masked row.
        weight[r] = piece.max[r] == -std::numeric_limits<T>::infinity()
                        ? 0.0
                        : std::exp(static_cast<double>(piece.max[r]) - max[r]);
        sum[r] += weight[r] * piece.sum[r];
      }
      for (int64_t d = 0; d < d_dim; ++d) {
        for (int64_t r = 0; r < rows; ++r) {
          ot[d * kRowTile + r] += static_cast<T>(weight[r]) * piece.ot[d * kRowTile + r];
        }
      }
    }
    WriteForward<T, S>(p, shape, at, r0, rows, ot.data(), max, sum);
  });
}

// ---------------------------------------------------------------------------------------------
// Backward.

// Per-row statistics of rows [r0, r0 + rows): lse, with -inf replaced by +inf so that
// P = exp(S - lse) is 0 on fully masked rows, and delta. Lanes [rows, padded) get the same as a
// fully masked row, and delta = 0.
template <class T>
void LoadStats(const BwdParams& p, const Shape& shape, const GroupOffsets& at, int64_t r0,
               int64_t rows, int64_t padded, T* lse, T* delta) {
  constexpr T kInf = std::numeric_limits<T>::infinity();
  const T* lse_src = static_cast<const T*>(p.lse) + at.stats;
  const T* delta_src = static_cast<const T*>(p.delta) + at.stats;
  for (int64_t r = 0; r < rows; ++r) {
    const T l = lse_src[shape.StatOffset(r0 + r)];
    lse[r] = l == -kInf ? kInf : l;
    delta[r] = delta_src[shape.StatOffset(r0 + r)];
  }
  std::fill(lse + rows, lse + padded, kInf);
  std::fill(delta + rows, delta + padded, T(0));
}

// Rows along the lanes: st = S^T becomes P^T = exp(S^T - lse) and dpt = dP^T becomes
// dS^T = P^T * (dP^T - delta).
template <class T>
void SoftmaxGradTransposed(int64_t keys, int64_t padded, const T* lse, const T* delta, T* st,
                           T* dpt, int64_t ld) {
  constexpr int64_t kL = kLanes<T>;
  for (int64_t c = 0; c < padded; c += kL) {
    const Vec<T> l = LoadVec(lse + c);
    const Vec<T> dl = LoadVec(delta + c);
    for (int64_t j = 0; j < keys; ++j) {
      const Vec<T> pv = Exp(LoadVec(st + j * ld + c) - l);
      StoreVec(st + j * ld + c, pv);
      StoreVec(dpt + j * ld + c, pv * (LoadVec(dpt + j * ld + c) - dl));
    }
  }
}

// Keys along the lanes: s = S becomes P and dp = dP becomes dS.
template <class T>
void SoftmaxGradRows(int64_t rows, int64_t padded, const T* lse, const T* delta, T* s, T* dp,
                     int64_t ld) {
  constexpr int64_t kL = kLanes<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const Vec<T> l = Splat(lse[r]);
    const Vec<T> dl = Splat(delta[r]);
    for (int64_t c = 0; c < padded; c += kL) {
      const Vec<T> pv = Exp(LoadVec(s + r * ld + c) - l);
      StoreVec(s + r * ld + c, pv);
      StoreVec(dp + r * ld + c, pv * (LoadVec(dp + r * ld + c) - dl));
    }
  }
}

// Pass 1: dK, dV [keys, d_pad] of keys [key0, key0 + keys) from row tiles [tile_begin, tile_end),
// starting from zero.
template <class T, class S>
void BackwardKeys(const BwdParams& p, const Shape& shape, const GroupOffsets& at, int64_t key0,
                  int64_t keys, int64_t tile_begin, int64_t tile_end, T* dk, T* dv) {
  constexpr int64_t kL = kLanes<T>;
  constexpr int64_t ldk = kKeyTile;
  const int64_t d_dim = shape.head_dim;
  const int64_t d_pad = RoundUp(d_dim, kL);
  const int64_t keys_pad = RoundUp(keys, kL);
  const int64_t row_total = shape.Rows();
  const int64_t row_begin = tile_begin * kRowTile;
  const int64_t row_end = std::min(tile_end * kRowTile, row_total);
  std::fill(dk, dk + keys * d_pad, T(0));
  std::fill(dv, dv + keys * d_pad, T(0));
  if (row_begin >= row_end) return;

  const int64_t kv_ld = shape.heads_kv * d_dim;
  const S* q = static_cast<const S*>(p.q) + at.rows;
  const S* dout = static_cast<const S*>(p.dout) + at.rows;
  Workspace<T> ws({d_dim * ldk, d_dim * ldk, kRowTile * d_pad, kRowTile * d_pad, kRowTile * ldk,
                   kRowTile * ldk, kRowTile, kRowTile});
  T* kt = ws.Next();
  T* vt = ws.Next();
  T* q_rows = ws.Next();
  T* do_rows = ws.Next();
  T* s = ws.Next();
  T* dp = ws.Next();
  T* lse = ws.Next();
  T* delta = ws.Next();
  const S* k_src = static_cast<const S*>(p.k) + at.keys + key0 * kv_ld;
  const S* v_src = static_cast<const S*>(p.v) + at.keys + key0 * kv_ld;
  PackKeysTransposed(k_src, kv_ld, keys, keys_pad, d_dim, kt, ldk);
  PackKeysTransposed(v_src, kv_ld, keys, keys_pad, d_dim, vt, ldk);
  // The Q rows carry the softmax scale: S = (scale Q) K^T and dK = dS^T (scale Q).
  const T scale = static_cast<T>(p.softmax_scale);

  for (int64_t r0 = row_begin; r0 < row_end; r0 += kRowTile) {
    const int64_t rows = std::min(kRowTile, row_end - r0);
    PackRows(q, shape, r0, rows, scale, q_rows, d_pad);
    PackRows(dout, shape, r0, rows, T(1), do_rows, d_pad);
    LoadStats(p, shape, at, r0, rows, rows, lse, delta);

    // Padding keys (zero K and V columns) get values in s and dp that no product reads.
    Gemm<T, Update::kOverwrite>(rows, keys_pad, d_dim, q_rows, d_pad, 1, kt, ldk, s, ldk);
    if (shape.Straddles(r0, key0, keys)) MaskRows(shape, r0, rows, key0, keys_pad, s, ldk);
    Gemm<T, Update::kOverwrite>(rows, keys_pad, d_dim, do_rows, d_pad, 1, vt, ldk, dp, ldk);
    SoftmaxGradRows(rows, keys_pad, lse, delta, s, dp, ldk);
    Gemm<T, Update::kAccumulate>(keys, d_pad, rows, s, 1, ldk, do_rows, d_pad, dv, d_pad);
    Gemm<T, Update::kAccumulate>(keys, d_pad, rows, dp, 1, ldk, q_rows, d_pad, dk, d_pad);
  }
}

// Pass 2: dQ^T [d][r] (without the softmax scale) of rows [r0, r0 + rows) from key tiles
// [tile_begin, tile_end) (clipped to the keys these rows see), starting from zero.
template <class T, class S>
void BackwardRows(const BwdParams& p, const Shape& shape, const GroupOffsets& at, int64_t r0,
                  int64_t rows, int64_t tile_begin, int64_t tile_end, T* dqt) {
  constexpr int64_t kL = kLanes<T>;
  constexpr int64_t ld = kRowTile;
  const int64_t d_dim = shape.head_dim;
  const int64_t padded = RoundUp(rows, kL);
  const int64_t key_begin = tile_begin * kKeyTile;
  const int64_t key_end = std::min(tile_end * kKeyTile, shape.KeyEnd(r0 + rows));
  std::fill(dqt, dqt + d_dim * ld, T(0));
  if (key_begin >= key_end) return;

  const int64_t kv_ld = shape.heads_kv * d_dim;
  const S* k_base = static_cast<const S*>(p.k) + at.keys;
  const S* v_base = static_cast<const S*>(p.v) + at.keys;
  Workspace<T> ws({d_dim * ld, d_dim * ld, kKeyTile * ld, kKeyTile * ld, ld, ld, kKeyTile * d_dim,
                   kKeyTile * d_dim});
  T* qt = ws.Next();
  T* dot = ws.Next();
  T* st = ws.Next();
  T* dpt = ws.Next();
  T* lse = ws.Next();
  T* delta = ws.Next();
  T* k_tile = ws.Next();
  T* v_tile = ws.Next();
  PackRowsTransposed(static_cast<const S*>(p.q) + at.rows, shape, r0, rows, padded,
                     static_cast<T>(p.softmax_scale), qt, ld);
  PackRowsTransposed(static_cast<const S*>(p.dout) + at.rows, shape, r0, rows, padded, T(1), dot,
                     ld);
  LoadStats(p, shape, at, r0, rows, padded, lse, delta);

  for (int64_t key0 = key_begin; key0 < key_end; key0 += kKeyTile) {
    const int64_t keys = std::min(kKeyTile, key_end - key0);
    const T* kt = CopyKeyTile(k_base + key0 * kv_ld, kv_ld, keys, d_dim, k_tile);
    const T* vt = CopyKeyTile(v_base + key0 * kv_ld, kv_ld, keys, d_dim, v_tile);
    Gemm<T, Update::kOverwrite>(keys, padded, d_dim, kt, d_dim, 1, qt, ld, st, ld);
    if (shape.Straddles(r0, key0, keys)) MaskTransposed(shape, r0, key0, keys, padded, st, ld);
    Gemm<T, Update::kOverwrite>(keys, padded, d_dim, vt, d_dim, 1, dot, ld, dpt, ld);
    SoftmaxGradTransposed(keys, padded, lse, delta, st, dpt, ld);
    // dQ^T[d][r] += sum_j K[j][d] dS^T[j][r].
    Gemm<T, Update::kAccumulate>(d_dim, padded, keys, kt, 1, d_dim, dpt, ld, dqt, ld);
  }
}

// Runs a pass whose split blocks combine by plain summation (both backward passes; the forward
// merge rescales instead). compute(task, out) fills out[0, size) with the task's result, the whole
// block's when unsplit and its piece's otherwise; write(task, total) stores a block's result.
template <class T, class Compute, class Write>
void RunSummed(const Schedule& sched, int64_t heads_kv, int64_t size,
               const ParallelFor& parallel_for, Compute compute, Write write) {
  // Partial results of split blocks, [outer block][piece]; see the note at the top.
  std::vector<T> partials(sched.splits > 1 ? sched.Tasks() * size : 0);
  parallel_for(sched.Tasks(), [&](int64_t t) {
    const Schedule::Task task = sched.Decode(t, heads_kv);
    std::vector<T> own(sched.splits > 1 ? 0 : static_cast<size_t>(size));
    T* out = sched.splits > 1 ? partials.data() + sched.Slot(task) * size : own.data();
    compute(task, out);
    if (sched.splits == 1) write(task, out);
  });
  if (sched.splits == 1) return;

  parallel_for(sched.Outer(), [&](int64_t outer) {
    const Schedule::Task task = sched.Decode(outer * sched.splits, heads_kv);
    T* first = partials.data() + sched.Slot(task) * size;
    // Fixed piece order: float addition is not associative, and gradients must be deterministic.
    for (int64_t s = 1; s < sched.splits; ++s) {
      const T* piece = first + s * size;
      for (int64_t i = 0; i < size; ++i) first[i] += piece[i];
    }
    write(task, first);
  });
}

template <class T, class S>
void Backward(const BwdParams& p, const ParallelFor& parallel_for) {
  const Shape shape = MakeShape(p);
  const int64_t d_dim = shape.head_dim;
  const int64_t d_pad = RoundUp(d_dim, kLanes<T>);
  const int64_t heads = shape.batch * shape.heads_kv;
  const int64_t kv_ld = shape.heads_kv * d_dim;
  const int64_t row_tiles = CeilDiv(shape.Rows(), kRowTile);
  const int64_t key_tiles = CeilDiv(shape.seqlen_k, kKeyTile);

  // Pass 1: dK and dV, one task per key block (and piece of its row tiles).
  {
    const Schedule sched(heads, key_tiles, row_tiles);
    const int64_t grad_size = 2 * kKeyTile * d_pad;  // dK, then dV
    const auto compute = [&](const Schedule::Task& task, T* grads) {
      const GroupOffsets at(shape, task.b, task.hk);
      const int64_t key0 = task.block * kKeyTile;
      const int64_t keys = std::min(kKeyTile, shape.seqlen_k - key0);
      const auto [tile_begin, tile_end] =
          sched.Piece(task.split, shape.FirstRow(key0) / kRowTile, row_tiles);
      BackwardKeys<T, S>(p, shape, at, key0, keys, tile_begin, tile_end, grads,
                         grads + kKeyTile * d_pad);
    };
    const auto write = [&](const Schedule::Task& task, const T* grads) {
      const T* dk = grads;
      const T* dv = grads + kKeyTile * d_pad;
      const int64_t key0 = task.block * kKeyTile;
      const int64_t keys = std::min(kKeyTile, shape.seqlen_k - key0);
      const int64_t offset = GroupOffsets(shape, task.b, task.hk).keys + key0 * kv_ld;
      S* dk_out = static_cast<S*>(p.dk) + offset;
      S* dv_out = static_cast<S*>(p.dv) + offset;
      for (int64_t j = 0; j < keys; ++j) {
        for (int64_t d = 0; d < d_dim; ++d) {
          Store(dk_out + j * kv_ld + d, dk[j * d_pad + d]);
          Store(dv_out + j * kv_ld + d, dv[j * d_pad + d]);
        }
      }
    };
    RunSummed<T>(sched, shape.heads_kv, grad_size, parallel_for, compute, write);
  }

  // Pass 2: dQ, one task per row block (and piece of its key tiles).
  {
    const Schedule sched(heads, row_tiles, key_tiles);
    const int64_t grad_size = d_dim * kRowTile;
    const T scale = static_cast<T>(p.softmax_scale);
    const auto compute = [&](const Schedule::Task& task, T* dqt) {
      const GroupOffsets at(shape, task.b, task.hk);
      const int64_t r0 = task.block * kRowTile;
      const int64_t rows = std::min(kRowTile, shape.Rows() - r0);
      const auto [tile_begin, tile_end] =
          sched.Piece(task.split, 0, CeilDiv(shape.KeyEnd(r0 + rows), kKeyTile));
      BackwardRows<T, S>(p, shape, at, r0, rows, tile_begin, tile_end, dqt);
    };
    const auto write = [&](const Schedule::Task& task, const T* dqt) {
      const int64_t r0 = task.block * kRowTile;
      const int64_t rows = std::min(kRowTile, shape.Rows() - r0);
      S* dq = static_cast<S*>(p.dq) + GroupOffsets(shape, task.b, task.hk).rows;
      for (int64_t r = 0; r < rows; ++r) {
        S* out = dq + shape.RowOffset(r0 + r);
        for (int64_t d = 0; d < d_dim; ++d) Store(out + d, dqt[d * kRowTile + r] * scale);
      }
    };
    RunSummed<T>(sched, shape.heads_kv, grad_size, parallel_for, compute, write);
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points of this instruction set (declared in kernels.h). dtype is the element type of Q,
// K, V and the outputs; f16/bf16 compute in float32.

void AttentionForward(const FwdParams& params, DType dtype, const ParallelFor& parallel_for) {
  switch (dtype) {
    case DType::kF16:
      return Forward<float, Half>(params, parallel_for);
    case DType::kBF16:
      return Forward<float, BFloat16>(params, parallel_for);
    case DType::kF32:
      return Forward<float, float>(params, parallel_for);
    case DType::kF64:
      return Forward<double, double>(params, parallel_for);
  }
}

void AttentionBackward(const BwdParams& params, DType dtype, const ParallelFor& parallel_for) {
  switch (dtype) {
    case DType::kF16:
      return Backward<float, Half>(params, parallel_for);
    case DType::kBF16:
      return Backward<float, BFloat16>(params, parallel_for);
    case DType::kF32:
      return Backward<float, float>(params, parallel_for);
    case DType::kF64:
      return Backward<double, double>(params, parallel_for);
  }
}
