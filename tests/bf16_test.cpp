// bf16 matrix products (kernels/cpu/bf16.h, runtime.precision = "bf16"): the rounding, the oneDNN
// matmul path (checked with float32 operands against SGEMM on every machine, and with bf16
// operands where the CPU has bf16 instructions), the emulated path, and training in bf16: the
// same bytes twice, and a final validation loss within 1 % of float32's for both families.
#include "kernels/cpu/bf16.h"

#include <gtest/gtest.h>

#include <cblas.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/fileio.h"
#include "core/rng.h"
#include "kernels/cpu/blas.h"
#include "test_util.h"

namespace keel {
namespace {

TEST(Bf16, RoundsToNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(round_to_bf16(1.0f + 1.0f / 256), 1.0f);            // a tie, to even (down)
  EXPECT_EQ(round_to_bf16(1.0f + 3.0f / 256), 1.0f + 4.0f / 256);  // a tie, to even (up)
  EXPECT_EQ(round_to_bf16(1.0f + 1.5f / 256), 1.0f + 2.0f / 256);  // above the tie: up
  EXPECT_EQ(round_to_bf16(-2.5f), -2.5f);                         // representable: unchanged
  EXPECT_TRUE(std::isnan(round_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(round_to_bf16(std::numeric_limits<float>::infinity()), std::numeric_limits<float>::infinity());
  EXPECT_EQ(round_to_bf16(1e-30f) > 0, true);  // float32's exponent range: no underflow to zero
  EXPECT_NEAR(round_to_bf16(3.0e38f), 3.0e38f, 3.0e38f / 128);
}

struct Shape {
  bool ta, tb;
  int M, N, K, lda_pad, ldb_pad, ldc_pad;
  float alpha, beta;
};

// op(A)[M,K] op(B)[K,N] with padded leading dimensions, through `run`, against SGEMM of `a`, `b`.
template <typename Run>
double max_error(const Shape& s, Run run, bool round_operands) {
  Rng rng(7);
  const int a_rows = s.ta ? s.K : s.M, a_cols = s.ta ? s.M : s.K, b_rows = s.tb ? s.N : s.K, b_cols = s.tb ? s.K : s.N;
  const int lda = a_cols + s.lda_pad, ldb = b_cols + s.ldb_pad, ldc = s.N + s.ldc_pad;
  std::vector<float> a(static_cast<size_t>(a_rows) * lda), b(static_cast<size_t>(b_rows) * ldb),
      c(static_cast<size_t>(s.M) * ldc);
  for (float& x : a) x = static_cast<float>(rng.normal());
  for (float& x : b) x = static_cast<float>(rng.normal());
  for (float& x : c) x = static_cast<float>(rng.normal());
  std::vector<float> want = c, ra = a, rb = b;
  if (round_operands) {
    for (float& x : ra) x = round_to_bf16(x);
    for (float& x : rb) x = round_to_bf16(x);
  }
  cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans, s.tb ? CblasTrans : CblasNoTrans, s.M, s.N, s.K, s.alpha,
              ra.data(), lda, rb.data(), ldb, s.beta, want.data(), ldc);
  std::vector<float> got = c;
  run(s, a.data(), lda, b.data(), ldb, got.data(), ldc);
  double err = 0, scale = 0;
  for (int i = 0; i < s.M; ++i) {
    for (int j = 0; j < s.N; ++j) {
      err = std::max(err, std::abs(static_cast<double>(got[i * ldc + j]) - want[i * ldc + j]));
      scale = std::max(scale, std::abs(static_cast<double>(want[i * ldc + j])));
    }
    for (int j = s.N; j < ldc; ++j) EXPECT_EQ(got[i * ldc + j], c[i * ldc + j]) << "padding written";
  }
  return err / scale;
}

const std::vector<Shape> kShapes = {
    {false, false, 17, 9, 13, 0, 0, 0, 1.0f, 0.0f},  {false, true, 17, 9, 13, 3, 1, 2, 1.0f, 1.0f},
    {true, false, 8, 31, 5, 2, 0, 1, 0.5f, 1.0f},    {true, true, 12, 12, 40, 1, 4, 0, 1.0f, 0.25f},
    {false, true, 64, 96, 128, 0, 0, 0, 1.0f, 0.0f},
};

// oneDNN's matmul primitive as Keel drives it (strides, transposes, alpha as an output scale, beta
// as a sum post-op, primitives cached per shape), with float32 operands: SGEMM's numbers.
TEST(Bf16, TheOneDnnMatmulPathMatchesSgemmWithFloat32Operands) {
  for (const Shape& s : kShapes) {
    for (int again = 0; again < 2; ++again) {  // the second call reuses the cached primitive
      const double e = max_error(
          s,
          [](const Shape& s, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
            ASSERT_TRUE(onednn_gemm("f32", s.ta, s.tb, s.M, s.N, s.K, s.alpha, a, lda, b, ldb, s.beta, c, ldc));
          },
          false);
      EXPECT_LT(e, 1e-5) << s.M << "x" << s.N << "x" << s.K << " ta " << s.ta << " tb " << s.tb;
    }
  }
}

// bf16 products: SGEMM of the operands rounded to bf16 (exactly so when emulated; within float32
// summation order through oneDNN).
TEST(Bf16, ProductsAreThoseOfTheRoundedOperands) {
  std::printf("bf16 engine here: %s\n", bf16_engine().c_str());
  for (const Shape& s : kShapes) {
    const double e = max_error(
        s,
        [](const Shape& s, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
          gemm_bf16(s.ta, s.tb, s.M, s.N, s.K, s.alpha, a, lda, b, ldb, s.beta, c, ldc);
        },
        true);
    EXPECT_LT(e, cpu_has_bf16() ? 1e-5 : 1e-7) << s.M << "x" << s.N << "x" << s.K;
    // And they are not float32's: the rounding shows.
    const double vs_fp32 = max_error(
        s,
        [](const Shape& s, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
          gemm_bf16(s.ta, s.tb, s.M, s.N, s.K, s.alpha, a, lda, b, ldb, s.beta, c, ldc);
        },
        false);
    EXPECT_GT(vs_fp32, 1e-4);
  }
}

TEST(Bf16, TheOneDnnBf16PrimitiveWhereTheCpuHasBf16) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16: bf16 products are emulated here";
  for (const Shape& s : kShapes) {
    const double e = max_error(
        s,
        [](const Shape& s, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
          ASSERT_TRUE(onednn_gemm("bf16", s.ta, s.tb, s.M, s.N, s.K, s.alpha, a, lda, b, ldb, s.beta, c, ldc));
        },
        true);
    EXPECT_LT(e, 1e-5);
  }
}

class Bf16Training : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 60);
  }
  testing::CommandResult train(const std::string& run, const std::string& extra) {
    return testing::run_keel("train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / run +
                             " --set train.eval_every=0 " + extra);
  }
  double final_val_loss(const std::string& run) {
    double loss = std::nan("");
    const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
      if (j.contains("val_loss")) loss = j.at("val_loss").get<double>();
      at = end + 1;
    }
    return loss;
  }
  testing::TempDir dir{"keel-bf16"};
};

