// The acceptance test of checkpoints and recovery. A 2-rank job of the default job's model ("d4":
// L=4 H=4 C=256, a vocabulary of 8192; 100 steps of 2 x 32 random tokens per rank, a checkpoint
// every 10 steps) is SIGKILLed three times, at moments drawn from a seed, under `keel launch --max-restarts`:
//   - once inside a checkpoint write: KEEL_FAULT in the launcher's environment (mpirun passes it
//     to the ranks on this machine) kills one rank at the Nth file operation on ckpt/step-*,
//     N chosen to fall inside the writing of its rN.bin or of the manifest;
//   - twice from outside: a random rank gets SIGKILL a random number of steps after the job
//     (re)started training.
// Every failure must be recovered, the final checkpoint's parameters and both AdamW moments must
// equal, byte for byte, those of the same job run without kills, and no directory without a
// manifest may be left under run_dir/ckpt. The seed and the recovery times are printed.
//
// KEEL_CHAOS_SEED=N draws other moments; the default is fixed so that CI is reproducible.
// bench/chaos.sh is the long version (100 kills).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/fileio.h"
#include "core/rng.h"
#include "data/shard.h"
#include "test_util.h"


namespace keel {
namespace {

namespace fs = std::filesystem;

// The optimizer step and the gradient all-reduce of the parameters dominate a step whatever the
// batch: d4's 5M parameters rather than the "small" preset's 16M (GPT-2's vocabulary) shorten each
// step, for the same recoveries (2026-12-05: 38 s of CPU for the whole test).
constexpr int kSteps = 100;
constexpr int kCheckpointEvery = 10;
// An outside kill comes 1..kMaxDelaySteps steps after the run (re)started training: before or
// after the run's first checkpoint.
constexpr int kMaxDelaySteps = 2 * kCheckpointEvery;
constexpr int kKills = 3;
constexpr int kMaxRestarts = 5;
// Draws: kill 1 SIGKILLs rank 0 13 steps in, kill 2 is rank 0's KEEL_FAULT at the append of the
// manifest of its run's first checkpoint, kill 3 SIGKILLs rank 1 14 steps after the restart.
constexpr uint64_t kDefaultSeed = 106;
// The longest any single wait may take before the test calls it a hang. A guard, not a speed
// assertion: the whole test takes a small fraction of this.
constexpr double kHangGuardS = 600;

// Position just past the n-th (1-based) occurrence of needle, or npos.
size_t after_nth(const std::string& text, const std::string& needle, size_t n) {
  size_t at = std::string::npos;
  for (size_t i = 0, from = 0; i < n; ++i, from = at + 1) {
    at = text.find(needle, from);
    if (at == std::string::npos) return at;
  }
  return at + needle.size();
}

// A job's log for failure messages: without the per-step progress lines, and its end only.
std::string tail(const std::string& text, size_t bytes = 8000) {
  std::string kept;
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, end - at);
    int step = 0, total = 0;
    if (std::sscanf(line.c_str(), "step %d/%d |", &step, &total) != 2) kept += line + '\n';
    at = end + 1;
  }
  return kept.size() <= bytes ? kept : "..." + kept.substr(kept.size() - bytes);
}

std::string proc_file(pid_t pid, const char* name) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/" + name, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Polls `ready` every 20 ms for up to `seconds`.
template <typename Ready>
bool poll(Ready ready, double seconds = kHangGuardS) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

using Job = testing::KeelJob;

// The highest N of the progress lines "step N/TOTAL | ..." in text from position `from` (-1: none).
int last_step(const std::string& text, size_t from) {
  int last = -1;
  for (size_t at = text.find("\nstep ", from); at != std::string::npos; at = text.find("\nstep ", at + 1)) {
    int step = 0, total = 0;
    if (std::sscanf(text.c_str() + at + 6, " %d/%d |", &step, &total) == 2) last = std::max(last, step);
  }
  return last;
}

// One "keel: recovered from failure K (...) in X.XX s: training resumes at step S from DIR".
struct Recovery {
  int failure = 0;
  double seconds = -1;
  int step = -1;
  std::string from;
};

std::vector<Recovery> recoveries(const std::string& text) {
  const std::string head = "keel: recovered from failure ", mid = " s: training resumes at step ";
  std::vector<Recovery> out;
  for (size_t at = text.find(head); at != std::string::npos; at = text.find(head, at + 1)) {
    const size_t end = text.find('\n', at);
    const std::string line = text.substr(at, end - at);
    Recovery r;
    r.failure = std::atoi(line.c_str() + head.size());
    const size_t m = line.find(mid);
    const size_t in = m == std::string::npos ? m : line.rfind(" in ", m);
    if (in != std::string::npos) {
      r.seconds = std::atof(line.c_str() + in + 4);
      r.step = std::atoi(line.c_str() + m + mid.size());
      const size_t from = line.find(" from ", m);
      if (from != std::string::npos) r.from = line.substr(from + 6);
    }
    out.push_back(r);
  }
  return out;
}

