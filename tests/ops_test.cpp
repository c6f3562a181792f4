// Tests for the CPU kernels (kernels/cpu/ops.h): every backward kernel against central finite
// differences of its forward kernel in double precision, the float instantiation against the
// double one, the accumulate contracts, and bit-identical results run to run and across thread
// counts where the code promises a fixed reduction order.
#include "kernels/cpu/ops.h"

#include <cblas.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/amx_attention.h"
#include "kernels/cpu/batched_gemm.h"
#include "kernels/cpu/weight_gemm.h"

namespace keel::ops {
namespace {

// Small shapes, so that every element of every tensor gets its own finite difference.
constexpr int kB = 2, kT = 5, kC = 8, kNH = 2, kOC = 12, kV = 11, kVp = 16;
constexpr int kN = kB * kT;

constexpr double kStep = 1e-6;         // central-difference step
constexpr double kFdTol = 1e-6;        // analytic vs finite difference, relative to the tensor's max
constexpr double kFloatTol = 2e-6;     // float vs double, same measure (observed <= 2e-7)
constexpr double kSentinel = 12345.0;  // pre-fill of outputs a kernel must overwrite

// Named outputs of one op (forward results and gradients), in the op's scalar type.
template <typename T>
using Tensors = std::map<std::string, std::vector<T>>;

std::vector<double> normal(Rng& rng, size_t n, double scale = 1.0, double shift = 0.0) {
  std::vector<double> v(n);
  for (double& x : v) x = shift + scale * rng.normal();
  return v;
}

template <typename T>
std::vector<T> cast(const std::vector<double>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<T>(v[i]);
  return out;
}

template <typename T>
std::vector<T> filled(size_t n, double value) {
  return std::vector<T>(n, static_cast<T>(value));
}

template <typename T>
double dot(const std::vector<T>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// max|got - want| / max(1e-8, max|want|): one number per tensor, so tiny entries of a tensor with
// large ones are not held to an impossible relative standard.
template <typename T>
double relative_error(const std::vector<T>& got, const std::vector<double>& want) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return diff / std::max(1e-8, scale);
}

template <typename T>
::testing::AssertionResult close(const std::string& what, const std::vector<T>& got, const std::vector<double>& want,
                                 double tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << what << ": size " << got.size() << ", expected " << want.size();
  }
  const double err = relative_error(got, want);
  if (err < tol) return ::testing::AssertionSuccess();
  size_t worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::abs(static_cast<double>(got[i]) - want[i]) > std::abs(static_cast<double>(got[worst]) - want[worst])) {
      worst = i;
    }
  }
  return ::testing::AssertionFailure() << what << ": relative error " << err << " >= " << tol << "; worst at [" << worst
                                       << "]: got " << static_cast<double>(got[worst]) << ", expected " << want[worst];
}

template <typename T>
::testing::AssertionResult bit_identical(const std::string& what, const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0) {
    return ::testing::AssertionSuccess();
  }
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure() << what << ": differs at [" << i << "]: " << a[i] << " vs " << b[i];
    }
  }
  return ::testing::AssertionFailure() << what << ": sizes " << a.size() << " vs " << b.size();
}

// Central difference of objective() w.r.t. every element of x, which objective() reads.
template <typename F>
std::vector<double> finite_difference(std::vector<double>& x, F&& objective) {
  std::vector<double> grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    const double xp = x0 + kStep, xm = x0 - kStep;
    x[i] = xp;
    const double lp = objective();
    x[i] = xm;
    const double lm = objective();
    x[i] = x0;
    grad[i] = (lp - lm) / (xp - xm);  // the steps actually taken, after rounding
  }
  return grad;
}

