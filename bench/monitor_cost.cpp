// What Keel's monitoring does per step, timed in place: the energy meter (its CPU-time or RAPL
// reading and the all-reduce that sums a step's joules over ranks), the alert rules and the
// Prometheus endpoint's update, each over the step lines of a real run (metrics.jsonl), and one
// scrape of the endpoint (the server's serialisation, on its own thread). Run under mpirun with
// the job's rank count so the meter's all-reduce is the real one; rank 0 prints.
// Usage: mpirun -n 2 keel_bench_monitor RUN_DIR/metrics.jsonl  (bench/monitor_overhead.sh runs it)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/config.h"
#include "monitor/alerts.h"
#include "monitor/endpoint.h"
#include "monitor/energy.h"

using keel::Communicator;
using nlohmann::json;

namespace {

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// One GET /metrics over loopback, read to the end; the bytes received.
size_t scrape(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return 0;
  }
  const char request[] = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (::send(fd, request, sizeof request - 1, 0) < 0) {
    ::close(fd);
    return 0;
  }
  size_t total = 0;
  char buf[65536];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) total += static_cast<size_t>(n);
  ::close(fd);
  return total;
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace

int main(int argc, char** argv) {
  Communicator& world = Communicator::world();
  if (argc != 2) {
    if (world.is_root()) std::fprintf(stderr, "usage: keel_bench_monitor RUN_DIR/metrics.jsonl\n");
    return 2;
  }
  std::vector<json> lines;
  std::vector<double> step_ms;
  {
    std::ifstream in(argv[1]);
    for (std::string l; std::getline(in, l);) {
      const json j = json::parse(l, nullptr, false);
      if (!j.is_object() || j.contains("event") || !j.contains("loss")) continue;
      lines.push_back(j);
      if (j.value("step", 0) >= 4) step_ms.push_back(j.value("ms", 0.0));
    }
  }
  if (lines.empty()) {
    if (world.is_root()) std::fprintf(stderr, "keel_bench_monitor: %s has no step lines\n", argv[1]);
    return 2;
  }
  keel::MonitorConfig config;
  config.port = free_port();
  constexpr int kRounds = 50;  // passes over the run's lines

  // The energy meter: before_step and after_step around each step, as the trainer calls them.
  keel::EnergyMeter energy(config, world, [](int64_t) { return 1024.0; });
  std::vector<double> energy_us;
  for (int r = 0; r < kRounds; ++r) {
    for (size_t i = 0; i < lines.size(); ++i) {
      const double t0 = now_us();
      energy.before_step(static_cast<int64_t>(i));
      energy.after_step(static_cast<int64_t>(i + 1));
      json fields;
      energy.add_step_fields(lines[i].value("ms", 0.0), fields);
      energy_us.push_back(now_us() - t0);
    }
  }
  if (!world.is_root()) return 0;

  keel::Alerts alerts(config, [](const json&) {});
  std::vector<double> alerts_us;
  // The rules print what fires: stdout goes to /dev/null, the figures to stderr.
  if (std::freopen("/dev/null", "w", stdout) == nullptr) return 1;
  for (int r = 0; r < kRounds; ++r) {
    for (const json& l : lines) {
      const double t0 = now_us();
      alerts.observe_step(l);
      alerts_us.push_back(now_us() - t0);
    }
  }
  keel::PrometheusEndpoint endpoint(config);
  std::vector<double> endpoint_us;
  for (int r = 0; r < kRounds; ++r) {
    for (const json& l : lines) {
      const double t0 = now_us();
      endpoint.observe_step(l);
      endpoint_us.push_back(now_us() - t0);
    }
  }
  std::vector<double> scrape_us;
  size_t bytes = 0;
  for (int i = 0; i < 200; ++i) {
    const double t0 = now_us();
    bytes = scrape(config.port);
    scrape_us.push_back(now_us() - t0);
  }
  const double step_us = median(step_ms) * 1e3;
  const double e = median(energy_us), a = median(alerts_us), p = median(endpoint_us), s = median(scrape_us);
  const double per_step = e + a + p;
  std::fprintf(stderr,
               "step lines of the run: %zu, median step %.2f ms (steps 4 and later), %d ranks\n"
               "per step, on the training thread (median of %d passes):\n"
               "  energy meter (CPU time or RAPL, all-reduce of joules)  %8.1f us\n"
               "  alert rules                                           %8.1f us\n"
               "  endpoint update (gauges and counters)                 %8.1f us\n"
               "  total                                                 %8.1f us = %.4f %% of the median step\n"
               "one scrape of /metrics (%zu bytes, served on the endpoint's thread): %.1f us;\n"
               "  scraped every 15 s that is %.5f %% of one core, every second %.4f %%\n",
               lines.size(), step_us / 1e3, world.size(), kRounds, e, a, p, per_step, 100 * per_step / step_us, bytes,
               s, 100 * s / 15e6, 100 * s / 1e6);
  return 0;
}
