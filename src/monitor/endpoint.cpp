#include "monitor/endpoint.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "monitor/http_server.h"

namespace keel {

PrometheusEndpoint::PrometheusEndpoint(const MonitorConfig& config)
    : registry_(std::make_shared<prometheus::Registry>()) {
  http::ServerOptions options;
  options.bind = config.bind;
  options.port = config.port;
  // (server_ is declared after registry_, so it stops before the registry it reads goes)
  const prometheus::Registry* registry = registry_.get();
  try {
    server_ = std::make_unique<http::Server>(
        options, [registry] { return prometheus::TextSerializer().Serialize(registry->Collect()); });
  } catch (const Error& e) {
    throw Error("monitor.port " + std::to_string(config.port) + ": " + e.what());
  }
  address_ = server_->address();
}

PrometheusEndpoint::~PrometheusEndpoint() = default;

void PrometheusEndpoint::print_startup() const {
  std::printf("keel: Prometheus metrics at http://%s/metrics (rank 0 serves the whole job)\n", address_.c_str());
}

namespace {

std::string series_key(const std::string& name, const std::map<std::string, std::string>& labels) {
  std::string key = name;
  for (const auto& [k, v] : labels) key += "\n" + k + "=" + v;
  return key;
}

}  // namespace

prometheus::Gauge& PrometheusEndpoint::gauge(const std::string& name, const std::string& help,
                                             const std::map<std::string, std::string>& labels) {
  prometheus::Gauge*& g = gauges_[series_key(name, labels)];
  if (g == nullptr) g = &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_).Add(labels);
  return *g;
}

prometheus::Counter& PrometheusEndpoint::counter(const std::string& name, const std::string& help,
                                                 const std::map<std::string, std::string>& labels) {
  prometheus::Counter*& c = counters_[series_key(name, labels)];
  if (c == nullptr) c = &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_).Add(labels);
  return *c;
}

void PrometheusEndpoint::set(const nlohmann::json& line, const char* field, const std::string& name,
                             const std::string& help, double scale, const std::map<std::string, std::string>& labels) {
  if (!line.contains(field) || !line.at(field).is_number()) return;
  gauge(name, help, labels).Set(line.at(field).get<double>() * scale);
}

void PrometheusEndpoint::add(const nlohmann::json& line, const char* field, const std::string& name,
                             const std::string& help, double scale, const std::map<std::string, std::string>& labels) {
  if (!line.contains(field) || !line.at(field).is_number()) return;
  const double v = line.at(field).get<double>() * scale;
  if (std::isfinite(v) && v > 0) counter(name, help, labels).Increment(v);
}

