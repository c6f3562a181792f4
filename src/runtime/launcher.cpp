#include "runtime/launcher.h"

#include <omp.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/config.h"
#include "core/cpu.h"
#include "core/error.h"
#include "core/fileio.h"
#include "kernels/cpu/blas.h"
#include "runtime/job_config.h"

namespace keel {

namespace {

// The running mpirun (-1 between runs) and the first SIGINT/SIGTERM the launcher received.
volatile sig_atomic_t g_child = -1;
volatile sig_atomic_t g_stop_signal = 0;

// The first SIGTERM / SIGINT asks the ranks to stop cleanly: mpirun forwards SIGUSR1 / SIGUSR2 to
// every rank untouched (on SIGTERM it would kill them a second later), and a training rank takes
// them for SIGTERM / SIGINT (runtime/stop_signal.h): it finishes its step, checkpoints and exits.
// A second signal is passed on as it is: mpirun ends the job at once.
void forward_signal(int sig) {
  const bool first = g_stop_signal == 0;
  if (first) g_stop_signal = sig;
  if (g_child > 0) ::kill(g_child, first ? (sig == SIGINT ? SIGUSR2 : SIGUSR1) : sig);
}

// The variables a restarted job finds in its ranks' environment (exported with mpirun -x).
constexpr const char* kRestartVariables[] = {"KEEL_RESTART", "KEEL_FAILURE_NOTICED_NS", "KEEL_FAILURE"};

// The SGEMM rates measured on this host, by CPU, kernels and threads (sgemm_reference_gflops);
// KEEL_SGEMM_CACHE names another file (tests keep theirs apart from a host's real runs).
std::string sgemm_cache_path() {
  const char* path = std::getenv("KEEL_SGEMM_CACHE");
  return path != nullptr && *path != '\0' ? path : "/dev/shm/keel-sgemm.json";
}


int parse_count(const std::string& text) {
  char* end = nullptr;
  const long n = std::strtol(text.c_str(), &end, 10);
  check(!text.empty() && *end == '\0', "launch -n: expected a number of ranks, found '" + text + "'");
  check(n >= 1 && n <= 4096, "launch -n: expected 1..4096 ranks, found " + text);
  return static_cast<int>(n);
}

int parse_restarts(const std::string& text) {
  char* end = nullptr;
  const long n = std::strtol(text.c_str(), &end, 10);
  check(!text.empty() && *end == '\0',
        "launch --max-restarts: expected a number of restarts (0 or more), found '" + text + "'");
  check(n >= 0 && n <= 1000000, "launch --max-restarts: expected 0..1000000 restarts, found " + text);
  return static_cast<int>(n);
}

// Turns mpirun's account of a failed rank into our words, or "" if the line is not one. OpenMPI 4:
//   "... process rank 1 with PID 123 on node h exited on signal 9 (Killed)."
//   "... process rank 1 with PID 123 on node h exited on status 3."
std::string describe_rank_failure(const std::string& line) {
  const size_t at = line.find("process rank ");
  if (at == std::string::npos) return "";
  char node[256] = {}, what[64] = {};
  int rank = -1, number = -1;
  long pid = -1;
  if (std::sscanf(line.c_str() + at, "process rank %d with PID %ld on node %255s exited on %63s %d", &rank, &pid, node,
                  what, &number) != 5) {
    return "";
  }
  // OpenMPI 4.1 reports PID 0 for a rank that died by a signal: then the pid is left out.
  const std::string where =
      "rank " + std::to_string(rank) + " (" + (pid > 0 ? "pid " + std::to_string(pid) + " " : "") + "on " + node + ")";
  if (std::string(what) == "signal") {
    const size_t open = line.find('(', at), close = line.find(')', open == std::string::npos ? at : open);
    const std::string name = open != std::string::npos && close != std::string::npos
                                 ? " (" + line.substr(open + 1, close - open - 1) + ")"
                                 : "";
    return where + " was killed by signal " + std::to_string(number) + name;
  }
  return where + " exited with status " + std::to_string(number);
}

// What mpirun's stderr says about a failed job, fed one line at a time. Besides the one-line
// reports above, OpenMPI 4 names a rank that exited non-zero, or called MPI_Abort, over two lines:
//   "  Process name: [[25999,1],1]"                                   "  Exit code:    2"
//   "MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD"  "with errorcode 2."
class FailureReport {
 public:
  void read(const std::string& line) {
    int job = 0, step = 0, rank = -1, code = 0;
    if (std::sscanf(line.c_str(), " Process name: [[%d,%d],%d]", &job, &step, &rank) == 3) {
      pending_rank_ = rank;
    } else if (pending_rank_ >= 0 && std::sscanf(line.c_str(), " Exit code: %d", &code) == 1) {
      note("rank " + std::to_string(pending_rank_) + " exited with status " + std::to_string(code), false);
      pending_rank_ = -1;
    } else if (std::sscanf(line.c_str(), "MPI_ABORT was invoked on rank %d", &rank) == 1) {
      abort_rank_ = rank;
    } else if (abort_rank_ >= 0 && std::sscanf(line.c_str(), "with errorcode %d", &code) == 1) {
      note("rank " + std::to_string(abort_rank_) + " called MPI_Abort with error code " + std::to_string(code), false);
      abort_rank_ = -1;
    } else {
      const std::string described = describe_rank_failure(line);
      if (!described.empty()) note(described, described.find(" signal ") != std::string::npos);
    }
  }
  // The rank that failed first and how, "" when mpirun named none.
  const std::string& description() const { return description_; }
  // Whether a rank was killed by a signal (then other ranks' exit codes are consequences).
  bool signalled() const { return signalled_; }

