// The whole model against an independent reference: loss and every parameter gradient of a tiny
// random GPT-2 computed in float64 by PyTorch (tests/reference/gpt2_reference.py make-fixtures),
// and the B/W split against the fused order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include "ckpt/llmc.h"
#include "data/shard.h"
#include "model/gpt.h"
#include "test_util.h"

namespace keel {
namespace {

struct Expected {
  int B = 0, T = 0;
  double loss = 0;
  std::vector<double> grads;  // llm.c order
};

Expected read_expected(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  int32_t h[256];
  in.read(reinterpret_cast<char*>(h), sizeof h);
  EXPECT_EQ(h[0], 20241130);
  EXPECT_EQ(h[1], 1);
  Expected e;
  e.B = h[2];
  e.T = h[3];
  in.read(reinterpret_cast<char*>(&e.loss), sizeof(double));
  e.grads.resize(h[4]);
  in.read(reinterpret_cast<char*>(e.grads.data()), sizeof(double) * e.grads.size());
  EXPECT_TRUE(in.good());
  return e;
}

class TinyModel : public ::testing::Test {
 protected:
  void SetUp() override {
    expected = read_expected(testing::source_path("tests/fixtures/tiny_expected.bin"));
    ASSERT_EQ(expected.B, tiny.B);
    ASSERT_EQ(expected.T, tiny.T);
  }
  Batch batch(float grad_scale) {
    return Batch{inputs.data(), targets.data(), expected.B, expected.T, grad_scale};
  }
  // Relative error of a tensor: max |a - b| / max |b|.
  std::vector<std::pair<std::string, double>> gradient_errors() {
    std::vector<std::pair<std::string, double>> errors;
    size_t cursor = 0;
    for (const std::string& name : llmc_tensor_order(model_config)) {
      std::span<const float> g = store->view(store->find(name), Plane::grad);
      double max_diff = 0, max_ref = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        max_diff = std::max(max_diff, std::abs(g[i] - expected.grads[cursor + i]));
        max_ref = std::max(max_ref, std::abs(expected.grads[cursor + i]));
      }
      cursor += g.size();
      errors.emplace_back(name, max_ref > 0 ? max_diff / max_ref : max_diff);
    }
    EXPECT_EQ(cursor, expected.grads.size());
    return errors;
  }

  testing::TinyFixture tiny{2, 8};
  ModelConfig& model_config = tiny.config;
  std::unique_ptr<ChunkStore>& store = tiny.store;
  std::unique_ptr<GPT>& model = tiny.model;
  std::vector<int>& inputs = tiny.inputs;
  std::vector<int>& targets = tiny.targets;
  Expected expected;
};

TEST_F(TinyModel, LossMatchesPyTorchFloat64) {
  const float loss = model->forward(batch(0.0f));
  EXPECT_NEAR(loss, expected.loss, 1e-5 * std::abs(expected.loss));
}

TEST_F(TinyModel, EveryGradientMatchesPyTorchFloat64) {
  store->zero_grads();
  const float loss = model->forward(batch(1.0f / (expected.B * expected.T)));
  model->backward(batch(1.0f / (expected.B * expected.T)));
  EXPECT_NEAR(loss, expected.loss, 1e-5 * std::abs(expected.loss));
  for (const auto& [name, err] : gradient_errors()) EXPECT_LT(err, 1e-5) << name;
}

TEST_F(TinyModel, PaddedVocabularyRowsGetNoGradient) {
  store->zero_grads();
  model->forward(batch(1.0f));
  model->backward(batch(1.0f));
  std::span<const float> g = store->view(store->find("wte"), Plane::grad);
  for (int64_t i = static_cast<int64_t>(model_config.vocab_size) * model_config.n_embd; i < static_cast<int64_t>(g.size()); ++i) {
    ASSERT_EQ(g[i], 0.0f);
  }
}

// Deferring every W until all Bs are done (what a zero-bubble pipeline does) gives the same bytes.
TEST_F(TinyModel, DeferredWeightGradientsEqualInterleaved) {
  const float s = 1.0f / (expected.B * expected.T);
  store->zero_grads();
  model->forward(batch(s));
  model->backward(batch(s));
  std::vector<float> interleaved(store->chunk_view(0, Plane::grad).data(),
                                 store->chunk_view(0, Plane::grad).data() + store->numel());

  store->zero_grads();
  model->forward(batch(s));
  model->backward(batch(s), /*defer_weight_grads=*/true);
  std::vector<float> deferred(store->chunk_view(0, Plane::grad).data(),
                              store->chunk_view(0, Plane::grad).data() + store->numel());
  EXPECT_EQ(0, std::memcmp(interleaved.data(), deferred.data(), sizeof(float) * deferred.size()));
}

TEST_F(TinyModel, GradientsAccumulateOverMicroBatches) {
  const float s = 1.0f / (expected.B * expected.T);
  store->zero_grads();
  model->forward(batch(s / 2));
  model->backward(batch(s / 2));
  model->forward(batch(s / 2));
  model->backward(batch(s / 2));
  for (const auto& [name, err] : gradient_errors()) EXPECT_LT(err, 1e-5) << name;
}

}  // namespace
}  // namespace keel
