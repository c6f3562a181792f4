// The optimizer against an independent reference: three full training steps (forward, backward,
// global-norm clipping, AdamW with the warm-up/cosine schedule) of the tiny random GPT-2, computed
// in float64 by PyTorch (tests/reference/gpt2_reference.py make-train-fixture, whose AdamW is
// itself checked against torch.optim.AdamW); plus the schedule, the decay mask and the gradient
// norm on their own.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <set>

#include "ckpt/llmc.h"
#include "data/shard.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "test_util.h"

namespace keel {
namespace {

// tests/fixtures/tiny_train_expected.bin: 256 int32 (magic, version, steps K, params P), then
// float64: 9 hyperparameters, K losses, K grad norms (before clipping), P final parameters in
// llm.c order.
struct TrainExpected {
  OptimConfig optim;
  int total_steps = 0;
  std::vector<double> losses, grad_norms, params;
};

TrainExpected read_train_expected(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  int32_t h[256];
  in.read(reinterpret_cast<char*>(h), sizeof h);
  EXPECT_EQ(h[0], 20241201);
  EXPECT_EQ(h[1], 1);
  double hp[9];
  in.read(reinterpret_cast<char*>(hp), sizeof hp);
  TrainExpected e;
  e.optim.lr = hp[0];
  e.optim.warmup_steps = static_cast<int>(hp[1]);
  e.total_steps = static_cast<int>(hp[2]);
  e.optim.min_lr_ratio = hp[3];
  e.optim.beta1 = hp[4];
  e.optim.beta2 = hp[5];
  e.optim.eps = hp[6];
  e.optim.weight_decay = hp[7];
  e.optim.grad_clip = hp[8];
  e.losses.resize(h[2]);
  e.grad_norms.resize(h[2]);
  e.params.resize(h[3]);
  in.read(reinterpret_cast<char*>(e.losses.data()), sizeof(double) * e.losses.size());
  in.read(reinterpret_cast<char*>(e.grad_norms.data()), sizeof(double) * e.grad_norms.size());
  in.read(reinterpret_cast<char*>(e.params.data()), sizeof(double) * e.params.size());
  EXPECT_TRUE(in.good());
  EXPECT_EQ(in.peek(), std::ifstream::traits_type::eof()) << path << ": trailing bytes";
  return e;
}

class TinyTraining : public ::testing::Test {
 protected:
  static constexpr int B = 2, T = 8;  // the batch tiny_train_expected.bin was made with

  Batch batch() { return Batch{inputs.data(), targets.data(), B, T, 1.0f / (B * T)}; }
  // Zeroed gradients, then one forward and backward of the batch; returns the loss.
  float gradients() {
    store->zero_grads();
    const float loss = model->forward(batch());
    model->backward(batch());
    return loss;
  }
  // Every element of one plane, in store order (alignment padding included).
  std::vector<float> plane(Plane p) const {
    const float* data = store->chunk_view(0, p).data() - store->chunks()[0].offset;
    return std::vector<float>(data, data + store->numel());
  }

