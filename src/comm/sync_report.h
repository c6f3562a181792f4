// What data-parallel gradient sync reports: per step the bytes sent, the wait backward did not
// hide, the spread of waits over ranks, the latency and its jitter (and with compression the
// ratio, codec time and per-layer bytes); at the end of a compressed run a per-layer table.
#pragma once

#include <deque>
#include <map>

#include "comm/communicator.h"
#include "comm/grad_sync.h"
#include "core/config.h"
#include "core/metrics_source.h"

namespace keel {

class SyncReport final : public MetricsSource {
 public:
  // `dp`: the data-parallel group the sync runs over. Silent on a group of one.
  SyncReport(const Config& config, Communicator& dp, const GradSync& sync);
  // After every step, on every rank of the group (one max over the ranks): the step's stats.
  void take(const SyncStats& stats);
  const SyncStats& last() const { return last_; }
  double jitter() const { return jitter_; }

  void print_startup() const override;
  void add_step_fields(double step_ms, nlohmann::json& line) override;
  std::string progress_fragment(double step_ms) const override;
  void print_summary() const override;

 private:
  const Config& config_;
  Communicator& dp_;
  const GradSync& sync_;
  SyncStats last_;
  double jitter_ = 0;                      // std/mean of the latency over the last window of steps
  std::deque<double> latencies_ms_;
  std::map<int, LayerSyncStats> totals_;   // by layer, over the run (compressed sync)
  double encode_ms_ = 0, decode_ms_ = 0;
};

}  // namespace keel
