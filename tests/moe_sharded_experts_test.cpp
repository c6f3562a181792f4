// Sharded experts (parallel.expert > 1 with parallel.zero = 0: a rank holds only its experts'
// weights, gradients and moments; under ZeRO-1/2/3 the same layout, each expert's state (ZeRO-3:
// and parameters) shared out over the ranks holding it; comm/expert_parallel.h) with what they combine with beyond plain
// float32 training, through the keel binary on the toy corpus (llama-moe-tiny at the toy's size):
// ZeRO-1, ZeRO-2 and ZeRO-3 (what one rank trains with the whole batch; the experts' share of a rank's
// parameters, gradients and moments in the step lines; checkpoints resumed in other layouts; ZeRO-1/2/3
// with tensor groups, ZeRO-1/2/3 in a pipeline, also of tensor groups, ZeRO-1/2 through a pipeline's
// re-cut, also of tensor groups),
// bf16 training state (runtime.param_dtype / grad_dtype; under ZeRO-1/2/3 a rank's float32 masters
// are its owned chunks', on one stage or in a pipeline), compressed gradient sync (sync.codec:
// each expert bucket compressed over the ranks holding its experts, with error feedback of its
// own) and memory checkpoints (checkpoint.memory_every, which also hold bias balancing's routing
// biases; also with tensor groups). Each trains what the same ranks train without expert parallelism, to the precision's
// bound, and a resumed run gives the uninterrupted run's bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/fileio.h"
#include "moe_runs.h"
#include "test_util.h"

