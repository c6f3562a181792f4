#include "comm/codec.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace keel {
namespace {

// Header layout (little-endian): u8 kind, u8 format version, u16 zero, u32 block (0 where the
// codec has none), u64 n, u64 count of values carried (k), u64 seed (0 where nothing is drawn).
constexpr uint8_t kFormatVersion = 2;  // 2: quant2-topk's fitted levels, no positions when dense
constexpr CodecKind kLastKind = CodecKind::randk;

template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
void store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

uint32_t float_bits(float f) { return std::bit_cast<uint32_t>(f); }

// Working memory of encode/decode, per thread so that one codec can serve several threads.
struct Scratch {
  std::vector<uint32_t> histogram, members, positions;
  std::vector<uint64_t> bitmap;
  std::vector<float> values;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Sum of |v[0..len)| in a fixed order (eight running sums, then a fixed tree), so the result is the
// same bytes whether or not the compiler vectorizes it.
float sum_abs(const float* v, size_t len) {
  float lane[8] = {};
  size_t i = 0;
  for (; i + 8 <= len; i += 8)
    for (int j = 0; j < 8; ++j) lane[j] += std::fabs(v[i + j]);
  float sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; i < len; ++i) sum += std::fabs(v[i]);
  return sum;
}

// The k positions of the largest |x[i]| (NaN counts as largest), ascending; among equal |x| the
// lower positions win. Magnitudes compare as integers (the float bits without the sign: the same
// order, and a total one even with NaN). A histogram of their top 16 bits finds the bin that holds
// the k-th largest; std::nth_element over that bin's few members finds the threshold; one pass
// in index order then takes everything above it and the first of those equal to it.
void select_topk(const float* x, size_t n, size_t k, std::vector<uint32_t>& positions) {
  positions.resize(k);
  if (k == n) {
    std::iota(positions.begin(), positions.end(), 0u);
    return;
  }
  if (k == 0) return;
  Scratch& s = scratch();
  std::vector<uint32_t>& hist = s.histogram;
  hist.assign(0x8000, 0);
  for (size_t i = 0; i < n; ++i) ++hist[(float_bits(x[i]) & 0x7FFFFFFFu) >> 16];
  size_t above = 0;  // elements in bins above `bin`
  uint32_t bin = 0x7FFF;
  while (above + hist[bin] < k) above += hist[bin--];
  std::vector<uint32_t>& members = s.members;
  members.clear();
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = float_bits(x[i]) & 0x7FFFFFFFu;
    if ((key >> 16) == bin) members.push_back(key);
  }
  const auto nth = members.end() - static_cast<std::ptrdiff_t>(k - above);
  std::nth_element(members.begin(), nth, members.end());
  const uint32_t threshold = *nth;
  for (auto it = nth + 1; it != members.end(); ++it) above += *it > threshold;
  size_t ties = k - above;  // how many of the elements equal to the threshold are kept
  positions.resize(k + 1);  // one spare slot: the pass below writes before it decides
  uint32_t* out = positions.data();
  size_t m = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = float_bits(x[i]) & 0x7FFFFFFFu;
    const bool equal = key == threshold;
    const bool take = key > threshold || (equal && ties != 0);
    out[m] = static_cast<uint32_t>(i);
    m += take;
    ties -= equal && take;
  }
  positions.resize(k);
}

// Common to every codec: the header, its checks, and the size formula.
class FormatCodec : public Codec {
 public:
  explicit FormatCodec(const CodecParams& p) : Codec(p) {}
  CodecKind kind() const override { return params_.kind; }
  bool lossless() const override { return params_.kind == CodecKind::none; }
  size_t max_encoded_bytes(size_t n) const override { return kHeaderBytes + payload_bytes(count(n), n); }

