#include "kernels/cpu/attention.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/ring_attention.h"
#include "kernels/cpu/vmath.h"

namespace keel::ops {

bool blockwise_attention_vectorized(MatmulPrecision precision, int head_size) {
  if (head_size <= 0 || head_size % 16 != 0 || head_size > 256) return false;
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (!avx512) return false;
  if (precision == MatmulPrecision::fp32) return true;
  return precision == MatmulPrecision::bf16 && cpu_has_bf16();
}

AttentionTiming time_attention(bool dense, MatmulPrecision precision, int B, int Tn, int C, int NH, int NKV,
                               int window, int repeats) {
  const int kv = (NKV == 0 ? NH : NKV) * (C / NH), C3 = C + 2 * kv;
  std::vector<float> qkv(static_cast<size_t>(B) * Tn * C3), out(static_cast<size_t>(B) * Tn * C), dout(out.size()),
      dqkv(qkv.size());
  // A fixed pattern in [-1, 1) (no generator needed: the values only have to be ordinary floats).
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = static_cast<float>((i * 2654435761u) % 2000) / 1000.0f - 1.0f;
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = static_cast<float>((i * 40503u) % 2000) / 100000.0f - 0.01f;
  std::vector<float> saved(dense ? static_cast<size_t>(B) * NH * Tn * Tn : static_cast<size_t>(B) * NH * Tn);
  using clock = std::chrono::steady_clock;
  auto ms = [](clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  AttentionTiming best{std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()};
  for (int r = 0; r <= repeats; ++r) {
    const auto t0 = clock::now();
    if (dense) {
      attention_forward(precision, out.data(), saved.data(), qkv.data(), B, Tn, C, NH, NKV);
    } else {
      flash_attention_forward(precision, out.data(), saved.data(), qkv.data(), B, Tn, C, NH, NKV, window);
    }
    const auto t1 = clock::now();
    if (dense) {
      attention_backward_input(precision, dqkv.data(), dout.data(), saved.data(), qkv.data(), B, Tn, C, NH, NKV);
    } else {
      flash_attention_backward_input(precision, dqkv.data(), dout.data(), out.data(), saved.data(), qkv.data(), B, Tn,
                                     C, NH, NKV, window);
    }
    const auto t2 = clock::now();
    if (r == 0) continue;  // the untimed pass: first touch of the buffers, the threads' scratch
    best.forward_ms = std::min(best.forward_ms, ms(t1 - t0));
    best.backward_ms = std::min(best.backward_ms, ms(t2 - t1));
  }
  return best;
}

}  // namespace keel::ops

// Everything below runs only where blockwise_attention_vectorized said so: it may use AVX-512 and
// AVX512_BF16 whatever the build's -march.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps(), which its flow analysis reports as
// (maybe) uninitialized once inlined; the values are never read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include "kernels/cpu/vmath512.h"

namespace keel::ops {

namespace {

constexpr int kTile = 64;  // queries of a query tile, keys of a key tile: 4 vectors of 16 floats

inline int window_start(int i, int window) { return window > 0 ? std::max(0, i - window + 1) : 0; }


// Bits lo..hi (clamped to the tile's 64 columns) set; 0 when empty.
inline uint64_t column_mask(int lo, int hi) {
  lo = std::max(lo, 0);
  hi = std::min(hi, kTile - 1);
  if (lo > hi) return 0;
  const uint64_t to_hi = hi == kTile - 1 ? ~uint64_t{0} : (uint64_t{1} << (hi + 1)) - 1;
  return to_hi & ~((uint64_t{1} << lo) - 1);
}

// Horizontal max and sum of 16 lanes, halving the vector each step (a fixed order).
inline float lanes_max(__m512 v) {
  const __m256 a = _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
}
inline float lanes_sum(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

inline __m512 bf16_dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}

// ---- packing (bf16 operands keep their reduction index in adjacent pairs) -------------------

// dst[hs][64] = src[64 rows][hs]^T; rows n.. are zero. src has row stride ld.
void pack_transposed(float* dst, const float* src, int64_t ld, int n, int hs) {
  for (int d = 0; d < hs; ++d) {
    for (int c = 0; c < kTile; ++c) dst[d * kTile + c] = c < n ? src[c * ld + d] : 0.0f;
  }
}
// dst[hs/2][64][2]: src^T with pairs of adjacent columns of src together, rounded to bf16.
void pack_transposed(uint16_t* dst, const float* src, int64_t ld, int n, int hs) {
  for (int d = 0; d < hs; ++d) {
    for (int c = 0; c < kTile; ++c) dst[((d / 2) * kTile + c) * 2 + d % 2] = c < n ? to_bf16(src[c * ld + d]) : 0;
  }
}
// dst[64][hs] = src rows (zero from n).
void pack_rows(float* dst, const float* src, int64_t ld, int n, int hs) {
  for (int c = 0; c < kTile; ++c) {
    for (int d = 0; d < hs; ++d) dst[c * hs + d] = c < n ? src[c * ld + d] : 0.0f;
  }
}
// dst[64][hs] = src rows rounded to bf16 (zero from n).
void pack_rows(uint16_t* dst, const float* src, int64_t ld, int n, int hs) {
  for (int c = 0; c < kTile; ++c) {
    for (int d = 0; d < hs; ++d) dst[c * hs + d] = c < n ? to_bf16(src[c * ld + d]) : 0;
  }
}
// dst[32][hs][2]: rows 2p and 2p+1 of src interleaved, rounded to bf16 (zero from n).
void pack_row_pairs(uint16_t* dst, const float* src, int64_t ld, int n, int hs) {
  for (int c = 0; c < kTile; ++c) {
    for (int d = 0; d < hs; ++d) dst[((c / 2) * hs + d) * 2 + c % 2] = c < n ? to_bf16(src[c * ld + d]) : 0;
  }
}

// A [64][64] tile of floats to bf16, row-major (pairs of adjacent columns).
void tile_to_bf16(uint16_t* dst, const float* src) {
  for (int i = 0; i < kTile * kTile; i += 16) {
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(b));
  }
}
// A [64][64] tile of floats to bf16 with pairs of adjacent rows together: dst[32][64][2].
void tile_to_bf16_row_pairs(uint16_t* dst, const float* src) {
  alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(interleave);
  for (int rp = 0; rp < kTile / 2; ++rp) {
    for (int c = 0; c < kTile; c += 16) {
      const __m512bh ab = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + (2 * rp + 1) * kTile + c),
                                              _mm512_loadu_ps(src + 2 * rp * kTile + c));
      const __m512i pairs = _mm512_permutexvar_epi16(idx, reinterpret_cast<const __m512i&>(ab));
      _mm512_storeu_si512(dst + (rp * kTile + c) * 2, pairs);
    }
  }
}

