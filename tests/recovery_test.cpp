// Recovery from memory (checkpoint.memory_every): a 2-rank `keel launch` job whose rank dies
// resumes from the ranks' copies in /dev/shm when they are newer than the newest disk checkpoint
// (from the buddy's copy when a rank's own is gone), from disk when they are not usable, never
// from another job's; either way the job ends with the bytes of a job never killed.
//
// The kills are KEEL_FAULT's (core/env.h): rank 1 dies at a chosen file operation on its memory
// copies, so every run kills at the same point. "buddy-r0-step-00000015.bin" is rank 1's rename of
// rank 0's buddy copy of step 15: both ranks' own copies of step 15 are complete by then (a rank
// sends its copy from its file, after writing it), step 16 has none.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/memory_checkpoint.h"
#include "core/fileio.h"
#include "test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::run_command;

constexpr int kSteps = 24;
constexpr const char* kKillAfterStep15 = "kill:op=1:path=buddy-r0-step-00000015.bin:rank=1";

bool contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

// The files of a memory checkpoint directory, by name.
std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += n + " ";
  return out;
}

class Recovery : public ::testing::Test {
 protected:
  // The uninterrupted job, without memory copies: its final planes, once for every repetition.
  static void SetUpTestSuite() {
    if (!reference_.empty()) return;
    const testing::TempDir shared("keel-recovery-ref");
    testing::write_toy_corpus(shared.path());
    testing::write_toy_config(shared.path(), kSteps);
    const testing::CommandResult r =
        testing::run_keel("launch -n 2 -- train --config " + shared / "toy.toml" + " --set train.eval_every=0" +
                          " --set train.checkpoint_every=10 --set train.run_dir=" + shared / "reference");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (Plane p : kSavedPlanes) reference_.push_back(testing::checkpoint_bytes(shared / "reference/ckpt", p));
  }
  void SetUp() override {
    ASSERT_EQ(reference_.size(), 3u) << "the reference job failed";
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), kSteps);
  }
  void TearDown() override { fs::remove_all(memory_checkpoint_dir(dir / "run")); }

  // `keel launch -n 2 --max-restarts R -- train` into dir/run with memory copies every step and
  // disk checkpoints every 10, with environment `env` ("NAME=value ..."), synchronously.
  testing::CommandResult launch(int restarts, const std::string& env, const std::string& extra = "") {
    return run_command(env + " " + KEEL_BINARY + " launch -n 2 --max-restarts " + std::to_string(restarts) +
                       " -- train --config " + dir / "toy.toml" +
                       " --set train.eval_every=0 --set train.checkpoint_every=10 --set checkpoint.memory_every=1"
                       " --set train.run_dir=" + dir / "run " + extra);
  }
  // The job killed after step 15 and not restarted: memory copies of steps 14 and 15, a disk
  // checkpoint of step 10.
  void kill_after_step_15(const std::string& job) {
    const testing::CommandResult r = launch(0, "KEEL_JOB_ID=" + job + " KEEL_FAULT=" + kKillAfterStep15);
    ASSERT_NE(r.exit_code, 0) << r.output;
    ASSERT_TRUE(contains(r.output, "was killed by signal 9")) << r.output;
    ASSERT_TRUE(fs::exists(shm() + "/r1-step-00000015.bin")) << joined(files_in(shm())) << r.output;
    ASSERT_TRUE(fs::exists(shm() + "/r0-step-00000015.bin")) << joined(files_in(shm()));
  }
  std::string shm() const { return memory_checkpoint_dir(dir / "run"); }
  // Whether the job's final checkpoint holds the uninterrupted job's bytes, plane by plane.
  void expect_reference_bytes() {
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(testing::checkpoint_bytes(dir / "run/ckpt", kSavedPlanes[i]) == reference_[static_cast<size_t>(i)])
          << "plane " << saved_plane_key(kSavedPlanes[i]) << " differs from the uninterrupted job's";
    }
  }
  // The run's one `event: resume` line, which must name `source`.
  nlohmann::json resume_event(const std::string& source) {
    std::vector<nlohmann::json> events;
    std::ifstream in(dir / "run/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("event", "") == "resume") events.push_back(j);
    }
    EXPECT_EQ(events.size(), 1u);
    if (events.empty()) return nlohmann::json::object();
    EXPECT_EQ(events.back().value("source", ""), source);
    return events.back();
  }

  testing::TempDir dir{"keel-recovery"};
  static std::vector<std::vector<char>> reference_;
};

std::vector<std::vector<char>> Recovery::reference_;

