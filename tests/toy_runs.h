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
  // The loss of every step run `run` logged (its metrics.jsonl), in order.
  std::vector<double> losses(const std::string& run) {
    std::vector<double> out;
    const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
    for (size_t start = 0; start < text.size();) {
      const size_t end = text.find('\n', start);
      auto j = nlohmann::json::parse(text.substr(start, end - start));
      if (j.contains("loss")) out.push_back(j["loss"]);
      start = end + 1;
    }
    return out;
  }
  TempDir dir;
};

}  // namespace keel::testing
