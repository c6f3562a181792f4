#include "kernels/cpu/conv.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <dnnl.hpp>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/bf16.h"

namespace keel::ops {

std::string ConvShape::str() const {
  return "conv " + std::to_string(N) + "x" + std::to_string(H) + "x" + std::to_string(W) + "x" + std::to_string(C) +
         " -> " + std::to_string(K) + " (" + std::to_string(R) + "x" + std::to_string(S) + ", stride " +
         std::to_string(stride) + ", pad " + std::to_string(pad) + ")";
}

namespace {

void check_shape(const ConvShape& s) {
  check(s.N >= 1 && s.H >= 1 && s.W >= 1 && s.C >= 1 && s.K >= 1 && s.R >= 1 && s.S >= 1 && s.stride >= 1 &&
            s.pad >= 0 && s.P() >= 1 && s.Q() >= 1,
        "convolution: impossible shape " + s.str());
}

// ---- float: oneDNN ---------------------------------------------------------------------------------
// One shape's primitives: forward, backward data and backward weights, each with the weights in
// the layout its implementation chose, and the reorders between those and PyTorch's OIHW.
//
// With bf16 products (a call at MatmulPrecision::bf16 where the CPU has bf16 instructions) the
// primitives read bf16 activations, weights and output gradients and write float32: forward
// (src, weights: bf16; dst: f32), backward data (diff_dst, weights: bf16; diff_src: f32), backward
// weights (src, diff_dst: bf16; diff_weights: f32). The float32 activations and gradients are
// converted into the entry's bf16 buffers per call.
struct ConvPrimitives {
  bool bf16 = false;
  dnnl::memory::desc in16, out16;      // the bf16 copies' layouts (bf16 entries)
  std::vector<uint16_t> in_buf, out_buf;
  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights bwd_weights;
  dnnl::memory::desc act_in, act_out, w_plain, w_fwd, w_bwd, dw_bwd, scratch_fwd, scratch_data, scratch_weights;
  dnnl::reorder to_fwd, to_bwd, from_dw;  // null where the chosen layout is the plain one
  std::vector<float> w_fwd_buf, w_bwd_buf, dw_buf, dw_plain;
  // Each primitive's own scratchpad (scratchpad_mode::user), never shared between primitives.
  std::vector<uint8_t> pad_fwd, pad_data, pad_weights;
  std::string impl;
};

struct ConvCache {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::mutex mutex;
  std::map<std::tuple<int, int, int, int, int, int, int, int, int, bool>, std::unique_ptr<ConvPrimitives>> entries;
  std::string first_impl;
};

ConvCache& conv_cache() {
  static ConvCache cache;
  return cache;
}

// The primitives of a shape, made on first use. Callers hold the cache's mutex while they run them
// (the entry's reorder buffers are shared; the model runs one convolution at a time anyway).
ConvPrimitives& primitives(ConvCache& cache, const ConvShape& s, bool bf16) {
  const auto key = std::make_tuple(s.N, s.H, s.W, s.C, s.K, s.R, s.S, s.stride, s.pad, bf16);
  auto it = cache.entries.find(key);
  if (it != cache.entries.end()) return *it->second;
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  auto p = std::make_unique<ConvPrimitives>();
  p->act_in = dnnl::memory::desc({s.N, s.C, s.H, s.W}, dt::f32, tag::nhwc);
  p->act_out = dnnl::memory::desc({s.N, s.K, s.P(), s.Q()}, dt::f32, tag::nhwc);
  p->w_plain = dnnl::memory::desc({s.K, s.C, s.R, s.S}, dt::f32, tag::oihw);
  const dt low = bf16 ? dt::bf16 : dt::f32;  // what the products read
  p->bf16 = bf16;
  p->in16 = dnnl::memory::desc({s.N, s.C, s.H, s.W}, dt::bf16, tag::nhwc);
  p->out16 = dnnl::memory::desc({s.N, s.K, s.P(), s.Q()}, dt::bf16, tag::nhwc);
  const dnnl::memory::desc& src = bf16 ? p->in16 : p->act_in;    // read by forward and backward weights
  const dnnl::memory::desc& ddst = bf16 ? p->out16 : p->act_out;  // the output gradient, read by both backwards
  const dnnl::memory::desc w_any({s.K, s.C, s.R, s.S}, low, tag::any);
  const dnnl::memory::dims strides = {s.stride, s.stride}, pad = {s.pad, s.pad};
  try {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::convolution_forward::primitive_desc fwd_pd(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
                                         src, w_any, p->act_out, strides, pad, pad),
        attr, cache.engine);
    const dnnl::convolution_backward_data::primitive_desc data_pd(
        dnnl::convolution_backward_data::desc(dnnl::algorithm::convolution_direct, p->act_in, w_any, ddst,
                                              strides, pad, pad),
        attr, cache.engine, fwd_pd);
    // Weight gradients as HWIO: oneDNN 2.6's AVX-512 backward-weights kernel for channels-last
    // activations (chosen for "any") wrote past its buffers with two threads (heap corruption after
    // a dozen shapes; AVX2 and one thread were fine); for HWIO it runs its GEMM-based kernel, which
    // is as fast here. (OIHW itself gets the reference kernel: slow.)
    const dnnl::memory::desc dw_hwio({s.K, s.C, s.R, s.S}, dt::f32, tag::hwio);
    const dnnl::convolution_backward_weights::primitive_desc weights_pd(
        dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src, dw_hwio, ddst,
                                                 strides, pad, pad),
        attr, cache.engine, fwd_pd);
    p->fwd = dnnl::convolution_forward(fwd_pd);
    p->bwd_data = dnnl::convolution_backward_data(data_pd);
    p->bwd_weights = dnnl::convolution_backward_weights(weights_pd);
    p->w_fwd = fwd_pd.weights_desc();
    p->w_bwd = data_pd.weights_desc();
    p->dw_bwd = weights_pd.diff_weights_desc();
    auto reorder = [&](const dnnl::memory::desc& from, const dnnl::memory::desc& to) {
      return from == to ? dnnl::reorder() : dnnl::reorder(dnnl::reorder::primitive_desc(cache.engine, from, cache.engine, to));
    };
    p->to_fwd = reorder(p->w_plain, p->w_fwd);
    p->to_bwd = reorder(p->w_plain, p->w_bwd);
    p->from_dw = reorder(p->dw_bwd, p->w_plain);
    p->w_fwd_buf.resize(p->w_fwd.get_size() / sizeof(float) + 1);
    p->w_bwd_buf.resize(p->w_bwd.get_size() / sizeof(float) + 1);
    if (bf16) {
      p->in_buf.resize(static_cast<size_t>(s.in_size()));
      p->out_buf.resize(static_cast<size_t>(s.out_size()));
    }
    p->dw_buf.resize(p->dw_bwd.get_size() / sizeof(float) + 1);
    p->dw_plain.resize(static_cast<size_t>(s.weight_size()));
    p->impl = fwd_pd.impl_info_str();
    p->scratch_fwd = fwd_pd.scratchpad_desc();
    p->scratch_data = data_pd.scratchpad_desc();
    p->scratch_weights = weights_pd.scratchpad_desc();
    p->pad_fwd.resize(p->scratch_fwd.get_size() + 1);
    p->pad_data.resize(p->scratch_data.get_size() + 1);
    p->pad_weights.resize(p->scratch_weights.get_size() + 1);
  } catch (const dnnl::error& e) {
    throw Error("convolution: oneDNN has no " + std::string(bf16 ? "bf16 " : "") + "implementation for " + s.str() +
                " (" + e.what() + ")");
  }
  if (cache.first_impl.empty()) cache.first_impl = p->impl;
  return *cache.entries.emplace(key, std::move(p)).first->second;
}

