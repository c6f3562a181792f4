// The tensor group as the layers see it (parallel.tensor): the ranks that hold the shards of the
// same layers, and the collectives Megatron's layout needs of them. The model reaches MPI only
// through this interface (comm/tensor_parallel.h implements it over a Communicator); a model
// built without one (nullptr) runs unsplit.
//
// The conjugate pair of a column-parallel product followed by a row-parallel one: the input of the
// column-parallel block is replicated (identity forward, all-reduce of its gradient backward), the
// row-parallel product's partial outputs are all-reduced forward (identity backward). Every rank
// computes the same all-reduced values, so what follows (norms, residuals, biases of row-parallel
// products) is replicated and its gradients agree on every rank by construction.
#pragma once

#include <cstdint>

#include "data/batch.h"

namespace keel {

class TensorGroup {
 public:
  virtual ~TensorGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place over the group: every rank ends with the same elementwise sum (maximum). Collective:
  // every rank of the group calls them in the same order.
  virtual void allreduce_sum(float* data, int64_t count) = 0;
  virtual void allreduce_max(float* data, int64_t count) = 0;

  // Sequence parallelism (parallel.sequence_parallel): between the tensor-parallel regions a
  // micro-batch's N = B x T token rows are held as rows() of them per rank, rank r's the rows
  // r * rows(N) .. (r + 1) * rows(N) - 1 of the [B, T] order (N divisible by the group's size).
  // The input of a column-parallel block is all-gathered from the ranks' rows (its gradient
  // reduce-scattered back to them), a row-parallel product's partial outputs reduce-scattered to
  // the ranks' rows (their gradient all-gathered): the all-reduce of the plain layout, cut in its
  // two halves with the row-wise work (norms, residuals, biases) between them done once per row.
  // Parameters used on a rank's rows only (the norms) get their gradients summed over the group.
  virtual bool sequence_parallel() const { return false; }
  // The rows of N this rank holds: N / size() with sequence parallelism, else N.
  int64_t rows(int64_t N) const { return sequence_parallel() ? N / size() : N; }
  // In place over the group, `count` floats per rank: rank r's part at data[r * count ..), every
  // rank ends with every part.
  virtual void allgather(float* data, int64_t count) = 0;
  // In place over the group, data[0 .. size() * count) summed elementwise over the ranks; rank r
  // ends with the sums of part r (data[r * count ..)) at data[0 .. count).
  virtual void reduce_scatter_sum(float* data, int64_t count) = 0;
};

// Vocabulary-parallel cross-entropy over this rank's logits[N, Vl] (vocabulary rows
// vocab_begin .. vocab_begin + Vl of the padded vocabulary; rows at or past vocab_size are padding
// and take no part): the rows' maxima, sums of exponentials and target logits (each held by one
// rank) all-reduced, so no rank materialises the whole logits. losses[N] as crossentropy_forward's
// (every rank the same); with grad_scale != 0 the logits are replaced by their gradient,
// grad_scale * (softmax - onehot(target)), zero on padding.
void vocab_parallel_crossentropy(TensorGroup& group, float* losses, float* logits, const int* targets, int N, int Vl,
                                 int vocab_begin, int vocab_size, float grad_scale);

// The vocabulary-parallel token embedding: x_out[N, C] = wte[token] of the tokens whose rows
// this rank holds (wte_shard: rows vocab_begin .. vocab_begin + Vl), zero for the others, summed
// over the group (exactly one rank contributes each row: the sum is exact), plus wpe[pos0 + t]
// when given.
// With sequence parallelism x_out holds this rank's rows (TensorGroup::rows) and `partial` [N, C]
// takes the rows' contributions before they are reduce-scattered (unused otherwise).
// `positions` (b.T entries, or null): the position of each local row of a sequence (context
// parallelism's chunks); null: pos0 + t.
void vocab_parallel_embedding_forward(TensorGroup& group, float* x_out, const Batch& b, const float* wte_shard,
                                      const float* wpe, int pos0, int Vl, int vocab_begin, int C,
                                      float* partial = nullptr, const int* positions = nullptr);
// Its weight gradient: this rank's rows of dwte (the tokens it holds) and the whole dwpe (every
// rank the same), accumulated in token order as encoder_backward_weight does.
void vocab_parallel_embedding_backward(float* dwte_shard, float* dwpe, const float* dx_out, const Batch& b, int Vl,
                                       int vocab_begin, int C, const int* positions = nullptr);

}  // namespace keel
