// The seed's small LSTM over each chunk's gradient history, for the pipeline's experimental
// gradient prediction (parallel.predict_gradients = lstm). What is predicted is the gradient a
// stage's last W adds, which runs a step late. Per chunk, the prediction is a blend
//   predicted = a * mean + b * previous
// of two vectors the trainer has: `mean`, the step's other micro-batches' mean gradient, and
// `previous`, what the same W really added one step earlier. One LSTM cell (shared weights, a
// state per chunk) reads a few numbers about the chunk's history and gives (a, b). When the true
// gradient arrives a step later, the (a, b) that would have fitted it best (least squares over
// the chunk) is the target, and the LSTM takes one SGD step towards it (truncated
// back-propagation through one step). It starts as the mean predictor (a = 1, b = 0).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

namespace keel::pipeline {

// One LSTM cell with a linear read-out: inputs kInputs, hidden kHidden, outputs 2.
class BlendLstm {
 public:
  static constexpr int kInputs = 4, kHidden = 8, kOutputs = 2;
  using Input = std::array<float, kInputs>;
  using Output = std::array<float, kOutputs>;
  struct State {
    std::array<float, kHidden> h{}, c{};
  };
  // What a step computed, for learning from it later.
  struct Trace {
    Input x{};
    State before, after;
    std::array<float, 4 * kHidden> gates{};  // i, f, g, o after their nonlinearity
    Output y{};
  };

  explicit BlendLstm(uint64_t seed = 1, float learning_rate = 0.02f);
  // Advances `state` by one input and returns the blend (a, b); `trace` keeps what learn() needs.
  Output step(State& state, const Input& x, Trace& trace) const;
  // One SGD step on 1/2 |y - target|^2 of a traced step (the state before it held fixed).
  // Returns the loss before the step.
  float learn(const Trace& trace, const Output& target);
  // The gradient of 1/2 |y - target|^2 with respect to every weight, in parameter order (tests
  // compare it with finite differences).
  std::vector<float> gradient(const Trace& trace, const Output& target) const;
  std::vector<float>& parameters() { return w_; }
  const std::vector<float>& parameters() const { return w_; }

 private:
  // w_: gate weights [4H, I + H], gate biases [4H], read-out [2, H], read-out bias [2].
  std::vector<float> w_;
  float lr_;
};

// The blend per chunk for the trainer: history, learning, prediction.
class GradientPredictor {
 public:
  explicit GradientPredictor(int chunks) : state_(chunks), trace_(chunks), fit_(chunks, {1.0f, 0.0f}) {}
  // The true gradient `actual` of the W predicted last time arrived (its chunk's elements):
  // learn from the blend that would have fitted it, given that time's `mean` and `previous`.
  void learn(int chunk, std::span<const float> mean, std::span<const float> previous, std::span<const float> actual);
  // The blend (a, b) for this step's prediction of the chunk, from this step's `mean` and the
  // last measured `previous`.
  BlendLstm::Output blend(int chunk, std::span<const float> mean, std::span<const float> previous);
  double last_loss() const { return last_loss_; }
  // Its state between steps as floats, appended to `out` (the LSTM's weights, then per chunk its
  // state, last trace, last fit and whether it was traced: everything the next learn() and
  // blend() read but last_loss, which travels beside them); load() reads them back from `in` and
  // returns how many it read (throws when `in` is too short for this predictor's chunks).
  void save(std::vector<float>& out) const;
  size_t load(std::span<const float> in);
  static size_t saved_floats(int chunks);  // what save() appends for `chunks` chunks
  void set_last_loss(double loss) { last_loss_ = loss; }

 private:
  BlendLstm lstm_;
  std::vector<BlendLstm::State> state_;
  std::vector<BlendLstm::Trace> trace_;
  std::vector<BlendLstm::Output> fit_;  // each chunk's last least-squares blend
  std::vector<bool> traced_ = {};
  double last_loss_ = 0;
};

}  // namespace keel::pipeline
