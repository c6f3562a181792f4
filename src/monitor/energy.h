// Energy per step and per token. Where the machine exposes RAPL (powercap sysfs: intel-rapl:N
// packages, also on AMD since Linux 5.8) the package counters are read (the ranks of a host
// share its packages: each counts its share), wraparound handled; otherwise energy is modelled as the process's
// CPU time (every rank's, summed) times monitor.cpu_watts per busy core, and labelled so
// ("energy_source": "modelled"). Reported per step (energy_j, energy_kwh_per_mtok), in the progress
// line and at the end of the run.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/config.h"
#include "core/metrics_source.h"
#include "core/step_hook.h"

namespace keel {

// The RAPL package counters under a powercap directory (a real /sys/class/powercap, or a tree a
// test writes). Empty when there are none readable.
class RaplCounters {
 public:
  explicit RaplCounters(const std::string& powercap);
  bool available() const { return !zones_.empty(); }
  // Joules since the previous call (0 at the first), summed over packages.
  double take_joules();
  size_t packages() const { return zones_.size(); }

 private:
  struct Zone {
    std::string energy_file;
    uint64_t max_uj = 0, last_uj = 0;
    bool started = false;
  };
  std::vector<Zone> zones_;
};

class EnergyMeter final : public MetricsSource, public StepHook {
 public:
  // `tokens_of_step`: the tokens of optimizer step n (0-based) over every data-parallel rank.
  EnergyMeter(const MonitorConfig& config, Communicator& world, std::function<double(int64_t)> tokens_of_step);

  void before_step(int64_t step) override;
  void after_step(int64_t step) override;  // a collective: every rank

  void print_startup() const override;
  void add_step_fields(double step_ms, nlohmann::json& line) override;
  std::string progress_fragment(double step_ms) const override;
  void print_summary() const override;

  bool measured() const { return measured_; }
  double step_joules() const { return step_j_; }

 private:
  double cpu_seconds() const;

  const MonitorConfig& config_;
  Communicator& world_;
  std::function<double(int64_t)> tokens_of_step_;
  double step_tokens_ = 0, total_tokens_ = 0;
  RaplCounters rapl_;
  bool measured_ = false;    // RAPL on every host
  double share_ = 1;         // of its host's packages this rank counts
  double cpu_at_start_ = 0;
  double step_j_ = 0, total_j_ = 0;
  int64_t steps_ = 0;
};

}  // namespace keel