// Sets the OpenMP thread count for a scope (OpenBLAS's OpenMP build follows it too).
class Threads {
 public:
  explicit Threads(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~Threads() { omp_set_num_threads(saved_); }
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;

 private:
  int saved_;
};

// ---- one case per op: inputs in double, and a run in either scalar type --------------------------
// Each run_* does the forward pass, then the backward kernels with dout = the case's R, so
// L = sum(out * R) is the objective whose gradients the backward kernels return. Outputs a kernel
// must overwrite start as kSentinel; weight gradients, which accumulate, start at zero.

struct EncoderCase {
  int B = kB, Tn = kT, C = kC, Vp = kVp;
  std::vector<int> tokens;
  std::vector<double> wte, wpe, R;
};

EncoderCase make_encoder_case(uint64_t seed, int B = kB, int Tn = kT, int C = kC) {
  Rng rng(seed);
  EncoderCase c;
  c.B = B, c.Tn = Tn, c.C = C;
  // Tokens from a range smaller than B*T, so rows of wte receive several contributions, with the
  // same token at one position in both sequences and twice within a sequence.
  for (int n = 0; n < B * Tn; ++n) c.tokens.push_back(static_cast<int>(rng.below(kV - 5)));
  c.tokens[Tn] = c.tokens[0];
  c.tokens[2] = c.tokens[0];
  c.tokens[Tn - 1] = kVp - 1;  // the last padded row is addressable
  c.wte = normal(rng, static_cast<size_t>(c.Vp) * C);
  c.wpe = normal(rng, static_cast<size_t>(Tn) * C);
  c.R = normal(rng, static_cast<size_t>(B) * Tn * C);
  return c;
}

template <typename T>
Tensors<T> run_encoder(const EncoderCase& c) {
  const size_t NC = static_cast<size_t>(c.B) * c.Tn * c.C;
  auto wte = cast<T>(c.wte), wpe = cast<T>(c.wpe), R = cast<T>(c.R);
  Tensors<T> r;
  r["out"] = filled<T>(NC, kSentinel);
  r["dwte"] = filled<T>(wte.size(), 0);
  r["dwpe"] = filled<T>(wpe.size(), 0);
  encoder_forward<T>(r["out"].data(), c.tokens.data(), wte.data(), wpe.data(), c.B, c.Tn, c.C);
  encoder_backward_weight<T>(r["dwte"].data(), r["dwpe"].data(), R.data(), c.tokens.data(), c.B, c.Tn, c.C);
  return r;
}

struct LayernormCase {
  int N = kN, C = kC;
  std::vector<double> inp, w, b, R;
};

LayernormCase make_layernorm_case(uint64_t seed, int N = kN, int C = kC) {
  Rng rng(seed);
  LayernormCase c;
  c.N = N, c.C = C;
  c.inp = normal(rng, static_cast<size_t>(N) * C, 2.0, 0.7);  // non-zero mean, non-unit variance
  c.w = normal(rng, C, 1.0, 1.0);
  c.b = normal(rng, C);
  c.R = normal(rng, static_cast<size_t>(N) * C);
  return c;
}

template <typename T>
Tensors<T> run_layernorm(const LayernormCase& c) {
  const size_t NC = static_cast<size_t>(c.N) * c.C;
  auto inp = cast<T>(c.inp), w = cast<T>(c.w), b = cast<T>(c.b), R = cast<T>(c.R);
  Tensors<T> r;
  r["out"] = filled<T>(NC, kSentinel);
  r["mean"] = filled<T>(c.N, kSentinel);
  r["rstd"] = filled<T>(c.N, kSentinel);
  r["dinp"] = filled<T>(NC, kSentinel);
  r["dw"] = filled<T>(c.C, 0);
  r["db"] = filled<T>(c.C, 0);
  layernorm_forward<T>(r["out"].data(), r["mean"].data(), r["rstd"].data(), inp.data(), w.data(), b.data(), c.N, c.C);
  layernorm_backward_input<T>(r["dinp"].data(), R.data(), inp.data(), r["mean"].data(), r["rstd"].data(), w.data(), c.N,
                              c.C, false);
  layernorm_backward_weight<T>(r["dw"].data(), r["db"].data(), R.data(), inp.data(), r["mean"].data(), r["rstd"].data(),
                               c.N, c.C);
  return r;
}

struct LinearCase {
  int N = kN, C = kC, OC = kOC;
  bool has_bias = true;
  std::vector<double> inp, w, bias, R;
};

LinearCase make_linear_case(uint64_t seed, bool has_bias, int N = kN, int C = kC, int OC = kOC) {
  Rng rng(seed);
  LinearCase c;
  c.N = N, c.C = C, c.OC = OC, c.has_bias = has_bias;
  c.inp = normal(rng, static_cast<size_t>(N) * C);
  c.w = normal(rng, static_cast<size_t>(OC) * C, 0.5);
  if (has_bias) c.bias = normal(rng, OC);
  c.R = normal(rng, static_cast<size_t>(N) * OC);
  return c;
}

template <typename T>
Tensors<T> run_linear(const LinearCase& c) {
  auto inp = cast<T>(c.inp), w = cast<T>(c.w), bias = cast<T>(c.bias), R = cast<T>(c.R);
  Tensors<T> r;
  r["out"] = filled<T>(static_cast<size_t>(c.N) * c.OC, kSentinel);
  r["dinp"] = filled<T>(inp.size(), kSentinel);
  r["dw"] = filled<T>(w.size(), 0);
  if (c.has_bias) r["dbias"] = filled<T>(c.OC, 0);
  T* dbias = c.has_bias ? r["dbias"].data() : nullptr;
  linear_forward<T>(MatmulPrecision::fp32, r["out"].data(), inp.data(), w.data(), c.has_bias ? bias.data() : nullptr,
                    c.N, c.C, c.OC);
  linear_backward_input<T>(MatmulPrecision::fp32, r["dinp"].data(), R.data(), w.data(), c.N, c.C, c.OC, false);
  linear_backward_weight<T>(MatmulPrecision::fp32, r["dw"].data(), dbias, R.data(), inp.data(), c.N, c.C, c.OC);
  return r;
}

struct GeluCase {
  std::vector<double> inp, R;
};

GeluCase make_gelu_case(uint64_t seed) {
  Rng rng(seed);
  GeluCase c;
  c.inp = normal(rng, static_cast<size_t>(kN) * 4 * kC, 2.5);  // reaches both tails of tanh
  c.inp[0] = 0.0;
  c.R = normal(rng, c.inp.size());
  return c;
}

template <typename T>
Tensors<T> run_gelu(const GeluCase& c) {
  auto inp = cast<T>(c.inp), R = cast<T>(c.R);
  Tensors<T> r;
  r["out"] = filled<T>(inp.size(), kSentinel);
  r["dinp"] = filled<T>(inp.size(), kSentinel);
  gelu_forward<T>(r["out"].data(), inp.data(), static_cast<int64_t>(inp.size()));
  gelu_backward_input<T>(r["dinp"].data(), R.data(), inp.data(), static_cast<int64_t>(inp.size()));
  return r;
}

struct ResidualCase {
  std::vector<double> a, b, R;
};

ResidualCase make_residual_case(uint64_t seed) {
  Rng rng(seed);
  ResidualCase c;
  c.a = normal(rng, static_cast<size_t>(kN) * kC);
  c.b = normal(rng, c.a.size());
  c.R = normal(rng, c.a.size());
  return c;
}

template <typename T>
Tensors<T> run_residual(const ResidualCase& c) {
  auto a = cast<T>(c.a), b = cast<T>(c.b);
  Tensors<T> r;
  r["out"] = filled<T>(a.size(), kSentinel);
  residual_forward<T>(r["out"].data(), a.data(), b.data(), static_cast<int64_t>(a.size()));
  return r;
}

struct AttentionCase {
  int B = kB, Tn = kT, C = kC, NH = kNH;
  std::vector<double> qkv, R;
};

AttentionCase make_attention_case(uint64_t seed, int B = kB, int Tn = kT, int C = kC, int NH = kNH) {
  Rng rng(seed);
  AttentionCase c;
  c.B = B, c.Tn = Tn, c.C = C, c.NH = NH;
  c.qkv = normal(rng, static_cast<size_t>(B) * Tn * 3 * C);
  c.R = normal(rng, static_cast<size_t>(B) * Tn * C);
  return c;
}

template <typename T>
Tensors<T> run_attention(const AttentionCase& c) {
  auto qkv = cast<T>(c.qkv), R = cast<T>(c.R);
  Tensors<T> r;
  r["out"] = filled<T>(c.R.size(), kSentinel);
  r["att"] = filled<T>(static_cast<size_t>(c.B) * c.NH * c.Tn * c.Tn, kSentinel);
  r["dqkv"] = filled<T>(qkv.size(), kSentinel);
  attention_forward<T>(MatmulPrecision::fp32, r["out"].data(), r["att"].data(), qkv.data(), c.B, c.Tn, c.C, c.NH);
  attention_backward_input<T>(MatmulPrecision::fp32, r["dqkv"].data(), R.data(), r["att"].data(), qkv.data(), c.B, c.Tn,
                              c.C, c.NH);
  return r;
}

struct CrossentropyCase {
  int N = kN, V = kV, Vp = kVp;
  double grad_scale = 0.37;
  std::vector<int> targets;
  std::vector<double> logits;
};

CrossentropyCase make_crossentropy_case(uint64_t seed) {
  Rng rng(seed);
  CrossentropyCase c;
  c.logits = normal(rng, static_cast<size_t>(c.N) * c.Vp, 2.0);
  // Padded columns hold values that would dominate the softmax if they were read.
  for (int n = 0; n < c.N; ++n) {
    for (int j = c.V; j < c.Vp; ++j) c.logits[static_cast<size_t>(n) * c.Vp + j] = 1e4 + j;
  }
  for (int n = 0; n < c.N; ++n) c.targets.push_back(static_cast<int>(rng.below(c.V)));
  c.targets[0] = 0;  // both ends of the real vocabulary
  c.targets[1] = c.V - 1;
  return c;
}

template <typename T>
Tensors<T> run_crossentropy(const CrossentropyCase& c, double grad_scale) {
  Tensors<T> r;
  r["losses"] = filled<T>(c.N, kSentinel);
  r["dlogits"] = cast<T>(c.logits);  // overwritten in place with the gradient
  crossentropy_forward<T>(r["losses"].data(), r["dlogits"].data(), c.targets.data(), c.N, c.V, c.Vp,
                          static_cast<T>(grad_scale));
  return r;
}

// ---- the llama family's kernels -----------------------------------------------------------------

struct RmsnormCase {
  int N = kN, C = kC;
  std::vector<double> inp, w, R;
};

RmsnormCase make_rmsnorm_case(uint64_t seed) {
  Rng rng(seed);
  RmsnormCase c;
  c.inp = normal(rng, static_cast<size_t>(c.N) * c.C, 2.0, 0.7);
  c.w = normal(rng, c.C, 1.0, 1.0);
  c.R = normal(rng, static_cast<size_t>(c.N) * c.C);
  return c;
}

template <typename T>
Tensors<T> run_rmsnorm(const RmsnormCase& c) {
  const size_t NC = static_cast<size_t>(c.N) * c.C;
  auto inp = cast<T>(c.inp), w = cast<T>(c.w), R = cast<T>(c.R);
  Tensors<T> r;
  r["out"] = filled<T>(NC, kSentinel);
  r["rstd"] = filled<T>(c.N, kSentinel);
  r["dinp"] = filled<T>(NC, kSentinel);
  r["dw"] = filled<T>(c.C, 0);
  rmsnorm_forward<T>(r["out"].data(), r["rstd"].data(), inp.data(), w.data(), c.N, c.C);
  rmsnorm_backward_input<T>(r["dinp"].data(), R.data(), inp.data(), r["rstd"].data(), w.data(), c.N, c.C, false);
  rmsnorm_backward_weight<T>(r["dw"].data(), R.data(), inp.data(), r["rstd"].data(), c.N, c.C);
  return r;
}

struct SwigluCase {
  int N = kN, H = 6;
  std::vector<double> inp, R;
};

SwigluCase make_swiglu_case(uint64_t seed) {
  Rng rng(seed);
  SwigluCase c;
  c.inp = normal(rng, static_cast<size_t>(c.N) * 2 * c.H, 2.0);
  c.R = normal(rng, static_cast<size_t>(c.N) * c.H);
  return c;
}

template <typename T>
Tensors<T> run_swiglu(const SwigluCase& c) {
  auto inp = cast<T>(c.inp), R = cast<T>(c.R);
  Tensors<T> r;
  r["out"] = filled<T>(c.R.size(), kSentinel);
  r["dinp"] = filled<T>(inp.size(), kSentinel);
  swiglu_forward<T>(r["out"].data(), inp.data(), c.N, c.H);
  swiglu_backward_input<T>(r["dinp"].data(), R.data(), inp.data(), c.N, c.H);
  return r;
}

// qkv of a grouped-query layout: NH = 4 query heads of size 4, NKV = 2 key/value heads.
struct RopeCase {
  int B = kB, Tn = kT, NH = 4, NKV = 2, hs = 4;
  double theta = 10000.0;
  int pos0 = 3;
  std::vector<double> qkv, R;
  int width() const { return (NH + 2 * NKV) * hs; }
};

RopeCase make_rope_case(uint64_t seed) {
  Rng rng(seed);
  RopeCase c;
  c.qkv = normal(rng, static_cast<size_t>(c.B) * c.Tn * c.width());
  c.R = normal(rng, c.qkv.size());
  return c;
}

// out = rope(qkv); the backward (inverse rotation) applied to R gives d sum(out * R) / d qkv.
template <typename T>
Tensors<T> run_rope(const RopeCase& c) {
  Tensors<T> r;
  r["out"] = cast<T>(c.qkv);
  r["dqkv"] = cast<T>(c.R);
  rope_forward<T>(r["out"].data(), c.B, c.Tn, c.NH, c.NKV, c.hs, c.theta, c.pos0);
  rope_forward<T>(r["dqkv"].data(), c.B, c.Tn, c.NH, c.NKV, c.hs, c.theta, c.pos0, true);
  return r;
}

struct GqaCase {
  int B = kB, Tn = kT, NH = 4, NKV = 2, hs = 3;
  std::vector<double> qkv, R;
  int C() const { return NH * hs; }
};

GqaCase make_gqa_case(uint64_t seed, int NKV) {
  Rng rng(seed);
  GqaCase c;
  c.NKV = NKV;
  c.qkv = normal(rng, static_cast<size_t>(c.B) * c.Tn * (c.C() + 2 * NKV * c.hs));
  c.R = normal(rng, static_cast<size_t>(c.B) * c.Tn * c.C());
  return c;
}

template <typename T>
Tensors<T> run_gqa(const GqaCase& c) {
  auto qkv = cast<T>(c.qkv), R = cast<T>(c.R);
  Tensors<T> r;
  r["out"] = filled<T>(c.R.size(), kSentinel);
  r["att"] = filled<T>(static_cast<size_t>(c.B) * c.NH * c.Tn * c.Tn, kSentinel);
  r["dqkv"] = filled<T>(qkv.size(), kSentinel);
  attention_forward<T>(MatmulPrecision::fp32, r["out"].data(), r["att"].data(), qkv.data(), c.B, c.Tn, c.C(), c.NH,
                       c.NKV);
  attention_backward_input<T>(MatmulPrecision::fp32, r["dqkv"].data(), R.data(), r["att"].data(), qkv.data(), c.B, c.Tn,
                              c.C(), c.NH, c.NKV);
  return r;
}

TEST(OpsGradient, RmsnormMatchesFiniteDifferences) {
  RmsnormCase c = make_rmsnorm_case(211);
  const auto analytic = run_rmsnorm<double>(c);
  auto objective = [&] { return dot(run_rmsnorm<double>(c)["out"], c.R); };
  EXPECT_TRUE(close("dinp", analytic.at("dinp"), finite_difference(c.inp, objective), kFdTol));
  EXPECT_TRUE(close("dw", analytic.at("dw"), finite_difference(c.w, objective), kFdTol));
}

TEST(OpsGradient, SwigluMatchesFiniteDifferences) {
  SwigluCase c = make_swiglu_case(411);
  const auto analytic = run_swiglu<double>(c);
  auto objective = [&] { return dot(run_swiglu<double>(c)["out"], c.R); };
  EXPECT_TRUE(close("dinp", analytic.at("dinp"), finite_difference(c.inp, objective), kFdTol));
}

TEST(OpsGradient, RopeBackwardMatchesFiniteDifferencesAndLeavesValuesAlone) {
  RopeCase c = make_rope_case(611);
  const auto analytic = run_rope<double>(c);
  auto objective = [&] { return dot(run_rope<double>(c)["out"], c.R); };
  EXPECT_TRUE(close("dqkv", analytic.at("dqkv"), finite_difference(c.qkv, objective), kFdTol));
  // v (the last NKV heads of each row) is not rotated; a rotation keeps each pair's length.
  const int w = c.width(), v0 = (c.NH + c.NKV) * c.hs;
  for (int n = 0; n < c.B * c.Tn; ++n) {
    for (int j = v0; j < w; ++j) EXPECT_EQ(analytic.at("out")[n * w + j], c.qkv[n * w + j]);
    for (int j = 0; j < v0; j += 2) {
      const double a = std::hypot(c.qkv[n * w + j], c.qkv[n * w + j + 1]);
      const double b = std::hypot(analytic.at("out")[n * w + j], analytic.at("out")[n * w + j + 1]);
      EXPECT_NEAR(a, b, 1e-12);
    }
  }
  // Position 0 of a sequence starting at 0 is not rotated at all.
  RopeCase at0 = make_rope_case(612);
  at0.pos0 = 0;
  const auto r0 = run_rope<double>(at0);
  for (int j = 0; j < at0.width(); ++j) EXPECT_EQ(r0.at("out")[j], at0.qkv[j]);
}

// RoPE's linear scaling multiplies positions: four tokens from position 4 at scale 1/4 sit at
// 1, 1.25, 1.5, 1.75, so the first is rotated exactly as a token at position 1 unscaled.
TEST(Ops, RopePositionScaleMultipliesPositions) {
  const int NH = 2, NKV = 1, hs = 8, width = (NH + 2 * NKV) * hs;
  std::vector<double> a(4 * width), b(width);
  Rng rng(5);
  for (double& x : a) x = rng.normal();
  std::copy(a.begin(), a.begin() + width, b.begin());
  ops::rope_forward(a.data(), 1, 4, NH, NKV, hs, 10000.0, 4, false, 0.25);
  ops::rope_forward(b.data(), 1, 1, NH, NKV, hs, 10000.0, 1, false, 1.0);
  for (int j = 0; j < width; ++j) EXPECT_NEAR(a[j], b[j], 1e-12) << j;
}

// Rows at positions of their own (a packed pass of several sequences) in one call: each row as
// a call for that row alone at its position, bit for bit, in any order of positions; the
// frequencies given explicitly as theta's are the theta call's.
TEST(Ops, RopePositionsArrayRotatesEachRowAtItsPosition) {
  const int NH = 4, NKV = 2, hs = 8, width = (NH + 2 * NKV) * hs, rows = 6;
  const std::vector<int> positions = {7, 0, 3, 63, 3, 12};
  std::vector<float> packed(rows * width);
  Rng rng(9);
  for (float& x : packed) x = static_cast<float>(rng.normal());
  std::vector<float> alone = packed;
  std::vector<double> freq(hs / 2);
  for (int i = 0; i < hs / 2; ++i) freq[i] = std::pow(50000.0, -2.0 * i / hs);
  ops::rope_forward(packed.data(), 1, rows, NH, NKV, hs, freq, 0, positions.data(), false, 0.5);
  for (int r = 0; r < rows; ++r) {
    ops::rope_forward(alone.data() + r * width, 1, 1, NH, NKV, hs, 50000.0, positions[r], false, 0.5);
  }
  EXPECT_EQ(0, std::memcmp(packed.data(), alone.data(), packed.size() * sizeof(float)));
  // The inverse rotation with the same positions gives the input back (to rounding).
  std::vector<float> back = packed;
  ops::rope_forward(back.data(), 2, rows / 2, NH, NKV, hs, freq, 0, positions.data(), true, 0.5);
  Rng again(9);
  for (float x : back) EXPECT_NEAR(x, static_cast<float>(again.normal()), 1e-5);
}

TEST(OpsGradient, GroupedQueryAttentionMatchesFiniteDifferences) {
  for (int nkv : {1, 2, 4}) {
    SCOPED_TRACE("n_kv_head " + std::to_string(nkv));
    GqaCase c = make_gqa_case(621 + nkv, nkv);
    const auto analytic = run_gqa<double>(c);
    auto objective = [&] { return dot(run_gqa<double>(c)["out"], c.R); };
    EXPECT_TRUE(close("dqkv", analytic.at("dqkv"), finite_difference(c.qkv, objective), kFdTol));
  }
}

// The dynamic window's signal is the dense kernel's probabilities binned by distance: the last
// rows of each sequence, every query head (grouped-query too), power-of-two buckets.
TEST(OpsForward, AttentionDistanceMassBinsTheDenseProbabilities) {
  const int B = 2, Tn = 40, NH = 4, NKV = 2, hs = 4, C = NH * hs, rows = 7, K = 8;
  Rng rng(17);
  const std::vector<double> qkv = normal(rng, static_cast<size_t>(B) * Tn * (C + 2 * NKV * hs), 2.0);
  std::vector<double> out(static_cast<size_t>(B) * Tn * C), att(static_cast<size_t>(B) * NH * Tn * Tn);
  ops::attention_forward(MatmulPrecision::fp32, out.data(), att.data(), qkv.data(), B, Tn, C, NH, NKV);
  std::vector<double> want(NH * K, 0.0), got(NH * K, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i = Tn - rows; i < Tn; ++i)
        for (int j = 0; j <= i; ++j) {
          const int d = i - j;
          int bucket = 0;
          while ((1 << bucket) <= d) ++bucket;  // 0 -> 0, 1 -> 1, 2..3 -> 2, 4..7 -> 3, ...
          want[h * K + std::min(bucket, K - 1)] += att[((static_cast<size_t>(b) * NH + h) * Tn + i) * Tn + j];
        }
  ops::attention_distance_mass(got.data(), K, qkv.data(), B, Tn, C, NH, NKV, rows);
  for (int k = 0; k < NH * K; ++k) EXPECT_NEAR(got[k], want[k], 1e-12) << k;
  double total = 0;
  for (double x : got) total += x;
  EXPECT_NEAR(total, B * NH * rows, 1e-9);  // every probed row's mass, once
}

// Grouped-query attention is multi-head attention with each key/value head repeated for its
// query heads: the same output as the MHA kernel on the expanded qkv.
TEST(OpsForward, GroupedQueryAttentionEqualsMultiHeadOnRepeatedKeysAndValues) {
  const GqaCase c = make_gqa_case(631, 2);
  const int C = c.C(), hs = c.hs, group = c.NH / c.NKV, w = C + 2 * c.NKV * hs;
  std::vector<double> expanded(static_cast<size_t>(c.B) * c.Tn * 3 * C);
  for (int n = 0; n < c.B * c.Tn; ++n) {
    for (int j = 0; j < C; ++j) expanded[n * 3 * C + j] = c.qkv[n * w + j];
    for (int h = 0; h < c.NH; ++h) {
      for (int d = 0; d < hs; ++d) {
        expanded[n * 3 * C + C + h * hs + d] = c.qkv[n * w + C + (h / group) * hs + d];
        expanded[n * 3 * C + 2 * C + h * hs + d] = c.qkv[n * w + C + c.NKV * hs + (h / group) * hs + d];
      }
    }
  }
  std::vector<double> mha(c.R.size()), att(static_cast<size_t>(c.B) * c.NH * c.Tn * c.Tn);
  attention_forward<double>(MatmulPrecision::fp32, mha.data(), att.data(), expanded.data(), c.B, c.Tn, C, c.NH);
  EXPECT_TRUE(close("out", run_gqa<double>(c).at("out"), mha, 1e-14));
}

TEST(OpsForward, EmbeddingWithoutPositionsGathersRows) {
  const EncoderCase c = make_encoder_case(641);
  std::vector<double> out(static_cast<size_t>(c.B) * c.Tn * c.C, kSentinel), dwte(c.wte.size(), 0.0);
  encoder_forward<double>(out.data(), c.tokens.data(), c.wte.data(), nullptr, c.B, c.Tn, c.C);
  encoder_backward_weight<double>(dwte.data(), nullptr, c.R.data(), c.tokens.data(), c.B, c.Tn, c.C);
  for (int n = 0; n < c.B * c.Tn; ++n) {
    for (int j = 0; j < c.C; ++j) EXPECT_EQ(out[n * c.C + j], c.wte[c.tokens[n] * c.C + j]);
  }
  const auto with = run_encoder<double>(c);  // the token rows' gradient is the same with positions
  EXPECT_TRUE(close("dwte", dwte, with.at("dwte"), 1e-15));
}

// ---- blockwise attention -------------------------------------------------------------------------

struct FlashCase {
  int B = 1, Tn = 0, NH = 2, NKV = 1, hs = 4, window = 0;
  std::vector<double> qkv, R;
  int C() const { return NH * hs; }
};

FlashCase make_flash_case(uint64_t seed, int Tn, int NH, int NKV, int hs, int window, int B = 1) {
  Rng rng(seed);
  FlashCase c;
  c.B = B, c.Tn = Tn, c.NH = NH, c.NKV = NKV, c.hs = hs, c.window = window;
  c.qkv = normal(rng, static_cast<size_t>(B) * Tn * (c.C() + 2 * NKV * hs), 1.5);
  c.R = normal(rng, static_cast<size_t>(B) * Tn * c.C());
  return c;
}

template <typename T>
Tensors<T> run_flash(const FlashCase& c, MatmulPrecision precision = MatmulPrecision::fp32) {
  auto qkv = cast<T>(c.qkv), R = cast<T>(c.R);
  Tensors<T> r;
  r["out"] = filled<T>(c.R.size(), kSentinel);
  r["lse"] = filled<T>(static_cast<size_t>(c.B) * c.NH * c.Tn, kSentinel);
  r["dqkv"] = filled<T>(qkv.size(), kSentinel);
  flash_attention_forward<T>(precision, r["out"].data(), r["lse"].data(), qkv.data(), c.B, c.Tn, c.C(), c.NH, c.NKV,
                             c.window);
  flash_attention_backward_input<T>(precision, r["dqkv"].data(), R.data(), r["out"].data(), r["lse"].data(),
                                    qkv.data(), c.B, c.Tn, c.C(), c.NH, c.NKV, c.window);
  return r;
}

// The dense kernel on the same case, with a sliding window applied as a mask: qkv's keys outside
// the window get a score of -inf through a huge negative bias is not available, so the check
// computes the masked dense reference directly (softmax over the allowed keys only).
std::vector<double> masked_dense_attention(const FlashCase& c) {
  const int C = c.C(), kvd = c.NKV * c.hs, C3 = C + 2 * kvd, group = c.NH / c.NKV;
  std::vector<double> out(c.R.size(), 0.0);
  for (int b = 0; b < c.B; ++b) {
    for (int h = 0; h < c.NH; ++h) {
      const int g = h / group;
      for (int i = 0; i < c.Tn; ++i) {
        const int lo = c.window > 0 ? std::max(0, i - c.window + 1) : 0;
        std::vector<double> s(i + 1, -1e300);
        double mx = -1e300;
        for (int j = lo; j <= i; ++j) {
          double dotp = 0;
          for (int d = 0; d < c.hs; ++d) {
            dotp += c.qkv[(b * c.Tn + i) * C3 + h * c.hs + d] * c.qkv[(b * c.Tn + j) * C3 + C + g * c.hs + d];
          }
          s[j] = dotp / std::sqrt(static_cast<double>(c.hs));
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int j = lo; j <= i; ++j) sum += std::exp(s[j] - mx);
        for (int j = lo; j <= i; ++j) {
          const double p = std::exp(s[j] - mx) / sum;
          for (int d = 0; d < c.hs; ++d) {
            out[(b * c.Tn + i) * C + h * c.hs + d] += p * c.qkv[(b * c.Tn + j) * C3 + C + kvd + g * c.hs + d];
          }
        }
      }
    }
  }
  return out;
}

// Equal to the dense kernel (no window) and to a masked dense reference (windows), over lengths
// that are and are not multiples of the 64-row tile, head sizes, grouped-query layouts.
TEST(OpsForward, BlockwiseAttentionEqualsDense) {
  struct Shape { int T, NH, NKV, hs, window; };
  for (const Shape s : {Shape{1, 2, 2, 4, 0}, Shape{63, 2, 1, 8, 0}, Shape{64, 4, 2, 4, 0}, Shape{130, 2, 2, 16, 0},
                        Shape{200, 4, 1, 8, 0}, Shape{150, 2, 2, 4, 17}, Shape{200, 4, 2, 8, 64}, Shape{97, 2, 1, 4, 1}}) {
    SCOPED_TRACE("T " + std::to_string(s.T) + " heads " + std::to_string(s.NH) + "/" + std::to_string(s.NKV) + " hs " +
                 std::to_string(s.hs) + " window " + std::to_string(s.window));
    const FlashCase c = make_flash_case(700 + s.T, s.T, s.NH, s.NKV, s.hs, s.window, 2);
    const auto flash = run_flash<double>(c);
    EXPECT_TRUE(close("out vs masked dense", flash.at("out"), masked_dense_attention(c), 1e-12));
    if (s.window == 0) {
      std::vector<double> dense(c.R.size()), att(static_cast<size_t>(c.B) * c.NH * c.Tn * c.Tn);
      attention_forward<double>(MatmulPrecision::fp32, dense.data(), att.data(), c.qkv.data(), c.B, c.Tn, c.C(), c.NH,
                                c.NKV);
      EXPECT_TRUE(close("out vs dense", flash.at("out"), dense, 1e-12));
      std::vector<double> ddense(c.qkv.size());
      attention_backward_input<double>(MatmulPrecision::fp32, ddense.data(), c.R.data(), att.data(), c.qkv.data(), c.B,
                                       c.Tn, c.C(), c.NH, c.NKV);
      EXPECT_TRUE(close("dqkv vs dense", flash.at("dqkv"), ddense, 1e-11));
    }
    const auto f = run_flash<float>(c);
    EXPECT_TRUE(close("float out", f.at("out"), flash.at("out"), 2e-5));
    EXPECT_TRUE(close("float dqkv", f.at("dqkv"), flash.at("dqkv"), 2e-4));
  }
}

TEST(OpsGradient, BlockwiseAttentionMatchesFiniteDifferences) {
  for (const int window : {0, 5}) {
    SCOPED_TRACE("window " + std::to_string(window));
    FlashCase c = make_flash_case(751 + window, 70, 2, 1, 4, window);  // two tiles, grouped-query
    const auto analytic = run_flash<double>(c);
    auto objective = [&] { return dot(run_flash<double>(c)["out"], c.R); };
    EXPECT_TRUE(close("dqkv", analytic.at("dqkv"), finite_difference(c.qkv, objective), kFdTol));
  }
}

// Head sizes of real models (multiples of 16: kernels/cpu/attention.h's vector path where the CPU
// has AVX-512), lengths off the 64-row tile, windows, grouped heads: float against the double
// kernel, which the test above holds to dense attention.
TEST(OpsForward, BlockwiseAttentionAtModelHeadSizesEqualsDouble) {
  struct Shape { int T, NH, NKV, hs, window; };
  for (const Shape s : {Shape{1, 2, 2, 32, 0}, Shape{100, 4, 2, 32, 0}, Shape{193, 2, 1, 64, 0}, Shape{130, 2, 2, 48, 0},
                        Shape{200, 4, 4, 32, 70}, Shape{256, 2, 1, 128, 64}, Shape{77, 2, 2, 16, 1}}) {
    SCOPED_TRACE("T " + std::to_string(s.T) + " heads " + std::to_string(s.NH) + "/" + std::to_string(s.NKV) + " hs " +
                 std::to_string(s.hs) + " window " + std::to_string(s.window));
    const FlashCase c = make_flash_case(800 + s.T, s.T, s.NH, s.NKV, s.hs, s.window, 2);
    const auto want = run_flash<double>(c);
    const auto f = run_flash<float>(c);
    EXPECT_TRUE(close("out", f.at("out"), want.at("out"), 2e-5));
    EXPECT_TRUE(close("lse", f.at("lse"), want.at("lse"), 2e-6));
    EXPECT_TRUE(close("dqkv", f.at("dqkv"), want.at("dqkv"), 2e-4));
  }
}

// Blockwise attention's definition under bf16 products (kernels/cpu/attention.h), in double: q, k
// and v rounded to bf16, the scores' sums exact; each key tile's probabilities exp(s - m_t), m_t the
// row's running maximum after tile t, rounded to bf16 where they multiply v; the row sums and the
// rescaling unrounded. `slack` per output element gathers the terms whose rounding a float32
// perturbation could flip (a probability within 1e-5 relative of a bf16 rounding boundary): either
// rounding is the definition's, to float32 precision.
struct Bf16Definition {
  std::vector<double> out, lse, slack;
};
Bf16Definition blockwise_bf16_definition(const FlashCase& c) {
  const int C = c.C(), kvd = c.NKV * c.hs, C3 = C + 2 * kvd, group = c.NH / c.NKV, tile = 64;
  auto r = [](double x) { return static_cast<double>(round_to_bf16(static_cast<float>(x))); };
  Bf16Definition d{std::vector<double>(c.R.size(), 0.0), std::vector<double>(static_cast<size_t>(c.B) * c.NH * c.Tn),
                   std::vector<double>(c.R.size(), 0.0)};
  const double inf = std::numeric_limits<double>::infinity();
  for (int b = 0; b < c.B; ++b) {
    for (int h = 0; h < c.NH; ++h) {
      const int g = h / group;
      for (int i = 0; i < c.Tn; ++i) {
        const int lo = c.window > 0 ? std::max(0, i - c.window + 1) : 0;
        const double* q = &c.qkv[(b * c.Tn + i) * C3 + h * c.hs];
        double m = -inf, l = 0;
        std::vector<double> acc(c.hs, 0.0), slack(c.hs, 0.0);
        for (int t = lo / tile; t <= i / tile; ++t) {
          const int j0 = std::max(lo, t * tile), j1 = std::min(i, t * tile + tile - 1);
          std::vector<double> s(j1 - j0 + 1);
          double m_t = m;
          for (int j = j0; j <= j1; ++j) {
            const double* k = &c.qkv[(b * c.Tn + j) * C3 + C + g * c.hs];
            double dot = 0;
            for (int e = 0; e < c.hs; ++e) dot += r(q[e]) * r(k[e]);
            s[j - j0] = dot / std::sqrt(static_cast<double>(c.hs));
            m_t = std::max(m_t, s[j - j0]);
          }
          const double correction = m == -inf ? 0.0 : std::exp(m - m_t);
          l *= correction;
          for (int e = 0; e < c.hs; ++e) acc[e] *= correction, slack[e] *= correction;
          for (int j = j0; j <= j1; ++j) {
            const double p = std::exp(s[j - j0] - m_t);
            const float pf = static_cast<float>(p);
            const bool ambiguous = round_to_bf16(pf * (1 + 1e-5f)) != round_to_bf16(pf * (1 - 1e-5f));
            l += p;
            const double* v = &c.qkv[(b * c.Tn + j) * C3 + C + kvd + g * c.hs];
            for (int e = 0; e < c.hs; ++e) {
              acc[e] += r(p) * r(v[e]);
              if (ambiguous) slack[e] += p / 128 * std::abs(r(v[e]));  // one bf16 step of p
            }
          }
          m = m_t;
        }
        for (int e = 0; e < c.hs; ++e) {
          d.out[(b * c.Tn + i) * C + h * c.hs + e] = acc[e] / l;
          d.slack[(b * c.Tn + i) * C + h * c.hs + e] = slack[e] / l;
        }
        d.lse[(static_cast<size_t>(b) * c.NH + h) * c.Tn + i] = m + std::log(l);
      }
    }
  }
  return d;
}

// Under bf16 products the forward equals its definition on bf16-rounded operands within float32
// summation-order tolerance; the backward (bf16 products of its own) stays within bf16's
// precision of the float64 gradient.
TEST(OpsForward, BlockwiseAttentionInBf16EqualsItsDefinition) {
  struct Shape { int T, NH, NKV, hs, window; };
  for (const Shape s : {Shape{150, 4, 2, 32, 0}, Shape{200, 2, 2, 64, 0}, Shape{130, 4, 1, 32, 50}, Shape{64, 2, 2, 16, 0}}) {
    SCOPED_TRACE("T " + std::to_string(s.T) + " heads " + std::to_string(s.NH) + "/" + std::to_string(s.NKV) + " hs " +
                 std::to_string(s.hs) + " window " + std::to_string(s.window));
    const FlashCase c = make_flash_case(900 + s.T, s.T, s.NH, s.NKV, s.hs, s.window, 2);
    const Bf16Definition want = blockwise_bf16_definition(c);
    const auto got = run_flash<float>(c, MatmulPrecision::bf16);
    double scale = 0;
    for (const double x : want.out) scale = std::max(scale, std::abs(x));
    size_t outside = 0, slack_used = 0, worst = 0;
    double worst_excess = -1;
    for (size_t i = 0; i < want.out.size(); ++i) {
      const double err = std::abs(got.at("out")[i] - want.out[i]), allowed = 2e-5 * scale + 1.01 * want.slack[i];
      if (err > 2e-5 * scale) ++slack_used;
      if (err > allowed) ++outside;
      if (err - allowed > worst_excess) worst_excess = err - allowed, worst = i;
    }
    EXPECT_EQ(outside, 0u) << "worst at [" << worst << "]: got " << got.at("out")[worst] << ", defined "
                           << want.out[worst] << " (slack " << want.slack[worst] << ")";
    EXPECT_LE(slack_used, want.out.size() / 100) << "elements off by more than float32 tolerance";
    EXPECT_TRUE(close("lse", got.at("lse"), want.lse, 2e-6));
    const auto exact = run_flash<double>(c);
    EXPECT_TRUE(close("dqkv (bf16 vs float64)", got.at("dqkv"), exact.at("dqkv"), 3e-2));
    EXPECT_FALSE(close("dqkv (bf16 vs float64)", got.at("dqkv"), exact.at("dqkv"), 1e-5)) << "no bf16 rounding seen";
  }
}

TEST(OpsDeterminism, BlockwiseAttentionIsBitIdenticalAcrossThreadCounts) {
  for (const int hs : {8, 32}) {
    for (const MatmulPrecision precision : {MatmulPrecision::fp32, MatmulPrecision::bf16}) {
      SCOPED_TRACE("hs " + std::to_string(hs) + (precision == MatmulPrecision::bf16 ? " bf16" : " fp32"));
      const FlashCase c = make_flash_case(761, 150, 4, 2, hs, 0, 2);
      Tensors<float> one, two, three;
      {
        Threads t(1);
        one = run_flash<float>(c, precision);
      }
      {
        Threads t(2);
        two = run_flash<float>(c, precision);
      }
      {
        Threads t(3);
        three = run_flash<float>(c, precision);
      }
      for (const auto& [name, v] : one) {
        EXPECT_TRUE(bit_identical(name, v, two.at(name)));
        EXPECT_TRUE(bit_identical(name, v, three.at(name)));
      }
    }
  }
}

// ---- gradients against finite differences (double) ---------------------------------------------

TEST(OpsGradient, EncoderWeightsMatchFiniteDifferences) {
  EncoderCase c = make_encoder_case(101);
  const auto analytic = run_encoder<double>(c);
  auto objective = [&] { return dot(run_encoder<double>(c)["out"], c.R); };
  EXPECT_TRUE(close("dwte", analytic.at("dwte"), finite_difference(c.wte, objective), kFdTol));
  EXPECT_TRUE(close("dwpe", analytic.at("dwpe"), finite_difference(c.wpe, objective), kFdTol));
}

TEST(OpsGradient, EncoderScattersRepeatedTokensAndLeavesUnusedRowsZero) {
  const EncoderCase c = make_encoder_case(102);
  const auto r = run_encoder<double>(c);
  for (int v = 0; v < c.Vp; ++v) {
    for (int ch = 0; ch < c.C; ++ch) {
      double want = 0;
      for (int n = 0; n < c.B * c.Tn; ++n) {
        if (c.tokens[n] == v) want += c.R[static_cast<size_t>(n) * c.C + ch];
      }
      EXPECT_NEAR(r.at("dwte")[static_cast<size_t>(v) * c.C + ch], want, 1e-12) << "token " << v << " channel " << ch;
    }
  }
}

TEST(OpsGradient, LayernormMatchesFiniteDifferences) {
  LayernormCase c = make_layernorm_case(201);
  const auto analytic = run_layernorm<double>(c);
  auto objective = [&] { return dot(run_layernorm<double>(c)["out"], c.R); };
  EXPECT_TRUE(close("dinp", analytic.at("dinp"), finite_difference(c.inp, objective), kFdTol));
  EXPECT_TRUE(close("dw", analytic.at("dw"), finite_difference(c.w, objective), kFdTol));
  EXPECT_TRUE(close("db", analytic.at("db"), finite_difference(c.b, objective), kFdTol));
}

TEST(OpsGradient, LinearWithBiasMatchesFiniteDifferences) {
  LinearCase c = make_linear_case(301, /*has_bias=*/true);
  const auto analytic = run_linear<double>(c);
  auto objective = [&] { return dot(run_linear<double>(c)["out"], c.R); };
  EXPECT_TRUE(close("dinp", analytic.at("dinp"), finite_difference(c.inp, objective), kFdTol));
  EXPECT_TRUE(close("dw", analytic.at("dw"), finite_difference(c.w, objective), kFdTol));
  EXPECT_TRUE(close("dbias", analytic.at("dbias"), finite_difference(c.bias, objective), kFdTol));
}

TEST(OpsGradient, LinearWithoutBiasMatchesFiniteDifferences) {
  LinearCase c = make_linear_case(302, /*has_bias=*/false);
  const auto analytic = run_linear<double>(c);
  auto objective = [&] { return dot(run_linear<double>(c)["out"], c.R); };
  EXPECT_TRUE(close("dinp", analytic.at("dinp"), finite_difference(c.inp, objective), kFdTol));
  EXPECT_TRUE(close("dw", analytic.at("dw"), finite_difference(c.w, objective), kFdTol));
}

TEST(OpsGradient, GeluMatchesFiniteDifferences) {
  GeluCase c = make_gelu_case(401);
  const auto analytic = run_gelu<double>(c);
  auto objective = [&] { return dot(run_gelu<double>(c)["out"], c.R); };
  EXPECT_TRUE(close("dinp", analytic.at("dinp"), finite_difference(c.inp, objective), kFdTol));
}

// The residual add has no backward kernel: its gradient w.r.t. either input is dout itself.
TEST(OpsGradient, ResidualMatchesFiniteDifferences) {
  ResidualCase c = make_residual_case(501);
  auto objective = [&] { return dot(run_residual<double>(c)["out"], c.R); };
  EXPECT_TRUE(close("da", c.R, finite_difference(c.a, objective), kFdTol));
  EXPECT_TRUE(close("db", c.R, finite_difference(c.b, objective), kFdTol));
}

TEST(OpsGradient, AttentionMatchesFiniteDifferences) {
  AttentionCase c = make_attention_case(601);
  const auto analytic = run_attention<double>(c);
  auto objective = [&] { return dot(run_attention<double>(c)["out"], c.R); };
  EXPECT_TRUE(close("dqkv", analytic.at("dqkv"), finite_difference(c.qkv, objective), kFdTol));
}

TEST(OpsGradient, CrossentropyGradientMatchesFiniteDifferences) {
  CrossentropyCase c = make_crossentropy_case(701);
  const auto analytic = run_crossentropy<double>(c, c.grad_scale);
  auto objective = [&] {
    const auto losses = run_crossentropy<double>(c, 0.0)["losses"];
    double sum = 0;
    for (double l : losses) sum += l;
    return c.grad_scale * sum;
  };
  const std::vector<double> fd = finite_difference(c.logits, objective);
  EXPECT_TRUE(close("dlogits", analytic.at("dlogits"), fd, kFdTol));
  for (int n = 0; n < c.N; ++n) {
    for (int j = c.V; j < c.Vp; ++j) {
      const size_t i = static_cast<size_t>(n) * c.Vp + j;
      EXPECT_EQ(analytic.at("dlogits")[i], 0.0) << "padded column " << j << " of row " << n;
      EXPECT_EQ(fd[i], 0.0) << "loss depends on padded column " << j << " of row " << n;
    }
  }
}

// ---- forward results against direct definitions -----------------------------------------------

TEST(OpsForward, CrossentropyLossEqualsNaiveLogSoftmax) {
  const CrossentropyCase c = make_crossentropy_case(702);
  for (double grad_scale : {0.0, c.grad_scale}) {
    const auto losses = run_crossentropy<double>(c, grad_scale).at("losses");
    for (int n = 0; n < c.N; ++n) {
      const double* row = c.logits.data() + static_cast<size_t>(n) * c.Vp;
      double sum = 0;
      for (int j = 0; j < c.V; ++j) sum += std::exp(row[j]);
      const double want = -std::log(std::exp(row[c.targets[n]]) / sum);
      EXPECT_NEAR(losses[n], want, 1e-12 * std::max(1.0, std::abs(want)))
          << "row " << n << " grad_scale " << grad_scale;
    }
  }
}

// Shifting a row's logits leaves the softmax unchanged; a kernel without the max subtraction
// overflows at +1000.
// The loss with its gradient left as bf16 bits for bf16 products (in the upper half of each float
// row): the same losses, bit for bit, and the bits of crossentropy_forward's float gradient
// rounded, the padded columns zero; wide rows (a vocabulary past one 16-column chunk, not a
// multiple of 16) on two threads.
TEST(OpsForward, CrossentropyBf16GradientIsTheRoundedFloatGradient) {
  Threads threads(2);
  for (const int V : {37, 1000}) {
    const int N = 9, Vp = V + 27;
    Rng rng(1800 + V);
    std::vector<float> logits(static_cast<size_t>(N) * Vp);
    for (float& x : logits) x = static_cast<float>(rng.normal() * 3);
    std::vector<int> targets;
    for (int n = 0; n < N; ++n) targets.push_back(static_cast<int>(rng.below(V)));
    targets[0] = 0, targets[1] = V - 1;
    std::vector<float> want = logits, got = logits, want_losses(N), got_losses(N);
    crossentropy_forward(want_losses.data(), want.data(), targets.data(), N, V, Vp, 0.37f);
    crossentropy_forward_bf16_gradient(got_losses.data(), got.data(), targets.data(), N, V, Vp, 0.37f);
    EXPECT_TRUE(bit_identical("losses", got_losses, want_losses));
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(got.data());
    size_t wrong = 0;
    for (int n = 0; n < N; ++n) {
      for (int j = 0; j < Vp; ++j) {
        const uint16_t expected = j < V ? to_bf16(want[static_cast<size_t>(n) * Vp + j]) : uint16_t{0};
        wrong += bits[static_cast<size_t>(n) * 2 * Vp + Vp + j] != expected;
      }
    }
    EXPECT_EQ(wrong, 0u) << "V " << V;
  }
}

// The activations' one-pass rounding for bf16 stashes: the bits of the float activation (and of
// its input) that gelu_forward / swiglu_forward compute, bit for bit.
TEST(OpsForward, RoundedActivationsAreTheFloatActivationsRounded) {
  Threads threads(2);
  Rng rng(1900);
  const int N = 7, H = 45;
  std::vector<float> x(static_cast<size_t>(N) * 2 * H);
  for (float& v : x) v = static_cast<float>(rng.normal() * 2);
  auto rounded = [](const std::vector<float>& f) {
    std::vector<uint16_t> b(f.size());
    for (size_t i = 0; i < f.size(); ++i) b[i] = to_bf16(f[i]);
    return b;
  };
  std::vector<float> gelu(x.size()), swiglu(static_cast<size_t>(N) * H);
  gelu_forward(gelu.data(), x.data(), static_cast<int64_t>(x.size()));
  swiglu_forward(swiglu.data(), x.data(), N, H);
  std::vector<uint16_t> in(x.size()), out(x.size());
  gelu_forward_rounded(in.data(), out.data(), x.data(), static_cast<int64_t>(x.size()));
  EXPECT_TRUE(in == rounded(x));
  EXPECT_TRUE(out == rounded(gelu));
  std::vector<uint16_t> in2(x.size()), out2(swiglu.size());
  swiglu_forward_rounded(in2.data(), out2.data(), x.data(), N, H);
  EXPECT_TRUE(in2 == rounded(x));
  EXPECT_TRUE(out2 == rounded(swiglu));
  // The backward's gradients rounded into a stash: the float gradients' bits (input in float32
  // and in bf16).
  std::vector<float> dout(x.size());
  for (float& v : dout) v = static_cast<float>(rng.normal());
  for (const bool bits_in : {false, true}) {
    const Operand inp = bits_in ? Operand::bits(in.data()) : Operand(x.data());
    std::vector<float> dgelu(x.size()), dswiglu(x.size());
    gelu_backward_input(dgelu.data(), dout.data(), inp, static_cast<int64_t>(x.size()));
    swiglu_backward_input(dswiglu.data(), dout.data(), inp, N, H);
    std::vector<uint16_t> g(x.size()), sw(x.size());
    gelu_backward_rounded(g.data(), dout.data(), inp, static_cast<int64_t>(x.size()));
    swiglu_backward_rounded(sw.data(), dout.data(), inp, N, H);
    EXPECT_TRUE(g == rounded(dgelu)) << (bits_in ? "bf16 input" : "float input");
    EXPECT_TRUE(sw == rounded(dswiglu)) << (bits_in ? "bf16 input" : "float input");
  }
}

TEST(OpsForward, CrossentropyIsShiftInvariant) {
  CrossentropyCase c = make_crossentropy_case(703);
  const auto base = run_crossentropy<double>(c, c.grad_scale);
  for (int n = 0; n < c.N; ++n) {
    for (int j = 0; j < c.V; ++j) c.logits[static_cast<size_t>(n) * c.Vp + j] += 1000.0;
  }
  const auto shifted = run_crossentropy<double>(c, c.grad_scale);
  EXPECT_TRUE(close("losses", shifted.at("losses"), base.at("losses"), 1e-10));
  EXPECT_TRUE(close("dlogits", shifted.at("dlogits"), base.at("dlogits"), 1e-10));
  const auto shifted_float = run_crossentropy<float>(c, c.grad_scale);
  EXPECT_TRUE(close("float losses", shifted_float.at("losses"), base.at("losses"), 1e-3));
}

TEST(OpsForward, ResidualLayernormEqualsResidualThenLayernorm) {
  Rng rng(801);
  const auto a = normal(rng, static_cast<size_t>(kN) * kC, 1.5, 0.3);
  const auto b_in = normal(rng, a.size());
  const auto w = normal(rng, kC, 1.0, 1.0);
  const auto b = normal(rng, kC);
  auto check = [&]<typename T>(T) {
    const auto ta = cast<T>(a), tb_in = cast<T>(b_in), tw = cast<T>(w), tb = cast<T>(b);
    auto res = filled<T>(a.size(), kSentinel), out = res;
    auto mean = filled<T>(kN, kSentinel), rstd = mean;
    residual_layernorm_forward<T>(res.data(), out.data(), mean.data(), rstd.data(), ta.data(), tb_in.data(), tw.data(),
                                  tb.data(), kN, kC);
    auto res2 = filled<T>(a.size(), kSentinel), out2 = res2;
    auto mean2 = filled<T>(kN, kSentinel), rstd2 = mean2;
    residual_forward<T>(res2.data(), ta.data(), tb_in.data(), static_cast<int64_t>(a.size()));
    layernorm_forward<T>(out2.data(), mean2.data(), rstd2.data(), res2.data(), tw.data(), tb.data(), kN, kC);
    EXPECT_TRUE(bit_identical("res", res, res2));
    EXPECT_TRUE(bit_identical("out", out, out2));
    EXPECT_TRUE(bit_identical("mean", mean, mean2));
    EXPECT_TRUE(bit_identical("rstd", rstd, rstd2));
  };
  check(0.0);
  check(0.0f);
}

TEST(OpsForward, LayernormOutputIsNormalised) {
  LayernormCase c = make_layernorm_case(802);
  std::fill(c.w.begin(), c.w.end(), 1.0);
  std::fill(c.b.begin(), c.b.end(), 0.0);
  const auto r = run_layernorm<double>(c);
  for (int n = 0; n < c.N; ++n) {
    double m = 0, var = 0;
    for (int ch = 0; ch < c.C; ++ch) m += c.inp[static_cast<size_t>(n) * c.C + ch];
    m /= c.C;
    for (int ch = 0; ch < c.C; ++ch) var += std::pow(c.inp[static_cast<size_t>(n) * c.C + ch] - m, 2);
    var /= c.C;
    EXPECT_NEAR(r.at("mean")[n], m, 1e-12);
    EXPECT_NEAR(r.at("rstd")[n], 1.0 / std::sqrt(var + 1e-5), 1e-12);
    for (int ch = 0; ch < c.C; ++ch) {
      const size_t i = static_cast<size_t>(n) * c.C + ch;
      EXPECT_NEAR(r.at("out")[i], (c.inp[i] - m) / std::sqrt(var + 1e-5), 1e-12);
    }
  }
}

TEST(OpsForward, LinearWithoutBiasEqualsZeroBias) {
  const LinearCase with = make_linear_case(803, /*has_bias=*/true);
  LinearCase without = with;
  without.has_bias = false;
  without.bias.clear();
  LinearCase zero = with;
  std::fill(zero.bias.begin(), zero.bias.end(), 0.0);
  EXPECT_TRUE(close("out", run_linear<double>(without).at("out"), run_linear<double>(zero).at("out"), 1e-14));
}

TEST(OpsForward, AttentionRowsAreCausalProbabilities) {
  const AttentionCase c = make_attention_case(901);
  const auto att = run_attention<double>(c).at("att");
  for (int bh = 0; bh < c.B * c.NH; ++bh) {
    for (int i = 0; i < c.Tn; ++i) {
      const double* row = att.data() + (static_cast<size_t>(bh) * c.Tn + i) * c.Tn;
      double sum = 0;
      for (int j = 0; j <= i; ++j) {
        EXPECT_GT(row[j], 0.0) << "bh " << bh << " row " << i << " col " << j;
        sum += row[j];
      }
      EXPECT_NEAR(sum, 1.0, 1e-12) << "bh " << bh << " row " << i;
      for (int j = i + 1; j < c.Tn; ++j) EXPECT_EQ(row[j], 0.0) << "bh " << bh << " row " << i << " col " << j;
    }
  }
}

// Changing q, k or v at positions > t leaves out[t] bit-identical, and the gradient of out[t]
// alone is zero at every position > t.
TEST(OpsForward, AttentionIsCausal) {
  const AttentionCase base = make_attention_case(902);
  const int C3 = 3 * base.C;
  const auto out = run_attention<double>(base).at("out");
  for (int s = 1; s < base.Tn; ++s) {
    AttentionCase changed = base;
    for (int b = 0; b < base.B; ++b) {
      for (int ch = 0; ch < C3; ++ch) changed.qkv[(static_cast<size_t>(b) * base.Tn + s) * C3 + ch] += 3.0;
    }
    const auto out2 = run_attention<double>(changed).at("out");
    for (int b = 0; b < base.B; ++b) {
      for (int t = 0; t < base.Tn; ++t) {
        for (int ch = 0; ch < base.C; ++ch) {
          const size_t i = (static_cast<size_t>(b) * base.Tn + t) * base.C + ch;
          if (t < s) {
            EXPECT_EQ(out2[i], out[i]) << "out[" << b << "," << t << "] changed with input at " << s;
          }
        }
      }
      // Sanity: the change is visible at s itself.
      double moved = 0;
      for (int ch = 0; ch < base.C; ++ch) {
        const size_t i = (static_cast<size_t>(b) * base.Tn + s) * base.C + ch;
        moved = std::max(moved, std::abs(out2[i] - out[i]));
      }
      EXPECT_GT(moved, 1e-6) << "input at " << s << " does not reach out[" << b << "," << s << "]";
    }
  }
  for (int t = 0; t < base.Tn; ++t) {
    AttentionCase one = base;
    for (int b = 0; b < base.B; ++b) {
      for (int tt = 0; tt < base.Tn; ++tt) {
        if (tt == t) continue;
        for (int ch = 0; ch < base.C; ++ch) one.R[(static_cast<size_t>(b) * base.Tn + tt) * base.C + ch] = 0.0;
      }
    }
    const auto dqkv = run_attention<double>(one).at("dqkv");
    for (int b = 0; b < base.B; ++b) {
      for (int s = t + 1; s < base.Tn; ++s) {
        for (int ch = 0; ch < C3; ++ch) {
          EXPECT_EQ(dqkv[(static_cast<size_t>(b) * base.Tn + s) * C3 + ch], 0.0)
              << "d out[" << b << "," << t << "] / d qkv[" << b << "," << s << "," << ch << "]";
        }
      }
    }
  }
}

// ---- float instantiation against double ---------------------------------------------------------

void expect_float_matches_double(const Tensors<float>& f, const Tensors<double>& d) {
  ASSERT_EQ(f.size(), d.size());
  for (const auto& [name, want] : d) EXPECT_TRUE(close(name, f.at(name), want, kFloatTol));
}

TEST(OpsFloat, MatchesDouble) {
  {
    SCOPED_TRACE("encoder");
    const auto c = make_encoder_case(1001);
    expect_float_matches_double(run_encoder<float>(c), run_encoder<double>(c));
  }
  {
    SCOPED_TRACE("layernorm");
    const auto c = make_layernorm_case(1002);
    expect_float_matches_double(run_layernorm<float>(c), run_layernorm<double>(c));
  }
  for (bool has_bias : {true, false}) {
    SCOPED_TRACE(has_bias ? "linear with bias" : "linear without bias");
    const auto c = make_linear_case(1003, has_bias);
    expect_float_matches_double(run_linear<float>(c), run_linear<double>(c));
  }
  {
    SCOPED_TRACE("gelu");
    const auto c = make_gelu_case(1004);
    expect_float_matches_double(run_gelu<float>(c), run_gelu<double>(c));
  }
  {
    SCOPED_TRACE("residual");
    const auto c = make_residual_case(1005);
    expect_float_matches_double(run_residual<float>(c), run_residual<double>(c));
  }
  {
    SCOPED_TRACE("attention");
    const auto c = make_attention_case(1006);
    expect_float_matches_double(run_attention<float>(c), run_attention<double>(c));
  }
  {
    SCOPED_TRACE("crossentropy");
    const auto c = make_crossentropy_case(1007);
    expect_float_matches_double(run_crossentropy<float>(c, c.grad_scale), run_crossentropy<double>(c, c.grad_scale));
  }
  {
    SCOPED_TRACE("rmsnorm");
    const auto c = make_rmsnorm_case(1008);
    expect_float_matches_double(run_rmsnorm<float>(c), run_rmsnorm<double>(c));
  }
  {
    SCOPED_TRACE("swiglu");
    const auto c = make_swiglu_case(1009);
    expect_float_matches_double(run_swiglu<float>(c), run_swiglu<double>(c));
  }
  {
    SCOPED_TRACE("rope");
    const auto c = make_rope_case(1010);
    expect_float_matches_double(run_rope<float>(c), run_rope<double>(c));
  }
  {
    SCOPED_TRACE("grouped-query attention");
    const auto c = make_gqa_case(1011, 2);
    expect_float_matches_double(run_gqa<float>(c), run_gqa<double>(c));
  }
}

// ---- accumulate contracts ----------------------------------------------------------------------

// Weight-gradient kernels add into their output: a second call on the same inputs doubles it.
TEST(OpsAccumulate, WeightKernelsAdd) {
  constexpr double kTol = 1e-13;
  {
    const auto c = make_encoder_case(1101);
    const auto once = run_encoder<double>(c);
    auto dwte = once.at("dwte"), dwpe = once.at("dwpe");
    encoder_backward_weight<double>(dwte.data(), dwpe.data(), c.R.data(), c.tokens.data(), c.B, c.Tn, c.C);
    std::vector<double> twice_wte = once.at("dwte"), twice_wpe = once.at("dwpe");
    for (double& x : twice_wte) x *= 2;
    for (double& x : twice_wpe) x *= 2;
    EXPECT_TRUE(close("encoder dwte", dwte, twice_wte, kTol));
    EXPECT_TRUE(close("encoder dwpe", dwpe, twice_wpe, kTol));
  }
  {
    const auto c = make_layernorm_case(1102);
    auto once = run_layernorm<double>(c);
    auto dw = once.at("dw"), db = once.at("db");
    layernorm_backward_weight<double>(dw.data(), db.data(), c.R.data(), c.inp.data(), once.at("mean").data(),
                                      once.at("rstd").data(), c.N, c.C);
    for (double& x : once.at("dw")) x *= 2;
    for (double& x : once.at("db")) x *= 2;
    EXPECT_TRUE(close("layernorm dw", dw, once.at("dw"), kTol));
    EXPECT_TRUE(close("layernorm db", db, once.at("db"), kTol));
  }
  {
    const auto c = make_linear_case(1103, /*has_bias=*/true);
    auto once = run_linear<double>(c);
    auto dw = once.at("dw"), dbias = once.at("dbias");
    linear_backward_weight<double>(MatmulPrecision::fp32, dw.data(), dbias.data(), c.R.data(), c.inp.data(), c.N, c.C,
                                   c.OC);
    for (double& x : once.at("dw")) x *= 2;
    for (double& x : once.at("dbias")) x *= 2;
    EXPECT_TRUE(close("linear dw", dw, once.at("dw"), kTol));
    EXPECT_TRUE(close("linear dbias", dbias, once.at("dbias"), kTol));
  }
}

// Input-gradient kernels overwrite (run_* starts them at kSentinel, and the FD tests pass), and
// add when `accumulate` is set.
TEST(OpsAccumulate, InputKernelsAddWhenAsked) {
  constexpr double kTol = 1e-13;
  {
    const auto c = make_layernorm_case(1201);
    auto once = run_layernorm<double>(c);
    auto dinp = once.at("dinp");
    layernorm_backward_input<double>(dinp.data(), c.R.data(), c.inp.data(), once.at("mean").data(),
                                     once.at("rstd").data(), c.w.data(), c.N, c.C, true);
    for (double& x : once.at("dinp")) x *= 2;
    EXPECT_TRUE(close("layernorm dinp", dinp, once.at("dinp"), kTol));
  }
  {
    const auto c = make_linear_case(1202, /*has_bias=*/true);
    auto once = run_linear<double>(c);
    auto dinp = once.at("dinp");
    linear_backward_input<double>(MatmulPrecision::fp32, dinp.data(), c.R.data(), c.w.data(), c.N, c.C, c.OC, true);
    for (double& x : once.at("dinp")) x *= 2;
    EXPECT_TRUE(close("linear dinp", dinp, once.at("dinp"), kTol));
  }
}

// ---- determinism -------------------------------------------------------------------------------

template <typename T>
void expect_bit_identical(const Tensors<T>& a, const Tensors<T>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, v] : a) EXPECT_TRUE(bit_identical(name, v, b.at(name)));
}

