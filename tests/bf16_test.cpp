// bf16 matrix products (kernels/cpu/bf16.h, runtime.precision = "bf16"): the rounding, the oneDNN
// matmul path (checked with float32 operands against SGEMM on every machine, and with bf16
// operands where the CPU has bf16 instructions), the emulated path, and training in bf16: the
// same bytes twice, and a final validation loss within 1 % of float32's for both families; and
// activations kept in bf16 (model/layer_util.h Stash): what they save, and that they change only
// what they should; and precision as a value each model carries (model/layer.h MathMode): models of
// different precisions trained interleaved, or on concurrent threads, each give their own bytes.
#include "kernels/cpu/bf16.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <thread>
#include <vector>

#include "core/config.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "kernels/cpu/blas.h"
#include "kernels/cpu/gemm_probe.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "store/chunk_store.h"
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

// bf16 products with operands already in bf16 (Operand::bits) give what rounding float32
// operands inside the product gives: the same bits when emulated, and through oneDNN too.
TEST(Bf16, OperandsAlreadyInBf16MultiplyAsRoundedFloat32Ones) {
  Rng rng(3);
  const int M = 37, N = 29, K = 41;
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      std::vector<float> a(M * K), b(K * N);
      for (float& x : a) x = static_cast<float>(rng.normal());
      for (float& x : b) x = static_cast<float>(rng.normal());
      std::vector<uint16_t> a16(a.size()), b16(b.size());
      to_bf16(a16.data(), a.data(), static_cast<int64_t>(a.size()));
      to_bf16(b16.data(), b.data(), static_cast<int64_t>(b.size()));
      const int lda = ta ? M : K, ldb = tb ? K : N;
      std::vector<float> want(M * N, 0.5f), got_a(want), got_b(want), got_ab(want);
      gemm_bf16(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 1.0f, want.data(), N);
      gemm_operands(MatmulPrecision::fp32, ta, tb, M, N, K, 1.0f, Operand::bits(a16.data()), lda, b.data(), ldb, 1.0f,
                    got_a.data(), N);
      gemm_operands(MatmulPrecision::fp32, ta, tb, M, N, K, 1.0f, a.data(), lda, Operand::bits(b16.data()), ldb, 1.0f,
                    got_b.data(), N);
      gemm_operands(MatmulPrecision::fp32, ta, tb, M, N, K, 1.0f, Operand::bits(a16.data()), lda,
                    Operand::bits(b16.data()), ldb, 1.0f, got_ab.data(), N);
      EXPECT_EQ(want, got_a) << ta << tb;
      EXPECT_EQ(want, got_b) << ta << tb;
      EXPECT_EQ(want, got_ab) << ta << tb;
    }
  }
}

ModelConfig stash_model(const std::string& family) {
  Config c;
  c.model.preset = family == "llama" ? "llama-tiny" : "tiny";
  c.model.n_layer = 2;
  c.model.n_head = 2;
  c.model.n_embd = 32;
  c.model.vocab_size = 61;
  c.model.max_seq_len = 16;
  if (family == "llama") c.model.n_kv_head = 1;
  c.train.seq_len = 16;
  c.resolve(1);
  return c.model;
}

// One forward and backward in bf16, activations kept in float32 or in bf16; the loss and the
// gradients in a map by tensor name.
struct Pass {
  float loss = 0;
  std::map<std::string, std::vector<float>> grads;
  int64_t block_floats = 0, head_floats = 0;
};
Pass bf16_pass(const ModelConfig& m, bool bf16_activations) {
  ChunkStore store(8192);
  GPT model(m, store, {}, bf16_activations, MathMode::uniform(MatmulPrecision::bf16));
  store.finalize();
  model.init_weights(11);
  const int B = 2, T = 16;
  Rng rng(5);
  std::vector<int> inputs(B * T), targets(B * T);
  for (int i = 0; i < B * T; ++i) {
    inputs[i] = static_cast<int>(rng.below(m.vocab_size));
    targets[i] = static_cast<int>(rng.below(m.vocab_size));
  }
  model.allocate(B, T);
  store.zero_grads();
  Pass out;
  out.loss = model.forward(Batch{inputs.data(), targets.data(), B, T, 1.0f / (B * T)});
  model.backward(Batch{inputs.data(), targets.data(), B, T, 1.0f / (B * T)});
  for (int id = 0; id < static_cast<int>(store.tensors().size()); ++id) {
    const std::span<const float> g = store.view(id, Plane::grad);
    out.grads[store.tensors()[id].spec.name].assign(g.begin(), g.end());
  }
  out.block_floats = model.layer(1).activation_floats(B, T);
  out.head_floats = model.layer(model.num_layers() - 1).activation_floats(B, T);
  return out;
}