namespace keel {
namespace {

using nlohmann::json;

// 2 micro-batches of one sequence of 32 tokens per step and data-parallel rank.
class ShardedExperts : public testing::MoeRuns {
 protected:
  static void SetUpTestSuite() { start_suite("keel-moe-sharded", kSteps, "--set train.batch_size=1"); }
  static constexpr int kSteps = 8;
  // Step line `s` of a 4-rank run of 2 stages x 2 replicas (ranks 0 and 2 stage 0's, 1 and 3
  // stage 1's): a stage's replicas hold as much of the experts as each other, half of the stage's;
  // the ranks together hold every expert once, every chunk of no expert twice and every
  // parameter's moments once.
  static void expect_two_stages_share_out_experts(const json& s, const std::string& run) {
    const int64_t model = s.at("model_param_bytes"), experts = s.at("model_expert_param_bytes");
    const std::vector<int64_t> param = s.at("held_param_bytes"), expert_param = s.at("held_expert_param_bytes");
    const std::vector<int64_t> moment = s.at("held_moment_bytes"), expert_moment = s.at("held_expert_moment_bytes");
    ASSERT_EQ(param.size(), 4u) << run;
    EXPECT_GT(expert_param[0], 0) << run;
    EXPECT_GT(expert_param[1], 0) << run;
    EXPECT_EQ(expert_param[0], expert_param[2]) << run;
    EXPECT_EQ(expert_param[1], expert_param[3]) << run;
    EXPECT_EQ(2 * (expert_param[0] + expert_param[1]), experts) << run;
    EXPECT_EQ(param[0] + param[1] + param[2] + param[3], 2 * model - experts) << run;
    EXPECT_EQ(moment[0] + moment[1] + moment[2] + moment[3], 2 * model) << run;
    EXPECT_EQ(expert_moment[0] + expert_moment[1] + expert_moment[2] + expert_moment[3], 2 * experts) << run;
  }
  // Step line `s` of `run`: data 2 x tensor 2 with expert groups of 2 on one stage or each of
  // `stages` (world rank = (data rank x stages + stage) x 2 + tensor rank). Each rank holds its
  // tensor shard (half the units) of its expert group's 2 experts of its stage, the only holder of
  // that shard (it owns the shard's whole state), as much as the stage's other ranks; the ranks
  // together hold every expert's every shard once and own every tensor shard's moments once.
  static void expect_tensor_ranks_share_out_experts(const json& s, const std::string& run, int stages = 1) {
    const int64_t experts = s.at("model_expert_param_bytes");
    const std::vector<int64_t> param = s.at("held_param_bytes"), expert_param = s.at("held_expert_param_bytes");
    const std::vector<int64_t> expert_grad = s.at("held_expert_grad_bytes");
    const std::vector<int64_t> moment = s.at("held_moment_bytes"), expert_moment = s.at("held_expert_moment_bytes");
    ASSERT_EQ(param.size(), static_cast<size_t>(4 * stages)) << run;
    int64_t held = 0, others = 0, moments = 0;
    for (int r = 0; r < 4 * stages; ++r) {
      const int first = r / 2 % stages * 2;  // (its stage's data rank 0, tensor rank 0)
      EXPECT_EQ(expert_param[r], expert_param[first]) << run << " rank " << r;
      EXPECT_EQ(param[r], param[first]) << run << " rank " << r;
      EXPECT_EQ(expert_grad[r], expert_param[r]) << run << " rank " << r;
      EXPECT_EQ(expert_moment[r], 2 * expert_param[r]) << run << " rank " << r;
      held += expert_param[r];
      others += param[r] - expert_param[r];
      moments += moment[r];
    }
    EXPECT_EQ(held, experts) << run;
    // (A tensor rank's chunks of no expert are held by both data ranks, their moments owned once.)
    EXPECT_EQ(moments, 2 * (others / 2 + experts)) << run;
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
  // Every step line of `run` (expert groups of 2 under ZeRO-1/2 on `ranks` data ranks) shows each
  // rank holding half of the experts' parameters and gradients (and every parameter of no
  // expert), the moments of each parameter owned by one rank (each expert's by one of its
  // holders), about a 1/ranks share each, and no more of the moment planes resident than owned.
  static void expect_experts_shared_out(const std::string& run, int ranks) {
    const std::vector<json> steps = lines(run);
    ASSERT_FALSE(steps.empty()) << run;
    for (const json& s : steps) {
      const int64_t model = s.at("model_param_bytes"), experts = s.at("model_expert_param_bytes");
      EXPECT_GT(experts, 0) << run;
      const std::vector<int64_t> param = s.at("held_param_bytes"), expert_param = s.at("held_expert_param_bytes");
      const std::vector<int64_t> grad = s.at("held_grad_bytes"), expert_grad = s.at("held_expert_grad_bytes");
      const std::vector<int64_t> moment = s.at("held_moment_bytes"), expert_moment = s.at("held_expert_moment_bytes");
      const std::vector<int64_t> resident = s.at("moment_resident_bytes");
      ASSERT_EQ(param.size(), static_cast<size_t>(ranks)) << run;
      int64_t moments = 0, expert_moments = 0;
      for (int r = 0; r < ranks; ++r) {
        EXPECT_EQ(2 * expert_param[r], experts) << run << " rank " << r;
        EXPECT_EQ(2 * expert_grad[r], experts) << run << " rank " << r;
        EXPECT_EQ(param[r], model - experts / 2) << run << " rank " << r;
        EXPECT_EQ(grad[r], param[r]) << run << " rank " << r;
        EXPECT_LT(moment[r], 2 * model * 3 / (2 * ranks)) << run << " rank " << r;  // (within 1.5x of 1/ranks)
        EXPECT_GT(moment[r], 2 * model / (2 * ranks)) << run << " rank " << r;
        EXPECT_LE(resident[r], moment[r] + kMomentRunSlackBytes) << run << " rank " << r;
        moments += moment[r];
        expert_moments += expert_moment[r];
      }
      EXPECT_EQ(moments, 2 * model) << run;
      EXPECT_EQ(expert_moments, 2 * experts) << run;
    }
  }
  // Pages shared by owned chunks and their unowned neighbours (a partial page at each end of a run
  // of owned chunks, in both planes): measured up to 29 KiB here. Were every page of a rank's
  // moment span resident (the whole store on 2 ranks), it would be 0.26 MB more.
  static constexpr int64_t kMomentRunSlackBytes = 16 * 4096;
  // A resumed run: on `ranks` ranks into `run`, with `extra`.
  struct Resume {
    int ranks;
    std::string run, extra;
  };
  // `saving`'s step-4 checkpoint (a run on `ranks` ranks in `layout`, 2 data ranks) resumed in the
  // same layout gives the uninterrupted run's bytes, and in each of `elsewhere` goes on as one rank
  // with the whole batch trained ("one-b2", from step 4 on: float32 state).
  static void expect_resumes(const std::string& saving, const std::string& layout, const std::vector<Resume>& elsewhere,
                             int ranks = 2) {
    const std::string from = " --set train.resume=" + at(saving) + "/ckpt/step-00000004";
    const testing::CommandResult same = train(ranks, saving + "-resumed", layout + from);
    ASSERT_EQ(same.exit_code, 0) << same.output;
    EXPECT_NE(same.output.find("resumed from"), std::string::npos) << same.output;
    expect_same_checkpoint(saving, saving + "-resumed");
    for (const Resume& c : elsewhere) {
      const testing::CommandResult r = train(c.ranks, c.run, c.extra + from + " --set train.checkpoint_every=4");
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
      expect_like("one-b2", c.run, 4);
    }
  }
  // The alignment gaps (chunks start on 4 KiB boundaries) after a rank's owned chunks, which its
  // float32 masters (bf16 state: between consecutive owned chunks) and its moments' extents (both
  // planes: after each owned chunk) hold beside its tensors' bytes: measured up to 10.5 KiB of
  // masters and 28.5 KiB of moments here. Were they the span of its owned chunks (as before), rank
  // 0's would be 0.12 MB (masters, 2 ranks; 0.06 MB on 4) and 0.21 MB (ZeRO-3 moments, 2 ranks) more.
  static constexpr int64_t kMasterGapSlackBytes = 4 * 4096;
  // Rank 0's float32 masters in every step line of `run` (bf16 state): its owned chunks'
  // (held_moment_bytes: both moments of their tensors), and the alignment gaps between consecutive
  // owned chunks (under 4 KiB each).
  static void expect_masters_of_owned_chunks(const std::string& run) {
    for (const json& s : lines(run)) {
      const double masters = s.at("bf16_master_bytes").get<double>();
      const double owned = s.at("held_moment_bytes")[0].get<double>() / 2;
      EXPECT_GE(masters, owned) << run;
      EXPECT_LE(masters, owned + kMasterGapSlackBytes) << run;
    }
  }
  // `saving`'s step-2 checkpoint (a run on `ranks` ranks in `layout`) resumed in the same layout
  // gives the uninterrupted run's bytes, and resumed on one rank with `one_rank` (train.steps = 2)
  // is saved there with the same bytes.
  static void expect_step_two_resumes(int ranks, const std::string& saving, const std::string& layout,
                                      const std::string& one_rank) {
    const std::string from = at(saving) + "/ckpt/step-00000002";
    const testing::CommandResult same = train(ranks, saving + "-resumed", layout + "--set train.resume=" + from);
    ASSERT_EQ(same.exit_code, 0) << same.output;
    EXPECT_NE(same.output.find("resumed from"), std::string::npos) << same.output;
    expect_same_checkpoint(saving, saving + "-resumed");
    expect_saved_again_on_one_rank(from, saving + "-to-one", one_rank);
  }
  // Rank 0's bf16 parameter bits resident between steps under ZeRO-3 (bf16 state), in every step
  // line of `run`: its shard's (2 bytes an element), within a page at each end of each run of own chunks.
  static void expect_bits_of_shard(const std::string& run) {
    for (const json& s : lines(run)) {
      const int64_t shard = s.at("zero3_param_shard_bytes")[0];
      EXPECT_LE(s.at("bf16_param_resident_bytes").get<int64_t>(), shard / 2 + kMomentRunSlackBytes) << run;
    }
  }
  // The checkpoint `from` resumed on one rank into `run` with `extra` (train.steps its step:
  // nothing trained) is saved there with the same bytes: parameters and both moments.
  static void expect_saved_again_on_one_rank(const std::string& from, const std::string& run,
                                             const std::string& extra) {
    const testing::CommandResult one = train(1, run, extra + " --set train.resume=" + from);
    ASSERT_EQ(one.exit_code, 0) << one.output;
    EXPECT_NE(one.output.find("resumed from"), std::string::npos) << one.output;
    for (Plane p : {Plane::param, Plane::adam_m, Plane::adam_v}) {
      EXPECT_EQ(read_checkpoint_plane(testing::newest_checkpoint(at(run) + "/ckpt"), p), read_checkpoint_plane(from, p))
          << run << " plane " << static_cast<int>(p);
    }
  }
  // A 4-rank run into `run` with expert groups of 2 under ZeRO-3 over 2 data ranks (each the only
  // holder of its experts) and `dimension` (the --set of the other dimension of 2): it trains what
  // one rank trains with the whole batch ("one-b2", trained here if not yet), its start-up lines
  // name the experts a rank holds and how ZeRO-3 shards them (`where`: what follows "the chunks of
  // no expert over all 2"), and in every step line rank 0's data group (world ranks 0 and 2) homes
  // a parameter shard smaller than what the rank holds, no more of it resident than the shard once
  // the step is over, and the moments of its owned chunks (their extents, not their span), and
  // `held` accepts the line. Its checkpoint at step 4 resumed in the same layout gives the
  // uninterrupted run's bytes, on one rank (P = 1, ZeRO-0) it goes on as the one-rank run.
  static void expect_zero3_over_two_data_ranks(const std::string& run, const std::string& dimension,
                                               const std::string& where,
                                               const std::function<void(const json&, const std::string&)>& held) {
    const std::string layout =
        dimension + " --set parallel.expert=2 --set parallel.zero=3 --set train.checkpoint_every=4 ";
    std::string output;
    ASSERT_NO_FATAL_FAILURE(expect_trains_like_one(4, run, layout, &output));
    EXPECT_NE(output.find("ZeRO-3 shards each expert's parameters and state over the ranks holding it"),
              std::string::npos) << output;
    EXPECT_NE(output.find("MB of routed experts (1/2: its expert group's share), sharded over the 1 rank(s) "
                          "holding the same experts; the chunks of no expert over all 2" + where + "\n"),
              std::string::npos) << output;
    for (const json& s : lines(run)) {
      const std::vector<int64_t> param = s.at("held_param_bytes"), owned = s.at("held_moment_bytes");
      const std::vector<int64_t> shard = s.at("zero3_param_shard_bytes"), resident = s.at("zero3_param_resident_bytes");
      const std::vector<int64_t> moments = s.at("zero3_moment_bytes");
      ASSERT_EQ(shard.size(), 2u) << run;
      for (int q = 0; q < 2; ++q) {
        EXPECT_GT(shard[q], 0) << run << " data rank " << q;
        EXPECT_LT(shard[q], param[2 * q]) << run << " data rank " << q;
        EXPECT_LE(resident[q], shard[q] + kMomentRunSlackBytes) << run << " data rank " << q;
        EXPECT_GE(moments[q], owned[2 * q]) << run << " data rank " << q;
        EXPECT_LE(moments[q], owned[2 * q] + 2 * kMasterGapSlackBytes) << run << " data rank " << q;
      }
      held(s, run);
    }
    expect_resumes(run, layout, {Resume{1, run + "-to-one", "--set train.batch_size=2"}}, 4);
  }
  // `layout` on `ranks` ranks into `run` with memory copies every step (checkpoint.memory_every =
  // 1): rank 1 SIGKILLed after step 6 (KEEL_FAULT, at its buddy copy of rank 0's step 6; once: the
  // marker file `run`.spent, whose absence fails the test), restarted by `keel launch
  // --max-restarts 1`. Returns the job's result.
  static testing::CommandResult kill_rank_one_after_step_six(int ranks, const std::string& run, const std::string& layout) {
    const std::string restartable = train_args(ranks, run, layout, "--max-restarts 1 ");
    const std::string fault = "KEEL_FAULT=kill:op=1:path=buddy-r0-step-00000006.bin:rank=1:once=" + at(run + ".spent");
    const testing::CommandResult killed = testing::run_command(fault + " " + std::string(KEEL_BINARY) + " " +
                                                               restartable + " --set checkpoint.memory_every=1");
    EXPECT_TRUE(std::filesystem::exists(at(run + ".spent"))) << killed.output;
    return killed;
  }
  // Two stages with expert groups of 2 cut at "1" (the embedding alone on the first stage, both
  // MoE blocks on the second), re-cut at step 4 by the exact partitioner on measured layer costs
  // with world rank `slow_rank` (one of the second stage's) slowed threefold: every measurement
  // calls it unbalanced.
  static std::string recut_options(int slow_rank) {
    return "--set parallel.pipeline=2 --set parallel.expert=2 --set parallel.stage_boundaries=1"
           " --set parallel.repartition_every=4 --set monitor.layer_costs_every=2"
           " --set parallel.partitioner=dp --set parallel.repartition_threshold=0"
           " --set runtime.slow_factor=3 --set runtime.slow_rank=" + std::to_string(slow_rank) + " ";
  }
  // `run`, on `ranks` ranks in `layout` (expert groups of 2: each rank runs and holds 2 of every
  // MoE block's 4 experts), trains what one rank trains with the whole batch ("one-b2", trained
  // here if not yet); `output`: the run's output, where wanted.
  static void expect_trains_like_one(int ranks, const std::string& run, const std::string& layout,
                                     std::string* output = nullptr) {
    if (!std::filesystem::exists(at("one-b2") + "/ckpt")) {
      ASSERT_EQ(train(1, "one-b2", "--set train.checkpoint_every=4 --set train.batch_size=2").exit_code, 0);
    }
    const testing::CommandResult r = train(ranks, run, layout);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos) << r.output;
    expect_like("one-b2", run);
    if (output != nullptr) *output = r.output;
  }
  // `run`, on `ranks` ranks in `layout` (recut_options' under ZeRO-1/2), trains what one rank
  // trains with the whole batch, ZeRO sharing each expert's state out over its holders, and a
  // re-cut moved a block (sending bytes); `last`: its last step line, after the move.
  static void expect_recut_trains_like_one(int ranks, const std::string& run, const std::string& layout, json* last) {
    std::string output;
    ASSERT_NO_FATAL_FAILURE(expect_trains_like_one(ranks, run, layout, &output));
    EXPECT_NE(output.find("ZeRO shares each expert's state out over the ranks holding it"), std::string::npos)
        << output;
    int moves = 0;
    for (const json& j : events(run, "repartition")) {
      if (j.at("moved").get<bool>()) {
        EXPECT_GT(j.at("bytes_sent").get<double>(), 0) << run << ": " << j.dump();
        moves++;
      }
    }
    ASSERT_GE(moves, 1) << run << ": no re-cut moved a block\n" << output;
    *last = lines(run).back();
    ASSERT_NE(last->at("stage_boundaries").get<std::string>(), "1") << run;
  }
};

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
  expect_same_checkpoint("bf16-ep2", "bf16-ep2-resumed");
}

// bf16 training state under ZeRO-1 and ZeRO-2 with expert groups of 2: a rank holds only its
// experts (held_expert_* half of the model's) and keeps float32 masters of the chunks it owns only
// (comm/zero.h experts apart: not one range, store/bf16_state.h), and trains what ZeRO-0 with the
// same experts held trains. On 2 data ranks (each rank its experts' only holder; the chunks of no
// expert summed over 2 ranks, one bf16 addition per element whatever the collective) and under
// ZeRO-1 on 4 (the same all-reductions in the same buckets as ZeRO-0's) the same bytes; ZeRO-2 on
// 4 (the 4 ranks' bf16 sums reduce-scattered, in another order) and ZeRO-0 on 4 within 1e-3 of one
// rank's losses with the whole batch, the bound of tests/bf16_state_test.cpp's N ranks. ZeRO-1's
// step-4 checkpoint (float32 masters, each chunk written by its owner) resumed in its own layout
// ends with the uninterrupted run's bytes, and resumed on one rank without expert parallelism is
// saved there with the same bytes.
TEST_F(ShardedExperts, Bf16StateUnderZeroOneAndTwoHoldsOnlyEachRanksExperts) {
  const std::string bf16 = "--set runtime.param_dtype=bf16 --set runtime.grad_dtype=bf16 ";
  const std::string ep = bf16 + "--set parallel.expert=2 --set train.checkpoint_every=4 ";
  ASSERT_EQ(train(1, "bf16-one-b4", bf16 + "--set train.batch_size=4").exit_code, 0);
  for (const int ranks : {2, 4}) {
    const std::string zero0 = "bf16-zero0-d" + std::to_string(ranks);
    ASSERT_EQ(train(ranks, zero0, ep).exit_code, 0);
    if (ranks == 4) expect_losses_near("bf16-one-b4", zero0, 1e-3);
    for (const std::string zero : {"1", "2"}) {
      const std::string run = "bf16-zero" + zero + "-d" + std::to_string(ranks);
      const testing::CommandResult r = train(ranks, run, ep + "--set parallel.zero=" + zero);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("ZeRO shares each expert's state out over the ranks holding it"), std::string::npos)
          << r.output;
      expect_experts_shared_out(run, ranks);
      if (ranks == 2 || zero == "1") {
        expect_same_checkpoint(zero0, run);
        const std::vector<json> got = lines(run), want = lines(zero0);
        ASSERT_EQ(got.size(), want.size()) << run;
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_EQ(got[i].at("loss").get<double>(), want[i].at("loss").get<double>()) << run << " step " << i + 1;
        }
      } else {
        expect_losses_near("bf16-one-b4", run, 1e-3);
      }
      expect_masters_of_owned_chunks(run);
    }
  }
  expect_resumes("bf16-zero1-d2", ep + "--set parallel.zero=1 ", {});
  expect_saved_again_on_one_rank(at("bf16-zero1-d2") + "/ckpt/step-00000004", "bf16-zero1-to-one",
                                 bf16 + "--set train.batch_size=2 --set train.steps=4");
}

