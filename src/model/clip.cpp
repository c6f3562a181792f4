#include "model/clip.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "model/text_tower.h"

namespace keel {

ResNetSpec ClipSpec::resnet_spec() const {
  ResNetSpec s = resnet ? *resnet : resnet_preset(image_tower);
  s.width = image_width;
  s.image_size = image_size;
  s.embed_dim = embed_dim;
  s.prefix = "visual.";
  s.layer_base = 0;
  s.quant = visual_quant;
  return s;
}

VitSpec ClipSpec::vit_spec() const {
  VitSpec s = vit;
  s.image_size = image_size;
  s.embed_dim = embed_dim;
  s.prefix = "visual.";
  s.layer_base = 0;
  s.quant = visual_quant;
  return s;
}

ClipSpec clip_spec(const ClipConfig& clip, int dataset_image_size) {
  check(clip.image_size == 0 || clip.image_size == dataset_image_size,
        "config key 'clip.image_size': " + std::to_string(clip.image_size) + ", but the dataset " + clip.dataset +
            " holds images of " + std::to_string(dataset_image_size) + " pixels (0 = the dataset's)");
  ClipSpec s;
  s.image_tower = *clip.image_tower;
  s.image_width = clip.image_width;
  s.image_size = dataset_image_size;
  s.embed_dim = clip.embed_dim;
  s.logit_scale_init = clip.logit_scale_init;
  s.logit_scale_max = clip.logit_scale_max;
  s.vit.patch = clip.vit_patch;
  s.vit.layers = clip.vit_layers;
  s.vit.width = clip.vit_width;
  s.vit.heads = clip.vit_heads;
  s.visual_quant = clip.visual_quant;
  return s;
}

void validate_clip_config(const Config& c) {
  const ClipConfig& clip = c.clip;
  if (!clip.enabled()) return;
  auto key = [](const std::string& k, const std::string& expected, const std::string& found) {
    return "config key '" + k + "': expected " + expected + ", found " + found;
  };
  // The towers' specs as the model will have them (the dataset's image size is checked when it is
  // loaded; until then a size each tower accepts).
  const bool vit = clip.image_tower == ImageTower::vit;
  const ClipSpec spec = clip_spec(clip, clip.image_size != 0 ? clip.image_size : vit ? clip.vit_patch : 64);
  if (vit) {
    validate_vit(spec.vit_spec());
  } else {
    validate_resnet(spec.resnet_spec());
  }
  check(clip.image_size == 0 || clip.image_size >= 32, key("clip.image_size", "0 (the dataset's) or >= 32",
                                                           std::to_string(clip.image_size)));
  check(std::isfinite(clip.logit_scale_init) && std::abs(clip.logit_scale_init) <= 20,
        key("clip.logit_scale_init", "a finite log-scale within +-20", std::to_string(clip.logit_scale_init)));
  check(std::isfinite(clip.logit_scale_max) && clip.logit_scale_max > 1,
        key("clip.logit_scale_max", "a finite value above 1", std::to_string(clip.logit_scale_max)));
  check(!clip.dataset.empty(), key("clip.dataset", "a `keel data images` directory", "\"\""));
  for (const auto& [k, v] : {std::pair<const char*, int>{"clip.image_update_every", clip.image_update_every},
                             {"clip.text_update_every", clip.text_update_every}}) {
    check(v >= 1 && v <= 1000, key(k, "a cadence of 1 .. 1000 steps", std::to_string(v)));
  }
  check(clip.image_update_every == 1 || clip.text_update_every == 1,
        key("clip.text_update_every", "1 when clip.image_update_every is not (one tower trains every step)",
            std::to_string(clip.text_update_every)));
  check(clip.vit_mask >= 0 && clip.vit_mask <= 0.95, key("clip.vit_mask", "0 .. 0.95", std::to_string(clip.vit_mask)));
  check(clip.vit_mask == 0 || vit,
        key("clip.vit_mask", "0 unless clip.image_tower = \"vit\" (patch masking)", std::to_string(clip.vit_mask)));
  // Not yet combined with a dual encoder (each a later piece of work, not a silent fallback).
  auto alone = [&](bool ok, const std::string& k, const std::string& found) {
    check(ok, "config key '" + k + "': not yet supported with clip.image_tower (a dual encoder), found " + found);
  };
  alone(c.parallel.pipeline == 1, "parallel.pipeline", std::to_string(c.parallel.pipeline));
  alone(!c.model.window_asked(), "model.attention_window",
        "\"" + c.model.attention_window + "\"");
  alone(c.sync.codec == SyncCodec::none, "sync.codec", "\"" + std::string(to_string(c.sync.codec)) + "\"");
  alone(c.train.seq_len_schedule.empty(), "train.seq_len_schedule", "\"" + c.train.seq_len_schedule + "\"");
  alone(c.optim.freeze_layers == 0, "optim.freeze_layers", std::to_string(c.optim.freeze_layers));
}

namespace {

// The loss layer's one tensor: the temperature's log-scale.
ModelLayout loss_layout(int loss_layer) {
  ModelLayout out;
  out.tensors.push_back(TensorSpec{"logit_scale", {1}, loss_layer, ChunkKind::head, false});
  return out;
}

}  // namespace

ModelLayout clip_layout(const ClipSpec& spec, const ModelConfig& text) {
  ModelLayout out =
      spec.image_tower == ImageTower::vit ? vit_layout(spec.vit_spec()) : resnet_layout(spec.resnet_spec());
  out.append(text_tower_layout(text, out.tensors.back().layer + 1, spec.embed_dim));
  out.append(loss_layout(out.tensors.back().layer + 1));
  return out;
}

ClipModel::ClipModel(const ClipSpec& spec, const ModelConfig& text, ChunkStore& store, MatmulPrecision precision)
    : spec_(spec), store_(store) {
  check(spec.logit_scale_max > 1 && std::isfinite(spec.logit_scale_max),
        "clip.logit_scale_max: expected a finite value above 1, found " + std::to_string(spec.logit_scale_max));
  image_ = spec.image_tower == ImageTower::vit ? make_vit(spec.vit_spec(), store, precision)
                                     : make_resnet(spec.resnet_spec(), store, precision);
  text_ = make_text_tower(text, image_->num_layers(), spec.embed_dim, store, precision);
  loss_layer_ = text_->first_layer() + text_->num_layers();
  logit_scale_ = register_layout(store, loss_layout(loss_layer_)).front();  // clip_layout's last tensor
}

void ClipModel::init_weights(uint64_t seed) {
  image_->init_weights(seed);
  text_->init_weights(seed);
  const PageLease use = store_.use_tensor(logit_scale_, {}, {Plane::param});
  store_.view(logit_scale_, Plane::param)[0] = static_cast<float>(spec_.logit_scale_init);
}

void ClipModel::allocate(int B, int T) {
  image_->allocate(B, T);
  text_->allocate(B, T);
  dimg_.assign(static_cast<size_t>(B) * spec_.embed_dim, 0.0f);
  dtxt_.assign(static_cast<size_t>(B) * spec_.embed_dim, 0.0f);
}

float ClipModel::logit_scale() {
  const PageLease use = store_.use_layer(loss_layer_, {Plane::param});
  return store_.data(logit_scale_, Plane::param)[0];
}

void ClipModel::add_logit_scale_grad(double grad) {
  const PageLease use = store_.use_layer(loss_layer_, {}, {Plane::grad});
  store_.data(logit_scale_, Plane::grad)[0] += static_cast<float>(grad);
}

ContrastiveResult ClipModel::train_micro_batch(const ClipBatch& b, float grad_scale, BackwardObserver* observer,
                                               const FeatureGather* dp, TowerMask backward) {
  const int D = spec_.embed_dim;
  const int ranks = dp != nullptr ? dp->ranks : 1, first = dp != nullptr ? dp->rank * b.B : 0;
  const size_t rows = static_cast<size_t>(b.B) * D, all = rows * ranks;
  all_img_.resize(all);
  all_txt_.resize(all);
  // Rank-major rows: this rank's at `first` (the loader gives rank r samples r*B .. r*B+B-1).
  std::memcpy(all_img_.data() + static_cast<size_t>(first) * D, image_->forward(b), sizeof(float) * rows);
  std::memcpy(all_txt_.data() + static_cast<size_t>(first) * D, text_->forward(b), sizeof(float) * rows);
  if (ranks > 1) {
    dp->gather(all_img_.data(), static_cast<int>(rows));
    dp->gather(all_txt_.data(), static_cast<int>(rows));
  }
  const ContrastiveResult r = contrastive_loss(all_img_.data(), all_txt_.data(), b.B * ranks, D, logit_scale(),
                                               spec_.logit_scale_max, first, b.B, grad_scale, dimg_.data(), dtxt_.data());
  // The forward passes ran every deferred update (tiers) before its chunk's first use; none may
  // still wait once gradients are written.
  store_.apply_pending();
  if (observer != nullptr) observer->after_backward_input(loss_layer_);
  add_logit_scale_grad(r.dlogit_scale * grad_scale / ranks);
  if (observer != nullptr) observer->after_backward_weight(loss_layer_);
  if (backward.text) text_->backward(b, dtxt_.data(), observer);
  if (backward.image) image_->backward(b, dimg_.data(), observer);
  return r;
}

void ClipModel::embed(const ClipBatch& b, float* img_out, float* txt_out) {
  const int D = spec_.embed_dim;
  const float* img = image_->forward(b);
  std::memcpy(img_out, img, sizeof(float) * static_cast<size_t>(b.B) * D);
  const float* txt = text_->forward(b);
  std::memcpy(txt_out, txt, sizeof(float) * static_cast<size_t>(b.B) * D);
  for (float* rows : {img_out, txt_out}) {
    for (int i = 0; i < b.B; ++i) {
      double sq = 0;
      for (int d = 0; d < D; ++d) sq += static_cast<double>(rows[i * D + d]) * rows[i * D + d];
      const double inv = 1.0 / std::max(std::sqrt(sq), 1e-12);
      for (int d = 0; d < D; ++d) rows[i * D + d] = static_cast<float>(rows[i * D + d] * inv);
    }
  }
}

}  // namespace keel
