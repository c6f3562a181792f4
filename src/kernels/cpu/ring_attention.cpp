#include "kernels/cpu/ring_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/blas.h"
#include "kernels/cpu/vmath.h"

namespace keel::ops {

namespace {

constexpr int kTile = 64;  // rows of a query tile and of a key tile

inline bool allowed(int i, int j, int window) { return j <= i && (window <= 0 || j > i - window); }

}  // namespace

PositionRange position_range(const int* pos, int n) {
  PositionRange r{pos[0], pos[0]};
  for (int t = 1; t < n; ++t) r.lo = std::min(r.lo, pos[t]), r.hi = std::max(r.hi, pos[t]);
  return r;
}

bool ring_block_visible(const RingBlock& s) {
  if (s.Tq == 0 || s.Tk == 0) return false;
  for (int i0 = 0; i0 < s.Tq; i0 += kTile) {
    const int rows = std::min(kTile, s.Tq - i0);
    for (int j0 = 0; j0 < s.Tk; j0 += kTile) {
      const int cols = std::min(kTile, s.Tk - j0);
      if (!ranges_meet(position_range(s.qpos + i0, rows), position_range(s.kpos + j0, cols), s.window)) continue;
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c)
          if (allowed(s.qpos[i0 + r], s.kpos[j0 + c], s.window)) return true;
    }
  }
  return false;
}

template <typename T>
void ring_attention_begin(T* acc, T* m, T* l, const RingBlock& s) {
  const int64_t rows = static_cast<int64_t>(s.B) * s.NH * s.Tq;
  std::fill(acc, acc + static_cast<int64_t>(s.B) * s.Tq * s.C, T(0));
  std::fill(m, m + rows, -std::numeric_limits<T>::infinity());
  std::fill(l, l + rows, T(0));
}

template <typename T>
void ring_attention_forward_block(MatmulPrecision precision, T* acc, T* m, T* l, const T* q, const T* k, const T* v,
                                  const RingBlock& s) {
  if constexpr (std::is_same_v<T, float>) {
    if (blockwise_attention_vectorized(precision, s.C / s.NH)) {
      ring_attention_forward_vector(precision, acc, m, l, q, k, v, s);
      return;
    }
  }
  const int NKV = s.NKV == 0 ? s.NH : s.NKV, hs = s.C / s.NH, group = s.NH / NKV;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const int q_tiles = (s.Tq + kTile - 1) / kTile;
#pragma omp parallel
  {
    std::vector<T> buffer(static_cast<size_t>(kTile) * (kTile + hs));
    T* p = buffer.data();          // [64, 64] scores, then probabilities
    T* o = p + kTile * kTile;      // [64, hs] the tile's unnormalised output
#pragma omp for schedule(static)
    for (int task = 0; task < s.B * s.NH * q_tiles; ++task) {
      const int bh = task / q_tiles, qt = task % q_tiles;
      const int b = bh / s.NH, h = bh % s.NH, g = h / group;
      const int i0 = qt * kTile, rows = std::min(kTile, s.Tq - i0);
      const PositionRange qr = position_range(s.qpos + i0, rows);
      const T* qt_rows = q + (static_cast<int64_t>(b) * s.Tq + i0) * s.ldq + h * hs;
      T* mt = m + static_cast<int64_t>(bh) * s.Tq + i0;
      T* lt = l + static_cast<int64_t>(bh) * s.Tq + i0;
      for (int r = 0; r < rows; ++r) {
        const T* src = acc + (static_cast<int64_t>(b) * s.Tq + i0 + r) * s.C + h * hs;
        std::copy(src, src + hs, o + r * hs);
      }
      for (int j0 = 0; j0 < s.Tk; j0 += kTile) {
        const int cols = std::min(kTile, s.Tk - j0);
        if (!ranges_meet(qr, position_range(s.kpos + j0, cols), s.window)) continue;  // wholly masked: never read
        const int64_t at = (static_cast<int64_t>(b) * s.Tk + j0) * s.ldkv + g * hs;
        gemm<T>(precision, false, true, rows, cols, hs, scale, qt_rows, static_cast<int>(s.ldq), k + at,
                static_cast<int>(s.ldkv), T(0), p, kTile);
        for (int r = 0; r < rows; ++r) {
          const int i = s.qpos[i0 + r];
          T* prow = p + r * kTile;
          T mx = mt[r];
          bool any = false;
          for (int c = 0; c < cols; ++c) {
            if (!allowed(i, s.kpos[j0 + c], s.window)) continue;
            mx = std::max(mx, prow[c]);
            any = true;
          }
          if (!any) {
            std::fill(prow, prow + cols, T(0));
            continue;
          }
          const T correction = vmath::exp(mt[r] - mx);
          T sum = 0;
          for (int c = 0; c < cols; ++c) {
            prow[c] = allowed(i, s.kpos[j0 + c], s.window) ? vmath::exp(prow[c] - mx) : T(0);
            sum += prow[c];
          }
          lt[r] = lt[r] * correction + sum;
          mt[r] = mx;
          T* orow = o + r * hs;
          for (int d = 0; d < hs; ++d) orow[d] *= correction;
        }
        gemm<T>(precision, false, false, rows, hs, cols, T(1), p, kTile, v + at, static_cast<int>(s.ldkv), T(1), o,
                hs);  // o += p v
      }
      for (int r = 0; r < rows; ++r) {
        T* dst = acc + (static_cast<int64_t>(b) * s.Tq + i0 + r) * s.C + h * hs;
        std::copy(o + r * hs, o + (r + 1) * hs, dst);
      }
    }
  }
}

