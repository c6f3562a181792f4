#include "comm/compressed_allreduce.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>

#include "core/clock.h"
#include "core/error.h"

namespace keel {

namespace {

// Distinct, reproducible seeds per (call seed, rank, shard).
uint64_t mix(uint64_t seed, uint64_t a, uint64_t b) {
  uint64_t x = seed ^ (a * 0x9E3779B97F4A7C15ull) ^ (b * 0xC2B2AE3D27D4EB4Full);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

int as_int(size_t bytes) {
  check(bytes <= static_cast<size_t>(std::numeric_limits<int>::max()), "compressed sync: bucket too large for one MPI call");
  return static_cast<int>(bytes);
}

}  // namespace

CompressedAllreduce::CompressedAllreduce(Communicator& comm, const Codec& codec, size_t n, SumShape shape)
    : comm_(comm), codec_(codec), n_(n), rank_(comm.rank()), world_(comm.size()) {
  // Codecs whose positions do not depend on the data can be summed shard by shard; the others
  // (topk, sparse quant2-topk) gather, and so does randk (each rank's payload is a few values).
  const bool shardable = !codec.data_dependent_positions() && codec.kind() != CodecKind::randk;
  two_phase_ = shardable && (shape == SumShape::two_phase || (shape == SumShape::automatic && world_ > 2));
  worker_residual_.assign(n, 0.0f);
  const size_t w = static_cast<size_t>(world_);
  if (two_phase_) {
    shard_begin_.resize(w + 1);
    for (size_t r = 0; r <= w; ++r) shard_begin_[r] = n * r / w;
    shard_bytes_.resize(w);
    for (size_t r = 0; r < w; ++r) shard_bytes_[r] = as_int(codec.max_encoded_bytes(shard_begin_[r + 1] - shard_begin_[r]));
    server_residual_.assign(shard_begin_[rank_ + 1] - shard_begin_[rank_], 0.0f);
    // All-to-all: shard j's encoding goes to rank j; this rank receives every rank's encoding of
    // its own shard, all of the same size.
    send_counts_ = shard_bytes_;
    send_displs_.assign(w, 0);
    for (size_t j = 1; j < w; ++j) send_displs_[j] = send_displs_[j - 1] + send_counts_[j - 1];
    send_.resize(static_cast<size_t>(send_displs_[w - 1] + send_counts_[w - 1]));
    exchange_counts_.assign(w, shard_bytes_[rank_]);
    exchange_displs_.assign(w, 0);
    for (size_t j = 1; j < w; ++j) exchange_displs_[j] = exchange_displs_[j - 1] + exchange_counts_[j - 1];
  }
}

void CompressedAllreduce::start(float* data, uint64_t seed) {
  check(phase_ == Phase::idle, "compressed sync: start() while the previous sum is in flight");
  data_ = data;
  seed_ = seed;
  stats_.raw_bytes += static_cast<double>(n_) * sizeof(float);
  const auto t0 = std::chrono::steady_clock::now();
  const size_t w = static_cast<size_t>(world_);
  if (two_phase_) {
    for (size_t j = 0; j < w; ++j) {
      const size_t b = shard_begin_[j], len = shard_begin_[j + 1] - b;
      encode_with_feedback(codec_, data + b, worker_residual_.data() + b, len, mix(seed, rank_, j), encoded_, scratch_);
      check(encoded_.size() == static_cast<size_t>(send_counts_[j]), "compressed sync: encoded size differs from its bound");
      std::memcpy(send_.data() + send_displs_[j], encoded_.data(), encoded_.size());
    }
    stats_.encode_ms += ms_since(t0);
    for (size_t j = 0; j < w; ++j) {
      if (static_cast<int>(j) != rank_) stats_.wire_bytes += send_counts_[j];
    }
    recv_.resize(static_cast<size_t>(shard_bytes_[rank_]) * w);
    request_ = comm_.ialltoallv(send_.data(), send_counts_, send_displs_, recv_.data(), exchange_counts_,
                                exchange_displs_);
    phase_ = Phase::exchange;
  } else {
    encode_with_feedback(codec_, data, worker_residual_.data(), n_, mix(seed, rank_, 0), encoded_, scratch_);
    stats_.encode_ms += ms_since(t0);
    const int bytes = as_int(encoded_.size());
    recv_counts_.assign(w, bytes);  // every rank's encoding of n values has the same size
    recv_displs_.assign(w, 0);
    for (size_t j = 1; j < w; ++j) recv_displs_[j] = recv_displs_[j - 1] + bytes;
    recv_.resize(static_cast<size_t>(bytes) * w);
    stats_.wire_bytes += static_cast<double>(bytes) * (world_ - 1);
    request_ = comm_.iallgatherv(encoded_.data(), recv_.data(), recv_counts_, recv_displs_);
    phase_ = Phase::gather;
  }
}

void CompressedAllreduce::after_exchange() {
  // This rank owns shard `rank_`: sum every rank's encoding of it, in rank order, then encode
  // the sum with the server-side residual and all-gather the encoded sums.
  const auto t0 = std::chrono::steady_clock::now();
  const size_t w = static_cast<size_t>(world_);
  const size_t len = shard_begin_[rank_ + 1] - shard_begin_[rank_];
  sum_.assign(len, 0.0f);
  for (size_t i = 0; i < w; ++i) {
    codec_.decode_add(recv_.data() + exchange_displs_[i], static_cast<size_t>(exchange_counts_[i]), len, sum_.data());
  }
  const auto t1 = std::chrono::steady_clock::now();
  stats_.decode_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
  encode_with_feedback(codec_, sum_.data(), server_residual_.data(), len, mix(seed_, rank_, w), encoded_, scratch_);
  stats_.encode_ms += ms_since(t1);
  std::vector<int> displs(w, 0);
  for (size_t j = 1; j < w; ++j) displs[j] = displs[j - 1] + shard_bytes_[j - 1];
  recv_counts_ = shard_bytes_;
  recv_displs_ = displs;
  recv_.resize(static_cast<size_t>(displs[w - 1] + shard_bytes_[w - 1]));
  stats_.wire_bytes += static_cast<double>(encoded_.size()) * (world_ - 1);
  request_ = comm_.iallgatherv(encoded_.data(), recv_.data(), recv_counts_, recv_displs_);
  phase_ = Phase::gather;
}

void CompressedAllreduce::finish() {
  const auto t0 = std::chrono::steady_clock::now();
  std::fill(data_, data_ + n_, 0.0f);
  const size_t w = static_cast<size_t>(world_);
  for (size_t j = 0; j < w; ++j) {
    if (two_phase_) {
      const size_t b = shard_begin_[j], len = shard_begin_[j + 1] - b;
      codec_.decode_add(recv_.data() + recv_displs_[j], static_cast<size_t>(recv_counts_[j]), len, data_ + b);
    } else {
      codec_.decode_add(recv_.data() + recv_displs_[j], static_cast<size_t>(recv_counts_[j]), n_, data_);
    }
  }
  stats_.decode_ms += ms_since(t0);
  phase_ = Phase::idle;
  data_ = nullptr;
}

bool CompressedAllreduce::test() {
  if (phase_ == Phase::exchange && comm_.test(request_)) after_exchange();
  if (phase_ == Phase::gather && comm_.test(request_)) finish();
  return phase_ == Phase::idle;
}

void CompressedAllreduce::wait() {
  if (phase_ == Phase::exchange) {
    comm_.wait(request_);
    after_exchange();
  }
  if (phase_ == Phase::gather) {
    comm_.wait(request_);
    finish();
  }
}

}  // namespace keel
