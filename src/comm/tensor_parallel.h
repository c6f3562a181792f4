// Tensor parallelism (parallel.tensor = T) as a component: the tensor group over MPI for the
// layers (model/tensor_group.h), the configuration it takes (and what it refuses, in one line),
// the gradient norm over a group's shards, and the whole model's state for checkpoints.
//
// Layout (Megatron's): world = data x pipeline x tensor, tensor innermost (comm/process_groups.h);
// each rank allocates only its shard of every split tensor (model/model_layout.h TensorShard).
// A data-parallel group is the ranks holding the same shard: gradient sync, ZeRO and the loader
// see it as the data-parallel world of a smaller model.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/zero.h"
#include "core/config.h"
#include "core/metrics_source.h"
#include "core/step_hook.h"
#include "model/gpt.h"
#include "model/model_layout.h"
#include "model/tensor_group.h"
#include "store/chunk_store.h"

namespace keel {

// Also the group's traffic counter. Metrics: `tensor_allreduce_bytes`, the bytes this rank handed
// to all-reduces over its tensor group during the step's passes (a sum's floats at 4 bytes, a
// maximum's values at 8: it runs in double), counted from before_step to after_step, so an
// evaluation between steps is not counted. Every rank of a group hands the same; the line holds
// rank 0's (with a pipeline: its first stage's group's). With sequence parallelism also
// `tensor_allgather_bytes` and `tensor_reduce_scatter_bytes`: the bytes of the whole buffers
// (every rank's part, 4 bytes a float) of its all-gathers and reduce-scatters, the measure in
// which an all-reduce of n floats costs what a reduce-scatter and an all-gather of n cost. And
// `tensor_comm_ms`: this rank's wall time inside those collectives over the step (waiting for its
// peers included), so a step's layer time splits into compute and the group's communication.
class MpiTensorGroup final : public TensorGroup, public MetricsSource, public StepHook {
 public:
  explicit MpiTensorGroup(Communicator& comm, bool sequence_parallel = false)
      : comm_(comm), sequence_parallel_(sequence_parallel) {}
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  void allreduce_sum(float* data, int64_t count) override;
  void allreduce_max(float* data, int64_t count) override;
  bool sequence_parallel() const override { return sequence_parallel_; }
  void allgather(float* data, int64_t count) override;
  void reduce_scatter_sum(float* data, int64_t count) override;
  Communicator& comm() { return comm_; }

  void before_step(int64_t) override {
    counting_ = true;
    bytes_ = gather_bytes_ = scatter_bytes_ = 0;
    ms_ = 0;
  }
  void after_step(int64_t) override {
    counting_ = false;
    step_bytes_ = bytes_;
    step_gather_bytes_ = gather_bytes_;
    step_scatter_bytes_ = scatter_bytes_;
    step_ms_ = ms_;
  }
  void add_step_fields(double, nlohmann::json& line) override {
    line["tensor_allreduce_bytes"] = step_bytes_;
    line["tensor_comm_ms"] = step_ms_;
    if (!sequence_parallel_) return;  // (absent without it: earlier runs' lines unchanged)
    line["tensor_allgather_bytes"] = step_gather_bytes_;
    line["tensor_reduce_scatter_bytes"] = step_scatter_bytes_;
  }

