#include "model/tensor_group.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/vmath.h"

namespace keel {

void vocab_parallel_crossentropy(TensorGroup& group, float* losses, float* logits, const int* targets, int N, int Vl,
                                 int vocab_begin, int vocab_size, float grad_scale) {
  const int real = std::clamp(vocab_size - vocab_begin, 0, Vl);  // this rank's rows of the real vocabulary
  // [0, N): row maxima; then [0, N) sums of exponentials and [N, 2N) target logits, in one sum.
  std::vector<float> max(N), sums(2 * static_cast<size_t>(N));
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* row = logits + static_cast<int64_t>(n) * Vl;
    float mx = -INFINITY;
    for (int j = 0; j < real; ++j) mx = std::max(mx, row[j]);
    max[n] = mx;
  }
  group.allreduce_max(max.data(), N);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    float* row = logits + static_cast<int64_t>(n) * Vl;
    const float mx = max[n];
    float sum = 0;
    const int t = targets[n] - vocab_begin;
    // The target's logit, from the rank holding it (0 elsewhere: the sum below is that one value).
    sums[N + n] = t >= 0 && t < real ? row[t] : 0.0f;
    // exp(row - max) is kept in `row` when a gradient is wanted, saving a second exp pass.
    if (grad_scale != 0.0f) {
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < real; ++j) {
        row[j] = vmath::exp(row[j] - mx);
        sum += row[j];
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < real; ++j) sum += vmath::exp(row[j] - mx);
    }
    sums[n] = sum;
  }
  group.allreduce_sum(sums.data(), 2 * static_cast<int64_t>(N));
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    losses[n] = std::log(sums[n]) + max[n] - sums[N + n];
    if (grad_scale == 0.0f) continue;
    float* row = logits + static_cast<int64_t>(n) * Vl;
    const float inv = grad_scale / sums[n];
#pragma omp simd
    for (int j = 0; j < real; ++j) row[j] *= inv;
    const int t = targets[n] - vocab_begin;
    if (t >= 0 && t < real) row[t] -= grad_scale;
    std::fill(row + real, row + Vl, 0.0f);
  }
}

void vocab_parallel_embedding_forward(TensorGroup& group, float* x_out, const Batch& b, const float* wte_shard,
                                      const float* wpe, int pos0, int Vl, int vocab_begin, int C, float* partial,
                                      const int* positions) {
  const int64_t N = static_cast<int64_t>(b.B) * b.T, R = group.rows(N);
  float* rows = group.sequence_parallel() ? partial : x_out;  // every token's row of this rank's vocabulary
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int v = b.inputs[n] - vocab_begin;
    float* o = rows + n * C;
    if (v >= 0 && v < Vl) {
      std::memcpy(o, wte_shard + static_cast<int64_t>(v) * C, sizeof(float) * C);
    } else {
      std::fill(o, o + C, 0.0f);
    }
  }
  if (group.sequence_parallel()) {
    group.reduce_scatter_sum(rows, R * C);  // this rank's rows, at rows[0 ..)
    std::memcpy(x_out, rows, sizeof(float) * R * C);
  } else {
    group.allreduce_sum(x_out, N * C);
  }
  if (wpe == nullptr) return;
  const int64_t first = R == N ? 0 : group.rank() * R;  // the batch row of x_out's first row
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < R; ++n) {
    const int t = static_cast<int>((first + n) % b.T);
    const float* p = wpe + static_cast<int64_t>(positions ? positions[t] : pos0 + t) * C;
    float* o = x_out + n * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] += p[c];
  }
}

void vocab_parallel_embedding_backward(float* dwte_shard, float* dwpe, const float* dx_out, const Batch& b, int Vl,
                                       int vocab_begin, int C, const int* positions) {
  const int64_t N = static_cast<int64_t>(b.B) * b.T;
  // Channels split over threads, tokens in order within each: the same sums as one rank's.
#pragma omp parallel
  {
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t c0 = C * static_cast<int64_t>(me) / threads, c1 = C * static_cast<int64_t>(me + 1) / threads;
    for (int64_t n = 0; n < N; ++n) {
      const float* d = dx_out + n * C;
      const int v = b.inputs[n] - vocab_begin;
      if (v >= 0 && v < Vl) {
        float* e = dwte_shard + static_cast<int64_t>(v) * C;
        for (int64_t c = c0; c < c1; ++c) e[c] += d[c];
      }
      if (dwpe != nullptr) {
        const int t = static_cast<int>(n % b.T);
        float* p = dwpe + static_cast<int64_t>(positions ? positions[t] : t) * C;
        for (int64_t c = c0; c < c1; ++c) p[c] += d[c];
      }
    }
  }
}

}  // namespace keel
