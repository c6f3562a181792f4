// A mixture of experts (the llama-moe-tiny preset at the toy's size: 2 MoE blocks of 4 experts,
// top-2, one shared expert) trained through the keel binary on the toy corpus: two data-parallel
// ranks with ZeRO-1 train what one rank trains with the whole batch, and route the same tokens;
// a resumed run gives the uninterrupted bytes; train.recompute gives the bytes of keeping every
// activation; the routers' figures reach metrics.jsonl, the alerts and the report. Each also
// with DeepSeek's auxiliary-loss-free balancing (model.moe_balance = "bias"), whose biases are
// checkpointed.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/fileio.h"
#include "moe_runs.h"
#include "test_util.h"

namespace keel {
namespace {

using nlohmann::json;

class MoeTraining : public testing::MoeRuns {
 protected:
  static void SetUpTestSuite() {
    start_suite("keel-moe-train", kSteps);
    // The imbalance alert's threshold at its least (1: any expert busier than the mean), after 2 steps.
    const testing::CommandResult one =
        train(0, "one", "--set monitor.max_moe_imbalance=1 --set monitor.moe_imbalance_after=2");
    ASSERT_EQ(one.exit_code, 0) << one.output;
    const testing::CommandResult bias = train(0, "one-bias", kBias);
    ASSERT_EQ(bias.exit_code, 0) << bias.output;
  }
  static constexpr int kSteps = 8;
  inline static const std::string kBias = testing::kMoeBias;
};

// Every step's line: per MoE block the pairs routed to each expert (all of the step's tokens x 2
// choices), the imbalance they give, the router's entropy; the run learns the toy language.
TEST_F(MoeTraining, OneRankLearnsAndReportsItsRoutingEveryStep) {
  const std::vector<json> steps = lines("one");
  ASSERT_EQ(steps.size(), static_cast<size_t>(kSteps));
  EXPECT_LT(steps.back().at("loss").get<double>(), steps.front().at("loss").get<double>());
  for (const json& s : steps) {
    ASSERT_EQ(s.at("moe_layers").size(), 2u) << s;
    double worst = 0;
    for (const json& b : s.at("moe_layers")) {
      const std::vector<double> tokens = b.at("tokens");
      ASSERT_EQ(tokens.size(), 4u);
      double sum = 0, most = 0;
      for (double t : tokens) sum += t, most = std::max(most, t);
      EXPECT_EQ(sum, 2.0 * 2 * 32 * 2) << "2 micro-batches x 2 sequences x 32 tokens x top-2";
      EXPECT_DOUBLE_EQ(b.at("imbalance").get<double>(), most / (sum / 4));
      EXPECT_EQ(b.at("dropped").get<double>(), 0.0);  // dropless
      EXPECT_GT(b.at("entropy").get<double>(), 0.0);
      EXPECT_LE(b.at("entropy").get<double>(), std::log(4.0) + 1e-9);
      EXPECT_FALSE(b.contains("bias"));
      worst = std::max(worst, b.at("imbalance").get<double>());
    }
    EXPECT_EQ(s.at("moe_imbalance").get<double>(), worst);
    EXPECT_EQ(s.at("moe_dropped").get<double>(), 0.0);
  }
  // The imbalance alert (threshold 1, after 2 steps) fired on step 2.
  bool fired = false;
  for (const json& e : events("one")) {
    if (e.value("event", "") == "alert" && e.value("metric", "") == "moe_imbalance") {
      fired = fired || (e.at("state") == "firing" && e.at("step") == 2 && e.at("rule") == "monitor.max_moe_imbalance");
    }
  }
  EXPECT_TRUE(fired);
  // A capacity drops pairs, counted per block and in all.
  ASSERT_EQ(train(0, "capacity", "--set model.moe_capacity=0.5 --set train.steps=2").exit_code, 0);
  for (const json& s : lines("capacity")) {
    EXPECT_GT(s.at("moe_dropped").get<double>(), 0.0) << s;
    double dropped = 0;
    for (const json& b : s.at("moe_layers")) dropped += b.at("dropped").get<double>();
    EXPECT_EQ(s.at("moe_dropped").get<double>(), dropped);
  }
}

// Two data-parallel ranks with ZeRO-1, each with one sequence of every micro-batch: the same
// sequences a step as one rank, routed the same (the counts are summed over the ranks).
TEST_F(MoeTraining, DataParallelZero1TrainsWhatOneRankTrains) {
  const testing::CommandResult r = train(2, "dp2", "--set train.batch_size=1 --set parallel.zero=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_like("one", "dp2");
}

// With bias balancing the biases move by the loads of both ranks: the same biases, the same routing.
TEST_F(MoeTraining, BiasBalancingOnTwoRanksTrainsWhatOneRankTrains) {
  const testing::CommandResult r =
      train(2, "dp2-bias", "--set train.batch_size=1 --set parallel.zero=1 " + kBias);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_like("one-bias", "dp2-bias");  // (the biases among the figures compared)
  // The biases moved (by +-rate per step against each expert's load), and routed differently from "aux".
  const std::vector<float> last = lines("one-bias").back().at("moe_layers")[0].at("bias");
  double moved = 0;
  for (float b : last) {
    moved += std::abs(b);
    EXPECT_LE(std::abs(b), kSteps * 0.01 + 1e-6);
  }
  EXPECT_GT(moved, 0.0);
}

// Resumed from the checkpoint of step 4: the bytes of the uninterrupted run (weights and moments),
// with the balancing loss and with the biases (which the checkpoint carries).
TEST_F(MoeTraining, AResumedRunGivesTheUninterruptedBytes) {
  for (const std::string balance : {"", "-bias"}) {
    const std::string extra = balance.empty() ? "" : kBias;
    const std::string saving = "saving" + balance, resumed = "resumed" + balance, whole = "one" + balance;
    ASSERT_EQ(train(0, saving, extra + " --set train.checkpoint_every=4").exit_code, 0);
    const testing::CommandResult r =
        train(0, resumed, extra + " --set train.resume=" + at(saving) + "/ckpt/step-00000004");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    EXPECT_EQ(testing::checkpoint_bytes(at(resumed) + "/ckpt"), testing::checkpoint_bytes(at(whole) + "/ckpt"))
        << whole;
    EXPECT_EQ(testing::checkpoint_bytes(at(resumed) + "/ckpt", Plane::adam_v),
              testing::checkpoint_bytes(at(whole) + "/ckpt", Plane::adam_v))
        << whole;
    const json want = lines(whole).back().at("moe_layers"), got = lines(resumed).back().at("moe_layers");
    EXPECT_EQ(got, want) << whole;
  }
  // A run balanced by the loss alone does not continue a biased run's trajectory: refused.
  const testing::CommandResult aux =
      train(0, "aux-from-bias", "--set train.resume=" + at("saving-bias") + "/ckpt/step-00000004");
  EXPECT_NE(aux.exit_code, 0) << aux.output;
  EXPECT_NE(aux.output.find("written by a different run (trajectory hash"), std::string::npos) << aux.output;
  // A checkpoint of one rank resumed on two: each rank takes the biases saved (they are the same
  // on every rank), and the run goes on as the one-rank run does.
  const testing::CommandResult r = train(2, "resumed-bias-dp2",
                                         "--set train.batch_size=1 --set parallel.zero=1 " + kBias +
                                             " --set train.resume=" + at("saving-bias") + "/ckpt/step-00000004");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<json> got = lines("resumed-bias-dp2"), want = lines("one-bias");
  ASSERT_EQ(got.size(), 4u);  // steps 5..8
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].at("moe_layers")[1].at("bias"), want[4 + i].at("moe_layers")[1].at("bias")) << "step " << 5 + i;
    EXPECT_EQ(got[i].at("moe_layers")[0].at("tokens"), want[4 + i].at("moe_layers")[0].at("tokens")) << "step " << 5 + i;
  }
  for (const auto& [name, d] : testing::weight_distance(at("one-bias") + "/ckpt", at("resumed-bias-dp2") + "/ckpt")) {
    EXPECT_LT(d, 1e-5) << name;
  }
}

