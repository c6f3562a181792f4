// The communicators of a data x pipeline x tensor mesh, built once at start-up. World rank =
// (replica * P + pipeline rank) * T + tensor rank: a tensor group's ranks are consecutive (one
// host, where its all-reduces of every layer are cheapest), a replica's stages are consecutive
// tensor groups. Without a pipeline and tensor groups the data-parallel group is the world itself.
#pragma once

#include <algorithm>
#include <memory>

#include "comm/communicator.h"

namespace keel {

class ProcessGroups {
 public:
  // `pipeline`: stages per replica (P); `tensor`: ranks per tensor group (T). Every rank of `world`
  // calls it (it splits communicators).
  ProcessGroups(Communicator& world, int pipeline, int tensor = 1) : world_(world) {
    pipeline = std::max(1, pipeline);
    tensor = std::max(1, tensor);
    if (pipeline == 1 && tensor == 1) return;
    const int rank = world.rank();
    const int q = rank / tensor, t = rank % tensor;  // q: the tensor group's index (replica * P + stage)
    dp_ = world.split((q % pipeline) * tensor + t, q / pipeline);
    if (pipeline > 1) pp_ = world.split((q / pipeline) * tensor + t, q % pipeline);
    if (tensor > 1) tp_ = world.split(q, t);
  }
  Communicator& world() { return world_; }
  // This rank's data-parallel group: the world, or the ranks holding the same stage and tensor shard.
  Communicator& dp() { return dp_ ? *dp_ : world_; }
  // This rank's replica's stages, of its tensor shard (requires a pipeline).
  Communicator& pp() { return *pp_; }
  bool pipelined() const { return pp_ != nullptr; }
  // This rank's tensor group (the ranks sharing its layers' shards); null without tensor parallelism.
  Communicator* tp() { return tp_.get(); }
  int tensor_size() const { return tp_ ? tp_->size() : 1; }

 private:
  Communicator& world_;
  std::unique_ptr<Communicator> dp_, pp_, tp_;
};

}  // namespace keel
