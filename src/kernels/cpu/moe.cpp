#include "kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/ops.h"

namespace keel::moe {

template <typename T>
void router_softmax_forward(T* probs, const T* logits, int N, int E) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const T* l = logits + static_cast<int64_t>(n) * E;
    T* p = probs + static_cast<int64_t>(n) * E;
    T top = l[0];
    for (int e = 1; e < E; ++e) top = std::max(top, l[e]);
    T sum = 0;
    for (int e = 0; e < E; ++e) {
      p[e] = std::exp(l[e] - top);
      sum += p[e];
    }
    for (int e = 0; e < E; ++e) p[e] /= sum;
  }
}

template <typename T>
void router_softmax_backward(T* dlogits, const T* dprobs, const T* probs, int N, int E) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const T* p = probs + static_cast<int64_t>(n) * E;
    const T* dp = dprobs + static_cast<int64_t>(n) * E;
    T* dl = dlogits + static_cast<int64_t>(n) * E;
    T dot = 0;
    for (int e = 0; e < E; ++e) dot += p[e] * dp[e];
    for (int e = 0; e < E; ++e) dl[e] = p[e] * (dp[e] - dot);
  }
}

template <typename T>
void top_k(int32_t* choice, const T* probs, int N, int E, int k, const T* bias) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const T* p = probs + static_cast<int64_t>(n) * E;
    int32_t* c = choice + static_cast<int64_t>(n) * k;
    auto score = [&](int e) { return bias != nullptr ? p[e] + bias[e] : p[e]; };
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken = taken || c[i] == e;
        if (!taken && (best < 0 || score(e) > score(best))) best = e;  // strict: ties keep the lower index
      }
      c[j] = best;
    }
  }
}

void update_balance_bias(float* bias, const double* load, int E, float rate) {
  double total = 0;
  for (int e = 0; e < E; ++e) total += load[e];
  const double mean = total / E;
  for (int e = 0; e < E; ++e) bias[e] += load[e] < mean ? rate : load[e] > mean ? -rate : 0.0f;
}

int64_t plan_routing(int32_t* offsets, int32_t* rows, int32_t* slot, const int32_t* choice, int B, int T, int k, int E,
                     int capacity, const int32_t* kept_before, int segments) {
  const int64_t pairs = static_cast<int64_t>(B) * T * k;
  if (kept_before == nullptr) segments = 1;
  const int64_t run = static_cast<int64_t>(T / segments) * k;  // a segment's pairs
  std::vector<int32_t> taken(E);
  int64_t dropped = 0;
  // Which pairs are kept: per sequence, per expert, the first `capacity` in position order.
  for (int b = 0; b < B; ++b) {
    for (int64_t p = static_cast<int64_t>(b) * T * k; p < static_cast<int64_t>(b + 1) * T * k; ++p) {
      const int64_t q = p - static_cast<int64_t>(b) * T * k;  // the pair's place in its sequence
      if (q % run == 0 && kept_before != nullptr) {  // a segment's start
        const int32_t* before = kept_before + (static_cast<int64_t>(b) * segments + q / run) * E;
        std::copy(before, before + E, taken.begin());
      } else if (q == 0) {
        std::fill(taken.begin(), taken.end(), 0);
      }
      const int e = choice[p];
      const bool keep = capacity <= 0 || taken[e] < capacity;
      taken[e] += keep ? 1 : 0;
      slot[p] = keep ? 0 : -1;
      dropped += keep ? 0 : 1;
    }
  }
  // Counting sort of the kept pairs by expert, stable (token order within an expert).
  std::fill(offsets, offsets + E + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    if (slot[p] >= 0) ++offsets[choice[p] + 1];
  }
  for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int32_t> next(offsets, offsets + E);
  for (int64_t p = 0; p < pairs; ++p) {
    if (slot[p] < 0) continue;
    const int32_t m = next[choice[p]]++;
    rows[m] = static_cast<int32_t>(p);
    slot[p] = m;
  }
  return dropped;
}

