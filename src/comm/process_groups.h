// The communicators of a data x pipeline grid. World rank = replica * P + pipeline rank: a
// replica's stages are consecutive ranks. Without a pipeline the data-parallel group is the
// world itself.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace keel {

class ProcessGroups {
 public:
  // `pipeline`: ranks per replica (P). Every rank of `world` calls it (it splits communicators).
  ProcessGroups(Communicator& world, int pipeline) : world_(world) {
    if (pipeline <= 1) return;
    const int rank = world.rank();
    dp_ = world.split(rank % pipeline, rank / pipeline);
    pp_ = world.split(rank / pipeline, rank % pipeline);
  }
  Communicator& world() { return world_; }
  // This rank's data-parallel group: the world, or its stage's replicas.
  Communicator& dp() { return dp_ ? *dp_ : world_; }
  // This rank's replica's stages (requires a pipeline).
  Communicator& pp() { return *pp_; }
  bool pipelined() const { return pp_ != nullptr; }

 private:
  Communicator& world_;
  std::unique_ptr<Communicator> dp_, pp_;
};

}  // namespace keel
