// The seam between a component and the metrics module (runtime/metrics.h): a component that has
// figures to report implements this, and its stats type knows its JSON fields, its fragment of
// the progress line and its end-of-run summary. The metrics module owns the sinks (the progress
// line on stdout, run_dir/metrics.jsonl, the end-of-run tables) and asks every source in turn.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace keel {

class MetricsSource {
 public:
  virtual ~MetricsSource() = default;
  // Printed to stdout once, before the first step, on rank 0: how the component is set up.
  virtual void print_startup() const {}
  // Adds this step's fields to the step's metrics.jsonl line (field names are documented on the
  // docs/ pages: users' scripts read them). `step_ms` is the step's wall time.
  virtual void add_step_fields(double step_ms, nlohmann::json& line) = 0;
  // This step's fragment of the progress line, without separators ("" = nothing to show).
  virtual std::string progress_fragment(double step_ms) const { return ""; }
  // Printed to stdout once, after the last step, on rank 0.
  virtual void print_summary() const {}
};

// A consumer of the finished step line (every source's fields in it): alerts, a live endpoint.
// Called on rank 0, after the line is written.
class StepLineSink {
 public:
  virtual ~StepLineSink() = default;
  virtual void observe_step(const nlohmann::json& line) = 0;
  // Every other line of metrics.jsonl (evaluations, events), as it is written.
  virtual void observe_event(const nlohmann::json& line) {}
};

}  // namespace keel
