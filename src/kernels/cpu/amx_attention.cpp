#include "kernels/cpu/amx_attention.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <dnnl.hpp>
#include <limits>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/vmath.h"

namespace keel::ops {

namespace {

// AMX-BF16 here, its tile state granted to this process by the OS, and oneDNN allowed to use it
// (ONEDNN_MAX_CPU_ISA below AMX turns this route off with oneDNN's own, so that one setting
// compares the two engines).
bool amx_ready() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    const bool tile = ((d >> 24) & 1u) != 0, bf16 = ((d >> 22) & 1u) != 0;
    if (!tile || !bf16 || !cpu_has_bf16()) return false;
    const unsigned isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const unsigned amx = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_amx);
    if ((isa & amx) != amx) return false;
    // Linux gives a process the tiles' state (XTILEDATA, feature 18) only on request.
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return yes;
}

int round_up(int n, int m) { return (n + m - 1) / m * m; }

template <typename T>
T* grow(std::vector<T>& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

}  // namespace

bool amx_attention(MatmulPrecision precision, int head_size, int Tn) {
  return precision == MatmulPrecision::bf16 && head_size > 0 && head_size % 32 == 0 && head_size <= 256 && Tn >= 1 &&
         Tn <= kAmxAttentionMaxTokens && amx_ready();
}

}  // namespace keel::ops

// Everything below runs only where amx_attention said so: it may use AVX-512, AVX512_BF16 and AMX
// whatever the build's -march.
#if defined(__clang__)
#pragma clang attribute push(                                                                             \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,amx-tile,amx-bf16"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,amx-tile,amx-bf16")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include "kernels/cpu/vmath512.h"

namespace keel::ops {

namespace {

// Tiles 0-7, each 16 rows of 64 bytes: 16 x 16 floats (sums), 16 x 32 bf16 (left operands) or
// 16 pairs x 16 columns of bf16 pairs (right operands, the "VNNI" layout: a dword holds the
// elements of two consecutive k for one column).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configured on entry and released on exit of each head: oneDNN's kernels configure their own.
struct Tiles {
  Tiles() {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
      config.colsb[t] = 64;
      config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

__mmask16 first_lanes(int n) { return n >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << n) - 1u); }

// 16 floats (the first n, zeros after) as 16 bf16 (nearest even).
__m256i bf16x16(const float* src, int n) {
  const __m256bh bits = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(first_lanes(n), src));
  __m256i out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The largest of x[0, n) (n >= 1).
float row_max(const float* x, int n) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = lowest;
  for (int j = 0; j < n; j += 16) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(lowest, first_lanes(n - j), x + j));
  return _mm512_reduce_max_ps(m);
}

// dst[0, width) = bf16(src[0, n)) then zeros (width a multiple of 16).
void convert_row(uint16_t* dst, const float* src, int n, int width) {
  for (int j = 0; j < width; j += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), bf16x16(src + j, std::clamp(n - j, 0, 16)));
  }
}

// Rows 2p and 2p+1 of a matrix as one row of pairs: dst[m] = (r0[m], r1[m]) for m in [0, width),
// from bf16 rows.
void pair_bf16_rows(uint32_t* dst, const uint16_t* r0, const uint16_t* r1, int width) {
  for (int m = 0; m < width; m += 16) {
    const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + m)));
    const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + m)));
    _mm512_storeu_si512(dst + m, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
  }
}

// The same from float rows of n valid elements (zeros after, up to width).
void pair_float_rows(uint32_t* dst, const float* r0, const float* r1, int n, int width) {
  for (int m = 0; m < width; m += 16) {
    const int valid = std::clamp(n - m, 0, 16);
    const __m512i a = r0 ? _mm512_cvtepu16_epi32(bf16x16(r0 + m, valid)) : _mm512_setzero_si512();
    const __m512i b = r1 ? _mm512_cvtepu16_epi32(bf16x16(r1 + m, valid)) : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + m, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
  }
}