template <typename T>
void gather_rows(T* xs, const T* x, const int32_t* rows, int M, int k, int C) {
#pragma omp parallel for schedule(static)
  for (int m = 0; m < M; ++m) {
    std::memcpy(xs + static_cast<int64_t>(m) * C, x + static_cast<int64_t>(rows[m] / k) * C, sizeof(T) * C);
  }
}

template <typename T>
void scatter_add_rows(T* dx, const T* dxs, const int32_t* slot, int N, int k, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    T* d = dx + static_cast<int64_t>(n) * C;
    for (int j = 0; j < k; ++j) {
      const int32_t m = slot[static_cast<int64_t>(n) * k + j];
      if (m < 0) continue;
      const T* s = dxs + static_cast<int64_t>(m) * C;
      for (int c = 0; c < C; ++c) d[c] += s[c];
    }
  }
}

template <typename T>
void combine_forward(T* y, const T* ye, const T* probs, const int32_t* choice, const int32_t* slot, int N, int k, int E,
                     int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    T* out = y + static_cast<int64_t>(n) * C;
    for (int j = 0; j < k; ++j) {
      const int64_t pair = static_cast<int64_t>(n) * k + j;
      if (slot[pair] < 0) continue;
      const T g = probs[static_cast<int64_t>(n) * E + choice[pair]];
      const T* s = ye + static_cast<int64_t>(slot[pair]) * C;
      for (int c = 0; c < C; ++c) out[c] += g * s[c];
    }
  }
}

template <typename T>
void combine_backward(T* dye, T* dprobs, const T* dy, const T* ye, const T* probs, const int32_t* choice,
                      const int32_t* slot, int N, int k, int E, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const T* d = dy + static_cast<int64_t>(n) * C;
    for (int j = 0; j < k; ++j) {
      const int64_t pair = static_cast<int64_t>(n) * k + j;
      if (slot[pair] < 0) continue;
      const int64_t at = static_cast<int64_t>(n) * E + choice[pair];
      const T g = probs[at];
      const T* s = ye + static_cast<int64_t>(slot[pair]) * C;
      T* out = dye + static_cast<int64_t>(slot[pair]) * C;
      T dot = 0;
      for (int c = 0; c < C; ++c) {
        out[c] = g * d[c];
        dot += d[c] * s[c];
      }
      dprobs[at] += dot;
    }
  }
}

template <typename T>
void grouped_linear_forward(MatmulPrecision precision, T* out, const T* inp, const T* const* w, const int32_t* offsets,
                            int E, int C, int OC) {
  for (int e = 0; e < E; ++e) {
    const int rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    ops::linear_forward<T>(precision, out + static_cast<int64_t>(offsets[e]) * OC, inp + static_cast<int64_t>(offsets[e]) * C,
                           w[e], nullptr, rows, C, OC);
  }
}

template <typename T>
void grouped_linear_backward_input(MatmulPrecision precision, T* dinp, const T* dout, const T* const* w,
                                   const int32_t* offsets, int E, int C, int OC) {
  for (int e = 0; e < E; ++e) {
    const int rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    ops::linear_backward_input<T>(precision, dinp + static_cast<int64_t>(offsets[e]) * C,
                                  dout + static_cast<int64_t>(offsets[e]) * OC, w[e], rows, C, OC, false);
  }
}

template <typename T>
void grouped_linear_backward_weight(MatmulPrecision precision, T* const* dw, const T* dout, const T* inp,
                                    const int32_t* offsets, int E, int C, int OC) {
  for (int e = 0; e < E; ++e) {
    const int rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    ops::linear_backward_weight<T>(precision, dw[e], nullptr,
                                   dout + static_cast<int64_t>(offsets[e]) * OC, inp + static_cast<int64_t>(offsets[e]) * C,
                                   rows, C, OC);
  }
}

