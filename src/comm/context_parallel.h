// Context parallelism (parallel.context = C) as a component: the context group over MPI for the
// layers (model/context_group.h) and the configuration it takes (and what it refuses, in one line).
//
// Layout: world = data x pipeline x context x tensor, tensor innermost, context inside data
// (comm/process_groups.h). The ranks of a context group share their data rank's sequences, each
// holding 2 of every sequence's 2C chunks; their gradients are partial sums over the same
// sequences, so the data-parallel group (gradient sync, ZeRO's shards, the loss's mean) spans
// data x context, exactly as if the group's ranks were data ranks of T / C-token sequences.
#pragma once

#include <string>

#include "comm/communicator.h"
#include "core/config.h"
#include "model/context_group.h"

namespace keel {

class MpiContextGroup final : public ContextGroup {
 public:
  explicit MpiContextGroup(Communicator& comm) : comm_(comm) {}
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  void start_shift(const float* send, float* recv, int64_t count, int channel) override;
  void finish_shift(int channel) override;
  void allreduce_sum(double* values, int64_t count) override { comm_.allreduce_sum(values, static_cast<size_t>(count)); }

 private:
  Communicator& comm_;
  Communicator::Request sends_[2], recvs_[2];
};

// Throws keel::Error, one line naming the key, when `c` asks for context parallelism it cannot
// run: a sequence length the group cannot cut into 2C equal chunks, dense attention, a model or a
// combination not built yet (each refused, never silently run otherwise).
void validate_context_parallel_config(const Config& c, int world_size);

}  // namespace keel
