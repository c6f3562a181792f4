// Checkpoints of pipelined runs (ckpt/checkpointer.h): every stage's replicas write their chunks
// in the whole model's layout, so a checkpoint written by P stages is the checkpoint one rank
// would write, and a run resumes from it in any layout, each rank loading its stages' tensors by
// name and offset. At one thread per rank a pipeline computes the bytes one rank computes (same
// kernels, same sums), so a run resumed in another pipeline layout, or on one rank, ends with
// the uninterrupted run's bytes; with data parallelism the sum over replicas rounds in another
// order, so there the resumed state is checked exactly and the training that follows closely.
// And `keel launch --max-restarts` recovers a pipelined run from SIGKILL to the uninterrupted bytes.
// With gradient prediction as well, in the layout that wrote the checkpoint (PredictionCheckpoints).
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ckpt/checkpoint.h"
#include "core/fileio.h"
#include "test_util.h"

namespace keel {
namespace {

class PipelineCheckpoints : public ::testing::Test {
 protected:
  static constexpr int kSteps = 16;
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir("keel-pipe-ckpt");
    testing::write_toy_corpus(dir_->path());
    testing::write_toy_config(dir_->path(), kSteps);
    // The uninterrupted run, and the same with periodic checkpoints (steps 4, 8, 12 and the
    // final 16): later runs resume from its step 8.
    ASSERT_EQ(train(2, "ref", "--set parallel.pipeline=2").exit_code, 0);
    const testing::CommandResult periodic = train(2, "periodic", "--set parallel.pipeline=2 --set train.checkpoint_every=4");
    ASSERT_EQ(periodic.exit_code, 0) << periodic.output;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  // llama-tiny untied on the toy corpus: 4 layers (embedding, 2 blocks, head), 4 micro-batches of
  // 2 sequences per step, one thread per rank in every layout.
  static std::string common() {
    return " --set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=32"
           " --set train.batch_size=2 --set train.grad_accum=4 --set train.eval_every=0 --set runtime.threads=1"
           " --set parallel.schedule=1f1b";
  }
  static std::string args(const std::string& run, const std::string& extra) {
    return "train --config " + dir_->path() + "/toy.toml" + common() + " --set train.run_dir=" + at(run) + " " + extra;
  }
  static testing::CommandResult train(int ranks, const std::string& run, const std::string& extra) {
    const std::string a = args(run, extra);
    return testing::run_keel(ranks <= 1 ? a : "launch -n " + std::to_string(ranks) + " -- " + a);
  }
  static std::string at(const std::string& run) { return dir_->path() + "/" + run; }
  static std::string step8() { return at("periodic") + "/ckpt/step-00000008"; }
  static std::vector<double> losses(const std::string& run) { return testing::step_losses(at(run) + "/metrics.jsonl"); }
  // The newest checkpoints under two runs hold the same parameters and AdamW moments, byte for byte.
  static void expect_same_state(const std::string& a, const std::string& b) {
    for (Plane p : {Plane::param, Plane::adam_m, Plane::adam_v}) {
      EXPECT_TRUE(testing::checkpoint_bytes(at(a) + "/ckpt", p) == testing::checkpoint_bytes(at(b) + "/ckpt", p))
          << a << " vs " << b << ": plane " << static_cast<int>(p);
    }
  }
  static testing::TempDir* dir_;
  // `keel launch` words for a training run whose log is read while it runs.
  static std::vector<std::string> launch_words(const std::string& run, const std::string& extra, int max_restarts) {
    const std::string a = args(run, extra);
    std::vector<std::string> words = {"launch", "-n", "2"};
    if (max_restarts > 0) words.insert(words.end(), {"--max-restarts", std::to_string(max_restarts)});
    words.push_back("--");
    for (size_t at = 0, next; at < a.size(); at = next + 1) {
      next = std::min(a.find(' ', at), a.size());
      if (next > at) words.push_back(a.substr(at, next - at));
    }
    return words;
  }
  // Polls `job`'s output until it holds `text` (false: the job ended first); a hang guard of 300 s.
  static bool wait_for(testing::KeelJob& job, const std::string& text) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
    while (job.running() && job.output().find(text) == std::string::npos) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return job.running();
  }
  // Run `run` of `extra` with checkpoints every 10 steps under `keel launch --max-restarts 2`,
  // its second stage SIGKILLed once the checkpoint of step 20 is published: the job recovers and
  // finishes.
  static void kill_a_stage_and_recover(const std::string& run, const std::string& extra) {
    testing::KeelJob job(launch_words(run, extra + "--set train.checkpoint_every=10", 2), at(run + ".log"), {});
    ASSERT_GT(job.pid(), 0);
    ASSERT_TRUE(wait_for(job, "keel: checkpoint step-00000020")) << "no kill before the job ended\n" << job.output();
    const std::vector<pid_t> pids = testing::keel_train_pids(dir_->path() + "/toy.toml");
    ASSERT_EQ(pids.size(), 2u) << job.output();
    ASSERT_EQ(::kill(pids[1], SIGKILL), 0);
    ASSERT_EQ(job.wait(300), 0) << job.output();
    EXPECT_NE(job.output().find("keel: recovered from failure 1"), std::string::npos) << job.output();
    EXPECT_NE(job.output().find("training resumes at step"), std::string::npos) << job.output();
  }
};
testing::TempDir* PipelineCheckpoints::dir_ = nullptr;

TEST_F(PipelineCheckpoints, AreWrittenInTheLayoutOneRankWritesAndPeriodically) {
  const std::vector<std::string> ckpts = list_checkpoints(at("periodic") + "/ckpt");
  ASSERT_EQ(ckpts.size(), 4u);  // steps 16, 12, 8 (differential) and 4 (full, their base)
  EXPECT_EQ(describe_checkpoint(ckpts[3]).kind, "full");
  EXPECT_EQ(describe_checkpoint(ckpts[2]).kind, "diff");
  EXPECT_EQ(describe_checkpoint(ckpts[0]).world, 2);
  for (const std::string& c : ckpts) EXPECT_NO_THROW(verify_checkpoint(c)) << c;
  expect_same_state("periodic", "ref");
  // One rank at one thread trains the pipeline's bytes, and reads the pipeline's checkpoint as
  // its own (the same chunks).
  ASSERT_EQ(train(1, "one", "").exit_code, 0);
  expect_same_state("one", "ref");
  const testing::CommandResult eval =
      testing::run_keel("eval --checkpoint " + step8() + " --data " + dir_->path() + "/val.bin --batch 2 --seq 32");
  EXPECT_EQ(eval.exit_code, 0) << eval.output;
}

// Resumed from step 8 as P = 2, as P = 4 (a stage per layer), as P = 2 with two stages a rank
// (zero bubble's V schedule) and on one rank: step 16 holds the uninterrupted run's bytes.
TEST_F(PipelineCheckpoints, ResumeBitIdenticallyAsTwoOrFourStagesOrOnOneRank) {
  const std::string from = " --set train.resume=" + step8();
  for (const auto& [ranks, run, layout] : std::vector<std::tuple<int, std::string, std::string>>{
           {2, "as-pp2", "--set parallel.pipeline=2"},
           {4, "as-pp4", "--set parallel.pipeline=4"},
           {2, "as-zb-v", "--set parallel.pipeline=2 --set parallel.schedule=zb-v"},  // 2 stages a rank
           {1, "as-one", ""}}) {
    const testing::CommandResult r = train(ranks, run, layout + from);
    ASSERT_EQ(r.exit_code, 0) << run << "\n" << r.output;
    EXPECT_NE(r.output.find("resumed from " + step8()), std::string::npos) << r.output;
    expect_same_state(run, "ref");
    const std::vector<double> got = losses(run), want = losses("ref");
    ASSERT_EQ(got.size(), 8u) << run;
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[8 + i]) << run << " step " << 9 + i;
  }
}

