#include "pipeline/gradient_prediction.h"

#include <algorithm>
#include <cstdint>
#include <map>

#include "core/error.h"
#include "model/moe.h"

namespace keel::pipeline {

std::vector<bool> chunks_weights_write(GPT& model, const ChunkStore& store, const int* inputs, int frozen_layers) {
  std::vector<bool> written(store.chunks().size(), true);
  std::map<int, std::vector<bool>> experts;  // per MoE block's layer
  for (const Chunk& c : store.chunks()) {
    if (c.expert < 0 || c.layer < frozen_layers) continue;  // (a frozen layer's chunks: carry() clears them)
    auto [at, added] = experts.try_emplace(c.layer);
    if (added) at->second = model.layer(c.layer).moe()->experts_written(inputs);
    written[static_cast<size_t>(c.id)] = at->second[static_cast<size_t>(c.expert)];
  }
  return written;
}

GradientPrediction::GradientPrediction(PredictGradients how, ChunkStore& store) : how_(how), store_(store) {
  const size_t n = static_cast<size_t>(store_.numel());
  predicted_.assign(n, 0.0f);
  measured_.assign(n, 0.0f);
  snapshot_.assign(n, 0.0f);
}

void GradientPrediction::attach(Executor& executor) {
  executor.defer_last_weights([this](bool before) {
    std::span<float> g = store_.range_view(Plane::grad, 0, store_.numel());
    if (before) {
      std::copy(g.begin(), g.end(), snapshot_.begin());
      return;
    }
    for (size_t i = 0; i < g.size(); ++i) measured_[i] = g[i] - snapshot_[i];
    measured_valid_ = true;
  });
}

void GradientPrediction::predict(int micro_batches, const std::vector<bool>& written) {
  // The plane holds: -(last step's prediction) + what the carried W's added + this step's own
  // gradients but the last micro-batch's W. Add a prediction of that W.
  std::span<float> g = store_.range_view(Plane::grad, 0, store_.numel());
  // Elements no carried W writes: their prediction is zero (whatever the predictor would say).
  std::vector<uint8_t> untouched;
  if (!written.empty()) {
    check(written.size() == store_.chunks().size(), "gradient prediction: a chunk mask of another store");
    untouched.assign(g.size(), 0);
    for (const Chunk& c : store_.chunks()) {
      if (!written[static_cast<size_t>(c.id)]) std::fill_n(untouched.begin() + c.offset, c.numel, uint8_t{1});
    }
  }
  auto quiet = [&](size_t i) { return !untouched.empty() && untouched[i] != 0; };
  // momentum: an exponential average (0.9) of what the W added in earlier steps, started from
  // the first measurement; previous: the last measurement alone; mean (and before any
  // measurement): the step's other micro-batches' mean.
  if (how_ == PredictGradients::momentum && measured_valid_) {
    if (momentum_.empty()) momentum_.assign(measured_.begin(), measured_.end());
    for (size_t i = 0; i < g.size(); ++i) momentum_[i] = 0.9f * momentum_[i] + 0.1f * measured_[i];
  }
  const float share = 1.0f / static_cast<float>(micro_batches - 1);
  if (how_ == PredictGradients::lstm) {
    // Per chunk: the LSTM's blend a * mean + b * previous (pipeline/gradient_predictor.h), after
    // it learned from how its last blend compared with the W's true gradient, now measured.
    if (!lstm_) {
      lstm_ = std::make_unique<GradientPredictor>(static_cast<int>(store_.chunks().size()));
      lstm_mean_.assign(g.size(), 0.0f);
      lstm_previous_.assign(g.size(), 0.0f);
    }
    std::vector<float> mean(g.size());
    for (size_t i = 0; i < g.size(); ++i) {
      const float carried = measured_valid_ ? measured_[i] - predicted_[i] : 0.0f;
      mean[i] = (g[i] - carried) * share;
    }
    for (const Chunk& c : store_.chunks()) {
      const size_t at = static_cast<size_t>(c.offset), n = static_cast<size_t>(c.numel);
      auto part = [&](std::vector<float>& v) { return std::span<const float>(v.data() + at, n); };
      if (measured_valid_) lstm_->learn(c.id, part(lstm_mean_), part(lstm_previous_), part(measured_));
      std::vector<float>& previous = measured_valid_ ? measured_ : lstm_previous_;
      if (!measured_valid_) std::fill_n(lstm_previous_.begin() + at, n, 0.0f);
      const auto [a, b] = lstm_->blend(c.id, part(mean), part(previous));
      for (size_t i = at; i < at + n; ++i) {
        if (quiet(i)) {
          predicted_[i] = 0.0f;
          continue;
        }
        predicted_[i] = a * mean[i] + b * previous[i];
        g[i] += predicted_[i];
      }
    }
    lstm_mean_.swap(mean);
    if (measured_valid_) lstm_previous_.assign(measured_.begin(), measured_.end());
    measured_valid_ = false;
    return;
  }
  const bool history = measured_valid_ && how_ != PredictGradients::mean;
  const std::vector<float>& past = how_ == PredictGradients::momentum ? momentum_ : measured_;
  for (size_t i = 0; i < g.size(); ++i) {
    const float carried = measured_valid_ ? measured_[i] - predicted_[i] : 0.0f;
    if (quiet(i)) {
      predicted_[i] = 0.0f;
      continue;
    }
    const float p = history ? past[i] : (g[i] - carried) * share;
    predicted_[i] = p;
    g[i] += p;
  }
  measured_valid_ = false;
}

void GradientPrediction::carry(int frozen_layers) {
  // The update used the prediction: its negative stays, for the true gradient to correct.
  std::span<float> g = store_.range_view(Plane::grad, 0, store_.numel());
  for (size_t i = 0; i < g.size(); ++i) g[i] = -predicted_[i];
  for (const Chunk& c : store_.chunks()) {
    if (c.layer >= frozen_layers) break;
    store_.zero_grad_chunk(c.id);
  }
}

nlohmann::json GradientPrediction::save(std::vector<float>& floats) const {
  std::span<const float> g = store_.range_view(Plane::grad, 0, store_.numel());
  floats.insert(floats.end(), g.begin(), g.end());
  for (const std::vector<float>* v : {&predicted_, &measured_, &momentum_}) floats.insert(floats.end(), v->begin(), v->end());
  nlohmann::json saved = {{"predict_gradients", to_string(how_)}, {"numel", store_.numel()}, {"measured", measured_valid_},
                          {"momentum", !momentum_.empty()}, {"lstm", lstm_ != nullptr}};
  if (lstm_) {
    lstm_->save(floats);
    floats.insert(floats.end(), lstm_mean_.begin(), lstm_mean_.end());
    floats.insert(floats.end(), lstm_previous_.begin(), lstm_previous_.end());
    saved["lstm_last_loss"] = lstm_->last_loss();
  }
  return saved;
}

std::string GradientPrediction::check_saved(const nlohmann::json& saved, size_t floats) const {
  const size_t n = static_cast<size_t>(store_.numel());
  const std::string how = saved.at("predict_gradients").get<std::string>();
  if (parse_enum<PredictGradients>(how) != how_ || saved.at("numel").get<size_t>() != n) {
    return "its gradient prediction state is of parallel.predict_gradients = \"" + how + "\" over " +
           std::to_string(saved.at("numel").get<size_t>()) + " floats; this rank's is \"" + to_string(how_) + "\" over " +
           std::to_string(n);
  }
  // Every field restore() reads (a missing or mistyped one throws: an unreadable description).
  static_cast<void>(saved.at("measured").get<bool>());
  const bool momentum = saved.at("momentum").get<bool>(), lstm = saved.at("lstm").get<bool>();
  if (lstm) static_cast<void>(saved.at("lstm_last_loss").get<double>());
  const int chunks = static_cast<int>(store_.chunks().size());
  const size_t want = n * (3 + (momentum ? 1 : 0)) + (lstm ? GradientPredictor::saved_floats(chunks) + 2 * n : 0);
  if (floats == want) return "";
  return "its gradient prediction state holds " + std::to_string(floats) + " floats where its description says " +
         std::to_string(want);
}

void GradientPrediction::restore(const nlohmann::json& saved, std::span<const float> floats) {
  const size_t n = static_cast<size_t>(store_.numel());
  size_t at = 0;
  auto take = [&](std::vector<float>& into) {
    into.assign(floats.begin() + static_cast<std::ptrdiff_t>(at), floats.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
  };
  std::vector<float> grads;
  take(grads);
  take(predicted_);
  take(measured_);
  measured_valid_ = saved.at("measured").get<bool>();
  momentum_.clear();
  if (saved.at("momentum").get<bool>()) take(momentum_);
  lstm_.reset();
  if (saved.at("lstm").get<bool>()) {
    lstm_ = std::make_unique<GradientPredictor>(static_cast<int>(store_.chunks().size()));
    at += lstm_->load(floats.subspan(at));
    lstm_->set_last_loss(saved.at("lstm_last_loss").get<double>());
    take(lstm_mean_);
    take(lstm_previous_);
  }
  std::span<float> g = store_.range_view(Plane::grad, 0, store_.numel());
  std::copy(grads.begin(), grads.end(), g.begin());
}

}  // namespace keel::pipeline
