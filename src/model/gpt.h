// A decoder-only transformer of either family (model.family). GPT-2: token + position
// embedding, pre-LayerNorm blocks of causal self-attention and a GELU MLP, final LayerNorm, LM
// head tied to the token embedding. llama (model/llama.h): token embedding, pre-RMSNorm blocks of
// rotary grouped-query attention and a SwiGLU MLP without biases, final RMSNorm, an LM head of
// its own or tied. Both end in cross-entropy. Parameters live in a ChunkStore; the model owns only
// activation memory, allocated once for the largest micro-batch.
//
// Layer indices (also the chunk store's layer ids): 0 = embedding, 1..L = blocks, L+1 = head.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "model/layer.h"
#include "model/model_layout.h"
#include "model/context_group.h"
#include "model/expert_group.h"
#include "model/tensor_group.h"
#include "store/chunk_store.h"

namespace keel {

class GPT {
 public:
  // Registers the parameter tensors of the layers in `ranges` (default: the whole model) with
  // `store` (which must not be finalized yet): exactly model_layout(config, ranges), in its order
  // (llm.c's per-layer order), and builds the layers over them. A pipeline rank holds
  // only its stages' layers; one with the head but not the embedding also holds a copy of the
  // tied token embedding wte. The caller finalizes the store, then calls init_weights or loads
  // state. With bf16_activations (runtime.precision = "bf16") the layers keep the activations
  // that feed matrix products in bf16, in half the memory (model/layer_util.h Stash). `math`: the
  // precision of every layer's matrix products (runtime.precision for a trained model; float32
  // unless given: a model built only for its layout multiplies nothing). `recompute`: which blocks
  // recompute their activations in backward and how (train.recompute; below). `tensor`: the
  // tensor group (parallel.tensor; null: unsplit): the rank registers and computes its shard of
  // every layer (model_layout's place), all-reducing over the group (model/tensor_group.h).
  // `context`: the context group (parallel.context; null: none): batches hold this rank's chunks of
  // each sequence and attention runs over the group's ring (model/context_group.h).
  // `experts`: the expert group (parallel.expert; null: none): each mixture-of-experts block runs
  // its share of the routed experts for the group's tokens (model/moe.h set_expert_group).
  GPT(const ModelConfig& config, ChunkStore& store, std::vector<LayerRange> ranges = {}, bool bf16_activations = false,
      MathMode math = {}, RecomputePlan recompute = {}, TensorGroup* tensor = nullptr,
      ContextGroup* context = nullptr, ExpertGroup* experts = nullptr);
  ~GPT();

  // GPT-2 initialisation: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L), zero
  // biases, unit norms, zero padded vocabulary rows. Each tensor draws from its own stream
  // derived from (seed, tensor name), so the result does not depend on the chunk layout.
  void init_weights(uint64_t seed);

  // Allocates activations for micro-batches of up to B x T tokens (T <= max_seq_len), `slots`
  // sets of them: a pipeline stage keeps several micro-batches between F and W.
  //
  // Activation recomputation: a recomputing block keeps in its slot only what its mode keeps
  // (selective: its matrix-product inputs; full: nothing but its input, the previous layer's
  // output) and rebuilds the rest in one set shared by every slot and block, which holds one
  // (slot, layer)'s at a time. backward_input rebuilds it unless it is already that one's (the
  // last forward's), then keeps its W operands there; backward_weight finds them when it follows
  // its B at once (backward, the executor's B then W) and otherwise (a zero-bubble schedule's
  // deferred W) rebuilds them, re-running B into a scratch gradient. Every pass runs the same
  // kernels in the same order: the same bytes as without recomputation.
  void allocate(int B, int T, int slots = 1);