// ---- micro-kernels ---------------------------------------------------------------------------

// s[64][64] = scale * (a tile's rows times a packed tile), 4 rows at a time in registers:
// `add(r0, acc)` adds rows r0..r0+3 of the product into acc[4][4] (4 vectors of 16 keys a row).
template <typename Add>
inline void score_rows(float* s, float scale, Add add) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r0 = 0; r0 < kTile; r0 += 4) {
    __m512 acc[4][4];
    for (auto& row : acc)
      for (auto& v : row) v = _mm512_setzero_ps();
    add(r0, acc);
    for (int rr = 0; rr < 4; ++rr)
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(s + (r0 + rr) * kTile + 16 * v, _mm512_mul_ps(acc[rr][v], sc));
  }
}

// s[64][64] = scale * a[64][hs] bt, bt[hs][64] a packed tile (a's rows broadcast, bt's rows vectors).
void scores(float* s, const float* a, const float* bt, int hs, float scale) {
  score_rows(s, scale, [&](int r0, __m512 (&acc)[4][4]) __attribute__((always_inline)) {
    const float* ar = a + r0 * hs;
    for (int d = 0; d < hs; ++d) {
      const float* b = bt + d * kTile;
      const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32),
                   b3 = _mm512_loadu_ps(b + 48);
#pragma GCC unroll 4
      for (int rr = 0; rr < 4; ++rr) {
        const __m512 x = _mm512_set1_ps(ar[rr * hs + d]);
        acc[rr][0] = _mm512_fmadd_ps(x, b0, acc[rr][0]);
        acc[rr][1] = _mm512_fmadd_ps(x, b1, acc[rr][1]);
        acc[rr][2] = _mm512_fmadd_ps(x, b2, acc[rr][2]);
        acc[rr][3] = _mm512_fmadd_ps(x, b3, acc[rr][3]);
      }
    }
  });
}
// The same with bf16 operands: a[64][hs] row-major, bt[hs/2][64][2].
void scores(float* s, const uint16_t* a, const uint16_t* bt, int hs, float scale) {
  score_rows(s, scale, [&](int r0, __m512 (&acc)[4][4]) __attribute__((always_inline)) {
    const uint16_t* ar = a + r0 * hs;
    for (int d2 = 0; d2 < hs / 2; ++d2) {
      const uint16_t* b = bt + d2 * kTile * 2;
      const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 32), b2 = _mm512_loadu_si512(b + 64),
                    b3 = _mm512_loadu_si512(b + 96);
#pragma GCC unroll 4
      for (int rr = 0; rr < 4; ++rr) {
        const __m512i x = _mm512_set1_epi32(static_cast<int>(load_pair(ar + rr * hs + 2 * d2)));
        acc[rr][0] = bf16_dot(acc[rr][0], x, b0);
        acc[rr][1] = bf16_dot(acc[rr][1], x, b1);
        acc[rr][2] = bf16_dot(acc[rr][2], x, b2);
        acc[rr][3] = bf16_dot(acc[rr][3], x, b3);
      }
    }
  });
}

// out[64][16 NV] (row stride ldo) += A B, RB rows at a time held in registers: `add(i0, acc)` adds
// rows i0.. of the product into acc[RB][NV].
template <int RB, int NV, typename Add>
inline void accumulate_rows(float* out, int64_t ldo, Add add) {
  for (int i0 = 0; i0 < kTile; i0 += RB) {
    __m512 acc[RB][NV];
    for (int rr = 0; rr < RB; ++rr)
      for (int v = 0; v < NV; ++v) acc[rr][v] = _mm512_loadu_ps(out + (i0 + rr) * ldo + 16 * v);
    add(i0, acc);
    for (int rr = 0; rr < RB; ++rr)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + (i0 + rr) * ldo + 16 * v, acc[rr][v]);
  }
}

