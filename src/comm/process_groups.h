// The communicators of a data x pipeline x context x tensor mesh, built once at start-up. World
// rank = ((replica * P + pipeline rank) * Cx + context rank) * T + tensor rank: a tensor group's
// ranks are consecutive (one host, where its all-reduces of every layer are cheapest), a context
// group's are consecutive tensor groups (its ring's neighbours next to each other), a replica's
// stages are consecutive context groups. The data-parallel group spans data x context: a context
// group's ranks hold the same parameters and their gradients are partial sums over the same
// sequences (comm/context_parallel.h). Without a pipeline, context and tensor groups the
// data-parallel group is the world itself.
#pragma once

#include <algorithm>
#include <memory>

#include "comm/communicator.h"

namespace keel {

class ProcessGroups {
 public:
  // `pipeline`: stages per replica (P); `tensor`: ranks per tensor group (T); `context`: ranks per
  // context group (Cx). Every rank of `world` calls it (it splits communicators).
  // `expert`: ranks per expert group (parallel.expert), consecutive ranks of the data-parallel group,
  // whose order is replica-major, context rank minor: with expert = context an expert group is a
  // context group (the ranks holding chunks of the same sequences), with more it spans replicas.
  ProcessGroups(Communicator& world, int pipeline, int tensor = 1, int context = 1, int expert = 1) : world_(world) {
    pipeline = std::max(1, pipeline);
    tensor = std::max(1, tensor);
    context = std::max(1, context);
    if (pipeline > 1 || tensor > 1 || context > 1) {
      const int rank = world.rank();
      const int q = rank / tensor, t = rank % tensor;  // q: the tensor group's index
      const int c = q % context, s = q / context;      // s: the context group's index (replica * P + stage)
      const int stage = s % pipeline, replica = s / pipeline;
      dp_ = world.split(stage * tensor + t, replica * context + c);
      if (pipeline > 1) pp_ = world.split((replica * context + c) * tensor + t, stage);
      if (tensor > 1) tp_ = world.split(q, t);
      if (context > 1) cp_ = world.split(s * tensor + t, c);
    }
    if (expert > 1) ep_ = dp().split(dp().rank() / expert, dp().rank() % expert);
  }
  Communicator& world() { return world_; }
  // This rank's data-parallel group: the world, or the ranks holding the same stage and tensor
  // shard (every context rank of every replica).
  Communicator& dp() { return dp_ ? *dp_ : world_; }
  // This rank's replica's stages, of its tensor shard (requires a pipeline).
  Communicator& pp() { return *pp_; }
  bool pipelined() const { return pp_ != nullptr; }
  // This rank's tensor group (the ranks sharing its layers' shards); null without tensor parallelism.
  Communicator* tp() { return tp_.get(); }
  int tensor_size() const { return tp_ ? tp_->size() : 1; }
  // This rank's context group (the ranks sharing its sequences); null without context parallelism.
  Communicator* cp() { return cp_.get(); }
  int context_size() const { return cp_ ? cp_->size() : 1; }
  int context_rank() const { return cp_ ? cp_->rank() : 0; }
  // This rank's expert group (the data-parallel ranks its tokens' experts are dealt out over);
  // null without expert parallelism.
  Communicator* ep() { return ep_.get(); }

 private:
  Communicator& world_;
  std::unique_ptr<Communicator> dp_, pp_, tp_, cp_, ep_;
};

}  // namespace keel
