#include "model/head.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/cpu/blas.h"
#include "kernels/cpu/ops.h"
#include "model/kv_context.h"
#include "model/model_layout.h"
#include "model/layer_util.h"

namespace keel {

using model_detail::Carver;
using model_detail::padded;
using model_detail::Stash;

namespace {

class Head final : public model_detail::OutputLayer {
 public:
  Head(const ModelConfig& m, ChunkStore& store, int layer, const std::vector<TensorId>& ids, TensorId tied_wte,
       bool bf16, MathMode math, TensorGroup* tensor)
      : store_(store),
        m_(m),
        layer_(m.layer_base + layer),
        layernorm_(!m.llama()),
        tied_(tied_wte >= 0),
        bf16_(bf16),
        math_(math),
        tp_(tensor),
        seq_(tensor),
        rows_(m.padded_vocab_size / (tensor ? tensor->size() : 1)),
        vocab_begin_(tensor ? tensor->rank() * rows_ : 0) {
    check(ids.size() == (layernorm_ || !tied_ ? 2u : 1u), "GPT: the head without its tensors");
    normw_ = ids[layout::norm_w];
    if (layernorm_) normb_ = ids[layout::norm_b];
    head_ = tied_ ? tied_wte : ids[layout::lm_head_w];
  }
  const char* name() const override { return "head"; }
  int64_t activation_floats(int B, int T) const override {
    const int64_t N = static_cast<int64_t>(B) * T;
    // normalised x and its gradient; row stats (LayerNorm: mean and rstd; RMSNorm: rstd); losses; logits
    return padded(Stash::floats(N * m_.n_embd, bf16_)) + padded(N * m_.n_embd) + padded(N) * (layernorm_ ? 3 : 2) +
           padded(N * rows_);
  }
  int64_t scratch_floats(int B, int T) const override {
    // under bf16: the staging of n; under sequence parallelism: the norm's partial weight gradients
    return (bf16_ ? padded(static_cast<int64_t>(B) * T * m_.n_embd) : 0) + (seq_.on() ? 2 * m_.n_embd : 0);
  }
  void bind(float* activations, float* scratch, int B, int T) override {
    const int64_t N = static_cast<int64_t>(B) * T;
    Carver a(activations);
    n_.carve(a, N * m_.n_embd, bf16_);
    stage_ = scratch;
    dn_ = a.take(N * m_.n_embd);
    mean_ = layernorm_ ? a.take(N) : nullptr;
    rstd_ = a.take(N);
    losses_ = a.take(N);
    logits_ = a.take(N * rows_);
  }

