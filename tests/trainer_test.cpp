// End-to-end properties of the single-process trainer: learning, determinism, exact resume,
// checkpoint validation. Uses a small shard made from the committed fixtures' generator so the
// test needs no corpus.
#include "runtime/trainer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "data/shard.h"
#include "test_util.h"

namespace keel {
namespace {

using testing::write_toy_shards;

Config toy_config(const std::string& dir, int steps) {
  Config c = Config::load("", {"model.preset=tiny", "model.vocab_size=64", "model.n_embd=32", "model.n_head=2",
                               "train.batch_size=4", "train.seq_len=16", "train.grad_accum=2",
                               "train.eval_batches=4", "train.sample_tokens=0", "train.log_every=1000",
                               "optim.warmup_steps=2", "runtime.peak_gflops=100", "optim.lr=1e-2", "store.chunk_bytes=8192"});
  c.train.steps = steps;
  c.train.run_dir = dir + "/run";
  c.data.train = dir + "/train.bin";
  c.data.val = dir + "/val.bin";
  c.data.tokenizer = "";
  c.resolve();
  return c;
}

std::vector<float> params_of(Trainer& t) {
  auto all = t.store().chunk_view(0, Plane::param);
  return std::vector<float>(all.data(), all.data() + t.store().numel());
}

TEST(Trainer, LossFallsOnALearnableStream) {
  testing::TempDir dir;
  write_toy_shards(dir.path());
  Trainer t(toy_config(dir.path(), 40));
  const double before = t.evaluate(4);
  for (int i = 0; i < 40; ++i) t.step();
  const double after = t.evaluate(4);
  EXPECT_LT(after, before - 1.0) << before << " -> " << after;
}

TEST(Trainer, SameSeedSameBytes) {
  testing::TempDir dir;
  write_toy_shards(dir.path());
  std::vector<float> a, b;
  {
    Trainer t(toy_config(dir.path(), 8));
    for (int i = 0; i < 8; ++i) t.step();
    a = params_of(t);
  }
  {
    Trainer t(toy_config(dir.path(), 8));
    for (int i = 0; i < 8; ++i) t.step();
    b = params_of(t);
  }
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

TEST(Trainer, ResumeIsBitIdenticalToAnUninterruptedRun) {
  testing::TempDir dir;
  write_toy_shards(dir.path());
  std::vector<float> straight;
  {
    Trainer t(toy_config(dir.path(), 12));
    for (int i = 0; i < 12; ++i) t.step();
    straight = params_of(t);
  }
  {
    Trainer t(toy_config(dir.path(), 12));
    for (int i = 0; i < 5; ++i) t.step();
    t.save(dir / "ckpt5");
  }
  Config resumed = toy_config(dir.path(), 12);
  resumed.train.resume = dir / "ckpt5";
  Trainer t(resumed);
  EXPECT_EQ(t.steps_done(), 5);
  while (t.steps_done() < 12) t.step();
  std::vector<float> after = params_of(t);
  EXPECT_EQ(0, std::memcmp(straight.data(), after.data(), after.size() * sizeof(float)));
  for (const Chunk& c : t.store().chunks()) EXPECT_EQ(c.version, 12u) << "chunk " << c.id;
}

}  // namespace
}  // namespace keel
