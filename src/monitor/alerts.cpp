#include "monitor/alerts.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace keel {

namespace {

constexpr size_t kWindow = 20;

double mean(const std::deque<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? std::nan("") : s / static_cast<double>(v.size());
}

double median(std::deque<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void remember(std::deque<double>& window, double value) {
  if (!std::isfinite(value)) return;
  window.push_back(value);
  if (window.size() > kWindow) window.pop_front();
}

}  // namespace

Alerts::Alerts(const MonitorConfig& config, std::function<void(const nlohmann::json&)> log_event)
    : config_(config), log_event_(std::move(log_event)) {
  rules_ = {{"tier_hit_rate", "monitor.min_hit_rate", false},
            {"pipeline_bubble", "monitor.max_bubble", true},
            {"sync_jitter", "monitor.max_sync_jitter", true},
            {"loss", "monitor.loss_spike", true},
            {"ms", "monitor.stall_factor", true},
            {"moe_imbalance", "monitor.max_moe_imbalance", true, config.moe_imbalance_after}};
}

bool Alerts::out_of_range(const Rule& r, double value, double* threshold) const {
  if (r.metric == "tier_hit_rate") *threshold = config_.min_hit_rate;
  if (r.metric == "pipeline_bubble") *threshold = config_.max_bubble;
  if (r.metric == "sync_jitter") *threshold = config_.max_sync_jitter;
  if (r.metric == "moe_imbalance") *threshold = config_.max_moe_imbalance;
  if (r.metric == "loss") {
    if (!std::isfinite(value)) {
      *threshold = std::numeric_limits<double>::infinity();
      return true;
    }
    // A spike needs a reference: the mean of the steps before (at least 5 of them).
    *threshold = recent_loss_.size() >= 5 ? config_.loss_spike * mean(recent_loss_) : std::nan("");
  }
  if (r.metric == "ms") *threshold = recent_ms_.size() >= 5 ? config_.stall_factor * median(recent_ms_) : std::nan("");
  if (std::isnan(*threshold)) return false;
  return r.above ? value > *threshold : value < *threshold;
}

void Alerts::observe_step(const nlohmann::json& line) {
  const int64_t step = line.value("step", int64_t{0});
  for (Rule& r : rules_) {
    if (!line.contains(r.metric) || !line.at(r.metric).is_number()) continue;
    const double value = line.at(r.metric).get<double>();
    double threshold = std::nan("");
    const bool out = out_of_range(r, value, &threshold);
    r.out = out ? r.out + 1 : 0;
    r.in = out ? 0 : r.in + 1;
    const int after = r.after > 0 ? r.after : config_.alert_after;
    const bool fire = !r.firing && r.out >= after;
    const bool clear = r.firing && r.in >= after;
    if (!fire && !clear) continue;
    r.firing = fire;
    r.fired += fire ? 1 : 0;
    char text[256];
    const char* relation = r.above ? ">" : "<";
    if (fire) {
      std::snprintf(text, sizeof text, "keel: ALERT at step %lld: %s %.4g %s %.4g (%s) for %d steps",
                    static_cast<long long>(step), r.metric.c_str(), value, relation, threshold, r.key.c_str(), r.out);
    } else {
      std::snprintf(text, sizeof text, "keel: alert resolved at step %lld: %s %.4g, in range for %d steps",
                    static_cast<long long>(step), r.metric.c_str(), value, r.in);
    }
    std::printf("%s\n", text);
    std::fflush(stdout);
    nlohmann::json event = {{"event", "alert"},  {"state", fire ? "firing" : "resolved"},
                            {"metric", r.metric}, {"value", value},
                            {"rule", r.key},      {"step", step}};
    if (std::isfinite(threshold)) event["threshold"] = threshold;
    log_event_(event);
  }
  if (line.contains("loss") && line.at("loss").is_number()) remember(recent_loss_, line.at("loss").get<double>());
  if (line.contains("ms") && line.at("ms").is_number()) remember(recent_ms_, line.at("ms").get<double>());
}

std::vector<std::string> Alerts::firing() const {
  std::vector<std::string> out;
  for (const Rule& r : rules_) {
    if (r.firing) out.push_back(r.metric);
  }
  return out;
}

std::string Alerts::progress_fragment(double) const {
  std::string names;
  for (const std::string& f : firing()) names += (names.empty() ? "" : ", ") + f;
  return names.empty() ? "" : "ALERT " + names;
}

void Alerts::print_summary() const {
  std::string fired;
  for (const Rule& r : rules_) {
    if (r.fired > 0) fired += (fired.empty() ? "" : ", ") + r.metric + " " + std::to_string(r.fired) + "x";
  }
  if (!fired.empty()) std::printf("keel: alerts over this run: %s\n", fired.c_str());
}

}  // namespace keel
