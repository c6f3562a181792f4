// A mixture of experts under ZeRO-3 (parallel.zero = 3, comm/sharded_params.h) and in pipelines,
// through the keel binary over OpenMPI: llama-moe-tiny at the toy's size (2 MoE blocks of 4
// experts, top-2, one shared expert), 20 steps of 2 micro-batches of 2 sequences. Two data-parallel
// ranks whose parameters are sharded (every expert's too: a layer's gather brings the block's
// experts with it) train what one rank trains with the whole batch, with the balancing loss and
// with bias balancing, with and without expert parallelism (parallel.expert = 2); so do two
// pipeline stages (one MoE block each: their figures and biases merged over the stages) under
// 1F1B and ZB-H1, and two replicas of two stages with expert groups of 2; checkpoints move
// between these layouts. Pipelines re-cut with MoE blocks (their biases, figures and sharded
// experts moving with them) and predict gradients with them (nothing for an unchosen expert).
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "model/moe.h"
#include "pipeline/gradient_prediction.h"
#include "moe_runs.h"
#include "test_util.h"

namespace keel {
namespace {

using nlohmann::json;

class MoeParallel : public testing::MoeRuns {
 protected:
  static void SetUpTestSuite() {
    start_suite("keel-moe-parallel", kSteps);
    const testing::CommandResult one = train(0, "one", "--set train.checkpoint_every=10");
    ASSERT_EQ(one.exit_code, 0) << one.output;
    const testing::CommandResult bias = train(0, "one-bias", kBias + " --set train.checkpoint_every=10");
    ASSERT_EQ(bias.exit_code, 0) << bias.output;
  }
  static constexpr int kSteps = 20;
  inline static const std::string kBias = testing::kMoeBias;
  // One rank: 2 micro-batches of 2 sequences of 32 tokens per step; more ranks: 1 sequence each
  // (unless `extra` says otherwise).
  static testing::CommandResult train(int ranks, const std::string& run, const std::string& extra) {
    return MoeRuns::train(ranks, run, (ranks > 0 ? "--set train.batch_size=1 " : "") + extra);
  }
  // Each rank held a shard of the parameters between steps (the two tile the plane, experts
  // included), and no more than its shard resident once the step was over (`slack`: the pages
  // its own chunks share with others' at the ends of their runs).
  static void expect_sharded(const std::string& run, int64_t slack = 2 * 4096) {
    for (const json& s : lines(run)) {
      const std::vector<int64_t> shard = s.at("zero3_param_shard_bytes"), resident = s.at("zero3_param_resident_bytes");
      ASSERT_EQ(shard.size(), 2u) << run;
      for (int r = 0; r < 2; ++r) {
        EXPECT_GT(shard[r], 0) << run;
        EXPECT_LT(shard[r], 3 * (shard[0] + shard[1]) / 4) << run;
        EXPECT_LE(resident[r], shard[r] + slack) << run << " rank " << r;
      }
    }
  }
};

// Every chunk sharded over the two ranks (a rank's MoE blocks gather their experts with the layer):
// what one rank trains with the whole batch, with the balancing loss and with bias balancing.
TEST_F(MoeParallel, ZeroThreeOnTwoRanksTrainsWhatOneRankTrains) {
  for (const std::string balance : {"", "-bias"}) {
    const std::string run = "zero3" + balance;
    const testing::CommandResult r = train(2, run, "--set parallel.zero=3 " + (balance.empty() ? "" : std::string(kBias)));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("keel: ZeRO-3 over 2 ranks"), std::string::npos) << r.output;
    expect_like("one" + balance, run);
    expect_sharded(run);
  }
}

// With expert groups of 2 (each rank runs the products of 2 of the 4 experts for both ranks'
// tokens, and holds only those: sharded experts) under ZeRO-3: the same, and every step's rows
// crossed between the ranks. (A rank's own chunks are its half of the chunks of no expert and
// its experts': runs apart, each with a page shared with the other rank's at either end.)
TEST_F(MoeParallel, ZeroThreeWithExpertParallelismTrainsWhatOneRankTrains) {
  for (const std::string balance : {"", "-bias"}) {
    const std::string run = "zero3-ep2" + balance;
    const testing::CommandResult r =
        train(2, run, "--set parallel.zero=3 --set parallel.expert=2 --set train.checkpoint_every=10 " +
                          (balance.empty() ? "" : std::string(kBias)));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_like("one" + balance, run);
    expect_sharded(run, 16 * 4096);
    for (const json& s : lines(run)) EXPECT_GT(s.at("expert_alltoall_bytes").get<double>(), 0.0) << run;
  }
}

// Checkpoints hold the whole model in any of these layouts: a ZeRO-3 run with expert groups of 2
// resumed at step 10 in the same layout gives the uninterrupted run's bytes (weights and moments);
// one rank's checkpoint resumed under ZeRO-3 with expert groups of 2, and that layout's resumed on
// one rank and under ZeRO-0 with sharded experts, go on as the one-rank run.
TEST_F(MoeParallel, CheckpointsResumeAcrossZeroAndExpertLayouts) {
  if (!std::filesystem::exists(at("zero3-ep2") + "/ckpt")) {
    ASSERT_EQ(train(2, "zero3-ep2", "--set parallel.zero=3 --set parallel.expert=2 --set train.checkpoint_every=10")
                  .exit_code,
              0);
  }
  const std::string z3ep2 = "--set parallel.zero=3 --set parallel.expert=2 ";
  const std::string from_z3 = " --set train.resume=" + at("zero3-ep2") + "/ckpt/step-00000010";
  const testing::CommandResult same = train(2, "z3ep2-resumed", z3ep2 + from_z3);
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_NE(same.output.find("resumed from"), std::string::npos) << same.output;
  EXPECT_EQ(testing::checkpoint_bytes(at("z3ep2-resumed") + "/ckpt"), testing::checkpoint_bytes(at("zero3-ep2") + "/ckpt"));
  EXPECT_EQ(testing::checkpoint_bytes(at("z3ep2-resumed") + "/ckpt", Plane::adam_v),
            testing::checkpoint_bytes(at("zero3-ep2") + "/ckpt", Plane::adam_v));
  struct Resume {
    int ranks;
    std::string run, extra;
  };
  for (const Resume& c : {Resume{2, "one-to-z3ep2", z3ep2 + "--set train.resume=" + at("one") + "/ckpt/step-00000010"},
                          Resume{0, "z3ep2-to-one", from_z3},
                          Resume{2, "z3ep2-to-ep2", "--set parallel.expert=2" + from_z3}}) {
    const testing::CommandResult r = train(c.ranks, c.run, c.extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    expect_like("one", c.run, 10);
  }
}

// Two pipeline stages (each holding one MoE block) under 1F1B and under ZB-H1 (W deferred):
// what one rank trains, every block's routing figures (merged over the stages into rank 0's line)
// and biases (each stage moves its block's) as one rank reports them.
TEST_F(MoeParallel, PipelineOfTwoStagesTrainsWhatOneRankTrains) {
  for (const std::string schedule : {"1f1b", "zb-h1"}) {
    for (const std::string balance : {"", "-bias"}) {
      const std::string run = "p2-" + schedule + balance;
      const testing::CommandResult r =
          train(2, run, "--set train.batch_size=2 --set parallel.pipeline=2 --set parallel.schedule=" + schedule +
                            (balance.empty() ? "" : std::string(" ") + kBias));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      expect_like("one" + balance, run);
    }
  }
}

// Two replicas of two stages, each stage's replicas an expert group of 2 (sharded experts, and
// under ZeRO-3): what one rank trains with the whole batch.
TEST_F(MoeParallel, TwoReplicasOfTwoStagesWithExpertGroupsTrainWhatOneRankTrains) {
  const std::string d2p2 = "--set parallel.pipeline=2 --set parallel.expert=2 ";
  for (const std::string run : {"d2p2-ep2", "d2p2-ep2-bias", "d2p2-ep2-zero3"}) {
    const std::string extra = run.ends_with("bias") ? kBias : run.ends_with("zero3") ? "--set parallel.zero=3" : "";
    const testing::CommandResult r = train(4, run, d2p2 + extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_like(run.ends_with("bias") ? "one-bias" : "one", run);
    for (const json& s : lines(run)) EXPECT_GT(s.at("expert_alltoall_bytes").get<double>(), 0.0) << run;
  }
}

// The routing biases a pipeline saves are the whole model's (both stages' blocks): its checkpoint
// resumes on one rank, and one rank's resumes in the pipeline, each going on as the one-rank run.
TEST_F(MoeParallel, PipelineCheckpointsCarryEveryStagesBiases) {
  const std::string p2 = std::string("--set train.batch_size=2 --set parallel.pipeline=2 ") + kBias;
  ASSERT_EQ(train(2, "p2-saving-bias", p2 + " --set train.checkpoint_every=10").exit_code, 0);
  struct Resume {
    int ranks;
    std::string run, extra;
  };
  for (const Resume& c :
       {Resume{0, "p2-to-one-bias", std::string(kBias) + " --set train.resume=" + at("p2-saving-bias") + "/ckpt/step-00000010"},
        Resume{2, "one-to-p2-bias", p2 + " --set train.resume=" + at("one-bias") + "/ckpt/step-00000010"}}) {
    const testing::CommandResult r = train(c.ranks, c.run, c.extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    expect_like("one-bias", c.run, 10);
  }
}

// Expert parallelism keeps room for the dropless worst case (P N k rows per block) as address
// space only: a rank's experts' side holds the rows its experts were sent, to whole pages. One
// micro-batch a step, so a step line's tokens of experts 0 and 1 (rank 0's) are the rows rank 0
// received; its resident bytes are those of the most rows received so far (8 arrays a block:
// inputs, outputs, output gradients, the wire, gate_up, hidden, their gradients; 640 floats a row
// at C = Hm = 64), rounded out to pages, and less than the worst case's.
TEST_F(MoeParallel, ExpertParallelMemoryFollowsTheRowsReceived) {
  const testing::CommandResult r =
      train(2, "ep2-rows", "--set parallel.expert=2 --set train.grad_accum=1 --set train.steps=6");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  constexpr int64_t kRowBytes = 640 * 4, kPage = 4096, kWorstRows = 2 * 32 * 2;  // P N k
  std::vector<int64_t> most(2, 0);
  for (const json& s : lines("ep2-rows")) {
    int64_t want = 0;
    for (size_t l = 0; l < 2; ++l) {
      const std::vector<double> tokens = s.at("moe_layers")[l].at("tokens");
      most[l] = std::max(most[l], static_cast<int64_t>(tokens[0] + tokens[1]));
      want += most[l] * kRowBytes;
    }
    const int64_t resident = s.at("moe_expert_rows_bytes"), reserved = s.at("moe_expert_rows_reserved_bytes");
    EXPECT_GE(reserved, 2 * kWorstRows * kRowBytes);
    EXPECT_GE(resident, want) << s;
    EXPECT_LE(resident, want + 2 * 8 * 2 * kPage) << s;
    EXPECT_LT(resident, reserved) << s;
  }
}

// A pipeline's re-cuts (parallel.repartition_every) move MoE blocks between the stages: from
// "1" (the embedding alone on the first stage, both MoE blocks and the head on the second, whose
// rank is slowed threefold: every measurement calls it unbalanced) the exact partitioner moves for
// any gain every 4 steps, each move taking a MoE block to the other stage with its chunks, its
// routing biases (bias balancing), the step's routing figures not yet in its line and, with
// expert groups of 2, its experts' chunks within their expert rank. A cut changes no arithmetic:
// what one rank trains (losses, each block's figures and biases every step, final weights), and
// the run's routing summary still counts every step. Two stages with either balancing, and two
// replicas of two stages with sharded experts (4 ranks).
TEST_F(MoeParallel, PipelineReCutsMoveTheBlocksAndTrainWhatOneRankTrains) {
  const std::string recut = " --set parallel.pipeline=2 --set parallel.stage_boundaries=1"
                            " --set parallel.repartition_every=4 --set monitor.layer_costs_every=2"
                            " --set parallel.partitioner=dp --set parallel.repartition_threshold=0"
                            " --set runtime.slow_rank=1 --set runtime.slow_factor=3";
  struct Case {
    int ranks;
    std::string run, extra, reference;
  };
  for (const Case& c : {Case{2, "p2-recut", "--set train.batch_size=2", "one"},
                        Case{2, "p2-recut-bias", std::string("--set train.batch_size=2 ") + kBias, "one-bias"},
                        Case{4, "d2p2-ep2-recut-bias", std::string("--set parallel.expert=2 ") + kBias, "one-bias"}}) {
    const testing::CommandResult r = train(c.ranks, c.run, c.extra + recut);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    int moves = 0;
    for (const json& j : events(c.run, "repartition")) {
      if (j.at("moved").get<bool>()) {
        EXPECT_GT(j.at("bytes_sent").get<double>(), 0) << c.run << ": " << j.dump();
        moves++;
      }
    }
    ASSERT_GE(moves, 1) << c.run << ": no re-cut moved a block\n" << r.output;
    expect_like(c.reference, c.run);
    EXPECT_NE(r.output.find("keel: MoE block 1 over 20 steps"), std::string::npos) << r.output;
    if (c.ranks == 4) {  // rank 0's rows crossed in every step its stage held a MoE block (layer 1 on)
      std::string cut = "1";  // during the step (a line's stage_boundaries are those after its re-cut)
      for (const json& s : lines(c.run)) {
        const double bytes = s.at("expert_alltoall_bytes");
        if (std::stoi(cut) >= 2) {
          EXPECT_GT(bytes, 0.0) << c.run << " " << s.dump();
        } else {
          EXPECT_EQ(bytes, 0.0) << c.run << " " << s.dump();
        }
        cut = s.at("stage_boundaries").get<std::string>();
      }
    }
  }
}

// Gradient prediction (parallel.predict_gradients) in a pipeline of MoE blocks: each stage's last
// W runs a step late, its gradient predicted meanwhile, except for the routed experts none of that
// micro-batch's rows chose (their gradient is known to stay as it is: predicted zero). Not the
// one-rank model but close (every loss within 10 %, the first step's within 1e-5, and not the
// same), the same bytes twice; with two replicas of two stages and expert groups of 2 as well
// (each rank's W writes only its own experts), and under ZeRO-2 the bytes of that (each rank
// still holding only its experts). With bias balancing a checkpoint holds the
// prediction's state and the routing biases: resumed at step 10 it goes on with the uninterrupted
// run's losses, biases and final bytes.
TEST_F(MoeParallel, PipelineGradientPredictionTrainsCloseAndResumesExactly) {
  // (four micro-batches of one sequence: a quarter of the last stage's gradient predicted)
  const std::string p2 = "--set train.batch_size=2 --set parallel.pipeline=2 --set parallel.schedule=1f1b "
                         "--set parallel.micro_batches=4 ";
  auto close_to_one = [&](const std::string& reference, const std::string& run) {
    const std::vector<json> want = lines(reference), got = lines(run);
    ASSERT_EQ(got.size(), want.size()) << run;
    EXPECT_NEAR(got[0].at("loss").get<double>(), want[0].at("loss").get<double>(), 1e-5 * want[0].at("loss").get<double>())
        << run;
    bool differs = false;
    for (size_t i = 0; i < want.size(); ++i) {
      const double a = want[i].at("loss"), b = got[i].at("loss");
      EXPECT_NEAR(b, a, 0.1 * a) << run << " step " << i + 1;
      differs = differs || a != b;
    }
    EXPECT_TRUE(differs) << run << ": the prediction changed nothing";
  };
  struct Case {
    int ranks;
    std::string run, extra, reference;
  };
  for (const Case& c : {Case{2, "p2-predict-mean", p2 + "--set parallel.predict_gradients=mean", "one"},
                        Case{2, "p2-predict-mean-again", p2 + "--set parallel.predict_gradients=mean", "one"},
                        Case{2, "p2-predict-lstm", p2 + "--set parallel.predict_gradients=lstm", "one"},
                        Case{4, "d2p2-ep2-predict-momentum",
                             "--set parallel.pipeline=2 --set parallel.expert=2 --set parallel.predict_gradients=momentum",
                             "one"},
                        Case{2, "p2-predict-bias", p2 + "--set parallel.predict_gradients=previous --set train.checkpoint_every=10 " + kBias,
                             "one-bias"}}) {
    const testing::CommandResult r = train(c.ranks, c.run, c.extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    close_to_one(c.reference, c.run);
  }
  EXPECT_EQ(testing::checkpoint_bytes(at("p2-predict-mean") + "/ckpt"), testing::checkpoint_bytes(at("p2-predict-mean-again") + "/ckpt"));
  // ZeRO-2 on the two replicas: each rank still holds only its experts (its store's gradients
  // predicted as without ZeRO), and the two-replica sums (reduce-scattered) give ZeRO-0's bytes.
  const testing::CommandResult zero2 = train(4, "d2p2-ep2-predict-momentum-zero2",
                                             "--set parallel.pipeline=2 --set parallel.expert=2 "
                                             "--set parallel.predict_gradients=momentum --set parallel.zero=2");
  ASSERT_EQ(zero2.exit_code, 0) << zero2.output;
  EXPECT_NE(zero2.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos)
      << zero2.output;
  expect_same_training("d2p2-ep2-predict-momentum", "d2p2-ep2-predict-momentum-zero2");
  const testing::CommandResult resumed =
      train(2, "p2-predict-bias-resumed", p2 + "--set parallel.predict_gradients=previous " + kBias +
                                              " --set train.resume=" + at("p2-predict-bias") + "/ckpt/step-00000010");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  const std::vector<json> whole = lines("p2-predict-bias"), rest = lines("p2-predict-bias-resumed");
  ASSERT_EQ(rest.size() + 10, whole.size());
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(rest[i].at("loss").get<double>(), whole[10 + i].at("loss").get<double>()) << "step " << 11 + i;
    for (size_t l = 0; l < 2; ++l) {
      EXPECT_EQ(rest[i].at("moe_layers")[l].at("bias"), whole[10 + i].at("moe_layers")[l].at("bias")) << "step " << 11 + i;
    }
  }
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(at("p2-predict-bias-resumed") + "/ckpt", plane),
              testing::checkpoint_bytes(at("p2-predict-bias") + "/ckpt", plane))
        << static_cast<int>(plane);
  }
}

// The experts a W writes, at one block: with its routing bias keeping expert 3 of 4 from every
// token, the block's backward pass finds expert 3 unchosen, and gradient prediction over a plane
// in which every expert has a gradient (as when other micro-batches chose it) predicts nothing for
// expert 3's chunks, under the mean and the LSTM predictor, while the unmasked prediction would
// invent one. Asked of another micro-batch than the last backward pass's, or before the recording
// is turned on (the pipeline does that with gradient prediction only), the block refuses.
TEST(MoePrediction, AnExpertNoRowChoseIsPredictedNothing) {
  const Config c = testing::one_moe_block_config();
  const int B = 2, T = 8;
  Rng rng(7);
  std::vector<int> in(B * T), tg(B * T);
  for (int i = 0; i < B * T; ++i) in[i] = static_cast<int>(rng.below(64)), tg[i] = static_cast<int>(rng.below(64));
  ChunkStore store(4096);
  GPT model(c.model, store);
  store.finalize();
  model.init_weights(5);
  MoeFeedForward* moe = model.layer(1).moe();
  ASSERT_NE(moe, nullptr);
  moe->routing_bias()[3] = -1e9f;  // expert 3 is never chosen
  model.allocate(B, T);
  store.zero_grads();
  const Batch batch{in.data(), tg.data(), B, T, 1.0f / (B * T)};
  // Unasked (no gradient prediction turned the recording on), the backward pass records nothing.
  model.forward(batch);
  model.backward(batch);
  EXPECT_NE(testing::error_of([&] { moe->experts_written(in.data()); }).find("their recording is off"), std::string::npos);
  moe->record_experts_written();
  store.zero_grads();
  model.forward(batch);
  model.backward(batch);
  const std::vector<bool> experts = moe->experts_written(in.data());
  EXPECT_EQ(experts, (std::vector<bool>{true, true, true, false}));
  EXPECT_THROW(moe->experts_written(tg.data()), Error);
  const std::vector<bool> written = pipeline::chunks_weights_write(model, store, in.data(), 0);
  ASSERT_EQ(written.size(), store.chunks().size());
  int quiet = 0;
  for (const Chunk& ch : store.chunks()) {
    EXPECT_EQ(written[static_cast<size_t>(ch.id)], ch.expert != 3) << "chunk " << ch.id << " expert " << ch.expert;
    quiet += ch.expert == 3;
  }
  ASSERT_GT(quiet, 0);
  std::span<float> g = store.range_view(Plane::grad, 0, store.numel());
  for (const PredictGradients how : {PredictGradients::mean, PredictGradients::lstm}) {
    for (const bool masked : {true, false}) {
      pipeline::GradientPrediction prediction(how, store);
      std::fill(g.begin(), g.end(), 1.0f);
      prediction.predict(2, masked ? written : std::vector<bool>{});
      bool others_predicted = false;
      for (const Chunk& ch : store.chunks()) {
        for (int64_t i = ch.offset; i < ch.offset + ch.numel; ++i) {
          if (ch.expert == 3 && masked) {
            ASSERT_EQ(g[static_cast<size_t>(i)], 1.0f) << "chunk " << ch.id << " under " << to_string(how);
          } else {
            others_predicted = others_predicted || g[static_cast<size_t>(i)] != 1.0f;
          }
        }
      }
      EXPECT_TRUE(others_predicted) << to_string(how) << (masked ? " masked" : " unmasked");
      prediction.carry(0);  // the prediction's negative stays: none for expert 3
      for (const Chunk& ch : store.chunks()) {
        if (ch.expert != 3 || !masked) continue;
        for (int64_t i = ch.offset; i < ch.offset + ch.numel; ++i) ASSERT_EQ(g[static_cast<size_t>(i)], 0.0f);
      }
    }
  }
  // Unmasked, the mean predictor invents expert 3's gradient: what the mask is for.
  pipeline::GradientPrediction unmasked(PredictGradients::mean, store);
  std::fill(g.begin(), g.end(), 1.0f);
  unmasked.predict(2);
  for (const Chunk& ch : store.chunks()) {
    if (ch.expert == 3) {
      EXPECT_EQ(g[static_cast<size_t>(ch.offset)], 2.0f);
    }
  }
}

// A pipeline takes what a mixture of experts combines with: re-cuts, gradient prediction, memory tiers.
TEST_F(MoeParallel, PipelinesAcceptWhatTheyBuildForAMixtureOfExperts) {
  const std::vector<std::string> p2 = {"model.preset=llama-moe-tiny", "parallel.pipeline=2"};
  auto with = [&](const std::string& set) {
    std::vector<std::string> sets = p2;
    sets.push_back(set);
    return sets;
  };
  EXPECT_EQ(testing::config_refusal(p2, 2), "");
  std::vector<std::string> recut = with("parallel.repartition_every=4");  // (tests of its moves above)
  recut.push_back("monitor.layer_costs_every=2");
  EXPECT_EQ(testing::config_refusal(recut, 2), "");
  std::vector<std::string> predict = with("parallel.predict_gradients=lstm");  // (tests above)
  predict.push_back("parallel.micro_batches=2");
  EXPECT_EQ(testing::config_refusal(predict, 2), "");
  // (memory tiers: tests/moe_tiers_parallel_test.cpp)
  EXPECT_EQ(testing::config_refusal(with("tier.device_mib=1"), 2), "");
}

// Every dimension at once: two replicas of two stages of tensor groups of 2 with expert groups of 2
// (8 ranks), and ZeRO-3 over data 2 x tensor 2 with expert groups of 2. (The pipeline's norm once
// left the sharded experts' squares out of a tensor group's share: 1.9e-5 apart by step 16.)
TEST_F(MoeParallel, TensorGroupsInPipelinesAndUnderZeroThreeTrainWhatOneRankTrains) {
  const testing::CommandResult dpt =
      train(8, "d2p2t2-ep2", "--set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.expert=2");
  ASSERT_EQ(dpt.exit_code, 0) << dpt.output;
  expect_like("one", "d2p2t2-ep2");
  const testing::CommandResult z3 =
      train(4, "d2t2-zero3-ep2", "--set parallel.zero=3 --set parallel.tensor=2 --set parallel.expert=2");
  ASSERT_EQ(z3.exit_code, 0) << z3.output;
  expect_like("one", "d2t2-zero3-ep2");
}

// bf16 training state: every rank computes its MoE blocks with the bf16 working bits, including the
// experts whose float32 masters it keeps (ZeRO-0/2: a rank owns some experts' chunks; ZeRO-3: every
// expert arrives with the layer's gather). So the three layouts train the same bytes, step by step.
// (The block's own leases once widened an owned chunk from its master: the owner then computed with
// float32 values where the other rank used the bits, 2e-4 relative apart after 20 steps.)
TEST_F(MoeParallel, Bf16StateComputesWithTheSameBitsUnderEveryZeroStage) {
  const std::string bf16 = "--set runtime.param_dtype=bf16 --set runtime.grad_dtype=bf16 ";
  for (const std::string zero : {"0", "2", "3"}) {
    const testing::CommandResult r = train(2, "bf16-zero" + zero, bf16 + "--set parallel.zero=" + zero);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  const std::vector<json> three = lines("bf16-zero3");
  ASSERT_EQ(three.size(), static_cast<size_t>(kSteps));
  for (const std::string zero : {"0", "2"}) {
    const std::vector<json> other = lines("bf16-zero" + zero);
    ASSERT_EQ(other.size(), three.size()) << zero;
    for (size_t i = 0; i < three.size(); ++i) {
      EXPECT_EQ(other[i].at("loss").get<double>(), three[i].at("loss").get<double>())
          << "ZeRO-" << zero << " against ZeRO-3, step " << i + 1;
    }
  }
}

}  // namespace
}  // namespace keel
