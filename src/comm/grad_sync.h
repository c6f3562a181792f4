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
//
// Compressed sync (HybridGC): given a codec per chunk, buckets are cut where the codec or the layer
// changes, and each bucket whose codec is lossy or narrower than float32 is summed by a
// CompressedAllreduce (with its own error-feedback residuals) instead of MPI's all-reduce; it is
// driven by the same tests between layers. Buckets whose codec is none keep MPI's all-reduce.
// During the first `warmup_steps` steps every bucket is summed uncompressed.
//
// Expert parallelism with sharded experts (`expert_group` = P > 1): a rank holds only its share
// of the routed experts (model/model_layout.h ExpertPlace), so a bucket never mixes an expert's
// chunks (Chunk::expert) with others, and an expert bucket is summed only over the data/P ranks
// holding the same experts (data rank % P equal: a communicator split from the data group);
// none when data == P. Every other bucket over the whole group, as before. Under ZeRO-2 each
// bucket is reduce-scattered over the same group (comm/zero.h: the partition shares the expert
// chunks out over their holders apart from the rest). With a codec an
// expert bucket is compressed over those ranks, with its own residuals, keyed also by its first
// expert and the holders' count (":X<expert>/<ranks>"): saved for other experts, never restored.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/codec.h"
#include "comm/communicator.h"
#include "comm/compressed_allreduce.h"
#include "comm/zero.h"
#include "core/backward_observer.h"
#include "core/sync_stats.h"
#include "store/bf16_state.h"
#include "store/chunk_store.h"

namespace keel {

struct GradSyncOptions {
  int64_t bucket_bytes = 8 << 20;
  // Reduce-scatter to these owners (ZeRO-2) instead of all-reducing (not with codecs).
  const ChunkPartition* scatter_to = nullptr;
  // The codec of each chunk (index = chunk id); empty = no compression.
  std::vector<CodecParams> codecs;
  uint64_t seed = 0;       // drives the codecs' random choices (with the step and the bucket)
  int warmup_steps = 0;    // steps before compression starts
  SumShape shape = SumShape::automatic;
  // Layers where a bucket must start: no bucket holds chunks of layers on both sides of one
  // (a dual encoder's towers, so that a tower's buckets can be held alone: set_held).
  std::vector<int> cut_layers;
  // Gradients held in bf16 (runtime.grad_dtype, store/bf16_state.h): buckets are summed on their
  // bf16 bits in place (half the bytes), without leasing float32 pages. Not with codecs.
  Bf16State* bf16 = nullptr;
  // parallel.expert with sharded experts (with a reduce-scatter: scatter_to shares the experts
  // out apart, ChunkPartition::experts_apart); 1: none.
  int expert_group = 1;
};

class GradSync final : public BackwardObserver {
 public:
  GradSync(Communicator& comm, ChunkStore& store, GradSyncOptions options);
  ~GradSync() override;

  // Starts the backward pass of optimizer step `step` (0-based). With sync false (an accumulation
  // micro-batch that is not the last) nothing is communicated.
  void begin(bool sync, int64_t step = 0);
  // Layers whose gradients are not synced (by layer id; missing or 0 = synced): from the next
  // begin() until set again, a bucket whose layers are all held is neither sent nor waited for
  // (a dual encoder's tower off its update cadence: every rank holds the same layers, and their
  // gradients are left as each rank's backward wrote them).
  void set_held(std::vector<char> held_by_layer) { held_ = std::move(held_by_layer); }
  void after_backward_input(int layer) override;
  void after_backward_weight(int layer) override;
  // Waits for every bucket. Afterwards the grad plane holds the sum over ranks.
  void finish();
  const SyncStats& stats() const { return stats_; }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  int num_compressed_buckets() const;
  bool compression_configured() const { return !options_.codecs.empty(); }

  // Error-feedback state of this rank (every compressed bucket's worker then server residual, in
  // bucket order), for checkpoints; and a description of the layout it belongs to (world size,
  // buckets, codecs): residuals saved under another layout cannot be restored.
  size_t residual_size() const;
  void copy_residuals(std::vector<float>& out) const;
  // With memory tiers, buckets in flight pin their gradient pages: at most this many bytes of
  // them (0 = no limit); a bucket that would exceed it first waits for the oldest to complete.
  void limit_in_flight(int64_t bytes) { max_in_flight_bytes_ = bytes; }
  void restore_residuals(std::span<const float> in);
  std::string residual_layout() const;

