// Hardening: a run never loses another's work, failures are reported truthfully, signals stop a
// run cleanly. Every test here runs the real `keel` binary (or `keel launch` over OpenMPI) on real
// files, as a careless or hostile user would.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "ckpt/checkpoint.h"
#include "ckpt/run_directory.h"
#include "core/config.h"
#include "core/fileio.h"
#include "model/gpt.h"
#include "runtime/stop_signal.h"
#include "store/chunk_store.h"
#include "test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;

bool contains(const std::string& haystack, const std::string& needle) { return haystack.find(needle) != std::string::npos; }

// Lines of `text` that contain `needle`.
int lines_with(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    n += text.substr(at, end - at).find(needle) != std::string::npos;
    at = end + 1;
  }
  return n;
}

std::vector<std::string> step_dirs(const std::string& root) {
  std::vector<std::string> out;
  if (!fs::is_directory(root)) return out;
  for (const auto& e : fs::directory_iterator(root)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<nlohmann::json> metrics_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  const std::string text = read_text_file(path);
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    if (end > at) out.push_back(nlohmann::json::parse(text.substr(at, end - at)));
    at = end + 1;
  }
  return out;
}

class Hardening : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 8);
  }
  // `keel train` (ranks = 0) or `keel launch -n ranks -- train` into dir/run.
  CommandResult train(const std::string& run, const std::string& extra, int ranks = 0, const std::string& env = "") {
    return testing::run_command(env + " " + command(run, extra, ranks));
  }
  std::string command(const std::string& run, const std::string& extra, int ranks = 0) const {
    const std::string args = "train --config " + dir / "toy.toml" + " --set train.batch_size=" +
                             std::to_string(ranks == 0 ? 8 : 8 / ranks) + " --set train.run_dir=" + dir / run + " " +
                             extra;
    return std::string(KEEL_BINARY) + " " + (ranks == 0 ? args : "launch -n " + std::to_string(ranks) + " -- " + args);
  }
  std::vector<std::string> job_args(const std::string& run, const std::vector<std::string>& sets, int ranks) const {
    std::vector<std::string> a;
    if (ranks > 0) a = {"launch", "-n", std::to_string(ranks), "--"};
    for (const std::string& w : {std::string("train"), std::string("--config"), dir / "toy.toml", std::string("--set"),
                                 "train.batch_size=" + std::to_string(ranks == 0 ? 8 : 8 / ranks), std::string("--set"),
                                 "train.run_dir=" + dir / run}) {
      a.push_back(w);
    }
    for (const std::string& s : sets) a.insert(a.end(), {"--set", s});
    return a;
  }
  std::string root(const std::string& run) const { return dir / (run + "/ckpt"); }
  std::string at(const std::string& run, int64_t step) const { return root(run) + "/" + checkpoint_name(step); }
  // Polls until `ready` or `seconds` pass.
  template <typename Ready>
  static bool poll(Ready ready, double seconds = 120) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (!ready()) {
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }
  testing::TempDir dir{"keel-harden"};
};

// One run per run_dir: a second trainer (one process, or a 2-rank job) is refused in one line
// naming the holder's pid; once the holder dies the kernel has released the lock.
TEST_F(Hardening, ASecondTrainerOnTheSameRunDirIsRefusedNamingTheHolder) {
  testing::KeelJob holder(job_args("busy", {"train.steps=1000000", "train.log_every=1", "train.eval_every=0"}, 0),
                          dir / "holder.log", {});
  ASSERT_GT(holder.pid(), 0);
  ASSERT_TRUE(poll([&] { return contains(holder.output(), "step      1") || !holder.running(); })) << holder.output();
  ASSERT_TRUE(holder.running()) << holder.output();
  for (int ranks : {0, 2}) {
    SCOPED_TRACE(ranks);
    const CommandResult r = train("busy", "", ranks);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "train.run_dir " + dir / "busy" + ": in use by another keel run (pid " +
                                       std::to_string(holder.pid())))
        << r.output;
    EXPECT_EQ(lines_with(r.output, "in use by another keel run"), ranks == 0 ? 1 : lines_with(r.output, "in use by"));
  }
  ::kill(holder.pid(), SIGKILL);
  holder.wait(60);
  // The dead holder's lock is gone; its run had no checkpoint and the same trajectory, so a
  // fresh start loses nothing and is allowed.
  const CommandResult r = train("busy", "");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// A fresh run never destroys an earlier run's work: refused in one line; resume=auto continues