// out[64][16 NV] += sum over k < 64 of A(i, k) bm[k][.] (row stride ldb), where
// A(i, k) = a[i * sa_i + k * sa_k]: a row-major tile (sa_i 64, sa_k 1) or its transpose (1, 64).
template <int RB, int NV>
void accumulate_block(float* out, int64_t ldo, const float* a, int64_t sa_i, int64_t sa_k, const float* bm,
                      int64_t ldb) {
  accumulate_rows<RB, NV>(out, ldo, [&](int i0, __m512 (&acc)[RB][NV]) __attribute__((always_inline)) {
    const float* ai = a + i0 * sa_i;
    for (int k = 0; k < kTile; ++k) {
      __m512 b[NV];
      for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(bm + k * ldb + 16 * v);
#pragma GCC unroll 8
      for (int rr = 0; rr < RB; ++rr) {
        const __m512 x = _mm512_set1_ps(ai[rr * sa_i + k * sa_k]);
        for (int v = 0; v < NV; ++v) acc[rr][v] = _mm512_fmadd_ps(x, b[v], acc[rr][v]);
      }
    }
  });
}
// The same with bf16 operands: A's pairs (i; 2 k2, 2 k2 + 1) are a[i * sa_i + k2 * sa_k] (32-bit
// words), bm[32][ldb][2] holds rows 2 k2 and 2 k2 + 1 of B interleaved.
template <int RB, int NV>
void accumulate_block(float* out, int64_t ldo, const uint32_t* a, int64_t sa_i, int64_t sa_k, const uint16_t* bm,
                      int64_t ldb) {
  accumulate_rows<RB, NV>(out, ldo, [&](int i0, __m512 (&acc)[RB][NV]) __attribute__((always_inline)) {
    const uint32_t* ai = a + i0 * sa_i;
    for (int k2 = 0; k2 < kTile / 2; ++k2) {
      __m512i b[NV];
      for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(bm + (k2 * ldb + 16 * v) * 2);
#pragma GCC unroll 8
      for (int rr = 0; rr < RB; ++rr) {
        const __m512i x = _mm512_set1_epi32(static_cast<int>(ai[rr * sa_i + k2 * sa_k]));
        for (int v = 0; v < NV; ++v) acc[rr][v] = bf16_dot(acc[rr][v], x, b[v]);
      }
    }
  });
}

// out[64][hs] += A bm over all hs columns, in blocks of at most 64 columns (A, bm as above; bm's
// columns are floats or, for bf16, interleaved pairs).
template <typename A, typename Bm>
void accumulate(float* out, int64_t ldo, const A* a, int64_t sa_i, int64_t sa_k, const Bm* bm, int64_t ldb, int hs) {
  constexpr int per_column = std::is_same_v<Bm, uint16_t> ? 2 : 1;  // bm elements per column
  int col = 0;
  for (; col + 64 <= hs; col += 64) accumulate_block<4, 4>(out + col, ldo, a, sa_i, sa_k, bm + col * per_column, ldb);
  switch ((hs - col) / 16) {
    case 3: accumulate_block<4, 3>(out + col, ldo, a, sa_i, sa_k, bm + col * per_column, ldb); break;
    case 2: accumulate_block<8, 2>(out + col, ldo, a, sa_i, sa_k, bm + col * per_column, ldb); break;
    case 1: accumulate_block<8, 1>(out + col, ldo, a, sa_i, sa_k, bm + col * per_column, ldb); break;
    default: break;
  }
}

// The allowed keys of a tile's rows when queries and keys are consecutive positions (query tile
// from i0, key tile from j0): bit c of row r is set when key j0 + c may be attended by i0 + r.
struct ConsecutiveMask {
  int i0, j0, window;
  uint64_t operator()(int r) const {
    const int i = i0 + r;
    return column_mask(window_start(i, window) - j0, i - j0);
  }
};

// The same for any positions (ring attention's blocks): qpos[r] for the tile's `rows` query rows
// (rows past them allow nothing), kpos[64] for its keys (INT_MAX past the block: never allowed).
struct PositionMask {
  const int* qpos;
  int rows;
  const int* kpos;
  int window;
  uint64_t operator()(int r) const {
    if (r >= rows) return 0;
    const int i = qpos[r];
    const __m512i iv = _mm512_set1_epi32(i), lo = _mm512_set1_epi32(window > 0 ? i - window : 0);
    uint64_t allowed = 0;
    for (int v = 0; v < 4; ++v) {
      const __m512i kv = _mm512_loadu_si512(kpos + 16 * v);
      __mmask16 m = _mm512_cmple_epi32_mask(kv, iv);
      if (window > 0) m &= _mm512_cmpgt_epi32_mask(kv, lo);
      allowed |= static_cast<uint64_t>(m) << (16 * v);
    }
    return allowed;
  }
};

// One key tile of the forward's online softmax: s[64][64] holds the scaled scores of a query tile
// against a key tile; each row's allowed keys (mask_of(row): causal, inside the window) become
// exp(s - m_new) (0 elsewhere), m_new the row's running maximum with this tile; the row's sum l
// and unnormalised output o[64][hs] are rescaled from the old maximum to the new one.
template <typename MaskOf>
void online_softmax(float* s, const MaskOf& mask_of, float* m, float* l, float* o, int hs) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < kTile; ++r) {
    const uint64_t allowed = mask_of(r);
    float* srow = s + r * kTile;
    if (allowed == 0) {
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(srow + 16 * v, _mm512_setzero_ps());
      continue;
    }
    __m512 x[4];
    __mmask16 mask[4];
    __m512 mx = minus_inf;
    for (int v = 0; v < 4; ++v) {
      mask[v] = static_cast<__mmask16>(allowed >> (16 * v));
      x[v] = _mm512_loadu_ps(srow + 16 * v);
      mx = _mm512_mask_max_ps(mx, mask[v], mx, x[v]);
    }
    const float m_new = std::max(m[r], lanes_max(mx));
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < 4; ++v) {
      const __m512 p = _mm512_maskz_mov_ps(mask[v], vmath::exp16(_mm512_sub_ps(x[v], mv)));
      _mm512_storeu_ps(srow + 16 * v, p);
      sum = _mm512_add_ps(sum, p);
    }
    if (m_new != m[r]) {
      const float correction = vmath::exp(m[r] - m_new);  // 0 (about 1e-38 times nothing) on a first tile
      l[r] *= correction;
      const __m512 cv = _mm512_set1_ps(correction);
      float* orow = o + r * hs;
      for (int d = 0; d < hs; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), cv));
      m[r] = m_new;
    }
    l[r] += lanes_sum(sum);
  }
}

