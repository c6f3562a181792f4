#include "pipeline/gradient_predictor.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"

namespace keel::pipeline {

namespace {

constexpr int I = BlendLstm::kInputs, H = BlendLstm::kHidden, G = 4 * H, Z = I + H;
constexpr int kGateBias = G * Z, kReadOut = kGateBias + G, kReadOutBias = kReadOut + 2 * H, kParams = kReadOutBias + 2;

float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

double dot(std::span<const float> a, std::span<const float> b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

}  // namespace

BlendLstm::BlendLstm(uint64_t seed, float learning_rate) : w_(kParams, 0.0f), lr_(learning_rate) {
  Rng rng(seed);
  for (int k = 0; k < kGateBias; ++k) w_[k] = static_cast<float>((rng.uniform() - 0.5) * 0.2);
  for (int r = H; r < 2 * H; ++r) w_[kGateBias + r] = 1.0f;  // forget gates start open
  for (int k = kReadOut; k < kReadOutBias; ++k) w_[k] = static_cast<float>((rng.uniform() - 0.5) * 0.02);
  w_[kReadOutBias] = 1.0f;  // a = 1, b = 0: the mean predictor
}

BlendLstm::Output BlendLstm::step(State& state, const Input& x, Trace& t) const {
  t.x = x;
  t.before = state;
  float z[Z];
  for (int j = 0; j < I; ++j) z[j] = x[j];
  for (int j = 0; j < H; ++j) z[I + j] = state.h[j];
  for (int r = 0; r < G; ++r) {
    float pre = w_[kGateBias + r];
    for (int j = 0; j < Z; ++j) pre += w_[r * Z + j] * z[j];
    t.gates[r] = (r >= 2 * H && r < 3 * H) ? std::tanh(pre) : sigmoid(pre);
  }
  for (int k = 0; k < H; ++k) {
    const float i = t.gates[k], f = t.gates[H + k], g = t.gates[2 * H + k], o = t.gates[3 * H + k];
    state.c[k] = f * state.c[k] + i * g;
    state.h[k] = o * std::tanh(state.c[k]);
  }
  t.after = state;
  for (int o = 0; o < kOutputs; ++o) {
    float y = w_[kReadOutBias + o];
    for (int k = 0; k < H; ++k) y += w_[kReadOut + o * H + k] * state.h[k];
    t.y[o] = y;
  }
  return t.y;
}

std::vector<float> BlendLstm::gradient(const Trace& t, const Output& target) const {
  std::vector<float> d(kParams, 0.0f);
  float dy[kOutputs], dh[H] = {};
  for (int o = 0; o < kOutputs; ++o) {
    dy[o] = t.y[o] - target[o];
    d[kReadOutBias + o] = dy[o];
    for (int k = 0; k < H; ++k) {
      d[kReadOut + o * H + k] = dy[o] * t.after.h[k];
      dh[k] += dy[o] * w_[kReadOut + o * H + k];
    }
  }
  float z[Z];
  for (int j = 0; j < I; ++j) z[j] = t.x[j];
  for (int j = 0; j < H; ++j) z[I + j] = t.before.h[j];
  for (int k = 0; k < H; ++k) {
    const float i = t.gates[k], f = t.gates[H + k], g = t.gates[2 * H + k], o = t.gates[3 * H + k];
    const float tc = std::tanh(t.after.c[k]);
    const float dc = dh[k] * o * (1 - tc * tc);
    const float pre[4] = {dc * g * i * (1 - i), dc * t.before.c[k] * f * (1 - f), dc * i * (1 - g * g),
                          dh[k] * tc * o * (1 - o)};
    for (int q = 0; q < 4; ++q) {
      const int r = q * H + k;
      d[kGateBias + r] = pre[q];
      for (int j = 0; j < Z; ++j) d[r * Z + j] = pre[q] * z[j];
    }
  }
  return d;
}

float BlendLstm::learn(const Trace& t, const Output& target) {
  float loss = 0;
  for (int o = 0; o < kOutputs; ++o) loss += 0.5f * (t.y[o] - target[o]) * (t.y[o] - target[o]);
  const std::vector<float> d = gradient(t, target);
  for (int k = 0; k < kParams; ++k) w_[k] -= lr_ * d[k];
  return loss;
}

void GradientPredictor::learn(int chunk, std::span<const float> mean, std::span<const float> previous,
                              std::span<const float> actual) {
  // The blend that would have fitted best: least squares of a * mean + b * previous = actual.
  const double mm = dot(mean, mean), pp = dot(previous, previous), mp = dot(mean, previous);
  const double mt = dot(mean, actual), pt = dot(previous, actual);
  const double det = mm * pp - mp * mp;
  double a = 1, b = 0;
  if (det > 1e-12 * std::max(1e-30, mm * pp)) {
    a = (mt * pp - pt * mp) / det;
    b = (pt * mm - mt * mp) / det;
  } else if (mm > 0) {
    a = mt / mm;
  }
  const BlendLstm::Output fit = {static_cast<float>(std::clamp(a, -2.0, 3.0)), static_cast<float>(std::clamp(b, -2.0, 3.0))};
  fit_[chunk] = fit;
  if (traced_.size() != trace_.size()) traced_.assign(trace_.size(), false);
  if (traced_[chunk]) last_loss_ = lstm_.learn(trace_[chunk], fit);
}

BlendLstm::Output GradientPredictor::blend(int chunk, std::span<const float> mean, std::span<const float> previous) {
  const double mm = dot(mean, mean), pp = dot(previous, previous), mp = dot(mean, previous);
  const float cosine = mm > 0 && pp > 0 ? static_cast<float>(mp / std::sqrt(mm * pp)) : 0.0f;
  const float ratio = mm > 0 && pp > 0 ? static_cast<float>(std::clamp(0.5 * std::log(pp / mm), -3.0, 3.0)) : 0.0f;
  const BlendLstm::Input x = {fit_[chunk][0], fit_[chunk][1], cosine, ratio};
  if (traced_.size() != trace_.size()) traced_.assign(trace_.size(), false);
  traced_[chunk] = true;
  return lstm_.step(state_[chunk], x, trace_[chunk]);
}

namespace {

// The floats of one chunk's state between steps, in save()'s order: the LSTM state, the trace
// (input, states before and after, gates, output) and the last fit (whether it was traced
// follows them as one float).
template <typename Visit>
void each_chunk_part(BlendLstm::State& state, BlendLstm::Trace& trace, BlendLstm::Output& fit, Visit visit) {
  visit(std::span<float>(state.h)), visit(std::span<float>(state.c));
  visit(std::span<float>(trace.x)), visit(std::span<float>(trace.before.h)), visit(std::span<float>(trace.before.c));
  visit(std::span<float>(trace.after.h)), visit(std::span<float>(trace.after.c)), visit(std::span<float>(trace.gates));
  visit(std::span<float>(trace.y)), visit(std::span<float>(fit));
}

}  // namespace

size_t GradientPredictor::saved_floats(int chunks) {
  BlendLstm::State state;
  BlendLstm::Trace trace;
  BlendLstm::Output fit{};
  size_t per_chunk = 1;  // (traced)
  each_chunk_part(state, trace, fit, [&](std::span<float> part) { per_chunk += part.size(); });
  return kParams + static_cast<size_t>(chunks) * per_chunk;
}

void GradientPredictor::save(std::vector<float>& out) const {
  const std::vector<float>& w = lstm_.parameters();
  out.insert(out.end(), w.begin(), w.end());
  for (size_t k = 0; k < state_.size(); ++k) {
    // (each_chunk_part visits mutable parts: copies of this chunk's, read only)
    BlendLstm::State state = state_[k];
    BlendLstm::Trace trace = trace_[k];
    BlendLstm::Output fit = fit_[k];
    each_chunk_part(state, trace, fit, [&](std::span<float> part) { out.insert(out.end(), part.begin(), part.end()); });
    out.push_back(k < traced_.size() && traced_[k] ? 1.0f : 0.0f);
  }
}

size_t GradientPredictor::load(std::span<const float> in) {
  size_t at = 0;
  auto take = [&](std::span<float> part) {
    check(at + part.size() <= in.size(), "gradient predictor state: " + std::to_string(in.size()) +
                                             " floats, too few for " + std::to_string(state_.size()) + " chunks");
    std::copy_n(in.begin() + static_cast<std::ptrdiff_t>(at), part.size(), part.begin());
    at += part.size();
  };
  take(std::span<float>(lstm_.parameters()));
  traced_.assign(state_.size(), false);
  for (size_t k = 0; k < state_.size(); ++k) {
    each_chunk_part(state_[k], trace_[k], fit_[k], take);
    float traced = 0;
    take(std::span<float>(&traced, 1));
    traced_[k] = traced != 0.0f;
  }
  return at;
}

}  // namespace keel::pipeline
