// Keel under a real Slurm: each test starts munged, slurmctld and slurmd on this host (a generated
// slurm.conf, a fresh munge key and all state in a temporary directory, one node with this
// machine's CPUs), runs Keel jobs with the README's `srun` line and `sbatch` script, and stops the
// daemons and removes their state however the test ends. A data-parallel job (and data x
// pipeline) started by Slurm ends with the losses and weights of the same job under `keel
// launch`; a step without PMIx and a task count that does not fit the layout are refused in one
// line with exit 2. Without root or without Slurm installed (scripts/setup.sh installs it) the
// tests are skipped, saying why.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>
#include <nlohmann/json.hpp>

#include "core/fileio.h"
#include "test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::run_command;

bool contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

// A TCP port nobody listens on now (the kernel's pick), for a daemon to bind.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  if (fd >= 0) ::close(fd);
  return ok ? ntohs(a.sin_port) : 0;
}

// Why this host cannot run a Slurm of its own, or "" when it can.
std::string missing_prerequisite() {
  if (::geteuid() != 0) return "slurmctld and slurmd run here as root (SlurmUser=root); this test runs as uid " +
                                std::to_string(::geteuid());
  for (const char* tool : {"munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo"}) {
    if (run_command(std::string("command -v ") + tool).exit_code != 0) {
      return std::string(tool) + " is not installed (scripts/setup.sh installs slurm-wlm and munge)";
    }
  }
  return "";
}

// The lines of `text` that Keel wrote (Slurm's own, "srun: ..." and sbatch's job number, left out).
std::vector<std::string> keel_lines(const std::string& text) {
  std::vector<std::string> lines;
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, end - at);
    if (!line.empty() && !line.starts_with("srun: ") && !line.starts_with("Submitted batch job ")) lines.push_back(line);
    at = end + 1;
  }
  return lines;
}

// A single-node Slurm cluster owned by this process: munged, slurmctld and slurmd in the
// foreground as its children (each dies with it: PR_SET_PDEATHSIG), their configuration, keys,
// sockets, logs and state under one directory. Commands reach it through env().
class SlurmCluster {
 public:
  explicit SlurmCluster(const std::string& dir) : dir_(dir) {}
  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;
  ~SlurmCluster() { stop(); }

  // Starts the daemons and waits until sinfo shows the node idle; "" on success, else what failed.
  std::string start() {
    end_leftovers();
    const std::string munge = dir_ + "/munge";
    fs::create_directories(munge);
    fs::permissions(munge, fs::perms::owner_all);
    for (const char* sub : {"ctld", "spool"}) fs::create_directories(dir_ + "/" + sub);
    if (run_command("dd if=/dev/urandom of=" + munge + "/munge.key bs=1024 count=1 status=none && chmod 400 " + munge +
                    "/munge.key")
            .exit_code != 0) {
      return "cannot write a munge key";
    }
    const std::string host = trim(run_command("hostname -s").output);
    const int ctld_port = free_port(), slurmd_port = free_port();
    if (host.empty() || ctld_port == 0 || slurmd_port == 0) return "no host name or free port";
    // Four CPUs at least, whatever this machine has (slurmd takes the configured count:
    // config_overrides): a data x pipeline job of four ranks oversubscribes two cores.
    const std::string cpus = std::to_string(std::max(4u, std::thread::hardware_concurrency()));
    // Job ids distinct from another cluster's on this host (two tests at once): PMIx names its
    // namespaces after them.
    const std::string first_job = std::to_string(1 + (::getpid() % 60000) * 1000);
    testing::write_text(
        conf(), "ClusterName=keeltest\nSlurmctldHost=" + host + "\nSlurmctldPort=" + std::to_string(ctld_port) +
                    "\nSlurmdPort=" + std::to_string(slurmd_port) +
                    "\nAuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket=" + munge + "/socket" +
                    "\nSlurmUser=root\nSlurmdUser=root\nStateSaveLocation=" + dir_ + "/ctld\nSlurmdSpoolDir=" + dir_ +
                    "/spool\nSlurmctldPidFile=" + dir_ + "/slurmctld.pid\nSlurmdPidFile=" + dir_ +
                    "/slurmd.pid\nSlurmctldLogFile=" + dir_ + "/slurmctld.log\nSlurmdLogFile=" + dir_ +
                    "/slurmd.log\nFirstJobId=" + first_job +
                    // No cgroups in a container: processes are tracked by their parent, not confined.
                    "\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nMpiDefault=none"
                    "\nSchedulerType=sched/builtin\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU"
                    // A loaded machine (the whole suite at -j2) answers RPCs slowly: Slurm's
                    // 10 s default message timeout would fail a job that is only waiting.
                    "\nMessageTimeout=100"
                    // `sbatch --wait` polls after 2 s, then 4x longer while that stays under half of
                    // MinJobAge (at most 32 s): 16 keeps it at 8 s (a finished job waited for up to
                    // 8 s, not 32), with 8 s to spare before the finished job's record is purged.
                    "\nMinJobAge=16"
                    "\nReturnToService=2\nSlurmdParameters=config_overrides\nJobAcctGatherType=jobacct_gather/none"
                    "\nAccountingStorageType=accounting_storage/none\nNodeName=" + host + " CPUs=" + cpus +
                    " State=UNKNOWN\nPartitionName=keel Nodes=" + host + " Default=YES MaxTime=INFINITE State=UP\n");
    munged_ = spawn({"munged", "--foreground", "--force", "--socket=" + munge + "/socket", "--key-file=" + munge +
                     "/munge.key", "--pid-file=" + munge + "/pid", "--log-file=" + munge + "/log",
                     "--seed-file=" + munge + "/seed"});
    if (!poll([&] { return fs::exists(munge + "/socket"); })) return "munged did not start: " + log("munge/log");
    slurmctld_ = spawn({"slurmctld", "-D", "-f", conf()});
    slurmd_ = spawn({"slurmd", "-D", "-f", conf()});
    std::string state;
    if (!poll([&] {
          state = trim(run_command(env() + "sinfo -h -o %T").output);
          return state == "idle";
        })) {
      return "the node is not idle (sinfo: '" + state + "')\n" + log("slurmctld.log") + log("slurmd.log");
    }
    return "";
  }