dnnl::memory wrap(const dnnl::memory::desc& md, const ConvCache& cache, const void* ptr) {
  return dnnl::memory(md, cache.engine, const_cast<void*>(ptr));
}

// The weights in `layout` (a reorder into `buffer`, or the plain array itself).
dnnl::memory weights_as(ConvCache& cache, const ConvPrimitives& p, dnnl::reorder& to, const dnnl::memory::desc& layout,
                        std::vector<float>& buffer, const float* w) {
  dnnl::memory plain = wrap(p.w_plain, cache, w);
  if (!to) return plain;
  dnnl::memory out = wrap(layout, cache, buffer.data());
  to.execute(cache.stream, plain, out);
  return out;
}

// Whether a call at `precision` multiplies in bf16 (where oneDNN runs bf16 here; int8 and fp32
// convolutions run in float32).
bool use_bf16(MatmulPrecision precision) { return precision == MatmulPrecision::bf16 && cpu_has_bf16(); }

// `x` as the primitive reads it: the float32 array, or its bf16 copy in `buf` (layout `md16`).
dnnl::memory low(const ConvCache& cache, const ConvPrimitives& p, const dnnl::memory::desc& f32,
                 const dnnl::memory::desc& md16, std::vector<uint16_t>& buf, const float* x) {
  if (!p.bf16) return wrap(f32, cache, x);
  to_bf16(buf.data(), x, static_cast<int64_t>(buf.size()));
  return wrap(md16, cache, buf.data());
}