// The backward's probabilities of a tile: s = exp(s - lse[row]) where allowed (mask_of(row)), 0
// elsewhere.
template <typename MaskOf>
void probabilities(float* s, const MaskOf& mask_of, const float* lse) {
  for (int r = 0; r < kTile; ++r) {
    const uint64_t allowed = mask_of(r);
    const __m512 lv = _mm512_set1_ps(lse[r]);
    float* srow = s + r * kTile;
    for (int v = 0; v < 4; ++v) {
      const __mmask16 mask = static_cast<__mmask16>(allowed >> (16 * v));
      const __m512 p = _mm512_maskz_mov_ps(mask, vmath::exp16(_mm512_sub_ps(_mm512_loadu_ps(srow + 16 * v), lv)));
      _mm512_storeu_ps(srow + 16 * v, p);
    }
  }
}

// dp (in place) = p * (dp - delta[row]) * scale: the scores' gradient.
void score_gradient(float* dp, const float* p, const float* delta, float scale) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < kTile; ++r) {
    const __m512 dl = _mm512_set1_ps(delta[r]);
    for (int v = 0; v < 4; ++v) {
      const int at = r * kTile + 16 * v;
      const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(p + at), _mm512_sub_ps(_mm512_loadu_ps(dp + at), dl));
      _mm512_storeu_ps(dp + at, _mm512_mul_ps(g, sc));
    }
  }
}

inline const uint32_t* as_pairs(const uint16_t* p) { return reinterpret_cast<const uint32_t*>(p); }

// One (query tile, key tile) pair of the backward, in the scratch of its task: p = the tile's
// probabilities (mask_of as the forward's), dp = dout v^T, dv += p^T dout, ds = p (dp - delta)
// scale, dq += ds k, dk += ds^T q. q, d: the query tile's rows (q2, d2: as bf16 row pairs), kt,
// vt, kr: the key tile packed as k^T, v^T and k (row pairs in bf16); lse, delta: the query rows'.
template <typename E, typename MaskOf>
void backward_tile(const MaskOf& mask_of, int hs, float scale, const E* q, const uint16_t* q2, const E* d,
                   const uint16_t* d2, const E* kt, const E* vt, const E* kr, const float* lse, const float* delta,
                   float* p, float* dp, uint16_t* p16, uint16_t* ds16, float* dq, float* dk, float* dv) {
  scores(p, q, kt, hs, scale);
  probabilities(p, mask_of, lse);
  scores(dp, d, vt, hs, 1.0f);  // dp = dout v^T
  if constexpr (std::is_same_v<E, float>) {
    accumulate(dv, hs, p, 1, kTile, d, hs, hs);  // dv += p^T dout
  } else {
    tile_to_bf16_row_pairs(p16, p);
    accumulate(dv, hs, as_pairs(p16), 1, kTile, d2, hs, hs);
  }
  score_gradient(dp, p, delta, scale);  // ds = p (dp - delta) scale
  if constexpr (std::is_same_v<E, float>) {
    accumulate(dq, hs, dp, kTile, 1, kr, hs, hs);  // dq += ds k
    accumulate(dk, hs, dp, 1, kTile, q, hs, hs);   // dk += ds^T q
  } else {
    tile_to_bf16(ds16, dp);
    accumulate(dq, hs, as_pairs(ds16), kTile / 2, 1, kr, hs, hs);
    tile_to_bf16_row_pairs(ds16, dp);
    accumulate(dk, hs, as_pairs(ds16), 1, kTile, q2, hs, hs);
  }
}

// A backward task's scratch, one per thread: a query head's q and dout rows [Tp][hs] (and their
// bf16 row pairs), its dq, delta and log-sum-exp rows, one tile pair's probabilities and their
// gradient, and the key tile's dk, dv.
template <typename E>
struct BackwardScratch {
  static constexpr bool bf16 = !std::is_same_v<E, float>;
  BackwardScratch(int Tp, int hs_)
      : hs(hs_), q(static_cast<size_t>(Tp) * hs), d(q.size()), q2(bf16 ? q.size() : 0), d2(q2.size()), dq(q.size()),
        delta(Tp), lse(Tp), tile(static_cast<size_t>(2) * kTile * kTile + 2 * kTile * hs),
        p16(bf16 ? kTile * kTile : 0), ds16(p16.size()) {}
  float* p() { return tile.data(); }                            // [64][64] probabilities
  float* dp() { return tile.data() + kTile * kTile; }           // [64][64] their gradient, then the scores'
  float* dk() { return tile.data() + 2 * kTile * kTile; }       // [64][hs] the key tile's gradient
  float* dv() { return dk() + static_cast<int64_t>(kTile) * hs; }  // [64][hs] the value tile's gradient
  // Rows [i0, i0 + rows) of the head's q (row stride ldq) and dout (ldd), zero past them.
  void pack(int i0, int rows, const float* qsrc, int64_t ldq, const float* dsrc, int64_t ldd) {
    pack_rows(q.data() + static_cast<int64_t>(i0) * hs, qsrc, ldq, rows, hs);
    pack_rows(d.data() + static_cast<int64_t>(i0) * hs, dsrc, ldd, rows, hs);
    if constexpr (bf16) {
      pack_row_pairs(q2.data() + static_cast<int64_t>(i0) * hs, qsrc, ldq, rows, hs);
      pack_row_pairs(d2.data() + static_cast<int64_t>(i0) * hs, dsrc, ldd, rows, hs);
    }
  }
  // The query tile from row i0 against a key tile packed as k^T, v^T and k.
  template <typename MaskOf>
  void tile_pair(const MaskOf& mask_of, int i0, float scale, const E* kt, const E* vt, const E* kr) {
    const int64_t at = static_cast<int64_t>(i0) * hs;
    backward_tile<E>(mask_of, hs, scale, q.data() + at, bf16 ? q2.data() + at : nullptr, d.data() + at,
                     bf16 ? d2.data() + at : nullptr, kt, vt, kr, lse.data() + i0, delta.data() + i0, p(), dp(),
                     p16.data(), ds16.data(), dq.data() + at, dk(), dv());
  }
  int hs;
  std::vector<E> q, d;
  std::vector<uint16_t> q2, d2;
  std::vector<float> dq, delta, lse, tile;
  std::vector<uint16_t> p16, ds16;
};