// it; train.overwrite moves it aside, whole, never deletes it.
TEST_F(Hardening, AFreshRunNeverDestroysAnEarlierRun) {
  ASSERT_EQ(train("r", "").exit_code, 0);
  const std::string metrics = read_text_file(dir / "r/metrics.jsonl");
  const std::vector<std::string> ckpts = step_dirs(root("r"));
  ASSERT_EQ(ckpts, std::vector<std::string>{checkpoint_name(8)});

  CommandResult again = train("r", "--set train.seed=99");
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_EQ(testing::count_lines(again.output), 1) << again.output;
  EXPECT_TRUE(contains(again.output, "holds an earlier run (1 checkpoint(s), newest " + checkpoint_name(8)))
      << again.output;
  EXPECT_TRUE(contains(again.output, "train.resume=auto")) << again.output;
  EXPECT_EQ(read_text_file(dir / "r/metrics.jsonl"), metrics);
  EXPECT_EQ(step_dirs(root("r")), ckpts);
  EXPECT_NO_THROW(verify_checkpoint(root("r")));

  // resume=auto with another trajectory: nothing it can resume, and the earlier run is not its own.
  again = train("r", "--set train.seed=99 --set train.resume=auto");
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_TRUE(contains(again.output, "holds an earlier run")) << again.output;
  EXPECT_EQ(read_text_file(dir / "r/metrics.jsonl"), metrics);
  EXPECT_EQ(step_dirs(root("r")), ckpts);

  // Re-running the finished run with resume=auto: nothing to do, nothing written.
  again = train("r", "--set train.resume=auto");
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(contains(again.output, "resumed from " + at("r", 8) + " at step 8")) << again.output;
  EXPECT_EQ(step_dirs(root("r")), ckpts);
  const std::string continued = read_text_file(dir / "r/metrics.jsonl");  // + the evaluation it ran
  EXPECT_TRUE(continued.starts_with(metrics));

  again = train("r", "--set train.seed=99 --set train.overwrite=true");
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(contains(again.output, "moved to " + dir / "r.old-1")) << again.output;
  EXPECT_EQ(read_text_file(dir / "r.old-1/metrics.jsonl"), continued);
  EXPECT_NO_THROW(verify_checkpoint(dir / "r.old-1/ckpt/" + checkpoint_name(8)));
  EXPECT_NO_THROW(verify_checkpoint(at("r", 8)));
  EXPECT_NE(testing::checkpoint_bytes(root("r")), testing::checkpoint_bytes(dir / "r.old-1/ckpt"));
}

// Retention keeps the checkpoint the run just wrote even when an older run left one of a higher
// step beside it (keep = 1 would otherwise delete the new one at once).
TEST_F(Hardening, RetentionNeverDeletesTheCheckpointJustWritten) {
  ASSERT_EQ(train("a", "--set train.checkpoint_every=4").exit_code, 0);
  fs::create_directories(root("b"));
  fs::copy(at("a", 8), root("b") + "/" + checkpoint_name(100), fs::copy_options::recursive);
  const CommandResult r =
      train("b", "--set train.steps=6 --set checkpoint.keep=1 --set train.resume=" + at("a", 4));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(at("b", 6) + "/manifest.json")) << r.output;
  EXPECT_NO_THROW(verify_checkpoint(at("b", 6)));
}

// The summary tells the truth: with the disk full for the final checkpoint the run exits 3 and
// names the newest checkpoint that exists and verifies.
TEST_F(Hardening, AFinalCheckpointThatCannotBeWrittenExitsNonZeroAndTheSummaryNamesWhatExists) {
  ASSERT_EQ(train("ok", "--set train.checkpoint_every=4").exit_code, 0);
  const uint64_t room = fs::file_size(at("ok", 4) + "/r0.bin") + fs::file_size(at("ok", 4) + "/manifest.json") + 4096;
  const CommandResult r = train("full", "--set train.checkpoint_every=4", 0,
                                "KEEL_FAULT=full:bytes=" + std::to_string(room) + ":path=ckpt");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(contains(r.output, "the final checkpoint (step 8) was not written; newest checkpoint: " + at("full", 4)))
      << r.output;
  EXPECT_TRUE(contains(r.output, "; checkpoint " + at("full", 4) + "\n")) << r.output;
  // keel launch does not restart it blindly.
  const CommandResult launched = testing::run_command(
      "KEEL_FAULT=full:bytes=" + std::to_string(room) + ":path=ckpt " + std::string(KEEL_BINARY) +
      " launch -n 1 --max-restarts 2 -- train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "full3" +
      " --set train.checkpoint_every=4");
  EXPECT_NE(launched.exit_code, 0) << launched.output;
  EXPECT_TRUE(contains(launched.output, "not restarting: the job ended without its final checkpoint (exit 3)"))
      << launched.output;
  EXPECT_FALSE(contains(launched.output, "restart 1 of 2")) << launched.output;
}

