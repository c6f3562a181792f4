#include "model/vit.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/cpu/ops.h"
#include "model/gpt.h"

namespace keel {

namespace {

// The blocks' configuration: Keel's GPT-2 blocks, not causal, dense attention over P + 1 tokens.
// (A GPT over layers 1..L only: it registers no token embedding or head, so the vocabulary is a
// placeholder validation asks for.)
ModelConfig blocks_config(const VitSpec& s) {
  ModelConfig m;
  m.preset = "vit";
  m.family = Family::gpt2;
  m.n_layer = s.layers;
  m.n_head = s.heads;
  m.n_kv_head = s.heads;
  m.n_embd = s.width;
  m.ffn_hidden = 4 * s.width;
  m.vocab_size = 2;
  m.padded_vocab_size = 2;
  m.max_seq_len = s.patches() + 1;
  m.tie_embeddings = true;
  m.attention = Attention::dense;
  m.causal = false;
  m.tensor_prefix = s.prefix;
  m.layer_base = s.layer_base;
  return m;
}

// The tower's own tensors before the blocks (layer_base: the patch embedding) and after them (the
// head), in this order.
enum PatchTensor : int { patch_w, patch_b, cls, pos };
enum HeadTensor : int { lnf_w, lnf_b, proj_w };

ModelLayout patch_layout(const VitSpec& s) {
  const int64_t C = s.width;
  ModelLayout out;
  out.tensors = {TensorSpec{s.prefix + "patch.w", {C, s.patch * s.patch * 3}, s.layer_base, ChunkKind::embedding, true},
                 TensorSpec{s.prefix + "patch.b", {C}, s.layer_base, ChunkKind::embedding, false},
                 TensorSpec{s.prefix + "cls", {C}, s.layer_base, ChunkKind::embedding, false},
                 TensorSpec{s.prefix + "pos", {s.patches() + 1, C}, s.layer_base, ChunkKind::embedding, false}};
  return out;
}

ModelLayout head_layout(const VitSpec& s) {
  const int64_t C = s.width;
  const int layer = s.layer_base + s.layers + 1;
  ModelLayout out;
  out.tensors = {TensorSpec{s.prefix + "lnf.w", {C}, layer, ChunkKind::norm, false},
                 TensorSpec{s.prefix + "lnf.b", {C}, layer, ChunkKind::norm, false},
                 TensorSpec{s.prefix + "proj.w", {s.embed_dim, C}, layer, ChunkKind::head, true}};
  return out;
}

class Vit final : public Tower {
 public:
  Vit(const VitSpec& s, ChunkStore& store, MatmulPrecision precision)
      : s_((validate_vit(s), s)),
        store_(store),
        math_(visual_math(s.quant, precision)),
        P_(s.patches()),
        PV_(s.patch * s.patch * 3),
        C_(s.width),
        patch_ids_(register_layout(store, patch_layout(s))),  // vit_layout's order: these, the blocks, the head
        body_(blocks_config(s), store, {LayerRange{1, s.layers}}, s.quant == VisualQuant::bf16, math_),
        head_layer_(s.layer_base + s.layers + 1),
        patch_w_(patch_ids_[patch_w]),
        patch_b_(patch_ids_[patch_b]),
        cls_(patch_ids_[cls]),
        pos_(patch_ids_[pos]) {
    const std::vector<TensorId> head = register_layout(store, head_layout(s));
    normw_ = head[lnf_w];
    normb_ = head[lnf_b];
    proj_ = head[proj_w];
  }
  const char* name() const override { return "vit"; }
  int first_layer() const override { return s_.layer_base; }
  int num_layers() const override { return s_.layers + 2; }
  int out_dim() const override { return s_.embed_dim; }

