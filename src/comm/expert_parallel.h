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
// First version: every rank still holds the whole block's parameters (all experts), so
// checkpoints, ZeRO-1/2 and resuming on another P are those of plain data parallelism; a rank
// writes weight gradients for its own experts only (the others' stay zero), and the data-parallel
// all-reduce sums each expert's over the ranks that ran it. What it does not give yet: less
// memory or less gradient traffic per rank (the experts' parameters are not sharded).
#pragma once

#include <cstdint>

#include "comm/communicator.h"
#include "core/metrics_source.h"
#include "core/step_hook.h"
#include "model/expert_group.h"

namespace keel {

// Metrics: `expert_alltoall_bytes`, the bytes this rank sent in the expert group's exchanges during
// the step's passes (its own rows included), and `expert_wait_ms`, the time it spent blocked
// finishing them (what the work between start and finish did not hide, and the wait for the
// group's slowest rank), counted from before_step to after_step.
class MpiExpertGroup final : public ExpertGroup, public MetricsSource, public StepHook {
 public:
  explicit MpiExpertGroup(Communicator& comm) : comm_(comm) {}
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
  void add_step_fields(double, nlohmann::json& line) override {
    line["expert_alltoall_bytes"] = step_bytes_;
    line["expert_wait_ms"] = step_wait_ms_;
  }

 private:
  Communicator& comm_;
  Communicator::Request request_;
  bool counting_ = false;
  int64_t bytes_ = 0, step_bytes_ = 0;
  double wait_ms_ = 0, step_wait_ms_ = 0;
};

}  // namespace keel
