#include "runtime/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <cstring>

namespace keel {

namespace {

volatile sig_atomic_t g_signal = 0;
struct sigaction g_previous[4];
constexpr int kSignals[4] = {SIGTERM, SIGINT, SIGUSR1, SIGUSR2};

void on_stop_signal(int received) {
  // SIGUSR1 / SIGUSR2: `keel launch` passing on a SIGTERM / SIGINT through mpirun.
  const int sig = received == SIGUSR1 ? SIGTERM : received == SIGUSR2 ? SIGINT : received;
  if (g_signal != 0) {
    // The second one: stop now (only async-signal-safe calls here).
    const char message[] = "keel: second stop signal: aborting without a checkpoint\n";
    [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, message, sizeof message - 1);
    ::_exit(128 + sig);
  }
  g_signal = sig;
  const char message[] = "keel: stop signal received: finishing this step, then a checkpoint\n";
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, message, sizeof message - 1);
}

}  // namespace

StopSignals::StopSignals() {
  g_signal = 0;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking calls (MPI, file I/O) continue rather than fail with EINTR
  for (int i = 0; i < 4; ++i) ::sigaction(kSignals[i], &sa, &g_previous[i]);
}

StopSignals::~StopSignals() {
  for (int i = 0; i < 4; ++i) ::sigaction(kSignals[i], &g_previous[i], nullptr);
}

int StopSignals::received() const { return g_signal; }

int StopSignals::requested(Communicator& world) const {
  const int mine = g_signal;
  return world.size() > 1 ? static_cast<int>(world.allreduce_max(static_cast<double>(mine))) : mine;
}

}  // namespace keel
