// What the mixture-of-experts tests share: llama-moe-tiny at the toy's size (2 MoE blocks of 4
// experts, top-2, one shared expert; test_util.h's toy corpus and config) trained through the keel
// binary, its step lines read back, and one run's training compared with another's (losses,
// every block's routing figures, final weights).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/fileio.h"
#include "test_util.h"

namespace keel::testing {

// The model at the toy's size (vocabulary 64, 32-token sequences), as --set options.
inline const std::string kMoeTiny =
    " --set model.preset=llama-moe-tiny --set model.vocab_size=64 --set model.max_seq_len=32 ";
// DeepSeek's auxiliary-loss-free balancing at the rate the tests use.
inline const std::string kMoeBias = " --set model.moe_balance=bias --set model.moe_bias_rate=0.01 ";

// The unit tests' models: `blocks` llama-moe-tiny blocks (with the embedding and the head) of
// width 32 with 4 heads, vocabulary 64, 16-token sequences, balanced by `balance`.
inline Config moe_blocks_config(int blocks, MoeBalance balance) {
  Config c;
  c.model.preset = "llama-moe-tiny";
  c.model.n_layer = blocks;
  c.model.n_embd = 32;
  c.model.n_head = 4;
  c.model.vocab_size = 64;
  c.model.max_seq_len = 16;
  c.model.moe_balance = balance;
  c.train.seq_len = 16;
  c.resolve(1);
  return c;
}
// One block with bias balancing (a test sets the biases).
inline Config one_moe_block_config() { return moe_blocks_config(1, MoeBalance::bias); }

// The lines of a metrics.jsonl whose `event` is `event` (every event line with ""), in order.
inline std::vector<nlohmann::json> event_lines(const std::string& metrics_jsonl, const std::string& event = "") {
  std::vector<nlohmann::json> out;
  const std::string text = read_text_file(metrics_jsonl);
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
    if (j.contains("event") && (event.empty() || j.at("event") == event)) out.push_back(std::move(j));
    at = end + 1;
  }
  return out;
}

// The run in directory `run` trained what the run in `reference` trained from step `first` on (its
// step lines are those steps'): every step's loss within 1e-5 relative; per MoE block the same
// layer, balancing loss and router entropy within 1e-5 relative, the same pairs routed to and
// dropped by every expert, and the same routing biases (or none on both); the final weights within
// `weights` (relative L2 per tensor; 1e-5 unless a caller says why not), the routed and shared
// experts' among them.
inline void expect_moe_training_like(const std::string& reference, const std::string& run, size_t first = 0,
                                     double weights = 1e-5) {
  const std::vector<nlohmann::json> want = step_lines(reference + "/metrics.jsonl"),
                                    got = step_lines(run + "/metrics.jsonl");
  ASSERT_EQ(got.size() + first, want.size()) << run;
  for (size_t i = 0; i < got.size(); ++i) {
    const nlohmann::json &w = want[first + i], &g = got[i];
    const std::string step = run + " step " + std::to_string(first + i + 1);
    const double a = w.at("loss"), b = g.at("loss");
    EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(a)) << step;
    ASSERT_EQ(g.at("moe_layers").size(), 2u) << run;
    ASSERT_EQ(w.at("moe_layers").size(), 2u) << reference;
    for (size_t l = 0; l < 2; ++l) {
      const nlohmann::json &wb = w.at("moe_layers")[l], &gb = g.at("moe_layers")[l];
      EXPECT_EQ(gb.at("layer"), wb.at("layer")) << step;
      for (const char* figure : {"aux", "entropy"}) {
        const double x = wb.at(figure), y = gb.at(figure);
        EXPECT_LE(std::abs(x - y), 1e-5 * std::abs(x)) << step << " block " << l << " " << figure;
      }
      for (const char* field : {"tokens", "dropped", "bias"}) {
        EXPECT_EQ(gb.value(field, nlohmann::json()), wb.value(field, nlohmann::json()))
            << step << " block " << l << " " << field;
      }
    }
  }
  const auto distance = weight_distance(reference + "/ckpt", run + "/ckpt");
  EXPECT_TRUE(distance.contains("h.0.moe.expert.3.proj.w") && distance.contains("h.1.moe.shared_mlp.gate_up.w"))
      << run;
  for (const auto& [name, d] : distance) EXPECT_LT(d, weights) << run << ": " << name;
}

