// keel launch: its arguments, the mpirun command line of a restart, and automatic restarts of a
// 2-rank training job through the keel binary as a user runs it: a SIGKILLed rank is restarted
// from the newest checkpoint and the job ends with the same weights as one never killed; bad
// input is not restarted; more failures than --max-restarts fail the job; a launcher stopped by
// SIGTERM does not restart.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/fileio.h"
#include "runtime/launcher.h"
#include "test_util.h"


namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::run_keel;

bool contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) n++;
  return n;
}

// --- arguments and the mpirun command line -----------------------------------------------------

TEST(LaunchArgs, MaxRestartsDefaultsToZeroAndIsParsed) {
  EXPECT_EQ(parse_launch_args({"-n", "2", "--", "train"}).max_restarts, 0);
  const LaunchOptions o = parse_launch_args({"-n", "2", "--max-restarts", "3", "--", "train", "--set", "a.b=c"});
  EXPECT_EQ(o.max_restarts, 3);
  EXPECT_EQ(o.ranks, 2);
  EXPECT_EQ(o.command, (std::vector<std::string>{"train", "--set", "a.b=c"}));
  EXPECT_EQ(parse_launch_args({"--max-restarts", "0", "-n", "1", "--", "eval"}).max_restarts, 0);
}

TEST(LaunchArgs, BadMaxRestartsIsRefusedWithOneLineAndExit2) {
  for (const char* bad : {"-1", "x", "", "2.5", "3x"}) {
    EXPECT_THROW(parse_launch_args({"-n", "2", "--max-restarts", bad, "--", "train"}), Error) << bad;
  }
  EXPECT_THROW(parse_launch_args({"-n", "2", "--max-restarts"}), Error);
  for (const auto& [value, needle] : {std::pair{"-1", "expected 0..1000000 restarts, found -1"},
                                      std::pair{"x", "expected a number of restarts (0 or more), found 'x'"}}) {
    auto r = run_keel(std::string("launch -n 2 --max-restarts ") + value + " -- train");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
    EXPECT_TRUE(contains(r.output, "keel: launch --max-restarts: ")) << r.output;
    EXPECT_TRUE(contains(r.output, needle)) << r.output;
  }
  // The other launch options refuse bad values the same way.
  auto r = run_keel("launch -n two -- train");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
}

TEST(LaunchArgs, ARestartExportsTheFailureAndTrainResumesFromTheNewestCheckpoint) {
  LaunchOptions o = parse_launch_args({"-n", "2", "--max-restarts", "1", "--mca", "k", "v", "--", "train", "--set",
                                       "train.resume=x/ckpt"});
  o.keel_binary = "/bin/keel";
  const std::vector<std::string> first = mpirun_argv(o, 0), again = mpirun_argv(o, 1);
  auto exported = [](const std::vector<std::string>& argv, const std::string& name) {
    for (size_t i = 0; i + 1 < argv.size(); ++i) {
      if (argv[i] == "-x" && argv[i + 1] == name) return true;
    }
    return false;
  };
  for (const char* name : {"KEEL_RESTART", "KEEL_FAILURE_NOTICED_NS", "KEEL_FAILURE"}) {
    EXPECT_FALSE(exported(first, name)) << name;
    EXPECT_TRUE(exported(again, name)) << name;
  }
  // Every run is the command as given (a restarted trainer sees KEEL_RESTART and resumes from its
  // run_dir's newest checkpoint, else from the user's own train.resume).
  const auto binary = std::find(first.begin(), first.end(), "/bin/keel");
  ASSERT_NE(binary, first.end());
  EXPECT_EQ(std::vector<std::string>(binary, first.end()),
            (std::vector<std::string>{"/bin/keel", "train", "--set", "train.resume=x/ckpt"}));
  const auto binary_again = std::find(again.begin(), again.end(), "/bin/keel");
  ASSERT_NE(binary_again, again.end());
  EXPECT_EQ(std::vector<std::string>(binary_again, again.end()),
            (std::vector<std::string>{"/bin/keel", "train", "--set", "train.resume=x/ckpt"}));
  EXPECT_TRUE(exported(again, "OMP_NUM_THREADS"));
  // Other subcommands are run again as they were.
  o.command = {"eval", "--checkpoint", "c"};
  const std::vector<std::string> eval_again = mpirun_argv(o, 2);
  EXPECT_EQ(eval_again.back(), "c");
  EXPECT_TRUE(exported(eval_again, "KEEL_RESTART"));
}

