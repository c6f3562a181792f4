#include "monitor/energy.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

// False when path is not a readable regular file holding a number (a FIFO there is not waited on).
bool read_u64(const std::string& path, uint64_t* out) {
  unsigned long long v = 0;
  try {
    if (std::fscanf(open_regular_stream(path).get(), "%llu", &v) != 1) return false;
  } catch (const Error&) {
    return false;
  }
  *out = v;
  return true;
}

}  // namespace

RaplCounters::RaplCounters(const std::string& powercap) {
  std::error_code ec;
  if (!fs::is_directory(powercap, ec)) return;
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(powercap, ec)) {
    const std::string name = e.path().filename().string();
    // Packages only (intel-rapl:0); their sub-zones (intel-rapl:0:0, cores or dram) are inside them.
    if (name.rfind("intel-rapl:", 0) == 0 && name.find(':', 11) == std::string::npos) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    Zone z;
    z.energy_file = powercap + "/" + name + "/energy_uj";
    uint64_t v = 0;
    if (!read_u64(z.energy_file, &v)) continue;  // not readable (root only on recent kernels)
    if (!read_u64(powercap + "/" + name + "/max_energy_range_uj", &z.max_uj)) z.max_uj = 0;
    zones_.push_back(z);
  }
}

double RaplCounters::take_joules() {
  double joules = 0;
  for (Zone& z : zones_) {
    uint64_t now = 0;
    if (!read_u64(z.energy_file, &now)) continue;
    if (z.started) {
      // The counter wraps at max_energy_range_uj.
      const uint64_t delta = now >= z.last_uj ? now - z.last_uj : (z.max_uj > z.last_uj ? z.max_uj - z.last_uj + now : 0);
      joules += static_cast<double>(delta) * 1e-6;
    }
    z.last_uj = now;
    z.started = true;
  }
  return joules;
}

EnergyMeter::EnergyMeter(const MonitorConfig& config, Communicator& world, std::function<double(int64_t)> tokens_of_step)
    : config_(config), world_(world), tokens_of_step_(std::move(tokens_of_step)), rapl_(config.powercap) {
  const double have = rapl_.available() ? 1.0 : 0.0;
  // Measured only when every rank's host has counters. The ranks of a host read the same
  // packages over the same (synchronous) step: each counts its share, 1 / (ranks on the host).
  measured_ = world_.size() > 1 ? world_.allreduce_min(have) > 0 : have > 0;
  share_ = 1.0 / std::max(1, world_.local_size());
  cpu_at_start_ = cpu_seconds();
}

double EnergyMeter::cpu_seconds() const {
  timespec ts = {};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

void EnergyMeter::before_step(int64_t) {
  if (measured_) rapl_.take_joules();  // the step's counting starts here
  cpu_at_start_ = cpu_seconds();
}

void EnergyMeter::after_step(int64_t steps_done) {
  step_tokens_ = tokens_of_step_(steps_done - 1);
  total_tokens_ += step_tokens_;
  const double mine =
      measured_ ? rapl_.take_joules() * share_ : (cpu_seconds() - cpu_at_start_) * config_.cpu_watts;
  step_j_ = world_.size() > 1 ? world_.allreduce_sum(mine) : mine;
  total_j_ += step_j_;
  steps_++;
}

void EnergyMeter::print_startup() const {
  if (measured_) {
    std::printf("keel: energy from RAPL (%zu package counter(s) under %s)\n", rapl_.packages(), config_.powercap.c_str());
  } else {
    std::printf("keel: energy modelled: CPU seconds x %.1f W per busy core (monitor.cpu_watts; no readable RAPL "
                "counters under %s)\n",
                config_.cpu_watts, config_.powercap.c_str());
  }
}

void EnergyMeter::add_step_fields(double, nlohmann::json& line) {
  line["energy_j"] = step_j_;
  line["energy_kwh_per_mtok"] = step_tokens_ > 0 ? step_j_ / 3.6e6 / (step_tokens_ / 1e6) : 0.0;
  line["energy_source"] = measured_ ? "rapl" : "modelled";
}

std::string EnergyMeter::progress_fragment(double) const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.1f J, %.3g kWh/Mtok%s", step_j_,
                step_tokens_ > 0 ? step_j_ / 3.6e6 / (step_tokens_ / 1e6) : 0.0, measured_ ? "" : " (modelled)");
  return buf;
}

void EnergyMeter::print_summary() const {
  const double tokens = total_tokens_;
  std::printf("keel: energy over this run: %.1f J (%.3g kWh) for %.0f tokens: %.3g kWh per million tokens (%s)\n",
              total_j_, total_j_ / 3.6e6, tokens, tokens > 0 ? total_j_ / 3.6e6 / (tokens / 1e6) : 0.0,
              measured_ ? "RAPL" : "modelled from CPU time");
}

}  // namespace keel