// Expert parallelism (parallel.expert = 2 on the 2 data-parallel ranks: each runs the products of
// 2 of the 4 experts for both ranks' tokens): what one rank trains with the whole batch, the same
// tokens routed to each expert, with the balancing loss and with bias balancing (the same biases).
// Without ZeRO, and under ZeRO-1 and ZeRO-2 (each expert's state shared out over the ranks holding
// it: here its one rank), each rank holds only its 2 experts: its parameter bytes are the model's
// less the other 2 experts' (2 blocks x gate_up [2 Hm, C] and proj [C, Hm], Hm = C = 64, float32).
TEST_F(MoeTraining, ExpertParallelOnTwoRanksTrainsWhatOneRankTrains) {
  const std::string ep = "--set train.batch_size=1 --set parallel.expert=2 ";
  const double expert_bytes = 2 * 3.0 * 64 * 64 * 4;  // one expert's, over the 2 MoE blocks
  for (const std::string zero : {"0", "1", "2"}) {
    const std::string run = "ep2-zero" + zero;
    const testing::CommandResult r = train(2, run, ep + "--set parallel.zero=" + zero);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_like("one", run);
    // Each rank sent rows to the other: the exchanges' bytes are counted; the run names its layout.
    for (const json& s : lines(run)) {
      EXPECT_GT(s.at("expert_alltoall_bytes").get<double>(), 0.0) << s;
      EXPECT_GE(s.at("expert_wait_ms").get<double>(), 0.0) << s;
      const double held = s.at("param_bytes"), whole = s.at("model_param_bytes");
      EXPECT_EQ(whole - held, 2 * expert_bytes) << run;
    }
    EXPECT_EQ(events(run).front().at("layout").at("expert"), 2) << run;
    EXPECT_NE(r.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos) << r.output;
  }
  const testing::CommandResult r = train(2, "ep2-bias", ep + kBias);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_like("one-bias", "ep2-bias");
}