  void init_weights(uint64_t seed) override {
    body_.init_weights(seed);  // every "visual." tensor by GPT-2's rules; then the tower's own:
    auto draw = [&](TensorId id, double std) {
      const PageLease use = store_.use_tensor(id, {}, {Plane::param});
      Rng rng(seed ^ hash_name(store_.tensors()[id].spec.name));
      for (float& v : store_.view(id, Plane::param)) v = static_cast<float>(rng.normal() * std);
    };
    const double inv_c = 1.0 / std::sqrt(static_cast<double>(C_));
    draw(patch_w_, 1.0 / std::sqrt(static_cast<double>(PV_)));
    draw(cls_, inv_c);
    draw(pos_, 0.01);
    draw(proj_, inv_c);
  }

  void allocate(int B, int) override {
    body_.allocate(B, P_ + 1);
    max_B_ = B;
    patches_.assign(static_cast<size_t>(B) * P_ * PV_, 0.0f);
    tokens_.assign(static_cast<size_t>(B) * P_ * C_, 0.0f);
    kept_.assign(static_cast<size_t>(B) * P_, 0);
    cls_out_.assign(static_cast<size_t>(B) * C_, 0.0f);
    normed_.assign(cls_out_.size(), 0.0f);
    dnormed_.assign(cls_out_.size(), 0.0f);
    dcls_out_.assign(cls_out_.size(), 0.0f);
    mean_.assign(B, 0.0f);
    rstd_.assign(B, 0.0f);
    features_.assign(static_cast<size_t>(B) * s_.embed_dim, 0.0f);
  }

  const float* forward(const ClipBatch& b) override {
    const int K = check_batch(b), T = K + 1;
    patchify(b, K);
    {
      const PageLease use = store_.use_layer(s_.layer_base, {Plane::param});
      // tokens[B*K, C] = patches @ W^T + bias, then the class token and the position rows.
      ops::linear_forward(math_.forward, tokens_.data(), patches_.data(), P(patch_w_), P(patch_b_), b.B * K, PV_, C_);
      float* x = body_.input(0, 1);
      for (int i = 0; i < b.B; ++i) {
        float* row0 = x + static_cast<int64_t>(i) * T * C_;
        for (int c = 0; c < C_; ++c) row0[c] = P(cls_)[c] + P(pos_)[c];
        for (int k = 0; k < K; ++k) {
          const float* pos = P(pos_) + static_cast<int64_t>(1 + kept_[static_cast<size_t>(i) * K + k]) * C_;
          const float* t = &tokens_[(static_cast<size_t>(i) * K + k) * C_];
          float* out = row0 + static_cast<int64_t>(1 + k) * C_;
          for (int c = 0; c < C_; ++c) out[c] = t[c] + pos[c];
        }
      }
    }
    body_.forward(LayerRange{1, s_.layers}, 0, blocks_batch(b.B, T));
    const float* y = body_.output(0, s_.layers);
    for (int i = 0; i < b.B; ++i) {
      std::memcpy(&cls_out_[static_cast<size_t>(i) * C_], y + static_cast<int64_t>(i) * T * C_, sizeof(float) * C_);
    }
    const PageLease use = store_.use_layer(head_layer_, {Plane::param});
    ops::layernorm_forward(normed_.data(), mean_.data(), rstd_.data(), cls_out_.data(), P(normw_), P(normb_), b.B, C_);
    ops::linear_forward(math_.forward, features_.data(), normed_.data(), P(proj_), static_cast<const float*>(nullptr),
                        b.B, C_, s_.embed_dim);
    return features_.data();
  }

