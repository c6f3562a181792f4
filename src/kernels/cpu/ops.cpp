#include "kernels/cpu/ops.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/amx_attention.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/batched_gemm.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/blas.h"
#include "kernels/cpu/vmath.h"
#include "kernels/cpu/weight_gemm.h"

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

// An element of a stored input as the kernel's scalar: itself, or a bf16 value widened.
template <typename T>
inline T load(T x) {
  return x;
}
inline float load(uint16_t b) { return from_bf16(b); }
// A result into a float, or rounded into a bf16 stash's bits.
template <typename T>
inline void put(T& out, T x) {
  out = x;
}
inline void put(uint16_t& out, float x) { out = to_bf16(x); }
inline Operand as_operand(const float* p) { return Operand(p); }
inline Operand as_operand(const uint16_t* p) { return Operand::bits(p); }

template <typename T>
T gelu_scale() {
  return static_cast<T>(0.7978845608028654);  // sqrt(2/pi)
}

}  // namespace

// ---- embedding ---------------------------------------------------------------------------------

template <typename T>
void encoder_forward(T* out, const int* tokens, const T* wte, const T* wpe, int B, int Tn, int C) {
  if (wpe == nullptr) {  // token embedding alone (llama: positions enter through RoPE)
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < static_cast<int64_t>(B) * Tn; ++n) {
      std::copy(wte + static_cast<int64_t>(tokens[n]) * C, wte + static_cast<int64_t>(tokens[n] + 1) * C, out + n * C);
    }
    return;
  }
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
      if (dwpe == nullptr) {
        for (int64_t c = c0; c < c1; ++c) e[c] += d[c];
        continue;
      }
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

// ---- RMSNorm -----------------------------------------------------------------------------------

namespace {
template <typename T>
inline void rmsnorm_row(T* o, T* rstd_out, const T* x, const T* w, int C) {
  T ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int c = 0; c < C; ++c) ss += x[c] * x[c];
  const T s = T(1) / std::sqrt(ss / C + static_cast<T>(1e-5));
#pragma omp simd
  for (int c = 0; c < C; ++c) o[c] = x[c] * s * w[c];
  *rstd_out = s;
}
}  // namespace

template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* w, int N, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    rmsnorm_row(out + static_cast<int64_t>(n) * C, rstd + n, inp + static_cast<int64_t>(n) * C, w, C);
  }
}

template <typename T>
void residual_rmsnorm_forward(T* res, T* out, T* rstd, const T* a, const T* b_in, const T* w, int N, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const int64_t off = static_cast<int64_t>(n) * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) res[off + c] = a[off + c] + b_in[off + c];
    rmsnorm_row(out + off, rstd + n, res + off, w, C);
  }
}

// y = x s w with s = (mean(x^2) + eps)^(-1/2): dx = s (g - xhat mean(g xhat)), g = w dout, xhat = x s.
template <typename T>
void rmsnorm_backward_input(T* dinp, const T* dout, const T* inp, const T* rstd, const T* w, int N, int C,
                            bool accumulate) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const int64_t off = static_cast<int64_t>(n) * C;
    const T* x = inp + off;
    const T* d = dout + off;
    const T s = rstd[n];
    T g_xhat_mean = 0;
#pragma omp simd reduction(+ : g_xhat_mean)
    for (int c = 0; c < C; ++c) g_xhat_mean += w[c] * d[c] * x[c] * s;
    g_xhat_mean /= C;
    T* di = dinp + off;
    if (accumulate) {
#pragma omp simd
      for (int c = 0; c < C; ++c) di[c] += (w[c] * d[c] - x[c] * s * g_xhat_mean) * s;
    } else {
#pragma omp simd
      for (int c = 0; c < C; ++c) di[c] = (w[c] * d[c] - x[c] * s * g_xhat_mean) * s;
    }
  }
}

template <typename T>
void rmsnorm_backward_weight(T* dw, const T* dout, const T* inp, const T* rstd, int N, int C) {
#pragma omp parallel
  {
    int64_t c0, c1;
    thread_range(C, &c0, &c1);
    for (int n = 0; n < N; ++n) {
      const int64_t off = static_cast<int64_t>(n) * C;
      const T s = rstd[n];
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dw[c] += dout[off + c] * inp[off + c] * s;
    }
  }
}

// ---- linear ------------------------------------------------------------------------------------

template <typename T>
void linear_forward(MatmulPrecision precision, T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) {
  if (bias != nullptr) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) std::copy(bias, bias + OC, out + static_cast<int64_t>(n) * OC);
  }
  gemm_weight<T>(precision, true, N, OC, C, inp, C, w, C, bias != nullptr ? T(1) : T(0), out, OC);
}

template <typename T>
void linear_backward_input(MatmulPrecision precision, T* dinp, const T* dout, const T* w, int N, int C, int OC,
                           bool accumulate) {
  gemm_weight<T>(precision, false, N, C, OC, dout, OC, w, C, accumulate ? T(1) : T(0), dinp, C);
}

template <typename T, typename Out, typename In>
void linear_backward_weight_impl(MatmulPrecision precision, T* dw, T* dbias, const Out* dout, const In* inp, int N,
                                 int C, int OC) {
  if constexpr (std::is_same_v<Out, T> && std::is_same_v<In, T>) {
    gemm<T>(precision, true, false, OC, C, N, T(1), dout, OC, inp, C, T(1), dw, C);
  } else {
    gemm_operands(precision, true, false, OC, C, N, 1.0f, as_operand(dout), OC, as_operand(inp), C, 1.0f, dw, C);
  }
  if (dbias != nullptr) {
#pragma omp parallel
    {
      int64_t o0, o1;
      thread_range(OC, &o0, &o1);
      for (int n = 0; n < N; ++n) {
        const Out* d = dout + static_cast<int64_t>(n) * OC;
#pragma omp simd
        for (int64_t o = o0; o < o1; ++o) dbias[o] += load(d[o]);
      }
    }
  }
}

template <typename T>
void linear_backward_weight(MatmulPrecision precision, T* dw, T* dbias, const T* dout, const T* inp, int N, int C,
                            int OC) {
  linear_backward_weight_impl(precision, dw, dbias, dout, inp, N, C, OC);
}