  // Forward pass through all layers (the whole model, slot 0). Returns the mean loss over B*T
  // tokens when batch.targets is given (0 otherwise). With batch.grad_scale != 0 it also prepares
  // the loss gradient.
  float forward(const Batch& batch);
  // Backward pass through all layers, last to first, accumulating into the grad plane: B then W
  // of each layer, or, with defer_weight_grads, every B first and then every W (the order a
  // zero-bubble pipeline uses; the result is the same bytes). Requires a forward of the same
  // batch with grad_scale != 0.
  // The observer, if any, hears of every layer's B and W as they complete.
  void backward(const Batch& batch, bool defer_weight_grads = false, BackwardObserver* observer = nullptr);

  // A pipeline stage's share of one micro-batch, on the activations of `slot`. Forward reads its
  // input from input(slot, range.first) (filled by the caller unless the range starts at the
  // embedding) and leaves its output in output(slot, range.last); it returns the mean loss when
  // the range ends at the head. backward_input reads output_grad(slot, range.last) (unless the
  // range ends at the head) and leaves input_grad(slot, range.first); backward_weight
  // accumulates the range's weight gradients. Layers run last to first in both.
  float forward(const LayerRange& range, int slot, const Batch& batch);
  void backward_input(const LayerRange& range, int slot, const Batch& batch, BackwardObserver* observer = nullptr);
  void backward_weight(const LayerRange& range, int slot, const Batch& batch, BackwardObserver* observer = nullptr);
  // B then W of each layer of the range in turn, last to first: the same bytes as backward_input
  // then backward_weight of the range, without rebuilding recomputed activations twice.
  void backward(const LayerRange& range, int slot, const Batch& batch, BackwardObserver* input_observer,
                BackwardObserver* weight_observer);
  bool recomputes() const { return recomputed_floats_ > 0; }
  float* input(int slot, int layer) { return layer == 0 ? nullptr : x_[slot][layer - 1]; }
  float* output(int slot, int layer) { return x_[slot][layer]; }
  float* input_grad(int slot, int layer) { return layer == 0 ? nullptr : dx_[slot][layer - 1]; }
  float* output_grad(int slot, int layer) { return layer == num_layers() - 1 ? nullptr : dx_[slot][layer]; }

  // Layers 0..n-1 are frozen (optim.freeze_layers): backward passes skip their B and W (no
  // gradient below them is wanted; observers still hear of every layer). Their gradients were
  // discarded anyway, so the result is the same bytes, sooner.
  void set_frozen_layers(int n) { frozen_ = n; }
  // A test-only slowdown (runtime.slow_factor): every layer's F, B and W takes `factor` times as
  // long (a sleep after it; the layer times include it).
  void set_slowdown(double factor) { slowdown_ = factor; }

  // Milliseconds each of this rank's layers spent in F, B and W (indexed by layer; zero for the
  // layers of other ranks) since the last call, which resets them: what the layer profiler
  // (pipeline/layer_profile.h) measures.
  struct LayerTimes {
    std::vector<double> forward, backward_input, backward_weight;
  };
  LayerTimes take_layer_times();
  // Bytes one micro-batch of B x T keeps for layer i (its activations and its output with the
  // output's gradient), and the bytes of its parameters (one plane).
  int64_t layer_activation_bytes(int i, int B, int T) const;

  // Logits [B*T, padded_vocab] of the last forward pass of slot 0 (valid only when it had no
  // grad_scale).
  const float* logits();

