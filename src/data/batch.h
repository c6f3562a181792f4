// One micro-batch of token windows, as the data loader yields it and the model's layers read it;
// one of image-caption pairs, as the CLIP loader (data/clip_loader.h) yields it and a dual
// encoder's towers (model/tower.h) read it.
#pragma once

namespace keel {

class KvContext;

struct Batch {
  const int* inputs = nullptr;   // [B, T] token ids
  const int* targets = nullptr;  // [B, T] next-token ids, or null (no loss: generation)
  int B = 0;
  int T = 0;
  // Multiplier of d(loss)/d(logits); 0 = forward only (evaluation). Training uses
  // 1 / (B * T * grad_accum) so gradients are those of the mean loss of the optimizer step.
  float grad_scale = 0.0f;
  // Inference over a KV cache (model/kv_context.h): B = 1, the T tokens are positions
  // kv->pos0() .. of one sequence, attention reads and extends the cache. Null: a whole window.
  KvContext* kv = nullptr;
};

// One micro-batch of image-caption pairs.
struct ClipBatch {
  const float* images = nullptr;  // [B, H, W, 3] channels-last, normalised
  const int* tokens = nullptr;    // [B, T] caption tokens (padded after each caption's end)
  const int* lengths = nullptr;   // [B]: caption b's feature is taken at position lengths[b] - 1
  int B = 0;
  int T = 0;
  // A ViT's patch masking (FLIP): the patches each sample keeps, [B, keep], increasing indices;
  // null: every patch.
  const int* patch_keep = nullptr;
  int keep = 0;
};

}  // namespace keel