void onednn_forward(MatmulPrecision precision, float* y, const float* x, const float* w, const ConvShape& s) {
  ConvCache& cache = conv_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  ConvPrimitives& p = primitives(cache, s, use_bf16(precision));
  const dnnl::memory weights = weights_as(cache, p, p.to_fwd, p.w_fwd, p.w_fwd_buf, w);
  p.fwd.execute(cache.stream, {{DNNL_ARG_SRC, low(cache, p, p.act_in, p.in16, p.in_buf, x)},
                               {DNNL_ARG_WEIGHTS, weights},
                               {DNNL_ARG_DST, wrap(p.act_out, cache, y)},
                               {DNNL_ARG_SCRATCHPAD, wrap(p.scratch_fwd, cache, p.pad_fwd.data())}});
  cache.stream.wait();
}

void onednn_backward_input(MatmulPrecision precision, float* dx, const float* dy, const float* w, const ConvShape& s) {
  ConvCache& cache = conv_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  ConvPrimitives& p = primitives(cache, s, use_bf16(precision));
  const dnnl::memory weights = weights_as(cache, p, p.to_bwd, p.w_bwd, p.w_bwd_buf, w);
  p.bwd_data.execute(cache.stream, {{DNNL_ARG_DIFF_DST, low(cache, p, p.act_out, p.out16, p.out_buf, dy)},
                                    {DNNL_ARG_WEIGHTS, weights},
                                    {DNNL_ARG_DIFF_SRC, wrap(p.act_in, cache, dx)},
                                    {DNNL_ARG_SCRATCHPAD, wrap(p.scratch_data, cache, p.pad_data.data())}});
  cache.stream.wait();
}

// Overwrites dw_plain of the entry with this call's weight gradient; the caller adds it.
const float* onednn_backward_weight(MatmulPrecision precision, const float* dy, const float* x, const ConvShape& s,
                                    std::unique_lock<std::mutex>&) {
  ConvCache& cache = conv_cache();
  ConvPrimitives& p = primitives(cache, s, use_bf16(precision));
  dnnl::memory plain = wrap(p.w_plain, cache, p.dw_plain.data());
  dnnl::memory grads = p.from_dw ? wrap(p.dw_bwd, cache, p.dw_buf.data()) : plain;
  p.bwd_weights.execute(cache.stream, {{DNNL_ARG_SRC, low(cache, p, p.act_in, p.in16, p.in_buf, x)},
                                       {DNNL_ARG_DIFF_DST, low(cache, p, p.act_out, p.out16, p.out_buf, dy)},
                                       {DNNL_ARG_DIFF_WEIGHTS, grads},
                                       {DNNL_ARG_SCRATCHPAD, wrap(p.scratch_weights, cache, p.pad_weights.data())}});
  if (p.from_dw) p.from_dw.execute(cache.stream, grads, plain);
  cache.stream.wait();
  return p.dw_plain.data();
}

