#include "comm/expert_parallel.h"

#include <chrono>

#include "core/error.h"
#include "model/gpt.h"
#include "model/moe.h"
#include "optim/adamw.h"
#include "store/placement.h"

namespace keel {

void MpiExpertGroup::start_exchange(const void* send, const std::vector<int>& send_counts,
                                    const std::vector<int>& send_displs, void* recv,
                                    const std::vector<int>& recv_counts, const std::vector<int>& recv_displs) {
  check(request_.done, "expert group: an exchange started while another is in flight");
  if (counting_) {
    for (int c : send_counts) bytes_ += c;
  }
  request_ = comm_.ialltoallv(static_cast<const uint8_t*>(send), send_counts, send_displs, static_cast<uint8_t*>(recv),
                              recv_counts, recv_displs);
}

void MpiExpertGroup::finish_exchange() {
  const auto start = std::chrono::steady_clock::now();
  comm_.wait(request_);
  if (counting_) wait_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

bool experts_sharded(const Config& config) {
  const ParallelConfig& p = config.parallel;
  if (!config.model.moe() || p.expert <= 1) return false;
  if (p.zero == 0) return true;
  // ZeRO shares the experts' chunks out over their holders (comm/zero.h; ZeRO-3 their parameters
  // too, comm/sharded_params.h), also with tensor groups (a holder's chunks are its tensor shard
  // of its experts): on one stage or on each stage of a pipeline (ZeRO-1/2 also with gradient
  // prediction: a rank predicts its own store's gradients, its experts' as without ZeRO; a re-cut
  // moves an expert's chunks between the ranks of one replica and its moments from their owner
  // among the holders: pipeline/stage_migration.h; ZeRO-3 takes no re-cuts), with or without
  // memory copies (each rank's copy is of its own store, its moments' span; with tensor groups of
  // its whole copy, comm/tensor_parallel.h WholeModelState), ZeRO-3 also with memory tiers (they
  // home the rank's own chunks: ChunkStore::param_homed); with bf16 training state likewise (its
  // masters those of the owned chunks, store/bf16_state.h; under ZeRO-3 gathers move the owners'
  // bits over the holders; under ZeRO-1/2 memory tiers move the moments, the bits and masters stay
  // outside them), on one stage or on each stage of a pipeline (bf16 state takes no re-cuts or
  // gradient prediction, nor tensor groups with a mixture of experts: validate_bf16_state_config,
  // which the line below restates for a config not yet validated).
  const bool bf16_state = config.runtime.param_dtype != StateDtype::fp32 || config.runtime.grad_dtype != StateDtype::fp32;
  return !(bf16_state && p.tensor > 1);
}

void attach_expert_group(GPT& model, ExpertGroup& group) {
  for (int l = 0; l < model.num_layers(); ++l) {
    if (MoeFeedForward* moe = model.holds_any({l}) ? model.layer(l).moe() : nullptr) moe->set_expert_group(&group);
  }
}

void gather_experts_with_layers(GPT& model) {
  for (int l = 0; l < model.num_layers(); ++l) {
    if (MoeFeedForward* moe = model.holds_any({l}) ? model.layer(l).moe() : nullptr) moe->lease_whole_layer();
  }
}

bool experts_gathered_with_layers(const Config& config, int data_ranks) {
  if (!config.model.moe() || config.parallel.zero != 3 || data_ranks < 2) return false;
  if (experts_gathered_apart(config, data_ranks)) return false;
  return !(experts_sharded(config) && experts_held_alone(config.parallel, data_ranks));
}

bool experts_gathered_apart(const Config& config, int data_ranks) {
  if (!config.model.moe() || config.parallel.zero != 3 || data_ranks < 2) return false;
  if (config.tier.experts != TierExperts::by_frequency) return false;
  return !(experts_sharded(config) && experts_held_alone(config.parallel, data_ranks));
}

std::unique_ptr<MpiExpertHolders> gather_experts_apart(GPT& model, const Config& config, Communicator& dp) {
  const int P = experts_sharded(config) ? config.parallel.expert : 1;
  auto holders = std::make_unique<MpiExpertHolders>(P > 1 ? dp.split(dp.rank() % P, dp.rank() / P) : dp.duplicate());
  for (int l = 0; l < model.num_layers(); ++l) {
    if (MoeFeedForward* moe = model.holds_any({l}) ? model.layer(l).moe() : nullptr) moe->gather_experts_apart(holders.get());
  }
  return holders;
}

double expert_grad_squares(const ChunkStore& store, Communicator& experts) {
  double others = 0, mine = 0;
  for (const Chunk& c : store.chunks()) (c.expert >= 0 ? mine : others) += grad_sum_squares(store, c.id, c.id + 1);
  return others + experts.allreduce_sum(mine);
}

}  // namespace keel
