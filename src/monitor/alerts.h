// Alerts on Keel's operating targets ([monitor]): a rule holds when its metric in the step line
// is out of range; once it has held for monitor.alert_after consecutive steps Keel prints one line
// naming the metric, its value and the threshold, and writes an `"event": "alert"` line with
// `"state": "firing"`; once the metric has been back in range as long, it says so once
// (`"state": "resolved"`). Rules whose metric a run does not report never fire.
//   tier_hit_rate   < monitor.min_hit_rate     (memory tiers: prefetch not keeping up)
//   pipeline_bubble > monitor.max_bubble       (pipelines: idle stages)
//   sync_jitter     > monitor.max_sync_jitter  (data parallelism: uneven gradient sync)
//   loss            > monitor.loss_spike x the mean of the last 20 steps, or not finite
//   ms              > monitor.stall_factor x the median of the last 20 steps (stalled progress)
//   moe_imbalance   > monitor.max_moe_imbalance on monitor.moe_imbalance_after steps (a mixture of
//                     experts' busiest expert over the mean, the worst block's)
#pragma once

#include <deque>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/metrics_source.h"

namespace keel {

class Alerts final : public StepLineSink, public MetricsSource {
 public:
  Alerts(const MonitorConfig& config, std::function<void(const nlohmann::json&)> log_event);

  void observe_step(const nlohmann::json& line) override;
  // Rules firing now (for a gauge: 1 while firing).
  std::vector<std::string> firing() const;

  // The record is the event lines; the progress line names the rules firing.
  void add_step_fields(double, nlohmann::json&) override {}
  std::string progress_fragment(double step_ms) const override;
  void print_summary() const override;

 private:
  struct Rule {
    std::string metric;   // the step line's field
    std::string key;      // the [monitor] key of its threshold
    bool above = true;    // out of range when above the threshold (else below)
    int after = 0;        // consecutive steps before it fires or resolves (0: monitor.alert_after)
    int out = 0, in = 0;  // consecutive steps out of / back in range
    bool firing = false;
    int fired = 0;        // times it fired in this run
  };
  // The threshold of `rule` for this step (NaN: no reference yet), and whether `value` breaks it.
  bool out_of_range(const Rule& rule, double value, double* threshold) const;

  const MonitorConfig& config_;
  std::function<void(const nlohmann::json&)> log_event_;
  std::vector<Rule> rules_;
  std::deque<double> recent_loss_, recent_ms_;  // the last 20 steps, for the relative rules
};

}  // namespace keel
