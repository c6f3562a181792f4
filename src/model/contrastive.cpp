#include "model/contrastive.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace keel {

namespace {

// Rows of x [N, D] scaled to unit length (in double); norms kept for the backward pass.
void normalise(const float* x, int N, int D, std::vector<double>& out, std::vector<double>& norm) {
  out.resize(static_cast<size_t>(N) * D);
  norm.resize(N);
#pragma omp parallel for schedule(static)
  for (int i = 0; i < N; ++i) {
    double sq = 0;
    for (int d = 0; d < D; ++d) sq += static_cast<double>(x[static_cast<int64_t>(i) * D + d]) * x[static_cast<int64_t>(i) * D + d];
    // A zero feature has no direction: a tiny floor keeps it finite (its gradient is then ~0).
    norm[i] = std::max(std::sqrt(sq), 1e-12);
    for (int d = 0; d < D; ++d) out[static_cast<size_t>(i) * D + d] = x[static_cast<int64_t>(i) * D + d] / norm[i];
  }
}

// dx = (dxn - xn (xn . dxn)) / |x| for one row: the gradient through x / |x|.
void unnormalise_grad(float* dx, const double* dxn, const double* xn, double norm, int D, float scale) {
  double dot = 0;
  for (int d = 0; d < D; ++d) dot += dxn[d] * xn[d];
  for (int d = 0; d < D; ++d) dx[d] = static_cast<float>(scale * (dxn[d] - xn[d] * dot) / norm);
}

}  // namespace

ContrastiveResult contrastive_loss(const float* img, const float* txt, int N, int D, float logit_scale,
                                   double max_scale, int first, int n, float grad_scale, float* dimg, float* dtxt) {
  check(N >= 1 && D >= 1 && first >= 0 && n >= 0 && first + n <= N,
        "contrastive loss: rows " + std::to_string(first) + ".." + std::to_string(first + n) + " of " +
            std::to_string(N));
  check(std::isfinite(logit_scale), "contrastive loss: the logit scale is not finite");
  const double cap = std::log(max_scale);
  const bool clamped = logit_scale > cap;
  const double s = std::exp(clamped ? cap : static_cast<double>(logit_scale));
  std::vector<double> in, tn, inorm, tnorm;
  normalise(img, N, D, in, inorm);
  normalise(txt, N, D, tn, tnorm);
  // logits[i][j] = s in_i . tn_j
  std::vector<double> logits(static_cast<size_t>(N) * N);
#pragma omp parallel for schedule(static)
  for (int i = 0; i < N; ++i) {
    for (int j = 0; j < N; ++j) {
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += in[static_cast<size_t>(i) * D + d] * tn[static_cast<size_t>(j) * D + d];
      logits[static_cast<size_t>(i) * N + j] = s * dot;
    }
  }
  // Row softmax (image -> text) and column softmax (text -> image), each with its max subtracted.
  std::vector<double> prow(logits.size()), pcol(logits.size()), row_lse(N), col_lse(N);
  std::vector<int> row_best(N), col_best(N);
#pragma omp parallel for schedule(static)
  for (int i = 0; i < N; ++i) {
    double m = -INFINITY;
    int best = 0;
    for (int j = 0; j < N; ++j) {
      const double v = logits[static_cast<size_t>(i) * N + j];
      if (v > m) m = v, best = j;
    }
    double sum = 0;
    for (int j = 0; j < N; ++j) sum += std::exp(logits[static_cast<size_t>(i) * N + j] - m);
    row_lse[i] = m + std::log(sum);
    for (int j = 0; j < N; ++j) prow[static_cast<size_t>(i) * N + j] = std::exp(logits[static_cast<size_t>(i) * N + j] - row_lse[i]);
    row_best[i] = best;
  }
#pragma omp parallel for schedule(static)
  for (int j = 0; j < N; ++j) {
    double m = -INFINITY;
    int best = 0;
    for (int i = 0; i < N; ++i) {
      const double v = logits[static_cast<size_t>(i) * N + j];
      if (v > m) m = v, best = i;
    }
    double sum = 0;
    for (int i = 0; i < N; ++i) sum += std::exp(logits[static_cast<size_t>(i) * N + j] - m);
    col_lse[j] = m + std::log(sum);
    for (int i = 0; i < N; ++i) pcol[static_cast<size_t>(i) * N + j] = std::exp(logits[static_cast<size_t>(i) * N + j] - col_lse[j]);
    col_best[j] = best;
  }
  ContrastiveResult r;
  double loss = 0;
  int right_rows = 0, right_cols = 0;
  for (int i = 0; i < N; ++i) {  // sequential: a fixed order
    const double diag = logits[static_cast<size_t>(i) * N + i];
    loss += (row_lse[i] - diag) + (col_lse[i] - diag);
    right_rows += row_best[i] == i;
    right_cols += col_best[i] == i;
  }
  r.loss = loss / (2.0 * N);
  r.accuracy_i2t = static_cast<double>(right_rows) / N;
  r.accuracy_t2i = static_cast<double>(right_cols) / N;
  // G = dL/dlogits = (P_row + P_col - 2 I) / 2N;  dL/d(logit_scale) = sum G o logits (unclamped).
  const double inv = 1.0 / (2.0 * N);
  std::vector<double> g(logits.size());
  double dscale = 0;
  for (int i = 0; i < N; ++i) {
    for (int j = 0; j < N; ++j) {
      const size_t at = static_cast<size_t>(i) * N + j;
      g[at] = (prow[at] + pcol[at] - (i == j ? 2.0 : 0.0)) * inv;
      dscale += g[at] * logits[at];
    }
  }
  r.dlogit_scale = clamped ? 0.0 : dscale;
  if (dimg == nullptr || dtxt == nullptr) return r;
  // Own rows: dimg_n[i] = s sum_j G[i][j] tn_j;  dtxt_n[j] = s sum_i G[i][j] in_i.
#pragma omp parallel for schedule(static)
  for (int k = 0; k < n; ++k) {
    const int i = first + k;
    std::vector<double> di(D, 0.0), dt(D, 0.0);
    for (int j = 0; j < N; ++j) {
      const double gij = s * g[static_cast<size_t>(i) * N + j], gji = s * g[static_cast<size_t>(j) * N + i];
      for (int d = 0; d < D; ++d) {
        di[d] += gij * tn[static_cast<size_t>(j) * D + d];
        dt[d] += gji * in[static_cast<size_t>(j) * D + d];
      }
    }
    unnormalise_grad(dimg + static_cast<int64_t>(k) * D, di.data(), &in[static_cast<size_t>(i) * D], inorm[i], D,
                     grad_scale);
    unnormalise_grad(dtxt + static_cast<int64_t>(k) * D, dt.data(), &tn[static_cast<size_t>(i) * D], tnorm[i], D,
                     grad_scale);
  }
  return r;
}

}  // namespace keel

