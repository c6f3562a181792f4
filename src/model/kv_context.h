// What an attention layer needs from a KV cache when it runs over new tokens of one sequence
// whose earlier keys and values are cached (runtime/kv_cache.h). The model stays ignorant of how
// the cache pages, shares or tiers its blocks.
#pragma once

#include <vector>

#include "kernels/cpu/bf16.h"

namespace keel {

class KvContext {
 public:
  virtual ~KvContext() = default;
  // Position of the first new token (the batch's T tokens are positions pos0 .. pos0 + T - 1).
  virtual int pos0() const = 0;
  // A packed pass (several sequences' new tokens side by side in one pass of T rows, batched
  // generation): the position of each of the T rows. Null (the default): rows pos0 .. pos0 + T - 1.
  virtual const int* positions() const { return nullptr; }
  // The rows of the pass whose logits are wanted (increasing, within 0 .. T - 1): the head then
  // computes only those and writes them in this order as rows 0, 1, ... of the logits (a prefill
  // that samples after its last token needs one row of the vocabulary-wide product, not T). Null
  // (the default): every row, row r at row r.
  virtual const std::vector<int>* logit_rows() const { return nullptr; }
  // Block `block` (0-based transformer block) of the model: stores the keys and values of the n
  // new tokens (columns C .. of qkv[n, ldq], after RoPE where the family has it) in the cache and
  // writes out[n, C] = causal attention of their queries (columns 0 .. C - 1) over every cached
  // key up to each one's position, within `window` keys (0 = all), its products at `precision`
  // (the layer's forward precision).
  virtual void attend(MatmulPrecision precision, int block, const float* qkv, int ldq, float* out, int n,
                      int window) = 0;
};

}  // namespace keel
