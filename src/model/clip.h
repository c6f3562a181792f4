// A CLIP-style dual encoder: an image tower (ResNet, model/resnet.h), a text tower (Keel's
// transformer with a pooling head, model/text_tower.h), and a learnable temperature, trained with
// the symmetric InfoNCE loss (model/contrastive.h). All parameters live in one chunk store: the
// image tower's layers first, then the text tower's, then the loss layer holding "logit_scale" [1]
// (a log-scale, initialised to log(1 / 0.07) and clamped at log(100) in use, as OpenAI's CLIP
// does). AdamW, checkpoints, tiers and gradient sync see one store like any other model's.
#pragma once

#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "core/config.h"
#include "model/contrastive.h"
#include "model/model_layout.h"
#include "model/resnet.h"
#include "model/tower.h"
#include "model/vit.h"
#include "store/chunk_store.h"

namespace keel {

struct ClipSpec {
  ImageTower image_tower = ImageTower::resnet18;  // clip.image_tower
  int image_width = 64;                  // the ResNet's stem channels
  int image_size = 64;
  int embed_dim = 64;
  double logit_scale_init = std::log(1.0 / 0.07);
  double logit_scale_max = 100.0;
  std::optional<ResNetSpec> resnet;  // other stage depths than the named presets' (tests)
  VitSpec vit;                       // image_tower = "vit": patch, layers, width, heads
  VisualQuant visual_quant = VisualQuant::none;  // clip.visual_quant (either tower's spec gets it)
  ResNetSpec resnet_spec() const;    // the image tower's, layer base 0
  VitSpec vit_spec() const;
};

// The model [clip] describes over images of `dataset_image_size` pixels (clip.image_size 0 = the
// dataset's; otherwise they must agree: one line naming both).
ClipSpec clip_spec(const ClipConfig& clip, int dataset_image_size);
// Checks [clip] and what a dual encoder run cannot combine with yet (pipelines, attention windows,
// compressed sync, sequence-length curricula, frozen layers): one line naming the key. The towers'
// shapes are checked again when the model is built.
void validate_clip_config(const Config& config);

// Which towers a micro-batch's backward runs through (a tower off its update cadence runs forward
// only: its features still enter the loss, no gradient reaches its parameters).
struct TowerMask {
  bool image = true;
  bool text = true;
};

// Every tensor of the dual encoder (model/model_layout.h), in ClipModel's order: the image tower's
// (vit_layout or resnet_layout), the text tower's (text_tower_layout), then logit_scale.
ModelLayout clip_layout(const ClipSpec& spec, const ModelConfig& text);

// How a micro-batch's features meet the other data-parallel ranks' (runtime/clip_step.h makes one
// over a communicator): this rank's place among `ranks`, and `gather`, which fills a rank-major
// buffer of ranks x floats_per_rank floats, this rank's already at rank x floats_per_rank, with
// every other rank's, in place (a collective: every rank calls it).
struct FeatureGather {
  int rank = 0;
  int ranks = 1;
  std::function<void(float* rows, int floats_per_rank)> gather;
};

class ClipModel {
 public:
  // `text` is a resolved model config (the text tower's transformer). Registers every tensor with
  // `store` (clip_layout's), which the caller then finalizes. `precision` (runtime.precision): the
  // arithmetic of the text tower's products, and of the image tower's unless spec.visual_quant says
  // otherwise (model/tower.h visual_math); under bf16 the text tower keeps its products' activations
  // in bf16.
  ClipModel(const ClipSpec& spec, const ModelConfig& text, ChunkStore& store,
            MatmulPrecision precision = MatmulPrecision::fp32);
  void init_weights(uint64_t seed);
  void allocate(int B, int T);

  Tower& image() { return *image_; }
  Tower& text() { return *text_; }
  const ClipSpec& spec() const { return spec_; }
  int num_layers() const { return loss_layer_ + 1; }
  int loss_layer() const { return loss_layer_; }
  TensorId logit_scale_tensor() const { return logit_scale_; }
  float logit_scale();  // the parameter (log-scale) now

  // One micro-batch: both towers' forward, the features gathered by `dp` (null: this rank holds
  // the whole batch; every rank's micro-batch has the same size), the loss over the gathered
  // batch, the gradients (times grad_scale) for this rank's samples through both towers and into
  // logit_scale. Summed over the ranks (gradient sync), they are the whole batch's: logit_scale's
  // share is 1 / ranks of the whole batch's gradient on each. Observers hear the loss layer first,
  // then the text tower's layers, then the image tower's (last to first): store ids descending;
  // a tower outside `backward` is skipped (its layers are not heard of).
  ContrastiveResult train_micro_batch(const ClipBatch& batch, float grad_scale, BackwardObserver* observer = nullptr,
                                      const FeatureGather* dp = nullptr, TowerMask backward = {});
  // Features of both towers, normalised, for evaluation: img_out / txt_out [B, D].
  void embed(const ClipBatch& batch, float* img_out, float* txt_out);
  // Adds dlogit_scale (times grad_scale) to the parameter's gradient (under a lease of the loss layer).
  void add_logit_scale_grad(double grad);

  // Multiply-add FLOPs (x2) of one pair's forward and backward (both towers).
  double train_flops_per_sample() const { return image_->train_flops_per_sample() + text_->train_flops_per_sample(); }

 private:
  ClipSpec spec_;
  ChunkStore& store_;
  std::unique_ptr<Tower> image_, text_;
  int loss_layer_ = 0;
  TensorId logit_scale_ = -1;
  std::vector<float> dimg_, dtxt_, all_img_, all_txt_;
};

}  // namespace keel