// As 2 x 2 (two replicas of two stages, ZeRO-1 sharding each stage's moments over its
// replicas): the state is loaded exactly (saved again at once, it is the checkpoint's bytes), and
// training goes on the same trajectory (the replicas' gradient sum rounds in another order).
TEST_F(PipelineCheckpoints, ResumeAsDataTimesPipelineLoadsTheStateExactly) {
  // (One sequence per replica per micro-batch: the data windows stay 2 sequences wide, so the
  // data stream goes on where the checkpoint left it.)
  const std::string grid = "--set parallel.pipeline=2 --set parallel.zero=1 --set train.batch_size=1 "
                           "--set train.resume=" + step8() + " ";
  const testing::CommandResult same = train(4, "as-2x2-at-8", grid + "--set train.steps=8");
  ASSERT_EQ(same.exit_code, 0) << same.output;
  for (Plane p : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    const std::vector<float> want = read_checkpoint_plane(step8(), p);
    EXPECT_TRUE(want == read_checkpoint_plane(testing::newest_checkpoint(at("as-2x2-at-8") + "/ckpt"), p))
        << "plane " << static_cast<int>(p);
  }
  // Windows of another width are said in one line (the position is a window count).
  const testing::CommandResult wide =
      train(4, "as-2x2-wide", grid + "--set train.batch_size=2 --set train.grad_accum=2 --set train.steps=8");
  ASSERT_EQ(wide.exit_code, 0) << wide.output;
  EXPECT_NE(wide.output.find("resuming with data windows of 4 sequences (data ranks x train.batch_size) where the "
                             "checkpoint's run read windows of 2"),
            std::string::npos)
      << wide.output;
  EXPECT_EQ(same.output.find("resuming with data windows"), std::string::npos) << same.output;
  const testing::CommandResult on = train(4, "as-2x2", grid);
  ASSERT_EQ(on.exit_code, 0) << on.output;
  const std::vector<double> got = losses("as-2x2"), want = losses("ref");
  ASSERT_EQ(got.size(), 8u);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[8 + i], 1e-4 * want[8 + i]) << "step " << 9 + i;
}