void linear_forward(MatmulPrecision precision, float* out, Operand inp, Operand w, const float* bias, int N, int C,
                    int OC) {
  if (inp.bf16 == nullptr && w.bf16 == nullptr) {
    linear_forward<float>(precision, out, inp.f32, w.f32, bias, N, C, OC);
    return;
  }
  if (bias != nullptr) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) std::copy(bias, bias + OC, out + static_cast<int64_t>(n) * OC);
  }
  gemm_operands(precision, false, true, N, OC, C, 1.0f, inp, C, w, C, bias != nullptr ? 1.0f : 0.0f, out, OC);
}

void linear_backward_input(MatmulPrecision precision, float* dinp, const float* dout, Operand w, int N, int C, int OC,
                           bool accumulate) {
  if (w.bf16 == nullptr) {
    linear_backward_input<float>(precision, dinp, dout, w.f32, N, C, OC, accumulate);
    return;
  }
  gemm_operands(precision, false, false, N, C, OC, 1.0f, dout, OC, w, C, accumulate ? 1.0f : 0.0f, dinp, C);
}

void linear_backward_input(MatmulPrecision precision, float* dinp, Operand dout, Operand w, int N, int C, int OC,
                           bool accumulate) {
  if (dout.bf16 == nullptr) {
    linear_backward_input(precision, dinp, dout.f32, w, N, C, OC, accumulate);
    return;
  }
  gemm_operands(precision, false, false, N, C, OC, 1.0f, dout, OC, w, C, accumulate ? 1.0f : 0.0f, dinp, C);
}

void linear_backward_weight(MatmulPrecision precision, float* dw, float* dbias, Operand dout, Operand inp, int N, int C,
                            int OC) {
  if (dout.bf16 != nullptr && inp.bf16 != nullptr) {
    linear_backward_weight_impl(precision, dw, dbias, dout.bf16, inp.bf16, N, C, OC);
  } else if (dout.bf16 != nullptr) {
    linear_backward_weight_impl(precision, dw, dbias, dout.bf16, inp.f32, N, C, OC);
  } else if (inp.bf16 != nullptr) {
    linear_backward_weight_impl(precision, dw, dbias, dout.f32, inp.bf16, N, C, OC);
  } else {
    linear_backward_weight_impl(precision, dw, dbias, dout.f32, inp.f32, N, C, OC);
  }
}

// ---- GELU --------------------------------------------------------------------------------------

// GELU of x (k = gelu_scale): one formula for the float kernels and their bf16-rounded forms.
template <typename T>
inline T gelu_of(T x, T k) {
  return T(0.5) * x * (T(1) + vmath::tanh(k * (x + T(0.044715) * x * x * x)));
}

// silu(a) b, SwiGLU's output element.
template <typename T>
inline T swiglu_of(T a, T b) {
  return a / (T(1) + vmath::exp(-a)) * b;
}

template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n) {
  const T k = gelu_scale<T>();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = gelu_of(inp[i], k);
}

void gelu_forward_rounded(uint16_t* in_bits, uint16_t* out_bits, const float* inp, int64_t n) {
  const float k = gelu_scale<float>();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    in_bits[i] = to_bf16(x);
    out_bits[i] = to_bf16(gelu_of(x, k));
  }
}

template <typename T, typename In, typename Out = T>
void gelu_backward_impl(Out* dinp, const T* dout, const In* inp, int64_t n) {
  const T k = gelu_scale<T>();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T x = load(inp[i]);
    const T u = k * (x + T(0.044715) * x * x * x);
    const T th = vmath::tanh(u);
    const T sech2 = T(1) - th * th;
    const T grad = T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * k * (T(1) + T(3) * T(0.044715) * x * x);
    put(dinp[i], grad * dout[i]);
  }
}

template <typename T>
void gelu_backward_input(T* dinp, const T* dout, const T* inp, int64_t n) {
  gelu_backward_impl(dinp, dout, inp, n);
}

void gelu_backward_input(float* dinp, const float* dout, Operand inp, int64_t n) {
  if (inp.bf16 != nullptr) {
    gelu_backward_impl(dinp, dout, inp.bf16, n);
  } else {
    gelu_backward_impl(dinp, dout, inp.f32, n);
  }
}

void gelu_backward_rounded(uint16_t* dinp_bits, const float* dout, Operand inp, int64_t n) {
  if (inp.bf16 != nullptr) {
    gelu_backward_impl(dinp_bits, dout, inp.bf16, n);
  } else {
    gelu_backward_impl(dinp_bits, dout, inp.f32, n);
  }
}

// ---- SwiGLU ------------------------------------------------------------------------------------

template <typename T>
void swiglu_forward(T* out, const T* inp, int N, int H) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const T* a = inp + static_cast<int64_t>(n) * 2 * H;
    const T* b = a + H;
    T* o = out + static_cast<int64_t>(n) * H;
#pragma omp simd
    for (int j = 0; j < H; ++j) o[j] = swiglu_of(a[j], b[j]);
  }
}

void swiglu_forward_rounded(uint16_t* in_bits, uint16_t* out_bits, const float* inp, int N, int H) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* a = inp + static_cast<int64_t>(n) * 2 * H;
    const float* b = a + H;
    uint16_t* ia = in_bits + static_cast<int64_t>(n) * 2 * H;
    uint16_t* ib = ia + H;
    uint16_t* o = out_bits + static_cast<int64_t>(n) * H;
#pragma omp simd
    for (int j = 0; j < H; ++j) {
      ia[j] = to_bf16(a[j]);
      ib[j] = to_bf16(b[j]);
      o[j] = to_bf16(swiglu_of(a[j], b[j]));
    }
  }
}

// silu(a) = a sig(a), silu'(a) = sig(a) (1 + a (1 - sig(a))).
template <typename T, typename In, typename Out = T>
void swiglu_backward_impl(Out* dinp, const T* dout, const In* inp, int N, int H) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const In* a = inp + static_cast<int64_t>(n) * 2 * H;
    const In* b = a + H;
    const T* d = dout + static_cast<int64_t>(n) * H;
    Out* da = dinp + static_cast<int64_t>(n) * 2 * H;
    Out* db = da + H;