 protected:
  // Values an encoding of n elements carries.
  virtual size_t count(size_t n) const = 0;
  // Payload bytes for k carried values of n.
  virtual size_t payload_bytes(size_t k, size_t n) const = 0;
  // Whether encode draws from the seed (else the header's seed is 0).
  virtual bool draws() const { return false; }
  virtual uint32_t header_block() const { return 0; }

  // Sizes `out` and writes the header; returns the payload's start.
  uint8_t* begin_encoding(size_t n, uint64_t seed, std::vector<uint8_t>& out) const {
    const size_t k = count(n);
    out.resize(kHeaderBytes + payload_bytes(k, n));
    uint8_t* p = out.data();
    store<uint8_t>(p, static_cast<uint8_t>(kind()));
    store<uint8_t>(p + 1, kFormatVersion);
    store<uint16_t>(p + 2, 0);
    store<uint32_t>(p + 4, header_block());
    store<uint64_t>(p + 8, n);
    store<uint64_t>(p + 16, k);
    store<uint64_t>(p + 24, draws() ? seed : 0);
    return p + kHeaderBytes;
  }

  // Throws keel::Error("gradient codec <name>: <why>").
  [[noreturn]] void fail(const std::string& why) const {
    throw Error(std::string("gradient codec ") + codec_name(kind()) + ": " + why);
  }

  void check_index_range(size_t n) const {
    if (n > UINT32_MAX) fail(std::to_string(n) + " elements, fewer than 2^32 allowed (positions are 32-bit)");
  }

  // Checks that in[0..bytes) is an encoding this codec made of n elements; returns its seed.
  uint64_t check_encoding(const uint8_t* in, size_t bytes, size_t n) const {
    if (bytes < kHeaderBytes)
      fail("truncated encoding: " + std::to_string(bytes) + " bytes, shorter than the " + std::to_string(kHeaderBytes) +
           "-byte header");
    const uint8_t kind_byte = load<uint8_t>(in);
    if (kind_byte > static_cast<uint8_t>(kLastKind))
      fail("not a codec encoding: unknown kind byte " + std::to_string(kind_byte));
    if (kind_byte != static_cast<uint8_t>(kind()))
      fail(std::string("given a ") + codec_name(static_cast<CodecKind>(kind_byte)) + " encoding, expected " + codec_name(kind()));
    const uint8_t version = load<uint8_t>(in + 1);
    if (version != kFormatVersion)
      fail("encoding format version " + std::to_string(version) + ", expected " + std::to_string(kFormatVersion));
    if (load<uint16_t>(in + 2) != 0) fail("malformed header (reserved bytes not zero)");
    const uint64_t enc_n = load<uint64_t>(in + 8);
    if (enc_n != n) fail("encoding holds " + std::to_string(enc_n) + " elements, expected " + std::to_string(n));
    const uint32_t block = load<uint32_t>(in + 4);
    if (block != header_block())
      fail("encoding has block " + std::to_string(block) + ", this codec " + std::to_string(header_block()) +
           " (codec params differ between ranks?)");
    const uint64_t k = load<uint64_t>(in + 16);
    if (k != count(n))
      fail("encoding carries " + std::to_string(k) + " values of " + std::to_string(n) + ", this codec keeps " +
           std::to_string(count(n)) + " (keep differs between ranks?)");
    const size_t expected = max_encoded_bytes(n);
    if (bytes != expected)
      fail("encoding of " + std::to_string(n) + " elements is " + std::to_string(bytes) + " bytes, expected " +
           std::to_string(expected) + (bytes < expected ? " (truncated)" : " (trailing bytes)"));
    const uint64_t seed = load<uint64_t>(in + 24);
    if (!draws() && seed != 0) fail("malformed header (seed set for a codec that draws nothing)");
    return seed;
  }