// GPT-2's head is tied to the embedding: the head's stage keeps a replica of wte, which is not
// written (its home's bytes are the same) and is loaded from its home's tensor.
TEST_F(PipelineCheckpoints, ATiedEmbeddingAcrossStagesResumesExactly) {
  const std::string gpt2 = "--set model.preset=tiny --set parallel.pipeline=2 ";
  ASSERT_EQ(train(2, "tied-ref", gpt2 + "--set train.checkpoint_every=8").exit_code, 0);
  const testing::CommandResult r =
      train(2, "tied-resumed", gpt2 + "--set train.resume=" + at("tied-ref") + "/ckpt/step-00000008");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_state("tied-resumed", "tied-ref");
}

// A stage SIGKILLed mid-run: `keel launch --max-restarts` restarts the job, which resumes from its
// newest checkpoint and ends with the bytes of the run that was never killed.
TEST_F(PipelineCheckpoints, ASigkilledStageIsRecoveredToTheUninterruptedBytes) {
  const std::string long_run = "--set parallel.pipeline=2 --set train.steps=60 --set train.log_every=1 ";
  ASSERT_EQ(train(2, "long-ref", long_run).exit_code, 0);
  ASSERT_NO_FATAL_FAILURE(kill_a_stage_and_recover("chaos", long_run));
  expect_same_state("chaos", "long-ref");
}

// Gradient prediction (parallel.predict_gradients): a step leaves each stage's last W to the next
// one, and the predictor keeps a history. A checkpoint runs those W's first (the sums the next
// step would have made) and saves every rank's prediction state beside the chunks, so a run
// resumed from any checkpoint, stopped by SIGTERM at any step or SIGKILLed under `keel launch
// --max-restarts` ends with the bytes of the run never interrupted: parameters, moments and
// every rank's prediction state. Only the layout that saved the state takes it up; any other is
// refused in one line.
class PredictionCheckpoints : public PipelineCheckpoints {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir("keel-predict-ckpt");
    testing::write_toy_corpus(dir_->path());
    testing::write_toy_config(dir_->path(), kSteps);
  }
  static std::string layout(const std::string& predictor) {
    return "--set parallel.pipeline=2 --set parallel.predict_gradients=" + predictor + " ";
  }
  // The newest checkpoints of two runs: the same parameters, moments and prediction state of
  // each of the `ranks` ranks, byte for byte.
  static void expect_same_prediction_state(const std::string& a, const std::string& b, int ranks = 2) {
    expect_same_state(a, b);
    const std::string ca = testing::newest_checkpoint(at(a) + "/ckpt"), cb = testing::newest_checkpoint(at(b) + "/ckpt");
    for (int rank = 0; rank < ranks; ++rank) {
      const std::vector<float> x = read_rank_carried(ca, rank), y = read_rank_carried(cb, rank);
      EXPECT_FALSE(x.empty());
      EXPECT_TRUE(x == y) << a << " vs " << b << ": prediction state of rank " << rank;
    }
  }
  static void expect_same_losses(const std::string& run, const std::string& ref, size_t from_step) {
    const std::vector<double> got = losses(run), want = losses(ref);
    ASSERT_EQ(got.size() + from_step, want.size()) << run;
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[from_step + i]) << run << " step " << from_step + i + 1;
  }
};

