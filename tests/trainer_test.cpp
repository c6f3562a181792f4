// End-to-end properties of the single-process trainer: learning, determinism, exact resume,
// checkpoint validation. Uses a small shard made from the committed fixtures' generator so the
// test needs no corpus.
#include "runtime/trainer.h"

#include <gtest/gtest.h>

#include <omp.h>

#include <cstring>
#include <thread>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "data/shard.h"
#include "kernels/cpu/float_mode.h"
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

// What each thread of the OpenMP pool (a team of omp_get_max_threads()) finds: its FTZ/DAZ mode
// and a denormal (1e-39 x 2) as it computes it. A std::thread started now inherits the caller's.
struct FloatModes {
  std::vector<int> flushing, denormal_kept;
  bool new_thread_flushing = false;
};
FloatModes float_modes() {
  FloatModes m;
  const int n = omp_get_max_threads();
  m.flushing.assign(n, -1);
  m.denormal_kept.assign(n, -1);
#pragma omp parallel num_threads(n)
  {
    volatile float tiny = 1e-39f;  // below 2^-126: a denormal
    const float twice = tiny * 2.0f;
    m.flushing[omp_get_thread_num()] = flush_denormals_on() ? 1 : 0;
    m.denormal_kept[omp_get_thread_num()] = twice != 0.0f ? 1 : 0;
  }
  std::thread t([&] { m.new_thread_flushing = flush_denormals_on(); });
  t.join();
  return m;
}

TEST(Trainer, FlushesDenormalsOnEveryComputingThreadAndRestoresAfter) {
  testing::TempDir dir;
  write_toy_shards(dir.path());
  set_flush_denormals(false);  // the process's IEEE default, whatever ran before
  for (const bool flush : {true, false}) {
    Config c = toy_config(dir.path(), 2);
    c.runtime.threads = 2;  // a pool of more than the calling thread, on any machine
    c.runtime.flush_denormals = flush;
    {
      Trainer t(c);
      t.step();
      const FloatModes m = float_modes();
      ASSERT_EQ(2u, m.flushing.size());
      for (size_t i = 0; i < m.flushing.size(); ++i) {
        EXPECT_EQ(flush ? 1 : 0, m.flushing[i]) << "pool thread " << i << ", flush_denormals=" << flush;
        EXPECT_EQ(flush ? 0 : 1, m.denormal_kept[i]) << "pool thread " << i << ", flush_denormals=" << flush;
      }
      EXPECT_EQ(flush, m.new_thread_flushing);
    }
    const FloatModes after = float_modes();  // the trainer gave the process its mode back
    for (size_t i = 0; i < after.flushing.size(); ++i) EXPECT_EQ(0, after.flushing[i]) << "thread " << i;
  }
}

TEST(Trainer, SameSeedSameBytesWithoutFlushingDenormals) {
  testing::TempDir dir;
  write_toy_shards(dir.path());
  std::vector<float> a, b;
  for (std::vector<float>* out : {&a, &b}) {
    Config c = toy_config(dir.path(), 8);
    c.runtime.flush_denormals = false;
    Trainer t(c);
    for (int i = 0; i < 8; ++i) t.step();
    *out = params_of(t);
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