#pragma omp simd
    for (int j = 0; j < H; ++j) {
      const T aj = load(a[j]), bj = load(b[j]);
      const T sig = T(1) / (T(1) + vmath::exp(-aj));
      put(da[j], d[j] * bj * sig * (T(1) + aj * (T(1) - sig)));
      put(db[j], d[j] * aj * sig);
    }
  }
}

template <typename T>
void swiglu_backward_input(T* dinp, const T* dout, const T* inp, int N, int H) {
  swiglu_backward_impl(dinp, dout, inp, N, H);
}

void swiglu_backward_input(float* dinp, const float* dout, Operand inp, int N, int H) {
  if (inp.bf16 != nullptr) {
    swiglu_backward_impl(dinp, dout, inp.bf16, N, H);
  } else {
    swiglu_backward_impl(dinp, dout, inp.f32, N, H);
  }
}

void swiglu_backward_rounded(uint16_t* dinp_bits, const float* dout, Operand inp, int N, int H) {
  if (inp.bf16 != nullptr) {
    swiglu_backward_impl(dinp_bits, dout, inp.bf16, N, H);
  } else {
    swiglu_backward_impl(dinp_bits, dout, inp.f32, N, H);
  }
}

// ---- RoPE --------------------------------------------------------------------------------------

template <typename T>
void rope_forward(T* qkv, int B, int Tn, int NH, int NKV, int hs, const std::vector<double>& freq, int pos0,
                  const int* positions, bool inverse, double position_scale) {
  const int C = NH * hs, width = C + 2 * NKV * hs, half = hs / 2;
  const int64_t rows = static_cast<int64_t>(B) * Tn;
  // The positions asked for: [lo, hi).
  int lo = pos0, hi = pos0 + Tn;
  if (positions != nullptr) {
    lo = rows > 0 ? positions[0] : 0, hi = lo;
    for (int64_t r = 0; r < rows; ++r) lo = std::min(lo, positions[r]), hi = std::max(hi, positions[r] + 1);
  }
  // The angles in double, one table of positions [table.lo, table.hi) for every batch row and head,
  // kept for the next call within it with the same frequencies (every block of a step, forward and
  // backward, asks for the same one). (The backward's inverse rotation negates the sines as it
  // reads them: exact.)
  struct Table {
    int lo = 0, hi = 0;
    double scale = 0;
    std::vector<double> freq;
    std::vector<T> cos, sin;
  };
  static thread_local Table table;
  if (lo < table.lo || hi > table.hi || table.scale != position_scale || table.freq != freq) {
    table.cos.resize(static_cast<size_t>(hi - lo) * half);
    table.sin.resize(static_cast<size_t>(hi - lo) * half);
    for (int p = lo; p < hi; ++p) {
      for (int i = 0; i < half; ++i) {
        const double angle = p * position_scale * freq[i];
        table.cos[static_cast<size_t>(p - lo) * half + i] = static_cast<T>(std::cos(angle));
        table.sin[static_cast<size_t>(p - lo) * half + i] = static_cast<T>(std::sin(angle));
      }
    }
    table.lo = lo, table.hi = hi, table.scale = position_scale, table.freq = freq;
  }
  const T sign = inverse ? T(-1) : T(1);
  const std::vector<T>& cos_t = table.cos;
  const std::vector<T>& sin_t = table.sin;
  const int heads = NH + NKV;  // the q heads, then the k heads: contiguous in each row
  const int base = table.lo;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < rows; ++bt) {
    const int p = positions != nullptr ? positions[bt] : pos0 + static_cast<int>(bt % Tn);
    const T* cs = cos_t.data() + static_cast<size_t>(p - base) * half;
    const T* sn = sin_t.data() + static_cast<size_t>(p - base) * half;
    T* row = qkv + bt * width;
    for (int h = 0; h < heads; ++h) {
      T* x = row + h * hs;
      for (int i = 0; i < half; ++i) {
        const T x0 = x[2 * i], x1 = x[2 * i + 1], s_i = sign * sn[i];
        x[2 * i] = x0 * cs[i] - x1 * s_i;
        x[2 * i + 1] = x0 * s_i + x1 * cs[i];
      }
    }
  }
}

template <typename T>
void rope_forward(T* qkv, int B, int Tn, int NH, int NKV, int hs, double theta, int pos0, bool inverse,
                  double position_scale) {
  std::vector<double> freq(static_cast<size_t>(hs / 2));
  for (int i = 0; i < hs / 2; ++i) freq[i] = std::pow(theta, -2.0 * i / hs);
  rope_forward(qkv, B, Tn, NH, NKV, hs, freq, pos0, nullptr, inverse, position_scale);
}

template <typename T>
void residual_forward(T* out, const T* a, const T* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// ---- attention ---------------------------------------------------------------------------------

namespace {

// Whether dense attention's per-head products run as one batched oneDNN product per kind
// (kernels/cpu/batched_gemm.h) rather than one OpenBLAS call per head: float32 products, one
// key/value head per query head (grouped heads add into shared gradients in head order: the
// per-head loop keeps that order), called outside a parallel region. By arguments alone, never
// by timing: a seed and layout keep their bytes.
template <typename T>
bool batched_attention(MatmulPrecision precision, int NH, int NKV) {
  return std::is_same_v<T, float> && precision == MatmulPrecision::fp32 && NKV == NH && !omp_in_parallel();
}

// Row i of a T x T map: the causal softmax in place (the keys after the last one this query reads
// set to zero).
template <typename T>
inline void softmax_row(T* row, int i, int Tn, bool causal) {
  const int last = causal ? i : Tn - 1;  // the last key this query reads
  T mx = row[0];
#pragma omp simd reduction(max : mx)
  for (int j = 1; j <= last; ++j) mx = std::max(mx, row[j]);
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j <= last; ++j) {
    row[j] = vmath::exp(row[j] - mx);
    sum += row[j];
  }
  const T inv = T(1) / sum;
#pragma omp simd
  for (int j = 0; j <= last; ++j) row[j] *= inv;
  for (int j = last + 1; j < Tn; ++j) row[j] = T(0);
}

// Row i of the softmax's backward in place: drow = arow * (drow - arow . drow) * scale, zero after
// the last key.
template <typename T>
inline void softmax_backward_row(T* drow, const T* arow, int i, int Tn, bool causal, T scale) {
  const int last = causal ? i : Tn - 1;
  T dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int j = 0; j <= last; ++j) dot += arow[j] * drow[j];
#pragma omp simd
  for (int j = 0; j <= last; ++j) drow[j] = arow[j] * (drow[j] - dot) * scale;
  for (int j = last + 1; j < Tn; ++j) drow[j] = T(0);
}