// Larger than the gradient cases, with sizes that do not split evenly between threads.
constexpr int kBigB = 3, kBigT = 23, kBigC = 37, kBigOC = 29;

TEST(OpsDeterminism, FloatRunsAreBitIdenticalWithTwoThreads) {
  Threads threads(2);
  const auto enc = make_encoder_case(1301, kBigB, kBigT, kBigC);
  expect_bit_identical(run_encoder<float>(enc), run_encoder<float>(enc));
  const auto ln = make_layernorm_case(1302, kBigB * kBigT, kBigC);
  expect_bit_identical(run_layernorm<float>(ln), run_layernorm<float>(ln));
  const auto lin = make_linear_case(1303, true, kBigB * kBigT, kBigC, kBigOC);
  expect_bit_identical(run_linear<float>(lin), run_linear<float>(lin));
  const auto gelu = make_gelu_case(1304);
  expect_bit_identical(run_gelu<float>(gelu), run_gelu<float>(gelu));
  const auto att = make_attention_case(1305, kBigB, kBigT, 4 * 6, 4);
  expect_bit_identical(run_attention<float>(att), run_attention<float>(att));
  const auto ce = make_crossentropy_case(1306);
  expect_bit_identical(run_crossentropy<float>(ce, ce.grad_scale), run_crossentropy<float>(ce, ce.grad_scale));
}