  testing::TinyFixture tiny{B, T};
  ModelConfig& model_config = tiny.config;
  std::unique_ptr<ChunkStore>& store = tiny.store;
  std::unique_ptr<GPT>& model = tiny.model;
  std::vector<int>& inputs = tiny.inputs;
  std::vector<int>& targets = tiny.targets;
};

class OptimAgainstPyTorch : public TinyTraining {};

// Trainer::step, one micro-batch per step, on the same batch every step.
TEST_F(OptimAgainstPyTorch, ThreeTrainingStepsMatch) {
  const TrainExpected e = read_train_expected(testing::source_path("tests/fixtures/tiny_train_expected.bin"));
  const int K = static_cast<int>(e.losses.size());
  ASSERT_EQ(K, 3);
  ASSERT_EQ(static_cast<int64_t>(e.params.size()), store->param_count());
  keel::AdamW optimizer(e.optim);
  int clipped_steps = 0;
  for (int s = 0; s < K; ++s) {
    const float loss = gradients();
    const double norm = std::sqrt(grad_sum_squares(*store));
    float clip = 1.0f;
    if (e.optim.grad_clip > 0 && norm > e.optim.grad_clip) clip = static_cast<float>(e.optim.grad_clip / norm);
    clipped_steps += clip != 1.0f;
    optimizer.step(*store, learning_rate(e.optim, s, e.total_steps), s + 1, clip);
    EXPECT_NEAR(loss, e.losses[s], 1e-5 * std::abs(e.losses[s])) << "step " << s + 1;
    EXPECT_NEAR(norm, e.grad_norms[s], 1e-5 * e.grad_norms[s]) << "step " << s + 1;
  }
  // The fixture exercises both branches of clipping.
  EXPECT_GT(clipped_steps, 0);
  EXPECT_LT(clipped_steps, K);

  // Per tensor: max |keel - ref| / max |ref|.
  const std::string key_bias = "attn.qkv.b";
  const int64_t C = model_config.n_embd;
  size_t cursor = 0;
  for (const std::string& name : llmc_tensor_order(model_config)) {
    std::span<const float> p = store->view(store->find(name), Plane::param);
    double max_diff = 0, max_ref = 0, max_key_diff = 0;
    const bool is_qkv_bias = name.size() > key_bias.size() && name.ends_with(key_bias);
    for (size_t i = 0; i < p.size(); ++i) {
      const double ref = e.params[cursor + i], diff = std::abs(p[i] - ref);
      max_ref = std::max(max_ref, std::abs(ref));
      // The key third of qkv.b has a gradient that is exactly zero in exact arithmetic (softmax
      // ignores a shift shared by all keys); both sides compute rounding noise there, which Adam
      // divides by itself plus eps, so it is bounded separately below.
      const bool is_key = is_qkv_bias && static_cast<int64_t>(i) >= C && static_cast<int64_t>(i) < 2 * C;
      (is_key ? max_key_diff : max_diff) = std::max(is_key ? max_key_diff : max_diff, diff);
    }
    cursor += p.size();
    EXPECT_LT(max_diff / max_ref, 1e-5) << name;
    if (is_qkv_bias) {
      double lr_sum = 0;
      for (int s = 0; s < K; ++s) lr_sum += learning_rate(e.optim, s, e.total_steps);
      EXPECT_LT(max_key_diff, lr_sum) << name << " (key part)";
    }
  }
  EXPECT_EQ(cursor, e.params.size());

  for (const Chunk& c : store->chunks()) EXPECT_EQ(c.version, static_cast<uint64_t>(K)) << "chunk " << c.id;
  // Padded vocabulary rows: zero weight, zero gradient, so zero after any number of steps.
  std::span<const float> wte = store->view(store->find("wte"), Plane::param);
  for (size_t i = static_cast<size_t>(model_config.vocab_size) * C; i < wte.size(); ++i) ASSERT_EQ(wte[i], 0.0f);
}

TEST(LearningRate, WarmupThenCosine) {
  OptimConfig o;
  o.lr = 6e-4;
  o.warmup_steps = 10;
  o.min_lr_ratio = 0.1;
  const int total = 100;
  const double min_lr = o.lr * o.min_lr_ratio;
  auto cosine = [&](int step) {
    return min_lr + 0.5 * (o.lr - min_lr) * (1.0 + std::cos(M_PI * (step - 10) / 90.0));
  };
  EXPECT_DOUBLE_EQ(learning_rate(o, 0, total), o.lr / 10);
  EXPECT_DOUBLE_EQ(learning_rate(o, 4, total), o.lr * 5 / 10);
  EXPECT_DOUBLE_EQ(learning_rate(o, 9, total), o.lr);
  EXPECT_DOUBLE_EQ(learning_rate(o, 10, total), o.lr);
  EXPECT_DOUBLE_EQ(learning_rate(o, 40, total), cosine(40));
  EXPECT_DOUBLE_EQ(learning_rate(o, 55, total), (o.lr + min_lr) / 2);
  EXPECT_DOUBLE_EQ(learning_rate(o, 77, total), cosine(77));
  EXPECT_DOUBLE_EQ(learning_rate(o, total, total), min_lr);
  EXPECT_DOUBLE_EQ(learning_rate(o, total + 50, total), min_lr);  // held at the floor past the end
  for (int s = 1; s < o.warmup_steps; ++s) EXPECT_GT(learning_rate(o, s, total), learning_rate(o, s - 1, total)) << s;
  for (int s = o.warmup_steps + 1; s <= total; ++s) {
    EXPECT_LT(learning_rate(o, s, total), learning_rate(o, s - 1, total)) << s;
  }
}

// The suite is named after the optimizer it tests; inside keel's anonymous namespace this
// fixture hides keel::AdamW, so the optimizer is named with its namespace below.
class AdamW : public TinyTraining {};

// With zero gradients an AdamW step is pure decoupled weight decay: p -= lr * wd * p on
// embeddings and matrices, nothing on biases and LayerNorm parameters.
TEST_F(AdamW, NoDecayOnBiasesAndNorms) {
  const std::set<std::string> decayed_suffixes = {"attn.qkv.w", "attn.proj.w", "mlp.fc.w", "mlp.proj.w"};
  auto expect_decay = [&](const std::string& name) {
    if (name == "wte" || name == "wpe") return true;
    for (const std::string& s : decayed_suffixes) {
      if (name.ends_with("." + s)) return true;
    }
    return false;
  };
  OptimConfig o;
  o.weight_decay = 0.1;
  const double lr = 0.01;
  const std::vector<float> before = plane(Plane::param);
  store->zero_grads();
  keel::AdamW(o).step(*store, lr, 1, 1.0f);

  int decayed = 0, kept = 0;
  for (const TensorInfo& t : store->tensors()) {
    const bool decay = expect_decay(t.spec.name);
    EXPECT_EQ(t.spec.decay, decay) << t.spec.name;
    std::span<const float> p = store->view(store->find(t.spec.name), Plane::param);
    for (int64_t i = 0; i < t.numel; ++i) {
      const float old = before[t.offset + i];
      if (decay) {
        const double want = old - lr * o.weight_decay * old;
        ASSERT_NEAR(p[i], want, 2 * std::numeric_limits<float>::epsilon() * std::abs(want)) << t.spec.name << " " << i;
      } else {
        ASSERT_EQ(p[i], old) << t.spec.name << " " << i;
      }
    }
    (decay ? decayed : kept)++;
  }
  EXPECT_EQ(decayed, 2 + 4 * model_config.n_layer);
  EXPECT_EQ(kept, 8 * model_config.n_layer + 2);
  // Zero gradients leave the moments at zero.
  for (float m : plane(Plane::adam_m)) ASSERT_EQ(m, 0.0f);
  for (float v : plane(Plane::adam_v)) ASSERT_EQ(v, 0.0f);
}

class GradNorm : public TinyTraining {};

// The sum of squares is summed in an order fixed by the data's length (blocks, lanes), so its bits
// are the same every run and whatever the thread count; and it is the double-precision sum.
TEST_F(GradNorm, SameBitsEveryRunAndAnyThreadCountAndExactSum) {
  gradients();
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(2);
  const double first = grad_sum_squares(*store);
  const double second = grad_sum_squares(*store);
  omp_set_num_threads(threads_before);
  EXPECT_EQ(0, std::memcmp(&first, &second, sizeof(double)));

  long double reference = 0;
  for (float g : plane(Plane::grad)) reference += static_cast<long double>(g) * g;
  EXPECT_GT(reference, 0);
  EXPECT_NEAR(first, static_cast<double>(reference), 1e-12 * static_cast<double>(reference));
}

// sum_squares on lengths around its block and lane sizes: one thread and three give the same bits
// (the partials of one thread per range, as before, differ in their last bits here), and each is
// the exact sum to double precision.
TEST(SumSquares, SameBitsForOneThreadAndThreeAndNearTheExactSum) {
  const int threads_before = omp_get_max_threads();
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{17}, int64_t{4095}, int64_t{4097},
                          int64_t{3 * 4096 + 5}, int64_t{100003}}) {
    std::vector<float> v(static_cast<size_t>(n));
    uint32_t x = 12345;
    for (float& f : v) {
      x = x * 1664525u + 1013904223u;
      f = (static_cast<float>(x >> 8) / 16777216.0f - 0.5f) * (1.0f + static_cast<float>(x & 7) * 100.0f);
    }
    omp_set_num_threads(1);
    const double one = sum_squares(v);
    omp_set_num_threads(3);
    const double three = sum_squares(v);
    omp_set_num_threads(threads_before);
    EXPECT_EQ(0, std::memcmp(&one, &three, sizeof(double))) << n;
    long double reference = 0;
    for (float f : v) reference += static_cast<long double>(f) * f;
    EXPECT_NEAR(one, static_cast<double>(reference), 1e-13 * static_cast<double>(reference)) << n;
  }
}

}  // namespace
}  // namespace keel