// (a) The launcher restarts the killed job, which resumes from both ranks' own copies of step 15
// (newer than the disk's step 10), ends with the uninterrupted job's bytes and removes its copies.
TEST_F(Recovery, RestartResumesFromMemoryWithTheSameBytes) {
  const testing::CommandResult r =
      launch(2, "KEEL_FAULT=" + std::string(kKillAfterStep15) + ":once=" + dir / "killed");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "killed")) << "the fault did not kill rank 1\n" << r.output;
  EXPECT_TRUE(contains(r.output, "keel: launch: job succeeded after 1 restart(s)")) << r.output;
  EXPECT_TRUE(contains(r.output, "keel: resumed from memory (step 15) in ")) << r.output;
  EXPECT_TRUE(contains(r.output, "2 rank(s) from their own copy, 0 from their buddy's")) << r.output;
  EXPECT_TRUE(contains(r.output, "newest disk checkpoint: step 10\n")) << r.output;
  EXPECT_FALSE(contains(r.output, "resumed from disk")) << r.output;
  EXPECT_EQ(resume_event("memory").value("step", -1), 15);
  expect_reference_bytes();
  EXPECT_FALSE(fs::exists(shm())) << "memory copies left after the job succeeded: " << joined(files_in(shm()));
}

// (b) Rank 1's own copies are gone (its host's memory, say): its buddy, rank 0, holds a copy and
// sends it; the job resumed by hand (same KEEL_JOB_ID, train.resume = auto) ends with the same bytes.
TEST_F(Recovery, ARankWithoutItsOwnCopyResumesFromItsBuddysCopy) {
  ASSERT_NO_FATAL_FAILURE(kill_after_step_15("job-b"));
  int removed = 0;
  for (const std::string& name : files_in(shm())) {
    if (name.rfind("r1-step-", 0) == 0) removed += fs::remove(shm() + "/" + name) ? 1 : 0;
  }
  ASSERT_EQ(removed, 2) << joined(files_in(shm()));
  const testing::CommandResult r = launch(2, "KEEL_JOB_ID=job-b", "--set train.resume=auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Rank 0 may not have finished keeping rank 1's step 15 when rank 1 died: then step 14.
  EXPECT_TRUE(contains(r.output, "keel: resumed from memory (step 15) in ") ||
              contains(r.output, "keel: resumed from memory (step 14) in "))
      << r.output;
  EXPECT_TRUE(contains(r.output, "1 rank(s) from their own copy, 1 from their buddy's")) << r.output;
  EXPECT_EQ(resume_event("memory").value("buddy", -1), 1);
  expect_reference_bytes();
  EXPECT_FALSE(fs::exists(shm())) << joined(files_in(shm()));
}

// (c) Both copies of rank 1 unusable (its own gone, its buddy's with a flipped byte): the job
// resumes from the disk checkpoint of step 10, with the same bytes in the end.
TEST_F(Recovery, BothCopiesOfARankUnusableFallsBackToDisk) {
  ASSERT_NO_FATAL_FAILURE(kill_after_step_15("job-c"));
  int flipped = 0;
  for (const std::string& name : files_in(shm())) {
    const std::string path = shm() + "/" + name;
    if (name.rfind("r1-step-", 0) == 0) fs::remove(path);
    if (name.rfind("buddy-r1-step-", 0) == 0) {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(100);
      char c = 0;
      f.read(&c, 1);
      c = static_cast<char>(c ^ 0x40);
      f.seekp(100);
      f.write(&c, 1);
      flipped++;
    }
  }
  ASSERT_GE(flipped, 1) << joined(files_in(shm()));
  const testing::CommandResult r = launch(2, "KEEL_JOB_ID=job-c", "--set train.resume=auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] memory copy of step 1")) << r.output;
  EXPECT_TRUE(contains(r.output, "is corrupt (checksum")) << r.output;
  EXPECT_TRUE(contains(r.output, "keel: not resuming from memory: ")) << r.output;
  EXPECT_TRUE(contains(r.output, "keel: resumed from disk (checkpoint " + dir / "run/ckpt/step-00000010, step 10)"))
      << r.output;
  EXPECT_FALSE(contains(r.output, "resumed from memory")) << r.output;
  EXPECT_EQ(resume_event("disk").value("step", -1), 10);
  expect_reference_bytes();
}

// (c') A copy is verified as it is restored (one pass): when rank 1's copies turn out corrupt
// halfway, rank 0 has restored its planes and rank 1 half of its own. Without a disk checkpoint
// the job starts from step 0, and what the copies wrote is gone: it ends with the bytes of a job
// never killed.
TEST_F(Recovery, ACopyFoundCorruptHalfwayLeavesNothingInTheStore) {
  ASSERT_NO_FATAL_FAILURE(kill_after_step_15("job-c2"));
  int flipped = 0;
  for (const std::string& name : files_in(shm())) {
    const std::string path = shm() + "/" + name;
    if (name.rfind("r1-step-", 0) != 0 && name.rfind("buddy-r1-step-", 0) != 0) continue;
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    const std::streamoff middle = static_cast<std::streamoff>(fs::file_size(path) / 2);
    f.seekg(middle);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x40);
    f.seekp(middle);
    f.write(&c, 1);
    flipped++;
  }
  ASSERT_GE(flipped, 2) << joined(files_in(shm()));
  fs::remove_all(dir / "run/ckpt");
  const testing::CommandResult r = launch(2, "KEEL_JOB_ID=job-c2", "--set train.resume=auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] memory copy of step 1")) << r.output;
  EXPECT_TRUE(contains(r.output, "is corrupt (checksum")) << r.output;
  EXPECT_TRUE(contains(r.output, "keel: not resuming from memory: ")) << r.output;
  EXPECT_FALSE(contains(r.output, "resumed from")) << r.output;
  expect_reference_bytes();
  EXPECT_FALSE(fs::exists(shm())) << joined(files_in(shm()));
}

