#include "model/moe.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/ops.h"
#include "model/model_layout.h"

namespace keel {

MoeFeedForward::MoeFeedForward(const ModelConfig& m, ChunkStore& store, int layer, const std::vector<TensorId>& ids,
                               MathMode math)
    : store_(store),
      math_(math),
      C_(m.n_embd),
      E_(m.moe_experts),
      K_(m.moe_top_k),
      Hm_(m.moe_hidden),
      S_(m.moe_shared_experts * m.moe_hidden),
      capacity_factor_(m.moe_capacity),
      aux_weight_(m.moe_aux_weight),
      t_(ids) {
  const size_t want = (S_ > 0 ? layout::shared_down_w : layout::experts_down_w) + 1;
  check(ids.size() == want, "GPT: mixture-of-experts block " + std::to_string(layer) + " without its tensors");
  stats_.layer = layer;
  stats_.tokens.assign(E_, 0.0);
  if (m.moe_balance == MoeBalance::bias) {
    bias_.assign(E_, 0.0f);
    load_.assign(E_, 0.0);
  }
}

MoeActivations MoeFeedForward::carve(model_detail::Carver& kept, int B, int T) const {
  const int64_t N = static_cast<int64_t>(B) * T, M = N * K_;
  auto ints = [&](int64_t n) { return reinterpret_cast<int32_t*>(kept.take(n)); };
  static_assert(sizeof(int32_t) == sizeof(float));
  MoeActivations a;
  a.probs = kept.take(N * E_);
  a.choice = ints(N * K_);
  a.slot = ints(N * K_);
  a.rows = ints(M);
  a.offsets = ints(E_ + 1);
  a.xs = kept.take(M * C_);
  a.gu = kept.take(M * 2 * Hm_);
  a.h = kept.take(M * Hm_);
  a.ye = kept.take(M * C_);
  a.dgu = kept.take(M * 2 * Hm_);
  a.dye = kept.take(M * C_);
  a.dh = kept.take(M * std::max(Hm_, C_));  // dh, then the sorted rows' input gradient
  a.dlogits = kept.take(N * E_);
  a.tmp = kept.take(N * std::max(C_, S_));  // the shared MLP's hidden gradient
  a.gus = kept.take(N * 2 * S_);
  a.hs = kept.take(N * S_);
  a.dgus = kept.take(N * 2 * S_);
  return a;
}

void MoeFeedForward::forward(const MoeActivations& a, const Batch& b, const float* x, float* out, bool count) {
  const int N = b.B * b.T;
  auto P = [&](int t) { return store_.data(t_[t], Plane::param); };  // t: layout::MoeBlock
  const MatmulPrecision f = math_.forward;
  // The router multiplies in float32 at every precision: its choices are discrete.
  ops::linear_forward<float>(MatmulPrecision::fp32, a.probs, x, P(layout::moe_router_w), nullptr, N, C_, E_);
  moe::router_softmax_forward(a.probs, a.probs, N, E_);
  moe::top_k(a.choice, a.probs, N, E_, K_, bias_.empty() ? nullptr : bias_.data());
  const int capacity =
      capacity_factor_ > 0 ? static_cast<int>(std::ceil(capacity_factor_ * b.T * K_ / static_cast<double>(E_))) : 0;
  const int64_t dropped = moe::plan_routing(a.offsets, a.rows, a.slot, a.choice, b.B, b.T, K_, E_, capacity);
  const int M = a.offsets[E_];
  moe::gather_rows(a.xs, x, a.rows, M, K_, C_);
  moe::grouped_linear_forward(f, a.gu, a.xs, P(layout::experts_gate_up_w), a.offsets, E_, C_, 2 * Hm_);
  ops::swiglu_forward(a.h, a.gu, M, Hm_);
  moe::grouped_linear_forward(f, a.ye, a.h, P(layout::experts_down_w), a.offsets, E_, Hm_, C_);
  if (S_ > 0) {
    ops::linear_forward<float>(f, a.gus, x, P(layout::shared_gate_up_w), nullptr, N, C_, 2 * S_);
    ops::swiglu_forward(a.hs, a.gus, N, S_);
    ops::linear_forward<float>(f, out, a.hs, P(layout::shared_down_w), nullptr, N, S_, C_);
  } else {
    std::memset(out, 0, sizeof(float) * N * C_);
  }
  moe::combine_forward(out, a.ye, a.probs, a.choice, a.slot, N, K_, E_, C_);
  if (b.grad_scale != 0.0f && count) {  // a training micro-batch: measured for monitoring (and balancing)
    for (int64_t p = 0; p < static_cast<int64_t>(N) * K_; ++p) stats_.tokens[a.choice[p]] += 1.0;
    if (!load_.empty()) {
      for (int64_t p = 0; p < static_cast<int64_t>(N) * K_; ++p) load_[a.choice[p]] += 1.0;
    }
    stats_.pairs += static_cast<double>(N) * K_;
    stats_.dropped += static_cast<double>(dropped);
    for (int n = 0; n < N; ++n) {
      double h = 0;
      for (int e = 0; e < E_; ++e) {
        const double p = a.probs[static_cast<int64_t>(n) * E_ + e];
        h -= p > 0 ? p * std::log(p) : 0.0;
      }
      stats_.entropy_sum += h;
    }
    stats_.token_count += N;
    stats_.aux_sum += moe::aux_loss_forward(a.probs, a.choice, b.B, b.T, E_, K_);
    stats_.sequences += b.B;
  }
}

void MoeFeedForward::backward_input(const MoeActivations& a, const Batch& b, const float* dout, float* dx) {
  const int N = b.B * b.T, M = a.offsets[E_];
  auto P = [&](int t) { return store_.data(t_[t], Plane::param); };
  const MatmulPrecision bw = math_.backward;
  float* dprobs = a.dlogits;
  std::memset(dprobs, 0, sizeof(float) * N * E_);
  moe::combine_backward(a.dye, dprobs, dout, a.ye, a.probs, a.choice, a.slot, N, K_, E_, C_);
  // d(w / S sum_s aux_s)/dp with grad_scale = 1 / (S T): w x grad_scale x E f_e (moe::aux_loss_backward's T folded in).
  if (aux_weight_ > 0) {
    moe::aux_loss_backward(dprobs, a.choice, b.B, b.T, E_, K_, static_cast<float>(aux_weight_ * b.grad_scale * b.T));
  }
  moe::router_softmax_backward(a.dlogits, dprobs, a.probs, N, E_);
  moe::grouped_linear_backward_input(bw, a.dh, a.dye, P(layout::experts_down_w), a.offsets, E_, Hm_, C_);
  ops::swiglu_backward_input(a.dgu, a.dh, a.gu, M, Hm_);
  float* dxs = a.dh;
  moe::grouped_linear_backward_input(bw, dxs, a.dgu, P(layout::experts_gate_up_w), a.offsets, E_, C_, 2 * Hm_);
  ops::linear_backward_input<float>(MatmulPrecision::fp32, dx, a.dlogits, P(layout::moe_router_w), N, C_, E_, false);
  moe::scatter_add_rows(dx, dxs, a.slot, N, K_, C_);
  if (S_ > 0) {
    float* dhs = a.tmp;
    ops::linear_backward_input<float>(bw, dhs, dout, P(layout::shared_down_w), N, S_, C_, false);
    ops::swiglu_backward_input(a.dgus, dhs, a.gus, N, S_);
    ops::linear_backward_input<float>(bw, dx, a.dgus, P(layout::shared_gate_up_w), N, C_, 2 * S_, true);
  }
}

void MoeFeedForward::backward_weight(const MoeActivations& a, const Batch& b, const float* x, const float* dout) {
  const int N = b.B * b.T;
  auto G = [&](int t) { return store_.data(t_[t], Plane::grad); };
  const MatmulPrecision bw = math_.backward;
  moe::grouped_linear_backward_weight(bw, G(layout::experts_down_w), a.dye, a.h, a.offsets, E_, Hm_, C_);
  moe::grouped_linear_backward_weight(bw, G(layout::experts_gate_up_w), a.dgu, a.xs, a.offsets, E_, C_, 2 * Hm_);
  ops::linear_backward_weight<float>(MatmulPrecision::fp32, G(layout::moe_router_w), nullptr, a.dlogits, x, N, C_, E_);
  if (S_ > 0) {
    ops::linear_backward_weight<float>(bw, G(layout::shared_down_w), nullptr, dout, a.hs, N, S_, C_);
    ops::linear_backward_weight<float>(bw, G(layout::shared_gate_up_w), nullptr, a.dgus, x, N, C_, 2 * S_);
  }
}

}  // namespace keel