 private:
  // A signal is the cause; a non-zero status may be a consequence of another rank's death.
  void note(const std::string& described, bool signal) {
    if (description_.empty() || (signal && !signalled_)) description_ = described;
    signalled_ = signalled_ || signal;
  }
  std::string description_;
  bool signalled_ = false;
  int pending_rank_ = -1, abort_rank_ = -1;
};

struct RunResult {
  int exit_code = 0;
  int64_t reaped_ns = 0;  // system_clock time at which mpirun's exit was reaped
  FailureReport report;
};

// Starts mpirun with its stderr on the pipe's write end (closed here). Returns its pid, or 0 when
// the launcher was already told to stop (nothing started). A SIGINT/SIGTERM arriving from here
// until g_child is set is held, then forwarded to it.
pid_t spawn_mpirun(const std::vector<std::string>& argv, const int err_pipe[2]) {
  sigset_t stop_signals, previous;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  ::sigprocmask(SIG_BLOCK, &stop_signals, &previous);
  if (g_stop_signal != 0) {
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    ::close(err_pipe[1]);
    return 0;
  }
  const pid_t child = ::fork();
  if (child == 0) {
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    ::dup2(err_pipe[1], STDERR_FILENO);
    ::close(err_pipe[0]);
    ::close(err_pipe[1]);
    std::vector<char*> cargv;
    for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    ::execvp("mpirun", cargv.data());
    std::fprintf(stderr, "keel: launch: cannot run mpirun (%s); install openmpi-bin (scripts/setup.sh)\n",
                 std::strerror(errno));
    ::_exit(127);
  }
  g_child = child;
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  ::close(err_pipe[1]);
  check(child > 0, "launch: cannot fork");
  return child;
}

// Runs mpirun once, passing its stderr through and reading its account of a failure. Returns
// with exit_code -1 (nothing run) when the launcher was already told to stop.
RunResult run_mpirun(const std::vector<std::string>& argv) {
  RunResult result;
  int err_pipe[2];
  check(::pipe(err_pipe) == 0, "launch: cannot create a pipe");
  pid_t child = 0;
  try {
    child = spawn_mpirun(argv, err_pipe);
  } catch (const Error&) {
    ::close(err_pipe[0]);
    throw;
  }
  if (child == 0) {
    ::close(err_pipe[0]);
    result.exit_code = -1;
    return result;
  }

  // Pass stderr through, and remember what mpirun says about a failed rank. Once mpirun has
  // named one it normally exits within a second, but OpenMPI 4.1 can hang instead (seen when a
  // rank was killed while connecting to the PMIx server): after kExitGrace it gets SIGTERM, and
  // SIGKILL after kExitGrace + kTermGrace, so that a restart is not waited for forever.
  constexpr auto kExitGrace = std::chrono::seconds(30), kTermGrace = std::chrono::seconds(10);
  std::chrono::steady_clock::time_point failure_seen;
  int stop_signals_sent = 0;
  int status = 0;
  bool reaped = false;
  std::string pending;
  // Waits up to timeout_ms for output and passes whole lines on: 1 = read some, 0 = none, -1 = end.
  auto read_lines = [&](int timeout_ms) {
    pollfd readable = {err_pipe[0], POLLIN, 0};
    const int ready = ::poll(&readable, 1, timeout_ms);
    if (ready == 0 || (ready < 0 && errno == EINTR)) return 0;
    char buffer[4096];
    const ssize_t n = ready > 0 ? ::read(err_pipe[0], buffer, sizeof buffer) : -1;
    if (n < 0 && errno == EINTR) return 0;
    if (n <= 0) return -1;
    pending.append(buffer, static_cast<size_t>(n));
    for (size_t end; (end = pending.find('\n')) != std::string::npos; pending.erase(0, end + 1)) {
      const std::string line = pending.substr(0, end + 1);
      std::fputs(line.c_str(), stderr);
      result.report.read(line);
    }
    return 1;
  };
  // mpirun's exit is looked for every 100 ms: a restart (and recovery from memory, in seconds)
  // waits for it.
  while (read_lines(100) >= 0) {
    // mpirun may be gone while something it started still holds the pipe.
    if (::waitpid(child, &status, WNOHANG) == child) {
      reaped = true;
      while (read_lines(0) > 0) {
      }
      break;
    }
    if (result.report.description().empty()) continue;
    const auto now = std::chrono::steady_clock::now();
    if (failure_seen == std::chrono::steady_clock::time_point{}) failure_seen = now;
    if (stop_signals_sent < 2 && now - failure_seen >= kExitGrace + kTermGrace * stop_signals_sent) {
      std::fprintf(stderr, "keel: launch: mpirun has not exited %lld s after a rank failed; sending it %s\n",
                   static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(now - failure_seen).count()),
                   stop_signals_sent == 0 ? "SIGTERM" : "SIGKILL");
      ::kill(child, stop_signals_sent == 0 ? SIGTERM : SIGKILL);
      stop_signals_sent++;
    }
  }
  if (!pending.empty()) {
    std::fputs(pending.c_str(), stderr);
    result.report.read(pending);
  }
  ::close(err_pipe[0]);
  while (!reaped && ::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  result.reaped_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  g_child = -1;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

// Why a failed run must not be run again, or "" when a restart may succeed.
std::string why_not_restart(const RunResult& r) {
  if (g_stop_signal != 0) {
    return std::string("the launcher was stopped by signal ") + std::to_string(g_stop_signal) + " (" +
           ::strsignal(g_stop_signal) + ")";
  }
  if (r.exit_code == kRefusedInputExit && !r.report.signalled()) {
    return "the job was refused its input (exit " + std::to_string(kRefusedInputExit) + ")";
  }
  if (r.exit_code == kFinalCheckpointNotWritten && !r.report.signalled()) {
    return "the job ended without its final checkpoint (exit " + std::to_string(kFinalCheckpointNotWritten) +
           "): a restart would fail the same way until the cause (a full disk?) is fixed";
  }
  if (r.exit_code == kNonFiniteStepExit && !r.report.signalled()) {
    return "the job stopped at a non-finite step (exit " + std::to_string(kNonFiniteStepExit) +
           "): a restart would replay into it";
  }
  if ((r.exit_code == 128 + SIGTERM || r.exit_code == 128 + SIGINT) && !r.report.signalled()) {
    return "the job was stopped by a signal and checkpointed (exit " + std::to_string(r.exit_code) + ")";
  }
  if (r.exit_code == 127) return "mpirun could not be run (exit 127)";
  return "";
}

}  // namespace

bool rdma_devices_present() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/sys/class/infiniband", ec);
  return !ec && it != std::filesystem::directory_iterator();
}

LaunchOptions parse_launch_args(const std::vector<std::string>& args) {
  LaunchOptions o;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      check(i + 1 < args.size(), "launch: option " + a + " needs a value");
      return args[++i];
    };
    if (a == "--") {
      ++i;
      break;
    } else if (a == "-n" || a == "-np" || a == "--ranks") {
      o.ranks = parse_count(value());
    } else if (a == "--hostfile") {
      o.hostfile = value();
      check(std::filesystem::is_regular_file(o.hostfile), "launch --hostfile " + o.hostfile + ": not found");
    } else if (a == "--mca") {
      const std::string key = value();
      o.mca.emplace_back(key, value());
    } else if (a == "--max-restarts") {
      o.max_restarts = parse_restarts(value());
    } else {
      throw Error("launch: unexpected argument '" + a +
                  "' (usage: keel launch -n N [--hostfile F] [--mca K V] [--max-restarts R] -- SUBCOMMAND ...)");
    }
  }
  check(o.ranks >= 1, "launch: missing -n N (the number of ranks)");
  o.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  check(!o.command.empty(), "launch: missing the keel subcommand after -- (e.g. keel launch -n 2 -- train)");
  check(o.command[0] != "launch", "launch: the subcommand cannot be launch itself");
  return o;
}