// bf16 training state under ZeRO-3 with expert groups of 2, 4 steps: a rank homes its share of the
// chunks of no expert and of its experts' chunks (each expert's bf16 bits gathered with the layer
// over its holders), keeps float32 masters of its own chunks only and, between steps, the bits of
// its shard only (bf16_param_resident_bytes, mincore: within a page at each end of each run of
// own chunks). On 2 data ranks (each rank its experts' only holder) it trains the bytes of ZeRO-0
// with the same experts held, on 4 (each expert's bits gathered over its 2 holders) ZeRO-2's (the
// same reduce-scatters in bf16, the same owners' bits). The 2-rank run's step-2 checkpoint resumed
// in its own layout gives the uninterrupted run's bytes, and on one rank is saved with the same bytes.
TEST_F(ShardedExperts, Bf16StateUnderZeroThreeHoldsOnlyEachRanksExperts) {
  const std::string bf16 = "--set runtime.param_dtype=bf16 --set runtime.grad_dtype=bf16 ";
  const std::string ep = bf16 + "--set parallel.expert=2 --set train.steps=4 --set train.checkpoint_every=2 ";
  for (const int ranks : {2, 4}) {
    const std::string d = "-d" + std::to_string(ranks) + "-4steps";
    const std::string reference = (ranks == 2 ? "bf16-zero0" : "bf16-zero2") + d;
    ASSERT_EQ(train(ranks, reference, ep + "--set parallel.zero=" + (ranks == 2 ? "0" : "2")).exit_code, 0);
    const std::string run = "bf16-zero3" + d;
    const testing::CommandResult r = train(ranks, run, ep + "--set parallel.zero=3");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("ZeRO-3 shards each expert's parameters and state over the ranks holding it"),
              std::string::npos) << r.output;
    expect_same_training(reference, run);
    expect_experts_shared_out(run, ranks);
    expect_masters_of_owned_chunks(run);
    expect_bits_of_shard(run);
  }
  expect_step_two_resumes(2, "bf16-zero3-d2-4steps", ep + "--set parallel.zero=3 ",
                          bf16 + "--set train.batch_size=2 --set train.steps=2");
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
  expect_same_checkpoint("topk-ep2", "topk-ep2-resumed");
}