// The heads of qkv's part starting at column `col` (q: 0, k: C, v: C + kv), as [B, NH, T, hs]
// matrices, or their transposes [B, NH, hs, T].
inline HeadMatrices qkv_heads(const float* base, int col, int Tn, int C3, int hs, bool transposed) {
  const int64_t batch = static_cast<int64_t>(Tn) * C3;
  return transposed ? HeadMatrices{base + col, batch, hs, 1, C3} : HeadMatrices{base + col, batch, hs, C3, 1};
}

// att[B, NH, T, T] (or a map of its shape), or its transposes.
inline HeadMatrices maps(const float* base, int NH, int Tn, bool transposed) {
  const int64_t map = static_cast<int64_t>(Tn) * Tn;
  return transposed ? HeadMatrices{base, NH * map, map, 1, Tn} : HeadMatrices{base, NH * map, map, Tn, 1};
}

// out[B, T, C] (or dout) as [B, NH, T, hs] matrices.
inline HeadMatrices row_heads(const float* base, int Tn, int C, int hs) {
  return HeadMatrices{base, static_cast<int64_t>(Tn) * C, hs, C, 1};
}

// attention_forward through batched_head_gemm; false (nothing written) where oneDNN has no
// implementation.
bool batched_attention_forward(float* out, float* att, const float* qkv, int B, int Tn, int C, int NH, bool causal) {
  const int hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  if (!batched_head_gemm(B, NH, Tn, Tn, hs, scale, qkv_heads(qkv, 0, Tn, C3, hs, false),
                         qkv_heads(qkv, C, Tn, C3, hs, true), 0.0f, maps(att, NH, Tn, false))) {
    return false;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < static_cast<int64_t>(B) * NH * Tn; ++r) {
    softmax_row(att + r * Tn, static_cast<int>(r % Tn), Tn, causal);
  }
  return batched_head_gemm(B, NH, Tn, hs, Tn, 1.0f, maps(att, NH, Tn, false), qkv_heads(qkv, 2 * C, Tn, C3, hs, false),
                           0.0f, row_heads(out, Tn, C, hs));
}

}  // namespace

template <typename T>
void attention_forward(MatmulPrecision precision, T* out, T* att, const T* qkv, int B, int Tn, int C, int NH, int NKV,
                       bool causal) {
  if (NKV == 0) NKV = NH;
  if constexpr (std::is_same_v<T, float>) {
    if (batched_attention<T>(precision, NH, NKV) && batched_attention_forward(out, att, qkv, B, Tn, C, NH, causal)) {
      return;
    }
  }
  const int hs = C / NH, group = NH / NKV, kv = NKV * hs;
  const int C3 = C + 2 * kv;  // the row width of qkv
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  [[maybe_unused]] const bool amx = std::is_same_v<T, float> && amx_attention(precision, hs, Tn);
  // One (batch, head) per iteration; BLAS runs single-threaded inside an OpenMP region.
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; ++bh) {
    const int b = bh / NH, h = bh % NH, g = h / group;
    const T* row = qkv + static_cast<int64_t>(b) * Tn * C3;
    const T* q = row + h * hs;
    const T* k = row + C + g * hs;
    const T* v = row + C + kv + g * hs;
    T* a = att + static_cast<int64_t>(bh) * Tn * Tn;
    if constexpr (std::is_same_v<T, float>) {
      if (amx) {  // the head's products on AMX tiles (kernels/cpu/amx_attention.h)
        amx_attention_head_forward(out + static_cast<int64_t>(b) * Tn * C + h * hs, C, a, q, k, v, C3, Tn, hs, causal,
                                   scale);
        continue;
      }
    }
    gemm<T>(precision, false, true, Tn, Tn, hs, scale, q, C3, k, C3, T(0), a, Tn);
    for (int i = 0; i < Tn; ++i) softmax_row(a + static_cast<int64_t>(i) * Tn, i, Tn, causal);
    gemm<T>(precision, false, false, Tn, hs, Tn, T(1), a, Tn, v, C3, T(0),
            out + static_cast<int64_t>(b) * Tn * C + h * hs, C);
  }
}

namespace {

// The batched backward keeps the probabilities' gradient for all heads at once (the per-head loop:
// one T x T map per thread); beyond this many floats (32 MB: dense attention at long context) it
// leaves the products to the per-head loop rather than double the maps' memory.
constexpr size_t kMaxBatchedMapFloats = size_t{8} << 20;

// attention_backward_input through batched_head_gemm (one key/value head per query head, so every
// gradient is overwritten by one head's product); false where the maps exceed
// kMaxBatchedMapFloats or oneDNN has no implementation (then nothing in dqkv is final: the
// caller's loop overwrites it all).
bool batched_attention_backward_input(float* dqkv, const float* dout, const float* att, const float* qkv, int B,
                                      int Tn, int C, int NH, bool causal) {
  const int hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // The probabilities' gradient for every head at once, kept for the next call.
  static thread_local std::vector<float> datt_buffer;
  const size_t map_floats = static_cast<size_t>(B) * NH * Tn * Tn;
  if (map_floats > kMaxBatchedMapFloats) return false;
  if (datt_buffer.size() < map_floats) datt_buffer.resize(map_floats);
  float* datt = datt_buffer.data();
  const HeadMatrices d = row_heads(dout, Tn, C, hs);
  // datt = dout v^T; dv = att^T dout
  if (!batched_head_gemm(B, NH, Tn, Tn, hs, 1.0f, d, qkv_heads(qkv, 2 * C, Tn, C3, hs, true), 0.0f,
                         maps(datt, NH, Tn, false)) ||
      !batched_head_gemm(B, NH, Tn, hs, Tn, 1.0f, maps(att, NH, Tn, true), d, 0.0f,
                         qkv_heads(dqkv, 2 * C, Tn, C3, hs, false))) {
    return false;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < static_cast<int64_t>(B) * NH * Tn; ++r) {
    softmax_backward_row(datt + r * Tn, att + r * Tn, static_cast<int>(r % Tn), Tn, causal, scale);
  }
  // dq = datt k; dk = datt^T q
  return batched_head_gemm(B, NH, Tn, hs, Tn, 1.0f, maps(datt, NH, Tn, false), qkv_heads(qkv, C, Tn, C3, hs, false),
                           0.0f, qkv_heads(dqkv, 0, Tn, C3, hs, false)) &&
         batched_head_gemm(B, NH, Tn, hs, Tn, 1.0f, maps(datt, NH, Tn, true), qkv_heads(qkv, 0, Tn, C3, hs, false),
                           0.0f, qkv_heads(dqkv, C, Tn, C3, hs, false));
}

}  // namespace

