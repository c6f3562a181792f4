// The ResNet image tower: torchvision's ResNet (v1.5: the stride on the bottleneck's 3 x 3
// convolution) with GroupNorm in place of BatchNorm, global average pooling and a projection into
// the shared embedding in place of the classifier.
//
// Normalisation: GroupNorm with min(32, C) groups (eps 1e-5, affine). BatchNorm's statistics are
// those of each rank's micro-batch, so a data-parallel run would no longer equal one rank with the
// whole batch (nor a run with gradient accumulation), and its running averages would be state
// outside the chunk store; GroupNorm normalises each sample on its own, needs no statistics across
// samples or ranks, and trains ResNets to within a point of BatchNorm at these batch sizes.
//
// Layers (store ids from spec.layer_base): the stem (7 x 7 convolution, stride 2, GroupNorm, ReLU,
// 3 x 3 max pool, stride 2), one per residual block, the head (average pool, projection without
// bias). Tensor names are torchvision's state_dict names under spec.prefix ("visual.conv1.weight",
// "visual.layer2.0.downsample.0.weight", ... — "bn" modules are GroupNorms), so weights move
// between Keel and PyTorch by name; the projection is "visual.proj.weight" [D, C]. Chunk kinds:
// convolutions "ffn", GroupNorms "norm", the projection "head" (what tier and codec policies key on).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "model/model_layout.h"
#include "model/tower.h"
#include "store/chunk_store.h"

namespace keel {

struct ResNetSpec {
  std::string block = "basic";  // "basic" (two 3 x 3 convolutions) or "bottleneck" (1 x 1, 3 x 3, 1 x 1, x4)
  std::vector<int> layers = {2, 2, 2, 2};  // blocks per stage
  int width = 64;       // the stem's channels; stages have width, 2, 4 and 8 x width planes
  int image_size = 64;  // square input images
  int embed_dim = 64;   // the projection's width D
  std::string prefix = "visual.";
  int layer_base = 0;
  // clip.visual_quant: "none", or "bf16": the tower's convolutions and projection read bf16
  // activations, weights and gradients (float32 sums and outputs) where the CPU has bf16
  // instructions (kernels/cpu/conv.cpp); int8 is a ViT's only.
  VisualQuant quant = VisualQuant::none;
  int expansion() const { return block == "bottleneck" ? 4 : 1; }
  int out_channels() const { return 8 * width * expansion(); }
};

// "resnet18" / "resnet34" (basic blocks) and "resnet50" / "resnet101" / "resnet152" (bottleneck):
// torchvision's stage depths. Throws for vit (not a ResNet).
ResNetSpec resnet_preset(ImageTower tower);
// Checks a spec (one line naming what is wrong).
void validate_resnet(const ResNetSpec& spec);

// The tower's tensors (model/model_layout.h), checked as validate_resnet checks the spec: the
// stem's, each block's (torchvision's order, the shortcut last), the projection.
ModelLayout resnet_layout(const ResNetSpec& spec);

// Registers the tower's tensors (resnet_layout) with `store` (not yet finalized). `precision`: the
// process's (runtime.precision), which the tower's products use unless spec.quant says otherwise
// (visual_math).
std::unique_ptr<Tower> make_resnet(const ResNetSpec& spec, ChunkStore& store, MatmulPrecision precision);

}  // namespace keel
