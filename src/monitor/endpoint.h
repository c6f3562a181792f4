// The Prometheus endpoint ([monitor] port): http://BIND:PORT/metrics on rank 0, served by Keel's
// own HTTP server (monitor/http_server.h: one thread, bounded per client) from prometheus-cpp
// gauges and counters the training thread only sets (a scrape never waits on training, nor
// training on a scrape: after a series' first step the training thread touches only its atomic,
// never the registry's lock that a scrape's Collect holds). Rank 0 serves the whole job: its step
// line already holds the job's figures (throughput over all ranks, the largest peak RSS, sync maxima
// over the data-parallel group). Names follow Prometheus conventions (base units, _total
// counters); the list is in docs/monitoring.md.
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "core/config.h"
#include "core/metrics_source.h"

namespace prometheus {
class Registry;
class Gauge;
class Counter;
}  // namespace prometheus

namespace keel {

namespace http {
class Server;
}

class PrometheusEndpoint final : public StepLineSink, public MetricsSource {
 public:
  // Listens at once; throws keel::Error naming monitor.port when it cannot (in use, not allowed).
  explicit PrometheusEndpoint(const MonitorConfig& config);
  ~PrometheusEndpoint() override;

  void observe_step(const nlohmann::json& line) override;
  void observe_event(const nlohmann::json& line) override;
  void print_startup() const override;
  void add_step_fields(double, nlohmann::json&) override {}
  const std::string& address() const { return address_; }

 private:
  prometheus::Gauge& gauge(const std::string& name, const std::string& help,
                           const std::map<std::string, std::string>& labels = {});
  prometheus::Counter& counter(const std::string& name, const std::string& help,
                               const std::map<std::string, std::string>& labels = {});
  void set(const nlohmann::json& line, const char* field, const std::string& name, const std::string& help,
           double scale = 1.0, const std::map<std::string, std::string>& labels = {});
  void add(const nlohmann::json& line, const char* field, const std::string& name, const std::string& help,
           double scale = 1.0, const std::map<std::string, std::string>& labels = {});

  std::string address_;
  std::shared_ptr<prometheus::Registry> registry_;
  // Each series once registered, by name and labels (the training thread's alone).
  std::map<std::string, prometheus::Gauge*> gauges_;
  std::map<std::string, prometheus::Counter*> counters_;
  std::unique_ptr<http::Server> server_;
};

}  // namespace keel