  // The environment prefix of a command that talks to this cluster.
  std::string env() const { return "SLURM_CONF=" + conf() + " " + owner_mark() + " "; }

  // Ends every job, then the daemons, and removes nothing (the caller's TempDir does).
  void stop() {
    if (slurmctld_ > 0 && slurmd_ > 0) {
      run_command(env() + "scancel --full --user=root");
      poll([&] { return trim(run_command(env() + "squeue -h -o %i").output).empty(); }, 20);
    }
    for (pid_t* pid : {&slurmd_, &slurmctld_, &munged_}) {
      if (*pid <= 0) continue;
      ::kill(*pid, SIGTERM);
      int status = 0;
      if (!poll([&] { return ::waitpid(*pid, &status, WNOHANG) == *pid; }, 10)) {
        ::kill(*pid, SIGKILL);
        ::waitpid(*pid, &status, 0);
      }
      *pid = -1;
    }
  }

  std::string log(const std::string& name) const {
    std::ifstream in(dir_ + "/" + name);
    return "--- " + name + ":\n" + std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

 private:
  std::string conf() const { return dir_ + "/slurm.conf"; }

  static std::string trim(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
  }

  // Polls `ready` every 50 ms for up to `seconds` (a bound on a hang, not a timing assertion).
  template <typename Ready>
  static bool poll(Ready ready, double seconds = 60) {
    return testing::poll_until(ready, seconds, 50);
  }

  // Every process of this cluster carries this in its environment: the daemons, and through the
  // commands' environment (env()) sbatch, srun and the job's tasks. (slurmstepd overwrites its
  // environment with its title; it is known by its log, open in the cluster's directory.)
  static std::string owner_mark() { return "KEEL_SLURM_TEST_OWNER=" + std::to_string(::getpid()); }

  // A test process killed outright (a ctest timeout) cannot stop its cluster: its daemons die with
  // it (PR_SET_PDEATHSIG), but sbatch, srun, slurmstepd and the job's tasks, and the state
  // directory, stay. Ends every process of a cluster whose owner no longer runs, and removes its
  // directory (TempDir's: /tmp/keel-slurm-PID-N).
  static void end_leftovers() {
    auto gone = [](const std::string& pid) {
      return !pid.empty() && pid.find_first_not_of("0123456789") == std::string::npos && ::kill(std::stoi(pid), 0) != 0 &&
             errno == ESRCH;
    };
    const std::string mark = "KEEL_SLURM_TEST_OWNER=", dir = (fs::temp_directory_path() / "keel-slurm-").string();
    // The owner a process belongs to, by its environment or by a file it holds open; "" = none.
    auto owner = [&](const fs::path& proc) -> std::string {
      std::ifstream in(proc / "environ", std::ios::binary);
      for (std::string var; std::getline(in, var, '\0');) {
        if (var.starts_with(mark)) return var.substr(mark.size());
      }
      std::error_code ec;
      for (const fs::directory_entry& fd : fs::directory_iterator(proc / "fd", ec)) {
        const std::string target = fs::read_symlink(fd.path(), ec).string();
        if (!ec && target.starts_with(dir)) return target.substr(dir.size(), target.find('-', dir.size()) - dir.size());
      }
      return "";
    };
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator("/proc", ec)) {
      const std::string pid = e.path().filename();
      if (pid.find_first_not_of("0123456789") == std::string::npos && gone(owner(e.path()))) ::kill(std::stoi(pid), SIGKILL);
    }
    for (const fs::directory_entry& e : fs::directory_iterator(fs::temp_directory_path(), ec)) {
      const std::string path = e.path().string();
      if (path.starts_with(dir) && gone(path.substr(dir.size(), path.find('-', dir.size()) - dir.size()))) {
        fs::remove_all(e.path(), ec);
      }
    }
  }