// A NaN or infinite loss stops the run at that step, before the update, with one line and a
// non-zero exit; the newest checkpoint is the last good one. optim.skip_nonfinite_steps skips
// that many such steps instead (counted in metrics.jsonl) and stops at the next.
TEST_F(Hardening, NonFiniteStepsStopTheRunWithoutCheckpointingThem) {
  const std::string blow_up = "--set optim.lr=1e30 --set optim.warmup_steps=0 --set train.checkpoint_every=1 ";
  CommandResult r = train("nan", blow_up);
  EXPECT_EQ(r.exit_code, 4) << r.output;
  ASSERT_EQ(lines_with(r.output, "(not finite): training stopped before the update"), 1) << r.output;
  const size_t at_step = r.output.find("keel: step ");
  ASSERT_NE(at_step, std::string::npos) << r.output;
  const int bad = std::atoi(r.output.c_str() + at_step + 11);
  ASSERT_GE(bad, 2) << r.output;
  const std::vector<std::string> ckpts = step_dirs(root("nan"));
  ASSERT_FALSE(ckpts.empty());
  EXPECT_EQ(ckpts.back(), checkpoint_name(bad - 1)) << r.output;  // nothing of the bad step
  EXPECT_TRUE(contains(r.output, "newest checkpoint: " + at("nan", bad - 1))) << r.output;
  EXPECT_NO_THROW(verify_checkpoint(root("nan")));

  r = train("skip", blow_up + "--set optim.skip_nonfinite_steps=2");
  EXPECT_EQ(r.exit_code, 4) << r.output;
  EXPECT_EQ(lines_with(r.output, "skipped, no update"), 2) << r.output;
  const std::vector<nlohmann::json> lines = metrics_lines(dir / "skip/metrics.jsonl");
  int64_t skipped = -1;
  for (const nlohmann::json& l : lines) {
    if (l.contains("skipped_steps")) skipped = l.at("skipped_steps").get<int64_t>();
  }
  EXPECT_EQ(skipped, 2);

  // keel launch does not restart into the same non-finite step.
  const CommandResult launched = testing::run_command(std::string(KEEL_BINARY) + " launch -n 1 --max-restarts 2 -- " +
                                                      command("nan2", blow_up).substr(std::string(KEEL_BINARY).size() + 1));
  EXPECT_EQ(launched.exit_code, 4) << launched.output;
  EXPECT_TRUE(contains(launched.output, "not restarting: the job stopped at a non-finite step")) << launched.output;

  // A learning rate no float can hold is refused before anything runs.
  r = train("huge", "--set optim.lr=1e308");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "optim.lr")) << r.output;
}

// Import and eval refuse weights that are not numbers.
TEST_F(Hardening, ImportAndEvalRefuseNonFiniteWeights) {
  ASSERT_EQ(train("w", "").exit_code, 0);
  const std::string good = dir / "good.bin";
  ASSERT_EQ(testing::run_keel("export --checkpoint " + root("w") + " --out " + good).exit_code, 0);
  std::vector<char> bytes = read_file(good);
  const float nan = std::nanf("");
  std::memcpy(bytes.data() + 1024 + 4 * 100, &nan, sizeof nan);
  const std::string poisoned = dir / "nan.bin";
  write_file(poisoned, bytes.data(), bytes.size());
  CommandResult r = testing::run_keel("import --llmc " + poisoned + " --out " + dir / "imported");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "non-finite value (nan) at element 100")) << r.output;
  EXPECT_FALSE(fs::exists(dir / "imported"));

  // A checkpoint holding a NaN weight (written in-process: its records are consistent).
  Config c = Config::load(dir / "toy.toml", {});
  c.resolve();
  ChunkStore store(c.store.chunk_bytes);
  GPT model(c.model, store);
  store.finalize();
  model.init_weights(1);
  store.range_view(Plane::param, 0, store.numel())[7] = nan;
  save_checkpoint(dir / "nanckpt", store, c, RankState{}, 0);
  r = testing::run_keel("eval --checkpoint " + dir / "nanckpt" + " --data " + dir / "val.bin");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "non-finite value (nan) at element 7")) << r.output;
  EXPECT_FALSE(contains(r.output, "\"loss\"")) << r.output;
}