// The reductions that are not BLAS give each thread whole output columns and sum rows in order,
// so their results do not depend on the thread count.
TEST(OpsDeterminism, FixedOrderReductionsDoNotDependOnThreadCount) {
  const auto enc = make_encoder_case(1401, kBigB, kBigT, kBigC);
  const auto ln = make_layernorm_case(1402, kBigB * kBigT, kBigC);
  const auto lin = make_linear_case(1403, true, kBigB * kBigT, kBigC, kBigOC);
  auto run = [&](int n_threads) {
    Threads threads(n_threads);
    Tensors<float> r;
    const auto e = run_encoder<float>(enc);
    r["encoder dwte"] = e.at("dwte");
    r["encoder dwpe"] = e.at("dwpe");
    const auto l = run_layernorm<float>(ln);
    r["layernorm dw"] = l.at("dw");
    r["layernorm db"] = l.at("db");
    r["layernorm dinp"] = l.at("dinp");
    r["layernorm out"] = l.at("out");
    r["linear dbias"] = run_linear<float>(lin).at("dbias");
    return r;
  };
  expect_bit_identical(run(1), run(2));
}

// ---- the packed-weight route (kernels/cpu/weight_gemm.h) ---------------------------------------

// At training's row counts the float linear products (forward and input gradient) take oneDNN's
// route with the weight packed: double's numbers within float32 rounding, the same bytes twice.
TEST(OpsFloat, LinearAtTrainingRowCountsTakesThePackedRouteAndMatchesDouble) {
  Threads threads(2);
  const int N = 600, C = 72, OC = 40;  // sizes that do not split evenly between threads or blocks
  ASSERT_TRUE(packed_weight_route(N, OC, C));   // the forward's product
  ASSERT_TRUE(packed_weight_route(N, C, OC));   // the input gradient's
  EXPECT_FALSE(packed_weight_route(511, OC, C));
  EXPECT_FALSE(packed_weight_route(N, 50304, 768));  // GPT-2 124M's head: OpenBLAS
  const auto c = make_linear_case(1501, /*has_bias=*/true, N, C, OC);
  const auto f = run_linear<float>(c);
  expect_float_matches_double(f, run_linear<double>(c));
  expect_bit_identical(f, run_linear<float>(c));
}

