// Sharded experts (parallel.expert > 1 with parallel.zero = 0: a rank holds only its experts'
// weights, gradients and moments; comm/expert_parallel.h) with what they combine with beyond plain
// float32 training, through the keel binary on the toy corpus (llama-moe-tiny at the toy's size):
// bf16 training state (runtime.param_dtype / grad_dtype), compressed gradient sync (sync.codec:
// each expert bucket compressed over the ranks holding its experts, with error feedback of its
// own) and memory checkpoints (checkpoint.memory_every, which also hold bias balancing's routing
// biases). Each trains what the same ranks train without expert parallelism, to the precision's
// bound, and a resumed run gives the uninterrupted run's bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/fileio.h"
#include "test_util.h"

namespace keel {
namespace {

using nlohmann::json;

class ShardedExperts : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir("keel-moe-sharded");
    testing::write_toy_corpus(dir_->path());
    testing::write_toy_config(dir_->path(), kSteps);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static constexpr int kSteps = 8;
  static constexpr const char* kBias = "--set model.moe_balance=bias --set model.moe_bias_rate=0.01 ";
  // 2 micro-batches of one sequence of 32 tokens per step and data-parallel rank.
  static std::string common() {
    return " --set model.preset=llama-moe-tiny --set model.vocab_size=64 --set model.max_seq_len=32"
           " --set train.batch_size=1 --set train.grad_accum=2 --set train.eval_every=0";
  }
  // `keel launch` (with `launch` its own options) training into `run`.
  static std::string job(int ranks, const std::string& run, const std::string& extra, const std::string& launch = "") {
    return "launch -n " + std::to_string(ranks) + " " + launch + "-- train --config " + dir_->path() + "/toy.toml" +
           common() + " --set train.run_dir=" + at(run) + " " + extra;
  }
  static testing::CommandResult train(int ranks, const std::string& run, const std::string& extra) {
    return testing::run_keel(job(ranks, run, extra));
  }
  static std::string at(const std::string& run) { return dir_->path() + "/" + run; }
  static std::vector<json> lines(const std::string& run) {
    return testing::step_lines(at(run) + "/metrics.jsonl");
  }
  // Every step's loss of `run` within `bound` relative of `reference`'s.
  static void expect_losses_near(const std::string& reference, const std::string& run, double bound) {
    const std::vector<json> want = lines(reference), got = lines(run);
    ASSERT_EQ(got.size(), want.size()) << run;
    for (size_t i = 0; i < want.size(); ++i) {
      const double a = want[i].at("loss"), b = got[i].at("loss");
      EXPECT_LE(std::abs(a - b), bound * std::abs(a)) << run << " step " << i + 1 << ": " << a << " vs " << b;
    }
  }
  // `resumed` (from `saving`'s step-4 checkpoint) ends with `whole`'s bytes: parameters and both moments.
  static void expect_same_bytes(const std::string& whole, const std::string& resumed) {
    for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
      EXPECT_EQ(testing::checkpoint_bytes(at(resumed) + "/ckpt", plane), testing::checkpoint_bytes(at(whole) + "/ckpt", plane))
          << resumed << " plane " << static_cast<int>(plane);
    }
  }
  static testing::TempDir* dir_;
};

testing::TempDir* ShardedExperts::dir_ = nullptr;