// Memory copies with sharded experts and bias balancing: each rank copies its own store (its
// experts) and the routing biases to /dev/shm every step, and its buddy's; rank 1 SIGKILLed after
// step 6 (at its buddy copy of step 6) is recovered by `keel launch --max-restarts` from both ranks'
// own copies of step 6 (newer than the disk's step 4) to the uninterrupted run's bytes and biases.
TEST_F(ShardedExperts, MemoryCopiesRecoverAKilledRankWithItsExpertsAndBiases) {
  const std::string layout = testing::kMoeBias + "--set parallel.expert=2 --set train.checkpoint_every=4 ";
  ASSERT_EQ(train(2, "memory-reference", layout).exit_code, 0);
  const testing::CommandResult killed = kill_rank_one_after_step_six(2, "memory-killed", layout);
  ASSERT_EQ(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.output.find("restart 1 of 1"), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("keel: resumed from memory (step 6) in "), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("2 rank(s) from their own copy, 0 from their buddy's"), std::string::npos)
      << killed.output;
  expect_same_checkpoint("memory-reference", "memory-killed");
  const json want = lines("memory-reference").back().at("moe_layers"), got = lines("memory-killed").back().at("moe_layers");
  for (size_t l = 0; l < 2; ++l) {
    EXPECT_EQ(got[l].at("bias"), want[l].at("bias")) << l;
    EXPECT_EQ(got[l].at("tokens"), want[l].at("tokens")) << l;
  }
}

