// The expert group as a mixture-of-experts block sees it (parallel.expert): the ranks over which
// the routed experts are dealt out, rank r holding experts r E / size .. (r + 1) E / size - 1.
// The block reaches MPI only through this interface (comm/expert_parallel.h implements it over a
// Communicator); a block without one (nullptr) runs every expert itself.
#pragma once

#include <cstdint>
#include <vector>

namespace keel {

class ExpertGroup {
 public:
  virtual ~ExpertGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // An all-to-all of bytes: send[send_displs[j] .. + send_counts[j]) goes to rank j, rank j's
  // part lands at recv[recv_displs[j] ..). start_exchange returns at once (the buffers belong to
  // the exchange until finish_exchange returns); one exchange at a time. Collective: every rank
  // of the group starts and finishes the same exchanges in the same order.
  virtual void start_exchange(const void* send, const std::vector<int>& send_counts,
                              const std::vector<int>& send_displs, void* recv, const std::vector<int>& recv_counts,
                              const std::vector<int>& recv_displs) = 0;
  virtual void finish_exchange() = 0;
};

// ZeRO-3 with several holders of each routed expert (comm/expert_parallel.h gather_experts_apart):
// the ranks holding the same experts as this one (with an expert group the data-parallel ranks at
// the same place in theirs, without one the whole data group), over which a block agrees on the
// experts any of them routed rows to before it gathers them one at a time.
class ExpertHolders {
 public:
  virtual ~ExpertHolders() = default;
  // Sums `data` [count] over the holders in place. Collective: every holder calls it alike.
  virtual void allreduce_sum(float* data, int64_t count) = 0;
};

}  // namespace keel
