// The metrics module: the sinks of everything a run reports. Per step one JSON line in
// run_dir/metrics.jsonl (the loop's own fields, then every source's: see core/metrics_source.h)
// and, every train.log_every steps, one progress line on stdout; events (evaluations,
// checkpoints, recoveries, pipeline layouts) as JSON lines of their own; at the end every
// source's summary. Only rank 0 writes; every rank may call.
#pragma once

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/config.h"
#include "core/metrics_source.h"

namespace keel {

// The loop's own figures of one step.
struct StepStats {
  int64_t step = 0;          // 1-based number of the step just taken
  double loss = 0;           // mean training loss over the step's tokens
  double lr = 0;
  double grad_norm = 0;      // before clipping
  double ms = 0;
  double tokens_per_s = 0;   // over every data-parallel rank
  double mfu = 0;            // model FLOP/s over the peak FLOP/s of the ranks' cores
  double matmul_efficiency = 0;  // model FLOP/s over the ranks' SGEMM rate measured at start-up
  double peak_rss_mb = 0;    // largest peak resident set over ranks so far
  double ckpt_stall_ms = 0;  // step time spent on checkpoints (snapshot, waiting for a write)
  int stop_signal = 0;       // a stop signal any rank had received by the end of the step (0 = none)
  int seq_len = 0;           // the step's sequence length (train.seq_len_schedule)
};

class Metrics {
 public:
  Metrics(const Config& config, Communicator& world);
  // Opens run_dir/metrics.jsonl: anew, or (`keep`: a resumed or restarted run) continuing it
  // without the lines of steps after `step`, which are about to be replayed.
  void open(bool keep, int64_t step);
  // Components report in the order added (that is their order in the progress line).
  void add_source(MetricsSource* source) { sources_.push_back(source); }
  // Each of `old` replaced by the source at the same index of `now` (components rebuilt mid-run).
  void replace_sources(const std::vector<MetricsSource*>& old, const std::vector<MetricsSource*>& now);
  // Consumers of every finished step line, in the order added.
  void add_sink(StepLineSink* sink) { sinks_.push_back(sink); }
  // A source the metrics module owns (monitoring components that only report): added, kept
  // alive as long as the module, and returned for the caller's other uses (a hook, a sink).
  template <typename T>
  T* adopt(std::unique_ptr<T> source) {
    T* raw = source.get();
    owned_.push_back(std::move(source));
    add_source(raw);
    return raw;
  }

  void log(const nlohmann::json& line);  // one line of metrics.jsonl
  void print_startup() const;            // every source's start-up lines
  // The step's JSON line, and its progress line when train.log_every says so.
  void step(const StepStats& s, double moments_mb);
  void evaluation(int64_t step, double loss);
  // An evaluation of other fields (a dual encoder's retrieval): `fields` into the line, `text`
  // after "step N | " on stdout.
  void evaluation(int64_t step, const nlohmann::json& fields, const std::string& text);
  void print_summaries() const;

 private:
  const Config& config_;
  Communicator& world_;
  std::vector<MetricsSource*> sources_;
  std::vector<StepLineSink*> sinks_;
  std::vector<std::unique_ptr<MetricsSource>> owned_;
  std::ofstream file_;
};

}  // namespace keel