// Memory copies with sharded experts under ZeRO-1 (each rank owning its experts' moments and half
// of the rest's) and bias balancing: rank 1 SIGKILLed after step 6 (at its buddy copy of step 6)
// is recovered by `keel launch --max-restarts` from both ranks' own copies of step 6 to the
// uninterrupted run's bytes (parameters and both moments) and biases.
TEST_F(ShardedExperts, MemoryCopiesUnderZeroOneRecoverAKilledRank) {
  const std::string layout = testing::kMoeBias + "--set parallel.expert=2 --set parallel.zero=1 --set train.checkpoint_every=4 ";
  const testing::CommandResult reference = train(2, "z1-memory-reference", layout);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  EXPECT_NE(reference.output.find("ZeRO shares each expert's state out over the ranks holding it"), std::string::npos)
      << reference.output;
  const testing::CommandResult killed = kill_rank_one_after_step_six(2, "z1-memory-killed", layout);
  ASSERT_EQ(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.output.find("ZeRO shares each expert's state out over the ranks holding it"), std::string::npos)
      << killed.output;
  EXPECT_NE(killed.output.find("keel: resumed from memory (step 6) in "), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("2 rank(s) from their own copy, 0 from their buddy's"), std::string::npos)
      << killed.output;
  expect_same_checkpoint("z1-memory-reference", "z1-memory-killed");
  const json want = lines("z1-memory-reference").back().at("moe_layers"), got = lines("z1-memory-killed").back().at("moe_layers");
  for (size_t l = 0; l < 2; ++l) EXPECT_EQ(got[l].at("bias"), want[l].at("bias")) << l;
}

// Expert groups of 2 under ZeRO-1 and ZeRO-2, on 2 data ranks (each rank the only holder of its
// experts: it owns their whole state) and on 4 (each expert held by 2 ranks, its moments and
// reduced gradients shared out over them): what one rank trains with the whole batch, and each
// rank holds half of the experts' parameters and gradients (the step lines).
TEST_F(ShardedExperts, ZeroOneAndTwoShareEachExpertOutOverItsHolders) {
  for (const int ranks : {2, 4}) {
    const std::string one = "one-b" + std::to_string(ranks);
    const testing::CommandResult whole =
        train(1, one, "--set train.checkpoint_every=4 --set train.batch_size=" + std::to_string(ranks));
    ASSERT_EQ(whole.exit_code, 0) << whole.output;
    for (const std::string zero : {"1", "2"}) {
      const std::string run = "zero" + zero + "-ep2-d" + std::to_string(ranks);
      const testing::CommandResult r =
          train(ranks, run, "--set parallel.expert=2 --set train.checkpoint_every=4 --set parallel.zero=" + zero);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos) << r.output;
      expect_like(one, run);
      expect_experts_shared_out(run, ranks);
    }
  }
}

