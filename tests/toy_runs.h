// A fixture for tests that train the toy model (test_util.h: write_toy_corpus, write_toy_config)
// through the keel binary, with or without MPI ranks, into runs under one temporary directory.
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/fileio.h"

#include "test_util.h"

namespace keel::testing {

class ToyRuns : public ::testing::Test {
 protected:
  // `tag` names the temporary directory (TempDir).
  explicit ToyRuns(const std::string& tag) : dir(tag) {}
  void SetUp() override {
    // A learnable stream with a little noise, vocabulary 64; 20 steps.
    write_toy_corpus(dir.path());
    write_toy_config(dir.path(), 20);
  }
  // Trains with `ranks` ranks (0 = plain `keel train`, no MPI) and per-rank batch b into dir/run.
  CommandResult train(int ranks, int b, const std::string& run, const std::string& extra = "") {
    return run_keel(toy_train_args(dir, ranks, b, run, extra));
  }
  // The loss of every step run `run` logged (its metrics.jsonl's step lines), in order.
  std::vector<double> losses(const std::string& run) { return step_losses(dir / (run + "/metrics.jsonl")); }
  // Run `run` trained what run `reference` trained: every step's loss within 1e-5 relative, and
  // every weight of their final checkpoints within `weights` (1e-5 unless a test says why not).
  void expect_same_training(const std::string& reference, const std::string& run, double weights = 1e-5) {
    const std::vector<double> want = losses(reference), got = losses(run);
    ASSERT_EQ(got.size(), want.size()) << run;
    for (size_t s = 0; s < got.size(); ++s) EXPECT_NEAR(got[s], want[s], 1e-5 * want[s]) << run << " step " << s + 1;
    const auto distance = weight_distance(dir / (reference + "/ckpt"), dir / (run + "/ckpt"));
    EXPECT_FALSE(distance.empty());
    for (const auto& [name, d] : distance) EXPECT_LT(d, weights) << run << ": " << name;
  }
  TempDir dir;
};

}  // namespace keel::testing