// The values mpirun's command line gives MCA parameter `key`, in order.
std::vector<std::string> mca_values(const std::vector<std::string>& argv, const std::string& key) {
  std::vector<std::string> values;
  for (size_t i = 0; i + 2 < argv.size(); ++i) {
    if (argv[i] == "--mca" && argv[i + 1] == key) values.push_back(argv[i + 2]);
  }
  return values;
}

// A rank's death ends the others at once (no SIGTERM, then SIGKILL a second later): most of the time
// a restart waited for. A caller's own value is passed instead, once.
TEST(LaunchArgs, ALostRankEndsTheOthersAtOnceUnlessTheCallerSaysOtherwise) {
  LaunchOptions o = parse_launch_args({"-n", "2", "--", "train"});
  EXPECT_EQ(mca_values(mpirun_argv(o, 0), "odls_base_sigkill_timeout"), std::vector<std::string>{"0"});
  EXPECT_EQ(mca_values(mpirun_argv(o, 1), "odls_base_sigkill_timeout"), std::vector<std::string>{"0"});
  o = parse_launch_args({"-n", "2", "--mca", "odls_base_sigkill_timeout", "5", "--", "train"});
  EXPECT_EQ(mca_values(mpirun_argv(o, 0), "odls_base_sigkill_timeout"), std::vector<std::string>{"5"});
}

// Without an RDMA device the ranks use ob1 (UCX's and libfabric's probing is time a restart spends
// down); with one, OpenMPI chooses. A caller's own pml is passed instead, once.
TEST(LaunchArgs, WithoutAnRdmaDeviceTheRanksSkipProbingRdmaTransports) {
  LaunchOptions o = parse_launch_args({"-n", "2", "--", "train"});
  const std::vector<std::string> expected =
      rdma_devices_present() ? std::vector<std::string>{} : std::vector<std::string>{"ob1"};
  EXPECT_EQ(mca_values(mpirun_argv(o, 0), "pml"), expected);
  EXPECT_EQ(mca_values(mpirun_argv(o, 1), "pml"), expected);
  EXPECT_EQ(rdma_devices_present(), fs::exists("/sys/class/infiniband") && !fs::is_empty("/sys/class/infiniband"));
  o = parse_launch_args({"-n", "2", "--mca", "pml", "ucx", "--", "train"});
  EXPECT_EQ(mca_values(mpirun_argv(o, 0), "pml"), std::vector<std::string>{"ucx"});
}

// A restarted rank takes the SGEMM rate an earlier start measured on this host (its start-up is
// down time); a first start measures and keeps it.
TEST(LaunchArgs, ARestartReusesTheSgemmRateAFirstStartMeasured) {
  testing::TempDir dir("keel-sgemm-cache");  // this test's own cache, not the host's
  const std::string cache = dir / "keel-sgemm.json";
  ::setenv("KEEL_SGEMM_CACHE", cache.c_str(), 1);
  ::unsetenv("KEEL_RESTART");
  const double measured = sgemm_reference_gflops();
  ASSERT_GT(measured, 0);
  ASSERT_TRUE(fs::is_regular_file(cache));
  nlohmann::json kept = nlohmann::json::parse(read_text_file(cache));
  std::string key;
  for (const auto& [k, v] : kept.items()) {
    if (v.is_number() && v.get<double>() == measured) key = k;
  }
  ASSERT_FALSE(key.empty()) << kept.dump();
  kept[key] = 12345.0;  // no CPU here measures this: only the cache can say it
  const std::string text = kept.dump();
  write_file_atomic(cache, {{text.data(), text.size()}});
  ::setenv("KEEL_RESTART", "1", 1);
  EXPECT_EQ(sgemm_reference_gflops(), 12345.0);
  ::unsetenv("KEEL_RESTART");
  EXPECT_NE(sgemm_reference_gflops(), 12345.0);  // a first start measures (and keeps its own rate)
  EXPECT_NE(nlohmann::json::parse(read_text_file(cache))[key].get<double>(), 12345.0);
  ::unsetenv("KEEL_SGEMM_CACHE");
}