// ---- double: direct loops from the definition ---------------------------------------------------
template <typename T>
void direct_forward(T* y, const T* x, const T* w, const ConvShape& s) {
  const int P = s.P(), Q = s.Q();
#pragma omp parallel for schedule(static)
  for (int64_t npq = 0; npq < static_cast<int64_t>(s.N) * P * Q; ++npq) {
    const int n = static_cast<int>(npq / (P * Q)), p = static_cast<int>(npq / Q % P), q = static_cast<int>(npq % Q);
    T* out = y + npq * s.K;
    for (int k = 0; k < s.K; ++k) {
      T sum = 0;
      for (int r = 0; r < s.R; ++r) {
        const int h = p * s.stride - s.pad + r;
        if (h < 0 || h >= s.H) continue;
        for (int c = 0; c < s.C; ++c) {
          for (int t = 0; t < s.S; ++t) {
            const int v = q * s.stride - s.pad + t;
            if (v < 0 || v >= s.W) continue;
            sum += x[((static_cast<int64_t>(n) * s.H + h) * s.W + v) * s.C + c] *
                   w[((static_cast<int64_t>(k) * s.C + c) * s.R + r) * s.S + t];
          }
        }
      }
      out[k] = sum;
    }
  }
}

template <typename T>
void direct_backward_input(T* dx, const T* dy, const T* w, const ConvShape& s, bool accumulate) {
  const int P = s.P(), Q = s.Q();
  const int64_t image = static_cast<int64_t>(s.H) * s.W * s.C;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < s.N; ++n) {
    T* dxn = dx + n * image;
    if (!accumulate) std::fill(dxn, dxn + image, T(0));
    for (int p = 0; p < P; ++p) {
      for (int q = 0; q < Q; ++q) {
        const T* g = dy + ((static_cast<int64_t>(n) * P + p) * Q + q) * s.K;
        for (int k = 0; k < s.K; ++k) {
          for (int r = 0; r < s.R; ++r) {
            const int h = p * s.stride - s.pad + r;
            if (h < 0 || h >= s.H) continue;
            for (int t = 0; t < s.S; ++t) {
              const int v = q * s.stride - s.pad + t;
              if (v < 0 || v >= s.W) continue;
              for (int c = 0; c < s.C; ++c) {
                dxn[(static_cast<int64_t>(h) * s.W + v) * s.C + c] +=
                    g[k] * w[((static_cast<int64_t>(k) * s.C + c) * s.R + r) * s.S + t];
              }
            }
          }
        }
      }
    }
  }
}

template <typename T>
void direct_backward_weight(T* dw, const T* dy, const T* x, const ConvShape& s) {
  const int P = s.P(), Q = s.Q();
#pragma omp parallel for schedule(static)
  for (int k = 0; k < s.K; ++k) {
    for (int c = 0; c < s.C; ++c) {
      for (int r = 0; r < s.R; ++r) {
        for (int t = 0; t < s.S; ++t) {
          T sum = 0;
          for (int n = 0; n < s.N; ++n) {
            for (int p = 0; p < P; ++p) {
              const int h = p * s.stride - s.pad + r;
              if (h < 0 || h >= s.H) continue;
              for (int q = 0; q < Q; ++q) {
                const int v = q * s.stride - s.pad + t;
                if (v < 0 || v >= s.W) continue;
                sum += dy[((static_cast<int64_t>(n) * P + p) * Q + q) * s.K + k] *
                       x[((static_cast<int64_t>(n) * s.H + h) * s.W + v) * s.C + c];
              }
            }
          }
          dw[((static_cast<int64_t>(k) * s.C + c) * s.R + r) * s.S + t] += sum;
        }
      }
    }
  }
}

}  // namespace

std::string conv_engine() {
  ConvCache& cache = conv_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  return cache.first_impl.empty() ? "oneDNN (no convolution run yet)" : "oneDNN " + cache.first_impl;
}

template <typename T>
void conv2d_forward(MatmulPrecision precision, T* y, const T* x, const T* w, const ConvShape& s) {
  check_shape(s);
  if constexpr (std::is_same_v<T, float>) {
    onednn_forward(precision, y, x, w, s);
  } else {
    direct_forward(y, x, w, s);
  }
}

template <typename T>
void conv2d_backward_input(MatmulPrecision precision, T* dx, const T* dy, const T* w, const ConvShape& s,
                           bool accumulate) {
  check_shape(s);
  if constexpr (std::is_same_v<T, float>) {
    if (!accumulate) {
      onednn_backward_input(precision, dx, dy, w, s);
      return;
    }
    std::vector<float> tmp(static_cast<size_t>(s.in_size()));
    onednn_backward_input(precision, tmp.data(), dy, w, s);
    const int64_t n = s.in_size();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) dx[i] += tmp[i];
  } else {
    direct_backward_input(dx, dy, w, s, accumulate);
  }
}

