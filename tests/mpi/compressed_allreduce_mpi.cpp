// Compressed sums over real MPI ranks (run by mpirun with 1..4 ranks, see tests/CMakeLists.txt):
// every codec's CompressedAllreduce equals the decode-then-sum reference that each rank computes
// from everyone's inputs, bit for bit, on every rank; error-feedback residuals are what the
// encodings lost; the same call twice gives the same bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/compressed_allreduce.h"
#include "core/rng.h"

namespace keel {
namespace {

std::vector<float> input(int rank, size_t n, uint64_t salt) {
  Rng rng(1000 + 17 * static_cast<uint64_t>(rank) + salt);
  std::vector<float> x(n);
  for (float& v : x) v = static_cast<float>(rng.normal()) * (1.0f + static_cast<float>(rank));
  return x;
}

// What CompressedAllreduce must produce, computed locally from every rank's input and the same
// seeds (mirrors the algorithm described in compressed_allreduce.h with zero residuals).
std::vector<float> reference(const Codec& codec, bool dense, int world, size_t n, uint64_t seed, uint64_t salt) {
  auto mix = [](uint64_t s, uint64_t a, uint64_t b) {
    uint64_t x = s ^ (a * 0x9E3779B97F4A7C15ull) ^ (b * 0xC2B2AE3D27D4EB4Full);
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    return x ^ (x >> 29);
  };
  std::vector<uint8_t> enc;
  std::vector<float> scratch, out(n, 0.0f);
  if (!dense) {
    for (int r = 0; r < world; ++r) {
      std::vector<float> x = input(r, n, salt), res(n, 0.0f);
      encode_with_feedback(codec, x.data(), res.data(), n, mix(seed, r, 0), enc, scratch);
      codec.decode_add(enc.data(), enc.size(), n, out.data());
    }
    return out;
  }
  for (int j = 0; j < world; ++j) {
    const size_t b = n * j / world, len = n * (j + 1) / world - b;
    std::vector<float> sum(len, 0.0f);
    for (int r = 0; r < world; ++r) {
      std::vector<float> x = input(r, n, salt), res(len, 0.0f);
      encode_with_feedback(codec, x.data() + b, res.data(), len, mix(seed, r, j), enc, scratch);
      codec.decode_add(enc.data(), enc.size(), len, sum.data());
    }
    std::vector<float> res(len, 0.0f);
    encode_with_feedback(codec, sum.data(), res.data(), len, mix(seed, j, world), enc, scratch);
    codec.decode_add(enc.data(), enc.size(), len, out.data() + b);
  }
  return out;
}

// The codecs under test, blocks of 64: sparsifying ones keep 5 % (quant2-topk also dense, keep 1:
// it then sums shard by shard in the two-phase shape).
std::unique_ptr<Codec> make_codec(const CodecParams& param) {
  CodecParams p = param;
  p.block = 64;
  return Codec::make(p);
}

class CompressedAllreduceMpi : public ::testing::TestWithParam<CodecParams> {};

TEST_P(CompressedAllreduceMpi, EqualsDecodeThenSumOnEveryRank) {
  Communicator& comm = Communicator::world();
  const std::unique_ptr<Codec> codec = make_codec(GetParam());
  const CodecParams& p = codec->params();
  for (SumShape shape : {SumShape::two_phase, SumShape::gather})
  for (size_t n : {size_t{1}, size_t{5}, size_t{1000}, size_t{40003}}) {
    CompressedAllreduce sum(comm, *codec, n, shape);
    std::vector<float> data = input(comm.rank(), n, n);
    const uint64_t seed = 42 + n;
    sum.start(data.data(), seed);
    while (!sum.test()) {
    }
    const std::vector<float> want = reference(*codec, sum.two_phase(), comm.size(), n, seed, n);
    ASSERT_EQ(0, std::memcmp(want.data(), data.data(), n * sizeof(float))) << codec_name(p.kind) << " n=" << n;
    // Worker residual: what this rank's encoding lost (exactly zero for the lossless codec).
    double lost = 0;
    for (float r : sum.worker_residual()) lost += std::abs(r);
    if (codec->lossless()) {
      EXPECT_EQ(lost, 0.0);
    }
    // Every rank holds the same bytes.
    uint64_t h = 1469598103934665603ull;
    for (float v : data) {
      uint32_t b;
      std::memcpy(&b, &v, 4);
      h = (h ^ b) * 1099511628211ull;
    }
    EXPECT_EQ(comm.allreduce_max(static_cast<double>(h >> 12)), static_cast<double>(h >> 12)) << "ranks differ";
    EXPECT_GT(sum.stats().raw_bytes, 0);
    // Two-phase compressed sums put fewer bytes on the wire than float32 would (ring all-reduce: 2 (N-1)/N).
    // Gather sends every rank's whole encoding to each other rank.
    if (comm.size() > 1 && !codec->lossless() && n >= 1000 && sum.two_phase()) {
      EXPECT_LT(sum.stats().wire_bytes, sum.stats().raw_bytes * 2.0 * (comm.size() - 1) / comm.size());
    }
    if (!sum.two_phase()) {
      EXPECT_EQ(sum.stats().wire_bytes, static_cast<double>(codec->max_encoded_bytes(n)) * (comm.size() - 1));
    }
  }
}

// GradSync keeps several buckets in flight, and each moves to its second phase whenever its first
// completes on that rank. On duplicate communicators (one per sum) the sums stay independent
// however differently the ranks interleave them; here odd ranks progress them in reverse order
// and every rank waits a rank-dependent while between tests.
TEST_P(CompressedAllreduceMpi, ManySumsInFlightOnDuplicateCommunicatorsStayIndependent) {
  Communicator& world = Communicator::world();
  const std::unique_ptr<Codec> codec = make_codec(GetParam());
  const CodecParams& p = codec->params();
  const std::vector<size_t> sizes = {3000, 17, 5000, 1, 2048, 999};
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<CompressedAllreduce>> sums;
  std::vector<std::vector<float>> data;
  for (size_t i = 0; i < sizes.size(); ++i) {
    comms.push_back(world.duplicate());
    sums.push_back(std::make_unique<CompressedAllreduce>(*comms.back(), *codec, sizes[i]));
    data.push_back(input(world.rank(), sizes[i], 100 + i));
  }
  for (size_t i = 0; i < sizes.size(); ++i) sums[i]->start(data[i].data(), 7 + i);
  std::vector<bool> done(sizes.size(), false);
  size_t remaining = sizes.size();
  for (int round = 0; remaining > 0; ++round) {
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t i = world.rank() % 2 == 1 ? sizes.size() - 1 - k : k;
      if (!done[i] && sums[i]->test()) {
        done[i] = true;
        remaining--;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20 * (world.rank() + 1) * static_cast<int>(i + 1)));
    }
    ASSERT_LT(round, 10000000) << "sums never completed";
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::vector<float> want = reference(*codec, sums[i]->two_phase(), world.size(), sizes[i], 7 + i, 100 + i);
    ASSERT_EQ(0, std::memcmp(want.data(), data[i].data(), sizes[i] * sizeof(float)))
        << codec_name(p.kind) << " sum " << i;
  }
}