// Kept in bf16, the inputs of products change no product: the loss is the same bits, and so are
// the gradients that only products of stashed inputs and float32 gradients make (the LM head's,
// the last block's MLP output projection's). The others go through a GELU / SwiGLU derivative at
// the bf16 input and stay close. The memory: each block keeps 7 (GPT-2) or 1 + 5H/(2C) (llama)
// rows of C floats fewer per token, the head half a row fewer.
TEST(Bf16, ActivationsKeptInBf16ChangeOnlyWhatTheyShouldAndSaveMemory) {
  for (const std::string family : {"gpt2", "llama"}) {
    const ModelConfig m = stash_model(family);
    const Pass f32 = bf16_pass(m, false), b16 = bf16_pass(m, true);
    EXPECT_EQ(f32.loss, b16.loss) << family;
    const std::string head = m.llama() ? "lm_head.w" : "wte";
    const std::string last = "h." + std::to_string(m.n_layer - 1) + ".mlp.proj.w";
    if (m.llama() && !m.tie_embeddings.value_or(false)) {  // (GPT-2's head is wte, also the embedding's)
      EXPECT_EQ(f32.grads.at(head), b16.grads.at(head)) << family;
    }
    EXPECT_EQ(f32.grads.at(last), b16.grads.at(last)) << family;
    int changed = 0;
    for (const auto& [name, g] : f32.grads) {
      const std::vector<float>& h = b16.grads.at(name);
      double diff = 0, norm = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        diff += (g[i] - h[i]) * static_cast<double>(g[i] - h[i]);
        norm += g[i] * static_cast<double>(g[i]);
      }
      EXPECT_LT(std::sqrt(diff), 0.02 * std::sqrt(norm) + 1e-12) << family << " " << name;
      changed += diff > 0;
    }
    EXPECT_GT(changed, 0) << family << ": the GELU / SwiGLU inputs are stored rounded";
    const int64_t NC = 2 * 16 * static_cast<int64_t>(m.n_embd), NH = 2 * 16 * static_cast<int64_t>(m.ffn_hidden);
    EXPECT_EQ(f32.block_floats - b16.block_floats, m.llama() ? NC + 5 * NH / 2 : 7 * NC) << family;
    EXPECT_EQ(f32.head_floats - b16.head_floats, NC / 2) << family;
  }
}

// A small model of one precision training on its own store: each step a forward, a backward and
// an AdamW update on a fixed batch; the loss and every parameter's bytes after it.
class Trainee {
 public:
  struct Step {
    float loss = 0;
    std::vector<float> params;
  };
  Trainee(const ModelConfig& m, MathMode math, bool bf16_activations, bool bf16_copies = true)
      : store_(8192), model_(m, store_, {}, bf16_activations, math), optimizer_(OptimConfig{}) {
    store_.finalize();
    store_.set_bf16_copies(bf16_copies);
    model_.init_weights(11);
    model_.allocate(kB, kT);
    store_.zero_grads();
    Rng rng(5);
    for (int i = 0; i < kB * kT; ++i) {
      inputs_.push_back(static_cast<int>(rng.below(m.vocab_size)));
      targets_.push_back(static_cast<int>(rng.below(m.vocab_size)));
    }
  }
  Step step() {
    const Batch batch{inputs_.data(), targets_.data(), kB, kT, 1.0f / (kB * kT)};
    Step out;
    out.loss = model_.forward(batch);
    model_.backward(batch);
    optimizer_.step(store_, 1e-2, ++updates_, 1.0f);
    const std::span<const float> p = store_.range_view(Plane::param, 0, store_.numel());
    out.params.assign(p.begin(), p.end());
    return out;
  }

 private:
  static constexpr int kB = 2, kT = 16;
  ChunkStore store_;
  GPT model_;
  AdamW optimizer_;
  std::vector<int> inputs_, targets_;
  int64_t updates_ = 0;
};

constexpr int kTraineeSteps = 3;

// The precisions a process may mix: float32; bf16 as runtime.precision = "bf16" trains (bf16
// products, activations kept in bf16); an image tower's int8 (int8 forward, bf16 backward), here
// on a language model's layers.
struct Mix {
  const char* name;
  MathMode math;
  bool bf16_activations;
};
const Mix kMixes[] = {{"fp32", MathMode{}, false},
                      {"bf16", MathMode::uniform(MatmulPrecision::bf16), true},
                      {"int8", MathMode{MatmulPrecision::int8, MatmulPrecision::bf16}, false}};