TEST(LaunchArgs, BadInputExits2) {
  testing::TempDir dir("keel-launch-args");
  auto r = run_keel("train --config " + dir / "missing.toml");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "missing.toml: not found")) << r.output;
  r = run_keel("eval --checkpoint " + dir / "nothing");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  r = run_keel("nonsense");
  EXPECT_EQ(r.exit_code, 2) << r.output;
}

// A training job's bad configuration is refused by `keel launch` itself, before any rank starts:
// one line naming the key (not one per rank and MPI's abort messages), exit 2.
TEST(LaunchArgs, ABadTrainingConfigIsOneLineBeforeAnyRankStarts) {
  for (const auto& [args, says] :
       std::vector<std::pair<std::string, std::string>>{
           {"--set train.steps=nope", "keel: config key 'train.steps' expects an integer, found 'nope'\n"},
           {"--set parallel.pipeline=2", "config key 'parallel.pipeline': expected a divisor of the 3 rank(s)"},
           {"--bogus 1", "keel: train: unknown option --bogus"}}) {
    const auto r = run_keel("launch -n 3 -- train " + args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_TRUE(contains(r.output, says)) << args << ": " << r.output;
    EXPECT_EQ(testing::count_lines(r.output), 1) << args << ": " << r.output;
  }
}

// --- restarting a running job ---------------------------------------------------------------------

// A `keel launch` running in the background, its stdout and stderr going to a log file; `args`
// are split at spaces (the test's paths have none).
class Job : public testing::KeelJob {
 public:
  Job(const std::string& args, const std::string& log) : KeelJob(split(args), log, {}) {}

 private:
  static std::vector<std::string> split(const std::string& args) {
    std::vector<std::string> words;
    std::istringstream in(args);
    for (std::string w; in >> w;) words.push_back(w);
    return words;
  }
};

// Polls `ready` every 20 ms for up to `seconds`.
template <typename Ready>
bool poll(Ready ready, double seconds = 120) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

std::string proc_file(pid_t pid, const char* name) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/" + name, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class Launch : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 10);
  }
  std::string train_args(const std::string& run, const std::string& extra = "") {
    return "train --config " + dir / "toy.toml" + " --set train.eval_every=0 --set train.run_dir=" + dir / run + " " +
           extra;
  }
  // The pids of the running ranks, ascending: their command lines start with the keel binary and
  // "train --config" (the launcher's has "launch", mpirun's starts with mpirun).
  std::vector<pid_t> rank_pids() { return testing::keel_train_pids(dir / "toy.toml"); }
  // Waits until run number `run` (1 = the first) of the job trains, i.e. has printed its first
  // evaluation (a rank killed while MPI starts up can make OpenMPI 4.1's mpirun hang: not what
  // these tests are about), and returns its two ranks, none of which is in `old`.
  std::vector<pid_t> wait_for_training(const Job& job, size_t run, const std::vector<pid_t>& old = {}) {
    std::vector<pid_t> pids;
    poll([&] {
      if (count(job.output(), "| val loss") < run) return false;
      pids = rank_pids();
      return pids.size() == 2 && std::none_of(pids.begin(), pids.end(), [&](pid_t p) {
               return std::find(old.begin(), old.end(), p) != old.end();
             });
    });
    return pids;
  }
  // Whether run_dir/ckpt holds a complete checkpoint (its manifest is written last, whatever the
  // checkpoint layout below ckpt/).
  bool has_checkpoint(const std::string& run) {
    std::error_code ec;
    for (fs::recursive_directory_iterator it(dir / (run + "/ckpt"), ec), end; !ec && it != end; it.increment(ec)) {
      if (it->path().filename() == "manifest.json") return true;
    }
    return false;
  }
  // The final parameters, through `keel export` (llm.c's fp32 layout: independent of the
  // checkpoint format).
  std::vector<char> final_params(const std::string& run) {
    const std::string out = dir / (run + ".llmc.bin");
    auto r = run_keel("export --checkpoint " + dir / (run + "/ckpt") + " --out " + out);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return read_file(out);
  }
  testing::TempDir dir{"keel-launch"};
};