// SIGTERM (what Slurm and cloud preemption send) to `keel launch`: every rank finishes its step
// and writes a checkpoint, a line names it, the exit status is 143; resuming from it ends in the
// very bytes of an uninterrupted run.
TEST_F(Hardening, SigtermCheckpointsAndTheResumeIsBitIdentical) {
  // The signalled run's rank 0 sleeps 4x each layer's time (runtime.slow_rank: timing only, the
  // same bytes), so that the steps left after step 20 outlast the signal's way to it even on a
  // loaded machine (at ~2 ms a step the 380 left could end first: the job then exits 0).
  const std::vector<std::string> sets = {"train.steps=400", "train.eval_every=0", "train.log_every=1",
                                         "runtime.slow_rank=0", "runtime.slow_factor=5"};
  ASSERT_EQ(train("ref", "--set train.steps=400 --set train.eval_every=0", 2).exit_code, 0);
  testing::KeelJob job(job_args("sig", sets, 2), dir / "sig.log", {});
  ASSERT_GT(job.pid(), 0);
  ASSERT_TRUE(poll([&] { return contains(job.output(), "step     20") || !job.running(); })) << job.output();
  ASSERT_TRUE(job.running()) << "the job ended before the signal\n" << job.output();
  ::kill(job.pid(), SIGTERM);
  EXPECT_EQ(job.wait(120), 128 + SIGTERM) << job.output();
  const std::string out = job.output();
  const size_t line = out.find("keel: Terminated: stopped after step ");
  ASSERT_NE(line, std::string::npos) << out;
  const int stopped = std::atoi(out.c_str() + line + 37);
  EXPECT_GT(stopped, 0);
  EXPECT_LT(stopped, 400) << out;
  EXPECT_NO_THROW(verify_checkpoint(at("sig", stopped)));
  EXPECT_EQ(testing::newest_checkpoint(root("sig")), at("sig", stopped));
  const CommandResult r = train("sig", "--set train.steps=400 --set train.eval_every=0 --set train.resume=auto", 2);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + at("sig", stopped))) << r.output;
  for (Plane p : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_TRUE(testing::checkpoint_bytes(root("ref"), p) == testing::checkpoint_bytes(root("sig"), p))
        << "plane " << static_cast<int>(p);
  }
}

// A second stop signal does not wait for the step: the process ends at once with 128 + signal.
TEST(StopSignals, TheFirstIsAskedForTheSecondAbortsAtOnce) {
  {
    const StopSignals signals;
    Communicator& world = Communicator::world();
    EXPECT_EQ(signals.requested(world), 0);
    ::raise(SIGINT);
    EXPECT_EQ(signals.requested(world), SIGINT);
  }
  EXPECT_EXIT(
      {
        const StopSignals signals;
        ::raise(SIGTERM);
        ::raise(SIGTERM);
        std::exit(0);  // not reached
      },
      ::testing::ExitedWithCode(128 + SIGTERM), "second stop signal");
}

// Outputs never clobber: export writes only regular files, never inside a checkpoint directory,
// and says which call failed with its own errno; a directory is not a config file.
TEST_F(Hardening, OutputsNeverClobberAndADirectoryIsNotAConfig) {
  ASSERT_EQ(train("o", "").exit_code, 0);
  for (const std::string& out : {std::string("/dev/null"), dir.path(), at("o", 8) + "/r0.bin", at("o", 8) + "/x.bin"}) {
    SCOPED_TRACE(out);
    const CommandResult r = testing::run_keel("export --checkpoint " + root("o") + " --out " + out);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
  }
  struct stat st;
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_NO_THROW(verify_checkpoint(at("o", 8)));
  const CommandResult missing = testing::run_keel("export --checkpoint " + root("o") + " --out " + dir / "no/such/x.bin");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_FALSE(contains(missing.output, "(Success)")) << missing.output;
  EXPECT_TRUE(contains(missing.output, "No such file or directory")) << missing.output;
  const CommandResult config_dir = testing::run_keel("train --config " + dir.path());
  EXPECT_EQ(config_dir.exit_code, 2) << config_dir.output;
  EXPECT_TRUE(contains(config_dir.output, "is a directory")) << config_dir.output;
}