// bf16 parameters and gradients (float32 masters): P = 2 on 2 ranks trains what the 2 ranks train
// without expert parallelism, to bf16's bound (an expert's gradient is rounded to bf16 once, from
// all of its rows, where the data-parallel run sums two ranks' bf16 gradients: measured 9.1e-5
// relative at worst over the 8 steps, so within 1e-3 here); a run resumed at step 4 gives the
// uninterrupted run's bytes.
TEST_F(ShardedExperts, Bf16TrainingStateTrainsWhatDataParallelTrains) {
  const std::string bf16 = "--set runtime.param_dtype=bf16 --set runtime.grad_dtype=bf16 ";
  ASSERT_EQ(train(2, "bf16-dp2", bf16).exit_code, 0);
  const testing::CommandResult r = train(2, "bf16-ep2", bf16 + "--set parallel.expert=2 --set train.checkpoint_every=4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos) << r.output;
  expect_losses_near("bf16-dp2", "bf16-ep2", 1e-3);
  const testing::CommandResult resumed = train(2, "bf16-ep2-resumed", bf16 + "--set parallel.expert=2 --set train.resume=" +
                                                                          at("bf16-ep2") + "/ckpt/step-00000004");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  expect_same_bytes("bf16-ep2", "bf16-ep2-resumed");
}

// Compressed sync over 4 data ranks in two expert groups of 2: the buckets of no expert are
// compressed over the 4 ranks, each expert bucket over the 2 ranks holding its experts, with its
// own error feedback (compressed from the first step: sync.warmup_steps = 0). With the bf16
// codec: what the 4 ranks train without expert parallelism, to bf16's bound (the experts' sums
// are taken over other ranks in another order: measured 1.6e-6 relative at worst, within 1e-4
// here), at about half the bytes. With top-k sparsification (error feedback carrying what
// was not sent): a run resumed at step 4 gives the uninterrupted run's bytes (the residuals of
// every bucket, expert buckets included, restored).
TEST_F(ShardedExperts, CompressedSyncCompressesEachExpertBucketOverItsHolders) {
  const std::string ep = "--set parallel.expert=2 ", bf16 = "--set sync.warmup_steps=0 --set sync.codec=bf16 ";
  ASSERT_EQ(train(4, "bf16codec-dp4", bf16).exit_code, 0);
  const testing::CommandResult r = train(4, "bf16codec-ep2", ep + bf16);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_losses_near("bf16codec-dp4", "bf16codec-ep2", 1e-4);
  for (const json& s : lines("bf16codec-ep2")) EXPECT_GT(s.at("sync_ratio").get<double>(), 1.5) << s;  // (bf16: ~2)

  const std::string topk = ep + "--set sync.warmup_steps=0 --set sync.codec=topk ";
  const testing::CommandResult saving = train(4, "topk-ep2", topk + "--set train.checkpoint_every=4");
  ASSERT_EQ(saving.exit_code, 0) << saving.output;
  EXPECT_LT(lines("topk-ep2").back().at("loss").get<double>(), lines("topk-ep2").front().at("loss").get<double>());
  const std::string from = at("topk-ep2") + "/ckpt/step-00000004";
  // Each rank saved its expert buckets' residuals, keyed by their first expert and holders: ranks
  // 0 and 2 hold experts 0 and 1 (of each block), ranks 1 and 3 experts 2 and 3.
  const std::string manifest = read_text_file(from + "/manifest.json");
  for (const char* key : {":X0/2", ":X2/2"}) EXPECT_NE(manifest.find(key), std::string::npos) << key;
  const testing::CommandResult resumed = train(4, "topk-ep2-resumed", topk + "--set train.resume=" + from);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(resumed.output.find("residuals dropped"), std::string::npos) << resumed.output;
  expect_same_bytes("topk-ep2", "topk-ep2-resumed");
}

// Memory copies with sharded experts and bias balancing: each rank copies its own store (its
// experts) and the routing biases to /dev/shm every step, and its buddy's; rank 1 SIGKILLed after
// step 6 (at its buddy copy of step 6) is recovered by `keel launch --max-restarts` from both ranks'
// own copies of step 6 (newer than the disk's step 4) to the uninterrupted run's bytes and biases.
TEST_F(ShardedExperts, MemoryCopiesRecoverAKilledRankWithItsExpertsAndBiases) {
  const std::string layout = std::string(kBias) + "--set parallel.expert=2 --set train.checkpoint_every=4 ";
  ASSERT_EQ(train(2, "memory-reference", layout).exit_code, 0);
  const std::string restartable = job(2, "memory-killed", layout, "--max-restarts 1 ");
  const std::string fault =
      "KEEL_FAULT=kill:op=1:path=buddy-r0-step-00000006.bin:rank=1:once=" + at("killed.spent");
  const testing::CommandResult killed = testing::run_command(fault + " " + std::string(KEEL_BINARY) + " " + restartable +
                                                             " --set checkpoint.memory_every=1");
  ASSERT_EQ(killed.exit_code, 0) << killed.output;
  EXPECT_TRUE(std::filesystem::exists(at("killed.spent"))) << killed.output;
  EXPECT_NE(killed.output.find("restart 1 of 1"), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("keel: resumed from memory (step 6) in "), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("2 rank(s) from their own copy, 0 from their buddy's"), std::string::npos)
      << killed.output;
  expect_same_bytes("memory-reference", "memory-killed");
  const json want = lines("memory-reference").back().at("moe_layers"), got = lines("memory-killed").back().at("moe_layers");
  for (size_t l = 0; l < 2; ++l) {
    EXPECT_EQ(got[l].at("bias"), want[l].at("bias")) << l;
    EXPECT_EQ(got[l].at("tokens"), want[l].at("tokens")) << l;
  }
}

}  // namespace
}  // namespace keel