  // The residuals keyed by what they cover rather than where their bucket lies in the flat space:
  // "L<layer>[r]#<k>:<worker>+<server>:<codec>/<keep>/<block>:D<ranks>" names the k-th bucket of
  // a layer's chunks (r: of a replica tensor's), the sizes of its worker and server residual, its
  // codec and the data-parallel ranks. Compressed buckets are cut per layer, so a layer's buckets
  // have the same keys under any pipeline cut: a re-cut (pipeline/stage_migration.h) and a resume
  // under another cut carry residuals by key, between ranks of the same data-parallel rank.
  struct ResidualPart {
    int layer = 0;
    bool replica = false;
    std::string key;
    std::vector<float> values;  // worker residual, then server residual
  };
  std::string residual_keys() const;  // ';'-joined, in copy_residuals' order
  std::vector<ResidualPart> residual_parts() const;
  // The parts of a flat residual (copy_residuals) saved with `keys`; throws keel::Error when they
  // do not describe it.
  static std::vector<ResidualPart> split_residuals(const std::string& keys, std::span<const float> flat);
  // Moves in every part whose key is one of this sync's buckets; returns how many buckets it filled.
  int restore_residual_parts(std::vector<ResidualPart>& parts);

 private:
  struct Bucket {
    int64_t offset = 0, numel = 0;
    int ready_layer = 0;  // the bucket is complete once W of this layer is done
    int layer = 0;        // with compression configured, buckets hold chunks of one layer
    bool replica = false;  // ... of a replica tensor (a pipeline's copy of a tied tensor)
    int index = 0;         // among the buckets of its layer (and replica flag), in backward order
    int top_layer = 0;     // the highest layer of its chunks (ready_layer is the lowest)
    bool held_now = false;  // not synced this step (set_held)
    bool expert = false;    // a routed expert's chunks: summed over expert_replicas_
    CodecParams codec;
    std::unique_ptr<Codec> codec_impl;            // lossy codecs only
    std::unique_ptr<Communicator> comm;           // its own: its phases start at rank-dependent moments
    std::unique_ptr<CompressedAllreduce> reducer;  // lossy codecs only
    bool compressed_now = false;                   // this step goes through reducer
    Communicator::Request request;
    int64_t own_offset = 0, own_count = 0;  // reduce-scatter: where this rank's sum belongs
    bool settled = true;                    // complete, and (reduce-scatter) its result in place
    PageLease lease;                        // with memory tiers: its gradient pages, pinned in flight
    // Elements of no tensor (alignment padding in and between its chunks): a block codec's
    // decoded sum puts values there, which are cleared so that they never feed the next step's
    // block scales (and ZeRO-1, which clears others' shards whole, gives the same bytes).
    std::vector<std::pair<int64_t, int64_t>> gaps;  // [begin, end) flat offsets
  };
  std::string key_of(const Bucket& b) const;
  void progress();
  void settle(Bucket& b);
  void complete(Bucket& b);

  Communicator& comm_;
  // The data ranks holding this rank's experts (expert_group > 1 and data > P), else null.
  std::unique_ptr<Communicator> expert_replicas_;
  Communicator& comm_of(const Bucket& b) { return b.expert && expert_replicas_ ? *expert_replicas_ : comm_; }
  ChunkStore& store_;
  GradSyncOptions options_;
  const ChunkPartition* scatter_to_;
  Bf16State* bf16_ = nullptr;  // bf16 gradients: buckets summed on their bits
  std::vector<Bucket> buckets_;  // in backward order
  int64_t step_ = 0;
  size_t next_ = 0;              // next bucket to start
  int64_t max_in_flight_bytes_ = 0;
  bool active_ = false;
  std::vector<char> held_;
  bool held(int layer) const { return layer >= 0 && layer < static_cast<int>(held_.size()) && held_[layer] != 0; }
  SyncStats stats_;
  std::chrono::steady_clock::time_point first_start_;
};

}  // namespace keel
