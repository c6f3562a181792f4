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
  // of its experts): on one stage or on each stage of a pipeline without gradient prediction (a
  // re-cut moves an expert's chunks between the ranks of one replica and its moments from their
  // owner among the holders: pipeline/stage_migration.h; ZeRO-3 takes no re-cuts), with or
  // without memory copies (each rank's copy is of its own store, its moments' span; with tensor
  // groups of its whole copy, comm/tensor_parallel.h WholeModelState), ZeRO-3 without memory
  // tiers; with bf16 training state (its masters those of the owned chunks,
  // store/bf16_state.h) under ZeRO-1/2 on one stage without tensor groups, with or without memory
  // tiers (the bits and masters stay outside them). Elsewhere every rank holds every expert.
  const bool bf16_state = config.runtime.param_dtype != StateDtype::fp32 || config.runtime.grad_dtype != StateDtype::fp32;
  if (bf16_state && (p.zero == 3 || p.pipeline > 1 || p.tensor > 1)) return false;
  if (p.zero == 3 && tiering_enabled(config.tier)) return false;
  return p.pipeline == 1 || p.predict_gradients == PredictGradients::off;
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

double expert_grad_squares(const ChunkStore& store, Communicator& experts) {
  double others = 0, mine = 0;
  for (const Chunk& c : store.chunks()) (c.expert >= 0 ? mine : others) += grad_sum_squares(store, c.id, c.id + 1);
  return others + experts.allreduce_sum(mine);
}

}  // namespace keel