  // Checks that the k stored positions at p are ascending and below n.
  void check_positions(const uint8_t* p, size_t k, size_t n) const {
    int64_t prev = -1;
    for (size_t j = 0; j < k; ++j) {
      const int64_t pos = load<uint32_t>(p + 4 * j);
      if (pos <= prev || pos >= static_cast<int64_t>(n))
        fail("malformed encoding: position " + std::to_string(pos) + " at entry " + std::to_string(j) +
             " is out of range or order (n = " + std::to_string(n) + ")");
      prev = pos;
    }
  }
};

class NoneCodec final : public FormatCodec {
 public:
  using FormatCodec::FormatCodec;
  void encode(const float* x, size_t n, uint64_t seed, std::vector<uint8_t>& out) const override {
    uint8_t* p = begin_encoding(n, seed, out);
    if (n > 0) std::memcpy(p, x, 4 * n);
  }
  void decode_add(const uint8_t* in, size_t bytes, size_t n, float* y) const override {
    check_encoding(in, bytes, n);
    const uint8_t* p = in + kHeaderBytes;
    for (size_t i = 0; i < n; ++i) y[i] += load<float>(p + 4 * i);
  }

 protected:
  size_t count(size_t n) const override { return n; }
  size_t payload_bytes(size_t k, size_t /*n*/) const override { return 4 * k; }
};

// fp16 or bf16, chosen by the template argument.
template <bool kBfloat>
class HalfCodec final : public FormatCodec {
 public:
  using FormatCodec::FormatCodec;
  void encode(const float* x, size_t n, uint64_t seed, std::vector<uint8_t>& out) const override {
    uint8_t* p = begin_encoding(n, seed, out);
    for (size_t i = 0; i < n; ++i) store<uint16_t>(p + 2 * i, kBfloat ? float_to_bfloat16(x[i]) : float_to_half(x[i]));
  }
  void decode_add(const uint8_t* in, size_t bytes, size_t n, float* y) const override {
    check_encoding(in, bytes, n);
    const uint8_t* p = in + kHeaderBytes;
    for (size_t i = 0; i < n; ++i) {
      const uint16_t h = load<uint16_t>(p + 2 * i);
      y[i] += kBfloat ? bfloat16_to_float(h) : half_to_float(h);
    }
  }

 protected:
  size_t count(size_t n) const override { return n; }
  size_t payload_bytes(size_t k, size_t /*n*/) const override { return 2 * k; }
};

// sign1 (formats: see codec.h). Kept values are not rescaled by 1/keep: see codec.h.
class Sign1Codec final : public FormatCodec {
 public:
  using FormatCodec::FormatCodec;
  void encode(const float* x, size_t n, uint64_t seed, std::vector<uint8_t>& out) const override {
    if (sparse()) check_index_range(n);
    const size_t k = count(n);
    uint8_t* p = begin_encoding(n, seed, out);
    const float* v = x;
    if (sparse()) {
      Scratch& s = scratch();
      sample_positions(n, k, seed, s.positions);
      s.values.resize(k);
      for (size_t j = 0; j < k; ++j) s.values[j] = x[s.positions[j]];
      v = s.values.data();
    }
    const size_t block = static_cast<size_t>(params_.block);
    uint8_t* scales = p;
    uint8_t* bits = p + 4 * ceil_div(k, block);
    for (size_t b = 0, first = 0; first < k; ++b, first += block) {
      const size_t len = std::min(block, k - first);
      store<float>(scales + 4 * b, sum_abs(v + first, len) / static_cast<float>(len));
    }
    size_t i = 0;
    for (; i + 64 <= k; i += 64) {
      uint64_t word = 0;
      for (uint32_t t = 0; t < 64; ++t) word |= static_cast<uint64_t>(float_bits(v[i + t]) >> 31) << t;
      store<uint64_t>(bits + i / 8, word);
    }
    for (; i < k; i += 8) {
      uint32_t byte = 0;
      for (uint32_t t = 0; t < 8 && i + t < k; ++t) byte |= (float_bits(v[i + t]) >> 31) << t;
      bits[i / 8] = static_cast<uint8_t>(byte);
    }
  }