  void forward(const Batch& b, const float* x, float*) override {
    const PageLease use = store_.use_layer(layer_, {Plane::param});
    const PageLease tied = tied_ ? store_.use_layer(m_.layer_base, {Plane::param}) : PageLease();  // the embedding's chunks
    int N = b.B * b.T;
    const int C = m_.n_embd;
    if (const std::vector<int>* rows = b.kv != nullptr ? b.kv->logit_rows() : nullptr) {
      // Only these rows' logits (a KV cache's prefill): their inputs gathered into dn_ (no backward
      // follows an inference pass), then normalised and multiplied as a pass of rows->size() rows.
      check(b.targets == nullptr && !tp_, "GPT: logits of chosen rows are an inference pass's (no loss, one rank)");
      for (size_t i = 0; i < rows->size(); ++i) {
        const int r = (*rows)[i];
        check(r >= 0 && r < N && (i == 0 || r > (*rows)[i - 1]), "GPT: logit rows out of order or range");
        std::copy(x + static_cast<int64_t>(r) * C, x + static_cast<int64_t>(r + 1) * C, dn_ + static_cast<int64_t>(i) * C);
      }
      x = dn_;
      N = static_cast<int>(rows->size());
    }
    // Under sequence parallelism x is this rank's R rows: normalised into its rows of n, then
    // gathered, so the LM head multiplies all N rows (its vocabulary rows of each).
    const int R = static_cast<int>(seq_.rows(N));
    float* n = n_.writable(stage_);
    float* mine = n + seq_.first(N) * C;
    if (layernorm_) {
      ops::layernorm_forward(mine, mean_, rstd_, x, P(normw_), P(normb_), R, C);
    } else {
      ops::rmsnorm_forward(mine, rstd_, x, P(normw_), R, C);
    }
    if (seq_.on()) seq_.gather(n, mine, N, C);
    n_.seal(n, static_cast<int64_t>(N) * C);
    const Operand head = model_detail::weight_operand(store_, head_, math_.forward);
    ops::linear_forward(math_.forward, logits_, n_.read(), head, static_cast<const float*>(nullptr), N, C, rows_);
    // Under bf16 products the gradient is rounded where the backward multiplies it: the loss writes
    // it as bf16 bits over the logits (ops::crossentropy_forward_bf16_gradient), once, for both.
    if (gradient_in_bits(b)) {
      ops::crossentropy_forward_bf16_gradient(losses_, logits_, b.targets, N, m_.vocab_size, rows_, b.grad_scale);
      mean_loss_ = model_detail::mean_loss(losses_, N);
    } else if (!tp_) {
      mean_loss_ = model_detail::head_loss(losses_, logits_, b, m_);
    } else if (b.targets != nullptr) {  // this rank's vocabulary rows of the logits only
      vocab_parallel_crossentropy(*tp_, losses_, logits_, b.targets, N, rows_, vocab_begin_, m_.vocab_size,
                                  b.grad_scale);
      mean_loss_ = model_detail::mean_loss(losses_, N);
    } else {
      mean_loss_ = 0.0f;
    }
  }
  // dx_in = d/dx of grad_scale * sum(losses); logits_ holds d(loss)/d(logits) after forward.
  void backward_input(const Batch& b, const float* x_in, const float*, float* dx_in) override {
    const PageLease use = store_.use_layer(layer_, {Plane::param});
    const PageLease tied = tied_ ? store_.use_layer(m_.layer_base, {Plane::param}) : PageLease();
    const int N = b.B * b.T, C = m_.n_embd;
    const Operand head = model_detail::weight_operand(store_, head_, math_.backward);
    if (gradient_in_bits(b)) {  // dn = dlogits head, from the bits (row stride 2 rows_)
      gemm_operands(math_.backward, false, false, N, C, rows_, 1.0f, gradient_bits(), 2 * rows_, head, C, 0.0f, dn_, C);
    } else {
      ops::linear_backward_input(math_.backward, dn_, logits_, head, N, C, rows_, false);
    }
    // The vocabulary shards' parts, summed: all N rows, or this rank's R (at dn_'s start).
    if (seq_.on()) {
      seq_.scatter(dn_, dn_, N, C);
    } else if (tp_) {
      tp_->allreduce_sum(dn_, static_cast<int64_t>(N) * C);
    }
    const int R = static_cast<int>(seq_.rows(N));
    if (layernorm_) {
      ops::layernorm_backward_input(dx_in, dn_, x_in, mean_, rstd_, P(normw_), R, C, false);
    } else {
      ops::rmsnorm_backward_input(dx_in, dn_, x_in, rstd_, P(normw_), R, C, false);
    }
  }
  void backward_weight(const Batch& b, const float* x_in, const float*) override {
    const PageLease use = store_.use_layer(layer_, {}, {Plane::grad});
    const PageLease tied = tied_ ? store_.use_layer(m_.layer_base, {}, {Plane::grad}) : PageLease();
    const int N = b.B * b.T, C = m_.n_embd;
    if (gradient_in_bits(b)) {  // dW += dlogits^T n, from the bits
      gemm_operands(math_.backward, true, false, rows_, C, N, 1.0f, gradient_bits(), 2 * rows_, n_.read(), C, 1.0f,
                    G(head_), C);
    } else {
      ops::linear_backward_weight(math_.backward, G(head_), static_cast<float*>(nullptr), logits_, n_.read(), N, C,
                                  rows_);
    }
    // Under sequence parallelism the norm's weight gradients from this rank's rows, summed over the group.
    const int R = static_cast<int>(seq_.rows(N));
    float* partial = stage_;  // (under bf16 over the forward's staging of n, no longer needed)
    if (seq_.on()) std::fill(partial, partial + 2 * C, 0.0f);
    float* dw = seq_.on() ? partial : G(normw_);
    if (layernorm_) {
      ops::layernorm_backward_weight(dw, seq_.on() ? partial + C : G(normb_), dn_, x_in, mean_, rstd_, R, C);
      if (seq_.on()) seq_.sum_into(partial, {G(normw_), G(normb_)}, C);
    } else {
      ops::rmsnorm_backward_weight(dw, dn_, x_in, rstd_, R, C);
      if (seq_.on()) seq_.sum_into(partial, {G(normw_)}, C);
    }
  }
  float mean_loss() const override { return mean_loss_; }
  const float* logits() const override { return logits_; }

 private:
  float* P(TensorId id) { return store_.data(id, Plane::param); }
  float* G(TensorId id) { return store_.data(id, Plane::grad); }

  ChunkStore& store_;
  ModelConfig m_;
  int layer_;
  bool layernorm_, tied_, bf16_;
  // Whether the forward of batch b leaves the logits' gradient as bf16 bits (gradient_bits()).
  bool gradient_in_bits(const Batch& b) const {
    return !tp_ && b.targets != nullptr && b.grad_scale != 0.0f && math_.backward == MatmulPrecision::bf16;
  }
  Operand gradient_bits() const { return Operand::bits(reinterpret_cast<const uint16_t*>(logits_) + rows_); }
  MathMode math_;  // its products' precision in F and in B, W
  TensorGroup* tp_;              // null: unsplit
  model_detail::SequenceRows seq_;  // sequence parallelism (off without it)
  int rows_, vocab_begin_;       // the vocabulary rows of the head this rank holds
  TensorId normw_ = -1, normb_ = -1, head_ = -1;
  Stash n_;  // the normalised input of the LM head
  float *stage_ = nullptr, *dn_ = nullptr, *mean_ = nullptr, *rstd_ = nullptr, *losses_ = nullptr, *logits_ = nullptr;
  float mean_loss_ = 0.0f;
};

}  // namespace

std::unique_ptr<Layer> make_head(const ModelConfig& m, ChunkStore& store, int layer, const std::vector<TensorId>& ids,
                                 TensorId tied_wte, bool bf16, MathMode math, TensorGroup* tensor) {
  return std::make_unique<Head>(m, store, layer, ids, tied_wte, bf16, math, tensor);
}

}  // namespace keel