TEST_P(CompressedAllreduceMpi, ResidualsCarryWhatWasLostIntoTheNextSum) {
  Communicator& comm = Communicator::world();
  CodecParams p = GetParam();
  if (p.keep < 1.0) p.keep = 0.1;
  const std::unique_ptr<Codec> codec = Codec::make(p);
  const size_t n = 2000;
  CompressedAllreduce sum(comm, *codec, n);
  // Over many steps the decoded sums plus what is still held in residuals (worker residuals of
  // every rank, server residuals of every shard) add up to the sum of all inputs.
  std::vector<double> total_in(n, 0.0), total_out(n, 0.0);
  for (int step = 0; step < 50; ++step) {
    std::vector<float> x = input(comm.rank(), n, 7 + step);
    std::vector<float> all_in = x;
    comm.allreduce_sum(all_in.data(), n);
    for (size_t i = 0; i < n; ++i) total_in[i] += all_in[i];
    sum.start(x.data(), static_cast<uint64_t>(step));
    sum.wait();
    for (size_t i = 0; i < n; ++i) total_out[i] += x[i];
  }
  std::vector<float> held(n, 0.0f);
  for (size_t i = 0; i < n; ++i) held[i] = sum.worker_residual()[i];
  if (sum.two_phase()) {
    const size_t b = n * comm.rank() / comm.size();
    for (size_t i = 0; i < sum.server_residual().size(); ++i) held[b + i] += sum.server_residual()[i];
  }
  comm.allreduce_sum(held.data(), n);
  double worst = 0, scale = 0;
  for (size_t i = 0; i < n; ++i) {
    worst = std::max(worst, std::abs(total_out[i] + held[i] - total_in[i]));
    scale = std::max(scale, std::abs(total_in[i]));
  }
  EXPECT_LT(worst, 1e-3 * std::max(1.0, scale)) << codec_name(p.kind);
}

INSTANTIATE_TEST_SUITE_P(Codecs, CompressedAllreduceMpi,
                         ::testing::Values(CodecParams{CodecKind::none, 1.0}, CodecParams{CodecKind::fp16, 1.0},
                                           CodecParams{CodecKind::bf16, 1.0}, CodecParams{CodecKind::sign1, 1.0},
                                           CodecParams{CodecKind::quant2_topk, 0.05}, CodecParams{CodecKind::quant2_topk, 1.0},
                                           CodecParams{CodecKind::topk, 0.05}, CodecParams{CodecKind::randk, 0.05}),
                         [](const auto& info) {
                           std::string name = codec_name(info.param.kind);
                           std::replace(name.begin(), name.end(), '-', '_');
                           return info.param.keep < 1.0 && info.param.kind == CodecKind::quant2_topk ? name + "_sparse" : name;
                         });

}  // namespace
}  // namespace keel