std::vector<std::string> mpirun_argv(const LaunchOptions& o, int restart) {
  std::vector<std::string> argv = {"mpirun", "-n", std::to_string(o.ranks),
                                   // Containers and small machines: more ranks than cores is allowed, and
                                   // ranks are not pinned (each runs its own OpenMP pool).
                                   "--oversubscribe", "--bind-to", "none",
                                   // Pass the thread settings to remote ranks too.
                                   "-x", "OMP_NUM_THREADS", "-x", "OMP_WAIT_POLICY"};
  // A fault-injection plan (tests) reaches ranks on other hosts too.
  if (std::getenv("KEEL_FAULT") != nullptr) {
    argv.push_back("-x");
    argv.push_back("KEEL_FAULT");
  }
  // The job's identity, the same in every run of it: memory checkpoints of this job are resumed
  // from, any other's are not (ckpt/memory_checkpoint.h).
  if (std::getenv("KEEL_JOB_ID") != nullptr) {
    argv.push_back("-x");
    argv.push_back("KEEL_JOB_ID");
  }
  if (restart > 0) {
    for (const char* name : kRestartVariables) {
      argv.push_back("-x");
      argv.push_back(name);
    }
  }
  if (!o.hostfile.empty()) {
    argv.push_back("--hostfile");
    argv.push_back(o.hostfile);
  }
  // Settings of Keel's own, each unless the caller passes the key (a --mca of the caller's wins).
  auto by_default = [&](const char* key, const char* value) {
    const bool own = std::any_of(o.mca.begin(), o.mca.end(), [&](const auto& kv) { return kv.first == key; });
    if (!own) {
      for (const char* word : {"--mca", key, value}) argv.push_back(word);
    }
  };
  // When a rank dies, mpirun ends the others with SIGTERM and, odls_base_sigkill_timeout seconds
  // later, SIGKILL; OpenMPI 4.1 takes 2 s for that with its default of 1, the largest part of
  // detecting a failure. Nothing is lost by ending them at once: a job that lost a rank cannot finish
  // a step, and an interrupted checkpoint write is never taken for a checkpoint. (A stop the user
  // asks for reaches the ranks as SIGUSR1/SIGUSR2, not through this.)
  by_default("odls_base_sigkill_timeout", "0");
  // Without an RDMA device (InfiniBand, RoCE, EFA) the UCX and libfabric transports have nothing
  // to offer over ob1's shared memory and TCP, but probing them takes each rank's MPI_Init 0.2 s
  // (0.47 -> 0.27 s measured, 2 ranks): time a restart spends down.
  if (!rdma_devices_present()) by_default("pml", "ob1");
  for (const auto& [k, v] : o.mca) {
    argv.push_back("--mca");
    argv.push_back(k);
    argv.push_back(v);
  }
  argv.push_back(o.keel_binary);
  argv.insert(argv.end(), o.command.begin(), o.command.end());
  return argv;
}

