// Gradient codecs for HybridGC: compressed data-parallel gradient sync with error feedback. A
// codec turns n floats into bytes and back; the compressed collectives (a separate layer) move the
// bytes between ranks, and each rank decodes every rank's contribution into one buffer, which sums
// them. Codecs are pure functions of their input: no MPI, no OpenMP, no global state.
//
// Every encoding is self-describing and checkable: a 32-byte header, then the payload. Its size
// depends only on (kind, params, n), never on the data or the seed, so a collective can size its
// buffers before encoding. Everything is little-endian; k is the count of values carried.
//   header       u8 kind, u8 format version (2), u16 0, u32 block (sign1, quant2-topk; else 0),
//                u64 n, u64 k, u64 seed (randk, sparsified sign1; else 0)
//   none         f32[n]
//   fp16, bf16   u16[n]: IEEE binary16 / bfloat16, round to nearest even
//   sign1        f32 scale per block of `block` kept values (mean |v| of the block), then 1 bit per
//                kept value (1 = negative; value i is bit i % 8 of byte i / 8); decodes as +-scale.
//                keep < 1: the kept values are at sample_positions(n, k, seed)
//   quant2-topk  u32[k] positions of topk (none when k == n: dense 2-bit), then per block of
//                `block` kept values two f32 magnitudes lo <= hi (fitted by 2-means on |v|, see
//                codec.cpp), then 2 bits per value (value j: bits 2 (j % 4) of byte j / 4):
//                codes 0..3 decode as -hi, -lo, +lo, +hi (the sign, then the nearer magnitude)
//   topk         u32[k] positions of the k largest |x| (ties: lower position), ascending; f32[k]
//   randk        f32[k]: the values at sample_positions(n, k, seed)
// Random sparsification is not rescaled (by 1/keep or n/k): the rescaled, unbiased versions are
// not contractions (||v - decode(v)||^2 can exceed ||v||^2), which error feedback needs to keep
// its residual bounded; with error feedback what is dropped is sent later instead.
//
// Random choices come only from the caller's seed, through a sampler that calls no libm function,
// so the same (x, n, seed) gives the same bytes on every machine and every decoder draws the same
// positions. Ranks that use the same seed for a bucket keep the same positions, so their randk
// payloads could be summed without decoding.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"

namespace keel {

static_assert(std::endian::native == std::endian::little, "codec formats are little-endian");

// (CodecKind: core/config.h, the names sync.codec spells.)
// The codec's name as configs spell it: "none", "fp16", "bf16", "sign1", "quant2-topk", "topk",
// "randk".
const char* codec_name(CodecKind kind);
// The inverse of codec_name. Throws keel::Error naming config key `key`, the value and the valid names.
CodecKind parse_codec(const std::string& name, const std::string& key = "sync.codec");

struct CodecParams {
  CodecKind kind = CodecKind::none;
  // Fraction of the elements kept, in (0, 1]: k = min(n, max(1, ceil(keep * n))) values per
  // encoding. topk, quant2_topk: the k largest |x|. randk: k positions drawn from the seed. sign1:
  // keep < 1 adds random sparsification to k positions drawn from the seed (1 = dense). Ignored
  // by none, fp16 and bf16.
  double keep = 1.0;
  // sign1, quant2_topk: consecutive kept values that share one scale (>= 1). Ignored by the others.
  int block = 256;
};

// Number of values a sparsifying codec keeps of n: min(n, max(1, ceil(keep * n))); 0 when n = 0.
size_t codec_keep_count(size_t n, double keep);

// The k distinct positions of [0, n) drawn from `seed`, ascending, uniformly among all k-subsets
// (Floyd's algorithm over a bitmap, drawing from keel::Rng(seed) without libm, so every machine
// draws the same). randk keeps these positions; so does sign1 with keep < 1. Requires
// k <= n < 2^32, else throws keel::Error. Costs O(min(k, n - k) + n / 64).
void sample_positions(size_t n, size_t k, uint64_t seed, std::vector<uint32_t>& positions);

class Codec {
 public:
  // Size in bytes of the header that starts every encoding.
  static constexpr size_t kHeaderBytes = 32;

  // The codec `p` describes. Throws keel::Error unless keep is in (0, 1] and block >= 1.
  static std::unique_ptr<Codec> make(const CodecParams& p);
  virtual ~Codec() = default;

  virtual CodecKind kind() const = 0;
  // The params it was made with.
  const CodecParams& params() const { return params_; }
  // True for none only: decode(encode(x)) == x bit for bit.
  virtual bool lossless() const = 0;
  // True when the kept positions depend on the data (topk, quant2_topk with keep < 1): ranks keep
  // different positions, so a shard of one rank's encoding cannot be summed with another's, and
  // the collective must gather whole encodings.
  bool data_dependent_positions() const {
    return (params_.kind == CodecKind::topk || params_.kind == CodecKind::quant2_topk) && params_.keep < 1.0;
  }
  // The size of every encoding of n elements (exact: sizes do not depend on the data).
  virtual size_t max_encoded_bytes(size_t n) const = 0;