// x [Tn rows at stride ld, hs columns] as the right operand of a product with x^T on the right
// (scores = q k^T, dout v^T), in blocks of 16 keys, each block's pairs one after another: the
// dword of key j and pair p, (x[j][2p], x[j][2p+1]), at [j / 16][p][j % 16] (zero past Tn), so
// that a tile of 16 pairs x 16 keys is 1 KB in a row. Through `rows` (Tp x hs bf16, x's rows).
void pairs_transposed(uint32_t* dst, uint16_t* rows, const float* x, int ld, int Tn, int Tp, int hs) {
  for (int j = 0; j < Tp; ++j) {
    convert_row(rows + static_cast<int64_t>(j) * hs, j < Tn ? x + static_cast<int64_t>(j) * ld : x, j < Tn ? hs : 0, hs);
  }
  const int pairs = hs / 2;
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(pairs));
  for (int j = 0; j < Tp; j += 16) {
    const int* base = reinterpret_cast<const int*>(rows + static_cast<int64_t>(j) * hs);
    uint32_t* block = dst + static_cast<int64_t>(j) * pairs;
    for (int p = 0; p < pairs; ++p) _mm512_storeu_si512(block + 16 * p, _mm512_i32gather_epi32(index, base + p, 4));
  }
}

// One block of 16 query rows' scores against keys [0, send): sc[r][j] = rows[r] . x[j] (sc's row
// stride Tp), rows bf16 [16 x hs] (stride hs), keys as pairs_transposed lays them out.
void score_block(float* sc, int Tp, const uint16_t* rows, int hs, const uint32_t* keys, int send) {
  const int64_t block = static_cast<int64_t>(hs / 2) * 16, sc_stride = static_cast<int64_t>(Tp) * 4;
  for (int j0 = 0; j0 < send; j0 += 16) {
    const uint32_t* b = keys + (j0 / 16) * block;
    _tile_zero(0);
    for (int kk = 0; kk < hs; kk += 32) {
      _tile_loadd(4, rows + kk, hs * 2);
      _tile_loadd(5, b + (kk / 2) * 16, 64);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, sc + j0, sc_stride);
  }
}

// x [Tn rows, hs columns] as a right operand with the rows as k: dst[jp][n] = (x[2jp][n],
// x[2jp+1][n]) for jp < Tp/2 (zero rows past Tn).
void pairs_of_rows(uint32_t* dst, const float* x, int ld, int Tn, int Tp, int hs) {
  for (int jp = 0; jp < Tp / 2; ++jp) {
    const int j = 2 * jp;
    pair_float_rows(dst + static_cast<int64_t>(jp) * hs, j < Tn ? x + static_cast<int64_t>(j) * ld : nullptr,
                    j + 1 < Tn ? x + static_cast<int64_t>(j + 1) * ld : nullptr, hs, hs);
  }
}

// x^T in bf16: dst[n][t] = x[t][n] for t < Tp (zero past Tn), gathered 16 rows at a time.
void transposed_bf16(uint16_t* dst, const float* x, int ld, int Tn, int Tp, int hs) {
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(ld));
  for (int t = 0; t < Tp; t += 16) {
    const __mmask16 valid = first_lanes(std::max(0, Tn - t));
    const float* base = x + static_cast<int64_t>(std::min(t, Tn - 1)) * ld;
    for (int n = 0; n < hs; ++n) {
      const __m512 column = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, index, base + n, 4);
      const __m256bh bits = _mm512_cvtneps_pbh(column);
      std::memcpy(dst + static_cast<int64_t>(n) * Tp + t, &bits, sizeof(bits));
    }
  }
}

// C[16 x (16 NT)] = A[16 x K] B[K x 16 NT] over k in [k0, k1) (multiples of 32), A bf16 rows at
// `a` (stride lda elements, starting at column 0), B in pairs at `b` (row kp at b + kp * ldb,
// column block t at + 16 t); stored at c (stride ldc floats).
template <int NT>
void tile_product(const uint16_t* a, int lda, const uint32_t* b, int ldb, int k0, int k1, float* c, int ldc) {
  static_assert(NT == 2 || NT == 4);
  const int64_t sc = static_cast<int64_t>(ldc) * 4;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NT == 4) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t sa = static_cast<int64_t>(lda) * 2, sb = static_cast<int64_t>(ldb) * 4;
  for (int k = k0; k < k1; k += 32) {
    const uint32_t* bk = b + static_cast<int64_t>(k / 2) * ldb;
    _tile_loadd(4, a + k, sa);
    _tile_loadd(5, bk, sb);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, bk + 16, sb);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (NT == 4) {
      _tile_loadd(7, bk + 32, sb);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, bk + 48, sb);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, sc);
  _tile_stored(1, c + 16, sc);
  if constexpr (NT == 4) {
    _tile_stored(2, c + 32, sc);
    _tile_stored(3, c + 48, sc);
  }
}

