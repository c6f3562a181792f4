#include "kernels/cpu/ops.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/blas.h"
#include "kernels/cpu/vmath.h"

namespace keel::ops {

namespace {

// Splits [0, n) into omp_get_num_threads() contiguous ranges; the calling thread's range.
// Used for reductions over rows where each thread must own whole output columns so that
// sums run in a fixed order (determinism).
inline void thread_range(int64_t n, int64_t* begin, int64_t* end) {
  const int64_t threads = omp_get_num_threads();
  const int64_t t = omp_get_thread_num();
  *begin = n * t / threads;
  *end = n * (t + 1) / threads;
}

template <typename T>
T gelu_scale() {
  return static_cast<T>(0.7978845608028654);  // sqrt(2/pi)
}

}  // namespace

// ---- embedding ---------------------------------------------------------------------------------

template <typename T>
void encoder_forward(T* out, const int* tokens, const T* wte, const T* wpe, int B, int Tn, int C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < static_cast<int64_t>(B) * Tn; ++n) {
    const T* e = wte + static_cast<int64_t>(tokens[n]) * C;
    const T* p = wpe + (n % Tn) * C;
    T* o = out + n * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] = e[c] + p[c];
  }
}

template <typename T>
void encoder_backward_weight(T* dwte, T* dwpe, const T* dout, const int* tokens, int B, int Tn, int C) {
  const int64_t N = static_cast<int64_t>(B) * Tn;
#pragma omp parallel
  {
    int64_t c0, c1;
    thread_range(C, &c0, &c1);
    for (int64_t n = 0; n < N; ++n) {
      const T* d = dout + n * C;
      T* e = dwte + static_cast<int64_t>(tokens[n]) * C;
      T* p = dwpe + (n % Tn) * C;
      for (int64_t c = c0; c < c1; ++c) {
        e[c] += d[c];
        p[c] += d[c];
      }
    }
  }
}

// ---- layernorm ---------------------------------------------------------------------------------

namespace {
template <typename T>
inline void layernorm_row(T* o, T* mean_out, T* rstd_out, const T* x, const T* w, const T* b, int C) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int c = 0; c < C; ++c) sum += x[c];
  const T m = sum / C;
  T var = 0;
#pragma omp simd reduction(+ : var)
  for (int c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
  const T s = T(1) / std::sqrt(var / C + static_cast<T>(1e-5));
#pragma omp simd
  for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * s * w[c] + b[c];
  *mean_out = m;
  *rstd_out = s;
}
}  // namespace

template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int N, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    layernorm_row(out + static_cast<int64_t>(n) * C, mean + n, rstd + n, inp + static_cast<int64_t>(n) * C, w, b, C);
  }
}

template <typename T>
void residual_layernorm_forward(T* res, T* out, T* mean, T* rstd, const T* a, const T* b_in, const T* w,
                                const T* b, int N, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const int64_t off = static_cast<int64_t>(n) * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) res[off + c] = a[off + c] + b_in[off + c];
    layernorm_row(out + off, mean + n, rstd + n, res + off, w, b, C);
  }
}

template <typename T>
void layernorm_backward_input(T* dinp, const T* dout, const T* inp, const T* mean, const T* rstd, const T* w,
                              int N, int C, bool accumulate) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const int64_t off = static_cast<int64_t>(n) * C;
    const T* x = inp + off;
    const T* d = dout + off;
    const T m = mean[n], s = rstd[n];
    T dnorm_mean = 0, dnorm_xhat_mean = 0;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_xhat_mean)
    for (int c = 0; c < C; ++c) {
      const T dn = w[c] * d[c];
      dnorm_mean += dn;
      dnorm_xhat_mean += dn * (x[c] - m) * s;
    }
    dnorm_mean /= C;
    dnorm_xhat_mean /= C;
    T* di = dinp + off;
    if (accumulate) {
#pragma omp simd
      for (int c = 0; c < C; ++c) di[c] += (w[c] * d[c] - dnorm_mean - (x[c] - m) * s * dnorm_xhat_mean) * s;
    } else {
#pragma omp simd
      for (int c = 0; c < C; ++c) di[c] = (w[c] * d[c] - dnorm_mean - (x[c] - m) * s * dnorm_xhat_mean) * s;
    }
  }
}