class PredictionResumes : public PredictionCheckpoints, public ::testing::WithParamInterface<std::string> {};

// Every predictor: checkpoints every 2 steps (full and differential) change nothing (the same
// bytes as the run without them), and a run resumed from each of them ends with the uninterrupted
// run's bytes after the uninterrupted run's losses.
TEST_P(PredictionResumes, FromEveryCheckpointToTheUninterruptedBytes) {
  const std::string p = GetParam();
  const int steps = 12;
  const std::string run = layout(p) + "--set train.steps=" + std::to_string(steps) + " ";
  const testing::CommandResult ref = train(2, p + "-ref", run);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const testing::CommandResult periodic =
      train(2, p + "-periodic", run + "--set train.checkpoint_every=2 --set checkpoint.keep=8");
  ASSERT_EQ(periodic.exit_code, 0) << periodic.output;
  const std::vector<std::string> ckpts = list_checkpoints(at(p + "-periodic") + "/ckpt");
  ASSERT_EQ(ckpts.size(), static_cast<size_t>(steps / 2));
  std::vector<std::string> kinds;
  for (const std::string& c : ckpts) {
    EXPECT_NO_THROW(verify_checkpoint(c)) << c;
    kinds.push_back(describe_checkpoint(c).kind);
  }
  EXPECT_NE(std::find(kinds.begin(), kinds.end(), "full"), kinds.end());
  EXPECT_NE(std::find(kinds.begin(), kinds.end(), "diff"), kinds.end());
  expect_same_prediction_state(p + "-periodic", p + "-ref");
  expect_same_losses(p + "-periodic", p + "-ref", 0);
  for (int step = 2; step < steps; step += 2) {
    const std::string resumed = p + "-from-" + std::to_string(step);
    const std::string from = at(p + "-periodic") + "/ckpt/" + checkpoint_name(step);
    const testing::CommandResult r = train(2, resumed, run + "--set train.resume=" + from);
    ASSERT_EQ(r.exit_code, 0) << resumed << "\n" << r.output;
    EXPECT_NE(r.output.find("resumed from " + from), std::string::npos) << r.output;
    expect_same_prediction_state(resumed, p + "-ref");
    expect_same_losses(resumed, p + "-ref", static_cast<size_t>(step));
  }
}

INSTANTIATE_TEST_SUITE_P(Predictors, PredictionResumes, ::testing::Values("mean", "previous", "momentum", "lstm"));

// The state is per rank and per element of its stages: another pipeline depth, another predictor,
// none, or no pipeline is refused in one line naming the keys. A checkpoint without prediction
// state starts the prediction afresh, as at a first step.
TEST_F(PredictionCheckpoints, AnotherLayoutIsRefusedInOneLine) {
  ASSERT_EQ(train(2, "src", layout("lstm") + "--set train.checkpoint_every=8").exit_code, 0);
  const std::string from = "--set train.resume=" + at("src") + "/ckpt/step-00000008 ";
  struct Case {
    int ranks;
    std::string set, expect;
  };
  const std::string same_keys = "resume it with the same parallel.predict_gradients, parallel.pipeline";
  for (const Case& c : std::vector<Case>{
           {4, "--set parallel.pipeline=4 --set parallel.predict_gradients=lstm", same_keys},
           {2, "--set parallel.pipeline=2 --set parallel.schedule=zb-v --set parallel.predict_gradients=lstm", same_keys},
           {2, "--set parallel.pipeline=2 --set parallel.predict_gradients=momentum", same_keys},
           {2, "--set parallel.pipeline=2", "which this run has no place for"},
           {1, "", "which this run has no place for"}}) {
    const testing::CommandResult r = train(c.ranks, "refused", from + c.set);
    EXPECT_EQ(r.exit_code, 2) << c.set << "\n" << r.output;
    const size_t line = r.output.find("checkpoint " + at("src") + "/ckpt/step-00000008: ");
    ASSERT_NE(line, std::string::npos) << c.set << "\n" << r.output;
    const std::string message = r.output.substr(line, r.output.find('\n', line) - line);
    EXPECT_NE(message.find(c.expect), std::string::npos) << c.set << "\n" << r.output;
    EXPECT_NE(message.find("parallel.predict_gradients = \"lstm\""), std::string::npos) << message;
    EXPECT_FALSE(std::filesystem::exists(at("refused") + "/ckpt/step-00000016")) << c.set;
  }
  ASSERT_EQ(train(2, "plain", "--set parallel.pipeline=2 --set train.checkpoint_every=8").exit_code, 0);
  const testing::CommandResult fresh =
      train(2, "fresh", layout("lstm") + "--set train.resume=" + at("plain") + "/ckpt/step-00000008");
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  EXPECT_NO_THROW(read_rank_carried(testing::newest_checkpoint(at("fresh") + "/ckpt"), 1));
}

