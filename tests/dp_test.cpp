// Data parallelism over OpenMPI, through the keel binary as a user runs it: N ranks with batch b
// train the model one rank trains with batch N*b; the same layout twice gives the same bytes; a
// killed rank fails the job with a message naming it; bad layouts are refused.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/fileio.h"
#include "core/rng.h"
#include "data/shard.h"
#include "test_util.h"
#include "toy_runs.h"

extern char** environ;

namespace keel {
namespace {

using testing::run_keel;

class DataParallel : public testing::ToyRuns {
 protected:
  DataParallel() : ToyRuns("keel-dp") {}
  std::vector<char> param_bytes(const std::string& run) { return testing::checkpoint_bytes(dir / (run + "/ckpt")); }
  std::map<std::string, double> weight_distance(const std::string& a, const std::string& b) {
    return testing::weight_distance(dir / (a + "/ckpt"), dir / (b + "/ckpt"));
  }
};

TEST_F(DataParallel, NRanksWithBatchBEqualOneRankWithBatchNB) {
  ASSERT_EQ(train(0, 8, "one").exit_code, 0);
  const std::vector<double> reference = losses("one");
  ASSERT_EQ(reference.size(), 20u);
  for (int zero : {0, 1, 2}) {
    for (int n : {2, 4}) {
      const std::string run = "dp" + std::to_string(n) + "z" + std::to_string(zero);
      auto r = train(n, 8 / n, run, "--set parallel.zero=" + std::to_string(zero));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("data parallel over " + std::to_string(n) + " ranks"), std::string::npos) << r.output;
      const std::vector<double> got = losses(run);
      ASSERT_EQ(got.size(), reference.size());
      for (size_t s = 0; s < got.size(); ++s) {
        EXPECT_NEAR(got[s], reference[s], 1e-5 * reference[s]) << run << " step " << s + 1;
      }
      for (const auto& [name, d] : weight_distance("one", run)) EXPECT_LT(d, 1e-5) << run << ": " << name;
    }
  }
}

// Under bf16 the layers read the store's bf16 copies of the weights (ChunkStore::bf16_params).
// With ZeRO a rank's AdamW writes the copies of its own chunks only; the others' parameters
// arrive by all-gather and their copies must be remade from them: ZeRO-1 and ZeRO-2 train what
// ZeRO-0 trains. (With copies left at the weights they were first made from, the other rank's
// half of every product would multiply the initial weights.)
TEST_F(DataParallel, Bf16WeightCopiesFollowTheParametersZeroGathers) {
  const std::string bf16 = "--set runtime.precision=bf16 --set train.steps=8 ";
  ASSERT_EQ(train(2, 4, "bf16z0", bf16 + "--set parallel.zero=0").exit_code, 0);
  const std::vector<double> reference = losses("bf16z0");
  ASSERT_EQ(reference.size(), 8u);
  for (int zero : {1, 2}) {
    const std::string run = "bf16z" + std::to_string(zero);
    auto r = train(2, 4, run, bf16 + "--set parallel.zero=" + std::to_string(zero));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<double> got = losses(run);
    ASSERT_EQ(got.size(), reference.size());
    for (size_t s = 0; s < got.size(); ++s) {
      EXPECT_NEAR(got[s], reference[s], 1e-5 * reference[s]) << run << " step " << s + 1;
    }
  }
}

TEST_F(DataParallel, ZeroShardsTheOptimizerStateAndResumesExactly) {
  ASSERT_EQ(train(2, 4, "straight", "--set parallel.zero=1 --set train.steps=12").exit_code, 0);
  ASSERT_EQ(train(2, 4, "half", "--set parallel.zero=1 --set train.steps=6").exit_code, 0);
  // Resume the 2-rank ZeRO-1 checkpoint with ZeRO-2: the moments are gathered on save and
  // re-sharded on load.
  auto r = train(2, 4, "resumed", "--set parallel.zero=2 --set train.steps=12 --set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(param_bytes("straight"), param_bytes("resumed"));
  EXPECT_EQ(testing::checkpoint_bytes(dir / "straight/ckpt", Plane::adam_v),
            testing::checkpoint_bytes(dir / "resumed/ckpt", Plane::adam_v));
  // Moments per rank: ZeRO-1 holds about half of what ZeRO-0 holds on 2 ranks.
  auto moments = [&](const std::string& run) {
    const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
    const size_t start = text.rfind('\n', text.find("moments_mb")) + 1;
    return nlohmann::json::parse(text.substr(start, text.find('\n', start) - start))["moments_mb"].get<double>();
  };
  ASSERT_EQ(train(2, 4, "z0", "--set parallel.zero=0 --set train.steps=2").exit_code, 0);
  EXPECT_LT(moments("straight"), 0.75 * moments("z0"));
}

TEST_F(DataParallel, OneRankUnderMpirunIsTheSingleProcessTrainer) {
  ASSERT_EQ(train(0, 4, "plain").exit_code, 0);
  auto r = train(1, 4, "mpi1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(param_bytes("plain"), param_bytes("mpi1"));
}

TEST_F(DataParallel, SameLayoutTwiceGivesTheSameBytes) {
  ASSERT_EQ(train(2, 4, "a").exit_code, 0);
  ASSERT_EQ(train(2, 4, "b").exit_code, 0);
  EXPECT_EQ(param_bytes("a"), param_bytes("b"));
  EXPECT_EQ(losses("a"), losses("b"));
}

TEST_F(DataParallel, ReportsSyncMetrics) {
  ASSERT_EQ(train(2, 4, "m").exit_code, 0);
  const std::string text = read_text_file(dir / "m/metrics.jsonl");
  const size_t start = text.rfind('\n', text.find("sync_payload_bytes")) + 1;
  const auto first_step = nlohmann::json::parse(text.substr(start, text.find('\n', start) - start));
  for (const char* key : {"sync_payload_bytes", "sync_sent_bytes", "sync_exposed_ms", "sync_imbalance_ms",
                          "sync_latency_ms", "sync_jitter"}) {
    EXPECT_TRUE(first_step.contains(key)) << key << " in " << first_step.dump();
  }
  EXPECT_GT(first_step["sync_payload_bytes"].get<double>(), 0);
}

TEST_F(DataParallel, GradientAccumulationSyncsOncePerStep) {
  ASSERT_EQ(train(0, 8, "acc1", "--set train.grad_accum=2").exit_code, 0);
  ASSERT_EQ(train(2, 4, "acc2", "--set train.grad_accum=2").exit_code, 0);
  const auto a = losses("acc1"), b = losses("acc2");
  ASSERT_EQ(a.size(), b.size());
  for (size_t s = 0; s < a.size(); ++s) EXPECT_NEAR(a[s], b[s], 1e-5 * a[s]) << "step " << s + 1;
}

TEST_F(DataParallel, BadLayoutsAreRefused) {
  auto one_line = [](const testing::CommandResult& r, const std::string& needle) {
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
  };
  one_line(run_keel("launch -n 0 -- train"), "expected 1..4096 ranks, found 0");
  one_line(run_keel("launch -n two -- train"), "expected a number of ranks, found 'two'");
  one_line(run_keel("launch -n 2 --hostfile " + dir / "nohosts" + " -- train"), "nohosts: not found");
  one_line(run_keel("launch -n 2"), "missing the keel subcommand");
  one_line(train(2, 4, "x", "--set train.global_batch_size=7"), "train.global_batch_size");
  one_line(train(2, 4, "x", "--set parallel.data=3"), "parallel.data");
}

// SIGKILL one rank of a running job: keel launch fails with a line naming the rank and signal.
TEST_F(DataParallel, KilledRankFailsTheJobNamingRankAndSignal) {
  const std::string log = dir / "launch.log";
  const std::string cmd = std::string(KEEL_BINARY) + " launch -n 2 -- train --config " + dir / "toy.toml" +
                          " --set train.steps=100000 --set train.eval_every=0 --set train.run_dir=" + dir / "k" +
                          " > " + log + " 2>&1";
  pid_t shell = 0;
  const char* argv[] = {"/bin/sh", "-c", cmd.c_str(), nullptr};
  ASSERT_EQ(posix_spawn(&shell, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ), 0);
  // Wait until training runs (a step line in the metrics), then kill rank 1.
  bool running = false;
  for (int i = 0; i < 600 && !running; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    running = std::filesystem::exists(dir / "k/metrics.jsonl") &&
              read_text_file(dir / "k/metrics.jsonl").find("\"loss\"") != std::string::npos;
  }
  ASSERT_TRUE(running) << read_text_file(log);
  // The ranks' command lines start with the keel binary and "train" (the launcher's has "launch",
  // mpirun's starts with mpirun).
  auto ranks = testing::run_command("pgrep -f '^" + std::string(KEEL_BINARY) + " train --config " + dir / "toy.toml" +
                                    "' | sort -n");
  std::vector<int> pids;
  for (size_t p = 0; p < ranks.output.size();) {
    const size_t e = ranks.output.find('\n', p);
    if (e > p) pids.push_back(std::stoi(ranks.output.substr(p, e - p)));
    p = e + 1;
  }
  ASSERT_EQ(pids.size(), 2u) << ranks.output;
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(pids[1], SIGKILL), 0);
  int status = 0;
  bool exited = false;
  for (int i = 0; i < 600 && !exited; ++i) {  // a hang guard, not a speed assertion
    exited = ::waitpid(shell, &status, WNOHANG) == shell;
    if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!exited) ::kill(shell, SIGKILL), ::waitpid(shell, &status, 0);
  ASSERT_TRUE(exited) << "keel launch did not exit after a rank was killed\n" << read_text_file(log);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  EXPECT_NE(WEXITSTATUS(status), 0);
  const std::string out = read_text_file(log);
  EXPECT_NE(out.find("keel: launch: job failed"), std::string::npos) << out;
  EXPECT_NE(out.find("signal 9 (Killed)"), std::string::npos) << out;
  EXPECT_NE(out.find("rank "), std::string::npos) << out;
  std::printf("keel launch exited %.1f s after SIGKILL of a rank\n", seconds);
}

}  // namespace
}  // namespace keel
