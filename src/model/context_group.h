// The context group as the layers see it (parallel.context = C): the C ranks that share each
// sequence of a batch. The sequence of T tokens is cut into 2C chunks of T / 2C; rank r holds
// chunks r and 2C-1-r, in that order, as its T / C rows (an early and a late chunk: under causal
// attention every rank then has the same work). Token-wise layers run on those rows unchanged;
// attention meets the other ranks' keys and values by passing blocks around the ring
// (model/context_attention.h). The model reaches MPI only through this interface
// (comm/context_parallel.h implements it over a Communicator).
#pragma once

#include <cstdint>

namespace keel {

class ContextGroup {
 public:
  virtual ~ContextGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // The ring's shift, non-blocking: sends send[0 .. count) to rank + 1 and receives the same count
  // from rank - 1 into recv (which must not overlap send), on channel `channel` (0 or 1: two
  // shifts may be in flight at once, one per channel). Collective: every rank of the group starts
  // the same shifts in the same order. finish_shift(channel) returns when both are done.
  virtual void start_shift(const float* send, float* recv, int64_t count, int channel) = 0;
  virtual void finish_shift(int channel) = 0;
  // Sums values[0 .. count) over the group, in place (a mixture of experts' per-sequence counts).
  // Collective: every rank of the group calls it in the same order.
  virtual void allreduce_sum(double* values, int64_t count) = 0;

  // The global position of local row t of a sequence whose rank-local rows number `rows` (T / C),
  // for the ring's member `member` (default: this rank).
  int position(int t, int rows) const { return position(t, rows, rank()); }
  int position(int t, int rows, int member) const {
    const int chunk = rows / 2;
    return t < chunk ? member * chunk + t : (2 * size() - 1 - member) * chunk + (t - chunk);
  }
};

}  // namespace keel