// Grouped heads' key/value gradients: each query head's dk, dv in head_dkv [B][NH][2][T][hs],
// summed per key/value head g in head order (a fixed order) into row (b, t)'s dk at
// dk + (b T + t) ld + g hs (dv likewise); `overwrite`: the first head's rows replace what is there.
void sum_group_heads(const std::vector<float>& head_dkv, int B, int T, int NH, int NKV, int hs, float* dk, float* dv,
                     int64_t ld, bool overwrite) {
  const int group = NH / NKV;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < static_cast<int64_t>(B) * T; ++bt) {
    const int b = static_cast<int>(bt / T), t = static_cast<int>(bt % T);
    for (int g = 0; g < NKV; ++g) {
      for (int part = 0; part < 2; ++part) {  // 0: dk, 1: dv
        float* dst = (part == 0 ? dk : dv) + bt * ld + g * hs;
        for (int h = g * group; h < (g + 1) * group; ++h) {
          const float* src = head_dkv.data() + ((static_cast<int64_t>(b * NH + h) * 2 + part) * T + t) * hs;
          if (overwrite && h == g * group) {
            std::copy(src, src + hs, dst);
          } else {
            for (int e = 0; e < hs; ++e) dst[e] += src[e];
          }
        }
      }
    }
  }
}

struct Shape {
  int B, Tn, C, NH, NKV, hs, group, kv, C3, tiles;
  float scale;
  Shape(int B_, int Tn_, int C_, int NH_, int NKV_)
      : B(B_), Tn(Tn_), C(C_), NH(NH_), NKV(NKV_ == 0 ? NH_ : NKV_), hs(C_ / NH_), group(NH / NKV), kv(NKV * hs),
        C3(C + 2 * kv), tiles((Tn_ + kTile - 1) / kTile), scale(1.0f / std::sqrt(static_cast<float>(hs))) {}
  int64_t tile_elements() const { return static_cast<int64_t>(kTile) * hs; }
  // The row of qkv at (batch row b, position t).
  int64_t row(int b, int t) const { return (static_cast<int64_t>(b) * Tn + t) * C3; }
};

// Packs every (batch row, key/value head, key tile) of `part` (C: keys, C + kv: values) with
// `pack`, into dst[B][NKV][tiles][tile_elements].
template <typename E>
void pack_all(std::vector<E>& dst, const Shape& sh, const float* qkv, int part,
              void (*pack)(E*, const float*, int64_t, int, int)) {
  const int64_t packs = static_cast<int64_t>(sh.B) * sh.NKV * sh.tiles;
  dst.resize(static_cast<size_t>(packs * sh.tile_elements()));
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < packs; ++p) {
    const int bg = static_cast<int>(p / sh.tiles), jt = static_cast<int>(p % sh.tiles);
    const int b = bg / sh.NKV, g = bg % sh.NKV, j0 = jt * kTile;
    pack(dst.data() + p * sh.tile_elements(), qkv + sh.row(b, j0) + part + g * sh.hs, sh.C3,
         std::min(kTile, sh.Tn - j0), sh.hs);
  }
}

template <typename E>
void forward(const Shape& sh, float* out, float* lse, const float* qkv, int window) {
  const int hs = sh.hs, nt = sh.tiles;
  const int64_t te = sh.tile_elements();
  std::vector<E> kt, v;  // per (b, g, key tile): k^T and v, in the layout of E's products
  pack_all<E>(kt, sh, qkv, sh.C, pack_transposed);
  if constexpr (std::is_same_v<E, float>) {
    pack_all<E>(v, sh, qkv, sh.C + sh.kv, pack_rows);
  } else {
    pack_all<E>(v, sh, qkv, sh.C + sh.kv, pack_row_pairs);
  }
  const int64_t tasks = static_cast<int64_t>(sh.B) * sh.NH * nt;
#pragma omp parallel
  {
    std::vector<float> buffer(static_cast<size_t>(kTile) * (kTile + hs + 2));
    float* s = buffer.data();     // [64][64] scores, then probabilities
    float* o = s + kTile * kTile;  // [64][hs] unnormalised output
    float* m = o + kTile * hs;     // [64] running maxima
    float* l = m + kTile;          // [64] running sums
    std::vector<E> q(static_cast<size_t>(te));
    std::vector<uint16_t> p16(std::is_same_v<E, float> ? 0 : kTile * kTile);
    // Longest tasks (last query tiles) first: the dynamic schedule then balances the threads.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int it = nt - 1 - static_cast<int>(task % nt), bh = static_cast<int>(task / nt);
      const int b = bh / sh.NH, h = bh % sh.NH, g = h / sh.group;
      const int i0 = it * kTile, rows = std::min(kTile, sh.Tn - i0);
      pack_rows(q.data(), qkv + sh.row(b, i0) + h * hs, sh.C3, rows, hs);
      std::fill(m, m + kTile, -std::numeric_limits<float>::infinity());
      std::fill(l, l + kTile, 0.0f);
      std::fill(o, o + kTile * hs, 0.0f);
      for (int jt = window_start(i0, window) / kTile; jt <= it; ++jt) {
        const int64_t pk = (static_cast<int64_t>(b) * sh.NKV + g) * nt + jt;
        scores(s, q.data(), kt.data() + pk * te, hs, sh.scale);
        online_softmax(s, ConsecutiveMask{i0, jt * kTile, window}, m, l, o, hs);
        if constexpr (std::is_same_v<E, float>) {
          accumulate(o, hs, s, kTile, 1, v.data() + pk * te, hs, hs);  // o += p v
        } else {
          tile_to_bf16(p16.data(), s);
          accumulate(o, hs, as_pairs(p16.data()), kTile / 2, 1, v.data() + pk * te, hs, hs);
        }
      }
      for (int r = 0; r < rows; ++r) {
        float* dst = out + (static_cast<int64_t>(b) * sh.Tn + i0 + r) * sh.C + h * hs;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < hs; ++d) dst[d] = o[r * hs + d] * inv;
        lse[static_cast<int64_t>(bh) * sh.Tn + i0 + r] = m[r] + std::log(l[r]);
      }
    }
  }
}

