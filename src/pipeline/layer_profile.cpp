#include "pipeline/layer_profile.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/fileio.h"
#include "pipeline/layout.h"

namespace keel::pipeline {

using nlohmann::json;

namespace {

constexpr double kSmoothing = 0.3;  // weight of the newest step in the exponential average

std::vector<double*> columns(LayerCosts& c, size_t i) {
  return {&c.forward[i], &c.backward_input[i], &c.backward_weight[i], &c.comm[i]};
}

LayerCosts zeros(int L) {
  LayerCosts c;
  for (std::vector<double>* v : {&c.forward, &c.backward_input, &c.backward_weight, &c.comm, &c.activation_bytes,
                                 &c.param_bytes}) {
    v->assign(static_cast<size_t>(L), 0.0);
  }
  return c;
}

}  // namespace

std::vector<double> LayerCosts::total() const {
  std::vector<double> t(forward.size());
  for (size_t i = 0; i < t.size(); ++i) {
    t[i] = forward[i] + backward_input[i] + backward_weight[i] + (i < comm.size() ? comm[i] : 0.0);
  }
  return t;
}

json LayerCosts::to_json() const {
  return {{"forward", forward},     {"backward_input", backward_input}, {"backward_weight", backward_weight},
          {"comm", comm},           {"activation_bytes", activation_bytes}, {"param_bytes", param_bytes},
          {"seq_len", seq_len},     {"message_ms", message_ms}};
}

LayerCosts LayerCosts::from_json(const json& j, int layers, const std::string& what) {
  LayerCosts c = zeros(layers);
  try {
    c.forward = j.at("forward").get<std::vector<double>>();
    c.backward_input = j.at("backward_input").get<std::vector<double>>();
    c.backward_weight = j.at("backward_weight").get<std::vector<double>>();
    if (j.contains("comm") && j.at("comm").is_array()) c.comm = j.at("comm").get<std::vector<double>>();
    if (j.contains("comm") && j.at("comm").is_number()) c.message_ms = j.at("comm").get<double>();
    if (j.contains("message_ms")) c.message_ms = j.at("message_ms").get<double>();
    if (j.contains("activation_bytes")) c.activation_bytes = j.at("activation_bytes").get<std::vector<double>>();
    if (j.contains("param_bytes")) c.param_bytes = j.at("param_bytes").get<std::vector<double>>();
    c.seq_len = j.value("seq_len", 0);
  } catch (const json::exception& e) {
    throw Error(what + ": " + e.what());
  }
  for (const auto& [name, v] : {std::pair<const char*, const std::vector<double>*>{"forward", &c.forward},
                                {"backward_input", &c.backward_input},
                                {"backward_weight", &c.backward_weight},
                                {"comm", &c.comm},
                                {"activation_bytes", &c.activation_bytes},
                                {"param_bytes", &c.param_bytes}}) {
    check(static_cast<int>(v->size()) == layers, what + ": expected " + std::to_string(layers) + " values in '" + name +
                                                     "' (embedding, " + std::to_string(layers - 2) +
                                                     " blocks, head), found " + std::to_string(v->size()));
    for (double x : *v) check(std::isfinite(x) && x >= 0, what + ": '" + std::string(name) + "' holds " + std::to_string(x));
  }
  return c;
}

LayerCosts LayerCosts::at_seq_len(const ModelConfig& model, int T) const {
  if (seq_len <= 0 || T == seq_len) return *this;
  const std::vector<double> now = layer_costs(model, seq_len), then = layer_costs(model, T);
  LayerCosts c = *this;
  c.seq_len = T;
  for (size_t i = 0; i < forward.size(); ++i) {
    const double f = then[i] / now[i], tokens = static_cast<double>(T) / seq_len;
    for (double* x : columns(c, i)) *x *= f * tokens;  // FLOPs per token, times tokens per sequence
    c.comm[i] = comm[i] * tokens;                       // messages grow with the activations
    c.activation_bytes[i] = activation_bytes[i] * tokens;
  }
  return c;
}

LayerCosts read_layer_costs(const std::string& path, int layers) {
  const std::string text = read_text_file(path);
  json found;
  try {
    const json whole = json::parse(text);
    found = whole.contains("layer_costs") ? whole.at("layer_costs") : whole;
  } catch (const json::exception&) {
    // metrics.jsonl: one JSON object per line; the last layer_costs event.
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      if (end > at) {
        try {
          const json line = json::parse(text.substr(at, end - at));
          if (line.value("event", "") == "layer_costs") found = line.at("layer_costs");
        } catch (const json::exception& e) {
          throw Error("layer costs " + path + ": neither a JSON object nor JSON lines (" + e.what() + ")");
        }
      }
      at = end + 1;
    }
    check(!found.is_null(), "layer costs " + path + ": no layer_costs event in these metrics");
  }
  return LayerCosts::from_json(found, layers, "layer costs " + path);
}

LayerProfiler::LayerProfiler(GPT& model, Communicator* stages, int every, std::function<void(const json&)> log_event)
    : model_(model), stages_(stages), every_(every), log_event_(std::move(log_event)) {
  const int L = model.num_layers();
  smoothed_ = local_ = interval_ = predicted_ = zeros(L);
}

