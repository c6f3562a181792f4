// Long context: with blockwise attention the activations a model keeps grow linearly in the
// sequence length (the dense kernel's grow with its square), and a llama model trains on
// sequences far longer than the dense kernel could hold here, blockwise and dense giving the
// same losses where both fit.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/fileio.h"
#include "model/gpt.h"
#include "test_util.h"

namespace keel {
namespace {

int64_t activation_bytes(const std::string& attention, int T) {
  Config c;
  c.model.preset = "llama-tiny";
  c.model.attention = attention;
  c.model.max_seq_len = T;
  c.model.vocab_size = 64;
  c.train.seq_len = T;
  c.resolve(1);
  ChunkStore store(1 << 20);
  GPT model(c.model, store);
  store.finalize();
  model.allocate(1, T);
  return model.activation_bytes();
}

TEST(LongContext, BlockwiseActivationsGrowLinearlyDenseOnesQuadratically) {
  const int64_t b1 = activation_bytes("blockwise", 2048), b2 = activation_bytes("blockwise", 4096),
                b4 = activation_bytes("blockwise", 8192);
  EXPECT_NEAR(static_cast<double>(b2) / b1, 2.0, 0.01);
  EXPECT_NEAR(static_cast<double>(b4) / b2, 2.0, 0.01);
  const int64_t d1 = activation_bytes("dense", 2048), d2 = activation_bytes("dense", 4096);
  EXPECT_GT(static_cast<double>(d2) / d1, 3.0);  // the T x T probabilities dominate
  std::printf("activations of llama-tiny, batch 1: blockwise %.1f / %.1f / %.1f MB at T = 2048 / 4096 / 8192; "
              "dense %.1f / %.1f MB at 2048 / 4096\n",
              b1 / 1e6, b2 / 1e6, b4 / 1e6, d1 / 1e6, d2 / 1e6);
}

class LongContextTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 3);
  }
  std::vector<double> losses(const std::string& run) {
    std::vector<double> out;
    const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
      if (j.contains("loss") && !j.contains("event")) out.push_back(j.at("loss").get<double>());
      at = end + 1;
    }
    return out;
  }
  testing::CommandResult train(const std::string& run, int T, const std::string& extra) {
    return testing::run_keel("train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / run +
                             " --set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=" +
                             std::to_string(T) + " --set train.seq_len=" + std::to_string(T) +
                             " --set train.batch_size=1 --set train.eval_every=0 --set train.eval_batches=1 " + extra);
  }
  testing::TempDir dir{"keel-long"};
};

// 2,048 tokens a sequence: blockwise and dense attention train the same model (within float32
// rounding of their different summation orders).
TEST_F(LongContextTraining, BlockwiseAndDenseTrainTheSameAt2048Tokens) {
  ASSERT_EQ(train("blockwise", 2048, "--set model.attention=blockwise").exit_code, 0);
  ASSERT_EQ(train("dense", 2048, "--set model.attention=dense").exit_code, 0);
  const std::vector<double> a = losses("blockwise"), b = losses("dense");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-4 * b[i]) << "step " << i + 1;
}

// A sliding window of 128 keys at 4,096 tokens: trains, and differs from full attention.
TEST_F(LongContextTraining, ASlidingWindowTrainsAt4096Tokens) {
  const testing::CommandResult r = train("window", 4096, "--set model.attention_window=128");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(train("full", 4096, "").exit_code, 0);
  const std::vector<double> w = losses("window"), f = losses("full");
  ASSERT_EQ(w.size(), 3u);
  for (double l : w) EXPECT_TRUE(std::isfinite(l));
  EXPECT_NE(w.back(), f.back());
  const std::string config = read_text_file(dir / "window/config.toml");
  EXPECT_NE(config.find("attention = 'blockwise'"), std::string::npos) << config;
  const testing::CommandResult bad = train("bad", 256, "--set model.attention=dense --set model.attention_window=64");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("model.attention_window"), std::string::npos) << bad.output;
  const testing::CommandResult range = train("range", 256, "--set model.attention_window=0-5:64");
  EXPECT_EQ(range.exit_code, 2) << range.output;
  EXPECT_NE(range.output.find("outside 0..1"), std::string::npos) << range.output;
}

}  // namespace
}  // namespace keel