namespace {

// An integer Slurm variable, 0 when absent or not a number.
int slurm_count(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(text, &end, 10);
  return *end == '\0' && n >= 0 && n <= 1 << 24 ? static_cast<int>(n) : 0;
}

std::string env_or_empty(const char* name) {
  const char* text = std::getenv(name);
  return text != nullptr ? text : "";
}

}  // namespace

SlurmTask slurm_task() {
  SlurmTask s;
  s.step_tasks = slurm_count("SLURM_STEP_NUM_TASKS");
  s.task = slurm_count("SLURM_PROCID");
  s.job_tasks = slurm_count("SLURM_NTASKS");
  s.job_id = env_or_empty("SLURM_JOB_ID");
  s.mpi = env_or_empty("SLURM_MPI_TYPE");
  s.pmix = std::getenv("PMIX_RANK") != nullptr;
  s.under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  return s;
}

void check_slurm_train_start(const SlurmTask& s, const Config& config) {
  if (s.job_id.empty() || s.under_mpirun) return;
  const std::string job = "Slurm job " + s.job_id;
  if (s.step_tasks == 0) {
    check(s.job_tasks <= 1, job + ": keel train runs outside a job step (as the batch script, or in an salloc shell), "
                                "one process in an allocation of " + std::to_string(s.job_tasks) +
                                " tasks (SLURM_NTASKS); start it with srun --mpi=pmix keel train ... (scripts/keel.sbatch)");
    return;
  }
  const std::string step = job + ", step of " + std::to_string(s.step_tasks) + " tasks (SLURM_STEP_NUM_TASKS)";
  check(s.step_tasks == 1 || s.pmix,
        step + ": expected srun --mpi=pmix, found --mpi=" + (s.mpi.empty() ? std::string("none") : s.mpi) +
            " (OpenMPI joins a Slurm step through PMIx only; without it every task would train alone); run "
            "srun --mpi=pmix, or set MpiDefault=pmix in slurm.conf");
  // The ranks of one model replica: its pipeline stages times each stage's context and tensor ranks.
  const int replica_ranks = std::max(1, config.parallel.pipeline) * std::max(1, config.parallel.tensor) *
                            std::max(1, config.parallel.context);
  const std::string context =
      config.parallel.context > 1 ? " x parallel.context = " + std::to_string(config.parallel.context) : "";
  const std::string layout = "parallel.data = " + std::to_string(config.parallel.data) +
                             " x parallel.pipeline = " + std::to_string(config.parallel.pipeline) + context +
                             " x parallel.tensor = " + std::to_string(config.parallel.tensor);
  if (config.parallel.data > 0) {
    const int ranks = config.parallel.data * replica_ranks;
    check(ranks == s.step_tasks, step + ": the configured layout " + layout + " needs " + std::to_string(ranks) +
                                     " tasks; start srun with -n " + std::to_string(ranks) +
                                     " (sbatch --ntasks), or set parallel.data = 0 (the whole step)");
  } else {
    check(s.step_tasks % replica_ranks == 0,
          step + ": expected a multiple of parallel.pipeline" + (context.empty() ? "" : " x parallel.context") +
              " x parallel.tensor = " + std::to_string(replica_ranks) +
              " tasks (world = data x pipeline x " + (context.empty() ? "" : "context x ") +
              "tensor); start srun with -n a multiple of " +
              std::to_string(replica_ranks));
  }
  // Every other refusal for this world size, said here once rather than by every rank.
  Config resolved = config;
  resolve_job_config(resolved, s.step_tasks);
  ::setenv("PMIX_MCA_gds", "hash", 0);  // silences harmless PMIx shared-memory warnings (as keel launch)
  // As keel launch: without an RDMA device UCX and libfabric only slow MPI_Init down.
  if (!rdma_devices_present()) ::setenv("OMPI_MCA_pml", "ob1", 0);
}

