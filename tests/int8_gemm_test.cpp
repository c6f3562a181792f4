// Dynamic int8 matrix products (kernels/cpu/int8_gemm.h): the fast path equals the reference byte
// for byte, the reference matches a product worked by hand, the quantisation error stays within its
// derived bound, and repeated or concurrent calls give the same bytes.
#include "kernels/cpu/int8_gemm.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"

namespace keel {
namespace {

// One product's shape, layout and coefficients. pad_* is how far each leading dimension exceeds
// the minimum; the padding is filled with values that would change the scales if it were read.
struct Case {
  bool trans_a, trans_b;
  int M, N, K;
  int pad_a, pad_b, pad_c;
  float alpha, beta;
};

std::string describe(const Case& c) {
  return "trans_a " + std::to_string(c.trans_a) + " trans_b " + std::to_string(c.trans_b) + " M " +
         std::to_string(c.M) + " N " + std::to_string(c.N) + " K " + std::to_string(c.K) + " alpha " +
         std::to_string(c.alpha) + " beta " + std::to_string(c.beta);
}

// The operands and output of one case, stored as the case lays them out.
struct Problem {
  Case c;
  int lda, ldb, ldc;
  std::vector<float> A, B, C;

  // op(A)[i,k] and op(B)[k,j] as stored.
  float& a(int i, int k) {
    return c.trans_a ? A[static_cast<size_t>(k) * lda + i] : A[static_cast<size_t>(i) * lda + k];
  }
  float& b(int k, int j) {
    return c.trans_b ? B[static_cast<size_t>(j) * ldb + k] : B[static_cast<size_t>(k) * ldb + j];
  }
};

Problem make_problem(const Case& c, unsigned seed) {
  Problem p{c, 0, 0, 0, {}, {}, {}};
  const int a_rows = c.trans_a ? c.K : c.M, a_cols = c.trans_a ? c.M : c.K;
  const int b_rows = c.trans_b ? c.N : c.K, b_cols = c.trans_b ? c.K : c.N;
  p.lda = a_cols + c.pad_a;
  p.ldb = b_cols + c.pad_b;
  p.ldc = c.N + c.pad_c;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  p.A.assign(static_cast<size_t>(a_rows) * p.lda, 1.0e30f);  // padding: never to be read
  p.B.assign(static_cast<size_t>(b_rows) * p.ldb, 1.0e30f);
  for (int i = 0; i < c.M; ++i)
    for (int k = 0; k < c.K; ++k) p.a(i, k) = normal(rng);
  for (int k = 0; k < c.K; ++k)
    for (int j = 0; j < c.N; ++j) p.b(k, j) = 3.0f * normal(rng);
  // C: random where beta is used; NaN where it must not be read (beta == 0) or written (padding).
  p.C.assign(static_cast<size_t>(c.M) * p.ldc, std::numeric_limits<float>::quiet_NaN());
  if (c.beta != 0.0f) {
    for (int i = 0; i < c.M; ++i)
      for (int j = 0; j < c.N; ++j) p.C[static_cast<size_t>(i) * p.ldc + j] = normal(rng);
  }
  return p;
}

// Runs the fast path and the reference on copies of p.C; returns both outputs.
std::pair<std::vector<float>, std::vector<float>> run_both(const Problem& p) {
  std::vector<float> fast = p.C, ref = p.C;
  const Case& c = p.c;
  gemm_int8_dynamic(c.trans_a, c.trans_b, c.M, c.N, c.K, c.alpha, p.A.data(), p.lda, p.B.data(), p.ldb, c.beta,
                    fast.data(), p.ldc);
  gemm_int8_dynamic_reference(c.trans_a, c.trans_b, c.M, c.N, c.K, c.alpha, p.A.data(), p.lda, p.B.data(), p.ldb,
                              c.beta, ref.data(), p.ldc);
  return {fast, ref};
}

// Same bytes, and the padding of C (columns N..ldc-1) untouched.
void expect_same_bytes(const Problem& p, const std::vector<float>& fast, const std::vector<float>& ref) {
  ASSERT_EQ(fast.size(), ref.size());
  EXPECT_EQ(std::memcmp(fast.data(), ref.data(), fast.size() * sizeof(float)), 0) << describe(p.c);
  for (int i = 0; i < p.c.M; ++i) {
    for (int j = p.c.N; j < p.ldc; ++j) {
      ASSERT_TRUE(std::isnan(fast[static_cast<size_t>(i) * p.ldc + j])) << "C padding written, " << describe(p.c);
    }
  }
  for (int i = 0; i < p.c.M; ++i) {
    for (int j = 0; j < p.c.N; ++j) {
      ASSERT_TRUE(std::isfinite(fast[static_cast<size_t>(i) * p.ldc + j])) << i << "," << j << " " << describe(p.c);
    }
  }
}

TEST(Int8Gemm, ReferenceMatchesHandWorkedExample) {
  // op(A) = [[127, -63.5], [5, -254]]: scales 1 and 2; codes [[127, -64], [2, -127]]
  //   (-63.5 and 5/2 = 2.5 are ties, rounded to the even -64 and 2).
  // op(B) = [[127, 381], [1, -4.5]]: column scales 1 and 3; codes [[127, 127], [1, -2]]
  //   (-4.5/3 = -1.5, a tie, rounded to the even -2).
  // acc = [[127*127 - 64, 127*127 + 128], [2*127 - 127, 2*127 + 254]] = [[16065, 16257], [127, 508]];
  // C = sa[i] * sb[j] * acc = [[16065, 48771], [254, 3048]].
  const float A[] = {127.0f, -63.5f, 5.0f, -254.0f};
  const float B[] = {127.0f, 381.0f, 1.0f, -4.5f};
  float C[4];
  gemm_int8_dynamic_reference(false, false, 2, 2, 2, 1.0f, A, 2, B, 2, 0.0f, C, 2);
  EXPECT_EQ(C[0], 16065.0f);
  EXPECT_EQ(C[1], 48771.0f);
  EXPECT_EQ(C[2], 254.0f);
  EXPECT_EQ(C[3], 3048.0f);
  // alpha 0.5 and beta 2 on C = [[1, 2], [3, 4]].
  float D[] = {1.0f, 2.0f, 3.0f, 4.0f};
  gemm_int8_dynamic_reference(false, false, 2, 2, 2, 0.5f, A, 2, B, 2, 2.0f, D, 2);
  EXPECT_EQ(D[0], 8034.5f);
  EXPECT_EQ(D[1], 24389.5f);
  EXPECT_EQ(D[2], 133.0f);
  EXPECT_EQ(D[3], 1532.0f);
  // The same product with both operands stored transposed.
  const float At[] = {127.0f, 5.0f, -63.5f, -254.0f};
  const float Bt[] = {127.0f, 1.0f, 381.0f, -4.5f};
  float E[4];
  gemm_int8_dynamic_reference(true, true, 2, 2, 2, 1.0f, At, 2, Bt, 2, 0.0f, E, 2);
  EXPECT_EQ(std::memcmp(C, E, sizeof C), 0);
  // And the fast path on it.
  float F[4];
  gemm_int8_dynamic(false, false, 2, 2, 2, 1.0f, A, 2, B, 2, 0.0f, F, 2);
  EXPECT_EQ(std::memcmp(C, F, sizeof C), 0);
}

TEST(Int8Gemm, FastPathEqualsReferenceBitForBit) {
  std::cout << "int8 engine: " << int8_engine() << "\n";
  const int shapes[][3] = {{1, 1, 1},    {3, 5, 1},      {2, 2, 2},   {17, 33, 19}, {16, 16, 16},
                           {64, 48, 64}, {100, 37, 250}, {5, 130, 7}, {129, 65, 3}, {257, 70, 131}};
  const float coefficients[][2] = {{1.0f, 0.0f}, {-0.75f, 0.0f}, {1.5f, 1.0f}, {0.3f, -2.25f}};
  int n = 0;
  for (const auto& s : shapes) {
    for (int t = 0; t < 4; ++t) {
      const auto& ab = coefficients[(n++) % 4];
      const int pad = (n % 3 == 0) ? 0 : 1 + n % 5;
      const Case c{(t & 1) != 0, (t & 2) != 0, s[0], s[1], s[2], pad, pad + 2, pad + 1, ab[0], ab[1]};
      const Problem p = make_problem(c, 1000u + static_cast<unsigned>(n));
      const auto [fast, ref] = run_both(p);
      expect_same_bytes(p, fast, ref);
    }
  }
}

TEST(Int8Gemm, ZeroRowsAndColumnsAndOutliers) {
  for (int t = 0; t < 4; ++t) {
    const Case c{(t & 1) != 0, (t & 2) != 0, 37, 45, 70, 3, 0, 2, 1.25f, t % 2 == 0 ? 0.0f : 0.5f};
    Problem p = make_problem(c, 77u + static_cast<unsigned>(t));
    for (int k = 0; k < c.K; ++k) p.a(4, k) = 0.0f;  // a zero row of op(A): scale 0
    for (int k = 0; k < c.K; ++k) p.b(k, 9) = 0.0f;  // a zero column of op(B)
    p.a(11, 17) = 1.0e6f;                            // a row dominated by one huge value
    p.b(23, 30) = -3.0e7f;                           // a column likewise
    for (int k = 0; k < c.K; ++k) p.a(20, k) = k == 5 ? -2.5f : 1.0e-3f * static_cast<float>(k % 7);
    const auto [fast, ref] = run_both(p);
    expect_same_bytes(p, fast, ref);
    if (c.beta == 0.0f) {
      for (int j = 0; j < c.N; ++j) EXPECT_EQ(fast[static_cast<size_t>(4) * p.ldc + j], 0.0f);
      for (int i = 0; i < c.M; ++i) EXPECT_EQ(fast[static_cast<size_t>(i) * p.ldc + 9], 0.0f);
    }
  }
}

// With the codes qa, qb and scales sa, sb, op(A) = sa*qa + ea and op(B) = sb*qb + eb elementwise
// (ea, eb the rounding errors), so the exact product differs from the quantised one by
//   sum_k (a eb + b ea - ea eb),  whose magnitude is at most  sum_k (|a||eb| + |b||ea| + |ea||eb|),
// with |ea| <= sa/2 and |eb| <= sb/2 (half a step of the rounding; a little more allows for the
// float32 division and scale). The float32 evaluation of alpha*(sa*sb)*acc adds at most three
// roundings, a relative 2^-22 of the result.
TEST(Int8Gemm, QuantisationErrorWithinBound) {
  for (int t = 0; t < 4; ++t) {
    const Case c{(t & 1) != 0, (t & 2) != 0, 33, 29, 200, 0, 1, 0, 1.5f, 0.0f};
    Problem p = make_problem(c, 4242u + static_cast<unsigned>(t));
    p.a(3, 7) = 40.0f;  // an outlier, so that row's other elements carry large relative errors
    std::vector<float> C = p.C;
    gemm_int8_dynamic(c.trans_a, c.trans_b, c.M, c.N, c.K, c.alpha, p.A.data(), p.lda, p.B.data(), p.ldb, c.beta,
                      C.data(), p.ldc);
    std::vector<double> sa(c.M, 0.0), sb(c.N, 0.0);
    for (int i = 0; i < c.M; ++i)
      for (int k = 0; k < c.K; ++k) sa[i] = std::max(sa[i], std::fabs(static_cast<double>(p.a(i, k))) / 127.0);
    for (int j = 0; j < c.N; ++j)
      for (int k = 0; k < c.K; ++k) sb[j] = std::max(sb[j], std::fabs(static_cast<double>(p.b(k, j))) / 127.0);
    const double half = 0.5 * (1.0 + 1.0e-5);
    double worst = 0.0, err2 = 0.0, ref2 = 0.0;
    for (int i = 0; i < c.M; ++i) {
      for (int j = 0; j < c.N; ++j) {
        double exact = 0.0, bound = 0.0;
        const double ea = half * sa[i], eb = half * sb[j];
        for (int k = 0; k < c.K; ++k) {
          const double a = p.a(i, k), b = p.b(k, j);
          exact += a * b;
          bound += std::fabs(a) * eb + std::fabs(b) * ea + ea * eb;
        }
        exact *= c.alpha;
        bound *= std::fabs(c.alpha);
        const double got = C[static_cast<size_t>(i) * p.ldc + j];
        const double err = std::fabs(got - exact);
        const double allowed = bound + std::ldexp(std::fabs(got), -22);
        ASSERT_LE(err, allowed) << i << "," << j << " " << describe(c);
        worst = std::max(worst, err / allowed);
        err2 += err * err;
        ref2 += exact * exact;
      }
    }
    // The bound is loose but not vacuous, and the product is close overall.
    EXPECT_GT(worst, 0.0);
    EXPECT_LT(std::sqrt(err2 / ref2), 0.02) << describe(c);
  }
}

TEST(Int8Gemm, DeterministicAcrossCallsAndThreads) {
  const Case c{false, true, 130, 96, 77, 2, 1, 3, 0.8f, -1.0f};
  const Problem p = make_problem(c, 9u);
  std::vector<float> first = p.C, second = p.C;
  gemm_int8_dynamic(c.trans_a, c.trans_b, c.M, c.N, c.K, c.alpha, p.A.data(), p.lda, p.B.data(), p.ldb, c.beta,
                    first.data(), p.ldc);
  gemm_int8_dynamic(c.trans_a, c.trans_b, c.M, c.N, c.K, c.alpha, p.A.data(), p.lda, p.B.data(), p.ldb, c.beta,
                    second.data(), p.ldc);
  EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0);
  // Concurrent calls from inside a parallel region (each thread its own output; per-thread buffers
  // and scratchpads) give the same bytes.
  constexpr int kThreads = 4;
  std::vector<std::vector<float>> outputs(kThreads, p.C);
#pragma omp parallel for num_threads(kThreads) schedule(static, 1)
  for (int t = 0; t < kThreads; ++t) {
    gemm_int8_dynamic(c.trans_a, c.trans_b, c.M, c.N, c.K, c.alpha, p.A.data(), p.lda, p.B.data(), p.ldb, c.beta,
                      outputs[t].data(), p.ldc);
  }
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(std::memcmp(first.data(), outputs[t].data(), first.size() * sizeof(float)), 0) << "thread " << t;
  }
}

TEST(Int8Gemm, EmptyAndInvalidSizes) {
  // K == 0: an empty sum, so C = beta * C.
  float C[] = {1.0f, 2.0f};
  const float x = 0.0f;
  gemm_int8_dynamic(false, false, 1, 2, 0, 1.0f, &x, 1, &x, 2, 3.0f, C, 2);
  EXPECT_EQ(C[0], 3.0f);
  EXPECT_EQ(C[1], 6.0f);
  gemm_int8_dynamic(false, false, 0, 2, 4, 1.0f, nullptr, 4, nullptr, 2, 0.0f, nullptr, 2);  // nothing to do
  // K beyond the int32 bound, and a leading dimension too small.
  EXPECT_THROW(gemm_int8_dynamic(false, false, 1, 1, 200000, 1.0f, nullptr, 200000, nullptr, 1, 0.0f, C, 1), Error);
  EXPECT_THROW(gemm_int8_dynamic(false, false, 2, 2, 4, 1.0f, nullptr, 3, nullptr, 2, 0.0f, C, 2), Error);
}

}  // namespace
}  // namespace keel
