// Tensor parallelism (parallel.tensor = T) as a component: the tensor group over MPI for the
// layers (model/tensor_group.h), the configuration it takes (and what it refuses, in one line),
// the gradient norm over a group's shards, and the whole model's state for checkpoints.
//
// Layout (Megatron's): world = data x pipeline x tensor, tensor innermost (comm/process_groups.h);
// each rank allocates only its shard of every split tensor (model/model_layout.h TensorShard).
// A data-parallel group is the ranks holding the same shard: gradient sync, ZeRO and the loader
// see it as the data-parallel world of a smaller model.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/config.h"
#include "model/gpt.h"
#include "model/tensor_group.h"
#include "store/chunk_store.h"

namespace keel {

class MpiTensorGroup final : public TensorGroup {
 public:
  explicit MpiTensorGroup(Communicator& comm) : comm_(comm) {}
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  void allreduce_sum(float* data, int64_t count) override;
  void allreduce_max(float* data, int64_t count) override;
  Communicator& comm() { return comm_; }

 private:
  Communicator& comm_;
  std::vector<double> scratch_;  // allreduce_max's values in double (the communicator's maximum)
};

// Throws keel::Error, one line naming the key, when `c` asks for tensor parallelism it cannot
// run: a model whose heads, key/value heads, MLP units or vocabulary T does not divide, a dual
// encoder, or a combination not built yet (each refused, never silently run otherwise).
void validate_tensor_parallel_config(const Config& c);

// The squared gradient norm of the whole model from a tensor group's shards (after the
// data-parallel sum): split tensors summed over the group, replicated ones (identical on every
// rank) counted once. Collective over the group.
double tensor_grad_squares(GPT& model, Communicator& tensor);

// A tensor-parallel rank's parameters and AdamW moments in the whole model's layout, so
// checkpoints are written and read as one rank writes them: any tensor size resumes any other.
// Holds a store of the whole model (allocated on every rank of the group; the cost of the
// first version: one whole copy of parameters and moments per rank, beside the shard).
class WholeModelState {
 public:
  WholeModelState(const Config& config, Communicator& tensor, GPT& model);
  ChunkStore& store() { return *whole_; }
  // Fills the whole store from the group's shards (all-gathers; collective over the group).
  // Throws keel::Error when the replicated parameters differ between the group's ranks.
  void gather();
  // Slices the whole store (as a checkpoint loaded it) into this rank's shards.
  void scatter();

 private:
  Communicator& tensor_;
  GPT& model_;
  std::unique_ptr<ChunkStore> whole_;
  std::vector<TensorId> whole_ids_;
  std::vector<float> buffer_;
};

}  // namespace keel