// Models may run on concurrent threads (each outside any OpenMP region, so each takes the route):
// two threads running the same products at once give the bytes one thread gives alone (each
// thread has its own packed weight and scratchpad).
TEST(OpsDeterminism, PackedRouteOnConcurrentThreadsGivesTheBytesOfOneThread) {
  const auto c = make_linear_case(1504, /*has_bias=*/true, 700, 64, 96);
  ASSERT_TRUE(packed_weight_route(c.N, c.OC, c.C));
  const auto alone = run_linear<float>(c);
  std::vector<Tensors<float>> got(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      for (int r = 0; r < 5; ++r) got[i] = run_linear<float>(c);
    });
  }
  for (std::thread& t : threads) t.join();
  for (const auto& g : got) expect_bit_identical(alone, g);
}

// The route itself against SGEMM: both layouts of the weight, padded leading dimensions (the
// padding left alone), beta 0 (overwrite) and 1 (the accumulating input gradient).
TEST(OpsFloat, PackedWeightProductsEqualSgemm) {
  Threads threads(2);
  Rng rng(1502);
  const int M = 515, N = 33, K = 70;
  for (const bool trans_w : {true, false}) {
    for (const float beta : {0.0f, 1.0f}) {
      const int lda = K + 3, ldw = (trans_w ? K : N) + 5, ldc = N + 2;
      std::vector<float> a(static_cast<size_t>(M) * lda), w(static_cast<size_t>(trans_w ? N : K) * ldw),
          c(static_cast<size_t>(M) * ldc);
      for (float& x : a) x = static_cast<float>(rng.normal());
      for (float& x : w) x = static_cast<float>(rng.normal());
      for (float& x : c) x = static_cast<float>(rng.normal());
      std::vector<float> want = c, got = c;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_w ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, a.data(), lda,
                  w.data(), ldw, beta, want.data(), ldc);
      ASSERT_TRUE(onednn_packed_weight_gemm(trans_w, M, N, K, a.data(), lda, w.data(), ldw, beta, got.data(), ldc));
      double err = 0, scale = 0;
      for (int i = 0; i < M; ++i) {
        for (int j = 0; j < N; ++j) {
          err = std::max(err, std::abs(static_cast<double>(got[i * ldc + j]) - want[i * ldc + j]));
          scale = std::max(scale, std::abs(static_cast<double>(want[i * ldc + j])));
        }
        for (int j = N; j < ldc; ++j) ASSERT_EQ(got[i * ldc + j], c[i * ldc + j]) << "padding written";
      }
      EXPECT_LT(err / scale, 1e-6) << "trans_w " << trans_w << " beta " << beta;
    }
  }
}