TEST_F(Bf16Training, SameBytesTwiceAndWithinOnePercentOfFloat32ForBothFamilies) {
  for (const std::string family : {"gpt2", "llama"}) {
    const std::string model = family == "llama" ? "--set model.preset=llama-tiny --set model.vocab_size=64 "
                                                  "--set model.max_seq_len=32 "
                                                : "";
    const testing::CommandResult fp32 = train(family + "-fp32", model);
    ASSERT_EQ(fp32.exit_code, 0) << fp32.output;
    const testing::CommandResult a = train(family + "-bf16-a", model + "--set runtime.precision=bf16");
    ASSERT_EQ(a.exit_code, 0) << a.output;
    EXPECT_NE(a.output.find("keel: precision bf16: matrix products with bf16 operands"), std::string::npos) << a.output;
    ASSERT_EQ(train(family + "-bf16-b", model + "--set runtime.precision=bf16").exit_code, 0);
    EXPECT_EQ(testing::checkpoint_bytes(dir / (family + "-bf16-a/ckpt")),
              testing::checkpoint_bytes(dir / (family + "-bf16-b/ckpt")))
        << family;
    EXPECT_NE(testing::checkpoint_bytes(dir / (family + "-bf16-a/ckpt")),
              testing::checkpoint_bytes(dir / (family + "-fp32/ckpt")))
        << family << ": bf16 should not be float32";
    const double want = final_val_loss(family + "-fp32"), got = final_val_loss(family + "-bf16-a");
    EXPECT_LT(std::abs(got - want), 0.01 * want) << family << ": bf16 " << got << " vs fp32 " << want;
  }
  const testing::CommandResult bad = train("bad", "--set runtime.precision=fp16");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("runtime.precision"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace keel
