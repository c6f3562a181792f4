// One micro-batch of token windows, as the data loader yields it and the model's layers read it.
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

}  // namespace keel