template <typename T>
void layernorm_backward_weight(T* dw, T* db, const T* dout, const T* inp, const T* mean, const T* rstd, int N,
                               int C) {
#pragma omp parallel
  {
    int64_t c0, c1;
    thread_range(C, &c0, &c1);
    for (int n = 0; n < N; ++n) {
      const int64_t off = static_cast<int64_t>(n) * C;
      const T m = mean[n], s = rstd[n];
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) {
        dw[c] += dout[off + c] * (inp[off + c] - m) * s;
        db[c] += dout[off + c];
      }
    }
  }
}

// ---- linear ------------------------------------------------------------------------------------

template <typename T>
void linear_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) {
  if (bias != nullptr) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) std::copy(bias, bias + OC, out + static_cast<int64_t>(n) * OC);
  }
  gemm<T>(false, true, N, OC, C, T(1), inp, C, w, C, bias != nullptr ? T(1) : T(0), out, OC);
}

template <typename T>
void linear_backward_input(T* dinp, const T* dout, const T* w, int N, int C, int OC, bool accumulate) {
  gemm<T>(false, false, N, C, OC, T(1), dout, OC, w, C, accumulate ? T(1) : T(0), dinp, C);
}

template <typename T>
void linear_backward_weight(T* dw, T* dbias, const T* dout, const T* inp, int N, int C, int OC) {
  gemm<T>(true, false, OC, C, N, T(1), dout, OC, inp, C, T(1), dw, C);
  if (dbias != nullptr) {
#pragma omp parallel
    {
      int64_t o0, o1;
      thread_range(OC, &o0, &o1);
      for (int n = 0; n < N; ++n) {
        const T* d = dout + static_cast<int64_t>(n) * OC;
#pragma omp simd
        for (int64_t o = o0; o < o1; ++o) dbias[o] += d[o];
      }
    }
  }
}

// ---- GELU --------------------------------------------------------------------------------------

template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n) {
  const T k = gelu_scale<T>();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T x = inp[i];
    out[i] = T(0.5) * x * (T(1) + vmath::tanh(k * (x + T(0.044715) * x * x * x)));
  }
}

template <typename T>
void gelu_backward_input(T* dinp, const T* dout, const T* inp, int64_t n) {
  const T k = gelu_scale<T>();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T x = inp[i];
    const T u = k * (x + T(0.044715) * x * x * x);
    const T th = vmath::tanh(u);
    const T sech2 = T(1) - th * th;
    const T grad = T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * k * (T(1) + T(3) * T(0.044715) * x * x);
    dinp[i] = grad * dout[i];
  }
}

template <typename T>
void residual_forward(T* out, const T* a, const T* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// ---- attention ---------------------------------------------------------------------------------

template <typename T>
void attention_forward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH) {
  const int hs = C / NH;
  const int C3 = 3 * C;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  // One (batch, head) per iteration; BLAS runs single-threaded inside an OpenMP region.
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; ++bh) {
    const int b = bh / NH, h = bh % NH;
    const T* q = qkv + static_cast<int64_t>(b) * Tn * C3 + h * hs;
    const T* k = q + C;
    const T* v = q + 2 * C;
    T* a = att + static_cast<int64_t>(bh) * Tn * Tn;
    gemm<T>(false, true, Tn, Tn, hs, scale, q, C3, k, C3, T(0), a, Tn);
    for (int i = 0; i < Tn; ++i) {
      T* row = a + static_cast<int64_t>(i) * Tn;
      T mx = row[0];
#pragma omp simd reduction(max : mx)
      for (int j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
      T sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j <= i; ++j) {
        row[j] = vmath::exp(row[j] - mx);
        sum += row[j];
      }
      const T inv = T(1) / sum;
#pragma omp simd
      for (int j = 0; j <= i; ++j) row[j] *= inv;
      for (int j = i + 1; j < Tn; ++j) row[j] = T(0);
    }
    gemm<T>(false, false, Tn, hs, Tn, T(1), a, Tn, v, C3, T(0), out + static_cast<int64_t>(b) * Tn * C + h * hs, C);
  }
}