// Expert groups of 2 under ZeRO-3 on 2 data ranks (each rank the only holder of its experts: it
// homes their parameters and state whole) and on 4 (each expert's chunks sharded over its 2
// holders, gathered with the layer over them): what one rank trains with the whole batch; each
// rank's layout holds half of the experts (the step lines and the start-up line), its parameter
// home no more resident than its shard once a step is over, and its moments shared out as under
// ZeRO-1/2 (zero3_moment_bytes: its owned chunks', not their span's). The 2-rank run's checkpoint resumed at step 4 in the same layout gives the
// uninterrupted run's bytes; on one rank (P = 1, ZeRO-0) and on 2 ranks under ZeRO-0 without
// expert parallelism it goes on as the one-rank run.
TEST_F(ShardedExperts, ZeroThreeHoldsOnlyEachRanksExperts) {
  const std::string z3ep2 = "--set parallel.expert=2 --set parallel.zero=3 --set train.checkpoint_every=4 ";
  for (const int ranks : {2, 4}) {
    const std::string one = "one-b" + std::to_string(ranks);
    if (!std::filesystem::exists(at(one) + "/ckpt")) {
      ASSERT_EQ(train(1, one, "--set train.checkpoint_every=4 --set train.batch_size=" + std::to_string(ranks)).exit_code, 0);
    }
    const std::string run = "zero3-ep2-d" + std::to_string(ranks);
    const testing::CommandResult r = train(ranks, run, z3ep2);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("ZeRO-3 shards each expert's parameters and state over the ranks holding it"),
              std::string::npos) << r.output;
    EXPECT_NE(r.output.find("routed experts (1/2: its expert group's share), sharded over the " +
                            std::to_string(ranks / 2) + " rank(s) holding the same experts"),
              std::string::npos) << r.output;
    expect_like(one, run);
    expect_experts_shared_out(run, ranks);
    for (const json& s : lines(run)) {
      const std::vector<int64_t> shard = s.at("zero3_param_shard_bytes"), resident = s.at("zero3_param_resident_bytes");
      const std::vector<int64_t> expert_param = s.at("held_expert_param_bytes");
      const std::vector<int64_t> moments = s.at("zero3_moment_bytes"), owned = s.at("held_moment_bytes");
      ASSERT_EQ(shard.size(), static_cast<size_t>(ranks)) << run;
      for (int r = 0; r < ranks; ++r) {
        EXPECT_GT(shard[r], 0) << run << " rank " << r;
        // (A page at each end of each run of own chunks is shared with another rank's chunk.)
        EXPECT_LE(resident[r], shard[r] + kMomentRunSlackBytes) << run << " rank " << r;
        EXPECT_EQ(2 * expert_param[r], s.at("model_expert_param_bytes").get<int64_t>()) << run << " rank " << r;
        // The moments a rank owns (its chunks' extents, to the next chunk: both planes), not their span.
        EXPECT_GE(moments[r], owned[r]) << run << " rank " << r;
        EXPECT_LE(moments[r], owned[r] + 2 * kMasterGapSlackBytes) << run << " rank " << r;
      }
    }
  }
  expect_resumes("zero3-ep2-d2", z3ep2, {Resume{1, "z3ep2-to-one", "--set train.batch_size=2"},
                                         Resume{2, "z3ep2-to-zero0", "--set parallel.zero=0"}});
}

// Two replicas of two pipeline stages under ZeRO-1 and ZeRO-2, each stage's replicas an expert
// group of 2 sharing out the stage's experts (each the only holder of its experts: it owns their
// whole state): what one rank trains with the whole batch. In the step lines (world ranks 0 and 2
// are stage 0's replicas, 1 and 3 stage 1's) the replicas of a stage hold as much of the experts
// as each other, half of the stage's, and the 4 ranks together hold every expert once, every
// chunk of no expert twice (one copy per replica) and every parameter's moments once.
TEST_F(ShardedExperts, ZeroOneAndTwoInAPipelineShareOutEachStagesExperts) {
  for (const std::string zero : {"1", "2"}) {
    const std::string run = "zero" + zero + "-ep2-d2p2";
    ASSERT_NO_FATAL_FAILURE(expect_trains_like_one(4, run, "--set parallel.pipeline=2 --set parallel.expert=2 "
                                                           "--set train.checkpoint_every=4 --set parallel.zero=" + zero));
    for (const json& s : lines(run)) {
      expect_two_stages_share_out_experts(s, run);
    }
  }
}

// Data 2 x tensor 2 with expert groups of 2 under ZeRO-1 and ZeRO-2: each rank holds its tensor
// shard (half the units) of its expert group's 2 experts (each the only holder of its shard: it
// owns the shard's whole state): what one rank trains with the whole batch. In the step lines
// (world rank = data rank x 2 + tensor rank) each rank holds a quarter of the experts'
// parameters, gradients and moments, and the 4 ranks' moments are every tensor shard's once. The
// ZeRO-1 run's checkpoint at step 4 (the moments gathered from their owners into each rank's
// whole copy of its experts) resumed in the same layout gives the uninterrupted run's bytes; each
// run's resumed on one rank (P = 1, ZeRO-0) goes on as the one-rank run.
TEST_F(ShardedExperts, ZeroOneAndTwoWithTensorGroupsHoldEachRanksExpertShards) {
  const std::string d2t2 = "--set parallel.tensor=2 --set parallel.expert=2 --set train.checkpoint_every=4 ";
  for (const std::string zero : {"1", "2"}) {
    const std::string run = "zero" + zero + "-ep2-d2t2";
    std::string output;
    ASSERT_NO_FATAL_FAILURE(expect_trains_like_one(4, run, d2t2 + "--set parallel.zero=" + zero, &output));
    EXPECT_NE(output.find("ZeRO shares each expert's state out over the ranks holding it"), std::string::npos)
        << output;
    for (const json& s : lines(run)) expect_tensor_ranks_share_out_experts(s, run);
  }
  const std::string from = " --set train.resume=" + at("zero1-ep2-d2t2") + "/ckpt/step-00000004";
  const testing::CommandResult same = train(4, "z1ep2-d2t2-resumed", d2t2 + "--set parallel.zero=1" + from);
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_NE(same.output.find("resumed from"), std::string::npos) << same.output;
  expect_same_checkpoint("zero1-ep2-d2t2", "z1ep2-d2t2-resumed");
  for (const std::string zero : {"1", "2"}) {
    const std::string run = "z" + zero + "ep2-d2t2-to-one";
    const testing::CommandResult r =
        train(1, run, "--set train.batch_size=2 --set train.checkpoint_every=4 --set train.resume=" +
                          at("zero" + zero + "-ep2-d2t2") + "/ckpt/step-00000004");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    expect_like("one-b2", run, 4);
  }
}

// Two replicas of two pipeline stages under ZeRO-3, each stage's replicas an expert group of 2
// (each the only holder of its experts: it homes their parameters and state whole; the stage's
// chunks of no expert sharded over both): what one rank trains with the whole batch. Each rank's
// layout holds half of its stage's experts (the start-up line and the step lines, as under
// ZeRO-1/2 in a pipeline), its parameter home no more resident than its shard once a step is
// over, its moments its owned chunks'. Its checkpoint at step 4 resumed in the same layout gives
// the uninterrupted run's bytes, on one rank (P = 1, ZeRO-0) it goes on as the one-rank run.
TEST_F(ShardedExperts, ZeroThreeInAPipelineHoldsOnlyEachStagesExperts) {
  expect_zero3_over_two_data_ranks("zero3-ep2-d2p2", "--set parallel.pipeline=2", " of the stage's replicas",
                                   expect_two_stages_share_out_experts);
}