template <typename T>
void ring_attention_finish(T* out, T* lse, const T* acc, const T* m, const T* l, const RingBlock& s) {
  const int hs = s.C / s.NH;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < static_cast<int64_t>(s.B) * s.Tq; ++bt) {
    const int64_t b = bt / s.Tq, t = bt % s.Tq;
    for (int h = 0; h < s.NH; ++h) {
      const int64_t row = (b * s.NH + h) * s.Tq + t;
      const T inv = T(1) / l[row];
      const T* src = acc + bt * s.C + h * hs;
      T* dst = out + bt * s.C + h * hs;
      for (int d = 0; d < hs; ++d) dst[d] = src[d] * inv;
      lse[row] = m[row] + std::log(l[row]);
    }
  }
}

template <typename T>
void ring_attention_delta(T* delta, const T* dout, const T* out, const RingBlock& s) {
  const int hs = s.C / s.NH;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < static_cast<int64_t>(s.B) * s.Tq; ++bt) {
    const int64_t b = bt / s.Tq, t = bt % s.Tq;
    for (int h = 0; h < s.NH; ++h) {
      T sum = 0;
      for (int e = 0; e < hs; ++e) sum += dout[bt * s.C + h * hs + e] * out[bt * s.C + h * hs + e];
      delta[(b * s.NH + h) * s.Tq + t] = sum;
    }
  }
}

template <typename T>
void ring_attention_backward_block(MatmulPrecision precision, T* dq, T* dk, T* dv, const T* dout, const T* lse,
                                   const T* delta, const T* q, const T* k, const T* v, const RingBlock& s) {
  if constexpr (std::is_same_v<T, float>) {
    if (blockwise_attention_vectorized(precision, s.C / s.NH)) {
      ring_attention_backward_vector(precision, dq, dk, dv, dout, lse, delta, q, k, v, s);
      return;
    }
  }
  const int NKV = s.NKV == 0 ? s.NH : s.NKV, hs = s.C / s.NH, group = s.NH / NKV;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const int ldq = static_cast<int>(s.ldq), ldkv = static_cast<int>(s.ldkv);
  // A task owns a batch row's key/value head: its keys' gradients and its query heads' dq rows.
#pragma omp parallel
  {
    std::vector<T> buffer(static_cast<size_t>(2) * kTile * kTile);
    T* p = buffer.data();         // [64, 64] probabilities
    T* dp = p + kTile * kTile;    // [64, 64] their gradient, then the scores'
#pragma omp for schedule(static)
    for (int bg = 0; bg < s.B * NKV; ++bg) {
      const int b = bg / NKV, g = bg % NKV;
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const int64_t bh = static_cast<int64_t>(b) * s.NH + h;
        for (int i0 = 0; i0 < s.Tq; i0 += kTile) {
          const int rows = std::min(kTile, s.Tq - i0);
          const PositionRange qr = position_range(s.qpos + i0, rows);
          const int64_t qat = (static_cast<int64_t>(b) * s.Tq + i0) * s.ldq + h * hs;
          const T* d = dout + (static_cast<int64_t>(b) * s.Tq + i0) * s.C + h * hs;
          for (int j0 = 0; j0 < s.Tk; j0 += kTile) {
            const int cols = std::min(kTile, s.Tk - j0);
            if (!ranges_meet(qr, position_range(s.kpos + j0, cols), s.window)) continue;
            const int64_t kat = (static_cast<int64_t>(b) * s.Tk + j0) * s.ldkv + g * hs;
            gemm<T>(precision, false, true, rows, cols, hs, scale, q + qat, ldq, k + kat, ldkv, T(0), p, kTile);
            for (int r = 0; r < rows; ++r) {
              const int i = s.qpos[i0 + r];
              const T mr = lse[bh * s.Tq + i0 + r];
              T* prow = p + r * kTile;
              for (int c = 0; c < cols; ++c)
                prow[c] = allowed(i, s.kpos[j0 + c], s.window) ? vmath::exp(prow[c] - mr) : T(0);
            }
            gemm<T>(precision, true, false, cols, hs, rows, T(1), p, kTile, d, s.C, T(1), dv + kat, ldkv);  // dv += p^T dout
            gemm<T>(precision, false, true, rows, cols, hs, T(1), d, s.C, v + kat, ldkv, T(0), dp, kTile);  // dp = dout v^T
            for (int r = 0; r < rows; ++r) {  // ds = p (dp - delta) scale
              const T dl = delta[bh * s.Tq + i0 + r];
              T* dprow = dp + r * kTile;
              const T* prow = p + r * kTile;
              for (int c = 0; c < cols; ++c) dprow[c] = prow[c] * (dprow[c] - dl) * scale;
            }
            gemm<T>(precision, false, false, rows, hs, cols, T(1), dp, kTile, k + kat, ldkv, T(1), dq + qat, ldq);  // dq += ds k
            gemm<T>(precision, true, false, cols, hs, rows, T(1), dp, kTile, q + qat, ldq, T(1), dk + kat, ldkv);  // dk += ds^T q
          }
        }
      }
    }
  }
}

#define KEEL_RING_INSTANTIATE(T)                                                                                     \
  template void ring_attention_begin<T>(T*, T*, T*, const RingBlock&);                                               \
  template void ring_attention_forward_block<T>(MatmulPrecision, T*, T*, T*, const T*, const T*, const T*,          \
                                                const RingBlock&);                                                   \
  template void ring_attention_finish<T>(T*, T*, const T*, const T*, const T*, const RingBlock&);                    \
  template void ring_attention_delta<T>(T*, const T*, const T*, const RingBlock&);                                   \
  template void ring_attention_backward_block<T>(MatmulPrecision, T*, T*, T*, const T*, const T*, const T*, const T*, \
                                                 const T*, const T*, const RingBlock&);
KEEL_RING_INSTANTIATE(float)
KEEL_RING_INSTANTIATE(double)

}  // namespace keel::ops