std::vector<Trainee::Step> train_alone(const ModelConfig& m, const Mix& mix) {
  Trainee t(m, mix.math, mix.bf16_activations);
  std::vector<Trainee::Step> steps;
  for (int s = 0; s < kTraineeSteps; ++s) steps.push_back(t.step());
  return steps;
}

// The weights' bf16 copies (ChunkStore::bf16_params, written by AdamW as it updates them) give
// the bytes of rounding the float32 weights on every product: three bf16 training steps of both
// families, with and without copies, have the same losses and parameters bit for bit. A stale copy
// (one step behind) would change the second step's loss.
TEST(Bf16, WeightCopiesMadeOncePerUpdateGiveTheBytesOfRoundingOnEveryProduct) {
  for (const std::string family : {"gpt2", "llama"}) {
    const ModelConfig m = stash_model(family);
    Trainee with(m, MathMode::uniform(MatmulPrecision::bf16), true, true);
    Trainee without(m, MathMode::uniform(MatmulPrecision::bf16), true, false);
    for (int s = 0; s < kTraineeSteps; ++s) {
      const Trainee::Step a = with.step(), b = without.step();
      EXPECT_EQ(a.loss, b.loss) << family << " step " << s;
      ASSERT_EQ(a.params.size(), b.params.size());
      EXPECT_EQ(0, std::memcmp(a.params.data(), b.params.data(), sizeof(float) * a.params.size()))
          << family << " step " << s;
    }
  }
}

// Precision is a value each model carries (MathMode, given at construction), not a state of the
// process: models of three precisions built side by side and trained step by step in turn each
// give exactly the bytes they give alone. Their first losses differ (the forward products'
// precision alone decides them: kept activations do not change a loss), so each model's kernels
// really ran at its own precision; with one process-wide precision, whichever model set it last
// would have run the others' products too. On a CPU without bf16 instructions the bf16 products are
// emulated (operands rounded to bf16): different bytes from float32's all the same.
TEST(Bf16, ModelsOfDifferentPrecisionsInterleavedEachGiveTheirOwnBytes) {
  for (const std::string family : {"gpt2", "llama"}) {
    const ModelConfig m = stash_model(family);
    std::vector<std::vector<Trainee::Step>> alone;
    for (const Mix& mix : kMixes) alone.push_back(train_alone(m, mix));
    for (size_t i = 0; i < alone.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        EXPECT_NE(alone[i][0].loss, alone[j][0].loss) << family << ": " << kMixes[i].name << " vs " << kMixes[j].name;
      }
    }
    std::vector<std::unique_ptr<Trainee>> side_by_side;
    for (const Mix& mix : kMixes) side_by_side.push_back(std::make_unique<Trainee>(m, mix.math, mix.bf16_activations));
    for (int s = 0; s < kTraineeSteps; ++s) {
      for (size_t i = 0; i < side_by_side.size(); ++i) {
        const Trainee::Step got = side_by_side[i]->step();
        EXPECT_EQ(got.loss, alone[i][s].loss) << family << " " << kMixes[i].name << " step " << s;
        EXPECT_EQ(got.params, alone[i][s].params) << family << " " << kMixes[i].name << " step " << s;
      }
    }
  }
}

// The same models trained at once, each on a thread of its own (each thread's kernels open their
// own OpenMP regions; bf16 products keep their buffers and oneDNN scratchpads per thread): each
// gives the bytes it gives alone on a thread.
TEST(Bf16, ModelsOfDifferentPrecisionsOnConcurrentThreadsEachGiveTheirOwnBytes) {
  const ModelConfig m = stash_model("gpt2");
  std::vector<std::vector<Trainee::Step>> alone(std::size(kMixes)), together(std::size(kMixes));
  for (size_t i = 0; i < std::size(kMixes); ++i) {
    std::thread([&, i] { alone[i] = train_alone(m, kMixes[i]); }).join();
  }
  std::vector<std::thread> threads;
  for (size_t i = 0; i < std::size(kMixes); ++i)
    threads.emplace_back([&, i] { together[i] = train_alone(m, kMixes[i]); });
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < std::size(kMixes); ++i) {
    ASSERT_EQ(together[i].size(), alone[i].size());
    for (int s = 0; s < kTraineeSteps; ++s) {
      EXPECT_EQ(together[i][s].loss, alone[i][s].loss) << kMixes[i].name << " step " << s;
      EXPECT_EQ(together[i][s].params, alone[i][s].params) << kMixes[i].name << " step " << s;
    }
  }
  EXPECT_NE(alone[0][0].loss, alone[1][0].loss);
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
  std::vector<double> losses(const std::string& run) { return testing::step_losses(dir / (run + "/metrics.jsonl")); }
  testing::TempDir dir{"keel-bf16"};
};