// SIGKILL one rank once a checkpoint exists: the launcher says so, restarts the job from the
// checkpoint, and the job ends with the bytes of a run never killed.
TEST_F(Launch, KilledRankIsRestartedFromTheNewestCheckpointAndReplaysExactly) {
  const std::string extra = "--set train.steps=80 --set train.checkpoint_every=10";
  auto reference = run_keel("launch -n 2 -- " + train_args("reference", extra));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;

  Job job("launch -n 2 --max-restarts 2 -- " + train_args("killed", extra), dir / "killed.log");
  ASSERT_GT(job.pid(), 0);
  ASSERT_TRUE(poll([&] { return has_checkpoint("killed") || job.wait(0) >= 0; })) << job.output();
  const std::vector<pid_t> ranks = rank_pids();
  ASSERT_EQ(ranks.size(), 2u) << "the job ended before a rank could be killed\n" << job.output();
  ASSERT_EQ(::kill(ranks[1], SIGKILL), 0);
  const int code = job.wait(120);
  const std::string out = job.output();
  ASSERT_EQ(code, 0) << out;
  EXPECT_TRUE(contains(out, "keel: launch: failure 1: rank ")) << out;
  EXPECT_TRUE(contains(out, "was killed by signal 9 (Killed); restart 1 of 2 from the newest checkpoint\n")) << out;
  EXPECT_TRUE(contains(out, "keel: launch: job succeeded after 1 restart(s)\n")) << out;
  EXPECT_FALSE(contains(out, "failure 2:")) << out;
  // The first start measures the SGEMM reference; the restart says it took the rate kept from a start.
  EXPECT_TRUE(contains(out, "matmul efficiency against SGEMM measured now")) << out;
  EXPECT_TRUE(contains(out, "matmul efficiency against SGEMM as an earlier start on this host measured it")) << out;
  // The second run resumed from a checkpoint (a fresh start would truncate the metrics) and
  // logged its recovery.
  const std::string metrics = read_text_file(dir / "killed/metrics.jsonl");
  bool resumed = false;
  for (size_t start = 0; start < metrics.size();) {
    const size_t end = metrics.find('\n', start);
    const auto line = nlohmann::json::parse(metrics.substr(start, end - start));
    if (line.value("event", "") == "recovery" && line["step"].get<int>() > 0 && line["step"].get<int>() < 80 &&
        line["from"].get<std::string>().find("/ckpt/step-") != std::string::npos) {
      resumed = true;
    }
    start = end == std::string::npos ? end : end + 1;
  }
  EXPECT_TRUE(resumed) << metrics;

  const std::vector<char> expected = final_params("reference"), got = final_params("killed");
  ASSERT_FALSE(expected.empty());
  EXPECT_TRUE(expected == got) << "the restarted job's final weights differ from the uninterrupted job's";
}