void LayerProfiler::after_step(int64_t step, int seq_len, int micro_batch, int micro_batches,
                               const std::vector<double>* comm_ms, double message_ms) {
  const GPT::LayerTimes t = model_.take_layer_times();
  report_now_ = false;
  // The first step (of the run, or of the stages after a re-cut) pays for first touches and
  // one-time set-up: not a cost of the layers.
  if (!seen_) {
    seen_ = true;
    local_.seq_len = seq_len;
    return;
  }
  // A new sequence length (a curriculum): what was measured is carried to it by the FLOP model
  // (LayerCosts::at_seq_len), and its first step, which touches activation memory no step has
  // yet, is not measured.
  if (seq_len != local_.seq_len) {
    const ModelConfig& m = model_.config();
    const int was = local_.seq_len;
    local_ = local_.at_seq_len(m, seq_len);
    interval_.seq_len = was;
    interval_ = interval_.at_seq_len(m, seq_len);
  } else {
    measure(t, micro_batches, comm_ms, message_ms);
  }
  // Reports fall on the run's steps that are multiples of `every` (a re-cut every k x every steps
  // then decides on a report of that very step).
  if (every_ > 0 && step % every_ == 0 && interval_steps_ > 0) report(step, seq_len, micro_batch);
}

void LayerProfiler::measure(const GPT::LayerTimes& t, int micro_batches, const std::vector<double>* comm_ms,
                            double message_ms) {
  const int L = model_.num_layers();
  // This rank's layers, smoothed and summed over the interval here; the ranks' figures meet only
  // at a report (each layer is on one rank, so their sum is the model's).
  const bool first = steps_ == 0;
  steps_++;
  interval_steps_++;
  const double per = 1.0 / std::max(1, micro_batches);
  for (int i = 0; i < L; ++i) {
    const double x[4] = {t.forward[i] * per, t.backward_input[i] * per, t.backward_weight[i] * per,
                         comm_ms != nullptr ? (*comm_ms)[i] * per : 0.0};
    std::vector<double*> s = columns(local_, static_cast<size_t>(i)), n = columns(interval_, static_cast<size_t>(i));
    for (int k = 0; k < 4; ++k) {
      *s[k] = first ? x[k] : (1 - kSmoothing) * *s[k] + kSmoothing * x[k];
      *n[k] += x[k];
    }
  }
  if (message_ms >= 0) {
    local_.message_ms = local_.message_ms < 0 ? message_ms : (1 - kSmoothing) * local_.message_ms + kSmoothing * message_ms;
  }
}

void LayerProfiler::report(int64_t step, int seq_len, int micro_batch) {
  const int L = model_.num_layers();
  // A report: [smoothed F | B | W | comm | interval F | B | W | comm | activation bytes |
  // parameter bytes] summed over the stages' ranks, the quickest message over them.
  std::vector<double> params(static_cast<size_t>(L), 0.0);
  for (const Chunk& c : model_.store().chunks()) {
    if (!c.replica) params[c.layer] += static_cast<double>(c.numel) * sizeof(float);
  }
  std::vector<double> v(static_cast<size_t>(10) * L, 0.0);
  for (int i = 0; i < L; ++i) {
    std::vector<double*> s = columns(local_, static_cast<size_t>(i)), n = columns(interval_, static_cast<size_t>(i));
    for (int k = 0; k < 4; ++k) {
      v[static_cast<size_t>(k) * L + i] = *s[k];
      v[static_cast<size_t>(k + 4) * L + i] = *n[k];
    }
    if (model_.has_layer(i)) {
      v[8 * L + i] = static_cast<double>(model_.layer_activation_bytes(i, micro_batch, seq_len));
      v[9 * L + i] = params[i];
    }
  }
  double quickest = local_.message_ms;
  if (stages_ != nullptr && stages_->size() > 1) {
    stages_->allreduce_sum(v.data(), v.size());
    const double q = stages_->allreduce_min(quickest < 0 ? 1e300 : quickest);
    quickest = q >= 1e300 ? -1 : q;
  }
  LayerCosts measured = zeros(L);  // the interval's mean
  for (int i = 0; i < L; ++i) {
    std::vector<double*> s = columns(smoothed_, static_cast<size_t>(i)), n = columns(measured, static_cast<size_t>(i));
    for (int k = 0; k < 4; ++k) {
      *s[k] = v[static_cast<size_t>(k) * L + i];
      *n[k] = v[static_cast<size_t>(k + 4) * L + i] / interval_steps_;
    }
    smoothed_.activation_bytes[i] = v[8 * L + i];
    smoothed_.param_bytes[i] = v[9 * L + i];
  }
  smoothed_.seq_len = seq_len;
  smoothed_.message_ms = quickest;
  // The interval against the prediction made at the last report (scaled to this interval's
  // sequence length).
  const std::vector<double> measured_total = measured.total(),
                            predicted_total = predicted_.at_seq_len(model_.config(), seq_len).total();
  double err = 0, sum = 0;
  for (int i = 0; i < L; ++i) {
    err += std::abs(predicted_total[i] - measured_total[i]);
    sum += measured_total[i];
  }
  error_ = predicted_.seq_len > 0 && sum > 0 ? err / sum : -1;
  predicted_ = smoothed_;
  interval_ = zeros(L);
  interval_steps_ = 0;
  report_now_ = true;
  reports_++;
  json line = {{"event", "layer_costs"}, {"step", step}, {"layer_costs", smoothed_.to_json()}};
  if (error_ >= 0) line["prediction_error"] = error_;
  if (log_event_) log_event_(line);
}

void LayerProfiler::add_step_fields(double, json& line) {
  if (report_now_ && error_ >= 0) line["layer_cost_prediction_error"] = error_;
}

}  // namespace keel::pipeline
