// The ViT image tower: the image cut into p x p patches (row-major; a patch's pixels row by row,
// channels last), each projected to the width C ("visual.patch.w" [C, p*p*3], "visual.patch.b"),
// a class token ("visual.cls" [C]) before them and a learned position embedding ("visual.pos"
// [P + 1, C], row 0 the class token's) added to every token; Keel's GPT-2 blocks with attention
// that is not causal (every token attends to every other: ModelConfig::causal = false, dense
// kernel), names "visual.h.{i}.*"; then the class token's final state through LayerNorm
// ("visual.lnf.w/b") and a projection without bias ("visual.proj.w" [D, C]). (OpenAI's CLIP ViT
// also normalises before the first block and uses exact-erf GELU; Keel's blocks use the tanh
// GELU of its language models.)
//
// Patch masking (FLIP): a batch may name the patches each sample keeps (ClipBatch::patch_keep,
// the same number for every sample): only those follow the class token, with their own position
// rows, so the blocks run on K + 1 tokens instead of P + 1 — the saving FLIP trades for its larger
// batches.
//
// Visual-token quantisation (clip.visual_quant, `quant`): the tower's matrix products — the patch
// embedding, every block's (attention's included) and the projection — at a lower precision,
// chosen per step from the tokens' own ranges:
//   "bf16": forward and backward products with bf16 operands (float32 sums), and the activations
//           the blocks keep for backward stored as bf16 (half their memory);
//   "int8": forward products in int8, each token's (row's) scale from its largest magnitude and
//           each weight column's likewise, recomputed every call (kernels/cpu/int8_gemm.h); the
//           backward products in bf16 from the float32 activations (the quantisation is passed
//           straight through: its gradient is taken as the identity).
// The text tower and the loss are not affected.
//
// Store layers (from layer_base): the patch embedding, one per block, the head.
#pragma once

#include <memory>
#include <string>

#include "model/model_layout.h"
#include "model/tower.h"
#include "store/chunk_store.h"

namespace keel {

struct VitSpec {
  int image_size = 64;
  int patch = 8;
  int layers = 4;
  int width = 64;
  int heads = 4;
  int embed_dim = 64;
  VisualQuant quant = VisualQuant::none;  // clip.visual_quant
  std::string prefix = "visual.";
  int layer_base = 0;
  int grid() const { return image_size / patch; }
  int patches() const { return grid() * grid(); }
};

// One line naming the [clip] key that is wrong.
void validate_vit(const VitSpec& spec);
// The tower's tensors (model/model_layout.h), the spec checked as validate_vit does: the patch
// embedding's, the blocks' (a GPT-2 body's, model_layout), the head's.
ModelLayout vit_layout(const VitSpec& spec);
// Registers the tower's tensors (vit_layout) with `store` (not yet finalized). `precision`: the
// process's (runtime.precision), which the tower's products use unless spec.quant says otherwise
// (visual_math).
std::unique_ptr<Tower> make_vit(const VitSpec& spec, ChunkStore& store, MatmulPrecision precision);

}  // namespace keel