template <typename E>
void backward(const Shape& sh, float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
              int window) {
  constexpr bool bf16 = !std::is_same_v<E, float>;
  const int hs = sh.hs, nt = sh.tiles, Tp = nt * kTile;
  const int64_t te = sh.tile_elements();
  // Per (b, g, key tile): k^T and v^T (the scores' and dp's right operands), k (dq's).
  std::vector<E> kt, vt, k;
  pack_all<E>(kt, sh, qkv, sh.C, pack_transposed);
  pack_all<E>(vt, sh, qkv, sh.C + sh.kv, pack_transposed);
  if constexpr (bf16) {
    pack_all<E>(k, sh, qkv, sh.C, pack_row_pairs);
  } else {
    pack_all<E>(k, sh, qkv, sh.C, pack_rows);
  }
  // Grouped heads: each query head's dk, dv [B][NH][T][hs], summed per group in head order after.
  std::vector<float> head_dkv(sh.group > 1 ? static_cast<size_t>(2) * sh.B * sh.NH * sh.Tn * hs : 0);
  const int tasks = sh.B * sh.NH;
#pragma omp parallel
  {
    BackwardScratch<E> w(Tp, hs);
#pragma omp for schedule(dynamic, 1)
    for (int bh = 0; bh < tasks; ++bh) {
      const int b = bh / sh.NH, h = bh % sh.NH, g = h / sh.group;
      for (int it = 0; it < nt; ++it) {
        const int i0 = it * kTile, rows = std::min(kTile, sh.Tn - i0);
        w.pack(i0, rows, qkv + sh.row(b, i0) + h * hs, sh.C3, dout + (static_cast<int64_t>(b) * sh.Tn + i0) * sh.C + h * hs,
               sh.C);
      }
      for (int t = 0; t < Tp; ++t) {  // delta = rowsum(dout * out) stands for rowsum(dp * p)
        float sum = 0.0f;
        if (t < sh.Tn) {
          const float* dr = dout + (static_cast<int64_t>(b) * sh.Tn + t) * sh.C + h * hs;
          const float* orow = out + (static_cast<int64_t>(b) * sh.Tn + t) * sh.C + h * hs;
          for (int e = 0; e < hs; ++e) sum += dr[e] * orow[e];
        }
        w.delta[t] = sum;
        w.lse[t] = t < sh.Tn ? lse[static_cast<int64_t>(bh) * sh.Tn + t] : 0.0f;
      }
      std::fill(w.dq.begin(), w.dq.end(), 0.0f);
      for (int jt = 0; jt < nt; ++jt) {
        const int j0 = jt * kTile;
        const int64_t pk = (static_cast<int64_t>(b) * sh.NKV + g) * nt + jt;
        std::fill(w.dk(), w.dk() + 2 * te, 0.0f);
        const int it_last = window > 0 ? std::min(nt - 1, (j0 + kTile - 2 + window) / kTile) : nt - 1;
        for (int it = jt; it <= it_last; ++it) {
          w.tile_pair(ConsecutiveMask{it * kTile, j0, window}, it * kTile, sh.scale, kt.data() + pk * te,
                      vt.data() + pk * te, k.data() + pk * te);
        }
        const int cols = std::min(kTile, sh.Tn - j0);
        for (int c = 0; c < cols; ++c) {
          float* dk_dst;
          float* dv_dst;
          if (sh.group == 1) {
            dk_dst = dqkv + sh.row(b, j0 + c) + sh.C + g * hs;
            dv_dst = dk_dst + sh.kv;
          } else {
            dk_dst = head_dkv.data() + ((static_cast<int64_t>(bh) * 2) * sh.Tn + j0 + c) * hs;
            dv_dst = dk_dst + static_cast<int64_t>(sh.Tn) * hs;
          }
          std::copy(w.dk() + c * hs, w.dk() + (c + 1) * hs, dk_dst);
          std::copy(w.dv() + c * hs, w.dv() + (c + 1) * hs, dv_dst);
        }
      }
      for (int t = 0; t < sh.Tn; ++t) {
        std::copy(w.dq.data() + static_cast<int64_t>(t) * hs, w.dq.data() + static_cast<int64_t>(t + 1) * hs,
                  dqkv + sh.row(b, t) + h * hs);
      }
    }
  }
  if (sh.group == 1) return;
  sum_group_heads(head_dkv, sh.B, sh.Tn, sh.NH, sh.NKV, hs, dqkv + sh.C, dqkv + sh.C + sh.kv, sh.C3, true);
}

// ---- ring attention's per-block pieces (kernels/cpu/ring_attention.h) ---------------------------

// A ring block's keys and values packed per (batch row, key/value head, key tile), its keys'
// positions padded to whole tiles with INT_MAX (never attended) and each tile's position range.
struct RingKeys {
  int tiles = 0;
  std::vector<int> kpos;
  std::vector<PositionRange> ranges;
};

RingKeys ring_keys(const RingBlock& s) {
  RingKeys r;
  r.tiles = (s.Tk + kTile - 1) / kTile;
  r.kpos.assign(static_cast<size_t>(r.tiles) * kTile, std::numeric_limits<int>::max());
  std::copy(s.kpos, s.kpos + s.Tk, r.kpos.begin());
  for (int jt = 0; jt < r.tiles; ++jt) r.ranges.push_back(position_range(s.kpos + jt * kTile, std::min(kTile, s.Tk - jt * kTile)));
  return r;
}