  // Encodes x[0..n) into `out`, resized to max_encoded_bytes(n). Random choices come only from
  // `seed` (stored in the encoding, so the decoder needs no position list); codecs that draw
  // nothing store 0 and give the same bytes for every seed. Codecs that store positions (topk,
  // quant2_topk) and randomly sparsified ones (randk, sign1 with keep < 1) require n < 2^32;
  // otherwise throws keel::Error. Not-a-numbers and infinities in x are carried as such where
  // the format can (none, fp16, bf16, topk, randk) and otherwise poison their block's scale.
  // Thread-safe: concurrent calls on one codec are fine.
  virtual void encode(const float* x, size_t n, uint64_t seed, std::vector<uint8_t>& out) const = 0;

  // Decodes in[0..bytes), an encoding of n elements made by a codec of the same kind and params,
  // and ADDS the values into y[0..n): decoding several ranks' encodings into one buffer sums them.
  // Throws keel::Error naming what is wrong if the encoding is truncated or too long, of another
  // kind, params or n, or holds positions out of range or out of order; it never reads outside
  // in[0..bytes) nor writes outside y[0..n), and leaves y unchanged when it throws. Thread-safe.
  virtual void decode_add(const uint8_t* in, size_t bytes, size_t n, float* y) const = 0;

 protected:
  explicit Codec(const CodecParams& p) : params_(p) {}
  CodecParams params_;
};

// Error feedback (EF-SGD, 1-bit Adam): encodes v = x + residual into `out`, then leaves in
// `residual` what the encoding lost, residual = v - decode(encode(v)), to be added to the next
// step's gradient; so over any number of steps, the sum of what was decoded plus the residual
// equals the sum of the inputs (to float rounding). For a lossless codec the residual is set to
// zero. `scratch` is working memory, reused between calls to avoid allocation. residual may not
// alias x.
void encode_with_feedback(const Codec& c, const float* x, float* residual, size_t n, uint64_t seed,
                          std::vector<uint8_t>& out, std::vector<float>& scratch);

// Scalar conversions of the fp16 and bf16 codecs, branch-free so that loops over them vectorize.

// IEEE binary16, round to nearest even: overflow (|f| >= 65520) gives +-inf, tiny values give
// subnormals or +-0, NaN gives a quiet NaN of the same sign.
inline uint16_t float_to_half(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7FFFFFFFu;
  // Normal: rebias the exponent (127 -> 15) and round off 13 mantissa bits, ties to even; a carry
  // moves into the exponent, which is correct, and everything from 65520 up clamps to inf.
  uint32_t normal = (a - 0x38000000u + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  normal = normal < 0x7C00u ? normal : 0x7C00u;
  // Below 2^-14: adding 0.5f, whose ulp is 2^-24 (the half subnormal step), rounds |f| to a
  // multiple of 2^-24, nearest even; the added mantissa bits are the subnormal's bits (1024 at
  // 2^-14 is exactly the smallest normal).
  const uint32_t subnormal = std::bit_cast<uint32_t>(std::bit_cast<float>(a) + 0.5f) - 0x3F000000u;
  uint32_t h = a < 0x38800000u ? subnormal : normal;
  h = a > 0x7F800000u ? 0x7E00u : h;
  return static_cast<uint16_t>(h | sign);
}

// The float value of an IEEE binary16 (exact; a signalling NaN comes back quiet).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t a = static_cast<uint32_t>(h & 0x7FFFu);
  // Normal, inf and NaN: move exponent and mantissa into place with the exponent 112 too high
  // times 2^112, then scale by 2^-112 (exact; exponent 31 lands on 255, inf or NaN).
  const float normal = std::bit_cast<float>((a << 13) + 0x70000000u) * 0x1.0p-112f;
  // Subnormal: the mantissa as the low bits of 0.5 + m 2^-24, minus 0.5 (exact).
  const float subnormal = std::bit_cast<float>(a | 0x3F000000u) - 0.5f;
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(a < 0x0400u);  // all ones or zero
  return std::bit_cast<float>(sign | (std::bit_cast<uint32_t>(subnormal) & is_subnormal) |
                              (std::bit_cast<uint32_t>(normal) & ~is_subnormal));
}

// bfloat16 (the top half of a float), round to nearest even; overflow gives +-inf, NaN a quiet NaN.
inline uint16_t float_to_bfloat16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  const uint32_t nan = (x >> 16) | 0x0040u;
  return static_cast<uint16_t>((x & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

// The float value of a bfloat16 (exact).
inline float bfloat16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

}  // namespace keel