  // A daemon in the foreground, its output in dir/NAME.out, ended with this process.
  pid_t spawn(const std::vector<std::string>& args) {
    const std::string out = dir_ + "/" + args[0] + ".out";
    const pid_t parent = ::getpid();
    const std::string mark = owner_mark();
    const pid_t child = ::fork();
    if (child == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      ::setsid();
      ::putenv(const_cast<char*>(mark.c_str()));
      std::FILE* f = std::fopen(out.c_str(), "w");
      if (f != nullptr) {
        ::dup2(::fileno(f), STDOUT_FILENO);
        ::dup2(::fileno(f), STDERR_FILENO);
      }
      std::vector<char*> argv;
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      ::_exit(127);
    }
    return child;
  }

  std::string dir_;
  pid_t munged_ = -1, slurmctld_ = -1, slurmd_ = -1;
};

// The README's command that starts `program` (the first line beginning with it in a code block),
// with the paths this test uses: build/keel is the keel binary under test, scripts/ the source
// tree's, configs/default.toml the toy configuration.
std::string readme_command(const std::string& program, const std::string& config) {
  const std::string readme = read_text_file(testing::source_path("README.md"));
  for (size_t at = 0; at < readme.size();) {
    const size_t end = std::min(readme.find('\n', at), readme.size());
    std::string line = readme.substr(at, end - at);
    at = end + 1;
    if (!line.starts_with(program + " ")) continue;
    auto replace = [&](const std::string& from, const std::string& to) {
      for (size_t p = line.find(from); p != std::string::npos; p = line.find(from, p + to.size())) {
        line.replace(p, from.size(), to);
      }
    };
    replace("build/keel", KEEL_BINARY);
    replace("scripts/", testing::source_path("scripts/"));
    replace("configs/default.toml", config);
    return line;
  }
  return "";
}

class Slurm : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string missing = missing_prerequisite();
    if (!missing.empty()) GTEST_SKIP() << missing;
    const std::string failed = cluster.start();
    ASSERT_EQ(failed, "") << failed;
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), kSteps);
    srun = readme_command("srun", dir / "toy.toml");
    sbatch = readme_command("sbatch", dir / "toy.toml");
    ASSERT_TRUE(contains(srun, "srun --mpi=pmix -n 2 ")) << "README's srun line: " << srun;
    ASSERT_TRUE(contains(sbatch, "sbatch --wait --ntasks=2 ") && contains(sbatch, "keel.sbatch"))
        << "README's sbatch line: " << sbatch;
  }
  // The README's srun line with `tasks` tasks and Keel's extra arguments.
  std::string srun_command(int tasks, const std::string& keel_args) const {
    std::string line = srun;
    line.replace(line.find("-n 2 "), 5, "-n " + std::to_string(tasks) + " ");
    return cluster.env() + line + " " + keel_args;
  }
  // The README's sbatch line, its output in dir/NAME.out, with `tasks` tasks and Keel's extra arguments;
  // returns the exit code and the job's output.
  testing::CommandResult run_sbatch(const std::string& name, int tasks, const std::string& keel_args) const {
    std::string line = sbatch;
    const std::string out = dir / (name + ".out");
    line.replace(line.find("--ntasks=2 "), 11, "--ntasks=" + std::to_string(tasks) + " --output=" + out + " ");
    testing::CommandResult r = run_command(cluster.env() + "KEEL=" + KEEL_BINARY + " " + line + " " + keel_args);
    r.output += read_text_file(out);
    return r;
  }
  std::string run_args(const std::string& run, const std::string& extra = "") const {
    return "--set train.eval_every=0 --set train.run_dir=" + dir / run + " " + extra;
  }
  // The layout a run's metrics.jsonl says it trained with (its "run" event).
  nlohmann::json layout(const std::string& run) const {
    const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
      if (j.value("event", "") == "run") return j["layout"];
      at = end + 1;
    }
    return nullptr;
  }
  void expect_same_job(const std::string& expected, const std::string& run) {
    EXPECT_EQ(layout(run), layout(expected)) << run;
    const std::vector<double> want = testing::step_losses(dir / (expected + "/metrics.jsonl"));
    ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
    EXPECT_EQ(testing::step_losses(dir / (run + "/metrics.jsonl")), want) << run;
    EXPECT_TRUE(testing::checkpoint_bytes(dir / (expected + "/ckpt")) == testing::checkpoint_bytes(dir / (run + "/ckpt")))
        << run << "'s final weights differ from " << expected << "'s";
  }

  static constexpr int kSteps = 4;
  testing::TempDir dir{"keel-slurm"};
  SlurmCluster cluster{dir / "slurm"};
  std::string srun, sbatch;
};