// Packs every (batch row, key/value head, key tile) of the block's rows at src (k or v) with
// `pack` into dst[B][NKV][tiles][64 hs].
template <typename E>
void ring_pack(std::vector<E>& dst, const RingBlock& s, int NKV, int hs, int tiles, const float* src,
               void (*pack)(E*, const float*, int64_t, int, int)) {
  const int64_t packs = static_cast<int64_t>(s.B) * NKV * tiles, te = static_cast<int64_t>(kTile) * hs;
  dst.resize(static_cast<size_t>(packs * te));
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < packs; ++p) {
    const int bg = static_cast<int>(p / tiles), jt = static_cast<int>(p % tiles);
    const int b = bg / NKV, g = bg % NKV, j0 = jt * kTile;
    pack(dst.data() + p * te, src + (static_cast<int64_t>(b) * s.Tk + j0) * s.ldkv + g * hs, s.ldkv,
         std::min(kTile, s.Tk - j0), hs);
  }
}

template <typename E>
void ring_forward(const RingBlock& s, float* acc, float* m, float* l, const float* q, const float* k, const float* v) {
  const int NKV = s.NKV == 0 ? s.NH : s.NKV, hs = s.C / s.NH, group = s.NH / NKV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t te = static_cast<int64_t>(kTile) * hs;
  const RingKeys keys = ring_keys(s);
  std::vector<E> kt, vp;
  ring_pack<E>(kt, s, NKV, hs, keys.tiles, k, pack_transposed);
  if constexpr (std::is_same_v<E, float>) {
    ring_pack<E>(vp, s, NKV, hs, keys.tiles, v, pack_rows);
  } else {
    ring_pack<E>(vp, s, NKV, hs, keys.tiles, v, pack_row_pairs);
  }
  const int q_tiles = (s.Tq + kTile - 1) / kTile;
  const int64_t tasks = static_cast<int64_t>(s.B) * s.NH * q_tiles;
#pragma omp parallel
  {
    std::vector<float> buffer(static_cast<size_t>(kTile) * (kTile + hs + 2));
    float* sc = buffer.data();      // [64][64] scores, then probabilities
    float* o = sc + kTile * kTile;  // [64][hs] the tile's unnormalised output
    float* mt = o + kTile * hs;     // [64] running maxima
    float* lt = mt + kTile;         // [64] running sums
    std::vector<E> qp(static_cast<size_t>(te));
    std::vector<uint16_t> p16(std::is_same_v<E, float> ? 0 : kTile * kTile);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int bh = static_cast<int>(task / q_tiles), qt = static_cast<int>(task % q_tiles);
      const int b = bh / s.NH, h = bh % s.NH, g = h / group;
      const int i0 = qt * kTile, rows = std::min(kTile, s.Tq - i0);
      const PositionRange qr = position_range(s.qpos + i0, rows);
      pack_rows(qp.data(), q + (static_cast<int64_t>(b) * s.Tq + i0) * s.ldq + h * hs, s.ldq, rows, hs);
      const int64_t stat = static_cast<int64_t>(bh) * s.Tq + i0;  // the tile's first row in m, l
      for (int r = 0; r < kTile; ++r) {
        float* orow = o + r * hs;
        if (r < rows) {
          const float* src = acc + (static_cast<int64_t>(b) * s.Tq + i0 + r) * s.C + h * hs;
          std::copy(src, src + hs, orow);
          mt[r] = m[stat + r], lt[r] = l[stat + r];
        } else {
          std::fill(orow, orow + hs, 0.0f);
          mt[r] = -std::numeric_limits<float>::infinity(), lt[r] = 0.0f;
        }
      }
      for (int jt = 0; jt < keys.tiles; ++jt) {
        if (!ranges_meet(qr, keys.ranges[jt], s.window)) continue;  // wholly masked: never read
        const int64_t pk = (static_cast<int64_t>(b) * NKV + g) * keys.tiles + jt;
        scores(sc, qp.data(), kt.data() + pk * te, hs, scale);
        online_softmax(sc, PositionMask{s.qpos + i0, rows, keys.kpos.data() + jt * kTile, s.window}, mt, lt, o, hs);
        if constexpr (std::is_same_v<E, float>) {
          accumulate(o, hs, sc, kTile, 1, vp.data() + pk * te, hs, hs);  // o += p v
        } else {
          tile_to_bf16(p16.data(), sc);
          accumulate(o, hs, as_pairs(p16.data()), kTile / 2, 1, vp.data() + pk * te, hs, hs);
        }
      }
      for (int r = 0; r < rows; ++r) {
        std::copy(o + r * hs, o + (r + 1) * hs, acc + (static_cast<int64_t>(b) * s.Tq + i0 + r) * s.C + h * hs);
        m[stat + r] = mt[r], l[stat + r] = lt[r];
      }
    }
  }
}

