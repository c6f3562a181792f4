// Context parallelism (parallel.context) over OpenMPI, through the keel binary as a user runs it: C ranks
// sharing every sequence (chunks r and 2C-1-r of 2C, ring attention) train what one rank trains (losses 1e-5
// relative over 20 steps, weights 1e-5), causal and windowed, both families, beside data, tensor and pipeline
// parallelism, ZeRO-1/2/3, recomputation, bf16 and experts (balancing and capacity per whole sequence);
// checkpoints resume on another layout; a rank's activations are 1/C of one rank's; what is not built is
// refused in one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "moe_runs.h"
#include "test_util.h"
#include "toy_runs.h"

namespace keel {
namespace {

using testing::run_keel;

// The llama toy model (4 heads, 2 key/value heads) on the blockwise kernel, one rank or C.
const std::string kLlama =
    "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false "
    "--set model.attention=blockwise ";

class ContextParallel : public testing::ToyRuns {
 protected:
  ContextParallel() : ToyRuns("keel-cp") {}
  // The MoE tests' layouts: `ranks` ranks of per-rank batch `b` into `run`, `extra` after parallel.context=2.
  struct MoeLayout {
    int ranks, b;
    std::string run, extra;
  };
  static constexpr const char* kMoeBlockwise = "--set model.attention=blockwise ";
  static constexpr const char* kExpert2 = "--set parallel.expert=2 ";
  // With expert groups every step's rows crossed between the ranks.
  void expect_rows_exchanged(const MoeLayout& l) {
    if (l.extra != kExpert2) return;
    for (const nlohmann::json& s : testing::step_lines(dir / (l.run + "/metrics.jsonl"))) {
      EXPECT_GT(s.at("expert_alltoall_bytes").get<double>(), 0.0) << l.run << " step " << s.at("step");
    }
  }
};

// C = 2 and C = 4 (oversubscribed) with the whole batch of 32-token sequences (chunks of 8 and 4
// tokens), causal and with a window of 6 keys (C = 4: whole ring steps outside the window).
TEST_F(ContextParallel, ContextRanksTrainWhatOneRankTrains) {
  for (const std::string window : {"0", "6"}) {
    const std::string extra = kLlama + "--set model.attention_window=" + window + " ";
    SCOPED_TRACE("window " + window);
    ASSERT_EQ(train(0, 8, "one" + window, extra).exit_code, 0);
    ASSERT_EQ(losses("one" + window).size(), 20u);
    for (const int context : {2, 4}) {
      const std::string run = "c" + std::to_string(context) + "w" + window;
      auto r = train(context, 8, run, extra + "--set parallel.context=" + std::to_string(context));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("context parallel over " + std::to_string(context) + " ranks (data 1 x context " +
                              std::to_string(context) + ")"),
                std::string::npos)
          << r.output;
      expect_same_training("one" + window, run);
    }
  }
}

// GPT-2: the position table's rows at each chunk's global positions (their gradients summed over
// the context group with the rest).
TEST_F(ContextParallel, Gpt2ContextRanksTrainWhatOneRankTrains) {
  for (const std::string window : {"0", "6"}) {
    const std::string extra = "--set model.attention=blockwise --set model.attention_window=" + window + " ";
    SCOPED_TRACE("window " + window);
    ASSERT_EQ(train(0, 8, "one" + window, extra).exit_code, 0);
    for (const int context : {2, 4}) {
      const std::string run = "c" + std::to_string(context) + "w" + window;
      auto r = train(context, 8, run, extra + "--set parallel.context=" + std::to_string(context));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      expect_same_training("one" + window, run);
    }
  }
}

// Data 2 x context 2: each context group reads half the batch.
TEST_F(ContextParallel, BesideDataParallelism) {
  ASSERT_EQ(train(0, 8, "one", kLlama).exit_code, 0);
  auto r = train(4, 4, "d2c2", kLlama + "--set parallel.context=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("context parallel over 2 ranks (data 2 x context 2)"), std::string::npos) << r.output;
  expect_same_training("one", "d2c2");
}

// ZeRO-1 and ZeRO-2 shard over data x context (a context group's ranks are data-parallel ranks of
// the gradient sync), and gradient accumulation reads each micro-batch's chunks: one rank's training.
TEST_F(ContextParallel, ComposesWithZeroAndAccumulation) {
  ASSERT_EQ(train(0, 8, "one", kLlama).exit_code, 0);
  for (const std::string zero : {"1", "2"}) {
    auto r = train(2, 8, "zero" + zero, kLlama + "--set parallel.context=2 --set parallel.zero=" + zero);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_same_training("one", "zero" + zero);
  }
  ASSERT_EQ(train(0, 4, "one_accum", kLlama + "--set train.grad_accum=2").exit_code, 0);
  auto r = train(2, 4, "accum", kLlama + "--set parallel.context=2 --set train.grad_accum=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_training("one_accum", "accum");
}

// Activation recomputation (selective: attention and the activation function again; full: every
// block's forward again) under C = 2: a recomputed attention runs the ring again, every rank of the
// group in the same order, so each setting trains the same bytes as C = 2 without recomputation
// (every step's loss and the final weights), both families, with two micro-batches a step.
TEST_F(ContextParallel, RecomputationTrainsTheSameBytes) {
  const std::string gpt2 = "--set model.attention=blockwise ";
  for (const auto& [family, model] : {std::pair<std::string, std::string>{"llama", kLlama}, {"gpt2", gpt2}}) {
    const std::string extra = model + "--set train.steps=8 --set train.grad_accum=2 --set parallel.context=2 ";
    const std::string none = family + "none";
    ASSERT_EQ(train(2, 4, none, extra).exit_code, 0);
    ASSERT_EQ(losses(none).size(), 8u);
    for (const std::string setting : {"selective", "full"}) {
      const std::string run = family + setting;
      auto r = train(2, 4, run, extra + "--set train.recompute=" + setting);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_EQ(losses(run), losses(none)) << run;
      EXPECT_TRUE(testing::checkpoint_bytes(dir / (none + "/ckpt")) == testing::checkpoint_bytes(dir / (run + "/ckpt")))
          << run << ": final weights differ";
    }
  }
}

// Context 2 x tensor 2 (4 ranks): each tensor rank holds its heads (llama: and key/value heads)
// and each context rank its two chunks; the ring runs over the context ranks of one tensor shard.
// One rank's training, both families (GPT-2: the position table's rows at the chunks' global
// positions beside the vocabulary-parallel embedding). With sequence parallelism too: the tensor
// ranks split a context rank's B x T / 2 rows (its chunks) between them outside the split products,
// and the ring runs on the gathered rows: it trains what one rank and context 2 x tensor 2 without it
// train (losses within 1e-5 relative over 20 steps, weights within 1e-5).
TEST_F(ContextParallel, BesideTensorParallelism) {
  for (const auto& [family, model] :
       {std::pair<std::string, std::string>{"llama", kLlama}, {"gpt2", "--set model.attention=blockwise "}}) {
    ASSERT_EQ(train(0, 8, family + "one", model).exit_code, 0);
    auto r = train(4, 8, family + "c2t2", model + "--set parallel.context=2 --set parallel.tensor=2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("context parallel over 2 ranks"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("tensor parallel over 2 ranks (data 1 x pipeline 1 x context 2 x tensor 2)"),
              std::string::npos)
        << r.output;
    expect_same_training(family + "one", family + "c2t2");
    r = train(4, 8, family + "c2t2sp",
              model + "--set parallel.context=2 --set parallel.tensor=2 --set parallel.sequence_parallel=true");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("keel: sequence parallel: norms and residual stream as 1/2"), std::string::npos)
        << r.output;
    expect_same_training(family + "one", family + "c2t2sp");
    expect_same_training(family + "c2t2", family + "c2t2sp");
  }
}

// Pipeline 2 x context 2 (4 ranks): each stage's two context ranks share its micro-batches'
// sequences and run the stage's schedule in the same order (a ring per attention layer, in F and
// in B); the final checkpoint is written by every stage's data x context ranks, each its part.
// One rank's training (2 micro-batches of 8 sequences a step), llama under 1F1B and ZB-H1 (B and
// W apart), GPT-2 (its tied wte on both stages) under 1F1B.
TEST_F(ContextParallel, BesidePipelineParallelism) {
  struct Case {
    std::string family, model, schedule;
  };
  for (const Case& c : {Case{"llama", kLlama, "1f1b"}, Case{"llama", kLlama, "zb-h1"},
                        Case{"gpt2", "--set model.attention=blockwise ", "1f1b"}}) {
    const std::string extra = c.model + "--set train.grad_accum=2 ";
    if (!std::filesystem::exists(dir / (c.family + "one"))) {
      ASSERT_EQ(train(0, 8, c.family + "one", extra).exit_code, 0);
    }
    const std::string run = c.family + "p2c2" + c.schedule;
    auto r = train(4, 8, run, extra + "--set parallel.context=2 --set parallel.pipeline=2 --set parallel.schedule=" +
                                  c.schedule);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    // GPT-2's 20 steps through 2 stages x 2 context ranks: every sum in another order (the context
    // group's gradient sums, the stages' micro-batches); since the loader draws a batch's sequences
    // from all over the shard (2026-12-05) its weights end 1.0-2.4e-5 apart (relative, per tensor;
    // biases and MLP weights of block 1) with every loss within 1e-5: within 3e-5.
    expect_same_training(c.family + "one", run, c.family == "gpt2" ? 3e-5 : 1e-5);
  }
}

// bf16 (runtime.precision = "bf16": bf16 products and stashes, the ring's products too) with C = 2
// trains what one rank trains in bf16 to bf16's precision, by the tensor-parallel bf16 test's
// measure: losses within 1e-4 relative over 8 steps, weights within 1e-2 (the ring merges a row's
// key blocks one at a time, rounding each block's probabilities to bf16 against a running maximum,
// and the context group sums gradients in another order; biases within 5e-2). Heads of 8 columns (model.n_head = 8)
// take the kernels' tile form on both sides; heads of 16 columns (model.n_head = 4) take the
// AVX-512 bf16 path where the CPU has it (one rank's blockwise kernel, the ring's vector kernel).
TEST_F(ContextParallel, Bf16TrainsWhatOneRankTrainsToBf16Precision) {
  for (const std::string heads : {"8", "4"}) {
    const std::string bf16 = "--set train.steps=8 --set runtime.precision=bf16 --set model.n_head=" + heads + " ";
    for (const auto& [family, model] :
         {std::pair<std::string, std::string>{"llama", kLlama}, {"gpt2", "--set model.attention=blockwise "}}) {
      SCOPED_TRACE(family + ", " + heads + " heads");
      const std::string one = family + "one" + heads, c2 = family + "c2h" + heads;
      ASSERT_EQ(train(0, 8, one, model + bf16).exit_code, 0);
      auto r = train(2, 8, c2, model + bf16 + "--set parallel.context=2");
      ASSERT_EQ(r.exit_code, 0) << r.output;
      const std::vector<double> want = losses(one), got = losses(c2);
      ASSERT_EQ(want.size(), 8u);
      ASSERT_EQ(got.size(), want.size());
      for (size_t s = 0; s < got.size(); ++s) EXPECT_NEAR(got[s], want[s], 1e-4 * want[s]) << "step " << s + 1;
      for (const auto& [name, d] : testing::weight_distance(dir / (one + "/ckpt"), dir / (c2 + "/ckpt"))) {
        // Biases start at zero: after 8 AdamW steps of ~lr each their norm is small, and Adam's
        // normalised step turns bf16's rounding differences in their small gradients into
        // differences of ~lr (measured: matrices 2-4e-3, biases 3e-3 to 2.2e-2).
        EXPECT_LT(d, name.ends_with(".b") ? 5e-2 : 1e-2) << name;
      }
    }
  }
}

// ZeRO-3 over the data-parallel group, which spans data x context: each of a context group's ranks
// homes a shard of the parameters and gathers each layer under its lease, ring attention runs
// inside the layer's lease. C = 2 alone (the shards split between the context ranks), data 2 x
// context 2, and C = 2 with full recomputation (a recomputed forward leases its layer again):
// one rank's training.
TEST_F(ContextParallel, ComposesWithZero3) {
  ASSERT_EQ(train(0, 8, "one", kLlama).exit_code, 0);
  struct Case {
    int ranks, b;
    std::string run, extra;
  };
  for (const Case& c : {Case{2, 8, "c2z3", ""}, Case{4, 4, "d2c2z3", ""},
                        Case{2, 8, "c2z3full", "--set train.recompute=full"}}) {
    auto r = train(c.ranks, c.b, c.run, kLlama + "--set parallel.context=2 --set parallel.zero=3 " + c.extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("ZeRO-3 over " + std::to_string(c.ranks) + " ranks"), std::string::npos) << r.output;
    expect_same_training("one", c.run);
  }
}

// A mixture of experts (llama-moe-tiny at the toy's size: 2 MoE blocks of 4 experts) with C = 2 and
// DeepSeek's bias balancing (model.moe_aux_weight = 0), dropless: routing is token by token, and
// the experts' counts and the balancing loads are summed over the data group (data x context), so
// every step routes the same tokens with the same biases as one rank, and trains what it trains.
// With expert parallelism as well (parallel.expert = 2, sharded experts): an expert group is
// consecutive ranks of the data group, whose order is replica-major, context rank minor; under C = 2
// a context group's two ranks (each routing the tokens of its chunks of the same sequences) are one
// expert group, and under data 2 x context 2 (4 ranks) so is each replica's context group, each
// expert's gradient summed over the two ranks holding it (one per replica).
TEST_F(ContextParallel, MixtureOfExpertsWithBiasBalancing) {
  const std::string moe = testing::kMoeTiny + kMoeBlockwise + testing::kMoeBias + "--set model.moe_aux_weight=0 ";
  ASSERT_EQ(train(0, 8, "one", moe).exit_code, 0);
  for (const MoeLayout& l : {MoeLayout{2, 8, "c2", ""}, MoeLayout{2, 8, "c2-ep2", kExpert2},
                             MoeLayout{4, 4, "d2c2-ep2", kExpert2}}) {
    auto r = train(l.ranks, l.b, l.run, moe + "--set parallel.context=2 " + l.extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    if (l.ranks == 4) {
      EXPECT_NE(r.output.find("context parallel over 2 ranks (data 2 x context 2)"), std::string::npos) << r.output;
    }
    testing::expect_moe_training_like(dir / "one", dir / l.run);
    expect_rows_exchanged(l);
  }
}

// The Switch/GShard balancing loss (model.moe_aux_weight = 0.01, the default) is taken per whole
// sequence: each MoE block sums a sequence's choice counts (and, for the reported loss, its router
// probabilities) over the context group before the loss and its gradient. C = 2, and data 2 x
// context 2 with expert groups of 2 (4 ranks), train what one rank trains, every step's balancing
// loss per block within 1e-5 and the same tokens per expert.
TEST_F(ContextParallel, MixtureOfExpertsBalancingLossOverTheContextGroup) {
  const std::string moe = testing::kMoeTiny + kMoeBlockwise;
  ASSERT_EQ(train(0, 8, "one", moe).exit_code, 0);
  for (const MoeLayout& l : {MoeLayout{2, 8, "c2", ""}, MoeLayout{4, 4, "d2c2-ep2", kExpert2}}) {
    auto r = train(l.ranks, l.b, l.run, moe + "--set parallel.context=2 " + l.extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    testing::expect_moe_training_like(dir / "one", dir / l.run);
    for (const nlohmann::json& s : testing::step_lines(dir / (l.run + "/metrics.jsonl"))) {
      for (const nlohmann::json& block : s.at("moe_layers")) EXPECT_GT(block.at("aux").get<double>(), 0) << l.run;
    }
  }
}

// A capacity (model.moe_capacity) keeps each expert's first pairs of a whole sequence in position
// order: a context rank's two chunks (r and 2C-1-r) count on from what the sequence's earlier chunks
// kept (the group's per-chunk counts summed, in position order). At a capacity factor of 0.5 (8
// pairs an expert of a sequence's 64: every step drops pairs), C = 2, data 2 x context 2, and data
// 2 x context 2 with expert groups of 2 drop the pairs one rank drops (each block's count, every
// step) and train what it trains (8 steps).
TEST_F(ContextParallel, MixtureOfExpertsCapacityDropsWhatOneRankDrops) {
  const std::string moe = testing::kMoeTiny + kMoeBlockwise + "--set model.moe_capacity=0.5 --set train.steps=8 ";
  ASSERT_EQ(train(0, 8, "one", moe).exit_code, 0);
  const std::vector<nlohmann::json> one = testing::step_lines(dir / "one/metrics.jsonl");
  ASSERT_EQ(one.size(), 8u);
  for (const nlohmann::json& s : one) EXPECT_GT(s.at("moe_dropped").get<double>(), 0.0) << s;
  for (const MoeLayout& l : {MoeLayout{2, 8, "c2", ""}, MoeLayout{4, 4, "d2c2", ""},
                             MoeLayout{4, 4, "d2c2-ep2", kExpert2}}) {
    auto r = train(l.ranks, l.b, l.run, moe + "--set parallel.context=2 " + l.extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    testing::expect_moe_training_like(dir / "one", dir / l.run);
    expect_rows_exchanged(l);
  }
}

// A C = 2 run's checkpoint resumed on one rank and on C = 4, and one rank's on C = 2: the
// uninterrupted one-rank run's weights (the data position is a count of windows of data ranks x
// train.batch_size sequences, the same for every C).
TEST_F(ContextParallel, CheckpointsResumeOnAnotherContextSize) {
  const std::string twelve = kLlama + "--set train.steps=12 ";
  const std::string six = kLlama + "--set train.steps=6 ";
  ASSERT_EQ(train(0, 8, "one", twelve).exit_code, 0);
  ASSERT_EQ(train(0, 8, "one_half", six).exit_code, 0);
  ASSERT_EQ(train(2, 8, "c2_half", six + "--set parallel.context=2").exit_code, 0);
  struct Resume {
    int ranks, context;
    std::string from, run;
  };
  for (const Resume& s : {Resume{0, 1, "c2_half", "on_one"}, Resume{4, 4, "c2_half", "on_c4"},
                          Resume{2, 2, "one_half", "on_c2"}}) {
    auto r = train(s.ranks, 8, s.run,
                   twelve + "--set parallel.context=" + std::to_string(s.context) + " --set train.resume=" +
                       dir / (s.from + "/ckpt"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find("resuming with data windows"), std::string::npos) << r.output;
    for (const auto& [name, d] : testing::weight_distance(dir / "one/ckpt", dir / (s.run + "/ckpt"))) {
      EXPECT_LT(d, 1e-5) << s.run << ": " << name;
    }
  }
  // One process evaluates a context-parallel run's checkpoint (its config's parallel.context is the
  // writer's layout, not the reader's).
  auto e = run_keel("eval --checkpoint " + dir / "c2_half/ckpt" + " --data " + dir / "val.bin" + " --batch 2 --seq 32");
  EXPECT_EQ(e.exit_code, 0) << e.output;
  EXPECT_NE(e.output.find("loss"), std::string::npos) << e.output;
}

// Checkpoints of the combined layouts are the whole model's: a context 2 x tensor 2 run's and a
// pipeline 2 x context 2 run's step-6 checkpoints resumed on one rank, and one rank's resumed on
// each, end at the uninterrupted one-rank run's weights (1e-5; llama, 2 micro-batches a step).
TEST_F(ContextParallel, CombinedLayoutsCheckpointsResumeOnOneRankAndBack) {
  const std::string common = kLlama + "--set train.grad_accum=2 ";
  const std::string t2 = "--set parallel.context=2 --set parallel.tensor=2 ";
  const std::string p2 = "--set parallel.context=2 --set parallel.pipeline=2 --set parallel.schedule=1f1b ";
  const std::string twelve = common + "--set train.steps=12 ", six = common + "--set train.steps=6 ";
  ASSERT_EQ(train(0, 8, "one", twelve).exit_code, 0);
  ASSERT_EQ(train(0, 8, "one_half", six).exit_code, 0);
  ASSERT_EQ(train(4, 8, "t2_half", six + t2).exit_code, 0);
  ASSERT_EQ(train(4, 8, "p2_half", six + p2).exit_code, 0);
  struct Resume {
    int ranks;
    std::string layout, from, run;
  };
  for (const Resume& s : {Resume{0, "", "t2_half", "t2_on_one"}, Resume{0, "", "p2_half", "p2_on_one"},
                          Resume{4, t2, "one_half", "one_on_t2"}, Resume{4, p2, "one_half", "one_on_p2"}}) {
    auto r = train(s.ranks, 8, s.run, twelve + s.layout + "--set train.resume=" + dir / (s.from + "/ckpt"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find("resuming with data windows"), std::string::npos) << r.output;
    for (const auto& [name, d] : testing::weight_distance(dir / "one/ckpt", dir / (s.run + "/ckpt"))) {
      EXPECT_LT(d, 1e-5) << s.run << ": " << name;
    }
  }
}

// The activation bytes each rank reports (the model's activation allocation, "keel: memory per
// rank: ... activations X MB") at 8192-token sequences: C ranks hold about 1/C of one rank's.
TEST_F(ContextParallel, ActivationMemoryPerRankIsAboutOneOverC) {
  // (the validation shard holds 5000 tokens: the training shard stands in for it)
  const std::string longer = kLlama + "--set train.steps=1 --set train.seq_len=8192 --set model.max_seq_len=8192 "
                                      "--set train.eval_batches=1 --set data.val=" + dir / "train.bin ";
  auto activations_mb = [](const std::string& output) {
    const size_t at = output.find(", activations ");
    if (at == std::string::npos) return -1.0;
    return std::stod(output.substr(at + 14));
  };
  auto one = train(0, 1, "one", longer);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const double whole = activations_mb(one.output);
  ASSERT_GT(whole, 0) << one.output;
  for (const int context : {2, 4}) {
    auto r = train(context, 1, "c" + std::to_string(context), longer + "--set parallel.context=" + std::to_string(context));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const double mine = activations_mb(r.output);
    EXPECT_NEAR(mine * context / whole, 1.0, 0.02) << context << ": " << mine << " MB of one rank's " << whole;
  }
}

TEST_F(ContextParallel, WhatIsNotBuiltIsRefusedInOneLine) {
  auto refused = [](const testing::CommandResult& r, const std::string& needle) {
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
  };
  // 32 tokens do not cut into 2 x 3 chunks; 3 ranks do not hold context 2.
  refused(train(3, 8, "x", kLlama + "--set parallel.context=3"),
          "config key 'parallel.context': expected a sequence length (train.seq_len 32) cut into 2 x context equal "
          "chunks, found 3");
  refused(train(3, 8, "x", kLlama + "--set parallel.context=2"),
          "config key 'parallel.context': expected pipeline x context x tensor (2) dividing the 3 rank(s) of this job");
  auto refusal = [](std::vector<std::string> sets, int world) { return testing::config_refusal(sets, world); };
  auto refuses = [&](std::vector<std::string> sets, int world, const std::string& needle) {
    const std::string why = refusal(sets, world);
    EXPECT_NE(why.find(needle), std::string::npos) << why;
  };
  const std::vector<std::string> llama = {"model.preset=tiny", "model.family=llama", "train.seq_len=64",
                                          "parallel.context=2"};
  auto with = [&](const std::string& set) {
    std::vector<std::string> s = llama;
    s.push_back(set);
    return s;
  };
  refuses(with("model.attention=dense"), 2, "config key 'model.attention': expected \"blockwise\" with parallel.context > 1");
  EXPECT_EQ(refusal(with("parallel.tensor=2"), 4), "");
  EXPECT_EQ(refusal(with("parallel.pipeline=2"), 4), "");
  EXPECT_EQ(refusal(with("parallel.zero=3"), 2), "");
  EXPECT_EQ(refusal(with("train.recompute=full"), 2), "");
  EXPECT_EQ(refusal(with("runtime.precision=bf16"), 2), "");
  refuses(with("model.attention_window=dynamic"), 2, "config key 'model.attention_window': expected fixed windows");
  // A mixture of experts, with expert groups and a capacity, is built (tests above).
  std::vector<std::string> moe = {"model.preset=llama-moe-tiny", "train.seq_len=64", "parallel.context=2"};
  EXPECT_EQ(refusal(moe, 2), "");
  moe.push_back("parallel.expert=2");
  EXPECT_EQ(refusal(moe, 2), "");
  moe.push_back("model.moe_capacity=1.25");  // (MixtureOfExpertsCapacityDropsWhatOneRankDrops)
  EXPECT_EQ(refusal(moe, 2), "");
  refuses(with("parallel.context=0"), 1, "parallel.context");
  EXPECT_EQ(refusal(llama, 2), "");
  EXPECT_EQ(refusal(llama, 4), "");  // data 2 x context 2
  // Unset, attention resolves to the blockwise kernel under context parallelism.
  Config c = Config::load("", llama);
  resolve_job_config(c, 2);
  EXPECT_EQ(c.model.attention, Attention::blockwise);
}

}  // namespace
}  // namespace keel
