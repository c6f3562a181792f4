// Dynamic attention windows (model.attention_window = "dynamic"): each transformer block's
// sliding window adapts while training, from a measured signal.
//
// Signal. Before every model.dynamic_window_every-th step (not step 0: an untrained model's loss
// hardly depends on what it attends to, so the first steps train with full attention, or with a
// resumed run's windows) the blocks are probed
// on a fixed batch (each rank's first validation window) with full attention: each block
// computes, for the last AttentionProbe::kRows query rows of every sequence, the full causal
// softmax and adds its probability mass at each distance, in power-of-two buckets, per head
// (ops::attention_distance_mass: a small fraction of the pass). The sums are added over the
// tensor group (each rank probes its own heads) and then the data-parallel ranks, so every rank
// decides the same. A decision reads only the weights
// before the step and the fixed batch, so a run resumed at any step decides as the original did.
//
// Rule. After the probed step, for a tolerance eps falling from 0.5 by halves down to
// model.dynamic_window_mass, every block's window is the smallest power of two W >=
// model.dynamic_window_min that leaves at most eps of any head's average mass at distances >= W
// (none when no W below the sequence length does; bucket edges are powers of two, so the mass
// outside a power-of-two window is read off exactly). The first (the smallest) set of windows
// whose loss on the probe batch (the first validation window, averaged over the data-parallel
// ranks) is within model.dynamic_window_loss of full attention's is taken; when none is, full
// attention. The windows then hold until the next probe.
//
// Bound. The loss a window may cost is bounded where it is measured: on the probe batch, at the
// probe, relative to full attention. The mass signal orders the candidates (dropping mass eps
// from a softmax and renormalising moves a query's output by at most 2 eps max_j |v_j|); the
// loss decides. A probe costs up to log2(0.5 / dynamic_window_mass) + 2 forward passes of the
// probe batch. What the windows cost over a whole run is measured: tests/long_context_test.cpp
// compares the final validation loss with full attention's.
//
// State. The windows live in the configuration (model.dynamic_windows_state) that checkpoints
// record: a resumed run starts from the checkpoint's windows and takes the same decisions as an
// uninterrupted one (same bytes).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/config.h"
#include "core/metrics_source.h"
#include "core/step_hook.h"
#include "model/gpt.h"

namespace keel {

class DynamicWindows final : public MetricsSource, public StepHook {
 public:
  // For the blocks of `model` (the whole model: not with pipelines). `config` is the run's own
  // configuration: its model.dynamic_windows_state is kept current. `resumed_from`: the
  // checkpoint a resumed run loaded ("" = a fresh start), whose windows it goes on with.
  // `probe_loss`: the loss on the probe batch (each rank's first validation window, averaged
  // over the ranks: the same on every rank) with the windows the blocks have now. `tensor`: the
  // tensor group (parallel.tensor > 1; null without), whose ranks each probe their own heads: the
  // heads' masses are summed over it (each head's from the one rank that holds it: exact), so every
  // tensor rank decides from all heads, as one rank does.
  DynamicWindows(Config& config, Communicator& dp, GPT& model, const std::string& resumed_from,
                 std::function<double()> probe_loss, std::function<void(const nlohmann::json&)> log,
                 Communicator* tensor = nullptr);

  // Every dynamic_window_every steps (from that step on), before the step: probe and decide.
  void before_step(int64_t step) override;

  void print_startup() const override;
  void print_summary() const override;
  void add_step_fields(double step_ms, nlohmann::json& line) override;
  std::string progress_fragment(double step_ms) const override;

  const std::vector<int>& windows() const { return windows_; }
  // The window the rule picks for one block from its probe (mass [heads][buckets], rows probed).
  static int choose(const std::vector<double>& mass, double rows, int heads, double eps, int min_window, int seq_len,
                    double* outside);

 private:
  void apply(const std::vector<int>& windows);
  double loss_with(const std::vector<int>& windows);
  Config& config_;
  Communicator& dp_;
  Communicator* tp_;  // null: no tensor group
  std::vector<AttentionProbe*> probes_;  // per block
  std::vector<int> windows_;
  std::vector<double> outside_;  // per block: the mass its window left out at the last probe
  std::function<double()> probe_loss_;
  std::function<void(const nlohmann::json&)> log_;
  double probe_ms_ = 0;  // time spent deciding, over the run
};

}  // namespace keel
