// The unit that pipelines, tiers and gradient sync reason about: a layer of the model with a
// forward pass and a backward pass split into B (gradient w.r.t. its input) and W (gradient
// w.r.t. its weights). Splitting B from W lets a pipeline schedule W into its bubbles and lets
// gradient sync of a layer start as soon as its W is done.
#pragma once

#include <cstdint>
#include <vector>

#include "core/backward_observer.h"
#include "data/batch.h"
#include "kernels/cpu/bf16.h"

namespace keel {

class ChunkStore;
class MoeFeedForward;
struct MoeStats;

// The arithmetic of a layer's matrix products (kernels/cpu/bf16.h), given at its construction and
// handed to every kernel it calls: `forward` in F, `backward` in B and W. A language model's layers
// multiply at runtime.precision both ways; an image tower under clip.visual_quant = "int8"
// multiplies in int8 forward and bf16 backward (model/tower.h visual_math). The default is float32.
struct MathMode {
  MatmulPrecision forward = MatmulPrecision::fp32;
  MatmulPrecision backward = MatmulPrecision::fp32;
  static MathMode uniform(MatmulPrecision p) { return MathMode{p, p}; }
};

// An attention layer's window and a probe of where its attention goes (runtime/dynamic_windows.h).
struct AttentionProbe {
  static constexpr int kBuckets = 32;  // distance buckets: 0, 1, 2-3, 4-7, ... (bucket b >= 1: 2^(b-1) .. 2^b - 1)
  static constexpr int kRows = 16;     // query rows probed per sequence: its last ones (they reach farthest)
  int window = 0;      // the sliding window the layer attends within now (0 = none)
  bool armed = false;  // measure during forward passes (training micro-batches, not the KV cache's)
  // [head][bucket]: full causal attention's probability mass at each distance, summed over the
  // probed rows of every micro-batch while armed; `rows` counts them.
  std::vector<double> mass;
  double rows = 0;
};

class Layer {
 public:
  virtual ~Layer() = default;
  virtual const char* name() const = 0;

  // Activation floats this layer keeps for a micro-batch of up to B x T tokens, and scratch
  // floats it needs only during one call (scratch is shared by all layers).
  virtual int64_t activation_floats(int B, int T) const = 0;
  virtual int64_t scratch_floats(int B, int T) const = 0;
  // Gives the layer its activation memory (activation_floats(B, T) of it) and the shared scratch,
  // for micro-batches of up to B x T tokens. Called again to switch between the activation sets
  // of micro-batches in flight (cheap: it only carves pointers).
  virtual void bind(float* activations, float* scratch, int B, int T) = 0;

  // Activation recomputation (train.recompute; the blocks implement it, the other layers keep
  // everything): floats of the set the layer rebuilds in backward instead of keeping per
  // micro-batch. One such set is shared by every slot and every recomputing layer (it holds one
  // layer's at a time: GPT tracks whose), given once by set_recomputed before any bind. It holds
  // what forward wrote there and what backward_input keeps for backward_weight.
  virtual int64_t recomputed_floats(int /*B*/, int /*T*/) const { return 0; }
  virtual void set_recomputed(float* /*shared*/) {}
  // Rewrites the shared set as the forward of this micro-batch left it, from what the layer keeps
  // and x_in, with the forward's kernels in the forward's order (the same bytes). Takes the
  // parameter lease a forward takes when it multiplies.
  virtual void recompute(const Batch& /*batch*/, const float* /*x_in*/) {}

  // x_out[B, T, C] from x_in[B, T, C]. The embedding reads batch.inputs instead of x_in; the
  // head reads batch.targets and writes losses instead of x_out.
  virtual void forward(const Batch& batch, const float* x_in, float* x_out) = 0;
  // B: dx_in[B, T, C] (overwritten) from dx_out. Keeps what backward_weight needs. The embedding
  // has no dx_in; the head reads its own loss gradient (dx_out is null). x_in is the forward's
  // input, still alive (a pipeline keeps several micro-batches in flight: the layer is re-bound
  // to each one's activations, so it cannot remember the pointer itself).
  virtual void backward_input(const Batch& batch, const float* x_in, const float* dx_out, float* dx_in) = 0;
  // W: accumulates weight gradients into the store's grad plane. Requires backward_input of the
  // same micro-batch, with the same x_in and dx_out still alive.
  virtual void backward_weight(const Batch& batch, const float* x_in, const float* dx_out) = 0;
  // Attention layers: their window and probe (null for the others).
  virtual AttentionProbe* attention_probe() { return nullptr; }
  // Mixture-of-experts blocks: what their router measured (model/moe.h; null for the others).
  virtual MoeStats* moe_stats() { return nullptr; }
  // Mixture-of-experts blocks: the block's experts and router (model/moe.h; null for the others).
  virtual MoeFeedForward* moe() { return nullptr; }
};

}  // namespace keel