  void decode_add(const uint8_t* in, size_t bytes, size_t n, float* y) const override {
    const uint64_t seed = check_encoding(in, bytes, n);
    const size_t k = count(n);
    if (!sparse()) {
      decode_values(in + kHeaderBytes, k, [y](size_t i, float v) { y[i] += v; });
      return;
    }
    std::vector<uint32_t>& positions = scratch().positions;
    sample_positions(n, k, seed, positions);
    const uint32_t* pos = positions.data();
    decode_values(in + kHeaderBytes, k, [y, pos](size_t i, float v) { y[pos[i]] += v; });
  }

 protected:
  bool sparse() const { return params_.keep < 1.0; }
  size_t count(size_t n) const override { return sparse() ? codec_keep_count(n, params_.keep) : n; }
  size_t payload_bytes(size_t k, size_t /*n*/) const override {
    return 4 * ceil_div(k, static_cast<size_t>(params_.block)) + ceil_div(k, 8);
  }
  bool draws() const override { return sparse(); }
  uint32_t header_block() const override { return static_cast<uint32_t>(params_.block); }

 private:
  // Calls emit(i, value i) for the k values of the payload at p.
  template <class Emit>
  void decode_values(const uint8_t* p, size_t k, Emit emit) const {
    const size_t block = static_cast<size_t>(params_.block);
    const uint8_t* bits = p + 4 * ceil_div(k, block);
    for (size_t b = 0, first = 0; first < k; ++b, first += block) {
      const uint32_t scale = float_bits(load<float>(p + 4 * b));
      const size_t end = std::min(k, first + block);
      const auto one = [&](size_t i) {
        const uint32_t sign = static_cast<uint32_t>((bits[i >> 3] >> (i & 7)) & 1u) << 31;
        emit(i, std::bit_cast<float>(scale ^ sign));
      };
      size_t i = first;
      for (; i < end && (i & 7) != 0; ++i) one(i);
      for (; i + 8 <= end; i += 8) {  // whole bytes
        const uint32_t byte = bits[i >> 3];
        for (uint32_t t = 0; t < 8; ++t) emit(i + t, std::bit_cast<float>(scale ^ (((byte >> t) & 1u) << 31)));
      }
      for (; i < end; ++i) one(i);
    }
  }
};

// topk: positions, then exact values.
class TopKCodec final : public FormatCodec {
 public:
  using FormatCodec::FormatCodec;
  void encode(const float* x, size_t n, uint64_t seed, std::vector<uint8_t>& out) const override {
    check_index_range(n);
    const size_t k = count(n);
    uint8_t* p = begin_encoding(n, seed, out);
    std::vector<uint32_t>& positions = scratch().positions;
    select_topk(x, n, k, positions);
    if (k > 0) std::memcpy(p, positions.data(), 4 * k);
    uint8_t* values = p + 4 * k;
    for (size_t j = 0; j < k; ++j) store<float>(values + 4 * j, x[positions[j]]);
  }
  void decode_add(const uint8_t* in, size_t bytes, size_t n, float* y) const override {
    check_encoding(in, bytes, n);
    const size_t k = count(n);
    const uint8_t* p = in + kHeaderBytes;
    check_positions(p, k, n);
    const uint8_t* values = p + 4 * k;
    for (size_t j = 0; j < k; ++j) y[load<uint32_t>(p + 4 * j)] += load<float>(values + 4 * j);
  }

 protected:
  size_t count(size_t n) const override { return codec_keep_count(n, params_.keep); }
  size_t payload_bytes(size_t k, size_t /*n*/) const override { return 8 * k; }
};