// A bf16 run on a CPU whose bf16 products are slower than its float32 ones says so at start-up,
// in one line naming both probes' rates and suggesting fp32; where bf16 is not slower, nothing.
TEST(Bf16Warning, OnlyWhereBf16ProductsAreSlowerThanFloat32Ones) {
  EXPECT_EQ(bf16_slower_warning(143.04, 212.3),
            "keel: warning: runtime.precision = \"bf16\" is slower here: bf16 products run at 143.0 GFLOP/s on this "
            "CPU, float32 ones (SGEMM) at 212.3; runtime.precision = \"fp32\" trains faster on it");
  EXPECT_EQ(bf16_slower_warning(400.0, 212.3), "");
  EXPECT_EQ(bf16_slower_warning(212.31, 212.3), "");  // equal as printed: not slower
  EXPECT_NE(bf16_slower_warning(212.2, 212.3), "");
  EXPECT_EQ(bf16_slower_warning(0, 212.3), "");  // a rate not measured: nothing to say
  EXPECT_EQ(bf16_slower_warning(143.0, 0), "");
}

TEST_F(Bf16Training, TheBinarySaysWhenBf16ProductsAreSlowerHere) {
  const testing::CommandResult r = train("rates", "--set runtime.precision=bf16 --set train.steps=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The rates the start-up line reports decide: the warning follows from them, whatever they are.
  const size_t at = r.output.find("keel: precision bf16: matrix products with bf16 operands, ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const size_t rates = r.output.find(": probe ", at);
  ASSERT_NE(rates, std::string::npos) << r.output;
  double bf16_gflops = 0, sgemm_gflops = 0;
  ASSERT_EQ(std::sscanf(r.output.c_str() + rates, ": probe %lf GFLOP/s, SGEMM %lf;", &bf16_gflops, &sgemm_gflops), 2)
      << r.output;
  EXPECT_GT(bf16_gflops, 0);
  EXPECT_GT(sgemm_gflops, 0);
  const std::string warning = bf16_slower_warning(bf16_gflops, sgemm_gflops);
  EXPECT_EQ(warning.empty(), bf16_gflops >= sgemm_gflops) << r.output;
  if (warning.empty()) {
    EXPECT_EQ(r.output.find("keel: warning: runtime.precision = \"bf16\""), std::string::npos) << r.output;
  } else {
    EXPECT_NE(r.output.find(warning + "\n"), std::string::npos) << r.output;
  }
  // The float32 run of the same job: no such line.
  const testing::CommandResult fp32 = train("rates-fp32", "--set train.steps=1");
  ASSERT_EQ(fp32.exit_code, 0) << fp32.output;
  EXPECT_EQ(fp32.output.find("keel: warning: runtime.precision"), std::string::npos) << fp32.output;
}

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

// bf16 across pipeline stages (the stages size their slots with bf16 activations): the same
// training as one rank in bf16, step by step. The attention kernel is named: under "auto" the
// one-rank run (2 threads) and the pipeline's ranks (1 thread each) measure at different thread
// counts and may take different kernels, whose sums differ in their last bits from the first step.
TEST_F(Bf16Training, APipelineInBf16TrainsWhatOneRankTrainsInBf16) {
  const std::string llama = "--set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=32 "
                            "--set train.batch_size=2 --set train.grad_accum=4 --set runtime.precision=bf16 "
                            "--set model.attention=dense ";
  ASSERT_EQ(train("one-bf16", llama).exit_code, 0);
  const testing::CommandResult pipe = testing::run_keel(
      "launch -n 2 -- train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "pipe-bf16" +
      " --set train.eval_every=0 " + llama + "--set parallel.pipeline=2 --set parallel.schedule=zb-h2");
  ASSERT_EQ(pipe.exit_code, 0) << pipe.output;
  ASSERT_EQ(train("one-fp32", llama + "--set runtime.precision=fp32").exit_code, 0);
  const auto apart = testing::weight_distance(dir / "one-bf16/ckpt", dir / "pipe-bf16/ckpt");
  const auto from_fp32 = testing::weight_distance(dir / "one-bf16/ckpt", dir / "one-fp32/ckpt");
  // The first steps agree to float32's last bits; later, sums in another order round to bf16
  // differently now and then, and the runs drift apart, but less than bf16 drifts from float32.
  const std::vector<double> one = losses("one-bf16"), piped = losses("pipe-bf16");
  ASSERT_EQ(one.size(), piped.size());
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_LE(std::abs(piped[i] - one[i]), (i < 2 ? 1e-6 : 5e-4) * one[i]) << "step " << i + 1;
  }
  for (const auto& [name, d] : apart) EXPECT_LT(d, from_fp32.at(name)) << name;
}

}  // namespace
}  // namespace keel
