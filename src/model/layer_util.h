// What the layers of both model families share: carving activation memory, and the output layer's
// interface (the loss and the logits of the last forward).
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/config.h"
#include "kernels/cpu/ops.h"
#include "model/layer.h"
#include "model/tensor_group.h"
#include "store/chunk_store.h"

namespace keel::model_detail {

inline int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }

// A weight as the operand of a product at `precision`: under bf16 the store's bf16 copy of it
// (ChunkStore::bf16_params: converted once per update, read in place), else its float32
// parameters. Requires the weight's parameter pages leased.
inline Operand weight_operand(ChunkStore& store, TensorId id, MatmulPrecision precision) {
  if (precision == MatmulPrecision::bf16) {
    if (const uint16_t* bits = store.bf16_params(id)) return Operand::bits(bits);
  }
  return Operand(store.data(id, Plane::param));
}

// Carves named slices out of one allocation, 64-byte aligned. Over no allocation (null) it only
// counts: used() is what the slices need.
class Carver {
 public:
  explicit Carver(float* base) : base_(base) {}
  float* take(int64_t n) {
    float* p = base_ ? base_ + used_ : nullptr;
    used_ += padded(n);
    return p;
  }
  int64_t used() const { return used_; }

 private:
  float* base_;
  int64_t used_ = 0;
};

// Where a block carves each tensor under activation recomputation (train.recompute): into the
// micro-batch's own activations (kept from forward to backward) or into the set shared by every
// slot and recomputing layer (rebuilt in backward by Layer::recompute).
struct RecomputeCarver {
  Carver kept, shared;
  Carver& at(bool recomputed) { return recomputed ? shared : kept; }
};

// Both families' Layer::recompute. Full: the block's whole forward again under its layer's
// parameter lease (`forward_again`, its output into the shared set's sink). Selective: attention
// from the kept q/k/v (`attend`), then, in float32, the MLP's activation from its kept input
// (`activation`; under bf16 that input is kept rounded, so the block keeps the activation's
// output instead: recomputing it from rounded rows would change the bytes).
template <typename ForwardAgain, typename Attend, typename Activation>
void recompute_block(Recompute mode, bool bf16, ChunkStore& store, int layer, ForwardAgain forward_again, Attend attend,
                     Activation activation) {
  if (mode == Recompute::full) {
    const PageLease use = store.use_layer(layer, {Plane::param});
    forward_again();
    return;
  }
  attend();
  if (!bf16) activation();
}

// What a block's carve(RecomputeCarver&, B, T) takes from each, counted on a copy of the block
// (its own pointers stay bound): its activation_floats and recomputed_floats.
template <typename BlockType>
RecomputeCarver carved(const BlockType& block, int B, int T) {
  BlockType sizing(block);
  RecomputeCarver a{Carver(nullptr), Carver(nullptr)};
  sizing.carve(a, B, T);
  return a;
}

// An activation a layer keeps from forward (or B) for a later pass: float32, or, when the model
// stores activations in bf16 (runtime.precision = "bf16"), bf16 bits in half the memory. Kept in
// bf16: the inputs of matrix products (which multiply in bf16 anyway, so storing them rounded
// changes no product) and the GELU / SwiGLU inputs and gradients that feed a product; kept in
// float32: the residual stream, attention's q/k/v, outputs and row statistics, norm gradients,
// logits. A producer writes float32 where writable() says (the tensor itself, or a staging
// buffer under bf16) and calls seal(), which rounds the staged values into the bits.
class Stash {
 public:
  static int64_t floats(int64_t n, bool bf16) { return bf16 ? (n + 1) / 2 : n; }
  void carve(Carver& a, int64_t n, bool bf16) {
    bf16_ = bf16;
    p_ = a.take(floats(n, bf16));
  }
  float* writable(float* staging) const { return bf16_ ? staging : p_; }
  void seal(const float* written, int64_t n) const {
    if (bf16_) to_bf16(reinterpret_cast<uint16_t*>(p_), written, n);
  }
  Operand read() const { return bf16_ ? Operand::bits(reinterpret_cast<const uint16_t*>(p_)) : Operand(p_); }
  // Where a bf16 stash keeps its bits (a kernel that writes them itself in place of seal); nullptr
  // for a float32 one.
  uint16_t* bits() const { return bf16_ ? reinterpret_cast<uint16_t*>(p_) : nullptr; }

 private:
  float* p_ = nullptr;
  bool bf16_ = false;
};

// Floats an attention layer keeps per micro-batch beside its output: the dense kernel's T x T
// probabilities, or the blockwise kernel's log-sum-exp per row (linear in T).
inline int64_t attention_floats(const ModelConfig& m, int B, int T) {
  const int64_t rows = static_cast<int64_t>(B) * m.n_head * T;
  return m.attention == Attention::dense ? rows * T : rows;
}

// The mean of N tokens' losses, summed in a fixed order (sequential).
inline float mean_loss(const float* losses, int N) {
  double sum = 0;
  for (int n = 0; n < N; ++n) sum += losses[n];
  return static_cast<float>(sum / N);
}