template <typename E>
void ring_backward(const RingBlock& s, float* dq, float* dk, float* dv, const float* dout, const float* lse,
                   const float* delta, const float* q, const float* k, const float* v) {
  constexpr bool bf16 = !std::is_same_v<E, float>;
  const int NKV = s.NKV == 0 ? s.NH : s.NKV, hs = s.C / s.NH, group = s.NH / NKV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t te = static_cast<int64_t>(kTile) * hs;
  const RingKeys keys = ring_keys(s);
  // Per (b, g, key tile): k^T and v^T (the scores' and dp's right operands), k (dq's).
  std::vector<E> kt, vt, kr;
  ring_pack<E>(kt, s, NKV, hs, keys.tiles, k, pack_transposed);
  ring_pack<E>(vt, s, NKV, hs, keys.tiles, v, pack_transposed);
  if constexpr (bf16) {
    ring_pack<E>(kr, s, NKV, hs, keys.tiles, k, pack_row_pairs);
  } else {
    ring_pack<E>(kr, s, NKV, hs, keys.tiles, k, pack_rows);
  }
  const int q_tiles = (s.Tq + kTile - 1) / kTile, Tp = q_tiles * kTile;
  std::vector<PositionRange> q_ranges;
  for (int it = 0; it < q_tiles; ++it) q_ranges.push_back(position_range(s.qpos + it * kTile, std::min(kTile, s.Tq - it * kTile)));
  // Grouped heads: each query head's dk, dv [B][NH][2][Tk][hs], summed per group in head order after.
  std::vector<float> head_dkv(group > 1 ? static_cast<size_t>(2) * s.B * s.NH * s.Tk * hs : 0);
  const int tasks = s.B * s.NH;
#pragma omp parallel
  {
    BackwardScratch<E> w(Tp, hs);
#pragma omp for schedule(dynamic, 1)
    for (int bh = 0; bh < tasks; ++bh) {
      const int b = bh / s.NH, h = bh % s.NH, g = h / group;
      for (int it = 0; it < q_tiles; ++it) {
        const int i0 = it * kTile, rows = std::min(kTile, s.Tq - i0);
        w.pack(i0, rows, q + (static_cast<int64_t>(b) * s.Tq + i0) * s.ldq + h * hs, s.ldq,
               dout + (static_cast<int64_t>(b) * s.Tq + i0) * s.C + h * hs, s.C);
      }
      for (int t = 0; t < Tp; ++t) {
        w.delta[t] = t < s.Tq ? delta[static_cast<int64_t>(bh) * s.Tq + t] : 0.0f;
        w.lse[t] = t < s.Tq ? lse[static_cast<int64_t>(bh) * s.Tq + t] : 0.0f;
      }
      std::fill(w.dq.begin(), w.dq.end(), 0.0f);
      for (int jt = 0; jt < keys.tiles; ++jt) {
        const int j0 = jt * kTile;
        const int64_t pk = (static_cast<int64_t>(b) * NKV + g) * keys.tiles + jt;
        std::fill(w.dk(), w.dk() + 2 * te, 0.0f);
        for (int it = 0; it < q_tiles; ++it) {
          if (!ranges_meet(q_ranges[it], keys.ranges[jt], s.window)) continue;
          const int i0 = it * kTile, rows = std::min(kTile, s.Tq - i0);
          w.tile_pair(PositionMask{s.qpos + i0, rows, keys.kpos.data() + j0, s.window}, i0, scale, kt.data() + pk * te,
                      vt.data() + pk * te, kr.data() + pk * te);
        }
        const int cols = std::min(kTile, s.Tk - j0);
        for (int c = 0; c < cols; ++c) {
          const float* dkt = w.dk() + c * hs;
          const float* dvt = w.dv() + c * hs;
          if (group == 1) {
            float* dk_dst = dk + (static_cast<int64_t>(b) * s.Tk + j0 + c) * s.ldkv + g * hs;
            float* dv_dst = dv + (static_cast<int64_t>(b) * s.Tk + j0 + c) * s.ldkv + g * hs;
            for (int e = 0; e < hs; ++e) dk_dst[e] += dkt[e], dv_dst[e] += dvt[e];
          } else {
            float* dst = head_dkv.data() + ((static_cast<int64_t>(bh) * 2) * s.Tk + j0 + c) * hs;
            std::copy(dkt, dkt + hs, dst);
            std::copy(dvt, dvt + hs, dst + static_cast<int64_t>(s.Tk) * hs);
          }
        }
      }
      for (int t = 0; t < s.Tq; ++t) {
        float* dst = dq + (static_cast<int64_t>(b) * s.Tq + t) * s.ldq + h * hs;
        const float* src = w.dq.data() + static_cast<int64_t>(t) * hs;
        for (int e = 0; e < hs; ++e) dst[e] += src[e];
      }
    }
  }
  if (group == 1) return;
  sum_group_heads(head_dkv, s.B, s.Tk, s.NH, NKV, hs, dk, dv, s.ldkv, false);
}

}  // namespace

void blockwise_attention_forward_vector(MatmulPrecision precision, float* out, float* lse, const float* qkv, int B,
                                        int Tn, int C, int NH, int NKV, int window) {
  const Shape sh(B, Tn, C, NH, NKV);
  if (precision == MatmulPrecision::bf16) {
    forward<uint16_t>(sh, out, lse, qkv, window);
  } else {
    forward<float>(sh, out, lse, qkv, window);
  }
}

void ring_attention_forward_vector(MatmulPrecision precision, float* acc, float* m, float* l, const float* q,
                                   const float* k, const float* v, const RingBlock& s) {
  if (precision == MatmulPrecision::bf16) {
    ring_forward<uint16_t>(s, acc, m, l, q, k, v);
  } else {
    ring_forward<float>(s, acc, m, l, q, k, v);
  }
}

void ring_attention_backward_vector(MatmulPrecision precision, float* dq, float* dk, float* dv, const float* dout,
                                    const float* lse, const float* delta, const float* q, const float* k,
                                    const float* v, const RingBlock& s) {
  if (precision == MatmulPrecision::bf16) {
    ring_backward<uint16_t>(s, dq, dk, dv, dout, lse, delta, q, k, v);
  } else {
    ring_backward<float>(s, dq, dk, dv, dout, lse, delta, q, k, v);
  }
}

void blockwise_attention_backward_vector(MatmulPrecision precision, float* dqkv, const float* dout, const float* out,
                                         const float* lse, const float* qkv, int B, int Tn, int C, int NH, int NKV,
                                         int window) {
  const Shape sh(B, Tn, C, NH, NKV);
  if (precision == MatmulPrecision::bf16) {
    backward<uint16_t>(sh, dqkv, dout, out, lse, qkv, window);
  } else {
    backward<float>(sh, dqkv, dout, out, lse, qkv, window);
  }
}

}  // namespace keel::ops

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
