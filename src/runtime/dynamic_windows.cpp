#include "runtime/dynamic_windows.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "ckpt/checkpoint.h"
#include "core/clock.h"
#include "core/error.h"

namespace keel {

DynamicWindows::DynamicWindows(Config& config, Communicator& dp, GPT& model, const std::string& resumed_from,
                               std::function<double()> probe_loss, std::function<void(const nlohmann::json&)> log,
                               Communicator* tensor)
    : config_(config), dp_(dp), tp_(tensor), probe_loss_(std::move(probe_loss)), log_(std::move(log)) {
  check(model.whole(), "model.attention_window = \"dynamic\": the whole model must be on each rank");
  if (!resumed_from.empty()) {
    config_.model.dynamic_windows_state = read_checkpoint_config(resumed_from).model.dynamic_windows_state;
  }
  for (int l = 1; l + 1 < model.num_layers(); ++l) {
    AttentionProbe* p = model.layer(l).attention_probe();
    check(p != nullptr, "dynamic windows: layer " + std::to_string(l) + " has no attention");
    probes_.push_back(p);
  }
  windows_.resize(probes_.size());
  outside_.assign(probes_.size(), 0.0);
  for (size_t b = 0; b < probes_.size(); ++b) windows_[b] = config_.model.window_of(static_cast<int>(b));
  apply(windows_);
}

int DynamicWindows::choose(const std::vector<double>& mass, double rows, int heads, double eps, int min_window,
                           int seq_len, double* outside) {
  const int K = AttentionProbe::kBuckets;
  // The mass outside window W = 2^k is that of buckets k + 1 and up (distances >= 2^k).
  auto worst_outside = [&](int k) {
    double worst = 0;
    for (int h = 0; h < heads; ++h) {
      double out = 0;
      for (int b = k + 1; b < K; ++b) out += mass[static_cast<size_t>(h) * K + b];
      worst = std::max(worst, rows > 0 ? out / rows : 0.0);
    }
    return worst;
  };
  for (int k = 0; k < K - 1; ++k) {
    const int64_t w = int64_t{1} << k;
    if (w >= seq_len) break;
    if (w < min_window) continue;
    const double out = worst_outside(k);
    if (out <= eps) {
      *outside = out;
      return static_cast<int>(w);
    }
  }
  *outside = 0;
  return 0;  // no window below the sequence length keeps enough: full attention
}

void DynamicWindows::apply(const std::vector<int>& windows) {
  std::string state;
  for (size_t b = 0; b < probes_.size(); ++b) {
    probes_[b]->window = windows[b];
    state += (b ? "," : "") + std::to_string(windows[b]);
  }
  config_.model.dynamic_windows_state = state;
}

double DynamicWindows::loss_with(const std::vector<int>& windows) {
  apply(windows);
  return probe_loss_();
}

void DynamicWindows::before_step(int64_t step) {
  // Not at step 0: an untrained model's loss hardly depends on what it attends to.
  if (step == 0 || step % config_.model.dynamic_window_every != 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  // The probe: full attention on the probe batch, measured. Everything a decision reads (the
  // weights before this step, the fixed batch) is in a checkpoint taken at this step boundary.
  for (AttentionProbe* p : probes_) {
    std::fill(p->mass.begin(), p->mass.end(), 0.0);
    p->rows = 0;
    p->armed = true;
  }
  const std::vector<int> full(probes_.size(), 0);
  const double full_loss = loss_with(full);
  const int heads = config_.model.n_head;
  // All blocks' sums in one collective: every replica decides from the same numbers.
  std::vector<double> all;
  for (AttentionProbe* p : probes_) {
    p->armed = false;
    all.insert(all.end(), p->mass.begin(), p->mass.end());
    // (Tensor ranks probe the same rows, each for its own heads: their rows counted once.)
    all.push_back(tp_ == nullptr || tp_->is_root() ? p->rows : 0.0);
  }
  if (tp_ != nullptr && tp_->size() > 1) tp_->allreduce_sum(all.data(), all.size());
  if (dp_.size() > 1) dp_.allreduce_sum(all.data(), all.size());
  const size_t per = static_cast<size_t>(heads) * AttentionProbe::kBuckets + 1;
  const ModelConfig& m = config_.model;
  auto candidate = [&](double eps, std::vector<double>* outside) {
    std::vector<int> w(probes_.size());
    for (size_t b = 0; b < probes_.size(); ++b) {
      const std::vector<double> mass(all.begin() + b * per, all.begin() + (b + 1) * per - 1);
      w[b] = choose(mass, all[(b + 1) * per - 1], heads, eps, m.dynamic_window_min, config_.train.longest_seq_len(), &(*outside)[b]);
    }
    return w;
  };
  const std::vector<int> before = windows_;
  const double bound = full_loss + std::abs(full_loss) * m.dynamic_window_loss;
  std::vector<int> chosen = full, tried = full;
  std::vector<double> outside(probes_.size(), 0.0), chosen_outside(probes_.size(), 0.0);
  double chosen_loss = full_loss, chosen_eps = 0;
  for (double eps = 0.5; eps >= m.dynamic_window_mass * (1 - 1e-9); eps /= 2) {
    const std::vector<int> w = candidate(eps, &outside);
    if (w == tried) continue;  // the same windows as the last candidate tried
    tried = w;
    const double loss = loss_with(w);
    if (loss <= bound) {
      chosen = w, chosen_loss = loss, chosen_eps = eps, chosen_outside = outside;
      break;
    }
  }
  windows_ = chosen;
  outside_ = chosen_outside;
  apply(windows_);
  probe_ms_ += ms_since(t0);
  if (windows_ != before && dp_.is_root()) {
    log_({{"event", "attention_windows"}, {"step", step}, {"windows", windows_}, {"outside_mass", outside_},
          {"eps", chosen_eps}, {"probe_loss_full", full_loss}, {"probe_loss", chosen_loss}});
  }
}

void DynamicWindows::print_summary() const {
  std::printf("keel: dynamic attention windows at the end: %s (deciding took %.0f ms over the run)\n",
              config_.model.dynamic_windows_state.c_str(), probe_ms_);
}

void DynamicWindows::print_startup() const {
  std::printf("keel: dynamic attention windows: every %d steps, at most %.3g of any head's attention mass outside, "
              "windows >= %d; now %s\n",
              config_.model.dynamic_window_every, config_.model.dynamic_window_mass, config_.model.dynamic_window_min,
              config_.model.dynamic_windows_state.c_str());
}

void DynamicWindows::add_step_fields(double, nlohmann::json& line) { line["attention_windows"] = windows_; }

std::string DynamicWindows::progress_fragment(double) const {
  std::string s = "windows";
  for (int w : windows_) s += " " + (w ? std::to_string(w) : std::string("full"));
  return s;
}

}  // namespace keel