// Two ranks, data-parallel: Slurm's tasks are the ranks of one job (trained alone, each task
// would end with other weights), under srun and under sbatch as under keel launch, and keel
// launch itself inside an sbatch allocation.
TEST_F(Slurm, DataParallelJobUnderSrunAndSbatchEqualsKeelLaunch) {
  const std::string toy = "train --config " + dir / "toy.toml" + " ";
  auto launched = testing::run_keel("launch -n 2 -- " + toy + run_args("launch"));
  ASSERT_EQ(launched.exit_code, 0) << launched.output;

  auto r = run_command(srun_command(2, run_args("srun")));
  ASSERT_EQ(r.exit_code, 0) << r.output << cluster.log("slurmd.log");
  expect_same_job("launch", "srun");

  r = run_sbatch("sbatch", 2, run_args("sbatch"));
  ASSERT_EQ(r.exit_code, 0) << r.output << cluster.log("slurmctld.log");
  expect_same_job("launch", "sbatch");
  EXPECT_EQ(layout("sbatch")["ranks"], 2) << layout("sbatch").dump();
  EXPECT_EQ(layout("sbatch")["data"], 2) << layout("sbatch").dump();

  // keel launch inside an allocation: its ranks are mpirun's, whatever SLURM_* they inherit.
  r = run_command(cluster.env() + "sbatch --wait --ntasks=2 --output=" + dir / "inside.out" + " --wrap '" +
                  KEEL_BINARY + " launch -n 2 -- " + toy + run_args("inside") + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output << read_text_file(dir / "inside.out");
  expect_same_job("launch", "inside");
}

// Data 2 x pipeline 2: four tasks, rank r = task r (rank = replica x 2 + stage), under srun and sbatch.
TEST_F(Slurm, DataTimesPipelineJobUnderSrunAndSbatchEqualsKeelLaunch) {
  const std::string layout = "--set parallel.pipeline=2 --set parallel.data=2";
  auto launched = testing::run_keel("launch -n 4 -- train --config " + dir / "toy.toml" + " " + run_args("launch", layout));
  ASSERT_EQ(launched.exit_code, 0) << launched.output;
  auto r = run_command(srun_command(4, run_args("srun", layout)));
  ASSERT_EQ(r.exit_code, 0) << r.output << cluster.log("slurmd.log");
  expect_same_job("launch", "srun");
  r = run_sbatch("sbatch", 4, run_args("sbatch", layout));
  ASSERT_EQ(r.exit_code, 0) << r.output << cluster.log("slurmctld.log");
  expect_same_job("launch", "sbatch");
}

// Data 2 x tensor 2: four tasks, tensor innermost (rank = replica x 2 + tensor rank), under srun and
// sbatch as under keel launch: same layout, losses and final (whole-layout) checkpoint bytes.
TEST_F(Slurm, DataTimesTensorJobUnderSrunAndSbatchEqualsKeelLaunch) {
  const std::string layout = "--set parallel.tensor=2 --set parallel.data=2";
  auto launched = testing::run_keel("launch -n 4 -- train --config " + dir / "toy.toml" + " " + run_args("launch", layout));
  ASSERT_EQ(launched.exit_code, 0) << launched.output;
  EXPECT_EQ(this->layout("launch")["tensor"], 2) << this->layout("launch").dump();
  EXPECT_EQ(this->layout("launch")["data"], 2) << this->layout("launch").dump();
  auto r = run_command(srun_command(4, run_args("srun", layout)));
  ASSERT_EQ(r.exit_code, 0) << r.output << cluster.log("slurmd.log");
  expect_same_job("launch", "srun");
  r = run_sbatch("sbatch", 4, run_args("sbatch", layout));
  ASSERT_EQ(r.exit_code, 0) << r.output << cluster.log("slurmctld.log");
  expect_same_job("launch", "sbatch");
}

// A step or allocation whose task count does not fit parallel.data x parallel.pipeline: one line
// from Keel naming both and the srun option that fixes it, exit 2, nothing trained.
TEST_F(Slurm, TaskCountNotFittingTheLayoutIsRefusedInOneLine) {
  auto r = run_command(srun_command(3, run_args("three", "--set parallel.data=2")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::vector<std::string> lines = keel_lines(r.output);
  ASSERT_EQ(lines.size(), 1u) << r.output;
  EXPECT_TRUE(contains(lines[0], "step of 3 tasks (SLURM_STEP_NUM_TASKS): the configured layout parallel.data = 2 x "
                                 "parallel.pipeline = 1 x parallel.tensor = 1 needs 2 tasks; start srun with -n 2"))
      << lines[0];
  EXPECT_FALSE(fs::exists(dir / "three/metrics.jsonl"));

  r = run_sbatch("odd", 3, run_args("odd", "--set parallel.pipeline=2"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::vector<std::string> odd = keel_lines(r.output);
  ASSERT_EQ(odd.size(), 1u) << r.output;
  EXPECT_TRUE(contains(odd[0], "step of 3 tasks (SLURM_STEP_NUM_TASKS): expected a multiple of parallel.pipeline x "
                               "parallel.tensor = 2"))
      << odd[0];
  EXPECT_FALSE(fs::exists(dir / "odd/metrics.jsonl"));

  // A replica is pipeline x tensor ranks.
  r = run_command(srun_command(3, run_args("tensor", "--set parallel.tensor=2")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::vector<std::string> tensor = keel_lines(r.output);
  ASSERT_EQ(tensor.size(), 1u) << r.output;
  EXPECT_TRUE(contains(tensor[0], "expected a multiple of parallel.pipeline x parallel.tensor = 2 tasks")) << tensor[0];

  // Any other refusal for the step's world size is said once too.
  r = run_command(srun_command(2, run_args("slow", "--set runtime.slow_rank=2")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::vector<std::string> slow = keel_lines(r.output);
  ASSERT_EQ(slow.size(), 1u) << r.output;
  EXPECT_TRUE(contains(slow[0], "config key 'runtime.slow_rank': expected a world rank below 2")) << slow[0];
}

// Without PMIx each task would train a job of its own (or fail inside MPI_Init): refused in one line.
TEST_F(Slurm, StepWithoutPmixIsRefusedInOneLine) {
  for (const std::string mpi : {"none", "pmi2"}) {
    std::string line = srun_command(2, run_args(mpi));
    line.replace(line.find("--mpi=pmix"), 10, "--mpi=" + mpi);
    const auto r = run_command(line);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    const std::vector<std::string> lines = keel_lines(r.output);
    ASSERT_EQ(lines.size(), 1u) << r.output;
    EXPECT_TRUE(contains(lines[0], "expected srun --mpi=pmix, found --mpi=" + mpi)) << lines[0];
    EXPECT_FALSE(fs::exists(dir / (mpi + "/metrics.jsonl")));
  }
  // keel train as the batch script of a two-task allocation: one process where two were asked for.
  const std::string script = dir / "alone.sbatch";
  testing::write_text(script, "#!/bin/sh\nexec " + std::string(KEEL_BINARY) + " train --config " + dir / "toy.toml" +
                                  " " + run_args("alone") + "\n");
  const auto r = run_command(cluster.env() + "sbatch --wait --ntasks=2 --output=" + dir / "alone.out" + " " + script);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::string out = read_text_file(dir / "alone.out");
  EXPECT_EQ(testing::count_lines(out), 1) << out;
  EXPECT_TRUE(contains(out, "keel train runs outside a job step (as the batch script, or in an salloc shell), one "
                            "process in an allocation of 2 tasks (SLURM_NTASKS); start it with srun --mpi=pmix"))
      << out;
}

}  // namespace
}  // namespace keel
