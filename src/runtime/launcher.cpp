#include "runtime/launcher.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "core/error.h"

namespace keel {

namespace {

pid_t g_child = -1;

void forward_signal(int sig) {
  if (g_child > 0) ::kill(g_child, sig);
}

int parse_count(const std::string& text) {
  char* end = nullptr;
  const long n = std::strtol(text.c_str(), &end, 10);
  check(!text.empty() && *end == '\0', "launch -n: expected a number of ranks, found '" + text + "'");
  check(n >= 1 && n <= 4096, "launch -n: expected 1..4096 ranks, found " + text);
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
  const std::string where = "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + " on " + node + ")";
  if (std::string(what) == "signal") {
    const size_t open = line.find('(', at), close = line.find(')', open == std::string::npos ? at : open);
    const std::string name = open != std::string::npos && close != std::string::npos
                                 ? " (" + line.substr(open + 1, close - open - 1) + ")"
                                 : "";
    return where + " was killed by signal " + std::to_string(number) + name;
  }
  return where + " exited with status " + std::to_string(number);
}

}  // namespace

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
    } else {
      throw Error("launch: unexpected argument '" + a + "' (usage: keel launch -n N [--hostfile F] [--mca K V] -- SUBCOMMAND ...)");
    }
  }
  check(o.ranks >= 1, "launch: missing -n N (the number of ranks)");
  o.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  check(!o.command.empty(), "launch: missing the keel subcommand after -- (e.g. keel launch -n 2 -- train)");
  check(o.command[0] != "launch", "launch: the subcommand cannot be launch itself");
  return o;
}

std::vector<std::string> mpirun_argv(const LaunchOptions& o) {
  std::vector<std::string> argv = {"mpirun", "-n", std::to_string(o.ranks),
                                   // Containers and small machines: more ranks than cores is allowed, and
                                   // ranks are not pinned (each runs its own OpenMP pool).
                                   "--oversubscribe", "--bind-to", "none",
                                   // Pass the thread settings to remote ranks too.
                                   "-x", "OMP_NUM_THREADS", "-x", "OMP_WAIT_POLICY"};
  if (!o.hostfile.empty()) {
    argv.push_back("--hostfile");
    argv.push_back(o.hostfile);
  }
  for (const auto& [k, v] : o.mca) {
    argv.push_back("--mca");
    argv.push_back(k);
    argv.push_back(v);
  }
  argv.push_back(o.keel_binary);
  argv.insert(argv.end(), o.command.begin(), o.command.end());
  return argv;
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

  const std::vector<std::string> argv = mpirun_argv(o);
  int err_pipe[2];
  check(::pipe(err_pipe) == 0, "launch: cannot create a pipe");
  g_child = ::fork();
  check(g_child >= 0, "launch: cannot fork");
  if (g_child == 0) {
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
  ::close(err_pipe[1]);
  struct sigaction sa = {};
  sa.sa_handler = forward_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  // Pass stderr through, and remember what mpirun says about a failed rank.
  // OpenMPI 4: "mpirun noticed that process rank 1 with PID 123 on node h exited on signal 9 (Killed)."
  std::string failure;
  FILE* err = ::fdopen(err_pipe[0], "r");
  char* line = nullptr;
  size_t cap = 0;
  while (::getline(&line, &cap, err) > 0) {
    std::fputs(line, stderr);
    const std::string described = describe_rank_failure(line);
    // A signal is the cause; a non-zero status may be a consequence of another rank's death.
    if (!described.empty() && (failure.empty() || described.find("signal") != std::string::npos)) failure = described;
  }
  std::free(line);
  std::fclose(err);
  int status = 0;
  while (::waitpid(g_child, &status, 0) < 0 && errno == EINTR) {
  }
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (code != 0) {
    std::fprintf(stderr, "keel: launch: job failed (mpirun exit %d)%s%s\n", code, failure.empty() ? "" : ": ",
                 failure.c_str());
  }
  return code;
}

}  // namespace keel