// quant2-topk: topk's positions (none when every value is kept), then per block of kept values two
// magnitudes lo <= hi and 2 bits per value: its sign and the nearer of lo and hi. The magnitudes
// are fitted to the block by 1-D 2-means on |v|: split at the mean |v|, take each side's mean,
// split again midway between them, a few rounds. The first split already does no worse than the
// best 1-bit code (mean |v| times the sign, sign1's), and each round can only lower the block's
// squared error; on Gaussian values it lands near the 4-level Lloyd-Max quantizer (0.45 and 1.51
// standard deviations), on topk's values (all far from zero) it spends both levels where they are.
class Quant2TopKCodec final : public FormatCodec {
 public:
  using FormatCodec::FormatCodec;
  void encode(const float* x, size_t n, uint64_t seed, std::vector<uint8_t>& out) const override {
    check_index_range(n);
    const size_t k = count(n);
    uint8_t* p = begin_encoding(n, seed, out);
    const float* v = x;
    if (k < n) {
      Scratch& s = scratch();
      select_topk(x, n, k, s.positions);
      if (k > 0) std::memcpy(p, s.positions.data(), 4 * k);
      s.values.resize(k);
      for (size_t j = 0; j < k; ++j) s.values[j] = x[s.positions[j]];
      v = s.values.data();
    }
    const size_t block = static_cast<size_t>(params_.block);
    uint8_t* levels = p + position_bytes(k, n);
    uint8_t* codes = levels + 8 * ceil_div(k, block);
    std::memset(codes, 0, ceil_div(k, 4));
    for (size_t b = 0, first = 0; first < k; ++b, first += block) {
      const size_t end = std::min(k, first + block);
      float lo, hi;
      fit_levels(v + first, end - first, lo, hi);
      store<float>(levels + 8 * b, lo);
      store<float>(levels + 8 * b + 4, hi);
      const float cut = lo + (hi - lo) * 0.5f;
      for (size_t j = first; j < end; ++j) {
        const uint32_t positive = v[j] >= 0.0f;
        const uint32_t high = std::fabs(v[j]) > cut;
        const uint32_t code = positive ? 2 + high : 1 - high;  // 0..3 = -hi, -lo, +lo, +hi
        codes[j >> 2] = static_cast<uint8_t>(codes[j >> 2] | (code << (2 * (j & 3))));
      }
    }
  }
  void decode_add(const uint8_t* in, size_t bytes, size_t n, float* y) const override {
    check_encoding(in, bytes, n);
    const size_t k = count(n);
    const uint8_t* p = in + kHeaderBytes;
    const bool dense = k == n;
    if (!dense) check_positions(p, k, n);
    const size_t block = static_cast<size_t>(params_.block);
    const uint8_t* levels = p + position_bytes(k, n);
    const uint8_t* codes = levels + 8 * ceil_div(k, block);
    for (size_t b = 0, first = 0; first < k; ++b, first += block) {
      const float lo = load<float>(levels + 8 * b), hi = load<float>(levels + 8 * b + 4);
      const float level[4] = {-hi, -lo, lo, hi};
      const size_t end = std::min(k, first + block);
      if (dense) {
        for (size_t j = first; j < end; ++j) y[j] += level[(codes[j >> 2] >> (2 * (j & 3))) & 3u];
      } else {
        for (size_t j = first; j < end; ++j) y[load<uint32_t>(p + 4 * j)] += level[(codes[j >> 2] >> (2 * (j & 3))) & 3u];
      }
    }
  }

 protected:
  size_t count(size_t n) const override { return codec_keep_count(n, params_.keep); }
  size_t payload_bytes(size_t k, size_t n) const override {
    return position_bytes(k, n) + 8 * ceil_div(k, static_cast<size_t>(params_.block)) + ceil_div(k, 4);
  }
  uint32_t header_block() const override { return static_cast<uint32_t>(params_.block); }

 private:
  static size_t position_bytes(size_t k, size_t n) { return k < n ? 4 * k : 0; }

