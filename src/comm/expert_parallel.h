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
// gathers the chunks of no expert over the data group and the rank's experts' over their holders
// (with data == P on one stage the layer's lease takes the chunks of no expert only, and the
// block leases its experts apart, as without ZeRO-3: experts_gathered_with_layers; with experts
// homed by routing share elsewhere, the holders agree on the experts any of them routed rows to
// and gather those apart, one at a time: experts_gathered_apart).
// In a pipeline each stage's replicas share out the stage's experts so (ZeRO-1/2/3; a ZeRO-1/2
// re-cut moves an expert's chunks within its replica and its moments from their owner among the
// holders), with tensor groups (also in a pipeline, under ZeRO-1/2/3 and with memory copies)
// each rank's chunks are its tensor shard of its experts (holders: the data ranks with the same
// expert and tensor rank), with bf16 training state (ZeRO-1/2/3, on one stage or in a pipeline;
// ZeRO-3 gathers the owners' bf16 bits over the holders) a rank's masters are its owned chunks',
// under ZeRO-3 with memory tiers the tiers home a rank's own chunks only (its shard of the chunks
// of no expert and of its experts': ChunkStore::param_homed), with gradient prediction in a
// pipeline (ZeRO-1/2) a rank predicts its own store's gradients. bf16 training state takes no
// tensor groups; there (a config that validation refuses) every rank would hold every expert: a
// rank writes weight gradients for its own experts only, the data-parallel sum adds each expert's
// over the ranks that ran it, and ZeRO shards the experts' chunks over the data group as the rest.
#pragma once

#include <cstdint>
#include <memory>

#include "comm/communicator.h"
#include "core/metrics_source.h"
#include "core/step_hook.h"
#include "model/expert_group.h"
#include "core/config.h"
#include "store/chunk_store.h"

namespace keel {

class GPT;

// Whether a rank holds only its share of the routed experts: parallel.expert > 1 without ZeRO;
// under ZeRO (0-3) with float32 or bf16 training state, on one stage or in a pipeline (ZeRO-1/2
// also with gradient prediction, parallel.predict_gradients), with or without memory copies
// (checkpoint.memory_every), memory tiers or tensor groups (parallel.tensor > 1; bf16 training
// state takes none).
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
// Whether ZeRO-3 over `data_ranks` gathers a MoE block's experts with its layer
// (gather_experts_with_layers): yes, but where each rank is the only holder of its experts
// (sharded experts with data = P, no pipeline: ZeRO-3 homes their chunks on it whole and never
// broadcasts them), where a block leases only its experts that rows were sent to, one at a time,
// as without ZeRO-3, and the layer's gather brings the chunks of no expert alone (the tiers'
// expert pages then follow the routing); and no where the blocks gather their experts apart
// (experts_gathered_apart).
bool experts_gathered_with_layers(const Config& config, int data_ranks);
// Whether ZeRO-3 over `data_ranks` gathers a MoE block's experts apart from its layer, one at a
// time and only those some holder routed rows to (gather_experts_apart): where several ranks hold
// each expert (experts_gathered_with_layers would gather them with the layer) and the experts are
// homed by routing share (tier.experts = "by_frequency": with memory tiers, where nothing is
// broadcast ahead, so the layer's gather loses no overlap by leaving the experts out). Then the
// tiers' expert pages follow the routing there too.
bool experts_gathered_apart(const Config& config, int data_ranks);

// The holders of a rank's experts over MPI (model/expert_group.h ExpertHolders): its own
// communicator, so that its sums never interleave with other collectives.
class MpiExpertHolders final : public ExpertHolders {
 public:
  explicit MpiExpertHolders(std::unique_ptr<Communicator> comm) : comm_(std::move(comm)) {}
  void allreduce_sum(float* data, int64_t count) override { comm_->allreduce_sum(data, static_cast<size_t>(count)); }

 private:
  std::unique_ptr<Communicator> comm_;
};
// ZeRO-3 where experts_gathered_apart: the holders of this rank's experts among `dp` (the data
// group, or a stage's replicas: with sharded experts the ranks at the same place in their expert
// groups, as comm/sharded_params.h broadcasts their chunks over; else all of them), handed to every
// MoE block of `model` (MoeFeedForward::gather_experts_apart). Collective over `dp`.
std::unique_ptr<MpiExpertHolders> gather_experts_apart(GPT& model, const Config& config, Communicator& dp);

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