namespace {
// f[E]: the share of sequence b's T k choices that picked each expert.
void choice_shares(double* f, const int32_t* choice, int b, int Tn, int E, int k) {
  std::fill(f, f + E, 0.0);
  const int64_t first = static_cast<int64_t>(b) * Tn * k, count = static_cast<int64_t>(Tn) * k;
  for (int64_t p = first; p < first + count; ++p) f[choice[p]] += 1.0;
  for (int e = 0; e < E; ++e) f[e] /= static_cast<double>(count);
}
}  // namespace

template <typename T>
double aux_loss_forward(const T* probs, const int32_t* choice, int B, int Tn, int E, int k) {
  std::vector<double> f(E);
  double total = 0;
  for (int b = 0; b < B; ++b) {
    choice_shares(f.data(), choice, b, Tn, E, k);
    for (int e = 0; e < E; ++e) {
      double mean_p = 0;
      for (int t = 0; t < Tn; ++t) mean_p += probs[(static_cast<int64_t>(b) * Tn + t) * E + e];
      total += E * f[e] * (mean_p / Tn);
    }
  }
  return total;
}

template <typename T>
void aux_loss_backward_shares(T* dprobs, const double* f, int B, int Tn, int E, T scale) {
  for (int b = 0; b < B; ++b) {
    const double* fb = f + static_cast<int64_t>(b) * E;
    for (int t = 0; t < Tn; ++t) {
      T* d = dprobs + (static_cast<int64_t>(b) * Tn + t) * E;
      for (int e = 0; e < E; ++e) d[e] += static_cast<T>(scale * static_cast<T>(E * fb[e] / Tn));
    }
  }
}

template <typename T>
void aux_loss_backward(T* dprobs, const int32_t* choice, int B, int Tn, int E, int k, T scale) {
  std::vector<double> f(static_cast<size_t>(B) * E);
  for (int b = 0; b < B; ++b) choice_shares(f.data() + static_cast<int64_t>(b) * E, choice, b, Tn, E, k);
  aux_loss_backward_shares(dprobs, f.data(), B, Tn, E, scale);
}

#define KEEL_MOE_INSTANTIATE(T)                                                                                    \
  template void router_softmax_forward<T>(T*, const T*, int, int);                                                 \
  template void router_softmax_backward<T>(T*, const T*, const T*, int, int);                                      \
  template void top_k<T>(int32_t*, const T*, int, int, int, const T*);                                            \
  template void gather_rows<T>(T*, const T*, const int32_t*, int, int, int);                                       \
  template void scatter_add_rows<T>(T*, const T*, const int32_t*, int, int, int);                                  \
  template void combine_forward<T>(T*, const T*, const T*, const int32_t*, const int32_t*, int, int, int, int);    \
  template void combine_backward<T>(T*, T*, const T*, const T*, const T*, const int32_t*, const int32_t*, int, int, \
                                    int, int);                                                                     \
  template void grouped_linear_forward<T>(MatmulPrecision, T*, const T*, const T* const*, const int32_t*, int, int, \
                                          int);                                                                    \
  template void grouped_linear_backward_input<T>(MatmulPrecision, T*, const T*, const T* const*, const int32_t*, int, \
                                                 int, int);                                                        \
  template void grouped_linear_backward_weight<T>(MatmulPrecision, T* const*, const T*, const T*, const int32_t*,  \
                                                  int, int, int);                                                  \
  template double aux_loss_forward<T>(const T*, const int32_t*, int, int, int, int);                               \
  template void aux_loss_backward<T>(T*, const int32_t*, int, int, int, int, T);                               \
  template void aux_loss_backward_shares<T>(T*, const double*, int, int, int, T);
KEEL_MOE_INSTANTIATE(float)
KEEL_MOE_INSTANTIATE(double)
#undef KEEL_MOE_INSTANTIATE

}  // namespace keel::moe