// With a capacity factor the same pairs are dropped (capacity is per sequence, wherever its
// experts run), counted per block as on one rank.
TEST_F(MoeTraining, ExpertParallelDropsWhatOneRankDropsAtACapacity) {
  const std::string capacity = "--set model.moe_capacity=0.5 --set train.steps=4 ";
  ASSERT_EQ(train(0, "capacity-one", capacity).exit_code, 0);
  const testing::CommandResult r =
      train(2, "capacity-ep2", capacity + "--set train.batch_size=1 --set parallel.expert=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_like("capacity-one", "capacity-ep2");  // (each block's dropped pairs among the figures compared)
  const std::vector<json> one = lines("capacity-one");
  ASSERT_EQ(one.size(), 4u);
  for (const json& s : one) EXPECT_GT(s.at("moe_dropped").get<double>(), 0.0) << s;
}

// Four data-parallel ranks in two expert groups of 2 (oversubscribed): what one rank trains with
// the 4 sequences of every micro-batch.
// Each expert's gradient is summed over the 2 ranks holding it (one per group); under ZeRO-1 its
// moments are shared out over those 2 (comm/zero.h). A checkpoint of the first resumes with expert groups of 4
// (each rank holding 1 expert) and goes on as the one-rank run.
TEST_F(MoeTraining, ExpertParallelInTwoGroupsOfFourDataRanksTrainsWhatOneRankTrains) {
  ASSERT_EQ(train(0, "one-b4", "--set train.batch_size=4 --set train.steps=4").exit_code, 0);
  const std::string four = "--set train.batch_size=1 --set train.steps=4 ";
  for (const std::string zero : {"0", "1"}) {
    const std::string run = "ep2-dp4-zero" + zero;
    const testing::CommandResult r =
        train(4, run, four + "--set parallel.expert=2 --set train.checkpoint_every=2 --set parallel.zero=" + zero);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_like("one-b4", run);
  }
  const testing::CommandResult r = train(4, "ep2-dp4-to-ep4", four + "--set parallel.expert=4 --set train.resume=" +
                                                                   at("ep2-dp4-zero0") + "/ckpt/step-00000002");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  const std::vector<json> got = lines("ep2-dp4-to-ep4"), want = lines("one-b4");
  ASSERT_EQ(got.size(), 2u);  // steps 3, 4
  for (size_t i = 0; i < got.size(); ++i) {
    const double a = want[2 + i].at("loss"), b = got[i].at("loss");
    EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(a)) << "step " << 3 + i;
    EXPECT_EQ(got[i].at("moe_layers")[1].at("tokens"), want[2 + i].at("moe_layers")[1].at("tokens"));
  }
  for (const auto& [name, d] : testing::weight_distance(at("one-b4") + "/ckpt", at("ep2-dp4-to-ep4") + "/ckpt")) {
    EXPECT_LT(d, 1e-5) << name;
  }
}