  // Every layer of the model, including those not on this rank (num_layers() = n_layer + 2).
  int num_layers() const { return static_cast<int>(layers_.size()); }
  bool has_layer(int i) const { return layers_[i] != nullptr; }
  bool whole() const;  // holds every layer
  // The tied parameter groups (GPT-2: the token embedding wte, home layer 0, read by the head).
  const std::vector<TiedGroup>& tied_groups() const { return tied_; }
  // True when this rank holds any of `layers`.
  bool holds_any(const std::vector<int>& layers) const;
  const std::vector<LayerRange>& ranges() const { return ranges_; }
  Layer& layer(int i) { return *layers_[i]; }
  const ModelConfig& config() const { return config_; }
  const MathMode& math() const { return math_; }
  ChunkStore& store() { return store_; }
  // The layout this rank registered (its shards' shapes and splits) and the store's ids of its tensors.
  const ModelLayout& layout() const { return layout_; }
  const std::vector<TensorId>& tensor_ids() const { return ids_; }
  TensorGroup* tensor_group() const { return tensor_; }
  ContextGroup* context_group() const { return context_; }
  // Matrix-product FLOPs of one training step (forward + backward) per token at sequence T.
  double train_flops_per_token(int T) const;
  int64_t activation_bytes() const { return activation_floats_ * static_cast<int64_t>(sizeof(float)); }
  // Of those, the set recomputing blocks share (0 without recomputation; model/layer.h).
  int64_t recomputed_bytes() const { return recomputed_floats_ * static_cast<int64_t>(sizeof(float)); }
  // Bytes one micro-batch of B x T keeps in flight on `range` (activations, outputs and their
  // gradients): what a pipeline stage's slot costs, computed without building the stage.
  static int64_t slot_bytes_for(const ModelConfig& config, const LayerRange& range, int B, int T,
                                bool bf16_activations = false, RecomputePlan recompute = {});
  // Bytes of the set the recomputing blocks of `range` share (0 without recomputation), computed
  // without building the stage.
  static int64_t recomputed_bytes_for(const ModelConfig& config, const LayerRange& range, int B, int T,
                                      bool bf16_activations, RecomputePlan recompute);
  // Bytes of one slot (one micro-batch in flight on this rank's layers).
  int64_t slot_bytes() const { return slot_floats_ * static_cast<int64_t>(sizeof(float)); }
  int slots() const { return static_cast<int>(act_.size()); }
  int allocated_B() const { return max_B_; }
  int allocated_T() const { return max_T_; }

 private:
  void bind(int slot, int layer);
  // Floats of the shared recomputed set for micro-batches of up to B x T: the largest block's and
  // a re-run B's input gradient [B, T, C]; 0 without recomputation.
  int64_t recomputed_floats_for(int B, int T) const;
  // Recomputation: rebuilds layer i's shared set for `slot` unless it holds that one's.
  void rebuild(int slot, int i, const Batch& batch);
  void check_batch(const Batch& batch, int slot) const;

  ModelConfig config_;
  ChunkStore& store_;
  std::vector<LayerRange> ranges_;
  std::vector<bool> local_;
  std::vector<std::unique_ptr<Layer>> layers_;  // null for layers on other ranks
  std::vector<TiedGroup> tied_;
  bool bf16_ = false;  // activations stashed in bf16
  RecomputePlan recompute_;
  MathMode math_;      // every layer's matrix products
  TensorGroup* tensor_ = nullptr;
  ContextGroup* context_ = nullptr;
  ModelLayout layout_;
  std::vector<TensorId> ids_;  // per layout_ tensor
  int max_B_ = 0, max_T_ = 0;
  int64_t activation_floats_ = 0, slot_floats_ = 0, recomputed_floats_ = 0;
  // Whose activations the shared recomputed set holds: (slot, layer) of the last forward or
  // rebuild, and whether that one's B has kept its W operands there since.
  struct SharedOwner {
    int slot = -1, layer = -1;
    bool backward = false;
  } shared_owner_;
  float* recompute_sink_ = nullptr;  // a re-run B's input gradient [B, T, C] (its bytes are already kept)
  std::unique_ptr<float[]> memory_;
  float* scratch_ = nullptr;
  // [slot][layer]: the layer's activations, its output x [B, T, C] and the output's gradient.
  std::vector<std::vector<float*>> act_, x_, dx_;
  std::vector<int> bound_;  // the slot each layer is bound to
  LayerTimes times_;
  // Milliseconds since t0, after the test-only slowdown's sleep.
  double timed(std::chrono::steady_clock::time_point t0) const;
  int frozen_ = 0;
  double slowdown_ = 1.0;
};

}  // namespace keel