// What a user sees when something is off: every checkpoint listed with its verdict; an
// incomplete one removed with a line; a refused resume in one line however many candidates; a
// resume onto another dataset said; a capped value said.
TEST_F(Hardening, DiagnosticsListEveryVerdictAndSayWhatWasChanged) {
  ASSERT_EQ(train("d", "--set train.checkpoint_every=2 --set checkpoint.keep=4").exit_code, 0);
  ASSERT_EQ(step_dirs(root("d")).size(), 4u);
  const std::string manifest = at("d", 8) + "/manifest.json";  // the newest: no other depends on it
  fs::resize_file(manifest, fs::file_size(manifest) / 2);
  CommandResult r = testing::run_keel("checkpoints --dir " + root("d") + " --verify yes");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  for (int step : {2, 4, 6, 8}) EXPECT_TRUE(contains(r.output, checkpoint_name(step))) << r.output;
  EXPECT_EQ(lines_with(r.output, "FAILED"), 1) << r.output;
  EXPECT_EQ(lines_with(r.output, " ok"), 3) << r.output;

  fs::create_directories(at("d", 9));  // what a crash during a write leaves
  r = train("d", "--set train.resume=auto --set train.steps=10");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(lines_with(r.output, "removed " + at("d", 9) + ": an incomplete checkpoint"), 1) << r.output;

  // Another batch shape: every candidate is refused for the same reason, in one line.
  r = train("d2", "--set train.batch_size=4 --set train.resume=" + root("d"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(lines_with(r.output, "trajectory hash"), 1) << r.output;
  EXPECT_EQ(lines_with(r.output, "rejected"), 0) << r.output;

  // Another training set: said in a line.
  fs::create_directories(dir / "other");
  testing::write_toy_corpus(dir / "other");
  r = train("d3", "--set train.resume=" + at("d", 6) + " --set train.steps=9 --set data.train=" + dir / "other/train.bin");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(lines_with(r.output, "resuming onto a different training set"), 1) << r.output;

  r = testing::run_keel("eval --checkpoint " + root("d") + " --data " + dir / "val.bin" + " --batches 100000 --seq 32");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(lines_with(r.output, "--batches 100000 capped to the"), 1) << r.output;
}

// Checkpoints by the clock: rank 0's clock decides the step, every rank follows (the manifests
// have every rank's part), and resuming from one replays to the run's very bytes.
TEST_F(Hardening, CheckpointsByTheClockAreTakenByAllRanksAndResumeExactly) {
  const CommandResult r =
      train("clock", "--set train.steps=60 --set train.eval_every=0 --set checkpoint.keep=100 "
                     "--set train.checkpoint_every_minutes=0.0002", 2);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<std::string> ckpts = step_dirs(root("clock"));
  ASSERT_GE(ckpts.size(), 3u) << r.output;  // a few by the clock, and the final one
  for (const std::string& c : ckpts) {
    EXPECT_NO_THROW(verify_checkpoint(root("clock") + "/" + c));
    const auto m = nlohmann::json::parse(read_text_file(root("clock") + "/" + c + "/manifest.json"));
    EXPECT_EQ(m.at("ranks").size(), 2u) << c;
  }
  const std::string middle = root("clock") + "/" + ckpts[ckpts.size() / 2];
  const CommandResult again =
      train("clock2", "--set train.steps=60 --set train.eval_every=0 --set train.resume=" + middle, 2);
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(testing::checkpoint_bytes(root("clock")) == testing::checkpoint_bytes(root("clock2")));
}

// Another run's checkpoint never deletes this run's work. Run b is run a's twin (same config,
// hence the same trajectory) but another run: resuming b's checkpoint in a's directory is refused
// in one line naming both, and nothing of a's changes; train.overwrite moves a aside, whole.
// Resuming a's own checkpoint, also a copy of it kept elsewhere, goes on as before.
TEST_F(Hardening, AnotherRunsCheckpointNeverDeletesThisRunsWork) {
  const std::string args = "--set train.steps=6 --set train.checkpoint_every=2 --set checkpoint.keep=10 ";
  ASSERT_EQ(train("a", args).exit_code, 0);
  ASSERT_EQ(train("b", args).exit_code, 0);
  const std::vector<std::string> mine = step_dirs(root("a"));
  ASSERT_EQ(mine.size(), 3u);
  const std::string a_id = read_run_id(dir / "a"), b_id = read_run_id(dir / "b");
  ASSERT_EQ(a_id.size(), 16u);
  ASSERT_NE(a_id, b_id);  // two runs of one config are two runs
  for (const std::string& c : mine) {
    EXPECT_EQ(nlohmann::json::parse(read_text_file(root("a") + "/" + c + "/manifest.json")).at("run"), a_id);
  }
  const std::string metrics = read_text_file(dir / "a/metrics.jsonl"), config = read_text_file(dir / "a/config.toml");
  const auto state = testing::checkpoint_bytes(root("a"));

  for (int ranks : {0, 2}) {
    SCOPED_TRACE(ranks);
    const CommandResult r = train("a", args + "--set train.resume=" + at("b", 2), ranks);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    if (ranks == 0) {
      EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
      EXPECT_EQ(lines_with(r.output, "train.run_dir " + dir / "a" + ": holds run " + a_id + " (3 checkpoint(s)"), 1)
          << r.output;
      EXPECT_TRUE(contains(r.output, "train.resume=" + at("b", 2) + " is another run's checkpoint (run " + b_id + ")"))
          << r.output;
    } else {  // every rank names both (mpirun may end rank 0 before its line is out)
      EXPECT_GE(lines_with(r.output, "train.run_dir " + dir / "a" + ": holds "), 1) << r.output;
      EXPECT_EQ(lines_with(r.output, "train.run_dir " + dir / "a" + ": holds "),
                lines_with(r.output, "train.resume=" + at("b", 2)))
          << r.output;
    }
    EXPECT_EQ(step_dirs(root("a")), mine);
    EXPECT_TRUE(testing::checkpoint_bytes(root("a")) == state);
    EXPECT_EQ(read_text_file(dir / "a/metrics.jsonl"), metrics);
    EXPECT_EQ(read_text_file(dir / "a/config.toml"), config);
  }

  // Its own checkpoint, copied elsewhere, is still its own.
  fs::copy(root("a"), dir / "backup", fs::copy_options::recursive);
  CommandResult r =
      train("a", "--set train.steps=8 --set checkpoint.keep=10 --set train.resume=" + dir / "backup/" + checkpoint_name(6));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + dir / "backup/" + checkpoint_name(6) + " at step 6")) << r.output;
  EXPECT_EQ(read_run_id(dir / "a"), a_id);
  EXPECT_EQ(nlohmann::json::parse(read_text_file(at("a", 8) + "/manifest.json")).at("run"), a_id);
  const std::string continued = read_text_file(dir / "a/metrics.jsonl");

  // train.overwrite: a moves aside whole (never deleted), and a new run continues b's checkpoint.
  r = train("a", args + "--set train.overwrite=true --set train.resume=" + at("b", 2));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "moved to " + dir / "a.old-1")) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + at("b", 2) + " at step 2")) << r.output;
  EXPECT_EQ(read_text_file(dir / "a.old-1/metrics.jsonl"), continued);
  EXPECT_EQ(read_run_id(dir / "a.old-1"), a_id);
  for (int step : {2, 4, 6, 8}) EXPECT_NO_THROW(verify_checkpoint(dir / "a.old-1/ckpt/" + checkpoint_name(step)));
  const std::string new_id = read_run_id(dir / "a");
  EXPECT_NE(new_id, a_id);
  EXPECT_NE(new_id, b_id);
  EXPECT_EQ(step_dirs(root("a")), (std::vector<std::string>{checkpoint_name(4), checkpoint_name(6)}));
}