// Checkpoints hold every expert (the whole model's layout): a run saved with parallel.expert = 2
// resumes without expert parallelism and the other way round, and goes on as the one-rank run.
TEST_F(MoeTraining, ExpertParallelCheckpointsResumeOnAnotherExpertGroupSize) {
  const std::string two = "--set train.batch_size=1 ";
  ASSERT_EQ(train(2, "ep2-saving", two + "--set parallel.expert=2 --set train.checkpoint_every=4").exit_code, 0);
  ASSERT_EQ(train(0, "ep1-saving", "--set train.checkpoint_every=4").exit_code, 0);
  struct Resume {
    std::string run, from, extra;
  };
  for (const Resume& c : {Resume{"ep2-to-1", "ep2-saving", ""}, Resume{"ep1-to-2", "ep1-saving", "--set parallel.expert=2"}}) {
    const testing::CommandResult r =
        train(2, c.run, two + c.extra + " --set train.resume=" + at(c.from) + "/ckpt/step-00000004");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    const std::vector<json> got = lines(c.run), want = lines("one");
    ASSERT_EQ(got.size(), 4u) << c.run;  // steps 5..8
    for (size_t i = 0; i < got.size(); ++i) {
      const double a = want[4 + i].at("loss"), b = got[i].at("loss");
      EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(a)) << c.run << " step " << 5 + i;
      EXPECT_EQ(got[i].at("moe_layers")[0].at("tokens"), want[4 + i].at("moe_layers")[0].at("tokens")) << c.run;
    }
    for (const auto& [name, d] : testing::weight_distance(at("one") + "/ckpt", at(c.run) + "/ckpt")) {
      EXPECT_LT(d, 1e-5) << c.run << ": " << name;
    }
  }
}

// Full recomputation under expert parallelism routes and exchanges again in the backward pass:
// the bytes of keeping every activation, the tokens counted once.
TEST_F(MoeTraining, ExpertParallelRecomputationGivesTheBytesOfKeepingEveryActivation) {
  const std::string ep = "--set train.batch_size=1 --set parallel.expert=2 --set train.steps=4 ";
  ASSERT_EQ(train(2, "ep2-keep", ep).exit_code, 0);
  const testing::CommandResult r = train(2, "ep2-recompute", ep + "--set train.recompute=full");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::checkpoint_bytes(at("ep2-recompute") + "/ckpt"), testing::checkpoint_bytes(at("ep2-keep") + "/ckpt"));
  const std::vector<json> got = lines("ep2-recompute"), want = lines("ep2-keep");
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].at("loss"), want[i].at("loss")) << "step " << i + 1;
    EXPECT_EQ(got[i].at("moe_layers"), want[i].at("moe_layers")) << "step " << i + 1;
  }
}

// In bf16 (products and stashes): what the same two ranks train without expert parallelism. The
// expert's weight gradients sum its rows in another order, and bf16's roundings carry that on:
// measured 6e-6 relative by step 8, so within 1e-4 here; the same tokens routed every step.
TEST_F(MoeTraining, ExpertParallelInBf16TrainsWhatDataParallelTrains) {
  const std::string bf16 = "--set train.batch_size=1 --set runtime.precision=bf16 ";
  ASSERT_EQ(train(2, "bf16-dp2", bf16).exit_code, 0);
  const testing::CommandResult r = train(2, "bf16-ep2", bf16 + "--set parallel.expert=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<json> want = lines("bf16-dp2"), got = lines("bf16-ep2");
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const double a = want[i].at("loss"), b = got[i].at("loss");
    EXPECT_LE(std::abs(a - b), 1e-4 * std::abs(a)) << "step " << i + 1;
    EXPECT_EQ(got[i].at("moe_layers")[0].at("tokens"), want[i].at("moe_layers")[0].at("tokens")) << "step " << i + 1;
    EXPECT_EQ(got[i].at("moe_layers")[1].at("tokens"), want[i].at("moe_layers")[1].at("tokens")) << "step " << i + 1;
  }
}