template <typename T>
void attention_backward_input(MatmulPrecision precision, T* dqkv, const T* dout, const T* att, const T* qkv, int B,
                              int Tn, int C, int NH, int NKV, bool causal) {
  if (NKV == 0) NKV = NH;
  if constexpr (std::is_same_v<T, float>) {
    if (batched_attention<T>(precision, NH, NKV) &&
        batched_attention_backward_input(dqkv, dout, att, qkv, B, Tn, C, NH, causal)) {
      return;
    }
  }
  const int hs = C / NH, group = NH / NKV, kv = NKV * hs;
  const int C3 = C + 2 * kv;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  [[maybe_unused]] const bool amx = std::is_same_v<T, float> && amx_attention(precision, hs, Tn);
#pragma omp parallel
  {
    // Per-thread T x T scratch, allocated once per thread and reused across steps.
    // (The AMX route keeps its own scratch.)
    static thread_local std::vector<T> datt_buffer;
    if (!amx && datt_buffer.size() < static_cast<size_t>(Tn) * Tn) datt_buffer.resize(static_cast<size_t>(Tn) * Tn);
    T* datt = datt_buffer.data();
    // One (batch, key/value head) per iteration: its query heads in order, each adding into dk, dv.
#pragma omp for schedule(static)
    for (int bg = 0; bg < B * NKV; ++bg) {
     const int b = bg / NKV, g = bg % NKV;
     for (int h = g * group; h < (g + 1) * group; ++h) {
      const T first = h == g * group ? T(0) : T(1);  // beta: the group's first head overwrites
      const int64_t row = static_cast<int64_t>(b) * Tn * C3;
      const T* q = qkv + row + h * hs;
      const T* k = qkv + row + C + g * hs;
      const T* v = qkv + row + C + kv + g * hs;
      T* dq = dqkv + row + h * hs;
      T* dk = dqkv + row + C + g * hs;
      T* dv = dqkv + row + C + kv + g * hs;
      const T* a = att + (static_cast<int64_t>(b) * NH + h) * Tn * Tn;
      const T* d = dout + static_cast<int64_t>(b) * Tn * C + h * hs;
      if constexpr (std::is_same_v<T, float>) {
        if (amx) {  // the head's products on AMX tiles (kernels/cpu/amx_attention.h)
          amx_attention_head_backward(dq, dk, dv, C3, first != T(0), d, C, a, q, k, v, Tn, hs, causal, scale);
          continue;
        }
      }
      gemm<T>(precision, false, true, Tn, Tn, hs, T(1), d, C, v, C3, T(0), datt, Tn);  // datt = dout v^T
      gemm<T>(precision, true, false, Tn, hs, Tn, T(1), a, Tn, d, C, first, dv, C3);   // dv (+)= att^T dout
      for (int i = 0; i < Tn; ++i) {  // softmax backward, in place, then the 1/sqrt(hs) scale
        softmax_backward_row(datt + static_cast<int64_t>(i) * Tn, a + static_cast<int64_t>(i) * Tn, i, Tn, causal,
                             scale);
      }
      gemm<T>(precision, false, false, Tn, hs, Tn, T(1), datt, Tn, k, C3, T(0), dq, C3);  // dq = dpre k
      gemm<T>(precision, true, false, Tn, hs, Tn, T(1), datt, Tn, q, C3, first, dk, C3);  // dk (+)= dpre^T q
     }
    }
  }
}

// ---- blockwise attention (FlashAttention-2's algorithm) -----------------------------------------

namespace {

constexpr int kBlock = 64;  // rows of a query tile and of a key/value tile

// The first key position query row i may attend to: the window's start (window 0: no window).
inline int window_start(int i, int window) { return window > 0 ? std::max(0, i - window + 1) : 0; }

// One key tile of the online softmax: s[rows, cols] (row stride ld) holds the scores of query
// rows i0.. against key columns j0..; each row's allowed columns (causal, inside its window) are
// turned into exp(score - new max) in place (0 elsewhere), and its running max m, sum l and
// unnormalised output o[rows, hs] are rescaled to the new max. The caller then adds p v to o.
template <typename T>
void online_softmax_tile(T* s, int ld, int rows, int cols, int i0, int j0, int window, T* m, T* l, T* o, int hs) {
  for (int r = 0; r < rows; ++r) {
    const int i = i0 + r, lo = window_start(i, window) - j0, hi = i - j0;  // allowed columns [lo, hi]
    T* srow = s + static_cast<int64_t>(r) * ld;
    T mx = m[r];
    const int c_lo = std::max(lo, 0), c_hi = std::min(hi, cols - 1);
#pragma omp simd reduction(max : mx)
    for (int c = c_lo; c <= c_hi; ++c) mx = std::max(mx, srow[c]);
    if (mx == -std::numeric_limits<T>::infinity()) {  // nothing allowed in this tile
      for (int c = 0; c < cols; ++c) srow[c] = T(0);
      continue;
    }
    const T correction = vmath::exp(m[r] - mx);
    // Vectorized (the sum in the lanes' order: fixed for a build, whatever the threads).
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int c = 0; c < cols; ++c) {
      const T e = vmath::exp(srow[c] - mx);
      srow[c] = c >= lo && c <= hi ? e : T(0);
      sum += srow[c];
    }
    l[r] = l[r] * correction + sum;
    m[r] = mx;
    T* orow = o + r * hs;
#pragma omp simd
    for (int d = 0; d < hs; ++d) orow[d] *= correction;
  }
}

}  // namespace