 private:
  Communicator& comm_;
  bool sequence_parallel_ = false;
  std::vector<double> scratch_;  // allreduce_max's values in double (the communicator's maximum)
  // Adds the wall time since `start` to the step's figure (while counting).
  void count_ms(std::chrono::steady_clock::time_point start);
  bool counting_ = false;
  double ms_ = 0, step_ms_ = 0;
  int64_t bytes_ = 0, step_bytes_ = 0, gather_bytes_ = 0, step_gather_bytes_ = 0, scatter_bytes_ = 0,
          step_scatter_bytes_ = 0;
};

// Throws keel::Error, one line naming the key, when `c` asks for tensor parallelism it cannot
// run: a model whose heads, key/value heads, MLP units or vocabulary T does not divide, a dual
// encoder, or a combination not built yet (each refused, never silently run otherwise).
void validate_tensor_parallel_config(const Config& c);

// The squared gradient norm of the whole model from a tensor group's shards (after the
// data-parallel sum): split tensors summed over the group, replicated ones (identical on every
// rank) counted once. With sharded experts (`experts`: the expert group; comm/expert_parallel.h)
// the routed experts' shards are summed over the expert group too. Collective over the group(s).
double tensor_grad_squares(GPT& model, Communicator& tensor, Communicator* experts = nullptr);
// This rank's share of the whole model's squared gradient norm over the chunks of its store that
// `owned` accepts (ZeRO-2: the chunks whose reduced gradient it owns; with sharded experts not one
// range), to be summed over the tensor group and the ranks that share the chunks out: its split
// tensors' pieces, and the replicated tensors' pieces on the tensor group's first rank only (they
// are the same on every rank of the group). Replicas of tied tensors are counted at home. Local.
double tensor_grad_share(GPT& model, int tensor_rank, const std::function<bool(int chunk)>& owned);

// Compressed gradient sync (sync.codec) runs on the data dimension: each tensor rank compresses
// its own store's chunks over its data group, and a chunk's blocks mix the rank's shards of split
// tensors with the replicated tensors (norms, biases of row-parallel products, the position
// table), so the replicated tensors' decoded gradients would differ between the group's ranks, and
// so would their updates. The group's first rank's decoded gradients of the replicated tensors are
// broadcast to the others (its data group's error feedback accounts for what it sent; the other
// ranks' residuals for those elements go unused). Collective over the group.
void tensor_share_replicated_grads(GPT& model, Communicator& tensor);

// A tensor-parallel rank's parameters and AdamW moments in the whole model's layout, so
// checkpoints are written and read as one rank (or one pipeline stage) writes them: any tensor
// size resumes any other. Holds a store of the unsplit tensors of the rank's layers (the whole
// model, or its pipeline stages'; allocated on every rank of the group; the cost of the first
// version: one whole copy of those layers' parameters and moments per rank, beside the shard).
class WholeModelState {
 public:
  // `moments` (ZeRO-1/2/3): how the model store's moments are shared out over `data`, the
  // data-parallel group (each rank holds its own chunks' moments; under ZeRO-3 also their
  // parameters, comm/sharded_params.h); null: every rank holds all. `experts`: with sharded
  // experts (comm/expert_parallel.h) the rank's share of the routed experts, which is all the
  // whole copy holds of them (the checkpointer writes each expert from the ranks holding it).
  // Under ZeRO-1/2/3 with sharded experts (`moments` experts apart) the chunks of no expert's
  // moments (ZeRO-3: and parameters) come from their owners over `data`, the rank's experts'
  // from their owner among the data ranks holding them (a communicator split from `data` here:
  // collective over it).
  WholeModelState(const Config& config, Communicator& tensor, GPT& model, Communicator* data = nullptr,
                  const ChunkPartition* moments = nullptr, ExpertPlace experts = {});
  ChunkStore& store() { return *whole_; }
  // Fills the whole store from the group's shards (all-gathers; collective over the group, and
  // under ZeRO over the data-parallel group too: the moments, under ZeRO-3 or with bf16 parameters
  // also the parameters, are gathered there first: the owners' float32 values, masters included).
  // Throws keel::Error when the replicated parameters differ between the group's ranks.
  void gather();
  // Slices the whole store (as a checkpoint loaded it) into this rank's shards (under ZeRO, its
  // own chunks' moments; under ZeRO-3 its own chunks' parameters, the only ones it holds).
  void scatter();

 private:
  // A plane of the model store as every rank would hold it unsharded (ZeRO: the moments, and the
  // parameters where `params` says so, all-gathered over the data-parallel group into planes_), or
  // nullptr for the store's own plane.
  float* gathered_plane(Plane plane, bool params);
  // Experts apart: this rank's owned chunks' `plane` copied into or out of `flat` (the rank's
  // whole flat space), and `flat` completed from the owners (the chunks of no expert over the
  // data group, the rank's experts' over their holders).
  void copy_owned(Plane plane, std::vector<float>& flat, bool into_flat);
  void gather_experts_apart(std::vector<float>& flat);

  Communicator& tensor_;
  GPT& model_;
  Communicator* data_ = nullptr;
  const ChunkPartition* moments_ = nullptr;
  std::unique_ptr<Communicator> holders_;  // experts apart with data > P: the data ranks holding this rank's experts
  bool params_sharded_ = false;  // ZeRO-3: a rank holds only its own chunks' parameters
  // ZeRO-3, or ZeRO-1/2 with bf16 parameters (store/bf16_state.h: a rank's float32 masters are its
  // own chunks', the others' are bf16 bits): gather() takes every chunk's parameters from its owner.
  bool params_from_owners_ = false;
  std::unique_ptr<ChunkStore> whole_;
  std::vector<TensorId> whole_ids_;
  std::vector<float> buffer_;
  std::vector<float> planes_[3];  // adam_m, adam_v (ZeRO), param (ZeRO-3) of the rank's whole flat space
};

}  // namespace keel