// The newest checkpoints of the runs in directories `reference` and `run` hold the same bytes:
// parameters and both moments.
inline void expect_same_checkpoint_bytes(const std::string& reference, const std::string& run) {
  for (Plane p : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(checkpoint_bytes(run + "/ckpt", p), checkpoint_bytes(reference + "/ckpt", p))
        << run << " plane " << static_cast<int>(p);
  }
}

// The run in directory `run` trained `reference`'s bytes: the same checkpoint bytes, every step's
// loss and every block's routing figures.
inline void expect_same_training_bytes(const std::string& reference, const std::string& run) {
  expect_same_checkpoint_bytes(reference, run);
  const std::vector<nlohmann::json> got = step_lines(run + "/metrics.jsonl"),
                                    want = step_lines(reference + "/metrics.jsonl");
  ASSERT_EQ(got.size(), want.size()) << run;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].at("loss").get<double>(), want[i].at("loss").get<double>()) << run << " step " << i + 1;
    EXPECT_EQ(got[i].at("moe_layers"), want[i].at("moe_layers")) << run << " step " << i + 1;
  }
}

// A suite's runs of llama-moe-tiny under one temporary directory, made by the suite's
// SetUpTestSuite (start_suite) and removed after its last test.
class MoeRuns : public ::testing::Test {
 protected:
  // A fresh directory named by `tag` with the toy corpus, a config of `steps` steps and an empty
  // nvme/ for memory tiers' files; `every_run`: --set options of every run of the suite (before
  // each run's own).
  static void start_suite(const std::string& tag, int steps, const std::string& every_run = "") {
    dir_ = new TempDir(tag);
    write_toy_corpus(dir_->path());
    write_toy_config(dir_->path(), steps);
    std::filesystem::create_directories(dir_->path() + "/nvme");
    every_run_ = every_run;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  // The keel arguments that train into run `run` with `ranks` ranks (0: plain `keel train`, no
  // MPI; `launch`: options of `keel launch`): 2 micro-batches of 2 sequences of 32 tokens per step
  // and data-parallel rank, no evaluation; the suite's options, then `extra`, override.
  static std::string train_args(int ranks, const std::string& run, const std::string& extra,
                                const std::string& launch = "") {
    const std::string args = "train --config " + dir_->path() + "/toy.toml" + kMoeTiny +
                             "--set train.batch_size=2 --set train.grad_accum=2 --set train.eval_every=0 " +
                             every_run_ + " --set train.run_dir=" + at(run) + " " + extra;
    return ranks == 0 ? args : "launch -n " + std::to_string(ranks) + " " + launch + "-- " + args;
  }
  static CommandResult train(int ranks, const std::string& run, const std::string& extra) {
    return run_keel(train_args(ranks, run, extra));
  }
  // Memory tiers of 1 MiB of compute and 1 MiB of host DRAM, NVMe (the suite's nvme/) for the
  // rest, every page's bytes verified; then `extra`.
  static std::string one_mib_tiers(const std::string& extra = "") {
    return " --set tier.device_mib=1 --set tier.host_mib=1 --set tier.verify=true --set tier.nvme_dir=" + at("nvme") +
           " " + extra + " ";
  }
  static std::string at(const std::string& run) { return dir_->path() + "/" + run; }
  // The run's step lines, and its `event` lines (every event line with "").
  static std::vector<nlohmann::json> lines(const std::string& run) { return step_lines(at(run) + "/metrics.jsonl"); }
  static std::vector<nlohmann::json> events(const std::string& run, const std::string& event = "") {
    return event_lines(at(run) + "/metrics.jsonl", event);
  }
  // expect_moe_training_like over two of the suite's runs.
  static void expect_like(const std::string& reference, const std::string& run, size_t first = 0,
                          double weights = 1e-5) {
    expect_moe_training_like(at(reference), at(run), first, weights);
  }
  // expect_same_checkpoint_bytes and expect_same_training_bytes over two of the suite's runs.
  static void expect_same_checkpoint(const std::string& reference, const std::string& run) {
    expect_same_checkpoint_bytes(at(reference), at(run));
  }
  static void expect_same_training(const std::string& reference, const std::string& run) {
    expect_same_training_bytes(at(reference), at(run));
  }
  inline static TempDir* dir_ = nullptr;
  inline static std::string every_run_;
};

}  // namespace keel::testing