template <typename T>
void flash_attention_forward(MatmulPrecision precision, T* out, T* lse, const T* qkv, int B, int Tn, int C, int NH,
                             int NKV, int window) {
  if constexpr (std::is_same_v<T, float>) {  // the vector path where the CPU and head size allow it
    if (blockwise_attention_vectorized(precision, C / NH)) {
      blockwise_attention_forward_vector(precision, out, lse, qkv, B, Tn, C, NH, NKV, window);
      return;
    }
  }
  if (NKV == 0) NKV = NH;
  const int hs = C / NH, group = NH / NKV, kv = NKV * hs, C3 = C + 2 * kv;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const int q_tiles = (Tn + kBlock - 1) / kBlock;
#pragma omp parallel
  {
    static thread_local std::vector<T> buffer;
    if (buffer.size() < static_cast<size_t>(kBlock) * (kBlock + hs + 2)) buffer.resize(static_cast<size_t>(kBlock) * (kBlock + hs + 2));
    T* s = buffer.data();                 // [kBlock, kBlock] scores, then probabilities
    T* o = s + kBlock * kBlock;           // [kBlock, hs] the tile's output, unnormalised
    T* m = o + kBlock * hs;               // [kBlock] running maxima
    T* l = m + kBlock;                    // [kBlock] running sums
#pragma omp for schedule(static)
    for (int task = 0; task < B * NH * q_tiles; ++task) {
      const int bh = task / q_tiles, qt = task % q_tiles;
      const int b = bh / NH, h = bh % NH, g = h / group;
      const T* row = qkv + static_cast<int64_t>(b) * Tn * C3;
      const int i0 = qt * kBlock, rows = std::min(kBlock, Tn - i0);
      const T* q = row + static_cast<int64_t>(i0) * C3 + h * hs;
      for (int r = 0; r < rows; ++r) m[r] = -std::numeric_limits<T>::infinity(), l[r] = T(0);
      std::fill(o, o + rows * hs, T(0));
      // Key tiles from the window's start for the tile's first row to the diagonal; tiles wholly
      // outside every row's window are never visited.
      const int j_first = window_start(i0, window) / kBlock * kBlock;
      for (int j0 = j_first; j0 < i0 + rows; j0 += kBlock) {
        const int cols = std::min(kBlock, Tn - j0);
        const T* k = row + static_cast<int64_t>(j0) * C3 + C + g * hs;
        const T* v = row + static_cast<int64_t>(j0) * C3 + C + kv + g * hs;
        gemm<T>(precision, false, true, rows, cols, hs, scale, q, C3, k, C3, T(0), s, kBlock);
        online_softmax_tile(s, kBlock, rows, cols, i0, j0, window, m, l, o, hs);
        gemm<T>(precision, false, false, rows, hs, cols, T(1), s, kBlock, v, C3, T(1), o, hs);  // o += p v
      }
      for (int r = 0; r < rows; ++r) {
        T* dst = out + (static_cast<int64_t>(b) * Tn + i0 + r) * C + h * hs;
        const T inv = T(1) / l[r];
        for (int d = 0; d < hs; ++d) dst[d] = o[r * hs + d] * inv;
        lse[static_cast<int64_t>(bh) * Tn + i0 + r] = m[r] + std::log(l[r]);
      }
    }
  }
}

template <typename T>
void attention_distance_mass(double* mass, int buckets, const T* qkv, int B, int Tn, int C, int NH, int NKV, int rows) {
  if (NKV == 0) NKV = NH;
  const int hs = C / NH, group = NH / NKV, kv = NKV * hs, C3 = C + 2 * kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  rows = std::min(rows, Tn);
  // Each head's rows in its own task; heads write their own buckets (sums in row order: fixed).
#pragma omp parallel
  {
    std::vector<double> p(static_cast<size_t>(Tn));
#pragma omp for schedule(static)
    for (int h = 0; h < NH; ++h) {
      double* out = mass + static_cast<int64_t>(h) * buckets;
      const int g = h / group;
      for (int b = 0; b < B; ++b) {
        const T* row = qkv + static_cast<int64_t>(b) * Tn * C3;
        for (int i = Tn - rows; i < Tn; ++i) {
          const T* q = row + static_cast<int64_t>(i) * C3 + h * hs;
          double mx = -std::numeric_limits<double>::infinity();
          for (int j = 0; j <= i; ++j) {
            const T* k = row + static_cast<int64_t>(j) * C3 + C + g * hs;
            double dot = 0;
            for (int d = 0; d < hs; ++d) dot += static_cast<double>(q[d]) * k[d];
            p[j] = dot * scale;
            mx = std::max(mx, p[j]);
          }
          double sum = 0;
          for (int j = 0; j <= i; ++j) sum += p[j] = std::exp(p[j] - mx);
          for (int j = 0; j <= i; ++j) {
            const int d = i - j;
            const int bucket = std::min(buckets - 1, static_cast<int>(std::bit_width(static_cast<unsigned>(d))));
            out[bucket] += p[j] / sum;
          }
        }
      }
    }
  }
}