// Another run's checkpoint copied into this run's ckpt/ is not taken by train.resume = "auto" (nor
// by a restarted job), even when it is the newest there: "auto" skips it in one line and resumes
// this run's own newest, the copy is left in place, and the run continues its own trajectory (the
// same bytes as resuming its own checkpoint by name).
TEST_F(Hardening, ResumeAutoSkipsAnotherRunsCheckpointCopiedIntoThisRun) {
  const std::string args = "--set train.checkpoint_every=2 --set checkpoint.keep=10 ";
  ASSERT_EQ(train("a", args + "--set train.steps=4").exit_code, 0);
  ASSERT_EQ(train("b", args + "--set train.steps=6").exit_code, 0);
  const std::string a_id = read_run_id(dir / "a"), b_id = read_run_id(dir / "b");
  fs::copy(at("b", 6), at("a", 6), fs::copy_options::recursive);
  fs::copy(dir / "a", dir / "a2", fs::copy_options::recursive);
  fs::remove_all(at("a2", 6));
  fs::remove(dir / "a2/.keel.lock");

  for (int ranks : {0, 2}) {
    SCOPED_TRACE(ranks);
    const std::string run = ranks == 0 ? "a" : "a2";
    if (ranks == 2) fs::copy(at("b", 6), at(run, 6), fs::copy_options::recursive);
    const std::string run_id = read_run_id(dir / run);
    const CommandResult r = train(run, args + "--set train.steps=8 --set train.resume=auto", ranks);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(lines_with(r.output, "keel: checkpoint rejected: checkpoint " + at(run, 6) + ": written by run " + b_id +
                                       ", not by this directory's run " + run_id),
              1)
        << r.output;
    EXPECT_TRUE(contains(r.output, "resumed from " + at(run, 4) + " at step 4")) << r.output;
    EXPECT_EQ(nlohmann::json::parse(read_text_file(at(run, 6) + "/manifest.json")).at("run"), b_id);  // left alone
    EXPECT_EQ(nlohmann::json::parse(read_text_file(at(run, 8) + "/manifest.json")).at("run"), run_id);
  }
  // "auto" continued a's own trajectory: the same bytes as resuming a's step 4 by name.
  fs::copy(dir / "a2", dir / "a3", fs::copy_options::recursive);
  fs::remove(dir / "a3/.keel.lock");
  for (int step : {6, 8}) fs::remove_all(at("a3", step));
  ASSERT_EQ(train("a3", args + "--set train.steps=8 --set train.resume=" + at("a3", 4)).exit_code, 0);
  EXPECT_TRUE(testing::checkpoint_bytes(root("a3")) == testing::checkpoint_bytes(root("a")));  // both newest: step 8
  EXPECT_NE(a_id, b_id);
}