class Chaos : public ::testing::Test {
 protected:
  void SetUp() override {
    // Random tokens over the model's whole vocabulary, in llm.c's shard format.
    Rng rng(7);
    auto tokens = [&](size_t n) {
      std::vector<uint16_t> t(n);
      for (auto& x : t) x = static_cast<uint16_t>(rng.below(8192));
      return t;
    };
    write_token_shard(dir / "train.bin", tokens(60000));
    write_token_shard(dir / "val.bin", tokens(4000));
    const std::string train = dir / "train.bin", val = dir / "val.bin";
    testing::write_text(dir / "d4.toml",
                        "[model]\npreset = \"d4\"\n"
                        "[train]\nbatch_size = 2\nseq_len = 32\nsteps = " +
                            std::to_string(kSteps) + "\ncheckpoint_every = " + std::to_string(kCheckpointEvery) +
                            "\neval_every = 0\neval_batches = 1\nsample_tokens = 0\nlog_every = 1\n"
                            "[optim]\nlr = 1e-3\nwarmup_steps = 10\n"
                            "[data]\ntrain = \"" +
                            train + "\"\nval = \"" + val + "\"\ntokenizer = \"\"\n[runtime]\npeak_gflops = 100\n");
  }
  void TearDown() override {
    // Ranks a failed assertion left behind (the launcher is stopped by ~Job).
    poll([&] { return rank_pids().empty(); }, 30);
    for (pid_t pid : rank_pids()) ::kill(pid, SIGKILL);
  }
  // The running ranks' pids: their command lines start with the keel binary and
  // "train --config <this test's config>" (the launcher's has "launch", mpirun's starts with mpirun).
  std::vector<pid_t> rank_pids() { return testing::keel_train_pids(dir / "d4.toml"); }
  // MPI rank of a running rank process (-1 when it is gone).
  int mpi_rank(pid_t pid) {
    const std::string env = proc_file(pid, "environ");
    const std::string key = std::string("OMPI_COMM_WORLD_RANK=");
    for (size_t at = 0; at < env.size();) {
      if (env.compare(at, key.size(), key) == 0) return std::atoi(env.c_str() + at + key.size());
      const size_t end = env.find('\0', at);
      if (end == std::string::npos) break;
      at = end + 1;
    }
    return -1;
  }
  // Checkpoint directories under run_dir/ckpt that have no manifest.
  std::vector<std::string> incomplete_checkpoints(const std::string& run) {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir / (run + "/ckpt"))) {
      if (e.is_directory() && !fs::exists(e.path() / "manifest.json")) out.push_back(e.path().string());
    }
    return out;
  }
  testing::TempDir dir{"keel-chaos"};
};