// Both heads' loss: cross-entropy of logits[N, Vp] (in place: its gradient when grad_scale != 0)
// and the mean over the N tokens, summed in a fixed order. 0 without targets.
inline float head_loss(float* losses, float* logits, const Batch& b, const ModelConfig& m) {
  if (b.targets == nullptr) return 0.0f;
  const int N = b.B * b.T;
  ops::crossentropy_forward(losses, logits, b.targets, N, m.vocab_size, m.padded_vocab_size, b.grad_scale);
  return mean_loss(losses, N);
}

// Both families' blocks: while armed (runtime/dynamic_windows.h), where a training pass's
// attention mass goes by distance, from its qkv (after RoPE: the scores attention uses). qkv holds
// this rank's heads: NH query heads (C columns) and NKV key/value heads, the model's heads
// head0 .. head0 + NH - 1 (all of them, head0 = 0, without tensor parallelism); their mass goes to
// those heads' rows of probe.mass, the other rows stay zero (DynamicWindows sums them over the
// tensor group).
inline void probe_attention(AttentionProbe& probe, const Batch& b, const float* qkv, int C, int NH, int NKV, int head0) {
  if (!probe.armed || b.kv != nullptr) return;
  ops::attention_distance_mass(probe.mass.data() + static_cast<int64_t>(head0) * AttentionProbe::kBuckets,
                               AttentionProbe::kBuckets, qkv, b.B, b.T, C, NH, NKV, AttentionProbe::kRows);
  probe.rows += static_cast<double>(b.B) * std::min(AttentionProbe::kRows, b.T);
}

// A layer's side of sequence parallelism (TensorGroup::sequence_parallel): where its rows of a
// micro-batch's N token rows start, and the collectives that move [rows, C] blocks between the
// ranks' rows and the whole [N, C]. Off (no group, or a group without it) every rank holds all N.
class SequenceRows {
 public:
  explicit SequenceRows(TensorGroup* group = nullptr) : group_(group) {}
  bool on() const { return group_ != nullptr && group_->sequence_parallel(); }
  int64_t rows(int64_t N) const { return on() ? group_->rows(N) : N; }
  int64_t first(int64_t N) const { return on() ? group_->rank() * group_->rows(N) : 0; }
  // all[N, C] from every rank's mine[rows, C] (mine may already be all's own rows). Returns all.
  float* gather(float* all, const float* mine, int64_t N, int64_t C) const {
    float* own = all + first(N) * C;
    if (own != mine) std::copy_n(mine, rows(N) * C, own);
    group_->allgather(all, rows(N) * C);
    return all;
  }
  // A kept stash's rows (model_detail::Stash::read: float32, or bf16 bits) as all N rows of a
  // product's operand, gathered into all (room for N x C floats). bf16 bits travel as they are, two
  // to a float (half the bytes; rows x C odd: widened to float32 first, exactly), so the product
  // reads the same bits it reads without sequence parallelism.
  Operand gather(float* all, Operand mine, int64_t N, int64_t C) const {
    if (mine.bf16 == nullptr) return Operand(gather(all, mine.f32, N, C));
    const int64_t n = rows(N) * C;
    if (n % 2 == 0) {
      uint16_t* bits = reinterpret_cast<uint16_t*>(all);
      std::copy_n(mine.bf16, n, bits + first(N) * C);
      group_->allgather(all, n / 2);
      return Operand::bits(bits);
    }
    float* own = all + first(N) * C;
    for (int64_t i = 0; i < n; ++i) own[i] = from_bf16(mine.bf16[i]);
    group_->allgather(all, n);
    return Operand(static_cast<const float*>(all));
  }
  // part[N, C] summed over the ranks; this rank's rows of the sums land in mine[rows, C] (which may
  // be part itself: MPI's in-place convention leaves them at its start).
  void scatter(float* part, float* mine, int64_t N, int64_t C) const {
    group_->reduce_scatter_sum(part, rows(N) * C);
    if (mine != part) std::copy_n(part, rows(N) * C, mine);
  }
  // The norms' weight gradients, computed from this rank's rows into partial[k * C ..) for grads[k]
  // (zeroed by the caller), summed over the group in one all-reduce and added to grads[k][0 .. C):
  // every rank then adds the whole batch's.
  void sum_into(float* partial, std::initializer_list<float*> grads, int64_t C) const {
    group_->allreduce_sum(partial, static_cast<int64_t>(grads.size()) * C);
    for (float* grad : grads) {
      for (int64_t i = 0; i < C; ++i) grad[i] += partial[i];
      partial += C;
    }
  }

 private:
  TensorGroup* group_;
};

// The last layer: final norm, LM head and cross-entropy.
class OutputLayer : public Layer {
 public:
  virtual float mean_loss() const = 0;     // of the last forward with targets
  virtual const float* logits() const = 0;  // [B*T, padded_vocab] of the last forward
};

}  // namespace keel::model_detail