// Only an incomplete checkpoint known to be this run's interrupted write is removed at start-up:
// a middle checkpoint whose manifest was lost keeps its data, a file with a checkpoint's name and
// another run's leftover are left alone; each is said in one line and none is used.
TEST_F(Hardening, OnlyThisRunsInterruptedWriteIsRemovedAtStartUp) {
  ASSERT_EQ(train("d", "--set train.checkpoint_every=2 --set checkpoint.keep=10").exit_code, 0);
  ASSERT_EQ(step_dirs(root("d")).size(), 4u);
  const std::string id = read_run_id(dir / "d");
  ASSERT_EQ(id.size(), 16u);
  fs::remove(at("d", 4) + "/manifest.json");  // lost: the newer checkpoints depend on it
  const std::vector<char> data = read_file(at("d", 4) + "/r0.bin");
  write_file(at("d", 10), std::string("a user's notes\n"));
  auto leave = [&](int64_t step, const std::string& marker) {  // what a crash during a write leaves
    fs::create_directories(at("d", step) + "/" + marker);
    fs::copy_file(at("d", 2) + "/r0.bin", at("d", step) + "/r0.bin");
  };
  leave(11, run_marker("0123456789abcdef"));
  leave(12, run_marker(id));
  const CommandResult r = train("d", "--set train.checkpoint_every=2 --set checkpoint.keep=10 --set train.resume=auto");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(lines_with(r.output, "removed " + at("d", 12) + ": an incomplete checkpoint"), 1) << r.output;
  EXPECT_FALSE(fs::exists(at("d", 12)));
  EXPECT_EQ(lines_with(r.output, "keel: left "), 3) << r.output;
  for (int step : {4, 10, 11}) EXPECT_EQ(lines_with(r.output, "left " + at("d", step) + " alone"), 1) << r.output;
  EXPECT_EQ(read_file(at("d", 4) + "/r0.bin"), data);
  EXPECT_EQ(read_text_file(at("d", 10)), "a user's notes\n");
  EXPECT_TRUE(fs::exists(at("d", 11) + "/r0.bin"));
  // Step 4 lost, steps 6 and 8 depended on it: the run went on from step 2.
  EXPECT_TRUE(contains(r.output, "resumed from " + at("d", 2) + " at step 2")) << r.output;
  EXPECT_NO_THROW(verify_checkpoint(root("d") + "/" + checkpoint_name(8, 1)));
}

