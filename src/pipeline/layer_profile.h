// Per-layer costs measured while training: the partitioners' input (pipeline/partitioner.h).
//
// Every step the model times each of its layers' F, B and W (GPT::take_layer_times: a clock read
// around each call, nothing else); the profiler adds the step's send and receive time at each
// stage boundary (from the executor's timeline), the bytes a micro-batch keeps per layer and each
// layer's parameter bytes, sums the layers over the pipeline's ranks (each layer lives on one),
// and smooths them (an exponential average; each rank its own layers, the ranks' figures summed
// only at a report: no collective in the other steps). At every step that is a multiple of `every` it writes the smoothed costs as
// a `{"event": "layer_costs"}` line of metrics.jsonl — the object `keel schedule --layer-costs`
// reads — with how far its previous prediction was from what the interval measured.
//
// Prediction: the next interval's per-layer cost is the smoothed cost, scaled to the coming
// batches' sequence length by the layer's FLOP model (attention's part grows with T; the dense
// parts do not): LayerCosts::at_seq_len. When a curriculum changes the length, the figures so far
// are carried to the new length the same way and the first step at it is not measured (it pays
// for first touches of the longer activations).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/config.h"
#include "core/metrics_source.h"
#include "model/gpt.h"

namespace keel::pipeline {

// Per layer of the model (embedding, blocks, head): what one micro-batch costs it (the unit of
// the schedule simulator's instructions).
struct LayerCosts {
  std::vector<double> forward, backward_input, backward_weight;  // ms per micro-batch
  std::vector<double> comm;              // ms per micro-batch sending and receiving at the layer's stage edges
  std::vector<double> activation_bytes;  // kept per micro-batch in flight
  std::vector<double> param_bytes;       // its parameters (one float32 plane; state is 4 planes)
  int seq_len = 0;                       // the sequence length they were measured at (0: unknown)
  double message_ms = -1;                // one message's latency when given as such (-1: from comm)

  int layers() const { return static_cast<int>(forward.size()); }
  // F + B + W + comm per layer.
  std::vector<double> total() const;
  nlohmann::json to_json() const;
  // The object `keel schedule --layer-costs` reads: forward, backward_input and backward_weight
  // (required, `layers` each), comm (per layer, or one number: a message's latency),
  // activation_bytes, param_bytes, seq_len (optional). Throws keel::Error naming `what`.
  static LayerCosts from_json(const nlohmann::json& j, int layers, const std::string& what);
  // The same costs at sequence length T: every cost of a layer scaled by how its FLOPs per step
  // grow (layout.h layer_costs at T over at seq_len; activations linearly in T).
  LayerCosts at_seq_len(const ModelConfig& model, int T) const;
};

// The costs in `path`: a JSON object as above, or a run's metrics.jsonl (its last layer_costs
// event). Throws keel::Error naming the file.
LayerCosts read_layer_costs(const std::string& path, int layers);

class LayerProfiler final : public MetricsSource {
 public:
  // `stages`: the pipeline group whose ranks hold the model's layers (null: this rank holds them
  // all). `every` steps between reports; `log_event` writes the report lines (rank 0).
  LayerProfiler(GPT& model, Communicator* stages, int every, std::function<void(const nlohmann::json&)> log_event);

  // After step `step` (steps done) of `micro_batches` micro-batches of `micro_batch` sequences
  // at `seq_len`: takes the step's layer times, the step's send / receive time per layer (null:
  // none) and its quickest message (ms, the latency the simulator uses; < 0: none).
  void after_step(int64_t step, int seq_len, int micro_batch, int micro_batches, const std::vector<double>* comm_ms,
                  double message_ms);

  // The smoothed costs of the last report (the same on every rank of the group).
  const LayerCosts& costs() const { return smoothed_; }
  bool reported() const { return reports_ > 0; }
  // Mean relative error of the last report's prediction against what its interval measured,
  // weighted by cost (-1 before there is one).
  double prediction_error() const { return error_; }

  void add_step_fields(double step_ms, nlohmann::json& line) override;

 private:
  // A step's times into the smoothed and interval figures.
  void measure(const GPT::LayerTimes& t, int micro_batches, const std::vector<double>* comm_ms, double message_ms);
  // The report: the ranks' figures summed, the prediction's error, the layer_costs line.
  void report(int64_t step, int seq_len, int micro_batch);

  GPT& model_;
  Communicator* stages_;
  int every_;
  std::function<void(const nlohmann::json&)> log_event_;
  // smoothed_: the model's, at the last report; local_, interval_: this rank's layers since
  // (smoothed, and summed over the interval's steps); predicted_: for the coming interval.
  LayerCosts smoothed_, local_, interval_, predicted_;
  int interval_steps_ = 0;
  int64_t steps_ = 0;
  double error_ = -1;
  bool report_now_ = false;
  bool seen_ = false;  // a step: the first one a profiler sees pays for set-up (first touches)
  int reports_ = 0;
};

}  // namespace keel::pipeline