template <typename T>
void conv2d_backward_weight(MatmulPrecision precision, T* dw, const T* dy, const T* x, const ConvShape& s) {
  check_shape(s);
  if constexpr (std::is_same_v<T, float>) {
    ConvCache& cache = conv_cache();
    std::unique_lock<std::mutex> lock(cache.mutex);
    const float* g = onednn_backward_weight(precision, dy, x, s, lock);
    const int64_t n = s.weight_size();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) dw[i] += g[i];
  } else {
    direct_backward_weight(dw, dy, x, s);
  }
}

// ---- group normalisation -------------------------------------------------------------------------
// Channels-last: each sample's rows of C channels are contiguous, so the kernels sum per channel
// along the rows (vectorised over C) and then per group. Samples run in parallel; every sum runs
// in one order (rows, then the group's channels), whatever the thread count.
namespace {

// Per-sample, per-channel sums over the HW rows of a[n] (and of a[n] * b[n] when b is given).
template <typename T, typename F>
void channel_sums(const T* a, const T* b, int HW, int C, double* sa, double* sab, F weight) {
  std::fill(sa, sa + C, 0.0);
  if (sab) std::fill(sab, sab + C, 0.0);
  for (int i = 0; i < HW; ++i) {
    const T* ra = a + static_cast<int64_t>(i) * C;
    const T* rb = b ? b + static_cast<int64_t>(i) * C : nullptr;
#pragma omp simd
    for (int c = 0; c < C; ++c) {
      const double v = weight(i, c, ra[c]);
      sa[c] += v;
      if (rb) sab[c] += v * rb[c];
    }
  }
}

}  // namespace

template <typename T>
void groupnorm_forward(T* y, T* mean, T* rstd, const T* x, const T* gamma, const T* beta, int N, int HW, int C, int G,
                       bool relu) {
  const int Cg = C / G;
  const double count = static_cast<double>(HW) * Cg;
#pragma omp parallel
  {
    std::vector<double> s(C), q(C);
    std::vector<T> mc(C), scale(C), shift(C);
#pragma omp for schedule(static)
    for (int n = 0; n < N; ++n) {
      const T* xn = x + static_cast<int64_t>(n) * HW * C;
      channel_sums(xn, static_cast<const T*>(nullptr), HW, C, s.data(), nullptr, [](int, int, T v) { return static_cast<double>(v); });
      for (int g = 0; g < G; ++g) {
        double sum = 0;
        for (int c = g * Cg; c < (g + 1) * Cg; ++c) sum += s[c];
        for (int c = g * Cg; c < (g + 1) * Cg; ++c) mc[c] = static_cast<T>(sum / count);
      }
      // Second pass: squared deviations from the group's mean (two passes: no cancellation).
      channel_sums(xn, static_cast<const T*>(nullptr), HW, C, q.data(), nullptr, [&](int, int c, T v) {
        const double d = static_cast<double>(v) - mc[c];
        return d * d;
      });
      for (int g = 0; g < G; ++g) {
        double sq = 0;
        for (int c = g * Cg; c < (g + 1) * Cg; ++c) sq += q[c];
        const double r = 1.0 / std::sqrt(sq / count + 1e-5);
        mean[n * G + g] = mc[g * Cg];
        rstd[n * G + g] = static_cast<T>(r);
        for (int c = g * Cg; c < (g + 1) * Cg; ++c) {
          scale[c] = static_cast<T>(r) * gamma[c];
          shift[c] = beta[c] - mc[c] * scale[c];
        }
      }
      T* yn = y + static_cast<int64_t>(n) * HW * C;
      for (int i = 0; i < HW; ++i) {
        const T* xr = xn + static_cast<int64_t>(i) * C;
        T* yr = yn + static_cast<int64_t>(i) * C;
#pragma omp simd
        for (int c = 0; c < C; ++c) {
          const T v = xr[c] * scale[c] + shift[c];
          yr[c] = relu && v < T(0) ? T(0) : v;
        }
      }
    }
  }
}