// bf16 training state in two replicas of two pipeline stages with expert groups of 2 (each
// stage's replicas share out the stage's experts, each the only holder of its experts), 4 steps:
// ZeRO-0, ZeRO-1, ZeRO-2 and ZeRO-3 train the same bytes (the chunks of no expert summed over 2
// replicas, one bf16 addition per element whatever the collective), within 1e-3 of the same layout
// with every expert held (an expert's gradient rounded to bf16 once from all of its rows, where
// that run sums two replicas' bf16 gradients: measured 2.8e-7 relative at worst). Under ZeRO-1/2/3
// the step lines show each stage's replicas holding half of the stage's experts and rank 0's
// float32 masters its owned chunks' (ZeRO-3: and its bf16 bits its shard's between steps); under
// ZeRO-0 rank 0 holds the parameters it holds under ZeRO-1.
// ZeRO-1's step-2 checkpoint resumed in its own layout gives the uninterrupted run's bytes, and
// resumed on one rank without expert parallelism is saved there with the same bytes.
TEST_F(ShardedExperts, Bf16StateInAPipelineHoldsOnlyEachStagesExperts) {
  const std::string bf16 = "--set runtime.param_dtype=bf16 --set runtime.grad_dtype=bf16 ";
  const std::string d2p2 = bf16 + "--set parallel.pipeline=2 --set train.steps=4 ";
  ASSERT_EQ(train(4, "bf16-d2p2", d2p2).exit_code, 0);
  const std::string ep = d2p2 + "--set parallel.expert=2 --set train.checkpoint_every=2 ";
  for (const std::string zero : {"0", "1", "2", "3"}) {
    const std::string run = "bf16-zero" + zero + "-ep2-d2p2";
    const testing::CommandResult r = train(4, run, ep + "--set parallel.zero=" + zero);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos) << r.output;
    expect_losses_near("bf16-d2p2", run, 1e-3);
    if (zero == "0") continue;
    EXPECT_NE(r.output.find(zero == "3" ? "ZeRO-3 shards each expert's parameters and state over the ranks holding it"
                                        : "ZeRO shares each expert's state out over the ranks holding it"),
              std::string::npos) << r.output;
    expect_same_training("bf16-zero0-ep2-d2p2", run);
    for (const json& s : lines(run)) expect_two_stages_share_out_experts(s, run);
    expect_masters_of_owned_chunks(run);
    if (zero == "3") expect_bits_of_shard(run);
  }
  const std::vector<json> zero0 = lines("bf16-zero0-ep2-d2p2"), zero1 = lines("bf16-zero1-ep2-d2p2");
  ASSERT_EQ(zero0.size(), zero1.size());
  for (size_t i = 0; i < zero0.size(); ++i) {
    EXPECT_EQ(zero0[i].at("param_bytes").get<int64_t>(), zero1[i].at("held_param_bytes")[0].get<int64_t>()) << i;
  }
  expect_step_two_resumes(4, "bf16-zero1-ep2-d2p2", ep + "--set parallel.zero=1 ",
                          bf16 + "--set train.batch_size=2 --set train.steps=2");
}

// A re-cut of two replicas of two pipeline stages under ZeRO-1 and ZeRO-2 with expert groups of
// 2: from "1" (the embedding alone on the first stage, both MoE blocks on the second, whose ranks
// are slowed threefold: every measurement calls it unbalanced) the exact partitioner moves a MoE
// block at step 4, each of its experts' chunks staying within its replica (its expert rank does
// not change), their moments from the owner among the holders: what one rank trains with the
// whole batch, and after the move the step lines show each stage's replicas holding half of the
// stage's experts (both stages holding some).
TEST_F(ShardedExperts, ReCutsUnderZeroOneAndTwoMoveEachExpertWithinItsReplica) {
  for (const std::string zero : {"1", "2"}) {
    const std::string run = "zero" + zero + "-ep2-d2p2-recut";
    json last;
    ASSERT_NO_FATAL_FAILURE(expect_recut_trains_like_one(
        4, run, recut_options(1) + "--set train.checkpoint_every=4 --set parallel.zero=" + zero, &last));
    expect_two_stages_share_out_experts(last, run);
  }
}

// A ZeRO-1 run's checkpoint with expert groups of 2 (written by the ranks owning each chunk's
// moments) resumed at step 4: in the same layout it gives the uninterrupted run's bytes
// (parameters and both moments); on one rank without ZeRO, on 2 ranks under ZeRO-2 without expert
// parallelism and under ZeRO-2 with expert groups of 2 it goes on as the one-rank run.
TEST_F(ShardedExperts, ZeroCheckpointsResumeInOtherExpertAndZeroLayouts) {
  const std::string ep = "--set parallel.expert=2 ", z1 = "--set parallel.zero=1 ";
  if (!std::filesystem::exists(at("one-b2") + "/ckpt")) {
    ASSERT_EQ(train(1, "one-b2", "--set train.checkpoint_every=4 --set train.batch_size=2").exit_code, 0);
  }
  if (!std::filesystem::exists(at("zero1-ep2-d2") + "/ckpt")) {
    ASSERT_EQ(train(2, "zero1-ep2-d2", ep + z1 + "--set train.checkpoint_every=4").exit_code, 0);
  }
  expect_resumes("zero1-ep2-d2", ep + z1, {Resume{1, "z1ep2-to-one", "--set train.batch_size=2"},
                                           Resume{2, "z1ep2-to-zero2", "--set parallel.zero=2"},
                                           Resume{2, "z1ep2-to-z2ep2", ep + "--set parallel.zero=2"}});
}