  void backward(const ClipBatch& b, const float* dfeatures, BackwardObserver* observer) override {
    const int K = check_batch(b), T = K + 1, D = s_.embed_dim;
    {
      const PageLease use = store_.use_layer(head_layer_, {Plane::param});
      ops::linear_backward_input(math_.backward, dnormed_.data(), dfeatures, P(proj_), b.B, C_, D, false);
      ops::layernorm_backward_input(dcls_out_.data(), dnormed_.data(), cls_out_.data(), mean_.data(), rstd_.data(),
                                    P(normw_), b.B, C_, false);
      float* dy = body_.output_grad(0, s_.layers);  // zero but at each sample's class token
      std::memset(dy, 0, sizeof(float) * static_cast<size_t>(b.B) * T * C_);
      for (int i = 0; i < b.B; ++i) {
        std::memcpy(dy + static_cast<int64_t>(i) * T * C_, &dcls_out_[static_cast<size_t>(i) * C_], sizeof(float) * C_);
      }
    }
    if (observer != nullptr) observer->after_backward_input(head_layer_);
    {
      const PageLease use = store_.use_layer(head_layer_, {}, {Plane::grad});
      ops::linear_backward_weight(math_.backward, G(proj_), static_cast<float*>(nullptr), dfeatures, normed_.data(),
                                  b.B, C_, D);
      ops::layernorm_backward_weight(G(normw_), G(normb_), dnormed_.data(), cls_out_.data(), mean_.data(), rstd_.data(),
                                     b.B, C_);
    }
    if (observer != nullptr) observer->after_backward_weight(head_layer_);
    const Batch batch = blocks_batch(b.B, T);
    for (int l = s_.layers; l >= 1; --l) {
      body_.backward_input(LayerRange{l, l}, 0, batch, observer);
      body_.backward_weight(LayerRange{l, l}, 0, batch, observer);
    }
    // The patch embedding: pixels need no gradient (B is empty); W from the blocks' input gradient.
    if (observer != nullptr) observer->after_backward_input(s_.layer_base);
    {
      const PageLease use = store_.use_layer(s_.layer_base, {}, {Plane::grad});
      const float* dx = body_.input_grad(0, 1);  // [B, T, C]
      // The patch tokens' gradients, compacted [B*K, C] (tokens_ is free now), for W and bias.
      for (int i = 0; i < b.B; ++i) {
        std::memcpy(&tokens_[static_cast<size_t>(i) * K * C_], dx + (static_cast<int64_t>(i) * T + 1) * C_,
                    sizeof(float) * static_cast<size_t>(K) * C_);
      }
      ops::linear_backward_weight(math_.backward, G(patch_w_), G(patch_b_), tokens_.data(), patches_.data(), b.B * K,
                                  PV_, C_);
      float* dcls = G(cls_);
      float* dpos = G(pos_);
      for (int i = 0; i < b.B; ++i) {  // sequential over samples: a fixed order
        const float* row0 = dx + static_cast<int64_t>(i) * T * C_;
        for (int c = 0; c < C_; ++c) {
          dcls[c] += row0[c];
          dpos[c] += row0[c];
        }
        for (int k = 0; k < K; ++k) {
          float* pos = dpos + static_cast<int64_t>(1 + kept_[static_cast<size_t>(i) * K + k]) * C_;
          const float* g = row0 + static_cast<int64_t>(1 + k) * C_;
          for (int c = 0; c < C_; ++c) pos[c] += g[c];
        }
      }
    }
    if (observer != nullptr) observer->after_backward_weight(s_.layer_base);
  }

  double train_flops_per_sample() const override {
    const int T = P_ + 1;
    return 6.0 * P_ * PV_ * C_ + body_.train_flops_per_token(T) * T + 6.0 * C_ * s_.embed_dim;
  }
  int64_t activation_bytes() const override {
    return body_.activation_bytes() +
           static_cast<int64_t>(sizeof(float)) *
               static_cast<int64_t>(patches_.size() + tokens_.size() + cls_out_.size() * 4 + features_.size());
  }

