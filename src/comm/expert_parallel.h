// Expert parallelism (parallel.expert = P) as a component: the expert group over MPI for the
// mixture-of-experts blocks (model/expert_group.h), and its traffic counter.
//
// Layout: an expert group is P consecutive ranks of the data-parallel group (comm/process_groups.h);
// rank r of it runs the products of routed experts r E / P .. (r + 1) E / P - 1 for every token its
// group's ranks route there: each block's forward sends the sorted rows to the experts' ranks and
// takes the outputs back (an all-to-all each way, counts first), its backward the same for the
// gradients. The router, the shared experts and everything outside the blocks run on every rank
// as without expert parallelism.
//
// Sharded experts: a rank holds only its E / P routed experts' chunks (model/model_layout.h
// ExpertPlace: parameters, gradients, moments); the router, the shared experts and every other
// chunk as under plain data parallelism. An expert's gradient is summed over the data / P ranks
// holding it (comm/grad_sync.h; none when data == P), everything else over the data group; the
// gradient norm counts each expert once (expert_grad_squares). Checkpoints hold the whole model
// (every expert, written by the ranks of the first expert group: ckpt/checkpointer.h) and resume
// on any P, read by tensor name. With a sync codec an expert bucket is compressed over the ranks
// holding its experts (comm/grad_sync.h). Under ZeRO-1/2 a rank's layout is the same (its own
// experts only): ZeRO shares the chunks of no expert out over the data group and each expert's
// chunks over the data / P ranks holding it (comm/zero.h, experts apart; with data == P a rank
// owns its experts' whole state), reduces (ZeRO-2: reduce-scatters) each gradient bucket over its
// chunks' group and broadcasts the updated parameters over the same groups. Under ZeRO-3 the
// same partition homes the parameters (comm/sharded_params.h): a MoE block's whole-layer lease
// gathers the chunks of no expert over the data group and the rank's experts' over their holders.
// In a pipeline each stage's replicas share out the stage's experts so (ZeRO-1/2/3; a ZeRO-1/2
// re-cut moves an expert's chunks within its replica and its moments from their owner among the
// holders), with tensor groups (also in a pipeline) each rank's chunks are its tensor shard of
// its experts (holders: the data ranks with the same expert and tensor rank), with bf16 training
// state under ZeRO-1/2 on one stage without tensor groups a rank's masters are its owned chunks'.
// With gradient prediction in a pipeline, bf16 training state elsewhere, and under ZeRO-3 with
// memory tiers every rank holds every expert: a rank writes weight gradients for its own experts
// only, the data-parallel sum adds each expert's over the ranks that ran it, and ZeRO shards the
// experts' chunks over the data group as the rest.
#pragma once

#include <cstdint>

#include "comm/communicator.h"
#include "core/metrics_source.h"
#include "core/step_hook.h"
#include "model/expert_group.h"
#include "core/config.h"
#include "store/chunk_store.h"

namespace keel {

class GPT;

// Whether a rank holds only its share of the routed experts: parallel.expert > 1 without ZeRO;
// under ZeRO with float32 training state, on one stage or in a pipeline without gradient
// prediction (parallel.predict_gradients), with or without memory copies (checkpoint.memory_every),
// ZeRO-3 without memory tiers, also with tensor groups (parallel.tensor > 1); with bf16 training
// state ZeRO-1/2 on one stage without tensor groups.
// Otherwise every rank holds every expert (its weight gradients zero but for its own), sharded
// over the data group as every other chunk.
bool experts_sharded(const Config& config);
// Hands `group` to every mixture-of-experts block of `model` holding every expert (the ZeRO
// layouts experts_sharded excludes), before its activations are allocated.
void attach_expert_group(GPT& model, ExpertGroup& group);
// ZeRO-3 (comm/sharded_params.h) with a mixture of experts: every MoE block of `model` leases its
// whole layer in each pass (MoeFeedForward::lease_whole_layer), so a layer's gather brings every
// expert the block holds with it (every rank of the data group takes the same leases; the experts
// a rank's tokens did not choose included; with sharded experts the rank's own E / P, gathered
// over their holders, else every expert, those that other ranks run included).
void gather_experts_with_layers(GPT& model);

// Metrics: `expert_alltoall_bytes`, the bytes this rank sent in the expert group's exchanges during
// the step's passes (its own rows included), and `expert_wait_ms`, the time it spent blocked
// finishing them (what the work between start and finish did not hide, and the wait for the
// group's slowest rank), counted from before_step to after_step.
class MpiExpertGroup final : public ExpertGroup, public MetricsSource, public StepHook {
 public:
  explicit MpiExpertGroup(Communicator& comm) : comm_(comm) {}
  // What a rank holds of the model's parameters (bytes: this rank's and the whole model's), for
  // the start-up line and metrics.jsonl's `param_bytes` / `model_param_bytes`.
  void set_param_bytes(int64_t held, int64_t whole) {
    param_bytes_ = held;
    model_param_bytes_ = whole;
  }
  int64_t param_bytes() const { return param_bytes_; }
  int64_t model_param_bytes() const { return model_param_bytes_; }
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  void start_exchange(const void* send, const std::vector<int>& send_counts, const std::vector<int>& send_displs,
                      void* recv, const std::vector<int>& recv_counts, const std::vector<int>& recv_displs) override;
  void finish_exchange() override;

  void before_step(int64_t) override {
    counting_ = true;
    bytes_ = 0;
    wait_ms_ = 0;
  }
  void after_step(int64_t) override {
    counting_ = false;
    step_bytes_ = bytes_;
    step_wait_ms_ = wait_ms_;
  }
  // A pipeline's re-cut (after the step's hooks, before its line): this group, built with the new
  // stages, reports the step `from` counted.
  void carry_step(const MpiExpertGroup& from) {
    step_bytes_ = from.step_bytes_;
    step_wait_ms_ = from.step_wait_ms_;
  }
  void add_step_fields(double, nlohmann::json& line) override {
    line["expert_alltoall_bytes"] = step_bytes_;
    line["expert_wait_ms"] = step_wait_ms_;
    line["param_bytes"] = param_bytes_;
    line["model_param_bytes"] = model_param_bytes_;
  }

 private:
  Communicator& comm_;
  Communicator::Request request_;
  bool counting_ = false;
  int64_t bytes_ = 0, step_bytes_ = 0;
  double wait_ms_ = 0, step_wait_ms_ = 0;
  int64_t param_bytes_ = 0, model_param_bytes_ = 0;
};

// The squared gradient norm of the whole model on a rank holding its share of the routed experts
// (after the gradient sum): the chunks of no expert (the same on every rank) once, the expert
// chunks summed over `experts` (the expert group). Replicas are counted at home. Collective.
double expert_grad_squares(const ChunkStore& store, Communicator& experts);

}  // namespace keel