// Two replicas of two stages: each rank predicts from its own replica's gradients (before the
// sync), and the grid that saved the state resumes to the uninterrupted bytes.
TEST_F(PredictionCheckpoints, AsDataTimesPipelineResumesToTheUninterruptedBytes) {
  const std::string grid = layout("momentum") + "--set parallel.zero=1 --set train.batch_size=1 --set train.steps=8 ";
  ASSERT_EQ(train(4, "grid-ref", grid).exit_code, 0);
  const testing::CommandResult periodic = train(4, "grid", grid + "--set train.checkpoint_every=4");
  ASSERT_EQ(periodic.exit_code, 0) << periodic.output;
  const testing::CommandResult r =
      train(4, "grid-from-4", grid + "--set train.resume=" + at("grid") + "/ckpt/" + checkpoint_name(4));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_prediction_state("grid", "grid-ref", 4);
  expect_same_prediction_state("grid-from-4", "grid-ref", 4);
  expect_same_losses("grid-from-4", "grid-ref", 4);
}

// SIGTERM to `keel launch` at whatever step it lands: the stop checkpoint holds the prediction
// state, and the run resumed from it ends with the bytes and losses of the run never stopped.
TEST_F(PredictionCheckpoints, ASigtermStopAnywhereResumesToTheUninterruptedBytes) {
  const std::string run = layout("lstm") + "--set train.steps=300 --set train.log_every=1 ";
  ASSERT_EQ(train(2, "term-ref", run).exit_code, 0);
  testing::KeelJob job(launch_words("term", run, 0), at("term.log"), {});
  ASSERT_GT(job.pid(), 0);
  ASSERT_TRUE(wait_for(job, "step     20")) << "no signal before the job ended\n" << job.output();
  ASSERT_EQ(::kill(job.pid(), SIGTERM), 0);
  ASSERT_EQ(job.wait(120), 128 + SIGTERM) << job.output();
  const std::string out = job.output();
  const size_t line = out.find("keel: Terminated: stopped after step ");
  ASSERT_NE(line, std::string::npos) << out;
  const int stopped = std::atoi(out.c_str() + line + 37);
  ASSERT_GT(stopped, 0);
  ASSERT_LT(stopped, 300) << out;
  const testing::CommandResult r = train(2, "term", run + "--set train.resume=auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + at("term") + "/ckpt/" + checkpoint_name(stopped)), std::string::npos)
      << r.output;
  expect_same_prediction_state("term", "term-ref");
  expect_same_losses("term", "term-ref", 0);
}

// A stage SIGKILLed under `keel launch --max-restarts`: the restarted job resumes from its newest
// checkpoint, prediction state and all, and ends with the uninterrupted run's bytes and losses.
TEST_F(PredictionCheckpoints, ASigkilledStageIsRecoveredToTheUninterruptedBytes) {
  const std::string run = layout("lstm") + "--set train.steps=60 --set train.log_every=1 ";
  ASSERT_EQ(train(2, "kill-ref", run).exit_code, 0);
  ASSERT_NO_FATAL_FAILURE(kill_a_stage_and_recover("kill", run));
  expect_same_prediction_state("kill", "kill-ref");
  expect_same_losses("kill", "kill-ref", 0);
}

}  // namespace
}  // namespace keel