// C[16 x hs] (stride ldc) = A[16 x K] B[K x hs] over k in [k0, k1), in column blocks of 64.
void tile_rows(const uint16_t* a, int lda, const uint32_t* b, int ldb, int k0, int k1, int hs, float* c, int ldc) {
  int n = 0;
  for (; n + 64 <= hs; n += 64) tile_product<4>(a, lda, b + n, ldb, k0, k1, c + n, ldc);
  for (; n + 32 <= hs; n += 32) tile_product<2>(a, lda, b + n, ldb, k0, k1, c + n, ldc);
}

// The first `rows` rows of a 16-row result block go to `out` (stride ldo): all 16 straight from
// the tiles, or through `staging` (16 x hs) where fewer rows remain.
template <typename Product>
void store_rows(float* out, int ldo, int rows, int hs, float* staging, Product product) {
  if (rows == 16) {
    product(out, ldo);
    return;
  }
  product(staging, hs);
  for (int r = 0; r < rows; ++r) std::memcpy(out + static_cast<int64_t>(r) * ldo, staging + r * hs, sizeof(float) * hs);
}

struct ForwardScratch {
  std::vector<uint16_t> q, p, rows;
  std::vector<uint32_t> k, v;
  std::vector<float> s, staging;
};

struct BackwardScratch {
  std::vector<uint16_t> dout, qt, doutt, ds, rows;
  std::vector<uint32_t> vt, k, dspairs, ppairs;
  std::vector<float> dp, t, staging;
};

}  // namespace

void amx_attention_head_forward(float* out, int ldo, float* att, const float* q, const float* k, const float* v,
                                int ld, int Tn, int hs, bool causal, float scale) {
  const int Tp = round_up(Tn, 32);
  thread_local ForwardScratch s;
  uint16_t* qb = grow(s.q, static_cast<size_t>(Tp) * hs);            // q's rows in bf16
  uint32_t* kt = grow(s.k, static_cast<size_t>(hs / 2) * Tp);        // k's pairs, transposed
  uint32_t* vv = grow(s.v, static_cast<size_t>(Tp / 2) * hs);        // v's rows in pairs
  float* sc = grow(s.s, static_cast<size_t>(16) * Tp);               // a block's scores
  uint16_t* pb = grow(s.p, static_cast<size_t>(16) * Tp);            // its probabilities in bf16
  float* staging = grow(s.staging, static_cast<size_t>(16) * hs);
  for (int t = 0; t < Tp; ++t) {
    convert_row(qb + static_cast<int64_t>(t) * hs, t < Tn ? q + static_cast<int64_t>(t) * ld : q, t < Tn ? hs : 0, hs);
  }
  pairs_transposed(kt, grow(s.rows, static_cast<size_t>(Tp) * hs), k, ld, Tn, Tp, hs);
  pairs_of_rows(vv, v, ld, Tn, Tp, hs);
  const Tiles tiles;
  for (int i0 = 0; i0 < Tn; i0 += 16) {
    const int rows = std::min(16, Tn - i0);
    // Keys of the block's scores (causal: up to its last row's diagonal) and of its products.
    const int send = causal ? i0 + 16 : Tp, kend = causal ? std::min(Tp, round_up(i0 + 16, 32)) : Tp;
    score_block(sc, Tp, qb + static_cast<int64_t>(i0) * hs, hs, kt, send);
    for (int r = 0; r < 16; ++r) {
      uint16_t* prow = pb + static_cast<int64_t>(r) * Tp;
      if (r >= rows) {
        std::memset(prow, 0, sizeof(uint16_t) * kend);
        continue;
      }
      const int i = i0 + r, n = causal ? i + 1 : Tn;  // keys [0, n) of query i
      float* row = sc + static_cast<int64_t>(r) * Tp;
      const __m512 vscale = _mm512_set1_ps(scale), mx = _mm512_set1_ps(row_max(row, n) * scale);  // (scale > 0)
      __m512 vsum = _mm512_setzero_ps();
      for (int j = 0; j < n; j += 16) {
        const __mmask16 m = first_lanes(n - j);
        const __m512 e = _mm512_maskz_mov_ps(m, vmath::exp16(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), vscale, mx)));
        _mm512_storeu_ps(row + j, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
      float* arow = att + static_cast<int64_t>(i) * Tn;
      for (int j = 0; j < std::max(Tn, kend); j += 16) {  // the row of att (zeros past n), its bf16 up to kend
        const __m512 p = j < n ? _mm512_maskz_mul_ps(first_lanes(n - j), _mm512_loadu_ps(row + j), inv)
                               : _mm512_setzero_ps();
        if (j < Tn) _mm512_mask_storeu_ps(arow + j, first_lanes(Tn - j), p);
        if (j < kend) {
          const __m256bh bits = _mm512_cvtneps_pbh(p);
          std::memcpy(prow + j, &bits, sizeof(bits));
        }
      }
    }
    store_rows(out + static_cast<int64_t>(i0) * ldo, ldo, rows, hs, staging, [&](float* c, int ldc) {
      tile_rows(pb, Tp, vv, hs, 0, kend, hs, c, ldc);
    });
  }
}