TEST_F(Chaos, ThreeKillsOneInsideACheckpointWriteAreRecoveredToTheUninterruptedBytes) {
  const char* seed_env = std::getenv("KEEL_CHAOS_SEED");
  const uint64_t seed = seed_env != nullptr && *seed_env != '\0' ? std::strtoull(seed_env, nullptr, 10) : kDefaultSeed;
  std::printf("chaos seed %llu (KEEL_CHAOS_SEED=N to draw other kills)\n", static_cast<unsigned long long>(seed));

  // One OpenMP thread per rank in both runs (the same bytes need the same thread count; two ranks
  // of two threads would oversubscribe a 2-core machine). The reference saves only at the end:
  // checkpoints must not change the trajectory either.
  auto reference = testing::run_command("OMP_NUM_THREADS=1 " + std::string(KEEL_BINARY) +
                                        " launch -n 2 -- train --config " + dir / "d4.toml" +
                                        " --set train.checkpoint_every=0 --set train.run_dir=" + dir / "reference");
  ASSERT_EQ(reference.exit_code, 0) << reference.output;

  // How many chunks each rank writes (the manifest's writer layout): a rank's checkpoint file
  // operations on ckpt/step-* are create_dirs, create rR.bin, one append per chunk and plane,
  // sync, close, sync_dir; rank 0 then writes the manifest (create .tmp, append, sync, close,
  // rename) and syncs the directory.
  const auto manifest =
      nlohmann::json::parse(read_text_file(testing::newest_checkpoint(dir / "reference/ckpt") + "/manifest.json"));
  const auto& writers = manifest.at("layout").at("writers");
  ASSERT_EQ(writers.size(), 2u);

  // The plan: which of the three kills is the checkpoint-write one, and the others' moments.
  Rng rng(seed);
  const int fault_kill = static_cast<int>(rng.below(kKills));
  const int fault_rank = static_cast<int>(rng.below(2));
  const int chunks = writers[fault_rank][1].get<int>() - writers[fault_rank][0].get<int>();
  const int writer_ops = 3 * chunks + 5;
  // Rank 1: op 2 is create r1.bin, 3 .. 3n+2 the appends, 3n+4 the close; either of the run's
  // first two checkpoints. Rank 0: the first checkpoint, from create r0.bin to the manifest's
  // rename (op 3n+10); a leftover directory removed at start-up may shift this by one.
  const int checkpoint_ordinal = fault_rank == 1 ? 1 + static_cast<int>(rng.below(2)) : 1;
  const int last_op = fault_rank == 1 ? 3 * chunks + 4 : 3 * chunks + 10;
  const int fault_op = (checkpoint_ordinal - 1) * writer_ops + 2 + static_cast<int>(rng.below(last_op - 1));
  int delay_steps[kKills], kill_rank[kKills];
  for (int k = 0; k < kKills; ++k) {
    delay_steps[k] = 1 + static_cast<int>(rng.below(kMaxDelaySteps));
    kill_rank[k] = static_cast<int>(rng.below(2));
  }
  const std::string marker = dir / "fault.spent";
  const std::string fault =
      "kill:op=" + std::to_string(fault_op) + ":path=ckpt/step-:rank=" + std::to_string(fault_rank) + ":once=" + marker;
  // What op N is within its checkpoint (for the record).
  const int op_in = fault_op - (checkpoint_ordinal - 1) * writer_ops;
  const std::string file = "r" + std::to_string(fault_rank) + ".bin";
  const std::string what = op_in == 2                ? "create " + file
                           : op_in <= 3 * chunks + 2 ? "append " + std::to_string(op_in - 2) + " of " +
                                                           std::to_string(3 * chunks) + " to " + file
                           : op_in == 3 * chunks + 3 ? "sync " + file
                           : op_in == 3 * chunks + 4 ? "close " + file
                           : op_in == 3 * chunks + 5 ? "sync the directory"
                           : op_in == 3 * chunks + 6 ? "create manifest.json.tmp"
                           : op_in == 3 * chunks + 7 ? "append the manifest"
                           : op_in == 3 * chunks + 8 ? "sync the manifest"
                           : op_in == 3 * chunks + 9 ? "close the manifest"
                                                     : "rename the manifest into place";
  for (int k = 0; k < kKills; ++k) {
    if (k == fault_kill) {
      std::printf("kill %d: KEEL_FAULT=%s (op %d: %s, in the run's checkpoint %d)\n", k + 1, fault.c_str(), fault_op,
                  what.c_str(), checkpoint_ordinal);
    } else {
      std::printf("kill %d: SIGKILL rank %d %d steps after training (re)starts\n", k + 1, kill_rank[k], delay_steps[k]);
    }
  }
  std::fflush(stdout);
  // The fault is armed only in the run that starts while the marker is absent: a run that finds
  // the marker at start-up takes the plan as spent. Runs before the fault's run are disarmed.
  if (fault_kill > 0) testing::write_text(marker, "");

  Job job({"launch", "-n", "2", "--max-restarts", std::to_string(kMaxRestarts), "--", "train", "--config",
           dir / "d4.toml", "--set", "train.run_dir=" + dir / "chaos"},
          dir / "chaos.log", {"KEEL_FAULT=" + fault, "OMP_NUM_THREADS=1"});
  ASSERT_GT(job.pid(), 0);
  for (int k = 0; k < kKills; ++k) {
    // Run k+1 trains: run 1 once it has evaluated at step 0, a restarted run once it has said
    // that it recovered.
    size_t start = std::string::npos;
    ASSERT_TRUE(poll([&] {
      const std::string out = job.output();
      start = k == 0 ? after_nth(out, "| val loss", 1) : after_nth(out, "keel: recovered from failure ", k);
      return start != std::string::npos || !job.running();
    })) << "run "
        << k + 1 << " did not start training\n"
        << tail(job.output());
    ASSERT_NE(start, std::string::npos) << "the job ended before kill " << k + 1 << "\n" << tail(job.output());
    const std::string failure = "keel: launch: failure " + std::to_string(k + 1) + ": ";
    if (k == fault_kill) {
      ASSERT_TRUE(poll([&] { return job.output().find(failure) != std::string::npos || !job.running(); }))
          << tail(job.output());
      ASSERT_TRUE(fs::exists(marker)) << "KEEL_FAULT did not reach the ranks (or op " << fault_op
                                      << " was never reached)\n"
                                      << tail(job.output());
      std::printf("kill %d: KEEL_FAULT killed rank %d after step %d\n", k + 1, fault_rank,
                  last_step(job.output(), start));
      std::fflush(stdout);
      continue;
    }
    const int resumed_at = k == 0 ? 0 : recoveries(job.output()).back().step;
    const int kill_after = resumed_at + delay_steps[k];
    ASSERT_TRUE(poll([&] { return last_step(job.output(), start) >= kill_after || !job.running(); }))
        << tail(job.output());
    ASSERT_TRUE(job.running()) << "the job ended before kill " << k + 1 << "\n" << tail(job.output());
    std::vector<pid_t> pids = rank_pids();
    ASSERT_EQ(pids.size(), 2u) << tail(job.output());
    if (mpi_rank(pids[0]) != kill_rank[k]) std::swap(pids[0], pids[1]);
    ASSERT_EQ(mpi_rank(pids[0]), kill_rank[k]);
    // The next run is the fault's: arm it (this run's ranks read the marker when they started).
    if (k + 1 == fault_kill) fs::remove(marker);
    std::printf("kill %d: SIGKILL rank %d (pid %d) after step %d\n", k + 1, kill_rank[k], pids[0],
                last_step(job.output(), start));
    std::fflush(stdout);
    ASSERT_EQ(::kill(pids[0], SIGKILL), 0);
    ASSERT_TRUE(poll([&] { return job.output().find(failure) != std::string::npos || !job.running(); }))
        << tail(job.output());
  }
  const int code = job.wait(kHangGuardS);
  const std::string out = job.output();
  ASSERT_NE(code, -1) << "the job did not end\n" << tail(out);
  ASSERT_EQ(code, 0) << tail(out);

  // Every failure recovered: three restarts, each resumed from a checkpoint and said so.
  for (int k = 1; k <= kKills; ++k) {
    EXPECT_NE(out.find("keel: launch: failure " + std::to_string(k) + ": rank "), std::string::npos) << tail(out);
  }
  EXPECT_EQ(out.find("keel: launch: failure " + std::to_string(kKills + 1) + ":"), std::string::npos) << tail(out);
  EXPECT_NE(out.find("keel: launch: job succeeded after " + std::to_string(kKills) + " restart(s)\n"),
            std::string::npos)
      << tail(out);
  EXPECT_NE(out.find("keel: launch: failure " + std::to_string(fault_kill + 1) + ": rank " +
                     std::to_string(fault_rank) + " "),
            std::string::npos)
      << "the checkpoint-write kill is not the failure expected\n"
      << tail(out);
  // Every recovery, from the metrics log (its "recovery" events; stdout says the same in words).
  std::vector<Recovery> rec;
  const std::string metrics = read_text_file(dir / "chaos/metrics.jsonl");
  for (size_t at = 0; at < metrics.size();) {
    const size_t end = metrics.find('\n', at);
    const auto line = nlohmann::json::parse(metrics.substr(at, end - at));
    if (line.value("event", "") == "recovery") {
      rec.push_back(Recovery{line.at("restart").get<int>(), line.at("recovery_s").get<double>(),
                             line.at("step").get<int>(), line.at("from").get<std::string>()});
    }
    at = end == std::string::npos ? end : end + 1;
  }
  EXPECT_EQ(rec.size(), static_cast<size_t>(kKills)) << tail(metrics);
  EXPECT_EQ(recoveries(out).size(), rec.size()) << tail(out);
  for (size_t i = 0; i < rec.size(); ++i) {
    EXPECT_EQ(rec[i].failure, static_cast<int>(i) + 1) << tail(metrics);
    EXPECT_GE(rec[i].seconds, 0) << tail(metrics);
    EXPECT_EQ(rec[i].step % kCheckpointEvery, 0) << tail(metrics);
    if (rec[i].step > 0) {
      EXPECT_NE(rec[i].from.find("/chaos/ckpt/step-"), std::string::npos) << tail(metrics);
    } else {
      EXPECT_EQ(rec[i].from, "scratch") << tail(metrics);
    }
    std::printf("recovery %zu: %.2f s, training resumed at step %d from %s\n", i + 1, rec[i].seconds, rec[i].step,
                rec[i].from.c_str());
  }

  // Nothing half-written is left, and the end state is the uninterrupted run's, byte for byte.
  EXPECT_EQ(incomplete_checkpoints("chaos"), std::vector<std::string>{});
  const std::string newest = fs::path(testing::newest_checkpoint(dir / "chaos/ckpt")).filename().string();
  EXPECT_TRUE(newest.starts_with(checkpoint_name(kSteps))) << newest;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    const std::vector<char> expected = testing::checkpoint_bytes(dir / "reference/ckpt", plane);
    ASSERT_FALSE(expected.empty());
    EXPECT_TRUE(expected == testing::checkpoint_bytes(dir / "chaos/ckpt", plane))
        << "plane " << static_cast<int>(plane) << " of the final checkpoint differs from the uninterrupted run's";
  }
}

}  // namespace
}  // namespace keel