// (d) Copies another job left (another KEEL_JOB_ID) are never used: reported in one line and
// removed; the job resumes from disk.
TEST_F(Recovery, AnotherJobsMemoryCopiesAreNotUsed) {
  ASSERT_NO_FATAL_FAILURE(kill_after_step_15("job-d-first"));
  const testing::CommandResult r = launch(2, "KEEL_JOB_ID=job-d-second", "--set train.resume=auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "memory copies in " + shm() +
                                     " that are not this run's (job job-d-first, this job job-d-second): removed\n"))
      << r.output;
  size_t lines = 0;
  for (size_t at = r.output.find("that are not this run's"); at != std::string::npos;
       at = r.output.find("that are not this run's", at + 1)) {
    lines++;
  }
  EXPECT_EQ(lines, 1u) << r.output;
  EXPECT_TRUE(contains(r.output, "keel: resumed from disk (checkpoint " + dir / "run/ckpt/step-00000010, step 10)"))
      << r.output;
  EXPECT_FALSE(contains(r.output, "resumed from memory")) << r.output;
  EXPECT_EQ(resume_event("disk").value("step", -1), 10);
  expect_reference_bytes();
  EXPECT_FALSE(fs::exists(shm())) << joined(files_in(shm()));
}

// (d) The same job id with another trajectory (another seed): its copies are not this run's.
TEST_F(Recovery, AnotherTrajectorysMemoryCopiesAreNotUsed) {
  ASSERT_NO_FATAL_FAILURE(kill_after_step_15("job-d-seed"));
  const testing::CommandResult r =
      launch(0, "KEEL_JOB_ID=job-d-seed", "--set train.resume=auto --set train.seed=7 --set train.steps=12");
  EXPECT_TRUE(contains(r.output, "memory copies in " + shm() + " that are not this run's (another trajectory")) << r.output;
  EXPECT_FALSE(contains(r.output, "resumed from memory")) << r.output;
  EXPECT_TRUE(files_in(shm()).empty()) << joined(files_in(shm()));
}

// (f) bf16 training state (store/bf16_state.h) under ZeRO-1, 8 steps: a rank's copy holds its own
// chunks' float32 masters and the bf16 bits of the others (read under leases that are not a
// layer's), so the job killed after step 5 and restarted from both ranks' own copies of step 5 (no
// disk checkpoint yet) ends with the bytes of the same job uninterrupted.
TEST_F(Recovery, Bf16TrainingStateResumesFromMemoryWithTheSameBytes) {
  const std::string bf16 = "--set runtime.param_dtype=bf16 --set runtime.grad_dtype=bf16 --set parallel.zero=1 "
                           "--set train.steps=8";
  const testing::CommandResult reference =
      testing::run_keel("launch -n 2 -- train --config " + dir / "toy.toml" + " --set train.eval_every=0" +
                        " --set train.checkpoint_every=10 --set train.run_dir=" + dir / "reference " + bf16);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const testing::CommandResult r =
      launch(1, "KEEL_FAULT=kill:op=1:path=buddy-r0-step-00000005.bin:rank=1:once=" + dir / "killed", bf16);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "killed")) << "the fault did not kill rank 1\n" << r.output;
  EXPECT_TRUE(contains(r.output, "keel: resumed from memory (step 5) in ")) << r.output;
  EXPECT_TRUE(contains(r.output, "2 rank(s) from their own copy, 0 from their buddy's")) << r.output;
  for (Plane p : kSavedPlanes) {
    EXPECT_TRUE(testing::checkpoint_bytes(dir / "run/ckpt", p) == testing::checkpoint_bytes(dir / "reference/ckpt", p))
        << "plane " << saved_plane_key(p) << " differs from the uninterrupted job's";
  }
}

// (e) A bad value is one line and exit 2.
TEST_F(Recovery, BadMemoryEveryIsOneLine) {
  for (const auto& [set, needle] :
       {std::pair<std::string, std::string>{"--set checkpoint.memory_every=-1", "config key 'checkpoint.memory_every': expected >= 0 (0 = off), found -1"},
        {"--set checkpoint.memory_every=x", "checkpoint.memory_every"},
        {"--set checkpoint.memory_every=2 --set model.attention_window=dynamic",
         "config key 'checkpoint.memory_every': expected 0 with model.attention_window = \"dynamic\""}}) {
    const testing::CommandResult r =
        testing::run_keel("train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "bad " + set);
    EXPECT_EQ(r.exit_code, 2) << set << "\n" << r.output;
    EXPECT_EQ(testing::count_lines(r.output), 1) << set << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, needle)) << set << "\n" << r.output;
  }
}

}  // namespace
}  // namespace keel