void amx_attention_head_backward(float* dq, float* dk, float* dv, int ld, bool accumulate, const float* dout, int ldo,
                                 const float* att, const float* q, const float* k, const float* v, int Tn, int hs,
                                 bool causal, float scale) {
  const int Tp = round_up(Tn, 32);
  thread_local BackwardScratch s;
  uint16_t* dob = grow(s.dout, static_cast<size_t>(Tp) * hs);           // dout's rows in bf16
  uint32_t* vt = grow(s.vt, static_cast<size_t>(hs / 2) * Tp);          // v's pairs, transposed
  uint32_t* kp = grow(s.k, static_cast<size_t>(Tp / 2) * hs);           // k's rows in pairs
  uint16_t* qt = grow(s.qt, static_cast<size_t>(hs) * Tp);              // q^T in bf16
  uint16_t* dot = grow(s.doutt, static_cast<size_t>(hs) * Tp);          // dout^T in bf16
  uint16_t* ds = grow(s.ds, static_cast<size_t>(Tp) * Tp);              // the scores' gradient in bf16
  uint32_t* dsp = grow(s.dspairs, static_cast<size_t>(Tp / 2) * Tp);    // its rows in pairs
  uint32_t* pp = grow(s.ppairs, static_cast<size_t>(Tp / 2) * Tp);      // the probabilities' rows in pairs
  float* dpb = grow(s.dp, static_cast<size_t>(16) * Tp);                // a block's dout v^T
  float* tb = grow(s.t, static_cast<size_t>(hs) * Tp);                  // dk^T or dv^T
  float* staging = grow(s.staging, static_cast<size_t>(16) * hs);
  for (int t = 0; t < Tp; ++t) {
    convert_row(dob + static_cast<int64_t>(t) * hs, t < Tn ? dout + static_cast<int64_t>(t) * ldo : dout, t < Tn ? hs : 0,
                hs);
  }
  pairs_transposed(vt, grow(s.rows, static_cast<size_t>(Tp) * hs), v, ld, Tn, Tp, hs);
  pairs_of_rows(kp, k, ld, Tn, Tp, hs);
  transposed_bf16(qt, q, ld, Tn, Tp, hs);
  transposed_bf16(dot, dout, ldo, Tn, Tp, hs);
  for (int ip = 0; ip < Tp / 2; ++ip) {
    const int i = 2 * ip;
    pair_float_rows(pp + static_cast<int64_t>(ip) * Tp, i < Tn ? att + static_cast<int64_t>(i) * Tn : nullptr,
                    i + 1 < Tn ? att + static_cast<int64_t>(i + 1) * Tn : nullptr, Tn, Tp);
  }
  const Tiles tiles;
  // dS, a block of 16 query rows at a time: dout v^T, then the softmax's backward.
  for (int i0 = 0; i0 < Tp; i0 += 16) {
    if (i0 >= Tn) {
      std::memset(ds + static_cast<int64_t>(i0) * Tp, 0, sizeof(uint16_t) * 16 * Tp);
      continue;
    }
    const int rows = std::min(16, Tn - i0), send = causal ? i0 + 16 : Tp;
    score_block(dpb, Tp, dob + static_cast<int64_t>(i0) * hs, hs, vt, send);
    for (int r = 0; r < 16; ++r) {
      uint16_t* dsrow = ds + static_cast<int64_t>(i0 + r) * Tp;
      if (r >= rows) {
        std::memset(dsrow, 0, sizeof(uint16_t) * Tp);
        continue;
      }
      const int i = i0 + r, last = causal ? i : Tn - 1;
      float* drow = dpb + static_cast<int64_t>(r) * Tp;
      const float* arow = att + static_cast<int64_t>(i) * Tn;
      float d = 0.0f;
#pragma omp simd reduction(+ : d)
      for (int j = 0; j <= last; ++j) d += arow[j] * drow[j];
#pragma omp simd
      for (int j = 0; j <= last; ++j) drow[j] = arow[j] * (drow[j] - d) * scale;
      convert_row(dsrow, drow, last + 1, Tp);
    }
  }
  for (int ip = 0; ip < Tp / 2; ++ip) {
    pair_bf16_rows(dsp + static_cast<int64_t>(ip) * Tp, ds + static_cast<int64_t>(2 * ip) * Tp,
                   ds + static_cast<int64_t>(2 * ip + 1) * Tp, Tp);
  }
  // dq = dS k, a block of 16 query rows at a time (causal: keys up to the block's diagonal).
  for (int i0 = 0; i0 < Tn; i0 += 16) {
    const int rows = std::min(16, Tn - i0), kend = causal ? std::min(Tp, round_up(i0 + 16, 32)) : Tp;
    store_rows(dq + static_cast<int64_t>(i0) * ld, ld, rows, hs, staging, [&](float* c, int ldc) {
      tile_rows(ds + static_cast<int64_t>(i0) * Tp, Tp, kp, hs, 0, kend, hs, c, ldc);
    });
  }
  // dk^T = q^T dS and dv^T = dout^T att, 16 channels by 64 keys at a time (causal: queries from
  // the keys' block on), then added into dk, dv transposed.
  auto transposed_product = [&](const uint16_t* at, const uint32_t* pairs, float* dst) {
    for (int n0 = 0; n0 < hs; n0 += 16) {
      int m0 = 0;
      for (; m0 + 64 <= Tp; m0 += 64) {
        tile_product<4>(at + static_cast<int64_t>(n0) * Tp, Tp, pairs + m0, Tp, causal ? m0 : 0, Tp,
                        tb + static_cast<int64_t>(n0) * Tp + m0, Tp);
      }
      for (; m0 < Tp; m0 += 32) {
        tile_product<2>(at + static_cast<int64_t>(n0) * Tp, Tp, pairs + m0, Tp, causal ? m0 : 0, Tp,
                        tb + static_cast<int64_t>(n0) * Tp + m0, Tp);
      }
    }
    const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(Tp));
    for (int j = 0; j < Tn; ++j) {
      float* row = dst + static_cast<int64_t>(j) * ld;
      for (int n = 0; n < hs; n += 16) {
        const __m512 x = _mm512_i32gather_ps(index, tb + static_cast<int64_t>(n) * Tp + j, 4);
        _mm512_storeu_ps(row + n, accumulate ? _mm512_add_ps(_mm512_loadu_ps(row + n), x) : x);
      }
    }
  };
  transposed_product(qt, dsp, dk);
  transposed_product(dot, pp, dv);
}

}  // namespace keel::ops

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