// ---- attention's batched per-head products (kernels/cpu/batched_gemm.h) -------------------------

// The batched route against SGEMM head by head: operands inside larger tensors (heads at column
// offsets of wider rows, as q, k and v sit in qkv), read plain and transposed, alpha != 1, beta 0
// and 1; elements outside the heads' matrices are left alone.
TEST(OpsFloat, BatchedHeadProductsEqualSgemmPerHead) {
  Threads threads(2);
  Rng rng(1601);
  const int B = 3, H = 2, M = 37, N = 21, K = 19;
  for (const bool trans_a : {false, true}) {
    for (const bool trans_b : {false, true}) {
      for (const float beta : {0.0f, 1.0f}) {
        // Each operand: [B, rows, H * cols + 3] rows of all heads side by side, plus 3 spare columns.
        auto layout = [&](int rows, int cols, bool trans, std::vector<float>& data) {
          const int stored_rows = trans ? cols : rows, stored_cols = trans ? rows : cols, ld = H * stored_cols + 3;
          data.resize(static_cast<size_t>(B) * stored_rows * ld);
          for (float& x : data) x = static_cast<float>(rng.normal());
          const int64_t batch = static_cast<int64_t>(stored_rows) * ld;
          return trans ? HeadMatrices{data.data(), batch, stored_cols, 1, ld}
                       : HeadMatrices{data.data(), batch, stored_cols, ld, 1};
        };
        std::vector<float> a, b, c;
        const HeadMatrices am = layout(M, K, trans_a, a), bm = layout(K, N, trans_b, b), cm = layout(M, N, false, c);
        std::vector<float> want = c;
        for (int bi = 0; bi < B; ++bi) {
          for (int h = 0; h < H; ++h) {
            auto at = [&](const HeadMatrices& m) { return bi * m.batch_stride + h * m.head_stride; };
            cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N,
                        K, 0.5f, a.data() + at(am), trans_a ? am.col_stride : am.row_stride, b.data() + at(bm),
                        trans_b ? bm.col_stride : bm.row_stride, beta, want.data() + at(cm), cm.row_stride);
          }
        }
        std::vector<float> got = c;
        HeadMatrices out = cm;
        out.data = got.data();
        ASSERT_TRUE(batched_head_gemm(B, H, M, N, K, 0.5f, am, bm, beta, out));
        double err = 0, scale = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          err = std::max(err, std::abs(static_cast<double>(got[i]) - want[i]));
          scale = std::max(scale, std::abs(static_cast<double>(want[i])));
          if (i % cm.row_stride >= static_cast<size_t>(H * N)) {
            ASSERT_EQ(got[i], c[i]) << "spare column written";
          }
        }
        EXPECT_LT(err / scale, 1e-6) << "trans_a " << trans_a << " trans_b " << trans_b << " beta " << beta;
      }
    }
  }
}

