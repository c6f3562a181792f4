#include "kernels/cpu/int8_gemm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <dnnl.hpp>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/error.h"

namespace keel {

namespace {

// The largest K whose int32 sums cannot overflow: 127 * 127 * K < 2^31.
constexpr int kMaxK = 133143;

// ---------------------------------------------------------------------------------------------
// The arithmetic both paths share. Everything that decides a result's bits is in these three
// functions, so the fast path and the reference cannot drift apart.

// The scale of a row or column whose largest magnitude is max_abs.
inline float scale_of(float max_abs) { return max_abs / 127.0f; }

// One code: x / s (a float32 division, never a multiplication by a reciprocal) rounded to the
// nearest integer, ties to even (nearbyint in the default rounding mode), then clamped to
// [-127, 127]. Requires s > 0 and a finite x. For a normal s the quotient never exceeds 127 by more
// than float32's rounding of s, so the clamp only guards; for a subnormal s it may bite.
inline int8_t code(float x, float s) {
  float q = std::nearbyint(x / s);
  q = std::min(std::max(q, -127.0f), 127.0f);
  return static_cast<int8_t>(q);
}

// One output element from its int32 sum (see the header for the formula and why fma).
inline float output(float alpha, float sa, float sb, int32_t acc, float beta, float c) {
  const float v = alpha * (sa * sb) * static_cast<float>(acc);
  return beta == 0.0f ? v : std::fma(beta, c, v);
}

// ---------------------------------------------------------------------------------------------
// Quantisation for the fast path: in parallel (unless already inside a parallel region), in loops
// the compiler vectorises.

// |x| as the integer bits of a float. For finite floats, larger magnitudes have larger bit
// patterns, so a max over these integers finds the largest |x| exactly, and an integer max
// reduction vectorises without permission to reorder float operations.
inline uint32_t abs_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u & 0x7fffffffu;
}

inline float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Per-thread scratch that only grows (the buffers are reused across calls).
template <typename T>
T* scratch(std::vector<T>& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// Quantises `rows` rows of `cols` contiguous floats (row r at src + r * ld) with one scale per row:
// codes compact [rows, cols], scales[rows]. Used for op(A) when A is stored as is (its rows are
// op(A)'s rows) and for op(B) when B is stored transposed (its rows are op(B)'s columns).
void quantise_rows(const float* src, int rows, int cols, int64_t ld, int8_t* codes, float* scales) {
  const bool outer = !omp_in_parallel();
#pragma omp parallel for schedule(static) if (outer)
  for (int r = 0; r < rows; ++r) {
    const float* x = src + r * ld;
    int8_t* q = codes + static_cast<int64_t>(r) * cols;
    uint32_t m = 0;
#pragma omp simd reduction(max : m)
    for (int c = 0; c < cols; ++c) m = std::max(m, abs_bits(x[c]));
    const float s = scale_of(from_bits(m));
    scales[r] = s;
    if (s == 0.0f) {  // an all-zero row (or one below float32's smallest scale): all codes 0
      std::memset(q, 0, static_cast<size_t>(cols));
      continue;
    }
#pragma omp simd
    for (int c = 0; c < cols; ++c) q[c] = code(x[c], s);
  }
}

// Quantises a rows x cols matrix (row r at src + r * ld) with one scale per column: scales[cols],
// and codes either compact in the same orientation ([rows, cols]; op(B) when B is stored as is) or
// compact transposed ([cols, rows]; op(A) when A is stored transposed, whose columns are op(A)'s
// rows, so that oneDNN always receives op(A) row-major).
//
// One task per strip of kStrip columns: the strip's magnitudes are reduced down all rows (vectors
// run along the row, across columns), then the strip is quantised. The transposed output goes
// through a kStrip x kStrip tile on the stack, so that reads and writes both stay near-sequential.
void quantise_columns(const float* src, int rows, int cols, int64_t ld, bool transpose, int8_t* codes, float* scales) {
  constexpr int kStrip = 64;
  const int strips = (cols + kStrip - 1) / kStrip;
  const bool outer = !omp_in_parallel();
#pragma omp parallel for schedule(static) if (outer)
  for (int t = 0; t < strips; ++t) {
    const int c0 = t * kStrip, w = std::min(kStrip, cols - c0);
    uint32_t m[kStrip] = {};
    for (int r = 0; r < rows; ++r) {
      const float* x = src + r * ld + c0;
#pragma omp simd
      for (int c = 0; c < w; ++c) m[c] = std::max(m[c], abs_bits(x[c]));
    }
    // A column whose scale is 0 divides by 1 instead: all its elements are then below 127 * 2^-149
    // in magnitude (most often exactly 0), so they round to code 0, as a zero scale requires, and
    // the loops below need no branch.
    float divisor[kStrip];
    for (int c = 0; c < w; ++c) {
      const float s = scale_of(from_bits(m[c]));
      scales[c0 + c] = s;
      divisor[c] = s == 0.0f ? 1.0f : s;
    }
    if (!transpose) {
      for (int r = 0; r < rows; ++r) {
        const float* x = src + r * ld + c0;
        int8_t* q = codes + static_cast<int64_t>(r) * cols + c0;
#pragma omp simd
        for (int c = 0; c < w; ++c) q[c] = code(x[c], divisor[c]);
      }
      continue;
    }
    int8_t tile[kStrip][kStrip];  // tile[r - r0][c]
    for (int r0 = 0; r0 < rows; r0 += kStrip) {
      const int h = std::min(kStrip, rows - r0);
      for (int r = 0; r < h; ++r) {
        const float* x = src + (r0 + r) * ld + c0;
#pragma omp simd
        for (int c = 0; c < w; ++c) tile[r][c] = code(x[c], divisor[c]);
      }
      for (int c = 0; c < w; ++c) {
        int8_t* q = codes + static_cast<int64_t>(c0 + c) * rows + r0;
        for (int r = 0; r < h; ++r) q[r] = tile[r][c];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// oneDNN's int8 matmul: s8 codes of op(A) (compact [M,K], row-major) times s8 codes of op(B)
// (compact [K,N] row-major, or [N,K] row-major read as op(B) transposed) into int32 [M,N].
//
// The source is signed. VNNI's dot-product instruction multiplies unsigned by signed bytes, and
// oneDNN bridges that internally (a shift of the source by 128 and a compensation term from the
// weights' column sums). Measured on Zen 4 at Keel's shapes, s8 codes run as fast as u8 codes
// (codes + 128) would, so Keel does no such shift and compensation of its own. op(A) always arrives row-major: with a
// transposed source oneDNN 2.6 leaves its blocked (brgemm) kernels for a slower generic one.

struct Primitive {
  dnnl::matmul matmul;
  dnnl::memory::desc scratchpad;  // the caller provides this much scratch per execution
  std::string impl;               // oneDNN's name for the implementation it chose
};

// (B transposed, M, N, K): the compact buffers make the leading dimensions follow from the shape.
using Key = std::tuple<bool, int, int, int>;

struct OneDnn {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mutex;
  std::map<Key, std::shared_ptr<Primitive>> cache;  // null: oneDNN has no implementation for that key
};

OneDnn& onednn() {
  static OneDnn instance;
  return instance;
}

dnnl::memory::desc a_desc(int M, int K) {
  return dnnl::memory::desc({M, K}, dnnl::memory::data_type::s8, dnnl::memory::dims{K, 1});
}
dnnl::memory::desc b_desc(bool trans_b, int K, int N) {
  return dnnl::memory::desc({K, N}, dnnl::memory::data_type::s8,
                            trans_b ? dnnl::memory::dims{1, K} : dnnl::memory::dims{N, 1});
}
dnnl::memory::desc c_desc(int M, int N) {
  return dnnl::memory::desc({M, N}, dnnl::memory::data_type::s32, dnnl::memory::dims{N, 1});
}

// The primitive for one shape and layout, created on first use and kept (nullptr where oneDNN
// has none, remembered too). Its scratchpad is the caller's (a per-thread buffer): products may
// run concurrently from several threads, and a library-owned scratchpad would be shared by them.
std::shared_ptr<Primitive> primitive(bool trans_b, int M, int N, int K) {
  OneDnn& o = onednn();
  const Key key{trans_b, M, N, K};
  std::lock_guard<std::mutex> lock(o.mutex);
  const auto it = o.cache.find(key);
  if (it != o.cache.end()) return it->second;
  std::shared_ptr<Primitive> p;
  try {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_desc(M, K), b_desc(trans_b, K, N), c_desc(M, N)), attr,
                                          o.engine);
    p = std::make_shared<Primitive>(Primitive{dnnl::matmul(pd), pd.scratchpad_desc(), pd.impl_info_str()});
  } catch (const dnnl::error&) {
    p = nullptr;
  }
  o.cache.emplace(key, p);
  return p;
}

// acc = codes(op(A)) codes(op(B)) through oneDNN; false (acc untouched) where it has no primitive.
bool onednn_product(bool trans_b, int M, int N, int K, const int8_t* a, const int8_t* b, int32_t* acc) {
  const std::shared_ptr<Primitive> p = primitive(trans_b, M, N, K);
  if (!p) return false;
  OneDnn& o = onednn();
  static thread_local std::vector<uint8_t> pad;
  uint8_t* pad_data = scratch(pad, std::max<size_t>(p->scratchpad.get_size(), 1));
  using dnnl::memory;
  memory a_mem(a_desc(M, K), o.engine, const_cast<int8_t*>(a));
  memory b_mem(b_desc(trans_b, K, N), o.engine, const_cast<int8_t*>(b));
  memory c_mem(c_desc(M, N), o.engine, acc);
  memory pad_mem(p->scratchpad, o.engine, pad_data);
  dnnl::stream stream(o.engine);
  p->matmul.execute(
      stream,
      {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}, {DNNL_ARG_SCRATCHPAD, pad_mem}});
  stream.wait();
  return true;
}

// acc = codes(op(A)) codes(op(B)) by plain loops, where oneDNN has no primitive. a: [M,K];
// b: [N,K] when trans_b, else [K,N].
void loop_product(bool trans_b, int M, int N, int K, const int8_t* a, const int8_t* b, int32_t* acc) {
  const bool outer = !omp_in_parallel();
#pragma omp parallel for schedule(static) if (outer)
  for (int i = 0; i < M; ++i) {
    const int8_t* ai = a + static_cast<int64_t>(i) * K;
    int32_t* ci = acc + static_cast<int64_t>(i) * N;
    for (int j = 0; j < N; ++j) ci[j] = 0;
    for (int k = 0; k < K; ++k) {
      const int32_t x = ai[k];
      for (int j = 0; j < N; ++j) {
        const int8_t y = trans_b ? b[static_cast<int64_t>(j) * K + k] : b[static_cast<int64_t>(k) * N + j];
        ci[j] += x * static_cast<int32_t>(y);
      }
    }
  }
}

void check_arguments(const char* who, bool trans_a, bool trans_b, int M, int N, int K, int lda, int ldb, int ldc) {
  const std::string name(who);
  check(M >= 0 && N >= 0 && K >= 0, name + ": negative size (M " + std::to_string(M) + ", N " + std::to_string(N) +
                                        ", K " + std::to_string(K) + ")");
  check(K <= kMaxK, name + ": K = " + std::to_string(K) + " exceeds " + std::to_string(kMaxK) +
                        ", beyond which int32 sums of int8 products can overflow");
  const int a_cols = trans_a ? M : K, b_cols = trans_b ? K : N;
  check(lda >= std::max(a_cols, 1), name + ": lda = " + std::to_string(lda) + " is below " + std::to_string(a_cols));
  check(ldb >= std::max(b_cols, 1), name + ": ldb = " + std::to_string(ldb) + " is below " + std::to_string(b_cols));
  check(ldc >= std::max(N, 1), name + ": ldc = " + std::to_string(ldc) + " is below " + std::to_string(N));
}

}  // namespace

void gemm_int8_dynamic(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                       const float* B, int ldb, float beta, float* C, int ldc) {
  check_arguments("gemm_int8_dynamic", trans_a, trans_b, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;

  // Per-thread buffers, kept between calls: codes, scales and the int32 sums.
  static thread_local std::vector<int8_t> a_buf, b_buf;
  static thread_local std::vector<float> sa_buf, sb_buf;
  static thread_local std::vector<int32_t> acc_buf;
  int8_t* qa = scratch(a_buf, std::max<size_t>(static_cast<size_t>(M) * K, 1));
  int8_t* qb = scratch(b_buf, std::max<size_t>(static_cast<size_t>(K) * N, 1));
  float* sa = scratch(sa_buf, static_cast<size_t>(M));
  float* sb = scratch(sb_buf, static_cast<size_t>(N));
  int32_t* acc = scratch(acc_buf, static_cast<size_t>(M) * N);

  // op(A) -> codes [M,K] row-major, whichever way A is stored.
  if (!trans_a) {
    quantise_rows(A, M, K, lda, qa, sa);
  } else {
    quantise_columns(A, K, M, lda, /*transpose=*/true, qa, sa);
  }
  // op(B) -> codes in B's own orientation: [N,K] when B is stored transposed, else [K,N].
  if (trans_b) {
    quantise_rows(B, N, K, ldb, qb, sb);
  } else {
    quantise_columns(B, K, N, ldb, /*transpose=*/false, qb, sb);
  }

  if (K == 0) {
    std::fill(acc, acc + static_cast<size_t>(M) * N, 0);
  } else if (!onednn_product(trans_b, M, N, K, qa, qb, acc)) {
    loop_product(trans_b, M, N, K, qa, qb, acc);
  }

  // The epilogue: scales, alpha and beta, row by row.
  const bool outer = !omp_in_parallel();
#pragma omp parallel for schedule(static) if (outer)
  for (int i = 0; i < M; ++i) {
    const int32_t* ai = acc + static_cast<int64_t>(i) * N;
    float* ci = C + static_cast<int64_t>(i) * ldc;
    const float s = sa[i];
    if (beta == 0.0f) {
#pragma omp simd
      for (int j = 0; j < N; ++j) ci[j] = output(alpha, s, sb[j], ai[j], 0.0f, 0.0f);
    } else {
#pragma omp simd
      for (int j = 0; j < N; ++j) ci[j] = output(alpha, s, sb[j], ai[j], beta, ci[j]);
    }
  }
}

std::string int8_engine() {
  static const std::string engine = [] {
    // A probe: some oneDNN builds or CPUs have no int8 matmul.
    const std::shared_ptr<Primitive> p = primitive(false, 16, 16, 16);
    return p ? "oneDNN int8 matmul (s8 x s8 -> s32, " + p->impl + ")"
             : std::string("reference loops (oneDNN has no int8 matmul here)");
  }();
  return engine;
}

void gemm_int8_dynamic_reference(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                                 const float* B, int ldb, float beta, float* C, int ldc) {
  check_arguments("gemm_int8_dynamic_reference", trans_a, trans_b, M, N, K, lda, ldb, ldc);
  auto op_a = [&](int i, int k) {
    return trans_a ? A[static_cast<int64_t>(k) * lda + i] : A[static_cast<int64_t>(i) * lda + k];
  };
  auto op_b = [&](int k, int j) {
    return trans_b ? B[static_cast<int64_t>(j) * ldb + k] : B[static_cast<int64_t>(k) * ldb + j];
  };

  std::vector<float> sa(M), sb(N);
  std::vector<int8_t> qa(static_cast<size_t>(M) * K), qb(static_cast<size_t>(K) * N);  // [M,K] and [K,N]
  for (int i = 0; i < M; ++i) {
    float m = 0.0f;
    for (int k = 0; k < K; ++k) m = std::max(m, std::fabs(op_a(i, k)));
    sa[i] = scale_of(m);
    for (int k = 0; k < K; ++k) qa[static_cast<size_t>(i) * K + k] = sa[i] == 0.0f ? 0 : code(op_a(i, k), sa[i]);
  }
  for (int j = 0; j < N; ++j) {
    float m = 0.0f;
    for (int k = 0; k < K; ++k) m = std::max(m, std::fabs(op_b(k, j)));
    sb[j] = scale_of(m);
    for (int k = 0; k < K; ++k) qb[static_cast<size_t>(k) * N + j] = sb[j] == 0.0f ? 0 : code(op_b(k, j), sb[j]);
  }
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      int32_t acc = 0;
      for (int k = 0; k < K; ++k) {
        acc += static_cast<int32_t>(qa[static_cast<size_t>(i) * K + k]) *
               static_cast<int32_t>(qb[static_cast<size_t>(k) * N + j]);
      }
      float& c = C[static_cast<int64_t>(i) * ldc + j];
      c = output(alpha, sa[i], sb[j], acc, beta, beta == 0.0f ? 0.0f : c);
    }
  }
}

}  // namespace keel