// Bad input fails the same way every time: exit 2 at once, no restart.
TEST_F(Launch, BadInputIsNotRestarted) {
  auto r = run_keel("launch -n 2 --max-restarts 1 -- " +
                    train_args("bad", "--set data.train=" + dir / "missing.bin"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "missing.bin")) << r.output;
  EXPECT_TRUE(contains(r.output, "keel: launch: not restarting: the job was refused its input (exit 2)\n")) << r.output;
  EXPECT_FALSE(contains(r.output, "failure 1:")) << r.output;
  EXPECT_FALSE(contains(r.output, "restart 1 of")) << r.output;
}

// More failures than --max-restarts: the restarted ranks get the failure in their environment
// and resume; the second kill fails the job, naming the last failure.
TEST_F(Launch, MoreFailuresThanMaxRestartsFailTheJob) {
  Job job("launch -n 2 --max-restarts 1 -- " + train_args("twice", "--set train.steps=100000"), dir / "twice.log");
  ASSERT_GT(job.pid(), 0);
  const std::vector<pid_t> first = wait_for_training(job, 1);
  ASSERT_EQ(first.size(), 2u) << job.output();
  const auto before_kill_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count();
  ASSERT_EQ(::kill(first[1], SIGKILL), 0);

  const std::vector<pid_t> second = wait_for_training(job, 2, first);
  ASSERT_EQ(second.size(), 2u) << job.output();
  for (pid_t pid : second) {
    const std::string env = proc_file(pid, "environ"), cmdline = proc_file(pid, "cmdline");
    EXPECT_TRUE(contains(env, std::string("KEEL_RESTART=1") + '\0')) << pid;
    EXPECT_TRUE(contains(env, "KEEL_FAILURE=rank ")) << env;
    EXPECT_TRUE(contains(env, "was killed by signal 9 (Killed)")) << env;
    const size_t at = env.find("KEEL_FAILURE_NOTICED_NS=");
    ASSERT_NE(at, std::string::npos);
    const long long noticed_ns = std::stoll(env.substr(at + 24));
    EXPECT_GE(noticed_ns, before_kill_ns);
  }
  ASSERT_EQ(::kill(second[0], SIGKILL), 0);
  const int code = job.wait(120);
  const std::string out = job.output();
  EXPECT_NE(code, 0) << out;
  EXPECT_NE(code, -1) << "keel launch did not exit after the second kill\n" << out;
  EXPECT_TRUE(contains(out, "keel: launch: failure 1: rank ")) << out;
  EXPECT_TRUE(contains(out, "was killed by signal 9 (Killed); restart 1 of 1 from the newest checkpoint\n")) << out;
  EXPECT_TRUE(contains(out, "keel: launch: job failed after 1 restart(s): rank ")) << out;
  EXPECT_FALSE(contains(out, "failure 2:")) << out;
  EXPECT_FALSE(contains(out, "succeeded")) << out;
}

// A user's SIGTERM (or Ctrl-C) to the launcher stops the job for good.
TEST_F(Launch, StoppedJobIsNotRestarted) {
  Job job("launch -n 2 --max-restarts 3 -- " + train_args("stopped", "--set train.steps=100000"), dir / "stopped.log");
  ASSERT_GT(job.pid(), 0);
  ASSERT_EQ(wait_for_training(job, 1).size(), 2u) << job.output();
  ASSERT_EQ(::kill(job.pid(), SIGTERM), 0);
  const int code = job.wait(120);
  const std::string out = job.output();
  EXPECT_NE(code, -1) << "keel launch did not exit after SIGTERM\n" << out;
  // The ranks stopped cleanly (a checkpoint, the conventional status), and nothing restarts them.
  EXPECT_EQ(code, 128 + SIGTERM) << out;
  EXPECT_TRUE(contains(out, "keel: Terminated: stopped after step ")) << out;
  EXPECT_TRUE(contains(out, "keel: launch: stopped by signal 15 (Terminated): the job stopped cleanly")) << out;
  EXPECT_FALSE(contains(out, "failure 1:")) << out;
  EXPECT_TRUE(poll([&] { return rank_pids().empty(); }, 20)) << "ranks left running after the launcher exited";
}

}  // namespace
}  // namespace keel