double sgemm_reference_gflops(bool* cached) {
  if (cached != nullptr) *cached = false;
  const std::string key = cpu_model_name() + ", OpenBLAS " + blas_core() + ", " + std::to_string(omp_get_max_threads()) +
                          " threads";
  const std::string cache_path = sgemm_cache_path();
  nlohmann::json cache = nlohmann::json::object();
  try {
    if (std::filesystem::is_regular_file(cache_path)) {
      const std::vector<char> bytes = read_file(cache_path);
      cache = nlohmann::json::parse(bytes.begin(), bytes.end(), nullptr, false);
      if (!cache.is_object()) cache = nlohmann::json::object();
    }
  } catch (const std::exception&) {
    cache = nlohmann::json::object();
  }
  if (std::getenv("KEEL_RESTART") != nullptr && cache.contains(key) && cache[key].is_number() && cache[key].get<double>() > 0) {
    if (cached != nullptr) *cached = true;
    return cache[key].get<double>();
  }
  const double gflops = measure_sgemm_gflops();
  try {
    cache[key] = gflops;
    const std::string text = cache.dump();
    write_file_atomic(cache_path, {{text.data(), text.size()}});
  } catch (const std::exception&) {
    // not kept: a restart measures again
  }
  return gflops;
}

int launch(const LaunchOptions& o) {
  // OpenMPI refuses to run as root unless told that this is intended (containers run as root).
  if (::geteuid() == 0) {
    ::setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    ::setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  }
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    ::setenv("OMP_NUM_THREADS", std::to_string(std::max(1u, cores / static_cast<unsigned>(o.ranks))).c_str(), 1);
  }
  ::setenv("OMP_WAIT_POLICY", std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "PASSIVE", 1);
  ::setenv("PMIX_MCA_gds", "hash", 0);  // silences harmless PMIx shared-memory warnings
  // The first run is no restart, whatever the caller's environment says.
  for (const char* name : kRestartVariables) ::unsetenv(name);
  // One identity for every run of this job (a caller's own, e.g. to resume a job by hand).
  if (std::getenv("KEEL_JOB_ID") == nullptr || *std::getenv("KEEL_JOB_ID") == '\0') {
    const auto now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
    ::setenv("KEEL_JOB_ID", ("launch-" + std::to_string(now_ns) + "-" + std::to_string(::getpid())).c_str(), 1);
  }

  // SA_RESTART: a forwarded signal must not fail a write of the passed-through output.
  struct sigaction sa = {};
  sa.sa_handler = forward_signal;
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  const bool train = o.command[0] == "train";
  for (int restart = 0;; ++restart) {
    const RunResult r = run_mpirun(mpirun_argv(o, restart));
    if (r.exit_code == -1) {  // stopped before mpirun was (re)started
      std::fprintf(stderr, "keel: launch: stopped by signal %d (%s) before mpirun was started\n",
                   static_cast<int>(g_stop_signal), ::strsignal(g_stop_signal));
      return 128 + g_stop_signal;
    }
    if (r.exit_code == 0) {
      if (restart > 0) std::fprintf(stderr, "keel: launch: job succeeded after %d restart(s)\n", restart);
      return 0;
    }
    const std::string failure = !r.report.description().empty()
                                    ? r.report.description()
                                    : "mpirun exited with status " + std::to_string(r.exit_code);
    const std::string refusal = why_not_restart(r);
    if (restart < o.max_restarts && refusal.empty()) {
      std::fprintf(stderr, "keel: launch: failure %d: %s; restart %d of %d%s\n", restart + 1, failure.c_str(),
                   restart + 1, o.max_restarts, train ? " from the newest checkpoint" : "");
      std::fflush(stderr);
      ::setenv("KEEL_RESTART", std::to_string(restart + 1).c_str(), 1);
      ::setenv("KEEL_FAILURE_NOTICED_NS", std::to_string(r.reaped_ns).c_str(), 1);
      ::setenv("KEEL_FAILURE", failure.c_str(), 1);
      continue;
    }
    if (g_stop_signal != 0 && r.exit_code == 128 + g_stop_signal && !r.report.signalled()) {
      std::fprintf(stderr, "keel: launch: stopped by signal %d (%s): the job stopped cleanly\n",
                   static_cast<int>(g_stop_signal), ::strsignal(g_stop_signal));
      return r.exit_code;
    }
    if (restart == 0) {
      std::fprintf(stderr, "keel: launch: job failed (mpirun exit %d)%s%s\n", r.exit_code,
                   r.report.description().empty() ? "" : ": ", r.report.description().c_str());
    } else {
      std::fprintf(stderr, "keel: launch: job failed after %d restart(s): %s\n", restart, failure.c_str());
    }
    if (o.max_restarts > 0 && !refusal.empty()) {
      std::fprintf(stderr, "keel: launch: not restarting: %s\n", refusal.c_str());
    }
    return r.exit_code;
  }
}

}  // namespace keel