void PrometheusEndpoint::observe_step(const nlohmann::json& l) {
  set(l, "step", "keel_step", "Optimizer steps done");
  set(l, "loss", "keel_loss", "Training loss of the last step");
  set(l, "tokens_per_s", "keel_tokens_per_second", "Training tokens per second over all ranks");
  if (l.contains("tokens_per_s") && l.contains("ms")) {
    counter("keel_tokens_total", "Training tokens processed")
        .Increment(l.at("tokens_per_s").get<double>() * l.at("ms").get<double>() / 1e3);
  }
  set(l, "ms", "keel_step_seconds", "Wall time of the last step", 1e-3);
  set(l, "mfu", "keel_mfu_ratio", "Model FLOP/s over the peak FLOP/s of the job's cores");
  set(l, "peak_rss_mb", "keel_peak_rss_bytes", "Largest peak resident set over ranks", 1e6);
  set(l, "grad_norm", "keel_grad_norm", "Global gradient norm before clipping");
  set(l, "tier_hit_rate", "keel_tier_hit_ratio", "First touches of pages that were present", 1.0,
      {{"tier", "offload"}});
  for (const char* tier : {"device", "host", "nvme"}) {
    const std::string p = std::string("tier_") + tier + "_";
    set(l, (p + "hit_rate").c_str(), "keel_tier_hit_ratio", "First touches of pages that were present", 1.0,
        {{"tier", tier}});
    set(l, (p + "resident_bytes").c_str(), "keel_tier_resident_bytes", "Bytes a tier holds", 1.0, {{"tier", tier}});
    add(l, (p + "read_bytes").c_str(), "keel_tier_read_bytes_total", "Bytes read from a tier into the device tier", 1.0,
        {{"tier", tier}});
    add(l, (p + "written_bytes").c_str(), "keel_tier_written_bytes_total", "Bytes written back into a tier", 1.0,
        {{"tier", tier}});
  }
  add(l, "tier_stall_ms", "keel_tier_stall_seconds_total", "Time acquires waited for pages", 1e-3);
  set(l, "pipeline_bubble", "keel_pipeline_bubble_ratio", "Idle share of the pipeline step");
  set(l, "sync_latency_ms", "keel_sync_latency_seconds", "Gradient sync latency of the last step", 1e-3);
  set(l, "sync_jitter", "keel_sync_jitter_ratio", "Gradient sync latency jitter");
  add(l, "sync_sent_bytes", "keel_sync_sent_bytes_total", "Gradient bytes sent");
  add(l, "sync_uncompressed_bytes", "keel_sync_uncompressed_bytes_total", "Gradient bytes before compression");
  add(l, "ckpt_stall_ms", "keel_checkpoint_stall_seconds_total", "Step time spent on checkpoints", 1e-3);
  add(l, "energy_j", "keel_energy_joules_total", "Energy of training (RAPL, or modelled from CPU time)");
  set(l, "skipped_steps", "keel_skipped_steps", "Steps skipped for a non-finite loss or norm");
  // A mixture of experts, per MoE block (the store's layer) and expert.
  if (l.contains("moe_layers") && l.at("moe_layers").is_array()) {
    for (const nlohmann::json& x : l.at("moe_layers")) {
      if (!x.is_object() || !x.contains("layer") || !x.at("layer").is_number_integer()) continue;
      const std::string layer = std::to_string(x.at("layer").get<int>());
      set(x, "imbalance", "keel_moe_imbalance_ratio", "Busiest expert's routed tokens over the mean, last step", 1.0,
          {{"layer", layer}});
      set(x, "entropy", "keel_moe_router_entropy_nats", "Router's mean entropy per token, last step", 1.0,
          {{"layer", layer}});
      add(x, "dropped", "keel_moe_dropped_tokens_total", "Token-expert pairs dropped over capacity", 1.0,
          {{"layer", layer}});
      if (!x.contains("tokens") || !x.at("tokens").is_array()) continue;
      const nlohmann::json& tokens = x.at("tokens");
      for (size_t e = 0; e < tokens.size(); ++e) {
        if (!tokens[e].is_number() || !(tokens[e].get<double>() > 0)) continue;
        counter("keel_moe_expert_tokens_total", "Token-expert pairs routed to an expert",
                {{"layer", layer}, {"expert", std::to_string(e)}})
            .Increment(tokens[e].get<double>());
      }
    }
  }
  // A mixture of experts in the memory tiers (runtime/expert_tiers.h), per MoE block and expert:
  // its pages' first touches, hits, stall and bytes read, and its home (1 for the tier it is homed
  // on, 0 for the others).
  if (l.contains("tier_experts") && l.at("tier_experts").is_array()) {
    for (const nlohmann::json& x : l.at("tier_experts")) {
      if (!x.is_object() || !x.contains("layer") || !x.at("layer").is_number_integer() || !x.contains("experts") ||
          !x.at("experts").is_array()) {
        continue;
      }
      const std::string layer = std::to_string(x.at("layer").get<int>());
      const nlohmann::json& experts = x.at("experts");
      for (size_t i = 0; i < experts.size(); ++i) {
        if (!experts[i].is_number_integer()) continue;
        const std::map<std::string, std::string> labels = {{"layer", layer},
                                                           {"expert", std::to_string(experts[i].get<int>())}};
        auto count = [&](const char* field, const std::string& name, const std::string& help, double scale) {
          if (!x.contains(field) || !x.at(field).is_array() || i >= x.at(field).size()) return;
          const nlohmann::json& v = x.at(field)[i];
          if (!v.is_number()) return;
          // Registered at the first step, so that an expert never touched still shows its zero.
          prometheus::Counter& c = counter(name, help, labels);
          if (std::isfinite(v.get<double>()) && v.get<double>() > 0) c.Increment(v.get<double>() * scale);
        };
        count("acquires", "keel_moe_expert_tier_touches_total", "First touches of an expert's pages in the tiers", 1.0);
        count("hits", "keel_moe_expert_tier_hits_total", "First touches of an expert's pages that were present", 1.0);
        count("stall_ms", "keel_moe_expert_tier_stall_seconds_total", "Time acquires of an expert's pages waited", 1e-3);
        count("read_bytes", "keel_moe_expert_tier_read_bytes_total", "Bytes of an expert's pages read into the device tier",
              1.0);
        if (!x.contains("home") || !x.at("home").is_array() || i >= x.at("home").size() || !x.at("home")[i].is_string()) {
          continue;
        }
        const std::string home = x.at("home")[i].get<std::string>();
        for (const char* tier : {"device", "host", "nvme"}) {
          std::map<std::string, std::string> at = labels;
          at["tier"] = tier;
          gauge("keel_moe_expert_home", "1 for the tier an expert's pages are homed on, else 0", at)
              .Set(home == tier ? 1.0 : 0.0);
        }
      }
    }
  }
}

void PrometheusEndpoint::observe_event(const nlohmann::json& l) {
  set(l, "val_loss", "keel_val_loss", "Validation loss of the last evaluation");
  const std::string event = l.value("event", "");
  if (event == "checkpoint" && l.value("ok", false)) {
    counter("keel_checkpoints_total", "Checkpoints published").Increment();
    add(l, "written_bytes", "keel_checkpoint_written_bytes_total", "Bytes written by checkpoints");
    add(l, "write_ms", "keel_checkpoint_write_seconds_total", "Background write time of checkpoints", 1e-3);
  } else if (event == "recovery") {
    counter("keel_recoveries_total", "Restarts recovered from a failure").Increment();
  } else if (event == "alert") {
    gauge("keel_alert_firing", "1 while an alert rule fires", {{"metric", l.value("metric", "?")}})
        .Set(l.value("state", "") == "firing" ? 1.0 : 0.0);
  }
}

}  // namespace keel