template <typename T>
void attention_backward_input(T* dqkv, const T* dout, const T* att, const T* qkv, int B, int Tn, int C, int NH) {
  const int hs = C / NH;
  const int C3 = 3 * C;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
#pragma omp parallel
  {
    // Per-thread T x T scratch, allocated once per thread and reused across steps.
    static thread_local std::vector<T> datt_buffer;
    if (datt_buffer.size() < static_cast<size_t>(Tn) * Tn) datt_buffer.resize(static_cast<size_t>(Tn) * Tn);
    T* datt = datt_buffer.data();
#pragma omp for schedule(static)
    for (int bh = 0; bh < B * NH; ++bh) {
      const int b = bh / NH, h = bh % NH;
      const int64_t base = static_cast<int64_t>(b) * Tn * C3 + h * hs;
      const T* q = qkv + base;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* dq = dqkv + base;
      T* dk = dq + C;
      T* dv = dq + 2 * C;
      const T* a = att + static_cast<int64_t>(bh) * Tn * Tn;
      const T* d = dout + static_cast<int64_t>(b) * Tn * C + h * hs;
      gemm<T>(false, true, Tn, Tn, hs, T(1), d, C, v, C3, T(0), datt, Tn);   // datt = dout v^T
      gemm<T>(true, false, Tn, hs, Tn, T(1), a, Tn, d, C, T(0), dv, C3);      // dv = att^T dout
      for (int i = 0; i < Tn; ++i) {  // softmax backward, in place, then the 1/sqrt(hs) scale
        const T* arow = a + static_cast<int64_t>(i) * Tn;
        T* drow = datt + static_cast<int64_t>(i) * Tn;
        T dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int j = 0; j <= i; ++j) dot += arow[j] * drow[j];
#pragma omp simd
        for (int j = 0; j <= i; ++j) drow[j] = arow[j] * (drow[j] - dot) * scale;
        for (int j = i + 1; j < Tn; ++j) drow[j] = T(0);
      }
      gemm<T>(false, false, Tn, hs, Tn, T(1), datt, Tn, k, C3, T(0), dq, C3);  // dq = dpre k
      gemm<T>(true, false, Tn, hs, Tn, T(1), datt, Tn, q, C3, T(0), dk, C3);   // dk = dpre^T q
    }
  }
}

// ---- loss --------------------------------------------------------------------------------------

template <typename T>
void crossentropy_forward(T* losses, T* logits, const int* targets, int N, int V, int Vp, T grad_scale) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    T* row = logits + static_cast<int64_t>(n) * Vp;
    T mx = row[0];
#pragma omp simd reduction(max : mx)
    for (int j = 1; j < V; ++j) mx = std::max(mx, row[j]);
    // exp(row - mx) is kept in `row` when a gradient is wanted, saving a second exp pass.
    T sum = 0;
    const int t = targets[n];
    const T target_logit = row[t];
    if (grad_scale != T(0)) {
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < V; ++j) {
        row[j] = vmath::exp(row[j] - mx);
        sum += row[j];
      }
      const T inv = grad_scale / sum;
#pragma omp simd
      for (int j = 0; j < V; ++j) row[j] *= inv;
      row[t] -= grad_scale;
      for (int j = V; j < Vp; ++j) row[j] = T(0);
    } else {
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < V; ++j) sum += vmath::exp(row[j] - mx);
    }
    losses[n] = std::log(sum) + mx - target_logit;
  }
}

#define KEEL_INSTANTIATE(T)                                                                                     \
  template void encoder_forward<T>(T*, const int*, const T*, const T*, int, int, int);                          \
  template void encoder_backward_weight<T>(T*, T*, const T*, const int*, int, int, int);                        \
  template void layernorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int, int);                       \
  template void residual_layernorm_forward<T>(T*, T*, T*, T*, const T*, const T*, const T*, const T*, int, int); \
  template void layernorm_backward_input<T>(T*, const T*, const T*, const T*, const T*, const T*, int, int, bool); \
  template void layernorm_backward_weight<T>(T*, T*, const T*, const T*, const T*, const T*, int, int);         \
  template void linear_forward<T>(T*, const T*, const T*, const T*, int, int, int);                             \
  template void linear_backward_input<T>(T*, const T*, const T*, int, int, int, bool);                          \
  template void linear_backward_weight<T>(T*, T*, const T*, const T*, int, int, int);                           \
  template void gelu_forward<T>(T*, const T*, int64_t);                                                         \
  template void gelu_backward_input<T>(T*, const T*, const T*, int64_t);                                        \
  template void residual_forward<T>(T*, const T*, const T*, int64_t);                                           \
  template void attention_forward<T>(T*, T*, const T*, int, int, int, int);                                     \
  template void attention_backward_input<T>(T*, const T*, const T*, const T*, int, int, int, int);              \
  template void crossentropy_forward<T>(T*, T*, const int*, int, int, int, T);

KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(double)

}  // namespace keel::ops