// Dense attention in float32 outside a parallel region takes the batched route: every output
// (causal and not) within float32 rounding of double's per-head loop, and the same bytes twice.
TEST(OpsFloat, BatchedDenseAttentionMatchesDoubleCausalAndNot) {
  Threads threads(2);
  const auto c = make_attention_case(1602, 3, 33, 4 * 8, 4);
  for (const bool causal : {true, false}) {
    auto run = [&](auto zero) {
      using T = decltype(zero);
      auto qkv = cast<T>(c.qkv), R = cast<T>(c.R);
      Tensors<T> r;
      r["out"] = filled<T>(c.R.size(), kSentinel);
      r["att"] = filled<T>(static_cast<size_t>(c.B) * c.NH * c.Tn * c.Tn, kSentinel);
      r["dqkv"] = filled<T>(qkv.size(), kSentinel);
      attention_forward<T>(MatmulPrecision::fp32, r["out"].data(), r["att"].data(), qkv.data(), c.B, c.Tn, c.C, c.NH,
                           0, causal);
      attention_backward_input<T>(MatmulPrecision::fp32, r["dqkv"].data(), R.data(), r["att"].data(), qkv.data(), c.B,
                                  c.Tn, c.C, c.NH, 0, causal);
      return r;
    };
    SCOPED_TRACE(causal ? "causal" : "not causal");
    const Tensors<float> f = run(0.0f);
    expect_float_matches_double(f, run(0.0));
    expect_bit_identical(f, run(0.0f));
  }
}