 private:
  // The number of patches each sample keeps (all, without a mask); checks the batch.
  int check_batch(const ClipBatch& b) const {
    check(b.images != nullptr && b.B >= 1 && b.B <= max_B_,
          "vit: a micro-batch of " + std::to_string(b.B) + " images, allocated for " + std::to_string(max_B_));
    if (b.patch_keep == nullptr) return P_;
    check(b.keep >= 1 && b.keep <= P_, "vit: " + std::to_string(b.keep) + " patches kept of " + std::to_string(P_));
    return b.keep;
  }
  // patches_[B, K, p*p*3] of the kept patches, kept_[B, K] their indices.
  void patchify(const ClipBatch& b, int K) {
    const int p = s_.patch, G = s_.grid(), S = s_.image_size;
    for (int i = 0; i < b.B; ++i) {
      for (int k = 0; k < K; ++k) {
        const int idx = b.patch_keep ? b.patch_keep[static_cast<size_t>(i) * K + k] : k;
        check(idx >= 0 && idx < P_ && (k == 0 || b.patch_keep == nullptr || idx > kept_[static_cast<size_t>(i) * K + k - 1]),
              "vit: kept patches must be increasing indices below " + std::to_string(P_));
        kept_[static_cast<size_t>(i) * K + k] = idx;
        const int gy = idx / G, gx = idx % G;
        float* out = &patches_[(static_cast<size_t>(i) * K + k) * PV_];
        for (int r = 0; r < p; ++r) {
          const float* src = b.images + ((static_cast<int64_t>(i) * S + gy * p + r) * S + gx * p) * 3;
          std::memcpy(out + static_cast<int64_t>(r) * p * 3, src, sizeof(float) * p * 3);
        }
      }
    }
  }
  static Batch blocks_batch(int B, int T) {
    Batch batch;
    batch.B = B;
    batch.T = T;
    return batch;
  }
  float* P(TensorId id) { return store_.data(id, Plane::param); }
  float* G(TensorId id) { return store_.data(id, Plane::grad); }

  VitSpec s_;
  ChunkStore& store_;
  MathMode math_;  // its products' precision in F and in B, W (visual_math), its blocks' included
  int P_, PV_, C_;
  std::vector<TensorId> patch_ids_;
  GPT body_;
  int head_layer_;
  TensorId patch_w_, patch_b_, cls_, pos_;
  TensorId normw_ = -1, normb_ = -1, proj_ = -1;
  int max_B_ = 0;
  std::vector<float> patches_, tokens_, cls_out_, normed_, dnormed_, dcls_out_, mean_, rstd_, features_;
  std::vector<int> kept_;
};

}  // namespace

void validate_vit(const VitSpec& s) {
  auto key = [](const char* k, const std::string& expected, int found) {
    return std::string("config key 'clip.") + k + "': expected " + expected + ", found " + std::to_string(found);
  };
  check(s.patch >= 1 && s.patch <= 64, key("vit_patch", "1..64 pixels", s.patch));
  check(s.image_size >= s.patch && s.image_size % s.patch == 0,
        "config key 'clip.vit_patch': " + std::to_string(s.patch) + " does not divide the images' " +
            std::to_string(s.image_size) + " pixels");
  check(s.patches() <= 4096, key("vit_patch", "at most 4096 patches an image", s.patches()));
  check(s.layers >= 1 && s.layers <= 256, key("vit_layers", "1..256", s.layers));
  check(s.width >= 1 && s.width <= 16384, key("vit_width", "1..16384", s.width));
  check(s.heads >= 1 && s.width % s.heads == 0, key("vit_heads", "a divisor of clip.vit_width", s.heads));
  check(s.embed_dim >= 1 && s.embed_dim <= 8192, key("embed_dim", "1..8192", s.embed_dim));
}

ModelLayout vit_layout(const VitSpec& spec) {
  validate_vit(spec);
  ModelLayout out = patch_layout(spec);
  const LayerRange blocks{1, spec.layers};
  ModelLayout body = model_layout(blocks_config(spec), {&blocks, 1});
  body.tied.clear();  // a GPT-2 body's wte group: the tower has no token embedding
  out.append(body);
  out.append(head_layout(spec));
  return out;
}

std::unique_ptr<Tower> make_vit(const VitSpec& spec, ChunkStore& store, MatmulPrecision precision) {
  return std::make_unique<Vit>(spec, store, precision);
}

}  // namespace keel