  // lo <= hi for the values v[0..len), as described above the class. Sums run in a fixed order,
  // so the result is the same bytes everywhere.
  // Eight running sums per side, combined in a fixed tree (as sum_abs), so that the result is
  // the same bytes whether or not the compiler vectorizes; three rounds at most.
  static void fit_levels(const float* v, size_t len, float& lo, float& hi) {
    float cut = sum_abs(v, len) / static_cast<float>(len);
    float mlo = cut, mhi = cut;
    // GCC vector extensions: eight lanes in registers, the same arithmetic as eight scalar sums.
    typedef float v8f __attribute__((vector_size(32)));
    typedef int32_t v8i __attribute__((vector_size(32)));
    const v8i abs_mask = {0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF};
    const v8f zero = {}, one = zero + 1.0f;
    for (int round = 0; round < 3; ++round) {
      v8f lane_lo = {}, lane_hi = {}, lane_n = {};
      const v8f cutv = zero + cut;
      size_t j = 0;
      for (; j + 8 <= len; j += 8) {
        v8f x;
        std::memcpy(&x, v + j, sizeof x);
        const v8f a = reinterpret_cast<v8f>(reinterpret_cast<v8i>(x) & abs_mask);
        const v8i high = a > cutv;
        lane_hi += high ? a : zero;
        lane_lo += high ? zero : a;
        lane_n += high ? one : zero;
      }
      auto tree = [](const v8f& x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); };
      float sum_lo = tree(lane_lo), sum_hi = tree(lane_hi), n_hi = tree(lane_n);
      for (; j < len; ++j) {
        const float a = std::fabs(v[j]);
        const bool high = a > cut;
        sum_hi += high ? a : 0.0f;
        sum_lo += high ? 0.0f : a;
        n_hi += high ? 1.0f : 0.0f;
      }
      const float n_lo = static_cast<float>(len) - n_hi;
      if (n_hi == 0.0f || n_lo == 0.0f) break;  // all |v| equal: one level, both at the mean
      mlo = sum_lo / n_lo;
      mhi = sum_hi / n_hi;
      const float next = mlo + (mhi - mlo) * 0.5f;
      if (next == cut) break;
      cut = next;
    }
    lo = mlo;
    hi = mhi;
  }
};

// randk: values at the positions the header's seed draws, not rescaled by n/k (see codec.h).
class RandKCodec final : public FormatCodec {
 public:
  using FormatCodec::FormatCodec;
  void encode(const float* x, size_t n, uint64_t seed, std::vector<uint8_t>& out) const override {
    check_index_range(n);
    const size_t k = count(n);
    uint8_t* p = begin_encoding(n, seed, out);
    std::vector<uint32_t>& positions = scratch().positions;
    sample_positions(n, k, seed, positions);
    for (size_t j = 0; j < k; ++j) store<float>(p + 4 * j, x[positions[j]]);
  }
  void decode_add(const uint8_t* in, size_t bytes, size_t n, float* y) const override {
    const uint64_t seed = check_encoding(in, bytes, n);
    const size_t k = count(n);
    std::vector<uint32_t>& positions = scratch().positions;
    sample_positions(n, k, seed, positions);
    const uint8_t* p = in + kHeaderBytes;
    for (size_t j = 0; j < k; ++j) y[positions[j]] += load<float>(p + 4 * j);
  }

 protected:
  size_t count(size_t n) const override { return codec_keep_count(n, params_.keep); }
  size_t payload_bytes(size_t k, size_t /*n*/) const override { return 4 * k; }
  bool draws() const override { return true; }
};

}  // namespace

const char* codec_name(CodecKind kind) { return to_string(kind); }

CodecKind parse_codec(const std::string& name, const std::string& key) { return parse_enum<CodecKind>(name, key); }

size_t codec_keep_count(size_t n, double keep) {
  if (n == 0) return 0;
  const double k = std::ceil(keep * static_cast<double>(n));
  if (!(k >= 1.0)) return 1;
  return k >= static_cast<double>(n) ? n : static_cast<size_t>(k);
}