// Past 8 M floats of maps (dense attention at long context) the backward leaves the batched route
// for the per-head loop (no second set of maps): the forward's batched maps and the loop's
// gradients still within float32 rounding of double.
TEST(OpsFloat, DenseAttentionBeyondTheBatchedMapLimitMatchesDouble) {
  Threads threads(2);
  const auto c = make_attention_case(1603, 1, 2050, 8, 2);  // 2 x 2050 x 2050 floats of maps > 8 M
  expect_float_matches_double(run_attention<float>(c), run_attention<double>(c));
}

// Dense attention under bf16 products (on AMX tiles where the CPU has them: kernels/cpu/
// amx_attention.h; else oneDNN's bf16 matmul or its emulation), against double on the same
// bf16-rounded q, k, v: the probabilities within float32 summation error (the scores' products of
// bf16 operands are exact, their sums float32), the outputs and gradients within bf16's precision
// (the probabilities, dout and the scores' gradient are rounded where they multiply) and visibly
// rounded; causal and not, head sizes 32 and 64, lengths off the tiles' 16 and 32, grouped
// key/value heads; the same bytes twice.
TEST(OpsBf16, DenseAttentionMatchesDoubleOnRoundedOperands) {
  Threads threads(2);
  if (std::string(bf16_engine()).find("AMX") != std::string::npos) {
    EXPECT_TRUE(amx_attention(MatmulPrecision::bf16, 64, 130)) << "AMX here, but dense attention does not use it";
  }
  struct Shape { int B, T, NH, NKV, hs; };
  for (const Shape sh : {Shape{2, 37, 2, 2, 32}, Shape{1, 130, 4, 2, 64}, Shape{1, 64, 2, 1, 64}}) {
    for (const bool causal : {true, false}) {
      SCOPED_TRACE("T " + std::to_string(sh.T) + " heads " + std::to_string(sh.NH) + "/" + std::to_string(sh.NKV) +
                   " hs " + std::to_string(sh.hs) + (causal ? " causal" : ""));
      const int C = sh.NH * sh.hs, C3 = C + 2 * sh.NKV * sh.hs;
      Rng rng(1700 + sh.T);
      std::vector<double> qkv = normal(rng, static_cast<size_t>(sh.B) * sh.T * C3), dout = normal(rng, static_cast<size_t>(sh.B) * sh.T * C);
      for (double& x : qkv) x = round_to_bf16(static_cast<float>(x));
      auto run = [&](auto zero, MatmulPrecision precision) {
        using T = decltype(zero);
        auto q = cast<T>(qkv), d = cast<T>(dout);
        Tensors<T> r;
        r["out"] = filled<T>(d.size(), kSentinel);
        r["att"] = filled<T>(static_cast<size_t>(sh.B) * sh.NH * sh.T * sh.T, kSentinel);
        r["dqkv"] = filled<T>(q.size(), kSentinel);
        attention_forward<T>(precision, r["out"].data(), r["att"].data(), q.data(), sh.B, sh.T, C, sh.NH, sh.NKV,
                             causal);
        attention_backward_input<T>(precision, r["dqkv"].data(), d.data(), r["att"].data(), q.data(), sh.B, sh.T, C,
                                    sh.NH, sh.NKV, causal);
        return r;
      };
      const Tensors<float> got = run(0.0f, MatmulPrecision::bf16);
      const Tensors<double> want = run(0.0, MatmulPrecision::fp32);
      EXPECT_TRUE(close("att", got.at("att"), want.at("att"), 2e-6));
      EXPECT_TRUE(close("out", got.at("out"), want.at("out"), 1e-2));
      EXPECT_FALSE(close("out", got.at("out"), want.at("out"), 1e-5)) << "no bf16 rounding seen";
      EXPECT_TRUE(close("dqkv", got.at("dqkv"), want.at("dqkv"), 3e-2));
      EXPECT_FALSE(close("dqkv", got.at("dqkv"), want.at("dqkv"), 1e-5)) << "no bf16 rounding seen";
      expect_bit_identical(got, run(0.0f, MatmulPrecision::bf16));
    }
  }
}

}  // namespace
}  // namespace keel::ops
