// A compressed sum over data-parallel ranks of one buffer (a gradient bucket), non-blocking, with
// error feedback, in two shapes (HybridGC):
//
//  * two-phase (dense codecs: none, fp16, bf16, sign1, quant2-topk at keep 1), 1-bit Adam's
//    compressed all-reduce: the buffer is cut into one shard per rank; every rank encodes each shard (adding its worker residual) and an
//    all-to-all sends shard j to rank j; rank j decodes the N encodings of its shard, sums them
//    in rank order, encodes the sum (adding its server residual) and an all-gather gives every
//    rank every encoded sum, which it decodes into the buffer. Each rank sends about
//    2 (N-1)/N x the encoded size, like a ring all-reduce of the encoded bytes.
//  * gather (every codec): every rank encodes the whole buffer (adding its worker residual), an
//    all-gather gives everyone every encoding, and each rank decodes them into the zeroed buffer
//    in rank order. Each rank sends (N-1) x its encoding. The sum is decoded from the ranks' own
//    encodings, with no second lossy step: on 2 ranks it sends the same bytes as two-phase and
//    loses less (a sum of two 1-bit encodings has three levels; its re-encoding has two).
//
// SumShape::automatic takes two-phase for dense codecs on more than 2 ranks, gather otherwise.
//
// Everything is deterministic for a given world size, layout and seed: every rank ends with the
// same bytes. Progress happens in test() (called between layers during backward) and wait().
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "comm/codec.h"
#include "comm/communicator.h"

namespace keel {

struct CompressionStats {
  double raw_bytes = 0;    // float32 bytes summed (this rank's buffer)
  double wire_bytes = 0;   // bytes this rank sent
  double encode_ms = 0;
  double decode_ms = 0;
};

// (SumShape: core/config.h, sync.shape.)

class CompressedAllreduce {
 public:
  // A sum of `n` floats over comm's ranks with `codec` (which must outlive this object). A sparse
  // codec (topk, quant2-topk with keep < 1, randk) always uses the gather shape.
  CompressedAllreduce(Communicator& comm, const Codec& codec, size_t n, SumShape shape = SumShape::automatic);

  // Starts summing data[0 .. n) over ranks; data is overwritten with the (decoded) sum once
  // test() returns true or wait() returns. `seed` drives the codec's random choices (the same on
  // every rank; ranks mix in their own rank). Requires the previous sum to be complete.
  void start(float* data, uint64_t seed);
  bool test();  // drives progress; true when complete
  void wait();
  bool active() const { return phase_ != Phase::idle; }

  bool two_phase() const { return two_phase_; }
  // Error-feedback state (per rank; saved in checkpoints): what encoding lost so far. The worker
  // residual covers the whole buffer; the server residual only this rank's shard (two-phase).
  std::span<float> worker_residual() { return worker_residual_; }
  std::span<float> server_residual() { return server_residual_; }
  std::span<const float> worker_residual() const { return worker_residual_; }
  std::span<const float> server_residual() const { return server_residual_; }
  const CompressionStats& stats() const { return stats_; }
  void reset_stats() { stats_ = CompressionStats{}; }

 private:
  enum class Phase { idle, exchange, gather };
  void after_exchange();
  void finish();

  Communicator& comm_;
  const Codec& codec_;
  size_t n_;
  bool two_phase_;
  int rank_, world_;
  std::vector<size_t> shard_begin_;   // two-phase: rank r's shard is [shard_begin_[r], shard_begin_[r + 1])
  std::vector<int> shard_bytes_;      // two-phase: encoded size of each rank's shard
  std::vector<float> worker_residual_, server_residual_, scratch_, sum_;
  std::vector<uint8_t> send_, recv_, encoded_;
  std::vector<int> send_counts_, send_displs_;
  std::vector<int> exchange_counts_, exchange_displs_;  // two-phase: every rank's encoding of this rank's shard
  std::vector<int> recv_counts_, recv_displs_;          // the all-gather in flight
  float* data_ = nullptr;
  uint64_t seed_ = 0;
  Phase phase_ = Phase::idle;
  Communicator::Request request_;
  CompressionStats stats_;
};

}  // namespace keel
