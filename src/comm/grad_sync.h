// Data-parallel gradient synchronisation, overlapped with backward. The gradient plane is cut
// into buckets of consecutive chunks (about `bucket_bytes` each), ordered as backward produces
// them: last layers first. As soon as the W pass of every chunk in a bucket is done, the bucket's
// all-reduce starts (non-blocking); every later B or W of backward tests the outstanding
// requests, which is what drives MPI's progress, so communication runs under the remaining
// computation. finish() waits for what is left; that wait is the communication overlap did not
// hide. With a ZeRO-2 partition, each bucket is reduce-scattered instead: a rank ends up with the
// summed gradient of the chunks it owns only. As soon as a bucket's reduce-scatter completes, the
// part of it this rank does not own is zeroed and its pages go back to the operating system, so
// a rank holds its own gradient shard plus the buckets in flight, not the whole gradient.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <vector>

#include "comm/communicator.h"
#include "comm/zero.h"
#include "model/gpt.h"
#include "store/chunk_store.h"

namespace keel {

struct SyncStats {
  double payload_bytes = 0;     // gradient bytes all-reduced by this rank this step
  double sent_bytes = 0;        // bytes this rank puts on the wire (ring all-reduce: 2 (N-1)/N payload)
  double exposed_ms = 0;        // time finish() waited on this rank
  // Over all ranks (set by the trainer): the least wait is communication that backward did not
  // hide (the last rank to finish backward waits only for the transfer); the spread between the
  // most and least wait is time ranks spent waiting for a slower peer.
  double exposed_min_ms = 0;
  double imbalance_ms = 0;
  double latency_ms = 0;        // first bucket started -> last bucket completed
  int buckets = 0;
};

class GradSync final : public BackwardObserver {
 public:
  // `scatter_to` (may be null): reduce-scatter to these owners (ZeRO-2) instead of all-reducing.
  GradSync(Communicator& comm, ChunkStore& store, int64_t bucket_bytes, const ChunkPartition* scatter_to = nullptr);

  // Starts a backward pass. With sync false (an accumulation micro-batch that is not the last)
  // nothing is communicated.
  void begin(bool sync);
  void after_backward_input(int layer) override;
  void after_backward_weight(int layer) override;
  // Waits for every bucket. Afterwards the grad plane holds the sum over ranks.
  void finish();
  const SyncStats& stats() const { return stats_; }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }

 private:
  struct Bucket {
    int64_t offset = 0, numel = 0;
    int ready_layer = 0;  // the bucket is complete once W of this layer is done
    Communicator::Request request;
    int64_t own_offset = 0, own_count = 0;  // reduce-scatter: where this rank's sum belongs
    bool settled = true;                    // complete, and (reduce-scatter) its result in place
  };
  void progress();
  void settle(Bucket& b);

  Communicator& comm_;
  ChunkStore& store_;
  const ChunkPartition* scatter_to_;
  std::vector<Bucket> buckets_;  // in backward order
  size_t next_ = 0;              // next bucket to start
  bool active_ = false;
  SyncStats stats_;
  std::chrono::steady_clock::time_point first_start_;
};

}  // namespace keel
