// The image towers' kernels (kernels/cpu/conv.h): oneDNN's float convolutions against the direct
// double loops written from the definition, every kernel's backward passes against finite
// differences of its forward (in double), and the float path's determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <ostream>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/conv.h"

namespace keel {
namespace {

template <typename T>
std::vector<T> random_vector(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(rng.normal() * scale);
  return v;
}

double max_rel(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, scale = 1e-12;
  for (size_t i = 0; i < got.size(); ++i) {
    diff = std::max(diff, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return diff / scale;
}

std::vector<double> widen(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

struct ConvCase {
  const char* name;
  ops::ConvShape s;
};

void PrintTo(const ConvCase& c, std::ostream* os) { *os << c.name << ": " << c.s.str(); }

class ConvShapes : public ::testing::TestWithParam<ConvCase> {};

TEST_P(ConvShapes, OneDnnMatchesTheDefinition) {
  const ops::ConvShape s = GetParam().s;
  const auto x = random_vector<float>(s.in_size(), 1);
  const auto w = random_vector<float>(s.weight_size(), 2, 0.2);
  const auto dy = random_vector<float>(s.out_size(), 3);
  std::vector<float> y(s.out_size()), dx(s.in_size(), 0.5f), dw(s.weight_size(), 0.25f);
  std::vector<double> yd(s.out_size()), dxd(s.in_size(), 0.5), dwd(s.weight_size(), 0.25);
  ops::conv2d_forward(MatmulPrecision::fp32, y.data(), x.data(), w.data(), s);
  ops::conv2d_forward(MatmulPrecision::fp32, yd.data(), widen(x).data(), widen(w).data(), s);
  EXPECT_LT(max_rel(y, yd), 1e-5) << s.str();
  // accumulate: dx starts at 0.5 and keeps it
  ops::conv2d_backward_input(MatmulPrecision::fp32, dx.data(), dy.data(), w.data(), s, true);
  ops::conv2d_backward_input(MatmulPrecision::fp32, dxd.data(), widen(dy).data(), widen(w).data(), s, true);
  EXPECT_LT(max_rel(dx, dxd), 1e-5) << s.str();
  ops::conv2d_backward_input(MatmulPrecision::fp32, dx.data(), dy.data(), w.data(), s, false);
  ops::conv2d_backward_input(MatmulPrecision::fp32, dxd.data(), widen(dy).data(), widen(w).data(), s, false);
  EXPECT_LT(max_rel(dx, dxd), 1e-5) << s.str();
  ops::conv2d_backward_weight(MatmulPrecision::fp32, dw.data(), dy.data(), x.data(), s);  // += onto 0.25
  ops::conv2d_backward_weight(MatmulPrecision::fp32, dwd.data(), widen(dy).data(), widen(x).data(), s);
  EXPECT_LT(max_rel(dw, dwd), 1e-5) << s.str();
}

// With bf16 products (a ResNet under clip.visual_quant = "bf16"): the convolutions equal the
// definition's on the operands rounded to bf16 (sums in float32: within float32 rounding).
TEST_P(ConvShapes, Bf16ProductsEqualTheDefinitionOnRoundedOperands) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "no bf16 instructions here: bf16 convolutions run in float32";
  const ops::ConvShape s = GetParam().s;
  const auto x = random_vector<float>(s.in_size(), 7);
  const auto w = random_vector<float>(s.weight_size(), 8, 0.2);
  const auto dy = random_vector<float>(s.out_size(), 9);
  auto rounded = [](const std::vector<float>& v) {
    std::vector<double> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = round_to_bf16(v[i]);
    return out;
  };
  std::vector<float> y(s.out_size()), dx(s.in_size()), dw(s.weight_size(), 0.0f);
  std::vector<double> yd(s.out_size()), dxd(s.in_size()), dwd(s.weight_size(), 0.0);
  ops::conv2d_forward(MatmulPrecision::bf16, y.data(), x.data(), w.data(), s);
  ops::conv2d_backward_input(MatmulPrecision::bf16, dx.data(), dy.data(), w.data(), s, false);
  ops::conv2d_backward_weight(MatmulPrecision::bf16, dw.data(), dy.data(), x.data(), s);
  ops::conv2d_forward(MatmulPrecision::fp32, yd.data(), rounded(x).data(), rounded(w).data(), s);
  ops::conv2d_backward_input(MatmulPrecision::fp32, dxd.data(), rounded(dy).data(), rounded(w).data(), s, false);
  ops::conv2d_backward_weight(MatmulPrecision::fp32, dwd.data(), rounded(dy).data(), rounded(x).data(), s);
  EXPECT_LT(max_rel(y, yd), 1e-5) << s.str();
  EXPECT_LT(max_rel(dx, dxd), 1e-5) << s.str();
  EXPECT_LT(max_rel(dw, dwd), 1e-5) << s.str();
  // ... and differ from the float32 products (the switch is real).
  std::vector<float> y32(s.out_size());
  ops::conv2d_forward(MatmulPrecision::fp32, y32.data(), x.data(), w.data(), s);
  EXPECT_NE(y, y32) << s.str();
}

TEST_P(ConvShapes, FloatPathIsDeterministic) {
  const ops::ConvShape s = GetParam().s;
  const auto x = random_vector<float>(s.in_size(), 4);
  const auto w = random_vector<float>(s.weight_size(), 5);
  const auto dy = random_vector<float>(s.out_size(), 6);
  auto run = [&] {
    std::vector<float> y(s.out_size()), dx(s.in_size()), dw(s.weight_size(), 0.0f);
    ops::conv2d_forward(MatmulPrecision::fp32, y.data(), x.data(), w.data(), s);
    ops::conv2d_backward_input(MatmulPrecision::fp32, dx.data(), dy.data(), w.data(), s, false);
    ops::conv2d_backward_weight(MatmulPrecision::fp32, dw.data(), dy.data(), x.data(), s);
    y.insert(y.end(), dx.begin(), dx.end());
    y.insert(y.end(), dw.begin(), dw.end());
    return y;
  };
  EXPECT_EQ(run(), run());
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, ConvShapes,
    ::testing::Values(ConvCase{"stem7x7s2", {2, 20, 20, 3, 8, 7, 7, 2, 3}}, ConvCase{"conv3x3", {2, 9, 9, 8, 16, 3, 3, 1, 1}},
                      ConvCase{"conv3x3s2", {3, 10, 10, 16, 8, 3, 3, 2, 1}},
                      ConvCase{"conv1x1", {2, 6, 6, 32, 64, 1, 1, 1, 0}},
                      ConvCase{"conv1x1s2", {2, 7, 7, 16, 32, 1, 1, 2, 0}},
                      ConvCase{"a", {3, 64, 64, 3, 8, 7, 7, 2, 3}}, ConvCase{"b", {3, 16, 16, 8, 8, 3, 3, 1, 1}},
                      ConvCase{"c", {3, 16, 16, 8, 16, 3, 3, 2, 1}}, ConvCase{"d", {3, 8, 8, 16, 16, 3, 3, 1, 1}},
                      ConvCase{"e", {3, 16, 16, 8, 16, 1, 1, 2, 0}}, ConvCase{"f", {3, 4, 4, 32, 64, 3, 3, 2, 1}},
                      ConvCase{"g", {3, 2, 2, 64, 64, 3, 3, 1, 1}}, ConvCase{"h", {3, 4, 4, 32, 64, 1, 1, 2, 0}}),
    [](const auto& info) { return std::string(info.param.name); });

// Finite differences of L = sum(f(x) * r) for a kernel's forward f, in double.
double numeric(const std::function<double()>& loss, double& v) {
  const double h = 1e-6, keep = v;
  v = keep + h;
  const double up = loss();
  v = keep - h;
  const double down = loss();
  v = keep;
  return (up - down) / (2 * h);
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

TEST(ConvGradients, ConvolutionMatchesFiniteDifferences) {
  const ops::ConvShape s{2, 5, 5, 3, 4, 3, 3, 2, 1};
  auto x = random_vector<double>(s.in_size(), 7), w = random_vector<double>(s.weight_size(), 8);
  const auto r = random_vector<double>(s.out_size(), 9);
  auto loss = [&] {
    std::vector<double> y(s.out_size());
    ops::conv2d_forward(MatmulPrecision::fp32, y.data(), x.data(), w.data(), s);
    return dot(y, r);
  };
  std::vector<double> dx(s.in_size()), dw(s.weight_size(), 0.0);
  ops::conv2d_backward_input(MatmulPrecision::fp32, dx.data(), r.data(), w.data(), s, false);
  ops::conv2d_backward_weight(MatmulPrecision::fp32, dw.data(), r.data(), x.data(), s);
  for (size_t i = 0; i < x.size(); i += 7) EXPECT_NEAR(dx[i], numeric(loss, x[i]), 1e-6) << "dx " << i;
  for (size_t i = 0; i < w.size(); i += 5) EXPECT_NEAR(dw[i], numeric(loss, w[i]), 1e-6) << "dw " << i;
}

TEST(ConvGradients, GroupNormWithAndWithoutReluMatchFiniteDifferences) {
  const int N = 2, HW = 6, C = 8, G = 4;
  for (bool relu : {false, true}) {
    auto x = random_vector<double>(N * HW * C, 10), gamma = random_vector<double>(C, 11),
         beta = random_vector<double>(C, 12);
    const auto r = random_vector<double>(N * HW * C, 13);
    std::vector<double> y(x.size()), mean(N * G), rstd(N * G);
    auto loss = [&] {
      ops::groupnorm_forward(y.data(), mean.data(), rstd.data(), x.data(), gamma.data(), beta.data(), N, HW, C, G,
                             relu);
      return dot(y, r);
    };
    loss();
    std::vector<double> dx(x.size(), 1.0), dgamma(C, 0.0), dbeta(C, 0.0);
    ops::groupnorm_backward_input(dx.data(), r.data(), x.data(), y.data(), mean.data(), rstd.data(), gamma.data(), N,
                                  HW, C, G, relu, true);  // += onto 1
    ops::groupnorm_backward_weight(dgamma.data(), dbeta.data(), r.data(), x.data(), y.data(), mean.data(), rstd.data(),
                                   N, HW, C, G, relu);
    for (size_t i = 0; i < x.size(); i += 5) EXPECT_NEAR(dx[i] - 1.0, numeric(loss, x[i]), 1e-6) << relu << " dx " << i;
    for (int c = 0; c < C; ++c) {
      EXPECT_NEAR(dgamma[c], numeric(loss, gamma[c]), 1e-6) << relu << " dgamma " << c;
      EXPECT_NEAR(dbeta[c], numeric(loss, beta[c]), 1e-6) << relu << " dbeta " << c;
    }
  }
}

TEST(ConvGradients, PoolingAndReluMatchFiniteDifferences) {
  const int N = 2, H = 7, W = 7, C = 3;
  const int P = ops::pool_out(H, 3, 2, 1), Q = ops::pool_out(W, 3, 2, 1);
  auto x = random_vector<double>(N * H * W * C, 14);
  const auto r = random_vector<double>(N * P * Q * C, 15);
  std::vector<int32_t> arg(N * P * Q * C);
  auto loss = [&] {
    std::vector<double> y(N * P * Q * C);
    ops::maxpool_forward(y.data(), arg.data(), x.data(), N, H, W, C, 3, 2, 1);
    return dot(y, r);
  };
  loss();
  std::vector<double> dx(x.size());
  ops::maxpool_backward_input(dx.data(), r.data(), arg.data(), N, H, W, C, P, Q);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(dx[i], numeric(loss, x[i]), 1e-6) << "maxpool dx " << i;

  const auto ra = random_vector<double>(N * C, 16);
  auto avg_loss = [&] {
    std::vector<double> y(N * C);
    ops::avgpool_forward(y.data(), x.data(), N, H * W, C);
    return dot(y, ra);
  };
  ops::avgpool_backward_input(dx.data(), ra.data(), N, H * W, C);
  for (size_t i = 0; i < x.size(); i += 3) EXPECT_NEAR(dx[i], numeric(avg_loss, x[i]), 1e-6) << "avgpool dx " << i;

  auto b = random_vector<double>(x.size(), 17);
  const auto rr = random_vector<double>(x.size(), 18);
  std::vector<double> y(x.size());
  ops::add_relu_forward(y.data(), x.data(), b.data(), static_cast<int64_t>(x.size()));
  std::vector<double> dy(x.size());
  ops::relu_backward(dy.data(), rr.data(), y.data(), static_cast<int64_t>(x.size()));
  auto relu_loss = [&] {
    std::vector<double> z(x.size());
    ops::add_relu_forward(z.data(), x.data(), b.data(), static_cast<int64_t>(x.size()));
    return dot(z, rr);
  };
  for (size_t i = 0; i < x.size(); i += 3) EXPECT_NEAR(dy[i], numeric(relu_loss, x[i]), 1e-6) << "relu " << i;
}

TEST(ConvShapesBadInput, ImpossibleShapesAreOneLine) {
  std::vector<float> a(64), b(64), c(64);
  const ops::ConvShape s{1, 2, 2, 1, 1, 5, 5, 1, 0};  // a 5 x 5 kernel on a 2 x 2 image, no padding
  try {
    ops::conv2d_forward(MatmulPrecision::fp32, a.data(), b.data(), c.data(), s);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("impossible shape"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace keel
