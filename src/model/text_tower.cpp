#include "model/text_tower.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/cpu/ops.h"
#include "model/gpt.h"

namespace keel {

namespace {

// The pooling head's tensors (layer layer_base + n_layer + 1): the final norm, then the projection.
ModelLayout pool_head_layout(const ModelConfig& m, int embed_dim) {
  const std::string& p = m.tensor_prefix;
  const int64_t C = m.n_embd;
  const int layer = m.layer_base + m.n_layer + 1;
  ModelLayout out;
  if (m.llama()) {
    out.tensors.push_back(TensorSpec{p + "norm.w", {C}, layer, ChunkKind::norm, false});
  } else {
    out.tensors.push_back(TensorSpec{p + "lnf.w", {C}, layer, ChunkKind::norm, false});
    out.tensors.push_back(TensorSpec{p + "lnf.b", {C}, layer, ChunkKind::norm, false});
  }
  out.tensors.push_back(TensorSpec{p + "proj.w", {embed_dim, C}, layer, ChunkKind::head, true});
  return out;
}

ModelConfig tower_config(ModelConfig text, int layer_base) {
  text.tensor_prefix = "text.";
  text.layer_base = layer_base;
  return text;
}

void check_embed_dim(int embed_dim) {
  check(embed_dim >= 1 && embed_dim <= 8192, "clip.embed_dim: expected 1..8192, found " + std::to_string(embed_dim));
}

class TextTower final : public Tower {
 public:
  TextTower(const ModelConfig& m, int embed_dim, ChunkStore& store, MatmulPrecision precision)
      : m_(m),
        store_(store),
        D_(embed_dim),
        body_(m, store, {LayerRange{0, m.n_layer}}, precision == MatmulPrecision::bf16, MathMode::uniform(precision)),
        head_layer_(m.layer_base + m.n_layer + 1) {
    check_embed_dim(embed_dim);
    // text_tower_layout's order: the body's tensors (registered by body_), then the head's.
    const std::vector<TensorId> head = register_layout(store, pool_head_layout(m, D_));
    normw_ = head.front();
    if (!m.llama()) normb_ = head[1];
    proj_ = head.back();
  }
  const char* name() const override { return "text"; }
  int first_layer() const override { return m_.layer_base; }
  int num_layers() const override { return m_.n_layer + 2; }
  int out_dim() const override { return D_; }

  void init_weights(uint64_t seed) override {
    body_.init_weights(seed);  // every "text." tensor, the head's norm included; then the projection:
    const PageLease use = store_.use_tensor(proj_, {}, {Plane::param});
    std::span<float> w = store_.view(proj_, Plane::param);
    Rng rng(seed ^ hash_name(store_.tensors()[proj_].spec.name));
    const double std = 1.0 / std::sqrt(static_cast<double>(m_.n_embd));
    for (float& v : w) v = static_cast<float>(rng.normal() * std);
  }

  void allocate(int B, int T) override {
    body_.allocate(B, T);
    const size_t BC = static_cast<size_t>(B) * m_.n_embd;
    pooled_.assign(BC, 0.0f);
    normed_.assign(BC, 0.0f);
    dnormed_.assign(BC, 0.0f);
    dpooled_.assign(BC, 0.0f);
    mean_.assign(B, 0.0f);
    rstd_.assign(B, 0.0f);
    features_.assign(static_cast<size_t>(B) * D_, 0.0f);
  }

  const float* forward(const ClipBatch& b) override {
    const Batch batch = check_batch(b);
    body_.forward(LayerRange{0, m_.n_layer}, 0, batch);
    const float* x = body_.output(0, m_.n_layer);
    const int C = m_.n_embd;
    for (int i = 0; i < b.B; ++i) {
      std::memcpy(&pooled_[static_cast<size_t>(i) * C], x + (static_cast<int64_t>(i) * b.T + b.lengths[i] - 1) * C,
                  sizeof(float) * C);
    }
    const PageLease use = store_.use_layer(head_layer_, {Plane::param});
    if (m_.llama()) {
      ops::rmsnorm_forward(normed_.data(), rstd_.data(), pooled_.data(), P(normw_), b.B, C);
    } else {
      ops::layernorm_forward(normed_.data(), mean_.data(), rstd_.data(), pooled_.data(), P(normw_), P(normb_), b.B, C);
    }
    ops::linear_forward(body_.math().forward, features_.data(), normed_.data(), P(proj_),
                        static_cast<const float*>(nullptr), b.B, C, D_);
    return features_.data();
  }