// Data 2 x tensor 2 with expert groups of 2 under ZeRO-3: each rank homes its tensor shard of its
// expert group's 2 experts whole (the only holder of that shard) beside its half of its tensor
// rank's chunks of no expert, gathered with the layer over its data group: what one rank trains
// with the whole batch. The step lines show each rank holding a quarter of the experts (as under
// ZeRO-1/2 with tensor groups), and rank 0's data group its parameter home no more resident than
// its shard once a step is over. Its checkpoint at step 4 (the whole copies filled from the
// owners' parameters and moments) resumed in the same layout gives the uninterrupted run's bytes,
// on one rank (P = 1, ZeRO-0) it goes on as the one-rank run.
TEST_F(ShardedExperts, ZeroThreeWithTensorGroupsHomesEachRanksExpertShards) {
  expect_zero3_over_two_data_ranks("zero3-ep2-d2t2", "--set parallel.tensor=2", "",
                                   [](const json& s, const std::string& run) {
                                     expect_tensor_ranks_share_out_experts(s, run);
                                   });
}

// Memory copies with data 2 x tensor 2, expert groups of 2 under ZeRO-2 and bias balancing: each
// rank copies its whole copy (WholeModelState: its experts unsplit, the moments gathered from
// their owners) and the routing biases to /dev/shm every step, and its buddy's; rank 1 SIGKILLed
// after step 6 (at its buddy copy of step 6) is recovered by `keel launch --max-restarts` from the
// 4 ranks' own copies of step 6 (or 5), each sliced back into the rank's tensor shard of its
// experts and its owned moments, to the uninterrupted run's bytes (parameters and both moments)
// and biases; every step line shows each rank holding its tensor shard of its experts only.
TEST_F(ShardedExperts, MemoryCopiesWithTensorGroupsRecoverAKilledRankWithItsExpertShards) {
  const std::string layout = testing::kMoeBias + "--set parallel.tensor=2 --set parallel.expert=2 "
                                                 "--set parallel.zero=2 --set train.checkpoint_every=4 ";
  ASSERT_EQ(train(4, "t2-memory-reference", layout).exit_code, 0);
  const testing::CommandResult killed = kill_rank_one_after_step_six(4, "t2-memory-killed", layout);
  ASSERT_EQ(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.output.find("ZeRO shares each expert's state out over the ranks holding it"), std::string::npos)
      << killed.output;
  // (Step 6 where every rank kept its own copy of step 6 before the job was stopped, else step 5:
  // on 4 ranks another rank may be stopped before its own copy of step 6 is complete.)
  const std::string resumed = "keel: resumed from memory (step ";
  const size_t at = killed.output.find(resumed);
  ASSERT_NE(at, std::string::npos) << killed.output;
  const int step = std::stoi(killed.output.substr(at + resumed.size()));
  EXPECT_TRUE(step == 5 || step == 6) << killed.output;
  EXPECT_NE(killed.output.find("4 rank(s) from their own copy, 0 from their buddy's"), std::string::npos)
      << killed.output;
  expect_same_checkpoint("t2-memory-reference", "t2-memory-killed");
  const json want = lines("t2-memory-reference").back().at("moe_layers"),
             got = lines("t2-memory-killed").back().at("moe_layers");
  for (size_t l = 0; l < 2; ++l) EXPECT_EQ(got[l].at("bias"), want[l].at("bias")) << l;
  for (const json& s : lines("t2-memory-killed")) expect_tensor_ranks_share_out_experts(s, "t2-memory-killed");
}

// Two replicas of two pipeline stages of tensor groups of 2 (8 ranks) under ZeRO-1 and ZeRO-3,
// each stage's replicas an expert group of 2: each rank holds its tensor shard of half of its
// stage's experts (the only holder of that shard: it owns, under ZeRO-3 homes, the shard's whole
// state): what one rank trains with the whole batch, every step line showing the ranks of a stage
// holding as much as each other and the 8 ranks every expert shard once. The ZeRO-1 run's
// checkpoint at step 4 (each stage's whole copies, each expert chunk written by its owner)
// resumed on one rank (P = 1, ZeRO-0) goes on as the one-rank run.
TEST_F(ShardedExperts, PipelinesOfTensorGroupsHoldEachRanksExpertShards) {
  for (const std::string zero : {"1", "3"}) {
    const std::string run = "zero" + zero + "-ep2-d2p2t2";
    ASSERT_NO_FATAL_FAILURE(expect_trains_like_one(8, run, "--set parallel.pipeline=2 --set parallel.tensor=2 "
                                                           "--set parallel.expert=2 --set train.checkpoint_every=4 "
                                                           "--set parallel.zero=" + zero));
    for (const json& s : lines(run)) expect_tensor_ranks_share_out_experts(s, run, 2);
  }
  const testing::CommandResult one =
      train(1, "z1ep2-d2p2t2-to-one", "--set train.batch_size=2 --set train.checkpoint_every=4 --set train.resume=" +
                                          at("zero1-ep2-d2p2t2") + "/ckpt/step-00000004");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_NE(one.output.find("resumed from"), std::string::npos) << one.output;
  expect_like("one-b2", "z1ep2-d2p2t2-to-one", 4);
}

// A re-cut of two replicas of two pipeline stages of tensor groups of 2 (8 ranks) under ZeRO-2
// with expert groups of 2: from "1" (the embedding alone on the first stage, both MoE blocks on
// the second, whose rank 2 is slowed threefold) the exact partitioner moves a MoE block or both
// at step 4 (by the measured times), each tensor rank's shard of an expert's chunks staying within
// its replica, their moments from the owner among the holders: what one rank trains with the
// whole batch, and after the move the step line shows each rank holding its tensor shard of half
// of its stage's experts.
TEST_F(ShardedExperts, ReCutsOfTensorGroupsMoveEachExpertShardWithinItsReplica) {
  const std::string run = "zero2-ep2-d2p2t2-recut";
  json last;
  ASSERT_NO_FATAL_FAILURE(expect_recut_trains_like_one(
      8, run, recut_options(2) + "--set parallel.tensor=2 --set parallel.zero=2 --set train.checkpoint_every=4", &last));
  expect_tensor_ranks_share_out_experts(last, run, 2);
}

}  // namespace
}  // namespace keel