namespace keel {

RetrievalRecall retrieval_recall(const float* img, const float* txt, int N, int D) {
  check(N >= 1 && D >= 1, "retrieval recall: no pairs");
  std::vector<double> sim(static_cast<size_t>(N) * N);
#pragma omp parallel for schedule(static)
  for (int i = 0; i < N; ++i) {
    for (int j = 0; j < N; ++j) {
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += static_cast<double>(img[static_cast<int64_t>(i) * D + d]) * txt[static_cast<int64_t>(j) * D + d];
      sim[static_cast<size_t>(i) * N + j] = dot;
    }
  }
  RetrievalRecall r;
  r.pairs = N;
  for (int q = 0; q < N; ++q) {
    int ahead_row = 0, ahead_col = 0;  // candidates scoring at least the right answer's score
    for (int c = 0; c < N; ++c) {
      if (c == q) continue;
      ahead_row += sim[static_cast<size_t>(q) * N + c] >= sim[static_cast<size_t>(q) * N + q];
      ahead_col += sim[static_cast<size_t>(c) * N + q] >= sim[static_cast<size_t>(q) * N + q];
    }
    r.i2t_at1 += ahead_row < 1;
    r.i2t_at5 += ahead_row < 5;
    r.t2i_at1 += ahead_col < 1;
    r.t2i_at5 += ahead_col < 5;
  }
  for (double* v : {&r.i2t_at1, &r.i2t_at5, &r.t2i_at1, &r.t2i_at5}) *v /= N;
  return r;
}

}  // namespace keel