template <typename T>
void paged_attention_forward(MatmulPrecision precision, T* out, const T* q, int ldq, int n, int pos0,
                             const T* const* blocks, int block_tokens, int NH, int NKV, int hs, int window) {
  const int group = NH / NKV, kv = NKV * hs, kb = block_tokens;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const int q_tiles = (n + kBlock - 1) / kBlock;
#pragma omp parallel
  {
    static thread_local std::vector<T> buffer;
    const size_t need = static_cast<size_t>(kBlock) * (kb + hs + 2);
    if (buffer.size() < need) buffer.resize(need);
    T* s = buffer.data();       // [kBlock, kb] scores, then probabilities
    T* o = s + kBlock * kb;     // [kBlock, hs]
    T* m = o + kBlock * hs;     // [kBlock]
    T* l = m + kBlock;          // [kBlock]
#pragma omp for schedule(static)
    for (int task = 0; task < NH * q_tiles; ++task) {
      const int h = task / q_tiles, qt = task % q_tiles, g = h / group;
      const int r0 = qt * kBlock, rows = std::min(kBlock, n - r0), i0 = pos0 + r0;  // query positions i0..
      for (int r = 0; r < rows; ++r) m[r] = -std::numeric_limits<T>::infinity(), l[r] = T(0);
      std::fill(o, o + rows * hs, T(0));
      const T* qt_rows = q + static_cast<int64_t>(r0) * ldq + h * hs;
      for (int blk = window_start(i0, window) / kb; blk * kb < i0 + rows; ++blk) {
        const int j0 = blk * kb, cols = std::min(kb, i0 + rows - j0);
        const T* k = blocks[blk] + g * hs;                                  // [kb, kv]: keys
        const T* v = blocks[blk] + static_cast<int64_t>(kb) * kv + g * hs;  // [kb, kv]: values
        gemm<T>(precision, false, true, rows, cols, hs, scale, qt_rows, ldq, k, kv, T(0), s, kb);
        online_softmax_tile(s, kb, rows, cols, i0, j0, window, m, l, o, hs);
        gemm<T>(precision, false, false, rows, hs, cols, T(1), s, kb, v, kv, T(1), o, hs);
      }
      for (int r = 0; r < rows; ++r) {
        T* dst = out + static_cast<int64_t>(r0 + r) * NH * hs + h * hs;
        const T inv = T(1) / l[r];
        for (int d = 0; d < hs; ++d) dst[d] = o[r * hs + d] * inv;
      }
    }
  }
}

template <typename T>
void flash_attention_backward_input(MatmulPrecision precision, T* dqkv, const T* dout, const T* out, const T* lse,
                                    const T* qkv, int B, int Tn, int C, int NH, int NKV, int window) {
  if constexpr (std::is_same_v<T, float>) {
    if (blockwise_attention_vectorized(precision, C / NH)) {
      blockwise_attention_backward_vector(precision, dqkv, dout, out, lse, qkv, B, Tn, C, NH, NKV, window);
      return;
    }
  }
  if (NKV == 0) NKV = NH;
  const int hs = C / NH, group = NH / NKV, kv = NKV * hs, C3 = C + 2 * kv;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  // dq, dk and dv are sums over tiles: zero them first (each task owns its batch row's key/value
  // head and that head group's query heads, so no two tasks write the same element).
#pragma omp parallel
  {
    static thread_local std::vector<T> buffer;
    const size_t need = static_cast<size_t>(kBlock) * kBlock * 2 + static_cast<size_t>(Tn);
    if (buffer.size() < need) buffer.resize(need);
    T* p = buffer.data();             // [kBlock, kBlock] probabilities
    T* dp = p + kBlock * kBlock;      // [kBlock, kBlock] their gradient, then the scores'
    T* delta = dp + kBlock * kBlock;  // [Tn] rowsum(dout * out) of the head
#pragma omp for schedule(static)
    for (int bg = 0; bg < B * NKV; ++bg) {
      const int b = bg / NKV, g = bg % NKV;
      const int64_t base = static_cast<int64_t>(b) * Tn * C3;
      for (int t = 0; t < Tn; ++t) {
        T* r = dqkv + base + static_cast<int64_t>(t) * C3;
        for (int h = g * group; h < (g + 1) * group; ++h) std::fill(r + h * hs, r + (h + 1) * hs, T(0));
        std::fill(r + C + g * hs, r + C + (g + 1) * hs, T(0));
        std::fill(r + C + kv + g * hs, r + C + kv + (g + 1) * hs, T(0));
      }
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const int64_t bh = static_cast<int64_t>(b) * NH + h;
        for (int t = 0; t < Tn; ++t) {
          const T* d = dout + (static_cast<int64_t>(b) * Tn + t) * C + h * hs;
          const T* o = out + (static_cast<int64_t>(b) * Tn + t) * C + h * hs;
          T sum = 0;
          for (int e = 0; e < hs; ++e) sum += d[e] * o[e];
          delta[t] = sum;
        }
        for (int i0 = 0; i0 < Tn; i0 += kBlock) {
          const int rows = std::min(kBlock, Tn - i0);
          const T* q = qkv + base + static_cast<int64_t>(i0) * C3 + h * hs;
          T* dq = dqkv + base + static_cast<int64_t>(i0) * C3 + h * hs;
          const T* d = dout + (static_cast<int64_t>(b) * Tn + i0) * C + h * hs;
          const int j_first = window_start(i0, window) / kBlock * kBlock;
          for (int j0 = j_first; j0 < i0 + rows; j0 += kBlock) {
            const int cols = std::min(kBlock, Tn - j0);
            const T* k = qkv + base + static_cast<int64_t>(j0) * C3 + C + g * hs;
            const T* v = qkv + base + static_cast<int64_t>(j0) * C3 + C + kv + g * hs;
            T* dk = dqkv + base + static_cast<int64_t>(j0) * C3 + C + g * hs;
            T* dv = dqkv + base + static_cast<int64_t>(j0) * C3 + C + kv + g * hs;
            // p = exp(q k^T scale - lse), recomputed; zero where masked.
            gemm<T>(precision, false, true, rows, cols, hs, scale, q, C3, k, C3, T(0), p, kBlock);
            for (int r = 0; r < rows; ++r) {
              const int i = i0 + r, lo = window_start(i, window) - j0, hi = i - j0;
              const T m = lse[bh * Tn + i];
              T* prow = p + r * kBlock;
#pragma omp simd
              for (int c = 0; c < cols; ++c) {
                const T e = vmath::exp(prow[c] - m);
                prow[c] = c >= lo && c <= hi ? e : T(0);
              }
            }
            gemm<T>(precision, true, false, cols, hs, rows, T(1), p, kBlock, d, C, T(1), dv, C3);  // dv += p^T dout
            gemm<T>(precision, false, true, rows, cols, hs, T(1), d, C, v, C3, T(0), dp, kBlock);  // dp = dout v^T
            for (int r = 0; r < rows; ++r) {                                              // ds = p (dp - delta) scale
              const T dl = delta[i0 + r];
              T* dprow = dp + r * kBlock;
              const T* prow = p + r * kBlock;
#pragma omp simd
              for (int c = 0; c < cols; ++c) dprow[c] = prow[c] * (dprow[c] - dl) * scale;
            }
            gemm<T>(precision, false, false, rows, hs, cols, T(1), dp, kBlock, k, C3, T(1), dq, C3);  // dq += ds k
            gemm<T>(precision, true, false, cols, hs, rows, T(1), dp, kBlock, q, C3, T(1), dk, C3);   // dk += ds^T q
          }
        }
      }
    }
  }
}

