// Gradient prediction for a pipeline (parallel.predict_gradients, experimental): the last
// micro-batch's W of each stage runs a step late (pipeline/executor.h defer_last_weights), and
// its gradient is predicted in the meantime, so the step need not wait for it. Predictors: the
// step's other micro-batches' mean (mean), what the same W added one step earlier (previous), an
// exponential average of that (momentum), or a per-chunk blend of mean and previous that a small
// LSTM learns online (lstm, pipeline/gradient_predictor.h). The prediction's negative stays in the
// gradient plane after the update, so the true gradient, added when the carried W runs,
// corrects it a step later: over the run every true gradient is applied once.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "core/config.h"
#include "pipeline/executor.h"
#include "pipeline/gradient_predictor.h"
#include "store/chunk_store.h"

namespace keel::pipeline {

// Per chunk of `store` (the chunks of `model`'s layers): whether the W's of the micro-batch whose
// backward passes ran last (`inputs`: its Batch::inputs) may write it: every chunk but a
// mixture-of-experts block's routed expert that none of that micro-batch's rows chose (with an
// expert group: none its group's rows chose, of this rank's experts; model/moe.h experts_written).
// Layers below `frozen_layers` are not asked (their W does not run; carry() clears them).
std::vector<bool> chunks_weights_write(GPT& model, const ChunkStore& store, const int* inputs, int frozen_layers);

class GradientPrediction {
 public:
  // `how`: mean | previous | momentum | lstm (not off).
  GradientPrediction(PredictGradients how, ChunkStore& store);
  // Makes `executor` carry each stage's last W into the next step, measuring what it adds.
  void attach(Executor& executor);
  // Before the sync, with `micro_batches` in the step: adds the prediction of the carried W's
  // gradients. The plane then holds the step's whole (predicted) gradient. `written`, per chunk
  // (empty: all): whether the carried W's can write it; a chunk they leave as it is (a routed
  // expert no row of their micro-batch chose: chunks_weights_write) is predicted zero, exactly.
  void predict(int micro_batches, const std::vector<bool>& written = {});
  // After the update: leaves the prediction's negative in the plane, for the true gradients to
  // correct (frozen layers' chunks, the first `frozen_layers` layers, are cleared instead).
  void carry(int frozen_layers);

  // Its state between steps, for a checkpoint, once the carried W's ran (Executor::run_deferred):
  // the gradient plane (the prediction's negative plus their true gradients), the prediction,
  // their measurement, and each predictor's history (momentum's average; the LSTM with its last
  // blend's mean and previous). save() appends the floats and describes them; restore() takes
  // back what save() gave, once check_saved() found that it fits: "" or why not (another
  // predictor or store; a count of floats that is not the description's).
  nlohmann::json save(std::vector<float>& floats) const;
  std::string check_saved(const nlohmann::json& saved, size_t floats) const;
  void restore(const nlohmann::json& saved, std::span<const float> floats);

 private:
  PredictGradients how_;
  ChunkStore& store_;
  // Over the grad plane: the prediction added this step, what the carried W's really added, and
  // the plane before they ran.
  std::vector<float> predicted_, measured_, snapshot_, momentum_;
  bool measured_valid_ = false;
  // lstm: the predictor, and the mean and previous its last blend mixed.
  std::unique_ptr<GradientPredictor> lstm_;
  std::vector<float> lstm_mean_, lstm_previous_;
};

}  // namespace keel::pipeline