template <typename T>
void groupnorm_backward_input(T* dx, const T* dy, const T* x, const T* y, const T* mean, const T* rstd, const T* gamma,
                              int N, int HW, int C, int G, bool relu, bool accumulate) {
  const int Cg = C / G;
  const double count = static_cast<double>(HW) * Cg;
#pragma omp parallel
  {
    std::vector<double> sd(C), sdx(C);
    std::vector<T> a(C), b(C), k(C);
#pragma omp for schedule(static)
    for (int n = 0; n < N; ++n) {
      const int64_t base = static_cast<int64_t>(n) * HW * C;
      const T* dyn = dy + base;
      const T* yn = y + base;
      // Per channel: the (ReLU-masked) output gradient's sum and its sum against x.
      channel_sums(dyn, x + base, HW, C, sd.data(), sdx.data(), [&](int i, int c, T v) {
        return relu && !(yn[static_cast<int64_t>(i) * C + c] > T(0)) ? 0.0 : static_cast<double>(v);
      });
      for (int g = 0; g < G; ++g) {
        const double m = mean[n * G + g], r = rstd[n * G + g];
        double sum_d = 0, sum_dxhat = 0;  // sums of dxhat = dy gamma, and of dxhat * xhat
        for (int c = g * Cg; c < (g + 1) * Cg; ++c) {
          sum_d += gamma[c] * sd[c];
          sum_dxhat += gamma[c] * r * (sdx[c] - m * sd[c]);
        }
        const double md = sum_d / count, mdx = sum_dxhat / count;
        // dx = r (dy gamma - md - xhat mdx) = dy (r gamma) + x (-r^2 mdx) + r (m r mdx - md)
        for (int c = g * Cg; c < (g + 1) * Cg; ++c) {
          a[c] = static_cast<T>(r * gamma[c]);
          b[c] = static_cast<T>(-r * r * mdx);
          k[c] = static_cast<T>(r * (m * r * mdx - md));
        }
      }
      for (int i = 0; i < HW; ++i) {
        const int64_t row = base + static_cast<int64_t>(i) * C;
#pragma omp simd
        for (int c = 0; c < C; ++c) {
          const T d = relu && !(y[row + c] > T(0)) ? T(0) : dy[row + c];
          const T v = d * a[c] + x[row + c] * b[c] + k[c];
          dx[row + c] = accumulate ? dx[row + c] + v : v;
        }
      }
    }
  }
}

template <typename T>
void groupnorm_backward_weight(T* dgamma, T* dbeta, const T* dy, const T* x, const T* y, const T* mean, const T* rstd,
                               int N, int HW, int C, int G, bool relu) {
  const int Cg = C / G;
  // Per sample and channel: sum dy and sum dy x (in parallel over samples); then over samples in order.
  std::vector<double> sd(static_cast<size_t>(N) * C), sdx(static_cast<size_t>(N) * C);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const int64_t base = static_cast<int64_t>(n) * HW * C;
    const T* yn = y + base;
    channel_sums(dy + base, x + base, HW, C, &sd[static_cast<size_t>(n) * C], &sdx[static_cast<size_t>(n) * C],
                 [&](int i, int c, T v) {
                   return relu && !(yn[static_cast<int64_t>(i) * C + c] > T(0)) ? 0.0 : static_cast<double>(v);
                 });
  }
  for (int c = 0; c < C; ++c) {
    const int g = c / Cg;
    double sg = 0, sb = 0;
    for (int n = 0; n < N; ++n) {
      const double m = mean[n * G + g], r = rstd[n * G + g];
      const size_t at = static_cast<size_t>(n) * C + c;
      sg += r * (sdx[at] - m * sd[at]);
      sb += sd[at];
    }
    dgamma[c] += static_cast<T>(sg);
    dbeta[c] += static_cast<T>(sb);
  }
}

template <typename T>
void add_relu_forward(T* y, const T* a, const T* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T v = b ? a[i] + b[i] : a[i];
    y[i] = v > T(0) ? v : T(0);
  }
}

template <typename T>
void relu_backward(T* dx, const T* dy, const T* y, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dx[i] = y[i] > T(0) ? dy[i] : T(0);
}