// ---- loss --------------------------------------------------------------------------------------

namespace {

// crossentropy_forward's rows, its gradient left as floats or (kBits, float only) as bf16 bits in
// the upper half of each row (crossentropy_forward_bf16_gradient).
template <typename T, bool kBits>
void crossentropy_rows(T* losses, T* logits, const int* targets, int N, int V, int Vp, T grad_scale) {
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
      if constexpr (kBits) {
        // The float gradient (row * inv, minus grad_scale at the target), rounded, 16 columns at
        // a time from the end down: bits [lo, hi) land on floats from (Vp + lo) / 2 >= lo on, all
        // read by then (the padded columns' floats are never read).
        uint16_t* bits = reinterpret_cast<uint16_t*>(row) + Vp;
        for (int j = Vp - 1; j >= V; --j) bits[j] = 0;
        for (int hi = V; hi > 0; hi -= 16) {
          const int lo = std::max(0, hi - 16), w = hi - lo;
          float chunk[16];
          uint16_t out[16];
          std::memcpy(chunk, row + lo, sizeof(float) * w);
#pragma omp simd
          for (int i = 0; i < w; ++i) out[i] = to_bf16(chunk[i] * inv - (lo + i == t ? grad_scale : 0.0f));
          std::memcpy(bits + lo, out, sizeof(uint16_t) * w);
        }
      } else {
#pragma omp simd
        for (int j = 0; j < V; ++j) row[j] *= inv;
        row[t] -= grad_scale;
        for (int j = V; j < Vp; ++j) row[j] = T(0);
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < V; ++j) sum += vmath::exp(row[j] - mx);
    }
    losses[n] = std::log(sum) + mx - target_logit;
  }
}

}  // namespace

template <typename T>
void crossentropy_forward(T* losses, T* logits, const int* targets, int N, int V, int Vp, T grad_scale) {
  crossentropy_rows<T, false>(losses, logits, targets, N, V, Vp, grad_scale);
}

void crossentropy_forward_bf16_gradient(float* losses, float* logits, const int* targets, int N, int V, int Vp,
                                        float grad_scale) {
  crossentropy_rows<float, true>(losses, logits, targets, N, V, Vp, grad_scale);
}

#define KEEL_INSTANTIATE(T)                                                                                         \
  template void encoder_forward<T>(T*, const int*, const T*, const T*, int, int, int);                              \
  template void encoder_backward_weight<T>(T*, T*, const T*, const int*, int, int, int);                            \
  template void layernorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int, int);                           \
  template void residual_layernorm_forward<T>(T*, T*, T*, T*, const T*, const T*, const T*, const T*, int, int);    \
  template void layernorm_backward_input<T>(T*, const T*, const T*, const T*, const T*, const T*, int, int, bool);  \
  template void layernorm_backward_weight<T>(T*, T*, const T*, const T*, const T*, const T*, int, int);             \
  template void linear_forward<T>(MatmulPrecision, T*, const T*, const T*, const T*, int, int, int);                \
  template void linear_backward_input<T>(MatmulPrecision, T*, const T*, const T*, int, int, int, bool);             \
  template void linear_backward_weight<T>(MatmulPrecision, T*, T*, const T*, const T*, int, int, int);              \
  template void gelu_forward<T>(T*, const T*, int64_t);                                                             \
  template void gelu_backward_input<T>(T*, const T*, const T*, int64_t);                                            \
  template void residual_forward<T>(T*, const T*, const T*, int64_t);                                               \
  template void attention_forward<T>(MatmulPrecision, T*, T*, const T*, int, int, int, int, int, bool);             \
  template void attention_backward_input<T>(MatmulPrecision, T*, const T*, const T*, const T*, int, int, int, int,  \
                                            int, bool);                                                             \
  template void rmsnorm_forward<T>(T*, T*, const T*, const T*, int, int);                                           \
  template void residual_rmsnorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int, int);                    \
  template void rmsnorm_backward_input<T>(T*, const T*, const T*, const T*, const T*, int, int, bool);              \
  template void rmsnorm_backward_weight<T>(T*, const T*, const T*, const T*, int, int);                             \
  template void swiglu_forward<T>(T*, const T*, int, int);                                                          \
  template void swiglu_backward_input<T>(T*, const T*, const T*, int, int);                                         \
  template void rope_forward<T>(T*, int, int, int, int, int, double, int, bool, double);                            \
  template void rope_forward<T>(T*, int, int, int, int, int, const std::vector<double>&, int, const int*, bool, double);                            \
  template void flash_attention_forward<T>(MatmulPrecision, T*, T*, const T*, int, int, int, int, int, int);        \
  template void attention_distance_mass<T>(double*, int, const T*, int, int, int, int, int, int);                   \
  template void paged_attention_forward<T>(MatmulPrecision, T*, const T*, int, int, int, const T* const*, int, int, \
                                           int, int, int);                                                          \
  template void flash_attention_backward_input<T>(MatmulPrecision, T*, const T*, const T*, const T*, const T*, int, \
                                                  int, int, int, int, int);                                         \
  template void crossentropy_forward<T>(T*, T*, const int*, int, int, int, T);

KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(double)

}  // namespace keel::ops