// No output of a keel command replaces a run directory's own files (nor writes under its ckpt/),
// also through a link; each is refused in one line and the file is untouched. Other files in a
// run's directory (its report) are fine.
TEST_F(Hardening, OutputsNeverReplaceARunDirectorysOwnFiles) {
  ASSERT_EQ(train("o", "").exit_code, 0);
  const std::string run = dir / "o";
  ASSERT_EQ(testing::run_keel("export --checkpoint " + root("o") + " --out " + dir / "model.bin").exit_code, 0);
  fs::create_symlink(run + "/metrics.jsonl", dir / "link.jsonl");
  auto files = [&] {
    return read_text_file(run + "/metrics.jsonl") + read_text_file(run + "/config.toml") +
           read_text_file(run + "/keel-run.json") + read_text_file(run + "/.keel.lock");
  };
  const std::string before = files();
  const auto state = testing::checkpoint_bytes(root("o"));
  const std::vector<std::string> commands = {
      "report " + run + " --out " + run + "/metrics.jsonl",
      "report " + run + " --out " + dir / "link.jsonl",
      "export --checkpoint " + root("o") + " --out " + run + "/metrics.jsonl",
      "export --checkpoint " + root("o") + " --out " + run + "/config.toml",
      "export --checkpoint " + root("o") + " --out " + run + "/keel-run.json",
      "export --checkpoint " + root("o") + " --out " + run + "/.keel.lock",
      "export --checkpoint " + root("o") + " --out " + run + "/ckpt/model.bin",
      "import --llmc " + dir / "model.bin" + " --out " + run + "/ckpt",
      "tokenize --input " + dir / "toy.toml" + " --out " + run + "/ckpt/data",
      "data images --from " + dir.path() + " --out " + run + "/ckpt",
      "schedule --trace " + run + "/config.toml",
      "simulate --trace " + run + "/metrics.jsonl",
  };
  for (const std::string& c : commands) {
    SCOPED_TRACE(c);
    const CommandResult r = testing::run_keel(c);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
    EXPECT_TRUE(contains(r.output, "run directory " + run + "'s own")) << r.output;
  }
  EXPECT_EQ(files(), before);
  EXPECT_TRUE(testing::checkpoint_bytes(root("o")) == state);
  EXPECT_EQ(step_dirs(root("o")), std::vector<std::string>{checkpoint_name(8)});
  const CommandResult report = testing::run_keel("report " + run);
  EXPECT_EQ(report.exit_code, 0) << report.output;
  EXPECT_TRUE(fs::exists(run + "/report.html"));
}

// A run's directory is neither the filesystem root nor inside another run's directory (its ckpt/
// or anywhere below it): refused in one line, nothing created.
TEST_F(Hardening, ARunDirectoryIsNeitherTheRootNorInsideAnotherRun) {
  CommandResult r = testing::run_keel("train --config " + dir / "toy.toml" + " --set train.run_dir=/");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
  EXPECT_TRUE(contains(r.output, "train.run_dir /: the filesystem root")) << r.output;
  EXPECT_FALSE(fs::exists("/keel-run.json"));
  ASSERT_EQ(train("outer", "").exit_code, 0);
  for (const std::string& inner : {std::string("outer/ckpt/inner"), std::string("outer/sub/inner")}) {
    SCOPED_TRACE(inner);
    r = train(inner, "");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
    EXPECT_TRUE(contains(r.output, "inside the run directory " + dir / "outer" + " (it holds .keel.lock)")) << r.output;
    EXPECT_FALSE(fs::exists(dir / inner));
  }
  EXPECT_EQ(step_dirs(root("outer")), std::vector<std::string>{checkpoint_name(8)});
}

// A manifest speaks only for its own directory: copied into another step's directory (new, or
// over that step's own manifest) it fails verification in one line naming both.
TEST_F(Hardening, AManifestCopiedIntoAnotherStepsDirectoryDoesNotVerify) {
  ASSERT_EQ(train("m", "--set train.checkpoint_every=2 --set checkpoint.keep=10").exit_code, 0);
  fs::create_directories(at("m", 10));
  fs::copy_file(at("m", 8) + "/manifest.json", at("m", 10) + "/manifest.json");
  fs::copy_file(at("m", 2) + "/manifest.json", at("m", 4) + "/manifest.json", fs::copy_options::overwrite_existing);
  const CommandResult r = testing::run_keel("checkpoints --dir " + root("m") + " --verify yes");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_GE(lines_with(r.output, "FAILED"), 2) << r.output;  // 10 and 4 (and what depends on 4)
  EXPECT_EQ(lines_with(r.output, "its manifest is that of " + checkpoint_name(8) + " (step 8), not of " +
                                     checkpoint_name(10)), 1) << r.output;
  EXPECT_GE(lines_with(r.output, "its manifest is that of " + checkpoint_name(2) + " (step 2), not of " +
                                     checkpoint_name(4)), 1) << r.output;
  EXPECT_THROW(verify_checkpoint(at("m", 10)), Error);
  EXPECT_NO_THROW(verify_checkpoint(at("m", 2)));
}

}  // namespace
}  // namespace keel