template <typename T>
void maxpool_forward(T* y, int32_t* arg, const T* x, int N, int H, int W, int C, int k, int stride, int pad) {
  const int P = pool_out(H, k, stride, pad), Q = pool_out(W, k, stride, pad);
#pragma omp parallel for schedule(static)
  for (int64_t npq = 0; npq < static_cast<int64_t>(N) * P * Q; ++npq) {
    const int n = static_cast<int>(npq / (P * Q)), p = static_cast<int>(npq / Q % P), q = static_cast<int>(npq % Q);
    for (int c = 0; c < C; ++c) {
      T best = -std::numeric_limits<T>::infinity();
      int32_t where = -1;
      for (int r = 0; r < k; ++r) {
        const int h = p * stride - pad + r;
        if (h < 0 || h >= H) continue;
        for (int t = 0; t < k; ++t) {
          const int v = q * stride - pad + t;
          if (v < 0 || v >= W) continue;
          const T value = x[((static_cast<int64_t>(n) * H + h) * W + v) * C + c];
          if (where < 0 || value > best) {
            best = value;
            where = h * W + v;
          }
        }
      }
      y[npq * C + c] = best;
      arg[npq * C + c] = where;
    }
  }
}

template <typename T>
void maxpool_backward_input(T* dx, const T* dy, const int32_t* arg, int N, int H, int W, int C, int P, int Q) {
  const int64_t image = static_cast<int64_t>(H) * W * C;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    T* dxn = dx + n * image;
    std::fill(dxn, dxn + image, T(0));
    const int64_t first = static_cast<int64_t>(n) * P * Q * C;
    for (int64_t i = 0; i < static_cast<int64_t>(P) * Q * C; ++i) {
      const int c = static_cast<int>(i % C);
      dxn[static_cast<int64_t>(arg[first + i]) * C + c] += dy[first + i];
    }
  }
}

template <typename T>
void avgpool_forward(T* y, const T* x, int N, int HW, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    for (int c = 0; c < C; ++c) {
      double sum = 0;
      for (int i = 0; i < HW; ++i) sum += x[(static_cast<int64_t>(n) * HW + i) * C + c];
      y[static_cast<int64_t>(n) * C + c] = static_cast<T>(sum / HW);
    }
  }
}

template <typename T>
void avgpool_backward_input(T* dx, const T* dy, int N, int HW, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    for (int i = 0; i < HW; ++i) {
      for (int c = 0; c < C; ++c) {
        dx[(static_cast<int64_t>(n) * HW + i) * C + c] = dy[static_cast<int64_t>(n) * C + c] / static_cast<T>(HW);
      }
    }
  }
}

#define KEEL_CONV_INSTANTIATE(T)                                                                                      \
  template void conv2d_forward<T>(MatmulPrecision, T*, const T*, const T*, const ConvShape&);                         \
  template void conv2d_backward_input<T>(MatmulPrecision, T*, const T*, const T*, const ConvShape&, bool);            \
  template void conv2d_backward_weight<T>(MatmulPrecision, T*, const T*, const T*, const ConvShape&);                 \
  template void groupnorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int, int, int, int, bool);             \
  template void groupnorm_backward_input<T>(T*, const T*, const T*, const T*, const T*, const T*, const T*, int, int, \
                                            int, int, bool, bool);                                                    \
  template void groupnorm_backward_weight<T>(T*, T*, const T*, const T*, const T*, const T*, const T*, int, int, int, \
                                             int, bool);                                                              \
  template void add_relu_forward<T>(T*, const T*, const T*, int64_t);                                                 \
  template void relu_backward<T>(T*, const T*, const T*, int64_t);                                                    \
  template void maxpool_forward<T>(T*, int32_t*, const T*, int, int, int, int, int, int, int);                        \
  template void maxpool_backward_input<T>(T*, const T*, const int32_t*, int, int, int, int, int, int);                \
  template void avgpool_forward<T>(T*, const T*, int, int, int);                                                      \
  template void avgpool_backward_input<T>(T*, const T*, int, int, int);

KEEL_CONV_INSTANTIATE(float)
KEEL_CONV_INSTANTIATE(double)

}  // namespace keel::ops