  void backward(const ClipBatch& b, const float* dfeatures, BackwardObserver* observer) override {
    const Batch batch = check_batch(b);
    const int C = m_.n_embd;
    {
      const PageLease use = store_.use_layer(head_layer_, {Plane::param});
      ops::linear_backward_input(body_.math().backward, dnormed_.data(), dfeatures, P(proj_), b.B, C, D_, false);
      if (m_.llama()) {
        ops::rmsnorm_backward_input(dpooled_.data(), dnormed_.data(), pooled_.data(), rstd_.data(), P(normw_), b.B, C,
                                    false);
      } else {
        ops::layernorm_backward_input(dpooled_.data(), dnormed_.data(), pooled_.data(), mean_.data(), rstd_.data(),
                                      P(normw_), b.B, C, false);
      }
      // The body's output gradient: zero but at each caption's pooled position.
      float* dx = body_.output_grad(0, m_.n_layer);
      std::memset(dx, 0, sizeof(float) * static_cast<size_t>(b.B) * b.T * C);
      for (int i = 0; i < b.B; ++i) {
        std::memcpy(dx + (static_cast<int64_t>(i) * b.T + b.lengths[i] - 1) * C, &dpooled_[static_cast<size_t>(i) * C],
                    sizeof(float) * C);
      }
    }
    if (observer != nullptr) observer->after_backward_input(head_layer_);
    {
      const PageLease use = store_.use_layer(head_layer_, {}, {Plane::grad});
      ops::linear_backward_weight(body_.math().backward, G(proj_), static_cast<float*>(nullptr), dfeatures,
                                  normed_.data(), b.B, C, D_);
      if (m_.llama()) {
        ops::rmsnorm_backward_weight(G(normw_), dnormed_.data(), pooled_.data(), rstd_.data(), b.B, C);
      } else {
        ops::layernorm_backward_weight(G(normw_), G(normb_), dnormed_.data(), pooled_.data(), mean_.data(), rstd_.data(),
                                       b.B, C);
      }
    }
    if (observer != nullptr) observer->after_backward_weight(head_layer_);
    for (int i = m_.n_layer; i >= 0; --i) {
      body_.backward_input(LayerRange{i, i}, 0, batch, observer);
      body_.backward_weight(LayerRange{i, i}, 0, batch, observer);
    }
  }

  double train_flops_per_sample() const override {
    // The body's matrix products at the allocated length, and the head's projection.
    return body_.train_flops_per_token(body_.allocated_T()) * body_.allocated_T() + 6.0 * m_.n_embd * D_;
  }
  int64_t activation_bytes() const override {
    return body_.activation_bytes() +
           static_cast<int64_t>(sizeof(float)) *
               static_cast<int64_t>(pooled_.size() * 4 + mean_.size() * 2 + features_.size());
  }

 private:
  Batch check_batch(const ClipBatch& b) const {
    check(b.tokens != nullptr && b.lengths != nullptr && b.B >= 1 && b.T >= 1,
          "text tower: a micro-batch needs tokens and lengths");
    for (int i = 0; i < b.B; ++i) {
      check(b.lengths[i] >= 1 && b.lengths[i] <= b.T, "text tower: caption " + std::to_string(i) + " has length " +
                                                          std::to_string(b.lengths[i]) + ", expected 1.." +
                                                          std::to_string(b.T));
    }
    Batch batch;
    batch.inputs = b.tokens;
    batch.B = b.B;
    batch.T = b.T;
    return batch;
  }
  float* P(TensorId id) { return store_.data(id, Plane::param); }
  float* G(TensorId id) { return store_.data(id, Plane::grad); }

  ModelConfig m_;
  ChunkStore& store_;
  int D_;
  GPT body_;
  int head_layer_;
  TensorId normw_ = -1, normb_ = -1, proj_ = -1;
  std::vector<float> pooled_, normed_, dnormed_, dpooled_, mean_, rstd_, features_;
};

}  // namespace

ModelLayout text_tower_layout(const ModelConfig& text, int layer_base, int embed_dim) {
  check_embed_dim(embed_dim);
  const ModelConfig m = tower_config(text, layer_base);
  const LayerRange body{0, m.n_layer};
  ModelLayout out = model_layout(m, {&body, 1});
  out.tied.clear();  // the pooling head does not read wte: nothing is tied
  out.append(pool_head_layout(m, embed_dim));
  return out;
}

std::unique_ptr<Tower> make_text_tower(const ModelConfig& text, int layer_base, int embed_dim, ChunkStore& store,
                                       MatmulPrecision precision) {
  return std::make_unique<TextTower>(tower_config(text, layer_base), embed_dim, store, precision);
}

}  // namespace keel