void sample_positions(size_t n, size_t k, uint64_t seed, std::vector<uint32_t>& positions) {
  if (k > n || n > UINT32_MAX)
    throw Error("sample_positions: k = " + std::to_string(k) + " of n = " + std::to_string(n) +
                " (need k <= n < 2^32)");
  positions.resize(k);
  if (k == n) {
    std::iota(positions.begin(), positions.end(), 0u);
    return;
  }
  // Floyd: for j = n - d .. n - 1, draw t in [0, j]; take t, or j if t is taken already. Every
  // d-subset is equally likely. Beyond half, draw the n - k positions to drop instead.
  const bool complement = k > n - k;
  const size_t draw = complement ? n - k : k;
  std::vector<uint64_t>& bitmap = scratch().bitmap;
  const size_t words = ceil_div(n, 64);
  bitmap.assign(words, 0);
  Rng rng(seed);
  for (size_t j = n - draw; j < n; ++j) {
    // below() multiplies a double in [0, 1) by j + 1; rounding may give j + 1 for large j.
    const size_t t = std::min<size_t>(rng.below(j + 1), j);
    const bool taken = (bitmap[t >> 6] >> (t & 63)) & 1u;
    const size_t pick = taken ? j : t;
    bitmap[pick >> 6] |= uint64_t{1} << (pick & 63);
  }
  uint32_t* out = positions.data();
  size_t m = 0;
  for (size_t w = 0; w < words; ++w) {
    uint64_t word = complement ? ~bitmap[w] : bitmap[w];
    if (w == words - 1 && n % 64 != 0) word &= (uint64_t{1} << (n % 64)) - 1;
    while (word != 0) {
      out[m++] = static_cast<uint32_t>(w * 64 + static_cast<size_t>(std::countr_zero(word)));
      word &= word - 1;
    }
  }
}

std::unique_ptr<Codec> Codec::make(const CodecParams& p) {
  check(static_cast<uint8_t>(p.kind) <= static_cast<uint8_t>(kLastKind),
        "gradient codec: unknown kind " + std::to_string(static_cast<int>(p.kind)));
  check(p.keep > 0.0 && p.keep <= 1.0, std::string("gradient codec ") + codec_name(p.kind) +
                                           ": keep = " + std::to_string(p.keep) + ", expected a fraction in (0, 1]");
  check(p.block >= 1, std::string("gradient codec ") + codec_name(p.kind) + ": block = " + std::to_string(p.block) +
                          ", expected at least 1");
  switch (p.kind) {
    case CodecKind::none:
      return std::make_unique<NoneCodec>(p);
    case CodecKind::fp16:
      return std::make_unique<HalfCodec<false>>(p);
    case CodecKind::bf16:
      return std::make_unique<HalfCodec<true>>(p);
    case CodecKind::sign1:
      return std::make_unique<Sign1Codec>(p);
    case CodecKind::quant2_topk:
      return std::make_unique<Quant2TopKCodec>(p);
    case CodecKind::topk:
      return std::make_unique<TopKCodec>(p);
    case CodecKind::randk:
      return std::make_unique<RandKCodec>(p);
  }
  throw Error("gradient codec: unknown kind");
}

void encode_with_feedback(const Codec& c, const float* x, float* residual, size_t n, uint64_t seed,
                          std::vector<uint8_t>& out, std::vector<float>& scratch) {
  scratch.resize(n);
  float* v = scratch.data();
  for (size_t i = 0; i < n; ++i) v[i] = x[i] + residual[i];
  c.encode(v, n, seed, out);
  std::fill(residual, residual + n, 0.0f);
  if (c.lossless()) return;
  c.decode_add(out.data(), out.size(), n, residual);
  for (size_t i = 0; i < n; ++i) residual[i] = v[i] - residual[i];
}

}  // namespace keel