// Layouts expert parallelism cannot take: one line naming parallel.expert, a non-zero exit.
TEST_F(MoeTraining, ExpertParallelRefusesWhatItCannotSplit) {
  struct Bad {
    int ranks;
    std::string extra, expected;
  };
  for (const Bad& b : {Bad{2, "--set parallel.expert=3", "a divisor of the 4 experts"},
                       Bad{2, "--set model.moe_experts=6 --set parallel.expert=3", "a divisor of the 2 data-parallel"},
                       Bad{0, "--set parallel.expert=0", ">= 1"}}) {
    const testing::CommandResult r = train(b.ranks, "bad", "--set train.batch_size=1 " + b.extra);
    EXPECT_NE(r.exit_code, 0) << b.extra;
    EXPECT_NE(r.output.find("config key 'parallel.expert': expected " + b.expected), std::string::npos) << r.output;
  }
  // A dense model has no experts to deal out.
  const testing::CommandResult dense = testing::run_keel("train --config " + dir_->path() +
                                                         "/toy.toml --set parallel.expert=2 --set train.run_dir=" +
                                                         at("bad-dense"));
  EXPECT_NE(dense.exit_code, 0);
  EXPECT_NE(dense.output.find("'parallel.expert': expected 1 without a mixture of experts"), std::string::npos)
      << dense.output;
}

// Formats without a mixture of experts refuse one in one line, naming it (the checkpoint holds
// each routed expert's tensors, which llama2.c and LlamaForCausalLM have no place for).
TEST_F(MoeTraining, ExportsWithoutExpertsRefuseAMixtureOfExperts) {
  const testing::CommandResult llama2c =
      testing::run_keel("export --checkpoint " + at("one") + "/ckpt --out " + at("one") + "/model.bin");
  EXPECT_NE(llama2c.exit_code, 0);
  EXPECT_NE(llama2c.output.find("llama2.c's format has no mixture of experts; this model has model.moe_experts = 4"),
            std::string::npos) << llama2c.output;
  const testing::CommandResult hf = testing::run_keel("export --checkpoint " + at("one") + "/ckpt --hf " + at("one") + "/hf");
  EXPECT_NE(hf.exit_code, 0);
  EXPECT_NE(hf.output.find("LlamaForCausalLM has no mixture of experts"), std::string::npos) << hf.output;
}

// Selective and full recomputation rebuild the attention (and, full, the whole block) but keep
// the experts' activations: the bytes of keeping everything, the tokens counted once.
TEST_F(MoeTraining, RecomputationGivesTheBytesOfKeepingEveryActivation) {
  for (const std::string mode : {"selective", "full"}) {
    for (const std::string balance : {"", "-bias"}) {
      const std::string run = "recompute-" + mode + balance, whole = "one" + balance;
      const testing::CommandResult r = train(0, run, "--set train.recompute=" + mode + " " + (balance.empty() ? "" : kBias));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_EQ(testing::checkpoint_bytes(at(run) + "/ckpt"), testing::checkpoint_bytes(at(whole) + "/ckpt")) << run;
      const std::vector<json> got = lines(run), want = lines(whole);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(got[i].at("loss"), want[i].at("loss")) << run << " step " << i + 1;
        EXPECT_EQ(got[i].at("moe_layers"), want[i].at("moe_layers")) << run << " step " << i + 1;
      }
    }
  }
}

// `keel report`: the MoE section (imbalance per block with the alert's threshold, the routers'
// entropy, each expert's share of the run's tokens) and the alert.
TEST_F(MoeTraining, TheReportDrawsEachBlocksRouting) {
  const testing::CommandResult r = testing::run_keel("report " + at("one") + " --out " + at("one.html"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string html = read_text_file(at("one.html"));
  for (const char* part : {"<h2>Mixture of experts</h2>", "MoE load imbalance (busiest expert / mean)",
                           "alert above 1", "MoE router entropy (nats)", "Tokens per expert (whole run)",
                           "<td>block 0</td>", "<td>block 1</td>", "expert 3: "}) {
    EXPECT_NE(html.find(part), std::string::npos) << part;
  }
  EXPECT_EQ(html.find("MoE dropped pairs"), std::string::npos);  // dropless: nothing to draw
  EXPECT_EQ(html.find("values or lines of metrics.jsonl"), std::string::npos);  // nothing skipped
  // A dense run's report has no MoE section.
  ASSERT_EQ(testing::run_keel("train --config " + dir_->path() + "/toy.toml --set train.steps=1 --set train.run_dir=" +
                              at("dense"))
                .exit_code,
            0);
  ASSERT_EQ(testing::run_keel("report " + at("dense") + " --out " + at("dense.html")).exit_code, 0);
  EXPECT_EQ(read_text_file(at("dense.html")).find("Mixture of experts"), std::string::npos);
}

}  // namespace
}  // namespace keel
